"""Memory-mapped token caches: a dataset tokenized once, read back without loading it.

A cache is a directory:

- ``tokens.bin``: uint32, every document's tokens back to back, each document followed
  by ``eos_id`` when one is given and it does not already end with it (the stream of
  :meth:`train.dataset.TokenDataset.rows`, EOS included);
- ``labels.bin``: int32, the same length, only where some record carries labels (its
  ``"labels"``, a prompt/completion record's: ``-100`` on the prompt, or a
  ``"messages"`` record's: ``-100`` but on the assistant turns; ``-100`` = ignored;
  the appended EOS is its own label, or ``-100`` after a record whose last label is
  ``-100``);
- ``index.npy``: int64 ``[num_documents + 1]``, document ``i`` is
  ``tokens[index[i]:index[i + 1]]``;
- ``meta.json``: what it was built from (the source's path, size and mtime; the
  tokenizer file's sha256 where records were tokenized; the chat template's file (the
  tokenizer's, or the one given in its place: ``--chat_template``), a sha256 of its text
  (and its ``tool_use`` template's) and the special tokens it was given, the inputs the
  reader gives it (``train.chat.TEMPLATE_INPUTS``), the template variables given to
  every conversation (``chat_template_kwargs``; a record's own are in the source), and
  ``chat_turns`` with how many conversations it split into how many examples
  (``split_conversations``, ``split_examples``; each example a document) where
  conversations were rendered), ``eos_id`` and counts.

It is written under a temporary name beside ``cache_dir`` and renamed into place when
complete: a failed build leaves nothing under the final name, and a stale cache it
replaces is removed only after the new one is in place. :class:`CachedRows` cuts rows
exactly as ``TokenDataset.rows`` does (same labels, segment ids and boundary masking),
computed per row from the memory map when a batch asks for it, so batches, losses and
resume positions are the in-memory path's; ``packing="whole"`` lays the documents out
from ``index.npy`` (:func:`train.dataset.whole_layout`, once) and pads as the in-memory
path does.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import hashlib
import json
import os
import re
import shlex
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from models.loss import IGNORE_INDEX
from train import processes
from train.chat import AUTO, WHOLE, chat_template_stamp
from train.dataset import (
    PACKINGS,
    PROGRESS_SECONDS,
    Rows,
    ShortData,
    TokenDataset,
    check_example_vocab,
    document_end,
    dropped_tail,
    load_dataset,
    padding_tokens,
    whole_layout,
    whole_lengths,
)
from train.readers import (
    CACHE_FORMAT,
    CACHE_INDEX,
    CACHE_META,
    CACHE_TOKENS,
    FILES,
    READERS,
    data_format,
    example_where,
    file_words,
    is_pattern,
    is_token_cache,
    pattern_folder,
    read_examples,
    source_exists,
    source_files,
)
from train.records import (
    RecordParser,
    split_note,
    tokenizer_file,
)
from train.words import plural

FORMAT = CACHE_FORMAT
VERSION = 2
# Versions whose caches without labels.bin are this version's (version 1's labels.bin
# labels every appended EOS, also after a record whose last label is -100).
UNLABELLED_VERSIONS = (1, VERSION)
META = CACHE_META
TOKENS = CACHE_TOKENS
LABELS = "labels.bin"
INDEX = CACHE_INDEX
_MAX_ID = np.iinfo(np.int32).max
_FLUSH_TOKENS = 1 << 22  # tokens buffered before a write


def is_cache(path: str | Path) -> bool:
    """Whether ``path`` is a token cache directory (it has a ``meta.json`` of this format)."""
    return is_token_cache(path)


def source_stamp(path: str | Path) -> dict[str, Any]:
    """``{"path", "size", "mtime_ns", "edges"}`` of a data file (a directory or pattern:
    its files' total size and latest mtime, edges None; with ``files``, their count,
    ``names``, a hash of their names, and ``stats``, of each one's size and mtime),
    what a cache records to notice a changed source; ``edges``: a hash of the file's
    first and last ``EDGE_BYTES``, so that a file rewritten to the same size with its
    time kept (``cp -p``, ``rsync -t``) is noticed where it differs there (at most 2 MiB
    read at each start; not per file of a directory of shards, which could be
    thousands)."""
    files = source_files(path)
    stats = [_stat(f) for f in files]
    stamp = {
        "path": source_path(path),
        "size": sum(s.st_size for s in stats),
        "mtime_ns": max((s.st_mtime_ns for s in stats), default=0),
        "edges": None,
    }
    if data_format(path) == FILES:  # a shard renamed or moved changes the order
        stamp["files"] = len(files)
        names = [name for name, _ in file_words(path)]
        stamp["names"] = hashlib.sha256("\n".join(names).encode()).hexdigest()
        # A file rewritten to its size with an older time leaves the total and the
        # latest time as they were: each file's size and time are recorded too.
        each = "\n".join(
            f"{n}\t{s.st_size}\t{s.st_mtime_ns}" for n, s in zip(names, stats, strict=True)
        )
        stamp["stats"] = hashlib.sha256(each.encode()).hexdigest()
    elif not Path(path).is_dir():
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            digest.update(f.read(EDGE_BYTES))
            if stats[0].st_size > EDGE_BYTES:
                f.seek(max(EDGE_BYTES, stats[0].st_size - EDGE_BYTES))
                digest.update(f.read(EDGE_BYTES))
        stamp["edges"] = digest.hexdigest()
    return stamp


def _stat(file: Path) -> os.stat_result:
    """``file``'s stat; ValueError naming it where it cannot be read (a link to
    nothing, no permission)."""
    try:
        return file.stat()
    except OSError as e:
        raise ValueError(f"{file}: cannot be read ({e.strerror})") from None


def source_path(path: str | Path) -> str:
    """A data source's absolute path as a cache records it (a pattern's, its wildcards
    kept; other paths with their links resolved)."""
    if is_pattern(path):
        return os.path.abspath(os.path.expanduser(path))
    return str(Path(path).resolve())


def source_bytes(path: str | Path) -> int:
    """A data source's size (a directory or pattern: its files' total), from their stats."""
    return sum(_stat(f).st_size for f in source_files(path))


# The bytes at each end of a data file whose hash a cache records (`source_stamp`).
EDGE_BYTES = 1 << 20


def tokenizer_stamp(tokenizer: str | Path) -> dict[str, str]:
    """``{"path", "sha256"}`` of a tokenizer's ``tokenizer.json``."""
    file = tokenizer_file(tokenizer).resolve()
    return {"path": str(file), "sha256": hashlib.sha256(file.read_bytes()).hexdigest()}


