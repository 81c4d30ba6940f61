"""Training data from rows to batches, sample data, and ``python -m train.data``.

The pipeline's modules, each importing only those before it: :mod:`train.chat` (chat
templates, for conversational records), :mod:`train.records` (records into token ids),
:mod:`train.patterns` (glob patterns), :mod:`train.readers` (the table of file formats,
each read into examples of token ids), :mod:`train.dataset` (examples in memory, packed
into rows), :mod:`train.data_cache` (examples tokenized once into a memory-mapped token
cache, its rows cut on demand), and this one: shuffled,
resumable batches of either's rows, learnable sample data, writing datasets, training a
BPE tokenizer, and the command line (``sample | inspect | cache | tokenizer``).

Batches (:class:`Batches`): per epoch the rows are permuted by a numpy Generator seeded
with ``(seed, epoch)``; batch ``i`` of the epoch is rows ``perm[i*G:(i+1)*G]`` for the
global batch size ``G``. Where ``G`` does not divide the rows, the epoch's last batch
holds its ``num_rows % G`` rows and is filled up with rows of nothing to learn (token 0,
labels -100), as HF's dataloader keeps its partial last batch; with ``drop_last`` the
last ``num_rows % M`` rows of the permutation are not used that epoch (a different set
every epoch), ``M`` the micro-batch (``G`` over the gradient accumulation steps), as
HF's dataloader drops its partial last micro-batch; the last batch is then filled up as
above where its micro-batches do not fill it. The position
``(epoch, index)`` is the next batch to yield, so a run restarted from a saved position
sees exactly the batches of an uninterrupted run. In multi-host training process ``p``
of ``P`` gets the contiguous block ``[p*G/P, (p+1)*G/P)`` of every global batch.

Sample data (``python -m train.data sample``): sequences from a sparse random Markov
chain (see :func:`markov_samples`), so a tiny model's loss visibly falls.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pickle
import sys
import unicodedata
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from models.convert import special_token_ids, tokenizer_vocab_size
from models.loss import IGNORE_INDEX
from train import data_cache, patterns
from train.chat import (
    AUTO,
    CHAT_TEMPLATE_FILE,
    CHAT_TURNS,
    DEFAULT,
    check_template_path,
    parse_template_kwargs,
)
from train.dataset import Rows, summarize_dataset
from train.errors import disk_error, disk_words, until_stopped
from train.readers import (
    SAVED_DATASET_FILES,
    each_real_file_once,
    file_format,
    is_pattern,
    is_token_cache,
    open_data,
    read_jsonl,
    walk_folder,
)
from train.records import (
    MESSAGES,
    PROMPT_COMPLETION,
    ChatTurnsError,
    NoTokenizerError,
    load_tokenizer,
    not_unicode,
    record_kind,
    tokenizer_file,
)
from train.run_files import is_run_output
from train.words import plural

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
        drop_last: drop each epoch's last micro-batch where the rows do not fill it
            (HF's `dataloader_drop_last`), instead of filling it up with rows of nothing
            to learn.
        micro_batch_size: rows per micro-batch, over all processes: the global batch
            over the gradient accumulation steps (default: the global batch). A batch
            of partial micro-batches is filled up as without ``drop_last``.
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
        drop_last: bool = False,
        micro_batch_size: int | None = None,
    ):
        if global_batch_size < 1:
            raise ValueError(f"{global_batch_size=} must be positive")
        micro_batch_size = micro_batch_size or global_batch_size
        if global_batch_size % micro_batch_size:
            raise ValueError(f"{micro_batch_size=} must divide {global_batch_size=}")
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
        self.drop_last = drop_last
        self.micro_batch_size = micro_batch_size
        self.process_count = process_count
        self.process_index = process_index
        # The rows an epoch uses: all, or the whole micro-batches' (drop_last).
        n = rows.num_rows
        self.rows_per_epoch = n - n % micro_batch_size if drop_last else n
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
        """Global batches per epoch: every row once, the last batch filled up with rows of
        nothing to learn where the rows do not divide into batches (HF's
        `dataloader_drop_last=False`: a step's loss is per labelled token, so the filled
        step's update is that of its real rows, as HF's partial last batch's); with
        `drop_last`, the whole micro-batches' rows only."""
        return -(-self.rows_per_epoch // self.global_batch_size)

    def starting_at(self, state: dict[str, int]) -> Batches:
        """These batches (the same rows and settings), from the position `state`."""
        return Batches(
            self.rows,
            self.global_batch_size,
            seed=self.seed,
            shuffle=self.shuffle,
            start=state,
            num_epochs=self.num_epochs,
            process_index=self.process_index,
            process_count=self.process_count,
            drop_last=self.drop_last,
            micro_batch_size=self.micro_batch_size,
        )

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
        ids = self._permutation(epoch)[: self.rows_per_epoch][begin : begin + self.local_batch_size]
        rows = self.rows.take(ids)
        if len(ids) < self.local_batch_size:  # the epoch's last batch: filled up
            rows = filled_rows(rows, self.local_batch_size - len(ids))
        return Batch(*rows)

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


def filled_rows(rows: Rows, count: int) -> Rows:
    """`rows` and `count` rows of nothing to learn after them: token 0, labels -100, one
    segment each."""
    shape = (count, rows.input_ids.shape[1])
    fill = (np.zeros(shape, np.int32), np.full(shape, IGNORE_INDEX, np.int32))
    return Rows(
        np.concatenate([rows.input_ids, fill[0]]),
        np.concatenate([rows.labels, fill[1]]),
        np.concatenate([rows.segment_ids, fill[0]]),
    )


# ---------------------------------------------------------------------------------------
# Sample data and writing datasets
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


def document_lengths(num_samples: int, mean: int, seed: int = 0) -> np.ndarray:
    """``num_samples`` lengths of a long-tailed document distribution: log-normal with
    sigma 1 and mean ``mean``, each in ``[1, 16 * mean]``. int64 ``[num_samples]``."""
    if num_samples < 1 or mean < 1:
        raise ValueError(f"{num_samples=} and {mean=} must be positive")
    sigma = 1.0
    rng = np.random.default_rng([seed, 1])  # not the Markov chain's stream
    draws = rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, size=num_samples)
    return np.clip(np.rint(draws), 1, 16 * mean).astype(np.int64)


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
    line; ``.npy``: an int32 ``[N, L]`` array (examples must have equal lengths). A file
    at ``path`` is replaced once the new one is whole.
    """
    path = Path(path)
    writer = writer_of(path)
    # Written whole beside it, then renamed: a write that fails (a full disk) leaves the
    # file that was there as it was. The temporary name keeps the extension (np.save
    # would add one).
    part = path.with_name(f".{path.stem}.part{path.suffix}")
    try:
        writer(part, examples)
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)


def writer_of(path: str | Path) -> Callable[[Path, Any], None]:
    """The writer of ``path``'s extension in :data:`WRITERS`; ValueError for others."""
    suffix = Path(path).suffix.lower()
    if suffix not in WRITERS:
        raise ValueError(f"{path}: cannot write {suffix!r} data; write one of {tuple(WRITERS)}")
    return WRITERS[suffix]


# ---------------------------------------------------------------------------------------
# Tokenizer training
# ---------------------------------------------------------------------------------------


END_OF_TEXT = "<|endoftext|>"
# What `train_tokenizer` writes into its directory (the chat template where given).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    CHAT_TEMPLATE_FILE,
)


