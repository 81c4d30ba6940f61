"""Training data: read examples (a table of formats), pack rows, shuffle resumable batches.

Formats (chosen by extension, one entry each in :data:`READERS`):

- ``.pkl``: a pickled list of examples (the ``data.pkl`` of PyTorch + LightSeq training
  scripts). Each example is a list / 1-D array of token ids, a dict with
  ``"input_ids"`` (and optional ``"labels"``), or a dict with ``"text"``. Unpickling
  runs code: load trusted files only.
- ``.jsonl``: one JSON object per line, ``{"input_ids": [...]}`` (optional ``"labels"``)
  or ``{"text": "..."}``. Blank lines are skipped; errors name the 1-based line number
  (blank lines counted, as an editor shows it). Other formats' errors name the 0-based
  index of the record.
- ``.npy``: an integer array ``[N, L]`` (N examples) or ``[L]`` (one token stream),
  memory-mapped while it is read.
- ``.parquet``: a column ``input_ids`` (optional ``labels``) or ``text`` (``pyarrow``,
  from the ``hf`` extra), read a batch of rows at a time.
- a directory written by HF ``datasets``' ``Dataset.save_to_disk`` (key
  ``save_to_disk``), with the same columns (the ``hf`` extra).

A token cache (:mod:`train.data_cache`) holds any of them tokenized once, for datasets
that should not be loaded whole into memory.

``"labels"`` follow the HuggingFace convention: aligned with ``input_ids`` (the model
shifts), ``-100`` = ignored. ``"text"`` is tokenized with a ``tokenizer.json`` (the file,
or the directory holding it, e.g. the model's; the ``tokenizers`` package, imported only
when text is present).

Row scheme (:meth:`TokenDataset.rows`): all examples are concatenated, in file order,
into one token stream (each followed by ``eos_id`` when one is given) and the stream is
cut into consecutive, non-overlapping rows of ``seq_len`` tokens; the tail that does not
fill a row is dropped. ``labels[t]`` is the label of the stream token *after*
``input_ids[t]``: already shifted, so ``labels[t]`` is the target of ``logits[t]``
(``models.loss`` convention). The last row's last label looks past the stream and is
``-100``. With ``mask_boundaries=True`` (default) a label whose token belongs to a
different example than ``input_ids[t]`` is ``-100``: nothing is learned across unrelated
documents, including at row ends when examples are exactly ``seq_len`` long. An
``eos_id`` separator belongs to the example before it, so predicting EOS is learned.

Batches (:class:`Batches`): per epoch the rows are permuted by a numpy Generator seeded
with ``(seed, epoch)``; batch ``i`` of the epoch is rows ``perm[i*G:(i+1)*G]`` for the
global batch size ``G``. Drop-last: the ``num_rows % G`` rows at the end of each epoch's
permutation are not used that epoch (a different set every epoch). The position
``(epoch, index)`` is the next batch to yield, so a run restarted from a saved position
sees exactly the batches of an uninterrupted run. In multi-host training process ``p``
of ``P`` gets the contiguous block ``[p*G/P, (p+1)*G/P)`` of every global batch.

Sample data (``python -m train.data sample``): sequences from a sparse random Markov
chain (see :func:`markov_samples`), so a tiny model's loss visibly falls.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import itertools
import json
import pickle
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from models.convert import special_token_ids
from models.loss import IGNORE_INDEX

_MAX_ID = np.iinfo(np.int32).max


# ---------------------------------------------------------------------------------------
# Datasets and loading
# ---------------------------------------------------------------------------------------


class Rows(NamedTuple):
    """Fixed-length training rows (see the module docstring for the scheme).

    Attributes:
        input_ids: int32 ``[num_rows, seq_len]``.
        labels: int32 ``[num_rows, seq_len]``; ``labels[r, t]`` is the target of
            ``input_ids[r, t]``'s logits, ``-100`` where ignored.
        segment_ids: int32 ``[num_rows, seq_len]``; which example each token comes from,
            numbered from 0 within the row (for document-masked attention).
    """

    input_ids: np.ndarray
    labels: np.ndarray
    segment_ids: np.ndarray

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    def take(self, ids: np.ndarray) -> Rows:
        """The rows ``ids`` (an int array), contiguous copies. :class:`Batches` and the
        evaluation read rows only through ``take``, ``num_rows`` and ``seq_len``, so a
        token cache's rows (``train.data_cache.CachedRows``) computed on demand serve too."""
        return Rows(*(np.ascontiguousarray(a[ids]) for a in self))


