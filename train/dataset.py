"""In-memory token datasets: a data file's examples, loaded whole and packed into rows.

:func:`load_dataset` reads any format of :data:`train.readers.READERS` into a
:class:`TokenDataset`; a token cache (:mod:`train.data_cache`) holds the same examples
tokenized once, for datasets that should not be loaded whole into memory.

Row scheme (:meth:`TokenDataset.rows`): all examples are concatenated, in file order,
into one token stream (each followed by ``eos_id`` when one is given) and the stream is
cut into consecutive, non-overlapping rows of ``seq_len`` tokens; the tail that does not
fill a row is dropped (training), or with ``pad_last`` (evaluation) filled up to a row
with token 0, labelled ``-100``, in the last example's segment: after every real token,
so causal attention never reads it. ``labels[t]`` is the label of the stream token *after*
``input_ids[t]``: already shifted, so ``labels[t]`` is the target of ``logits[t]``
(``models.loss`` convention). The last row's last label looks past the stream and is
``-100``. With ``mask_boundaries=True`` (default) a label whose token belongs to a
different example than ``input_ids[t]`` is ``-100``: nothing is learned across unrelated
documents, including at row ends when examples are exactly ``seq_len`` long. An
``eos_id`` separator belongs to the example before it and takes its last token's
labelling: predicting EOS is learned after an example whose last token is labelled
(every example without ``"labels"``, and a prompt/completion record, whose completion
is), and ignored (``-100``) after one whose last token is ignored (e.g. a prompt-only
record).

Packing (``packing``): ``"stream"`` is the scheme above, examples cut wherever a row
ends. ``"whole"`` places the same examples (each with its EOS) in file order but never
cuts one that fits in a row: an example longer than what is left of the current row
starts the next row, and the rest of the current row is padding, as ``pad_last`` pads
(token 0, labelled ``-100``, in the segment of the example before it, after its tokens).
An example longer than a row starts a row and runs on across the next ones as in
``"stream"``, but one of exactly a row's length with its EOS after it fills its row
alone, without that EOS (:func:`whole_lengths`), as an example cut to the row's length
ends: else the EOS alone would begin the next row and the rest of that row be padding.
Labels, segment ids and boundary masking are the stream's, computed on the padded
stream (:func:`whole_layout` gives where each example starts in it); padding is never
labelled.
"""

from __future__ import annotations

import dataclasses
import time
from array import array
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from models.loss import IGNORE_INDEX
from train.chat import AUTO
from train.readers import (
    FILES,
    READERS,
    Example,
    data_format,
    example_where,
    file_words,
    read_examples,
)
from train.records import (
    RecordParser,
)
from train.words import plural

_MAX_ID = np.iinfo(np.int32).max
# How examples go into rows (see the module docstring): `--packing`'s values.
PACKINGS = ("stream", "whole")


class ShortData(ValueError):
    """Data of fewer tokens than one row: ``source`` (its path), ``tokens``, ``seq_len``."""

    def __init__(self, source, tokens: int, seq_len: int):
        super().__init__(f"{source}: {tokens} tokens do not fill one row of {seq_len=}")
        self.source, self.tokens, self.seq_len = source, tokens, seq_len


def whole_layout(lengths: np.ndarray, seq_len: int) -> tuple[np.ndarray, int]:
    """``(starts, total)`` of ``"whole"`` packing: int64 ``starts[i]``, where example
    ``i`` (``lengths[i]`` tokens, its EOS included) starts in the padded stream, and the
    padded stream's length. An example that does not fit in the rest of its row starts
    the next one; the positions skipped are padding."""
    if seq_len < 1:
        raise ValueError(f"{seq_len=} must be positive")
    starts = np.empty(len(lengths), np.int64)
    pos = 0
    for i, n in enumerate(np.asarray(lengths).tolist()):
        used = pos % seq_len
        if used and n > seq_len - used:
            pos += seq_len - used
        starts[i] = pos
        pos += n
    return starts, pos