class TokenCache:
    """An opened cache: ``tokens`` (uint32 memmap), ``targets`` (int32 memmap, or the
    tokens), ``offsets`` (int64, memory-mapped), ``meta``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not is_cache(self.path):
            raise ValueError(f"{self.path}: not a token cache (no {META} of format {FORMAT!r})")
        self.meta = json.loads((self.path / META).read_text())
        version = self.meta.get("version")
        if version != VERSION and not (
            version in UNLABELLED_VERSIONS and self.meta.get("labels") is False
        ):
            raise ValueError(
                f"{self.path}: token cache version {self.meta.get('version')}, this jflash "
                f"reads {VERSION}; rebuild it with python -m train.data cache"
            )
        n = int(self.meta["num_tokens"])
        self.tokens = self._map(TOKENS, np.uint32, n)
        self.targets = self._map(LABELS, np.int32, n) if self.meta["labels"] else self.tokens
        index = self.path / INDEX
        try:
            self.offsets = np.load(index, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError, EOFError):
            problem = "not a readable .npy array" if index.is_file() else "missing"
            raise ValueError(f"{index}: {problem} (a damaged cache: rebuild it)") from None
        docs = int(self.meta["num_documents"])
        if self.offsets.shape != (docs + 1,) or int(self.offsets[-1]) != n:
            raise ValueError(
                f"{self.path}: {INDEX} does not match {META} ({docs} documents, {n} tokens)"
            )

    def _map(self, name: str, dtype, n: int) -> np.memmap:
        file = self.path / name
        if not file.is_file():
            raise ValueError(f"{file}: missing (a damaged cache: rebuild it)")
        size = file.stat().st_size
        if size != n * np.dtype(dtype).itemsize:
            raise ValueError(
                f"{file}: {size} bytes, expected {n} tokens of {np.dtype(dtype).name} "
                "(a damaged cache: rebuild it)"
            )
        return np.memmap(file, dtype=dtype, mode="r", shape=(n,))

    @property
    def eos_id(self) -> int | None:
        return self.meta["eos_id"]

    @property
    def num_tokens(self) -> int:
        return int(self.meta["num_tokens"])

    def summary(self) -> dict[str, Any]:
        """Counts as :meth:`TokenDataset.summary` gives them (EOS tokens included)."""
        lengths = np.diff(np.asarray(self.offsets))
        labelled = self.labelled_tokens()
        return {
            "examples": int(self.meta["num_documents"]),
            "tokens": self.num_tokens,
            "labelled_tokens": labelled,
            "min_length": int(lengths.min()),
            "max_length": int(lengths.max()),
            "max_id": int(self.meta["max_id"]),
        }

    def labelled_tokens(self) -> int:
        """How many tokens are targets with a label: not a document's first token (nothing
        before it in its document predicts it), not ``-100`` (one pass over labels.bin)."""
        offsets = np.asarray(self.offsets)
        labelled = self.num_tokens - (len(offsets) - 1)
        if self.targets is not self.tokens:
            firsts = np.asarray(self.targets[offsets[:-1]])
            labelled = int(np.count_nonzero(self.targets != IGNORE_INDEX))
            labelled -= int(np.count_nonzero(firsts != IGNORE_INDEX))
        return labelled

    def check_vocab(self, vocab_size: int) -> None:
        """ValueError naming the cache and the largest id where it is ``>= vocab_size``."""
        for name, key in (("token id", "max_id"), ("label", "max_label")):
            if self.meta[key] >= vocab_size:
                raise ValueError(
                    f"{self.path}: {name} {self.meta[key]} is out of range for {vocab_size=}"
                )

    def mismatch(
        self,
        source: str | Path | None = None,
        *,
        tokenizer: str | Path | None = None,
        eos_id: int | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_turns: str = AUTO,
        chat_template: str | Path | None = None,
        check_source: bool = True,
    ) -> list[str]:
        """Why this cache is not what ``source`` (default: the recorded source, where it
        still exists; none with ``check_source`` False), ``tokenizer`` (compared where
        both tokenized text; its chat template where the cache's conversations were
        rendered with one, or ``chat_template``'s, given in its place),
        ``chat_template_kwargs`` and
        ``chat_turns`` (where they were: ``"auto"`` and ``"whole"`` build the same cache
        where ``"auto"`` split no conversation; a cache from before the setting read them
        whole) and ``eos_id`` would build; empty when it is."""
        reasons = []
        if eos_id != self.eos_id:
            words = ["none" if e is None else e for e in (self.eos_id, eos_id)]
            reasons.append(f"built with eos_id={words[0]}, this run's is {words[1]}")
        if check_source:
            reasons += self.source_mismatch(source)
        if "masked_tokens" not in self.meta and self.meta["tokenizer"] is None:
            # Token-id records were read whole, attention_mask's padding as tokens.
            reasons.append("built before records' attention_mask was read (padding was kept)")
        reasons += self.rendering_mismatch(
            tokenizer=tokenizer,
            chat_template_kwargs=chat_template_kwargs,
            chat_turns=chat_turns,
            chat_template=chat_template,
        )
        return reasons

    def source_mismatch(self, source: str | Path | None = None) -> list[str]:
        """How ``source`` (default: the recorded source, where it still exists) differs
        from the data this cache was built from; empty where it does not."""
        reasons = []
        recorded = self.meta["source"]
        now = None
        if source is not None:
            now = source_stamp(source)
        elif source_exists(recorded["path"]):
            # The data it was built from, where they still are: an emptied folder, a
            # file no longer readable, is data gone (the cache is what is left).
            with contextlib.suppress(ValueError, OSError):
                now = source_stamp(recorded["path"])
        if now is not None:
            if now["path"] != recorded["path"]:
                reasons.append(f"built from {recorded['path']}, not {now['path']}")
            elif (now["size"], now["mtime_ns"]) != (recorded["size"], recorded["mtime_ns"]):
                reasons.append(f"{now['path']} changed since the cache was built (size or mtime)")
            elif now.get("names") != recorded.get("names"):
                reasons.append(
                    f"{now['path']}'s files were renamed, moved or reordered since the cache "
                    "was built"
                )
            elif now.get("stats") != recorded.get("stats", now.get("stats")):
                reasons.append(
                    f"{now['path']} changed since the cache was built (a file's size or mtime)"
                )
            elif now["edges"] != recorded.get("edges", now["edges"]):  # older caches: none
                reasons.append(
                    f"{now['path']} changed since the cache was built (its first or last MiB)"
                )
        return reasons

    def rendering_mismatch(
        self,
        *,
        tokenizer: str | Path | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_turns: str = AUTO,
        chat_template: str | Path | None = None,
    ) -> list[str]:
        """`mismatch`'s reasons about how the examples were tokenized and rendered:
        ``tokenizer`` (where both tokenized text), its chat template or
        ``chat_template``, ``chat_template_kwargs`` and ``chat_turns`` (where the cache
        holds conversations); empty when they match."""
        reasons = []
        used = self.meta["tokenizer"]
        if used is not None and tokenizer is not None and tokenizer_file(tokenizer).is_file():
            if tokenizer_stamp(tokenizer)["sha256"] != used["sha256"]:
                reasons.append(f"its text was tokenized by another tokenizer ({used['path']})")
        chat = self.meta.get("chat_template")  # absent from caches of no conversation
        if chat is not None and tokenizer is not None and tokenizer_file(tokenizer).is_file():
            now = chat_template_stamp(tokenizer_file(tokenizer).parent, template=chat_template)
            if now is None or now["sha256"] != chat["sha256"]:
                reasons.append(
                    f"its conversations were rendered with another chat template ({chat['path']})"
                )
            elif chat.get("inputs", "messages") != now["inputs"]:  # a cache before tools
                reasons.append(
                    f"its conversations' template was given {chat.get('inputs', 'messages')}, "
                    f"this jflash gives it {now['inputs']}"
                )
        kwargs = dict(chat_template_kwargs or {})
        if chat is not None and chat.get("kwargs", {}) != kwargs:
            reasons.append(
                f"its conversations were rendered with chat_template_kwargs "
                f"{json.dumps(chat.get('kwargs', {}))}, not {json.dumps(kwargs)}"
            )
        if chat is not None:
            built = chat.get("turns", WHOLE)  # a cache from before the setting: whole
            split = chat.get("split_conversations", 0)
            alike = {built, chat_turns} == {AUTO, WHOLE} and not split  # auto split none
            if built != chat_turns and not alike:
                how = f" ({split} of them split)" if split else ""
                reasons.append(
                    f"its conversations were read with chat_turns {built}{how}, not {chat_turns}"
                )
        return reasons

    def prompted(self) -> np.ndarray:
        """bool ``[num_documents]``: which documents hold a token labelled ``-100`` (a
        prompt); one pass over ``labels.bin`` where there is one (-100 is the least
        label, and no document is empty)."""
        offsets = np.asarray(self.offsets)
        if not self.meta["labels"]:
            return np.zeros(len(offsets) - 1, bool)
        return np.minimum.reduceat(self.targets, offsets[:-1]) == IGNORE_INDEX

    def content_lengths(self, eos_id: int | None = None) -> np.ndarray:
        """int64 ``[num_documents]``: tokens per document, its EOS not counted (as
        :meth:`train.dataset.TokenDataset.content_lengths`; ``eos_id``: the cache's own)."""
        return np.diff(np.asarray(self.offsets)) - (self.eos_id is not None)

    def prompted_longer_than(self, seq_len: int, eos_id: int | None = None) -> np.ndarray:
        """:meth:`train.dataset.TokenDataset.prompted_longer_than` of the cached
        documents: reads the labels of those longer than ``seq_len`` only."""
        if not self.meta["labels"]:
            return np.zeros(0, np.int64)
        offsets = np.asarray(self.offsets)
        long = np.flatnonzero(self.content_lengths() > seq_len)
        prompted = [
            i for i in long if (self.targets[offsets[i] : offsets[i + 1]] == IGNORE_INDEX).any()
        ]
        return np.asarray(prompted, np.int64)

    def rows(
        self,
        seq_len: int,
        *,
        mask_boundaries: bool = True,
        pad_last: bool = False,
        packing: str = "stream",
    ) -> CachedRows:
        return CachedRows(
            self, seq_len, mask_boundaries=mask_boundaries, pad_last=pad_last, packing=packing
        )


def open_cache(path: str | Path, *, vocab_size: int | None = None) -> TokenCache:
    """Opens the cache at ``path`` (memory maps; nothing is read whole but the meta)."""
    cache = TokenCache(path)
    if vocab_size is not None:
        cache.check_vocab(vocab_size)
    return cache


class CachedRows:
    """The rows of :meth:`TokenDataset.rows` for a cache's stream, cut on demand.

    Row ``r`` is stream positions ``[r * seq_len, (r + 1) * seq_len)``; its labels read
    one position further (``-100`` past the stream's end, and across a document
    boundary with ``mask_boundaries``); with ``pad_last`` a last row past the stream's
    end is filled as :meth:`train.dataset.TokenDataset.rows` fills it. With
    ``packing="whole"`` the positions are those of the padded stream of
    :func:`train.dataset.whole_layout`, computed once from the document index. Quacks like
    :class:`train.dataset.Rows` for :class:`train.data.Batches`: ``num_rows``,
    ``seq_len``, ``take``.
    """

    def __init__(
        self,
        cache: TokenCache,
        seq_len: int,
        *,
        mask_boundaries: bool = True,
        pad_last: bool = False,
        packing: str = "stream",
    ):
        if seq_len < 1:
            raise ValueError(f"{seq_len=} must be positive")
        if packing not in PACKINGS:
            raise ValueError(f"{packing=} must be one of {PACKINGS}")
        self.cache = cache
        self.mask_boundaries = mask_boundaries
        self.packing = packing
        self._seq_len = seq_len
        self._total = cache.num_tokens  # the (padded) stream's length
        self._stream_tokens = cache.num_tokens  # those the rows hold
        if packing == "whole":
            self._offsets = np.asarray(cache.offsets)
            lengths = np.diff(self._offsets)
            # An example one row long leaves its EOS out (`whole_lengths`).
            ends = np.zeros(len(lengths), bool)
            if cache.eos_id is not None:
                one_row = np.flatnonzero(lengths == seq_len + 1)
                last = np.asarray(cache.tokens[self._offsets[one_row + 1] - 1])
                ends[one_row] = last == cache.eos_id
            self._lengths = whole_lengths(lengths, seq_len, ends)
            self._stream_tokens = int(self._lengths.sum())
            self._starts, self._total = whole_layout(self._lengths, seq_len)
        rounding = seq_len - 1 if pad_last else 0
        self._num_rows = (self._total + rounding) // seq_len
        if self._num_rows == 0:
            raise ShortData(cache.path, cache.num_tokens, seq_len)

    @property
    def num_rows(self) -> int:
        return self._num_rows

    @property
    def seq_len(self) -> int:
        return self._seq_len

    @property
    def padding(self) -> int:
        """How many of the rows' tokens are padding (``"whole"`` packing; else 0 but for
        ``pad_last``'s fill)."""
        return padding_tokens(self._num_rows, self._seq_len, self._stream_tokens, self._total)

    @property
    def tail(self) -> tuple[int, int]:
        """The tail the rows leave out (:func:`train.dataset.dropped_tail`: its tokens and
        the documents wholly in it); none with ``pad_last``."""
        if self._num_rows * self._seq_len >= self._total:
            return 0, 0
        starts = self._starts if self.packing == "whole" else self.cache.offsets[:-1]
        return dropped_tail(starts, self._total, self._seq_len)

    @property
    def packed(self) -> bool:
        """Whether some row holds more than one document: a document starts inside a row."""
        if self.packing == "whole":
            starts = self._starts[1:]
        else:
            starts = np.asarray(self.cache.offsets[1:-1])
        starts = starts[starts < self._num_rows * self._seq_len]
        return bool((starts % self._seq_len).any())

    @property
    def labelled(self) -> bool:
        """Whether some token of the cache is a target with a label: a document's first
        token is none, whatever its label (`max_target`, which the writer records; a cache
        written before it: counted, one pass over its labels)."""
        if "max_target" in self.cache.meta:
            return self.cache.meta["max_target"] >= 0
        return self.cache.labelled_tokens() > 0

    def take(self, ids) -> Rows:
        """Rows ``ids`` as int32 arrays ``[len(ids), seq_len]``."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self._num_rows):
            raise IndexError(f"row ids must be in [0, {self._num_rows}), got {ids}")
        if self.packing == "whole":
            return self._take_whole(ids)
        L, n = self._seq_len, self.cache.num_tokens
        out = [np.zeros((ids.size, L), np.int32) for _ in range(3)]
        for j, r in enumerate(ids):
            begin = int(r) * L
            end = min(begin + L + 1, n)  # one past the row, for its last label
            # Padding past the stream's end (`pad_last`) joins the last document.
            at = np.minimum(np.arange(begin, max(end, begin + L)), n - 1)
            docs = np.searchsorted(self.cache.offsets, at, side="right") - 1
            tokens = self.cache.tokens[begin : begin + L]
            out[0][j, : len(tokens)] = tokens
            labels = np.full(L, IGNORE_INDEX, np.int32)
            labels[: end - begin - 1] = self.cache.targets[begin + 1 : end]
            if self.mask_boundaries:
                crossing = docs[1 : end - begin] != docs[: end - begin - 1]
                labels[: end - begin - 1][crossing] = IGNORE_INDEX
            out[1][j] = labels
            out[2][j] = docs[:L] - docs[0]
        return Rows(*out)

    def _take_whole(self, ids: np.ndarray) -> Rows:
        """:meth:`take` in ``"whole"`` packing: each position of the padded stream is a
        document's token or padding after it (token 0, target ``-100``, its segment)."""
        L = self._seq_len
        out = [np.zeros((ids.size, L), np.int32) for _ in range(3)]
        for j, r in enumerate(ids):
            at = np.arange(int(r) * L, (int(r) + 1) * L + 1)  # one past, for the last label
            docs = np.searchsorted(self._starts, at, side="right") - 1
            within = at - self._starts[docs]
            real = within < self._lengths[docs]
            source = self._offsets[docs] + np.minimum(within, self._lengths[docs] - 1)
            tokens = np.where(real, self.cache.tokens[source], 0)
            # int32 first: an unlabelled cache's targets are its uint32 tokens (ids < 2**31)
            targets = np.where(real, self.cache.targets[source].astype(np.int32), IGNORE_INDEX)
            labels = targets[1:].astype(np.int32)
            if self.mask_boundaries:
                labels[docs[1:] != docs[:-1]] = IGNORE_INDEX
            labels[~real[:L]] = IGNORE_INDEX  # padding is never labelled
            out[0][j] = tokens[:L]
            out[1][j] = labels
            out[2][j] = docs[:L] - docs[0]
        return Rows(*out)


class _Writer:
    """Appends documents to ``tokens.bin`` (and ``labels.bin`` from the first labelled
    record on, back-filled with the tokens so far), buffered."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.tokens = open(folder / TOKENS, "wb")
        self.labels = None
        self.buffer: list[tuple[np.ndarray, np.ndarray | None]] = []
        self.buffered = 0
        self.offsets = [0]
        self.max_id, self.max_label = -1, -1
        self.max_target = -1  # of the labels past each document's first token

    def add(
        self, ids: np.ndarray, labels: np.ndarray | None, end: tuple[int, int] | None = None
    ) -> None:
        """One document: `ids` (and `labels`), then `end`, `(EOS id, its label)`, where
        one follows it (buffered beside the ids, not appended onto a copy of them: a
        record can be a whole corpus long)."""
        if labels is not None and self.labels is None:
            self.flush()
            self.tokens.flush()
            shutil.copyfile(self.folder / TOKENS, self.folder / LABELS)  # ids < 2**31
            self.labels = open(self.folder / LABELS, "ab")
        self.buffer.append((ids, labels))
        length = len(ids)
        self.max_id = max(self.max_id, int(ids.max()))
        targets = ids if labels is None else labels
        self.max_label = max(self.max_label, int(targets.max()))
        if len(targets) > 1:
            self.max_target = max(self.max_target, int(targets[1:].max()))
        if end is not None:
            eos, eos_label = end
            target = eos if labels is None else eos_label
            self.buffer.append(
                (
                    np.array([eos], np.int32),
                    None if labels is None else np.array([target], np.int32),
                )
            )
            length += 1
            self.max_id = max(self.max_id, eos)
            self.max_label = max(self.max_label, target)
            self.max_target = max(self.max_target, target)
        self.buffered += length
        self.offsets.append(self.offsets[-1] + length)
        if self.buffered >= _FLUSH_TOKENS:
            self.flush()

    def flush(self) -> None:
        if not self.buffer:
            return
        tokens = _joined([ids for ids, _ in self.buffer], "<u4")
        _write_to(self.tokens, lambda f: f.write(memoryview(tokens)))
        if self.labels is not None:
            labels = _joined([ids if lab is None else lab for ids, lab in self.buffer], "<i4")
            _write_to(self.labels, lambda f: f.write(memoryview(labels)))
        self.buffer, self.buffered = [], 0

    def close(self) -> None:
        self.flush()
        for f in (self.tokens, self.labels):
            if f is not None:
                _write_to(f, lambda f: (f.flush(), os.fsync(f.fileno())))
                f.close()


def _joined(parts: list[np.ndarray], dtype: str) -> np.ndarray:
    """`parts` end to end as `dtype`, in one pass (one copy at most: a record can be a
    whole corpus long)."""
    if len(parts) == 1:
        return np.ascontiguousarray(parts[0]).astype(dtype, copy=False)
    return np.concatenate(parts, dtype=dtype, casting="unsafe")


def _write_to(f, write) -> None:
    """`write(f)`; an OSError it raises (a full disk's, which a file object's write
    raises without a name) names `f`'s file."""
    try:
        write(f)
    except OSError as e:
        raise OSError(e.errno, e.strerror or str(e), f.name) from None


def build_cache(
    source: str | Path,
    cache_dir: str | Path,
    *,
    tokenizer: str | Path | None = None,
    eos_id: int | None = None,
    vocab_size: int | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    chat_turns: str = AUTO,
    chat_template: str | Path | None = None,
) -> TokenCache:
    """Tokenizes ``source`` (any format of :data:`train.readers.READERS`) into a cache at
    ``cache_dir``, one record at a time, written under a temporary name and renamed into
    place when complete (replacing an older cache there only then);
    ``chat_template_kwargs``, ``chat_turns`` and ``chat_template``: template variables
    for every conversation, which conversations are split into an example per assistant
    turn, and the template given in place of the tokenizer's, as
    :func:`train.dataset.load_dataset` takes them.

    Raises:
        ValueError: as :func:`train.dataset.load_dataset` for bad data (nothing is left
            under ``cache_dir``); ``cache_dir`` exists and is neither a cache (one whose
            meta.json a crash emptied is replaced) nor an empty directory; a folder above
            it is not a directory; this user may not write there, or a file size limit
            stops a file (one line naming ``cache_dir``).
    """
    try:
        return _build(
            Path(source),
            Path(cache_dir),
            tokenizer=tokenizer,
            eos_id=eos_id,
            vocab_size=vocab_size,
            chat_template_kwargs=chat_template_kwargs,
            chat_turns=chat_turns,
            chat_template=chat_template,
        )
    except OSError as e:
        if e.errno not in _REFUSED_ERRNOS or not _of_cache(e.filename, Path(cache_dir)):
            raise
        raise ValueError(
            f"{cache_dir}: the token cache cannot be written there ({e.filename}: "
            f"{e.strerror}): it needs a folder this user can write, and files as large as "
            "the cache's"
        ) from None


def _build(
    source: Path,
    cache_dir: Path,
    *,
    tokenizer: str | Path | None,
    eos_id: int | None,
    vocab_size: int | None,
    chat_template_kwargs: dict[str, Any] | None,
    chat_turns: str,
    chat_template: str | Path | None,
) -> TokenCache:
    """:func:`build_cache`'s work."""
    if eos_id is not None and not 0 <= eos_id <= _MAX_ID:
        raise ValueError(f"{eos_id=} must be a non-negative int32 token id")
    if blocked := _file_in_the_way(cache_dir.parent):
        raise ValueError(f"{cache_dir}: {blocked} is not a directory")
    if cache_dir.exists() and not is_cache(cache_dir) and not _damaged_cache(cache_dir):
        if not cache_dir.is_dir() or any(cache_dir.iterdir()):
            raise ValueError(f"{cache_dir} exists and is not a token cache; not writing over it")
    stamp = source_stamp(source) if source_exists(source) else None
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(cache_dir)
    # Made and locked under a name the next build's leftovers sweep leaves alone a
    # while, then given its name: a build of another PID namespace never sees it
    # unlocked.
    new = _aside(cache_dir, STARTING)
    new.mkdir()
    lock = _hold(new)
    tmp = new.with_name(new.name.replace(f".{STARTING}-", f".{TEMPORARY}-", 1))
    try:
        os.rename(new, tmp)
    except BaseException:
        os.close(lock)
        shutil.rmtree(new, ignore_errors=True)
        raise
    try:
        parser = RecordParser(source, tokenizer, chat_template_kwargs, chat_turns, chat_template)
        where = example_where(source)
        word = "line" if READERS[data_format(source)].by_line else "record"
        writer = _Writer(tmp)
        started = last = time.monotonic()
        try:
            for example in read_examples(source, parser):
                if (now := time.monotonic()) - last >= PROGRESS_SECONDS:  # a long build
                    last = now
                    tokens = writer.offsets[-1]
                    print(
                        f"cache {cache_dir}: {len(writer.offsets) - 1:,} {word}s, {tokens:,} "
                        f"tokens so far from {source} ({_size(stamp)}), "
                        f"{tokens / (now - started):,.0f} tokens/s",
                        flush=True,
                    )
                ids, labels = example.input_ids, example.labels
                if vocab_size is not None:
                    check_example_vocab(source, where(example), ids, labels, vocab_size)
                writer.add(ids, labels, document_end(ids, labels, eos_id))
        finally:
            writer.close()
        if len(writer.offsets) == 1:
            raise ValueError(f"{source}: the dataset has no examples")
        _write_synced(tmp / INDEX, lambda f: np.save(f, np.asarray(writer.offsets, np.int64)))
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "source": stamp,
            "tokenizer": tokenizer_stamp(tokenizer) if parser.used_tokenizer else None,
            "chat_template": parser.chat_template
            and {
                **parser.chat_template.stamp,
                "turns": parser.chat_turns,
                "split_conversations": parser.split_conversations,
                "split_examples": parser.split_examples,
            },
            "eos_id": eos_id,
            "masked_tokens": parser.masked_tokens,  # attention_mask's padding, left out
            "num_tokens": writer.offsets[-1],
            "num_documents": len(writer.offsets) - 1,
            "max_id": writer.max_id,
            "max_label": writer.max_label,
            "max_target": writer.max_target,
            "labels": writer.labels is not None,
            "token_dtype": "uint32",
        }
        text = (json.dumps(meta, indent=2) + "\n").encode()
        _write_synced(tmp / META, lambda f: f.write(text))
        _sync_folder(tmp)
        TokenCache(tmp)  # readable before it takes the final name
        try:
            _move_into_place(tmp, cache_dir)
        except OSError:
            if not is_cache(cache_dir):
                raise
            shutil.rmtree(tmp)  # another process put its cache there first: use that one
        else:
            with contextlib.suppress(OSError):
                (cache_dir / BUILD_LOCK).unlink()
            _sync_folder(cache_dir.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        os.close(lock)
    return TokenCache(cache_dir)


# What writing a cache can meet besides a full or failing disk (`train.errors.DISK_ERRNOS`,
# which the trainer and `train.data` report as the machine's): a folder of another user
# (a shared cache directory), a file size limit (`ulimit -f`).
_REFUSED_ERRNOS = (errno.EACCES, errno.EPERM, errno.EFBIG)


def _damaged_cache(folder: Path) -> bool:
    """Whether ``folder`` is a cache whose ``meta.json`` cannot be read (cut short by a
    crash, emptied): it holds a cache's files only, its tokens and index among them,
    and a ``meta.json`` that is not a JSON object (another tool's is kept)."""
    try:
        names = {entry.name for entry in folder.iterdir()}
        if not {META, TOKENS, INDEX} <= names <= {META, TOKENS, LABELS, INDEX, BUILD_LOCK}:
            return False
        meta = json.loads((folder / META).read_text())
    except OSError:
        return False
    except ValueError:  # cut short, empty, not text
        return True
    return not isinstance(meta, dict)


def _of_cache(filename: Any, cache_dir: Path) -> bool:
    """Whether ``filename`` is what a build of ``cache_dir`` writes: the cache, its
    temporary and set-aside folders beside it, or a folder above it."""
    if not isinstance(filename, (str, os.PathLike)):
        return False
    path, cache = Path(os.path.abspath(filename)), Path(os.path.abspath(cache_dir))
    if path in cache.parents:
        return True
    return any(
        p.parent == cache.parent and (p.name == cache.name or p.name.startswith(f".{cache.name}."))
        for p in (path, *path.parents)
    )


def _write_synced(file: Path, write) -> None:
    """Writes ``file`` with ``write(f)`` and flushes it to the disk, so that a cache in
    place after a machine's crash holds every file whole."""
    with open(file, "wb") as f:
        _write_to(f, lambda f: (write(f), f.flush(), os.fsync(f.fileno())))


def _sync_folder(folder: Path) -> None:
    """Flushes ``folder``'s entries (a rename into it, files made in it) to the disk."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _size(stamp: dict | None) -> str:
    """A source's size for a progress line: `2.1 GB`."""
    return "size unknown" if stamp is None else _bytes(stamp["size"])


def _bytes(n: int) -> str:
    """``n`` bytes for a line: `2.1 GB`, `35.2 MB`, `12 kB`."""
    if n >= 1e8:
        return f"{n / 1e9:.1f} GB"
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{round(n / 1e3)} kB"


def _move_into_place(tmp: Path, cache_dir: Path) -> None:
    """Renames the finished ``tmp`` to ``cache_dir``; an old cache there is moved aside
    first and deleted only once the new one is in place (restored if the rename fails)."""
    old = None
    if cache_dir.exists():
        old = _aside(cache_dir, REPLACED)
        os.rename(cache_dir, old)
    try:
        os.rename(tmp, cache_dir)
    except OSError:
        if old is not None:
            os.rename(old, cache_dir)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# The folders a build keeps beside `cache_dir` while it runs: `.<name>.<kind>-<owner>`,
# the cache being written and the one it replaces (until the new one is in place). The
# owner is `<host>@<process id>@<its start time>@<8 hex digits>`, so that the next build
# can tell the leftovers of a build killed outright (SIGKILL, the out-of-memory killer)
# from a build still running.
TEMPORARY = "tmp"
REPLACED = "old"
STARTING = "new"  # a build's folder before it holds its lock (removed after a minute)
STARTING_SECONDS = 60.0
# A build holds an exclusive lock (flock) on this file in the folder it writes, from
# its start until its cache is in place: a process id cannot tell a build in another
# PID namespace (a container) on this host from a dead one, the lock can.
BUILD_LOCK = ".building"


def _hold(folder: Path) -> int:
    """Takes the build lock of ``folder``; the open descriptor holds it until closed.
    On a filesystem without locks the build goes on unlocked (its process id still
    tells a build of this PID namespace from a dead one)."""
    fd = os.open(folder / BUILD_LOCK, os.O_WRONLY | os.O_CREAT, 0o644)
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def _held(folder: Path) -> bool:
    """Whether a running build holds the lock of ``folder``."""
    try:
        fd = os.open(folder / BUILD_LOCK, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
    return False


def _aside(cache_dir: Path, kind: str) -> Path:
    """A new folder name beside ``cache_dir`` for a ``kind`` folder of this process."""
    start = processes.started(os.getpid()) or "?"
    owner = f"{processes.host()}@{os.getpid()}@{start}@{uuid.uuid4().hex[:8]}"
    return cache_dir.parent / f".{cache_dir.name}.{kind}-{owner}"


def remove_leftovers(cache_dir: str | Path) -> list[Path]:
    """Removes what builds of ``cache_dir`` killed outright left beside it (a cache half
    written, one being replaced), each with a line: only folders of this host whose
    process has ended. Others, of another host or named as before owners were recorded,
    are left with a line naming them; those of running builds (their process runs, or
    they hold :data:`BUILD_LOCK`), silently. Returns the folders removed."""
    cache_dir = Path(cache_dir)
    removed = []
    entries = sorted(cache_dir.parent.glob(f".{glob.escape(cache_dir.name)}.*-*"))
    # A folder being replaced belongs to a build finishing: its lock is in the cache it
    # is putting in place, or still in its folder of the new cache.
    finishing = _held(cache_dir) or any(
        _held(e) for e in entries if e.name.startswith(f".{cache_dir.name}.{TEMPORARY}-")
    )
    for entry in entries:
        kind, _, owner = entry.name[len(cache_dir.name) + 2 :].partition("-")
        if kind not in (TEMPORARY, REPLACED, STARTING) or not entry.is_dir() or entry.is_symlink():
            continue
        try:
            if kind == STARTING and time.time() - entry.stat().st_mtime < STARTING_SECONDS:
                continue  # its build may be about to lock it
        except OSError:  # gone meanwhile
            continue
        host, pid, start, tag = (owner.split("@") + [""] * 4)[:4]
        if not (pid.isdigit() and len(tag) == 8):  # not named by this version
            if len(owner) == 8:
                print(
                    f"{cache_dir}: left as it is: {entry.name}, what a cache build stopped "
                    "outright left (remove it if no build of this cache runs)",
                    flush=True,
                )
            continue
        if host != processes.host():
            print(
                f"{cache_dir}: left as it is: {entry.name}, a cache build's folder on host "
                f"{host} (remove it if no build of this cache runs there)",
                flush=True,
            )
            continue
        if processes.runs({"pid": int(pid), "started": None if start == "?" else start}):
            continue
        if _held(entry) or (kind == REPLACED and finishing):  # another PID namespace's
            continue
        size = _folder_bytes(entry)
        shutil.rmtree(entry, ignore_errors=True)
        if not entry.exists():
            removed.append(entry)
            print(
                f"{cache_dir}: removed {entry.name} ({_bytes(size)}), left by a cache "
                f"build that was stopped outright (process {pid} has ended)",
                flush=True,
            )
    return removed


def _folder_bytes(folder: Path) -> int:
    """The sizes of the files under ``folder``, added up (0 for any it cannot read)."""
    total = 0
    for path in folder.rglob("*"):
        with contextlib.suppress(OSError):
            if path.is_file() and not path.is_symlink():
                total += path.stat().st_size
    return total


def ensure_cache(
    source: str | Path,
    cache_dir: str | Path,
    *,
    tokenizer: str | Path | None = None,
    eos_id: int | None = None,
    vocab_size: int | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    chat_turns: str = AUTO,
    chat_template: str | Path | None = None,
    replace_other_source: bool = True,
    announce: bool = False,
    source_checked: bool = False,
) -> tuple[TokenCache, bool]:
    """``(cache, built)``: the cache at ``cache_dir`` if it matches ``source``,
    ``tokenizer``, ``eos_id``, ``chat_template_kwargs``, ``chat_turns`` and
    ``chat_template`` (see
    :meth:`TokenCache.mismatch`), else a new one built there (replacing the stale one).
    Without ``replace_other_source``, a cache there of another data file is refused
    (ValueError), not replaced: the tokenization of another corpus is kept. ``announce``:
    a first build says so as it starts (a rebuild always says why). ``source_checked``:
    another process has just checked the cache against its own copy of ``source`` (a
    multi-host run sharing the cache, each host with its data on its own disk, their
    times apart): this one reads it, checking the settings only.

    A cache that another build put in place as this one finished, of other settings or
    from a source changed while it was read, is refused (ValueError): run again."""
    source = Path(source)
    if not source_exists(source):
        raise ValueError(f"{source}: no such data file")
    settings = dict(
        tokenizer=tokenizer,
        eos_id=eos_id,
        chat_template_kwargs=chat_template_kwargs,
        chat_turns=chat_turns,
        chat_template=chat_template,
    )
    if is_cache(cache_dir):
        other = None
        try:
            cache = open_cache(cache_dir)
            other = (cache.meta.get("source") or {}).get("path")
            stale = cache.mismatch(source, check_source=not source_checked, **settings)
        except (ValueError, OSError, KeyError) as e:
            stale = [f"unreadable ({e})"]
        if not replace_other_source and other and other != source_path(source):
            raise ValueError(
                f"{cache_dir} holds the token cache of another data file, {other}: pass "
                "--overwrite to replace it (nothing was written)"
            )
        if not stale:
            if vocab_size is not None:
                cache.check_vocab(vocab_size)
            remove_leftovers(cache_dir)  # a build's, killed once its cache was in place
            return cache, False
        print(f"token cache {cache_dir} is stale ({'; '.join(stale)}): rebuilding", flush=True)
    elif _damaged_cache(Path(cache_dir)):
        damaged = f"token cache {cache_dir} is damaged (its {META} is unreadable): rebuilding"
        print(damaged, flush=True)
    elif announce:  # the first build: a large corpus takes minutes to its first progress line
        print(f"token cache: tokenizing {source} into {cache_dir}, once", flush=True)
    cache = build_cache(source, cache_dir, vocab_size=vocab_size, **settings)
    if stale := cache.mismatch(source, **settings):  # what is in place now is another's
        raise ValueError(
            f"{cache_dir}: the token cache in place as this build finished is not this "
            f"run's ({'; '.join(stale)}): another build replaced it, or {source} changed "
            "while it was read; run again"
        )
    return cache, True


def _file_in_the_way(folder: str | Path) -> Path | None:
    """The path that keeps ``folder`` from being a directory: ``folder`` itself or a
    folder above it that exists as something else (a file, ``/dev/null``); None if none."""
    folder = Path(folder)
    for path in (folder, *folder.parents):
        if path.exists():
            return None if path.is_dir() else path
    return None


def cache_location(
    source: str | Path,
    cache_root: str | Path,
    *,
    tokenizer: str | Path | None = None,
    eos_id: int | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    chat_turns: str = AUTO,
    chat_template: str | Path | None = None,
) -> Path:
    """Where ``--data_cache_dir`` keeps the cache of ``source`` tokenized with these
    settings: ``<root>/<name>-<hash of its absolute path and the settings>`` (a
    pattern's name from its folder on, its wildcards and slashes ``_``), so that runs
    tokenizing one corpus two ways keep a cache each, not one rebuilt by turns."""
    path = source_path(source)
    settings = {
        "tokenizer": str(tokenizer_file(tokenizer).resolve()) if tokenizer else None,
        "eos_id": eos_id,
        "chat_template_kwargs": chat_template_kwargs or None,
        "chat_turns": chat_turns,
        "chat_template": str(Path(chat_template).resolve()) if chat_template else None,
    }
    key = json.dumps([path, settings], sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    name = os.path.basename(path)
    if is_pattern(source):  # from its folder on: `corpus/*.jsonl.gz` -> `corpus_.jsonl.gz`
        name = os.path.relpath(path, os.path.dirname(pattern_folder(path)))
        name = re.sub(r"[*?\[\]/]+", "_", name)
    return Path(cache_root) / f"{name}-{digest}"


def _adopt_former(source: str | Path, location: Path, settings: dict[str, Any]) -> None:
    """Where ``location`` is not there yet, the cache of ``source`` that an earlier
    jflash named by the hash of its source's path alone, taken under its name now where
    it is this run's (a line says so): a corpus is not tokenized again for the new name."""
    if os.path.lexists(location):
        return
    digest = hashlib.sha256(source_path(source).encode()).hexdigest()[:12]
    former = location.with_name(f"{location.name.rsplit('-', 1)[0]}-{digest}")
    if former == location or not is_cache(former):
        return
    try:
        if open_cache(former).mismatch(source, **settings):
            return
        os.rename(former, location)
    except (ValueError, OSError, KeyError):
        return  # another run's cache there, or one that took the name first
    print(f"token cache: {former} renamed {location} (named by its settings too)", flush=True)


def packed_rows(
    path: str | Path,
    seq_len: int,
    *,
    tokenizer: str | Path | None = None,
    eos_id: int | None = None,
    vocab_size: int | None = None,
    cache_root: str | Path | None = None,
    pad_last: bool = False,
    packing: str = "stream",
    chat_template_kwargs: dict[str, Any] | None = None,
    chat_turns: str = AUTO,
    chat_template: str | Path | None = None,
    source_checked: bool = False,
) -> Rows | CachedRows:
    """The trainer's rows of ``path``: a token cache directory (checked against
    ``eos_id``, ``tokenizer``, ``chat_template_kwargs``, ``chat_turns``,
    ``chat_template`` and its recorded source), a data file cached under
    ``cache_root`` (built on first use, rebuilt when stale), or without ``cache_root``
    a data file loaded into memory. ``pad_last``: the tail that does not fill a row
    makes a last row, filled up (evaluation), instead of being dropped. ``packing``:
    ``"stream"`` or ``"whole"`` (:mod:`train.dataset`); ``"whole"`` prints how many of
    the rows' tokens are padding. A cache read as it is (not built now) says in a line
    how many conversations it split, as reading them says it (:func:`_note_split`).
    ``source_checked``: as :func:`ensure_cache` takes it."""
    settings = dict(
        tokenizer=tokenizer,
        eos_id=eos_id,
        chat_template_kwargs=chat_template_kwargs,
        chat_turns=chat_turns,
        chat_template=chat_template,
    )
    if is_cache(path):
        cache = open_cache(path, vocab_size=vocab_size)
        stale = cache.mismatch(**settings)
        if stale:
            flags = "--no-eos" if eos_id is None else f"--eos-id {eos_id}"
            if tokenizer is not None and cache.meta["tokenizer"] is not None:
                flags += f" --tokenizer {tokenizer}"  # its text is this run's tokenizer's
            if chat_template_kwargs and cache.meta.get("chat_template") is not None:
                flags += f" --chat-template-kwargs {shlex.quote(json.dumps(chat_template_kwargs))}"
            if chat_turns != AUTO and cache.meta.get("chat_template") is not None:
                flags += f" --chat-turns {chat_turns}"
            if chat_template is not None and cache.meta.get("chat_template") is not None:
                flags += f" --chat-template {shlex.quote(str(chat_template))}"
            raise ValueError(
                f"{path}: the token cache does not match this run ({'; '.join(stale)}); "
                "rebuild it: python -m train.data cache "
                f"{shlex.quote(str(cache.meta['source']['path']))} {path} {flags}"
            )
        _note_split(path, cache)
        _note_cut_prompts(path, seq_len, cache, eos_id)
        _note_stream_cuts(path, seq_len, packing, cache, np.diff(cache.offsets))
        return _note_padding(path, cache.rows(seq_len, pad_last=pad_last, packing=packing))
    if cache_root:
        if blocked := _file_in_the_way(cache_root):
            raise ValueError(f"--data_cache_dir={str(cache_root)!r}: {blocked} is not a directory")
        location = cache_location(path, cache_root, **settings)
        _adopt_former(path, location, settings)
        cache, built = ensure_cache(
            path,
            location,
            vocab_size=vocab_size,
            announce=True,
            source_checked=source_checked,
            **settings,
        )
        if built:
            print(f"token cache: wrote {location} ({cache.num_tokens} tokens)", flush=True)
        else:
            _note_split(path, cache)
        _note_cut_prompts(path, seq_len, cache, eos_id)
        _note_stream_cuts(path, seq_len, packing, cache, np.diff(cache.offsets))
        return _note_padding(path, cache.rows(seq_len, pad_last=pad_last, packing=packing))
    dataset = load_dataset(
        path,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        chat_template_kwargs=chat_template_kwargs,
        chat_turns=chat_turns,
        chat_template=chat_template,
    )
    lengths = dataset.stream_lengths(eos_id)
    _note_cut_prompts(path, seq_len, dataset, eos_id)
    _note_stream_cuts(path, seq_len, packing, dataset, lengths)
    rows, padding, tail = dataset.rows_and_padding(
        seq_len, eos_id=eos_id, pad_last=pad_last, packing=packing
    )
    if packing == "whole":
        _say_padding(path, rows.num_rows, seq_len, padding)
    _say_tail(path, seq_len, *tail)
    return rows


def _note_split(path: str | Path, cache: TokenCache) -> None:
    """One line where the cache's conversations were split into an example per
    assistant turn, in the words reading them prints (:func:`train.records.split_note`)."""
    if note := cache_split_note(cache):
        print(f"{path}: token cache: {note}", flush=True)


def cache_split_note(cache: TokenCache) -> str | None:
    """:func:`train.records.split_note` of the conversations the cache split, or None
    where it split none."""
    chat = cache.meta.get("chat_template") or {}
    if not chat.get("split_conversations"):
        return None
    return split_note(chat["split_conversations"], chat["split_examples"], chat["turns"])


def _note_padding(path: str | Path, rows: CachedRows) -> CachedRows:
    if rows.packing == "whole":
        _say_padding(path, rows.num_rows, rows.seq_len, rows.padding)
    _say_tail(path, rows.seq_len, *rows.tail)
    return rows


def _say_tail(path: str | Path, seq_len: int, tokens: int, examples: int) -> None:
    """One line where the rows leave a tail out (less than a row: not trained on), and
    how many examples lie wholly in it."""
    if not tokens:
        return
    whole = f"; {plural(examples, 'whole example')} among them" if examples else ""
    print(
        f"{path}: the last {plural(tokens, 'token', grouped=True)} (less than a row of "
        f"{seq_len:,}{whole}) {'is' if tokens == 1 else 'are'} not trained on",
        flush=True,
    )


def _say_padding(path: str | Path, num_rows: int, seq_len: int, padding: int) -> None:
    """One line: how much of ``"whole"`` packing's rows is padding (compute on nothing)."""
    tokens = num_rows * seq_len
    print(
        f"{path}: --packing whole: {padding:,} of the rows' {tokens:,} tokens "
        f"({padding / tokens:.1%}) are padding",
        flush=True,
    )


def _note_stream_cuts(
    path: str | Path,
    seq_len: int,
    packing: str,
    data: TokenDataset | TokenCache,
    lengths: np.ndarray,
) -> None:
    """With ``"stream"`` packing, one line where examples with a prompt that fit a row
    are cut at a row end anyway (``lengths``: each example's tokens in the stream, EOS
    included): their tokens past the cut are predicted without the start of their
    prompt, which ``--packing whole`` avoids."""
    if packing != "stream":
        return
    prompted = data.prompted()
    if not prompted.any():
        return
    ends = np.cumsum(lengths)
    starts = ends - lengths
    cut = prompted & (lengths <= seq_len) & (starts // seq_len != (ends - 1) // seq_len)
    if n := int(np.count_nonzero(cut)):
        print(
            f"{path}: {n} of {int(np.count_nonzero(prompted))} examples with a prompt are cut "
            f"at a row end of {seq_len} tokens (their tokens past the cut are predicted "
            "without the start of their prompt); --packing whole keeps each that fits a row "
            "in one",
            flush=True,
        )


def _note_cut_prompts(
    path: str | Path, seq_len: int, data: TokenDataset | TokenCache, eos_id: int | None
) -> None:
    """One line where examples with a prompt are longer than a row: packing cuts them
    across rows, and their completions past the first row train without the prompt's
    start (a silent loss of context otherwise)."""
    cut = data.prompted_longer_than(seq_len, eos_id)
    if not cut.size:
        return
    lengths = data.content_lengths(eos_id)[cut]
    if isinstance(data, TokenCache):
        # A cache keeps no line numbers: its examples are counted (from 1) in file order,
        # a split conversation's turns each one.
        where = f"the cache's example {int(cut[np.argmax(lengths)]) + 1}"
    else:
        where = data.where(int(cut[np.argmax(lengths)]))
    plural = cut.size > 1
    many = f"example{'s' * plural} with a prompt (tokens labelled -100) {'are' if plural else 'is'}"
    print(
        f"{path}: {cut.size} {many} longer than a row of {seq_len} tokens (the longest: "
        f"{int(lengths.max())} tokens, {where}): each is cut across rows, and its tokens "
        "past its first row are predicted without the start of its prompt; raise "
        "--model_max_length or shorten them",
        flush=True,
    )