@dataclasses.dataclass(frozen=True)
class TokenDataset:
    """Examples of token ids, stored concatenated.

    Attributes:
        path: where the data came from (for error messages).
        tokens: int32 ``[num_tokens]``, all examples back to back.
        targets: int32 ``[num_tokens]``, the unshifted per-token labels: the token itself,
            or the example's ``"labels"`` (``-100`` = ignored).
        offsets: int64 ``[num_examples + 1]``; example ``i`` is
            ``tokens[offsets[i]:offsets[i + 1]]``.
        lines: int64 ``[num_examples]``, the 1-based line of each example in a
            ``.jsonl`` file (for error messages); None: examples are named by index.
    """

    path: str
    tokens: np.ndarray
    targets: np.ndarray
    offsets: np.ndarray
    lines: np.ndarray | None = None

    @classmethod
    def from_examples(
        cls,
        path: str,
        input_ids: Sequence[np.ndarray],
        labels: Sequence[np.ndarray | None] | None = None,
        lines: Sequence[int] | None = None,
    ) -> TokenDataset:
        """Builds a dataset from validated 1-D int arrays (``labels[i]`` None: the tokens;
        ``lines``: each example's 1-based line in a ``.jsonl`` file)."""
        if not input_ids:
            raise ValueError(f"{path}: the dataset has no examples")
        labels = labels if labels is not None else [None] * len(input_ids)
        targets = [ids if lab is None else lab for ids, lab in zip(input_ids, labels, strict=True)]
        lengths = np.array([len(ids) for ids in input_ids], dtype=np.int64)
        return cls(
            path=str(path),
            tokens=np.concatenate(input_ids).astype(np.int32),
            targets=np.concatenate(targets).astype(np.int32),
            offsets=np.concatenate([[0], np.cumsum(lengths)]),
            lines=None if lines is None else np.asarray(lines, dtype=np.int64),
        )

    @property
    def num_examples(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def lengths(self) -> np.ndarray:
        """int64 ``[num_examples]``: tokens per example."""
        return np.diff(self.offsets)

    def example(self, i: int) -> np.ndarray:
        """int32 ``[length_i]``: the tokens of example ``i``."""
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    def where(self, i: int) -> str:
        """Example ``i`` as an error message names it: ``line N`` or ``record i``."""
        return f"record {i}" if self.lines is None else f"line {int(self.lines[i])}"

    def check_vocab(self, vocab_size: int) -> None:
        """Raises ValueError naming file, record and id for a token or label ``>= vocab_size``."""
        for name, values in (("token id", self.tokens), ("label", self.targets)):
            bad = np.flatnonzero(values >= vocab_size)
            if bad.size:
                record = int(np.searchsorted(self.offsets, bad[0], side="right")) - 1
                raise ValueError(
                    f"{self.path}: {self.where(record)}: {name} {int(values[bad[0]])} is out of "
                    f"range for {vocab_size=}"
                )

    def summary(self) -> dict[str, int]:
        """Counts: examples, tokens, min/max example length, max token id."""
        return {
            "examples": self.num_examples,
            "tokens": self.num_tokens,
            "min_length": int(self.lengths.min()),
            "max_length": int(self.lengths.max()),
            "max_id": int(self.tokens.max()),
        }

    def rows(
        self, seq_len: int, *, eos_id: int | None = None, mask_boundaries: bool = True
    ) -> Rows:
        """Packs the examples into rows of ``seq_len`` tokens with shifted labels.

        Args:
            seq_len: tokens per row.
            eos_id: if given, appended after every example (as part of it) that does
                not already end with it.
            mask_boundaries: set labels that cross from one example into the next to -100.

        Returns:
            :class:`Rows`, ``[num_tokens // seq_len, seq_len]`` each (counting EOS tokens).
        """
        if seq_len < 1:
            raise ValueError(f"{seq_len=} must be positive")
        tokens, targets, docs = self._stream(eos_id)
        num_rows = len(tokens) // seq_len
        if num_rows == 0:
            raise ValueError(f"{self.path}: {len(tokens)} tokens do not fill one row of {seq_len=}")
        next_targets = np.append(targets[1:], np.int32(IGNORE_INDEX))
        if mask_boundaries:
            next_targets[:-1][docs[1:] != docs[:-1]] = IGNORE_INDEX
        shape = (num_rows, seq_len)
        used = num_rows * seq_len
        row_docs = docs[:used].reshape(shape)
        return Rows(
            input_ids=tokens[:used].reshape(shape),
            labels=next_targets[:used].reshape(shape),
            segment_ids=(row_docs - row_docs[:, :1]).astype(np.int32),
        )

    def _stream(self, eos_id: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(tokens, targets, example index)`` of the concatenated stream, int32 each;
        ``eos_id`` goes after every example that does not already end with it."""
        docs = np.repeat(np.arange(self.num_examples, dtype=np.int32), self.lengths)
        if eos_id is None:
            return self.tokens, self.targets, docs
        if not 0 <= eos_id <= _MAX_ID:
            raise ValueError(f"{eos_id=} must be a non-negative int32 token id")
        ends = self.offsets[1:]
        need = self.tokens[ends - 1] != eos_id
        ends, which = ends[need], np.flatnonzero(need).astype(np.int32)
        return (
            np.insert(self.tokens, ends, eos_id),
            np.insert(self.targets, ends, eos_id),
            np.insert(docs, ends, which),
        )


class Example(NamedTuple):
    """One example as a reader yields it: ``number`` (the 1-based line of a ``.jsonl``
    file, else the 0-based record index), int32 ``input_ids``, int32 ``labels`` or None
    (the tokens themselves)."""

    number: int
    input_ids: np.ndarray
    labels: np.ndarray | None


@dataclasses.dataclass(frozen=True)
class Reader:
    """One data format: ``read(path, parser)`` yields its :class:`Example` s in order;
    ``by_line``: errors and :attr:`TokenDataset.lines` name lines, not record indices."""

    read: Callable[[Path, RecordParser], Iterator[Example]]
    by_line: bool = False


def load_dataset(
    path: str | Path, *, tokenizer: str | Path | None = None, vocab_size: int | None = None
) -> TokenDataset:
    """Loads a dataset of any format in :data:`READERS` into memory (see the module
    docstring).

    Args:
        path: the data file (or ``save_to_disk`` directory).
        tokenizer: ``tokenizer.json`` or a directory holding it, needed for ``"text"``.
        vocab_size: if given, every token id and label must be below it.

    Raises:
        ValueError: malformed data, naming the file and record index; an empty dataset;
            ids out of range; an unknown format; a missing optional package.
    """
    path = Path(path)
    reader = READERS[data_format(path)]
    parser = RecordParser(path, tokenizer)
    examples = list(read_examples(path, parser))
    if not examples:
        raise ValueError(f"{path}: the dataset has no examples")
    dataset = TokenDataset.from_examples(
        str(path),
        [e.input_ids for e in examples],
        [e.labels for e in examples],
        lines=[e.number for e in examples] if reader.by_line else None,
    )
    if vocab_size is not None:
        dataset.check_vocab(vocab_size)
    return dataset


def read_examples(path: str | Path, parser: RecordParser) -> Iterator[Example]:
    """The examples of ``path`` in order, one at a time (its reader from :data:`READERS`)."""
    path = Path(path)
    suffix = data_format(path)
    if not path.exists():
        raise ValueError(f"{path}: no such data file")
    if suffix != SAVED_DATASET and not path.is_file():
        raise ValueError(f"{path}: not a file")
    return READERS[suffix].read(path, parser)


def records_reader(
    read: Callable[[Path], Iterator[tuple[int, Any]]], by_line: bool = False
) -> Callable[[Path, RecordParser], Iterator[Example]]:
    """A reader from a function yielding ``(number, record)``: records are parsed (ids,
    labels, or text tokenized, ``_CHUNK`` texts per ``encode_batch`` call) a chunk at a
    time, so the file is never all in memory as Python objects."""
    word = "line" if by_line else "record"

    def parse_all(path: Path, parser: RecordParser) -> Iterator[Example]:
        for chunk in itertools.batched(read(path), _CHUNK):
            wheres = [f"{word} {number}" for number, _ in chunk]
            texts = parser.tokenize_texts(wheres, [record for _, record in chunk])
            for where, (number, record), ids in zip(wheres, chunk, texts, strict=True):
                yield Example(number, *parser.parse(where, record, ids))

    return parse_all


_CHUNK = 512  # records parsed (and texts tokenized) together


def _read_pkl(path: Path) -> Iterator[tuple[int, Any]]:
    try:
        with open(path, "rb") as f:
            data = pickle.load(f)
    except Exception as e:  # noqa: BLE001 - any unpickling failure: name the file
        raise ValueError(f"{path}: not a readable pickle ({type(e).__name__}: {e})") from None
    if not isinstance(data, (list, tuple)):
        raise ValueError(f"{path}: expected a pickled list of examples, got {type(data).__name__}")
    return enumerate(data)


def _read_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """``(1-based line number, parsed object)`` for each non-blank line.

    A generator, read line by line: the caller turns each record into int32 arrays
    before the next is parsed, so the file's JSON (Python ints, ~9x the bytes of the
    arrays) is never all in memory at once.
    """
    with open(path, "rb") as f:
        for i, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}: line {i}: not UTF-8 text ({e})") from None
            if not line.strip():
                continue
            try:
                yield i, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {i}: invalid JSON ({e})") from None


def _read_npy(path: Path, parser: RecordParser) -> Iterator[Example]:
    """The rows of an ``[N, L]`` array (or the one ``[L]`` stream), memory-mapped."""
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise ValueError(f"{path}: not a readable .npy array of token ids ({e})") from None
    if array.ndim == 1:
        array = array[None]
    if array.ndim != 2 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(
            f"{path}: expected an integer array [N, L] or [L], got {array.dtype} {array.shape}"
        )
    if array.size == 0:
        raise ValueError(f"{path}: the dataset has no tokens, shape {array.shape}")
    for record in range(array.shape[0]):
        row = np.asarray(array[record])
        for name, bad in (("negative", row < 0), ("above int32", row > _MAX_ID)):
            if bad.any():
                value = int(row[np.argmax(bad)])
                raise ValueError(f"{path}: record {record}: {name} token id {value}")
        yield Example(record, row.astype(np.int32), None)


def _columns(path: Path, names: Sequence[str]) -> list[str]:
    """The columns a table's records are read from: ``input_ids`` (+ ``labels``) or ``text``."""
    if "input_ids" in names:
        return ["input_ids"] + (["labels"] if "labels" in names else [])
    if "text" in names:
        return ["text"]
    raise ValueError(f"{path}: expected a column 'input_ids' or 'text', got {list(names)}")


def _table_records(batches: Iterator[dict[str, list]]) -> Iterator[tuple[int, Any]]:
    """``(record index, {column: value})`` from column batches ``{column: [values]}``."""
    index = 0
    for batch in batches:
        names = list(batch)
        for values in zip(*(batch[n] for n in names), strict=True):
            yield index, dict(zip(names, values, strict=True))
            index += 1


def _optional(module: str, path: Path, extra: str = "hf"):
    """Imports an optional package, or names the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(
            f"{path}: reading it needs the {module.split('.')[0]!r} package: "
            f"pip install 'jflash[{extra}]'"
        ) from None


def _read_parquet(path: Path) -> Iterator[tuple[int, Any]]:
    pq = _optional("pyarrow.parquet", path)
    try:
        table = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow's errors vary: name the file
        raise ValueError(f"{path}: not a readable parquet file ({e})") from None
    columns = _columns(path, table.schema_arrow.names)
    batches = table.iter_batches(batch_size=1024, columns=columns)
    yield from _table_records(b.to_pydict() for b in batches)


def _read_saved_dataset(path: Path) -> Iterator[tuple[int, Any]]:
    datasets = _optional("datasets", path)
    try:
        dataset = datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - datasets' errors vary: name the directory
        raise ValueError(f"{path}: not a dataset saved with save_to_disk ({e})") from None
    if not isinstance(dataset, datasets.Dataset):
        splits = sorted(dataset)
        raise ValueError(
            f"{path}: holds the splits {splits}; pass one split's directory, e.g. "
            f"{path / splits[0]}"
        )
    columns = _columns(path, dataset.column_names)
    yield from _table_records(dataset.select_columns(columns).iter(batch_size=1024))


SAVED_DATASET = "save_to_disk"  # READERS' key for a directory saved by `datasets`
# The data formats: the file's lower-case extension (or SAVED_DATASET) -> its reader.
# A new format is one entry here (and its tests in tests/test_train_data.py).
READERS: dict[str, Reader] = {
    ".pkl": Reader(records_reader(_read_pkl)),
    ".jsonl": Reader(records_reader(_read_jsonl, by_line=True), by_line=True),
    ".npy": Reader(_read_npy),
    ".parquet": Reader(records_reader(_read_parquet)),
    SAVED_DATASET: Reader(records_reader(_read_saved_dataset)),
}
FORMATS = tuple(READERS)


class RecordParser:
    """Turns one record into ``(input_ids, labels or None)``; ``tokenizer``: a
    ``tokenizer.json`` or its directory, loaded at the first ``"text"`` record."""

    def __init__(self, path: Path, tokenizer: str | Path | None):
        self.path = path
        self.tokenizer = tokenizer
        self._tokenizer = None

    @property
    def used_tokenizer(self) -> bool:
        """Whether any record was text (so the tokenizer shaped the tokens)."""
        return self._tokenizer is not None

    def parse(
        self, where: str, record: Any, text_ids: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """``(input_ids, labels or None)``; ``text_ids``: the record's text, tokenized."""
        if not isinstance(record, dict):
            return self._ids(where, "input_ids", record), None
        if "input_ids" in record:
            ids = self._ids(where, "input_ids", record["input_ids"])
            labels = record.get("labels")
            return ids, None if labels is None else self._labels(where, labels, len(ids))
        if "text" in record:
            if text_ids is None:
                text_ids = self.tokenize_texts([where], [record])[0]
            return text_ids, None
        raise ValueError(
            f"{self.path}: {where}: expected key 'input_ids' or 'text', got {sorted(record)}"
        )

    def tokenize_texts(
        self, wheres: Sequence[str], records: Sequence[Any]
    ) -> list[np.ndarray | None]:
        """The token ids of each text record (one ``encode_batch`` call), None for the
        others; ValueError naming the first text that is not a str or gives no tokens."""
        texts = [
            (i, r["text"])
            for i, r in enumerate(records)
            if isinstance(r, dict) and "input_ids" not in r and "text" in r
        ]
        out: list[np.ndarray | None] = [None] * len(records)
        if not texts:
            return out
        for i, text in texts:
            if not isinstance(text, str):
                raise ValueError(
                    f"{self.path}: {wheres[i]}: 'text' must be a str, got {type(text)}"
                )
        tokenizer = self._get_tokenizer(wheres[texts[0][0]])
        encodings = tokenizer.encode_batch([text for _, text in texts])
        for (i, _), encoding in zip(texts, encodings, strict=True):
            if not encoding.ids:
                raise ValueError(f"{self.path}: {wheres[i]}: 'text' tokenizes to no tokens")
            out[i] = np.asarray(encoding.ids, dtype=np.int32)
        return out

    def _ids(self, where: str, key: str, value: Any, *, allow_ignore: bool = False) -> np.ndarray:
        prefix = f"{self.path}: {where}: {key!r}"
        if isinstance(value, (str, bytes, dict)) or np.isscalar(value):
            raise ValueError(f"{prefix} must be a list of ints, got {type(value).__name__}")
        try:
            array = np.asarray(value)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{prefix} must be a list of ints ({e})") from None
        if array.ndim != 1 or array.size == 0:
            raise ValueError(f"{prefix} must be a non-empty 1-D list of ints, shape {array.shape}")
        if not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"{prefix} must be a list of ints, got elements of {array.dtype}")
        ignored = (array == IGNORE_INDEX) if allow_ignore else np.zeros(array.shape, bool)
        for problem, bad in (
            ("is negative", (array < 0) & ~ignored),
            ("exceeds int32", array > _MAX_ID),
        ):
            if bad.any():
                pos = int(np.argmax(bad))
                raise ValueError(f"{prefix}: id {int(array[pos])} at position {pos} {problem}")
        return array.astype(np.int32)

    def _labels(self, where: str, value: Any, length: int) -> np.ndarray:
        labels = self._ids(where, "labels", value, allow_ignore=True)
        if len(labels) != length:
            raise ValueError(
                f"{self.path}: {where}: 'labels' has {len(labels)} entries, "
                f"'input_ids' has {length}"
            )
        return labels

    def _get_tokenizer(self, where: str):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(
                self.tokenizer, f"{self.path}: {where}: has 'text' but"
            )
        return self._tokenizer