def text_files(path: str | Path) -> list[Path]:
    """The files a tokenizer learns from for one argument: a text file; a folder's or a
    glob pattern's text files (:func:`text_files_of`), sorted. ValueError where there is
    none."""
    return text_files_of(path)[0]


# The bytes of a file's start that tell text from binary (a NUL byte among them).
TEXT_PROBE_BYTES = 8192


def text_files_of(path: str | Path, out: str | Path | None = None) -> tuple[list[Path], list[Path]]:
    """``(text files, files left out)`` of one argument of :func:`train_tokenizer`: a
    text file; a folder's files at any depth, or a pattern's, leaving out hidden ones,
    those under ``out`` (the tokenizer's own folder), those in a token cache's folder or
    a training run's output directory, data files of a binary format (``.npy``,
    ``.pkl``, ``.parquet``) and any other file with a NUL byte in its first 8 KiB
    (decompressed: ``.txt.gz`` is text). ValueError where no text file is left, for a
    binary file named, and for a token cache, a run's output directory or a
    ``save_to_disk`` folder (no text files)."""
    if Path(path).is_file():
        if not _is_text(Path(path)):
            raise ValueError(
                f"{path}: not a text file (binary, or a {Path(path).suffix} data file); "
                "a tokenizer learns from text and .jsonl records"
            )
        return [Path(path)], []
    if Path(path).is_dir() and (
        is_token_cache(path)
        or is_run_output(path)
        or any((Path(path) / n).is_file() for n in SAVED_DATASET_FILES)
    ):
        what = (
            "a token cache"
            if is_token_cache(path)
            else "a training run's output directory"
            if is_run_output(path)
            else "a dataset saved with save_to_disk"
        )
        raise ValueError(
            f"{path}: {what}, not a folder of text files; write its texts as .jsonl "
            "records to learn a tokenizer from them"
        )
    own = os.path.realpath(out) if out is not None else None
    if is_pattern(path):
        named = [Path(p) for p in patterns.expand(str(path))]
        found = [p for p in named if p.is_file()]
    elif Path(path).is_dir():
        found = sorted(p for p in walk_folder(path)[0] if p.is_file())
    else:
        found = []
    if not found:
        raise ValueError(f"{path}: no such text file (nor a folder or pattern of them)")
    if own is not None:  # an earlier tokenizer written there is not text to learn from
        found = [f for f in found if not os.path.realpath(f).startswith(own + os.sep)]
    kept, left = [], []
    for file in found:
        (kept if _is_text(file) else left).append(file)
    if not kept:
        what = plural(len(left), "binary or data file")
        raise ValueError(f"{path}: no text file in this folder or pattern ({what} left out)")
    return kept, left