def whole_lengths(lengths: np.ndarray, seq_len: int, ends_with_eos: np.ndarray) -> np.ndarray:
    """The lengths ``"whole"`` packing places (int64): ``lengths`` (each example's tokens,
    its EOS included), but ``seq_len`` for an example of ``seq_len + 1`` tokens whose last
    is its EOS (``ends_with_eos``): it fills one row, and its EOS is left out."""
    lengths = np.asarray(lengths, np.int64)
    return np.where((lengths == seq_len + 1) & np.asarray(ends_with_eos, bool), seq_len, lengths)


def padding_tokens(num_rows: int, seq_len: int, stream_tokens: int, total: int) -> int:
    """How many of ``num_rows`` rows' tokens are padding, for a stream of
    ``stream_tokens`` padded to ``total`` by :func:`whole_layout` (padding only ever ends
    a row, so a dropped tail holds none)."""
    return max(num_rows * seq_len, total) - stream_tokens


def dropped_tail(starts: np.ndarray, total: int, seq_len: int) -> tuple[int, int]:
    """``(tokens, examples)``: what of a (padded) stream of ``total`` tokens, its
    examples starting at ``starts``, lies past its last whole row of ``seq_len``, the
    tail training drops: its tokens, and how many examples lie wholly in it."""
    kept = total // seq_len * seq_len
    return total - kept, int(np.count_nonzero(np.asarray(starts) >= kept))


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

    @property
    def packed(self) -> bool:
        """Whether some row holds more than one example (ids count up from 0 in a row)."""
        return bool(self.num_rows) and bool(self.segment_ids[:, -1].any())

    @property
    def labelled(self) -> bool:
        """Whether some token of the rows has a label (not all ``-100``)."""
        return bool((self.labels != IGNORE_INDEX).any())

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
            ``.jsonl`` file (for error messages); None: examples are named by record.
        records: int64 ``[num_examples]``, the 0-based record each example came from in
            other formats (an example is not its record's index once empty records are
            dropped or conversations split), or the number within its file of a folder's
            or pattern's files; None: by the example's own index.
        files: for a folder's or pattern's files, each file's name and what its
            examples are numbered by (``train.readers.file_words``); None: one source.
        file_of: int32 ``[num_examples]``, each example's file in ``files``.
    """

    path: str
    tokens: np.ndarray
    targets: np.ndarray
    offsets: np.ndarray
    lines: np.ndarray | None = None
    records: np.ndarray | None = None
    files: tuple[tuple[str, str], ...] | None = None
    file_of: np.ndarray | None = None

    @classmethod
    def from_examples(
        cls,
        path: str,
        input_ids: Sequence[np.ndarray],
        labels: Sequence[np.ndarray | None] | None = None,
        lines: Sequence[int] | None = None,
        records: Sequence[int] | None = None,
        files: Sequence[tuple[str, str]] | None = None,
        file_of: Sequence[int] | None = None,
    ) -> TokenDataset:
        """Builds a dataset from validated 1-D int arrays (``labels[i]`` None: the tokens;
        ``lines``: each example's 1-based line in a ``.jsonl`` file; ``records``: else
        each example's 0-based record, or its number in its file of ``files``, which
        ``file_of`` gives)."""
        if not input_ids:
            raise ValueError(f"{path}: the dataset has no examples")
        labels = labels if labels is not None else [None] * len(input_ids)
        tokens = np.concatenate(input_ids).astype(np.int32, copy=False)
        if all(lab is None for lab in labels):
            targets = tokens  # one array: unlabelled data's targets are its tokens
        else:
            pairs = zip(input_ids, labels, strict=True)
            targets = np.concatenate([ids if lab is None else lab for ids, lab in pairs])
            targets = targets.astype(np.int32, copy=False)
        lengths = np.array([len(ids) for ids in input_ids], dtype=np.int64)
        return cls(
            path=str(path),
            tokens=tokens,
            targets=targets,
            offsets=np.concatenate([[0], np.cumsum(lengths)]),
            lines=None if lines is None else np.asarray(lines, dtype=np.int64),
            records=None if records is None else np.asarray(records, dtype=np.int64),
            files=None if files is None else tuple(map(tuple, files)),
            file_of=None if file_of is None else np.asarray(file_of, dtype=np.int32),
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
        """Example ``i`` as an error message names it: ``line N`` or ``record N``, where
        it came from."""
        if self.files is not None:
            name, word = self.files[int(self.file_of[i])]
            return f"{name}, {word} {int(self.records[i])}"
        if self.lines is not None:
            return f"line {int(self.lines[i])}"
        return f"record {i if self.records is None else int(self.records[i])}"

    def prompted(self) -> np.ndarray:
        """bool ``[num_examples]``: which examples hold a token labelled ``-100`` (a
        prompt)."""
        ignored = np.concatenate([[0], np.cumsum(self.targets == IGNORE_INDEX)])
        return ignored[self.offsets[1:]] > ignored[self.offsets[:-1]]

    def content_lengths(self, eos_id: int | None = None) -> np.ndarray:
        """int64 ``[num_examples]``: tokens per example, an EOS ``eos_id`` at its end (its
        own, or the one packing appends) not counted, as a token cache counts them."""
        if eos_id is None:
            return self.lengths
        return self.lengths - (self.tokens[self.offsets[1:] - 1] == eos_id)

    def prompted_longer_than(self, seq_len: int, eos_id: int | None = None) -> np.ndarray:
        """Indices of the examples longer than ``seq_len`` tokens (an EOS at the end not
        counted: :meth:`content_lengths`) that hold a token labelled ``-100`` (a prompt):
        packing cuts each across rows, and its tokens past its first row are predicted
        without the start of its prompt."""
        return np.flatnonzero(self.prompted() & (self.content_lengths(eos_id) > seq_len))

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

    def summary(self, eos_id: int | None = None) -> dict[str, int]:
        """Counts: examples, tokens, labelled tokens (the targets the loss is taken on,
        as :meth:`rows` makes them: the tokens whose label is not ``-100``, every token of
        unlabelled data, but each example's first, which nothing before it in the example
        predicts), min/max example length, max token id; with ``eos_id``, each example's
        EOS as packing appends it (labelled as :meth:`rows` labels it), as a token cache
        counts them."""
        return stream_summary(*self.packed_stream(eos_id))

    def rows(
        self,
        seq_len: int,
        *,
        eos_id: int | None = None,
        mask_boundaries: bool = True,
        pad_last: bool = False,
        packing: str = "stream",
    ) -> Rows:
        """Packs the examples into rows of ``seq_len`` tokens with shifted labels.

        Args:
            seq_len: tokens per row.
            eos_id: if given, appended after every example (as part of it) that does
                not already end with it; labelled ``-100`` where the example's last
                token is.
            mask_boundaries: set labels that cross from one example into the next to -100.
            pad_last: fill the tail up to a last row (ignored tokens) instead of dropping
                it: every token is evaluated.
            packing: ``"stream"`` or ``"whole"`` (see the module docstring).

        Returns:
            :class:`Rows`, ``[num_tokens // seq_len, seq_len]`` each (counting EOS tokens,
            and in ``"whole"`` packing the padding; rounded up with ``pad_last``).
        """
        return self.rows_and_padding(
            seq_len,
            eos_id=eos_id,
            mask_boundaries=mask_boundaries,
            pad_last=pad_last,
            packing=packing,
        )[0]

    def rows_and_padding(
        self,
        seq_len: int,
        *,
        eos_id: int | None = None,
        mask_boundaries: bool = True,
        pad_last: bool = False,
        packing: str = "stream",
    ) -> tuple[Rows, int, tuple[int, int]]:
        """:meth:`rows`, how many of their tokens are padding (``"whole"`` packing's, and
        ``pad_last``'s fill), as :attr:`train.data_cache.CachedRows.padding` counts them,
        and the tail they leave out (:func:`dropped_tail`; none with ``pad_last``)."""
        if seq_len < 1:
            raise ValueError(f"{seq_len=} must be positive")
        if packing not in PACKINGS:
            raise ValueError(f"{packing=} must be one of {PACKINGS}")
        tokens, targets, docs = self._stream(eos_id)
        stream_tokens = len(tokens)
        padding = None
        lengths = self.stream_lengths(eos_id)
        starts = (np.cumsum(lengths) - lengths)[lengths > 0]  # each example's first token
        if packing == "whole":
            tokens, targets, docs, padding, starts = _place_whole(
                tokens, targets, docs, seq_len, eos_id
            )
            stream_tokens = int(np.count_nonzero(~padding))  # less the EOS tokens left out
        total = len(tokens)  # the padded stream's length, before pad_last's fill
        tail = (0, 0) if pad_last else dropped_tail(starts, total, seq_len)
        if pad_last and len(tokens) % seq_len:
            fill = seq_len - len(tokens) % seq_len
            tokens = np.append(tokens, np.zeros(fill, np.int32))
            targets = np.append(targets, np.full(fill, IGNORE_INDEX, np.int32))
            docs = np.append(docs, np.full(fill, docs[-1], np.int32))
            if padding is not None:
                padding = np.append(padding, np.ones(fill, bool))
        num_rows = len(tokens) // seq_len
        if num_rows == 0:
            raise ShortData(self.path, len(tokens), seq_len)
        next_targets = np.append(targets[1:], np.int32(IGNORE_INDEX))
        if mask_boundaries:
            next_targets[:-1][docs[1:] != docs[:-1]] = IGNORE_INDEX
        if padding is not None:
            next_targets[padding] = IGNORE_INDEX
        shape = (num_rows, seq_len)
        used = num_rows * seq_len
        # Each row's documents from 0, in place: `docs` is this call's own array (a
        # stream of a few bytes a token is what memory holds of the rows, not a copy
        # more).
        row_docs = docs[:used].reshape(shape)
        row_docs -= row_docs[:, :1].copy()
        rows = Rows(
            input_ids=tokens[:used].reshape(shape),
            labels=next_targets[:used].reshape(shape),
            segment_ids=row_docs,
        )
        return rows, padding_tokens(num_rows, seq_len, stream_tokens, total), tail

    def stream_lengths(self, eos_id: int | None = None) -> np.ndarray:
        """int64 ``[num_examples]``: tokens per example in the packed stream, an appended
        EOS included (the lengths of a token cache's documents)."""
        if eos_id is None:
            return self.lengths
        return self.lengths + (self.tokens[self.offsets[1:] - 1] != eos_id)

    def packed_stream(self, eos_id: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(tokens, targets, offsets)`` of the stream packing reads (``eos_id`` after
        each example, as :meth:`_stream` appends it), example ``i`` at
        ``offsets[i]:offsets[i + 1]``, as a token cache stores its documents."""
        tokens, targets, _ = self._stream(eos_id)
        offsets = np.concatenate([[0], np.cumsum(self.stream_lengths(eos_id))])
        return tokens, targets, offsets

    def _stream(self, eos_id: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(tokens, targets, example index)`` of the concatenated stream, int32 each;
        ``eos_id`` goes after every example that does not already end with it, its target
        ``-100`` where the example's last target is."""
        if eos_id is None:
            docs = np.repeat(np.arange(self.num_examples, dtype=np.int32), self.lengths)
            return self.tokens, self.targets, docs
        if not 0 <= eos_id <= _MAX_ID:
            raise ValueError(f"{eos_id=} must be a non-negative int32 token id")
        ends = self.offsets[1:]
        need = self.tokens[ends - 1] != eos_id
        docs = np.repeat(np.arange(self.num_examples, dtype=np.int32), self.lengths + need)
        ends = ends[need]
        tokens = np.insert(self.tokens, ends, eos_id)
        if self.targets is self.tokens:  # unlabelled: the EOS's target is the EOS too
            return tokens, tokens, docs
        eos_targets = np.where(self.targets[ends - 1] == IGNORE_INDEX, IGNORE_INDEX, eos_id)
        return tokens, np.insert(self.targets, ends, eos_targets.astype(np.int32)), docs


def stream_summary(tokens: np.ndarray, targets: np.ndarray, offsets: np.ndarray) -> dict[str, int]:
    """:meth:`TokenDataset.summary`'s counts of the stream ``(tokens, targets, offsets)``
    of :meth:`TokenDataset.packed_stream`: for a caller that reads the stream too (one
    pass over the examples)."""
    lengths = np.diff(offsets)
    # Each example's first token is no target (nothing before it in its example).
    firsts = targets[offsets[:-1][lengths > 0]]
    labelled = np.count_nonzero(targets != IGNORE_INDEX) - np.count_nonzero(firsts != IGNORE_INDEX)
    return {
        "examples": len(lengths),
        "tokens": len(tokens),
        "labelled_tokens": int(labelled),
        "min_length": int(lengths.min()),
        "max_length": int(lengths.max()),
        "max_id": int(tokens.max()),
    }


def summarize_dataset(
    path: str | Path,
    *,
    eos_id: int | None,
    keep: int = 0,
    tokenizer: str | Path | None = None,
    vocab_size: int | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    chat_turns: str = AUTO,
    chat_template: str | Path | None = None,
) -> tuple[dict[str, int], tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """:func:`stream_summary`'s counts of ``load_dataset(path, ...).packed_stream(eos_id)``
    and that stream's first ``keep`` examples ``(tokens, targets, offsets)``, read one
    example at a time: the memory of the counts, not of the dataset (``train.data
    inspect`` of a corpus larger than memory). The same errors as :func:`load_dataset`,
    a token id or label past ``vocab_size`` named by its example."""
    path = Path(path)
    parser = RecordParser(path, tokenizer, chat_template_kwargs, chat_turns, chat_template)
    where = example_where(path)
    count = tokens = labelled = max_id = 0
    shortest, longest = None, 0
    kept: list[tuple[np.ndarray, np.ndarray]] = []
    for example in _progress(read_examples(path, parser), f"reading {path}"):
        ids, labels = example.input_ids, example.labels
        if vocab_size is not None:  # the data's ids, as a token cache's build checks them
            check_example_vocab(path, where(example), ids, labels, vocab_size)
        targets = ids if labels is None else labels
        if (end := document_end(ids, labels, eos_id)) is not None:  # as packing appends it
            ids, targets = np.append(ids, np.int32(end[0])), np.append(targets, np.int32(end[1]))
        count += 1
        tokens += len(ids)
        labelled += int(np.count_nonzero(targets[1:] != IGNORE_INDEX))
        shortest = len(ids) if shortest is None else min(shortest, len(ids))
        longest, max_id = max(longest, len(ids)), max(max_id, int(ids.max()))
        if len(kept) < keep:
            kept.append((ids, targets))
    if not count:
        raise ValueError(f"{path}: the dataset has no examples")
    summary = {
        "examples": count,
        "tokens": tokens,
        "labelled_tokens": labelled,
        "min_length": shortest,
        "max_length": longest,
        "max_id": max_id,
    }
    lengths = [len(ids) for ids, _ in kept]
    shown = (
        np.concatenate([ids for ids, _ in kept]) if kept else np.zeros(0, np.int32),
        np.concatenate([targets for _, targets in kept]) if kept else np.zeros(0, np.int32),
        np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]),
    )
    return summary, shown


def _place_whole(
    tokens: np.ndarray, targets: np.ndarray, docs: np.ndarray, seq_len: int, eos_id: int | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The stream ``(tokens, targets, docs)`` laid out by :func:`whole_layout` (the EOS of
    an example one row long left out: :func:`whole_lengths`), a bool mask of its
    padding (token 0, target ``-100``, the example before it), and the examples' starts."""
    lengths = np.bincount(docs, minlength=int(docs[-1]) + 1)
    ends = np.cumsum(lengths) - 1
    eos_last = np.zeros(len(lengths), bool) if eos_id is None else tokens[ends] == eos_id
    placed = whole_lengths(lengths, seq_len, eos_last & (lengths > 0))
    if (placed != lengths).any():
        keep = np.ones(len(tokens), bool)
        keep[ends[placed != lengths]] = False
        tokens, targets, docs, lengths = tokens[keep], targets[keep], docs[keep], placed
    starts, total = whole_layout(lengths, seq_len)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    where = np.repeat(starts - offsets, lengths) + np.arange(len(tokens))
    placed_tokens = np.zeros(total, np.int32)
    placed_tokens[where] = tokens
    placed_targets = np.full(total, IGNORE_INDEX, np.int32)
    placed_targets[where] = targets
    placed_docs = np.zeros(total, np.int32)
    placed_docs[where] = docs
    placed_docs = np.maximum.accumulate(placed_docs)  # padding: the example before it
    padding = np.ones(total, bool)
    padding[where] = False
    return placed_tokens, placed_targets, placed_docs, padding, starts


# Seconds between the progress lines of a long read (into memory, or a cache build).
PROGRESS_SECONDS = 30.0


def _progress(examples: Iterator[Example], what: str, note: str = "") -> Iterator[Example]:
    """`examples`, with a line every PROGRESS_SECONDS of a long read: `<what>: N
    examples, M tokens so far, R tokens/s<note>`."""
    started = last = time.monotonic()
    count = tokens = 0
    for example in examples:
        count, tokens = count + 1, tokens + len(example.input_ids)
        if (now := time.monotonic()) - last >= PROGRESS_SECONDS:
            last = now
            print(
                f"{what}: {plural(count, 'example', grouped=True)}, {tokens:,} tokens so far, "
                f"{tokens / (now - started):,.0f} tokens/s{note}",
                flush=True,
            )
        yield example


def document_end(ids: np.ndarray, labels: np.ndarray | None, eos_id: int | None):
    """`(EOS id, its label)` that packing puts after a document of `ids` (`labels`: None
    where they are the ids), or None where none follows it: no EOS, or the document ends
    with it already. The EOS is labelled -100 after a last label of -100 (a prompt-only
    record), else learned."""
    if eos_id is None or ids[-1] == eos_id:
        return None
    ignored = labels is not None and labels[-1] == IGNORE_INDEX
    return eos_id, IGNORE_INDEX if ignored else eos_id


def check_example_vocab(source, where: str, ids, labels, vocab_size: int) -> None:
    """ValueError naming `source`, the example (`where`) and the id, for a token id or a
    label (None: the ids) of one example at or past `vocab_size`."""
    for name, values in (("token id", ids), ("label", labels)):
        if values is not None and values.size and values.max() >= vocab_size:
            bad = int(values[np.argmax(values >= vocab_size)])
            raise ValueError(f"{source}: {where}: {name} {bad} is out of range for {vocab_size=}")


class _Gathered:
    """Examples as a reader yields them, kept as a few int32 chunks rather than an array
    per example (whose ~100 bytes of overhead each add up over millions of short
    documents), and each one's length, number and file in compact arrays."""

    CHUNK = 1 << 22  # tokens gathered before they are joined into one chunk

    def __init__(self):
        self.lengths, self.numbers, self.files = array("q"), array("q"), array("i")
        self._tokens, self._targets = _Chunks(), None  # targets: once a label is seen

    @property
    def tokens(self) -> int:
        """The tokens gathered so far."""
        return self._tokens.size + sum(len(c) for c in self._tokens.done)

    def add(self, example: Example) -> None:
        self.lengths.append(len(example.input_ids))
        self.numbers.append(example.number)
        self.files.append(example.file)
        if example.labels is not None and self._targets is None:
            self._targets = self._tokens.copy()  # the earlier examples' targets: their tokens
        self._tokens.add(example.input_ids)
        if self._targets is not None:
            labels = example.labels
            self._targets.add(example.input_ids if labels is None else labels)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``(tokens, targets)``, int32; one array where no example has labels."""
        tokens = self._tokens.joined()
        return tokens, tokens if self._targets is None else self._targets.joined()


class _Chunks:
    """int32 arrays appended one at a time, joined every `_Gathered.CHUNK` tokens."""

    def __init__(self):
        self.done, self.open, self.size = [], [], 0

    def add(self, values: np.ndarray) -> None:
        self.open.append(np.asarray(values, np.int32))
        self.size += len(values)
        if self.size >= _Gathered.CHUNK:
            self.done.append(np.concatenate(self.open))
            self.open, self.size = [], 0

    def copy(self) -> _Chunks:
        twin = _Chunks()
        twin.done, twin.open, twin.size = list(self.done), list(self.open), self.size
        return twin

    def joined(self) -> np.ndarray:
        parts = self.done + ([np.concatenate(self.open)] if self.open else [])
        whole = np.concatenate(parts) if len(parts) != 1 else parts[0]
        self.done, self.open, self.size = [], [], 0
        return whole.astype(np.int32, copy=False)


def load_dataset(
    path: str | Path,
    *,
    tokenizer: str | Path | None = None,
    vocab_size: int | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    chat_turns: str = AUTO,
    chat_template: str | Path | None = None,
) -> TokenDataset:
    """Loads a dataset of any format in :data:`train.readers.READERS` into memory.

    Args:
        path: the data file (or ``save_to_disk`` directory).
        tokenizer: ``tokenizer.json`` or a directory holding it, needed for ``"text"``.
        vocab_size: if given, every token id and label must be below it.
        chat_template_kwargs: chat template variables for every conversation
            (:class:`train.chat.ChatTemplate`), under a record's own.
        chat_turns: which conversations are split into one example per assistant turn
            (:data:`train.chat.CHAT_TURNS`); a split one's examples share its line.
        chat_template: a Jinja file, or a directory, whose chat template renders the
            conversations in place of the tokenizer's (:func:`train.chat.read_template_path`).

    Raises:
        ValueError: malformed data, naming the file and record index; an empty dataset;
            ids out of range; an unknown format; a missing optional package.
    """
    path = Path(path)
    fmt = data_format(path)
    parser = RecordParser(path, tokenizer, chat_template_kwargs, chat_turns, chat_template)
    gathered = _Gathered()
    note = " (a token cache, --data_cache_dir, reads a corpus once)"
    for example in _progress(read_examples(path, parser), f"reading {path} into memory", note):
        gathered.add(example)
    if not gathered.lengths:
        raise ValueError(f"{path}: the dataset has no examples")
    tokens, targets = gathered.arrays()
    numbers = np.asarray(gathered.numbers, dtype=np.int64)
    by_line, several = READERS[fmt].by_line, fmt == FILES
    dataset = TokenDataset(
        path=str(path),
        tokens=tokens,
        targets=targets,
        offsets=np.concatenate([[0], np.cumsum(np.asarray(gathered.lengths, np.int64))]),
        lines=numbers if by_line else None,
        records=None if by_line else numbers,
        files=tuple(file_words(path)) if several else None,
        file_of=np.asarray(gathered.files, np.int32) if several else None,
    )
    if vocab_size is not None:
        dataset.check_vocab(vocab_size)
    return dataset