def tokenizer_file(tokenizer: str | Path) -> Path:
    """The ``tokenizer.json`` that ``tokenizer`` names: the file, or the one in the directory."""
    path = Path(tokenizer)
    return path / "tokenizer.json" if path.is_dir() else path


def load_tokenizer(tokenizer: str | Path | None, where: str = "text data needs a tokenizer;"):
    """``tokenizers.Tokenizer`` from a ``tokenizer.json`` or its directory, with clear errors
    (``where`` starts each message)."""
    if tokenizer is None:
        raise ValueError(
            f"{where} no tokenizer was given; pass --tokenizer_name_or_path (a "
            "tokenizer.json or its directory) or a model directory that holds tokenizer.json"
        )
    file = tokenizer_file(tokenizer)
    if not file.is_file():
        raise ValueError(f"{where} {file} does not exist")
    try:
        import tokenizers
    except ImportError:
        raise ValueError(
            f"{where} the 'tokenizers' package is missing (pip install 'jflash[text]' or "
            "tokenizers); or pre-tokenize the data into 'input_ids'"
        ) from None
    try:
        return tokenizers.Tokenizer.from_file(str(file))
    except Exception as e:  # noqa: BLE001 - the Rust library's errors: name the file
        raise ValueError(f"{where} {file} is not a readable tokenizer ({e})") from None