def _is_text(file: Path) -> bool:
    """Whether a file found in a folder or by a pattern is text to learn from."""
    if any(is_token_cache(folder) or is_run_output(folder) for folder in file.parents):
        return False
    if file_format(file) not in (None, ".jsonl"):  # .npy, .pkl, .parquet, ...
        return False
    try:
        with open_data(file) as f:
            return b"\0" not in f.read(TEXT_PROBE_BYTES)
    except (ValueError, OSError, EOFError):
        return False


def train_tokenizer(
    files: Sequence[str | Path],
    out: str | Path,
    *,
    vocab_size: int = 4096,
    special_tokens: Sequence[str] = (),
    chat_template: str | Path | None = None,
) -> Path:
    """Trains a byte-level BPE (the ``tokenizers`` package, GPT-2's scheme) on text files
    (each file one document; a ``.jsonl`` file's records' ``"text"``, ``"prompt"`` and
    ``"completion"``, or ``"messages"``' contents, each one, in order) and writes
    ``out/tokenizer.json`` with a ``tokenizer_config.json`` and
    ``special_tokens_map.json`` naming ``<|endoftext|>`` (id 0) as its BOS and EOS.
    ``special_tokens`` (e.g. a chat template's ``<|eot_id|>``) get ids 1, 2, ... and are
    never split; ``chat_template``, a Jinja file, is copied to
    ``out/chat_template.jinja``, where transformers and :mod:`train.chat` find it (and
    without one, a ``chat_template.jinja`` already in ``out`` is removed). A folder or
    a glob pattern gives its files (:func:`text_files`). Deterministic for the same
    files in the same order."""
    extra = list(dict.fromkeys(t for t in special_tokens if t != END_OF_TEXT))
    if any(not t or t != t.strip() for t in extra):
        raise ValueError(
            f"--special-tokens {extra}: each must be a non-empty string without spaces around it"
        )
    if vocab_size < 257 + len(extra):
        raise ValueError(
            f"--vocab-size={vocab_size} must be at least {257 + len(extra)} (256 bytes + EOS"
            + (f" + {len(extra)} special tokens)" if extra else ")")
        )
    found = [text_files_of(given, out) for given in files]
    # Each real file once: a link to one, a folder and a file in it, a pattern's
    # matches through linked folders (each would weigh its text twice).
    files = each_real_file_once([f for kept, _ in found for f in kept])
    left = [f for _, others in found for f in others]
    if left:
        names = ", ".join(str(f) for f in left[:3]) + ", ..." * (len(left) > 3)
        print(f"tokenizer: left out {plural(len(left), 'binary or data file')}: {names}")
    template = None
    if chat_template is not None:  # read and compiled as the trainer will, before training
        path = Path(chat_template)
        if path.is_dir():
            raise ValueError(
                f"--chat-template={str(chat_template)!r}: a directory; give the Jinja file "
                "the tokenizer is to carry"
            )
        template = check_template_path(path, "--chat-template")[DEFAULT]
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise ValueError(
            "training a tokenizer needs the 'tokenizers' package: pip install 'jflash[text]'"
        ) from None

    characters = 0  # of the texts read: none leaves nothing to learn

    def texts() -> Iterator[str]:
        nonlocal characters
        for f in files:
            if file_format(Path(f)) == ".jsonl":  # compressed too
                for i, record in read_jsonl(Path(f)):
                    for text in _record_texts(record, f"{f}: line {i}"):
                        if problem := not_unicode(text):
                            raise ValueError(f"{f}: line {i}: a text {problem}")
                        characters += len(text)
                        yield text
            else:  # text, decompressed where its name says (`.txt.gz`)
                text = _file_text(Path(f))
                characters += len(text)
                yield text

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out={str(out)!r} is a file, not a directory")
    made = not out.exists()  # removed again where the training fails
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file above it, no permission
        raise ValueError(f"--out={str(out)!r} cannot be created ({e.strerror})") from None
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT, *extra],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    try:
        tokenizer.train_from_iterator(texts(), trainer)
        if not characters:
            shown = ", ".join(map(str, files[:3])) + (", ..." if len(files) > 3 else "")
            raise ValueError(f"{shown}: no text to learn a tokenizer from (nothing was written)")
    except BaseException:
        if made and not any(out.iterdir()):
            out.rmdir()
        raise
    tokenizer.save(str(out / "tokenizer.json"))
    special = {"bos_token": END_OF_TEXT, "eos_token": END_OF_TEXT}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    if template is not None:
        (out / CHAT_TEMPLATE_FILE).write_text(template, encoding="utf-8")
    else:  # an earlier tokenizer's template there would pair with this one
        (out / CHAT_TEMPLATE_FILE).unlink(missing_ok=True)
    return out / "tokenizer.json"