END_OF_TEXT = "<|endoftext|>"


def train_tokenizer(
    files: Sequence[str | Path], out: str | Path, *, vocab_size: int = 4096
) -> Path:
    """Trains a byte-level BPE (the ``tokenizers`` package, GPT-2's scheme) on text files
    (each file one document; a ``.jsonl`` file's records' ``"text"``, in order) and
    writes ``out/tokenizer.json`` with a ``tokenizer_config.json`` and
    ``special_tokens_map.json`` naming ``<|endoftext|>`` (id 0) as its BOS and EOS.
    Deterministic for the same files in the same order."""
    if vocab_size < 257:
        raise ValueError(f"--vocab-size={vocab_size} must be at least 257 (256 bytes + EOS)")
    missing = [str(f) for f in files if not Path(f).is_file()]
    if missing:
        raise ValueError(f"no such text files: {missing}")
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise ValueError(
            "training a tokenizer needs the 'tokenizers' package: pip install 'jflash[text]'"
        ) from None

    def texts() -> Iterator[str]:
        for f in files:
            if Path(f).suffix.lower() == ".jsonl":
                for _, record in _read_jsonl(Path(f)):
                    if isinstance(record, dict) and isinstance(record.get("text"), str):
                        yield record["text"]
            else:
                yield Path(f).read_text(encoding="utf-8", errors="replace")

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts(), trainer)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    special = {"bos_token": END_OF_TEXT, "eos_token": END_OF_TEXT}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return out / "tokenizer.json"


def tokenizer_eos_id(tokenizer: str | Path) -> int | None:
    """The id of the tokenizer's ``eos_token`` (named in ``tokenizer_config.json`` or
    ``special_tokens_map.json`` beside its ``tokenizer.json``); None where none is named.
    Reads the JSON files only (no ``tokenizers`` package needed)."""
    return special_token_ids(tokenizer_file(tokenizer)).get("eos_token")


# ---------------------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------------------


def document_positions(segment_ids: np.ndarray) -> np.ndarray:
    """int32 ``[..., T]``: each token's position inside its document (0 at every change
    of segment id along the last axis, and at the row's start), as HF's ``position_ids``
    of a packed batch."""
    seg = np.asarray(segment_ids)
    t = np.arange(seg.shape[-1], dtype=np.int32)
    change = np.ones(seg.shape, dtype=bool)
    change[..., 1:] = seg[..., 1:] != seg[..., :-1]
    starts = np.maximum.accumulate(np.where(change, t, 0), axis=-1)
    return (t - starts).astype(np.int32)


class Batch(NamedTuple):
    """One (process-local share of a) global batch, int32 ``[batch, seq_len]`` each."""

    input_ids: np.ndarray
    labels: np.ndarray
    segment_ids: np.ndarray


class Batches:
    """Deterministic, resumable, multi-epoch iterator of shuffled batches of rows.

    Args:
        rows: the packed rows (:class:`Rows`, or a token cache's ``CachedRows``).
        global_batch_size: rows per global batch, over all processes.
        seed: shuffle seed; epoch ``e`` uses ``np.random.default_rng([seed, e])``.
        shuffle: if False, rows keep their order every epoch.
        start: position to start from, ``state()`` of an earlier instance.
        start_step: alternatively, the number of batches already consumed.
        num_epochs: stop after this many epochs; None iterates forever.
        process_index: this process (host) in multi-host training.
        process_count: number of processes; each yields ``global_batch_size //
            process_count`` rows, a contiguous block of every global batch.
    """

    def __init__(
        self,
        rows: Rows,
        global_batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        start: dict[str, int] | None = None,
        start_step: int | None = None,
        num_epochs: int | None = None,
        process_index: int = 0,
        process_count: int = 1,
    ):
        if global_batch_size < 1:
            raise ValueError(f"{global_batch_size=} must be positive")
        if global_batch_size > rows.num_rows:
            raise ValueError(
                f"{global_batch_size=} exceeds the {rows.num_rows} rows of the dataset; "
                "add data or reduce the batch size / sequence length"
            )
        if not 0 <= process_index < process_count:
            raise ValueError(f"{process_index=} must be in [0, {process_count=})")
        if global_batch_size % process_count:
            raise ValueError(f"{global_batch_size=} must be divisible by {process_count=}")
        if start is not None and start_step is not None:
            raise ValueError("give either start or start_step, not both")
        self.rows = rows
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.num_epochs = num_epochs
        self.local_batch_size = global_batch_size // process_count
        self._local_start = process_index * self.local_batch_size
        self._perm_epoch, self._perm = -1, np.arange(0)
        if start is not None:
            self._step = self._step_of(start)
        else:
            self._step = start_step or 0
        if self._step < 0:
            raise ValueError(f"start step {self._step} must be non-negative")

    @property
    def steps_per_epoch(self) -> int:
        """Full global batches per epoch (drop-last)."""
        return self.rows.num_rows // self.global_batch_size

    @property
    def step(self) -> int:
        """Global batches consumed so far (the index of the next batch)."""
        return self._step

    def state(self) -> dict[str, int]:
        """Position of the next batch: ``{"epoch": e, "index": i}`` (i-th batch of epoch e)."""
        epoch, index = divmod(self._step, self.steps_per_epoch)
        return {"epoch": epoch, "index": index}

    def batch_at(self, step: int) -> Batch:
        """This process's share of global batch ``step`` (counted over all epochs)."""
        epoch, index = divmod(step, self.steps_per_epoch)
        begin = index * self.global_batch_size + self._local_start
        ids = self._permutation(epoch)[begin : begin + self.local_batch_size]
        return Batch(*self.rows.take(ids))

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        if self.num_epochs is not None and self._step >= self.num_epochs * self.steps_per_epoch:
            raise StopIteration
        batch = self.batch_at(self._step)
        self._step += 1
        return batch

    def _step_of(self, state: dict[str, int]) -> int:
        if set(state) != {"epoch", "index"}:
            raise ValueError(f"data position must have keys 'epoch' and 'index', got {state}")
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index < self.steps_per_epoch:
            raise ValueError(
                f"data position {state} does not fit {self.steps_per_epoch} steps per epoch "
                "(did the data, sequence length or batch size change?)"
            )
        return epoch * self.steps_per_epoch + index

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            n = self.rows.num_rows
            rng = np.random.default_rng([self.seed, epoch])
            self._perm = rng.permutation(n) if self.shuffle else np.arange(n)
            self._perm_epoch = epoch
        return self._perm