def _file_text(path: Path) -> str:
    """A text file's text (decompressed where its name says), UTF-8 with a byte order
    mark at its start dropped; ValueError naming the file and byte where it is not
    UTF-8 (a tokenizer learning replacement characters for it would learn no text)."""
    with open_data(path) as f:
        data = f.read()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path}: byte {e.start} is not UTF-8 ({e.reason}): the tokenizer learns from "
            "UTF-8 text; convert the file (e.g. iconv -f latin1 -t utf-8)"
        ) from None


def _record_texts(record: Any, where: str) -> Iterator[str]:
    """The strings a tokenizer learns from a record: its ``"text"``, else its messages'
    contents (a str, or the texts of a list of parts) where it is read by them, else its
    ``"prompt"`` and ``"completion"``. ValueError naming `where` (``file: line N``) for a
    record the trainer would not read as text: token ids, no text key, a ``"text"``,
    ``"prompt"`` or ``"completion"`` that is not a str (or, for the last two, a list of
    messages), as the trainer refuses them, so no record is skipped unsaid."""
    kind = record_kind(record) if isinstance(record, dict) else "input_ids"
    if kind == "input_ids":
        raise ValueError(f"{where}: token ids, no text to learn a tokenizer from")
    if kind is None:
        raise ValueError(
            f"{where}: expected key 'text' or 'messages', or keys 'prompt' and "
            f"'completion', got {sorted(record)}"
        )
    if kind == MESSAGES:
        messages = record[MESSAGES]
        if not isinstance(messages, list):
            raise ValueError(f"{where}: 'messages' must be a list, got {type(messages).__name__}")
        yield from (v for v in _contents(messages) if isinstance(v, str))
        return
    for key in ["text"] if kind == "text" else PROMPT_COMPLETION:
        if key not in record:
            raise ValueError(f"{where}: has 'prompt' or 'completion' but not {key!r}")
        value = record[key]
        if kind != "text" and isinstance(value, list):  # messages: TRL's conversational form
            yield from (v for v in _contents(value) if isinstance(v, str))
        elif isinstance(value, str):
            yield value
        else:
            raise ValueError(f"{where}: {key!r} must be a str, got {type(value).__name__}")


def _contents(messages: list) -> list:
    """The contents of a list of messages: each a str, or the texts of a list of parts."""
    values = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        parts = content if isinstance(content, list) else [{"text": content}]
        values += [p.get("text") for p in parts if isinstance(p, dict)]
    return values


def tokenizer_eos_id(tokenizer: str | Path) -> int | None:
    """The id of the tokenizer's ``eos_token`` (named in ``tokenizer_config.json`` or
    ``special_tokens_map.json`` beside its ``tokenizer.json``); None where none is named.
    Reads the JSON files only (no ``tokenizers`` package needed)."""
    return special_token_ids(tokenizer_file(tokenizer)).get("eos_token")