# ---------------------------------------------------------------------------------------
# Sample data and the CLI
# ---------------------------------------------------------------------------------------


def markov_samples(
    num_samples: int,
    seq_len: int,
    vocab_size: int,
    seed: int = 0,
    *,
    num_states: int = 256,
    branching: int = 4,
) -> np.ndarray:
    """Learnable sample sequences from a sparse random Markov chain.

    ``num_states`` distinct token ids are drawn from the vocabulary; each has
    ``branching`` possible successors (among those states) with Dirichlet-random
    probabilities. A model first learns which tokens occur (loss falls from
    ``ln(vocab_size)`` towards ``ln(num_states)``), then the transitions (towards the
    chain's entropy rate, at most ``ln(branching)``).

    Returns:
        int32 ``[num_samples, seq_len]``.
    """
    for name, value in (("num_samples", num_samples), ("seq_len", seq_len)):
        if value < 1:
            raise ValueError(f"{name}={value} must be positive")
    num_states = min(num_states, vocab_size)
    if num_states < 1 or not 1 <= branching <= num_states:
        raise ValueError(f"need 1 <= {branching=} <= {num_states=} <= {vocab_size=}")
    rng = np.random.default_rng(seed)
    state_ids = rng.choice(vocab_size, size=num_states, replace=False).astype(np.int32)
    successors = np.stack(
        [rng.choice(num_states, size=branching, replace=False) for _ in range(num_states)]
    )
    cumulative = np.cumsum(rng.dirichlet(np.ones(branching), size=num_states), axis=1)
    states = np.empty((num_samples, seq_len), dtype=np.int64)
    states[:, 0] = rng.integers(num_states, size=num_samples)
    for t in range(1, seq_len):
        u = rng.random(num_samples)[:, None]
        prev = states[:, t - 1]
        choice = np.minimum((u > cumulative[prev]).sum(axis=1), branching - 1)
        states[:, t] = successors[prev, choice]
    return state_ids[states]


def data_format(path: str | Path) -> str:
    """The key of ``path``'s reader in :data:`READERS`: a directory's is ``save_to_disk``,
    a file's its lower-case extension; ValueError for an extension no reader has."""
    path = Path(path)
    if path.is_dir():
        return SAVED_DATASET
    suffix = path.suffix.lower()
    if suffix not in READERS:
        known = ", ".join(k for k in READERS if k != SAVED_DATASET)
        raise ValueError(
            f"{path}: unknown data format {suffix!r}; expected a file ending in {known}, a "
            "directory saved with datasets' save_to_disk, or a token cache directory"
        )
    return suffix


def _write_pkl(path: Path, examples) -> None:
    with open(path, "wb") as f:
        pickle.dump([{"input_ids": np.asarray(e).tolist()} for e in examples], f)


def _write_jsonl(path: Path, examples) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for e in examples:
            f.write(json.dumps({"input_ids": np.asarray(e).tolist()}) + "\n")


# The formats save_dataset writes (extension -> writer).
WRITERS: dict[str, Callable[[Path, Any], None]] = {
    ".pkl": _write_pkl,
    ".jsonl": _write_jsonl,
    ".npy": lambda path, examples: np.save(path, np.asarray(examples, dtype=np.int32)),
}


def save_dataset(path: str | Path, examples: np.ndarray | Sequence[np.ndarray]) -> None:
    """Writes examples (``[N, L]`` or a list of 1-D int arrays) by extension.

    ``.pkl``: a list of ``{"input_ids": [...]}`` dicts; ``.jsonl``: one such object per
    line; ``.npy``: an int32 ``[N, L]`` array (examples must have equal lengths).
    """
    path = Path(path)
    writer_of(path)(path, examples)