# ---------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------


# The data commands' --tokenizer: what it is and which records need it.
TOKENIZER_HELP = (
    "tokenizer.json or its directory, for 'text' records, 'prompt' / 'completion' records "
    "and 'messages' records (rendered with its directory's chat template)"
)

# The data commands' --chat-template-kwargs, as the trainer's --chat_template_kwargs.
TEMPLATE_KWARGS_HELP = (
    "chat template variables for every 'messages' record, a JSON object (e.g. "
    "'{\"enable_thinking\": false}'; a record's own chat_template_kwargs win over them)"
)

# The data commands' --chat-template, as the trainer's --chat_template.
TEMPLATE_HELP = (
    "a Jinja file, or a tokenizer directory, whose chat template renders the 'messages' "
    "records in place of --tokenizer's (e.g. for a base model's tokenizer, which has none)"
)

# The data commands' --chat-turns, as the trainer's --chat_turns.
TURNS_HELP = (
    "a conversation whose chat template rewrites its earlier turns (Qwen3's drops their "
    "reasoning) as one example per assistant turn, rendered through that turn: auto "
    "splits only those, whole refuses them, split splits every conversation (default: "
    "%(default)s)"
)

# The command line's description: the data pipeline, file to batch.
DESCRIPTION = (
    "Training data: read examples (a table of formats), pack rows, shuffle resumable batches."
)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m train.data sample | inspect | cache | tokenizer``."""
    parser = argparse.ArgumentParser(prog="python -m train.data", description=DESCRIPTION)
    commands = parser.add_subparsers(dest="command", required=True)
    sample = commands.add_parser("sample", help="write learnable Markov-chain sample data")
    sample.add_argument("--out", required=True, help="output file: .pkl, .jsonl or .npy")
    sample.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    sample.add_argument(
        "--num-samples", type=int, default=512, help="examples (default: %(default)s)"
    )
    sample.add_argument(
        "--seq-len",
        type=int,
        default=1024,
        help="tokens per example (the mean, with --lengths; default: %(default)s)",
    )
    sample.add_argument(
        "--lengths",
        choices=("fixed", "lognormal"),
        default="fixed",
        help="example lengths: all --seq-len, or log-normal (sigma 1) with mean --seq-len, "
        "capped at 16x (packed documents of a long-tailed corpus)",
    )
    sample.add_argument(
        "--vocab-size",
        type=int,
        default=32000,
        help="at most the model's (512 for the tiny preset; default: %(default)s, Llama-2's)",
    )
    sample.add_argument("--seed", type=int, default=0, help="default: %(default)s")
    sample.add_argument(
        "--num-states", type=int, default=256, help="distinct tokens used (default: %(default)s)"
    )
    sample.add_argument(
        "--branching", type=int, default=4, help="successors per token (default: %(default)s)"
    )
    sample.add_argument(
        "--stream",
        action="store_true",
        help="write the samples back to back as one example (a token stream): the trainer "
        "cuts it into rows of one document each, as HF's benchmark rows are",
    )
    inspect = commands.add_parser("inspect", help="print counts of a dataset or token cache")
    inspect.add_argument(
        "path", help="a data file, a folder or quoted glob pattern of them, or a token cache"
    )
    inspect.add_argument("--tokenizer", default=None, help=TOKENIZER_HELP)
    inspect.add_argument("--chat-template", default=None, metavar="PATH", help=TEMPLATE_HELP)
    inspect.add_argument("--chat-template-kwargs", default="", help=TEMPLATE_KWARGS_HELP)
    inspect.add_argument("--chat-turns", choices=CHAT_TURNS, default=AUTO, help=TURNS_HELP)
    inspect.add_argument(
        "--eos-id",
        type=int,
        default=None,
        help="token that packing appends after each example, counted (default: the "
        "tokenizer's eos_token; a cache's own)",
    )
    inspect.add_argument("--no-eos", action="store_true", help="count no token between examples")
    inspect.add_argument("--vocab-size", type=int, default=None, help="also check id range")
    inspect.add_argument(
        "--show",
        type=int,
        default=0,
        metavar="N",
        help="also print the first N examples, the tokens the loss learns in [[ ]] (decoded "
        "with --tokenizer, else as ids)",
    )
    cache = commands.add_parser(
        "cache", help="tokenize a dataset once into a memory-mapped token cache directory"
    )
    cache.add_argument(
        "input",
        help="a data file (any format, compressed .jsonl and .pkl too), a folder or quoted "
        "glob pattern of them, or a save_to_disk directory",
    )
    cache.add_argument("cache_dir", help="the cache directory to write (kept if up to date)")
    cache.add_argument("--tokenizer", default=None, help=TOKENIZER_HELP)
    cache.add_argument("--chat-template", default=None, metavar="PATH", help=TEMPLATE_HELP)
    cache.add_argument("--chat-template-kwargs", default="", help=TEMPLATE_KWARGS_HELP)
    cache.add_argument("--chat-turns", choices=CHAT_TURNS, default=AUTO, help=TURNS_HELP)
    cache.add_argument(
        "--eos-id",
        type=int,
        default=None,
        help="token appended after each document (default: the tokenizer's eos_token)",
    )
    cache.add_argument(
        "--no-eos",
        action="store_true",
        help="no token between documents (python -m train reads such a cache only for a "
        "model and tokenizer that name no EOS: it packs with theirs)",
    )
    cache.add_argument("--vocab-size", type=int, default=None, help="also check id range")
    cache.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a cache in cache_dir built from another data file (one of this file "
        "that is stale is rebuilt without it)",
    )
    tok = commands.add_parser(
        "tokenizer", help="train a byte-level BPE tokenizer (the tokenizers package) on text"
    )
    tok.add_argument(
        "files",
        nargs="+",
        help="UTF-8 text files, or .jsonl files of 'text' (or 'prompt' and 'completion', or "
        "'messages'); either compressed too (.gz, .bz2, .xz, .zst); folders or quoted glob "
        "patterns of them",
    )
    tok.add_argument("--out", required=True, help="directory for tokenizer.json and its config")
    tok.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a tokenizer already in --out (its files: " + ", ".join(TOKENIZER_FILES) + ")",
    )
    tok.add_argument(
        "--special-tokens",
        nargs="+",
        default=[],
        metavar="TOKEN",
        help="tokens never split, ids 1, 2, ... after <|endoftext|> (e.g. a chat template's "
        "<|start_header_id|> <|end_header_id|> <|eot_id|>)",
    )
    tok.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="a Jinja chat template, written as chat_template.jinja beside tokenizer.json",
    )
    tok.add_argument(
        "--vocab-size",
        type=int,
        default=4096,
        help="at most this many tokens (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    try:  # a stop: what was being written is removed (or never renamed)
        until_stopped(lambda: _command(args), f"python -m train.data {args.command} stopped")
        # Here, not as Python exits (status 120 and a message): a reader gone by then is
        # the BrokenPipeError below.
        sys.stdout.flush()
    except NoTokenizerError as e:
        parser.exit(2, f"error: {e.asking_for('--tokenizer')}\n")
    except ChatTurnsError as e:
        parser.exit(2, f"error: {e.asking_for('--chat-turns')}\n")
    except ValueError as e:
        parser.exit(2, f"error: {e}\n")
    except BrokenPipeError:  # the reader of stdout went (`inspect --show 99 | head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error
        sys.exit(141)  # as a shell reports a command SIGPIPE ended
    except OSError as e:  # a full disk's (what was being written is removed)
        if (disk := disk_error(e)) is None:
            raise
        parser.exit(1, f"error: {disk_words(disk)}\n")


def _command(args: argparse.Namespace) -> None:
    given = getattr(args, "tokenizer", None)  # inspect's and cache's
    if given is not None and not tokenizer_file(given).is_file():
        raise ValueError(f"--tokenizer={given!r}: {tokenizer_file(given)} does not exist")
    if args.command == "sample":
        writer_of(args.out)  # before making the samples
        if os.path.lexists(args.out) and not args.overwrite:
            raise ValueError(
                f"--out={args.out!r} exists: pass --overwrite to replace it (nothing was written)"
            )
        for flag, value in (("--num-samples", args.num_samples), ("--seq-len", args.seq_len)):
            if value < 1:
                raise ValueError(f"{flag}={value} must be positive")
        if not 1 <= args.branching <= args.num_states <= args.vocab_size:
            raise ValueError(
                f"need 1 <= --branching={args.branching} <= --num-states={args.num_states} "
                f"<= --vocab-size={args.vocab_size}"
            )
        if args.lengths == "lognormal" and Path(args.out).suffix.lower() == ".npy":
            raise ValueError(f"{args.out}: .npy holds examples of one length; use .jsonl or .pkl")
        if args.lengths == "lognormal":
            lengths = document_lengths(args.num_samples, args.seq_len, args.seed)
        else:
            lengths = np.full(args.num_samples, args.seq_len)
        examples = markov_samples(
            args.num_samples,
            int(lengths.max()),
            args.vocab_size,
            args.seed,
            num_states=args.num_states,
            branching=args.branching,
        )
        if args.lengths == "lognormal":
            examples = [e[:n] for e, n in zip(examples, lengths, strict=True)]
        if args.stream:
            examples = [np.concatenate(examples)]
        try:
            save_dataset(args.out, examples)
        except OSError as e:  # a directory that does not exist, or is a file; no permission
            raise ValueError(f"--out={args.out!r} cannot be written ({e.strerror})") from None
        count, sizes = len(examples), [len(e) for e in examples]
        span = f"{sizes[0]}" if len(set(sizes)) == 1 else f"{min(sizes)}-{max(sizes)}"
        print(f"wrote {args.out}: {plural(count, 'example')} x {span} tokens ({sum(sizes)} in all)")
    elif args.command == "inspect":
        if args.show < 0:
            raise ValueError(f"--show {args.show}: give a number of examples, 0 or more")
        if data_cache.is_cache(args.path):
            cache = data_cache.open_cache(args.path, vocab_size=args.vocab_size)
            asked = None if args.no_eos else args.eos_id
            if (args.no_eos or args.eos_id is not None) and asked != cache.eos_id:
                flag = "--no-eos" if args.no_eos else f"--eos-id {args.eos_id}"
                holds = "no token" if cache.eos_id is None else f"eos_id={cache.eos_id}"
                raise ValueError(
                    f"{args.path}: the token cache holds {holds} after each document, not "
                    f"{flag}; its counts include it"
                )
            _check_rendering(args, cache)
            if stale := cache.source_mismatch():  # what the trainer would refuse it for
                print(
                    f"note: {args.path} is stale ({'; '.join(stale)}): its counts are of the "
                    "data as it was; the trainer refuses it until it is rebuilt (python -m "
                    "train.data cache)"
                )
            summary, eos_id = cache.summary(), cache.eos_id
            stream = cache.tokens, cache.targets, cache.offsets
            if note := data_cache.cache_split_note(cache):  # as reading the file printed it
                print(f"{args.path}: {note}")
        else:
            eos_id = _eos_flags(args)
            summary, stream = summarize_dataset(  # one example at a time: any size
                args.path,
                eos_id=eos_id,  # as a cache holds them: EOS included
                keep=args.show,
                tokenizer=args.tokenizer,
                vocab_size=args.vocab_size,
                chat_template_kwargs=_template_kwargs(args),
                chat_turns=args.chat_turns,
                chat_template=_chat_template(args),
            )
        for key, value in {**summary, "eos_id": "none" if eos_id is None else eos_id}.items():
            print(f"{key}: {value}")
        if args.show:
            decode = None
            if args.tokenizer is not None:
                tokenizer = load_tokenizer(args.tokenizer, "--tokenizer:")
                decode = functools.partial(tokenizer.decode, skip_special_tokens=False)
            for line in shown_examples(*stream, args.show, decode):
                print(line)
    elif args.command == "cache":
        eos_id = _eos_flags(args)
        cache, built = data_cache.ensure_cache(
            args.input,
            args.cache_dir,
            tokenizer=args.tokenizer,
            eos_id=eos_id,
            vocab_size=args.vocab_size,
            chat_template_kwargs=_template_kwargs(args),
            chat_turns=args.chat_turns,
            chat_template=_chat_template(args),
            replace_other_source=args.overwrite,
        )
        documents = int(cache.meta["num_documents"])  # not summary(): it reads labels.bin
        print(
            f"{'wrote' if built else 'up to date:'} {args.cache_dir}: {documents} documents, "
            f"{cache.num_tokens} tokens (eos_id={'none' if cache.eos_id is None else cache.eos_id})"
        )
        if not built and (note := data_cache.cache_split_note(cache)):  # as building said
            print(f"{args.cache_dir}: {note}")
    else:
        held = [f for f in TOKENIZER_FILES if os.path.lexists(os.path.join(args.out, f))]
        if held and not args.overwrite:
            raise ValueError(
                f"--out={args.out!r} holds a tokenizer ({', '.join(held)}): pass --overwrite "
                "to replace it, or another --out (nothing was written)"
            )
        file = train_tokenizer(
            args.files,
            args.out,
            vocab_size=args.vocab_size,
            special_tokens=args.special_tokens,
            chat_template=args.chat_template,
        )
        size = tokenizer_vocab_size(file)
        short = f" (of --vocab-size {args.vocab_size}: the text has no more merges)"
        print(f"wrote {file}: vocab_size={size}{short if size < args.vocab_size else ''}")


def shown_examples(tokens, targets, offsets, count: int, decode=None) -> list[str]:
    """The first ``count`` examples as ``inspect --show`` prints them: a header line
    (tokens, tokens learned), then the example with each run of tokens the loss learns
    (a label other than ``-100``, the example's first token never: nothing before it
    predicts it) in ``[[ ]]``; ``decode(ids) -> str`` per run (the tokenizer's, special
    tokens kept), else the ids. A run cut inside a multi-byte character decodes as the
    tokenizer decodes it alone; control characters but newline and tab are shown
    escaped (``\\x00``), not sent to the terminal."""
    lines = []
    for i in range(min(count, len(offsets) - 1)):
        a, b = int(offsets[i]), int(offsets[i + 1])
        ids = np.asarray(tokens[a:b]).astype(np.int64).tolist()
        learned = (np.asarray(targets[a:b]) != IGNORE_INDEX).tolist()
        if learned:
            learned[0] = False
        lines.append(f"--- example {i}: {len(ids)} tokens, {sum(learned)} learned (in [[ ]])")
        parts, start = [], 0
        for j in range(1, len(ids) + 1):
            if j == len(ids) or learned[j] != learned[start]:
                run = ids[start:j]
                text = _visible(decode(run)) if decode is not None else " ".join(map(str, run))
                parts.append(f"[[{text}]]" if learned[start] else text)
                start = j
        lines.append(("" if decode is not None else " ").join(parts))
    return lines


def _visible(text: str) -> str:
    """``text`` with its control characters but newline and tab escaped as Python
    writes them (``\\x00``, ``\\x1b``, ``\\r``)."""
    return "".join(
        repr(c)[1:-1] if unicodedata.category(c) == "Cc" and c not in "\n\t" else c for c in text
    )


def _eos_flags(args: argparse.Namespace) -> int | None:
    """The EOS of ``--eos-id`` / ``--no-eos``, else the tokenizer's ``eos_token``."""
    if args.no_eos and args.eos_id is not None:
        raise ValueError("give --eos-id or --no-eos, not both")
    if args.eos_id is None and not args.no_eos and args.tokenizer is not None:
        return tokenizer_eos_id(args.tokenizer)
    return args.eos_id