def writer_of(path: str | Path) -> Callable[[Path, Any], None]:
    """The writer of ``path``'s extension in :data:`WRITERS`; ValueError for others."""
    suffix = Path(path).suffix.lower()
    if suffix not in WRITERS:
        raise ValueError(f"{path}: cannot write {suffix!r} data; write one of {tuple(WRITERS)}")
    return WRITERS[suffix]


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m train.data sample | inspect | cache | tokenizer``."""
    parser = argparse.ArgumentParser(
        prog="python -m train.data", description=__doc__.split("\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    sample = commands.add_parser("sample", help="write learnable Markov-chain sample data")
    sample.add_argument("--out", required=True, help="output file: .pkl, .jsonl or .npy")
    sample.add_argument("--num-samples", type=int, default=512)
    sample.add_argument("--seq-len", type=int, default=1024, help="tokens per example")
    sample.add_argument("--vocab-size", type=int, default=32000)
    sample.add_argument("--seed", type=int, default=0)
    sample.add_argument("--num-states", type=int, default=256, help="distinct tokens used")
    sample.add_argument("--branching", type=int, default=4, help="successors per token")
    inspect = commands.add_parser("inspect", help="print counts of a dataset or token cache")
    inspect.add_argument("path")
    inspect.add_argument(
        "--tokenizer", default=None, help="tokenizer.json or its directory, for 'text' records"
    )
    inspect.add_argument("--vocab-size", type=int, default=None, help="also check id range")
    cache = commands.add_parser(
        "cache", help="tokenize a dataset once into a memory-mapped token cache directory"
    )
    cache.add_argument("input", help="a data file or save_to_disk directory (any format)")
    cache.add_argument("cache_dir", help="the cache directory to write (kept if up to date)")
    cache.add_argument(
        "--tokenizer", default=None, help="tokenizer.json or its directory, for 'text' records"
    )
    cache.add_argument(
        "--eos-id",
        type=int,
        default=None,
        help="token appended after each document (default: the tokenizer's eos_token)",
    )
    cache.add_argument("--no-eos", action="store_true", help="no token between documents")
    cache.add_argument("--vocab-size", type=int, default=None, help="also check id range")
    tok = commands.add_parser(
        "tokenizer", help="train a byte-level BPE tokenizer (the tokenizers package) on text"
    )
    tok.add_argument("files", nargs="+", help="UTF-8 text files, or .jsonl files of 'text'")
    tok.add_argument("--out", required=True, help="directory for tokenizer.json and its config")
    tok.add_argument("--vocab-size", type=int, default=4096)
    args = parser.parse_args(argv)
    try:
        _command(args)
    except ValueError as e:
        parser.exit(2, f"error: {e}\n")


def _command(args: argparse.Namespace) -> None:
    from train import data_cache

    if args.command == "sample":
        writer_of(args.out)  # before making the samples
        examples = markov_samples(
            args.num_samples,
            args.seq_len,
            args.vocab_size,
            args.seed,
            num_states=args.num_states,
            branching=args.branching,
        )
        save_dataset(args.out, examples)
        print(f"wrote {args.out}: {args.num_samples} examples x {args.seq_len} tokens")
    elif args.command == "inspect":
        if data_cache.is_cache(args.path):
            summary = data_cache.open_cache(args.path, vocab_size=args.vocab_size).summary()
        else:
            summary = load_dataset(
                args.path, tokenizer=args.tokenizer, vocab_size=args.vocab_size
            ).summary()
        for key, value in summary.items():
            print(f"{key}: {value}")
    elif args.command == "cache":
        if args.no_eos and args.eos_id is not None:
            raise ValueError("give --eos-id or --no-eos, not both")
        eos_id = args.eos_id
        if eos_id is None and not args.no_eos and args.tokenizer is not None:
            eos_id = tokenizer_eos_id(args.tokenizer)
        cache, built = data_cache.ensure_cache(
            args.input,
            args.cache_dir,
            tokenizer=args.tokenizer,
            eos_id=eos_id,
            vocab_size=args.vocab_size,
        )
        s = cache.summary()
        print(
            f"{'wrote' if built else 'up to date:'} {args.cache_dir}: {s['examples']} documents, "
            f"{s['tokens']} tokens (eos_id={cache.eos_id})"
        )
    else:
        file = train_tokenizer(args.files, args.out, vocab_size=args.vocab_size)
        print(f"wrote {file}: vocab_size={args.vocab_size}")


if __name__ == "__main__":
    main()