def _check_rendering(args: argparse.Namespace, cache: data_cache.TokenCache) -> None:
    """``inspect`` of a token cache: the tokenizer and chat settings given must be the
    ones the cache was built with (its counts and ``--show`` come from the cache, not
    from the flags). ValueError naming the first difference."""
    given = args.tokenizer or args.chat_template or args.chat_template_kwargs
    if not (given or args.chat_turns != AUTO):
        return
    tokenizer = args.tokenizer
    used = cache.meta["tokenizer"]
    if args.chat_template and tokenizer is None and used and Path(used["path"]).exists():
        tokenizer = used["path"]  # the cache's own, beside which its template is read
    reasons = cache.rendering_mismatch(
        tokenizer=tokenizer,
        chat_template_kwargs=_template_kwargs(args),
        chat_turns=args.chat_turns,
        chat_template=_chat_template(args),
    )
    if reasons:
        raise ValueError(
            f"{args.path}: the token cache was built otherwise than these flags say: "
            f"{reasons[0]}; inspect the data file with them, or rebuild the cache "
            "(python -m train.data cache)"
        )


def _template_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``--chat-template-kwargs`` as a dict (:func:`train.chat.parse_template_kwargs`)."""
    return parse_template_kwargs(args.chat_template_kwargs, "--chat-template-kwargs")


def _chat_template(args: argparse.Namespace) -> str | None:
    """``--chat-template``, checked (read and compiled) before any record is read, or
    None without it (:func:`train.chat.check_template_path`)."""
    if not args.chat_template:
        return None
    check_template_path(args.chat_template, "--chat-template")
    return args.chat_template


if __name__ == "__main__":
    main()
