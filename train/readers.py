"""Data file readers: a table of formats, each turning a file into examples of token ids.

Formats (chosen by extension, one entry each in :data:`READERS`):

- ``.pkl``: a pickled list of examples (the ``data.pkl`` of PyTorch + LightSeq training
  scripts). Each example is a list / 1-D array of token ids, or a dict: a record as
  below. Unpickling runs code: load trusted files only.
- ``.jsonl``: one JSON object per line, a record as below. Blank lines are skipped;
  errors name the 1-based line number (blank lines counted, as an editor shows it).
  Other formats' errors name the 0-based index of the record.
- ``.npy``: an integer array ``[N, L]`` (N examples) or ``[L]`` (one token stream),
  memory-mapped while it is read.
- ``.parquet``: a column ``input_ids`` (optional ``labels``), ``text``, columns
  ``prompt`` and ``completion``, or a column ``messages`` (a list of structs; with
  optional columns ``tools`` and ``chat_template_kwargs``, also beside ``prompt`` and
  ``completion``) (``pyarrow``, from the ``hf`` extra), read a batch of rows at a time.
- a directory written by HF ``datasets``' ``Dataset.save_to_disk`` (key
  ``save_to_disk``), with the same columns (the ``hf`` extra).
- ``.jsonl`` and ``.pkl`` compressed (:data:`COMPRESSIONS`: ``a.jsonl.gz``), decompressed
  as they are read.
- a folder of data files, or a glob pattern of them (key ``files``): each file read by
  its own format, one after another in sorted order (:func:`data_files`); examples are
  named by their file and line or record. A token cache's folder and a training run's
  output directory under it are left out.

Each record is turned into token ids by :class:`train.records.RecordParser` (what a
record may hold, and how text, prompt/completion and conversations are tokenized).

:func:`read_examples` yields a file's examples one at a time; the in-memory dataset
(:func:`train.dataset.load_dataset`) and the token cache (:mod:`train.data_cache`) both
read every format through it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import itertools
import json
import os
import pickle
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from train import patterns
from train.patterns import is_pattern, pattern_folder
from train.records import (
    ATTENTION_MASK,
    CHAT_TEMPLATE_KWARGS,
    MESSAGES,
    PROMPT_COMPLETION,
    TOOLS,
    RecordParser,
    split_note,
)
from train.run_files import LOG_FILE, SETTINGS_FILE, is_run_output
from train.words import plural

_MAX_ID = np.iinfo(np.int32).max


class Example(NamedTuple):
    """One example as a reader yields it: ``number`` (the 1-based line of a ``.jsonl``
    file, else the 0-based record index), int32 ``input_ids``, int32 ``labels`` or None
    (the tokens themselves); ``file``: which of a source's :func:`data_files` it is in
    (0 for a single file)."""

    number: int
    input_ids: np.ndarray
    labels: np.ndarray | None
    file: int = 0


@dataclasses.dataclass(frozen=True)
class Reader:
    """One data format: ``read(path, parser)`` yields its :class:`Example` s in order;
    ``by_line``: errors and :attr:`train.dataset.TokenDataset.lines` name lines, not
    record indices."""

    read: Callable[[Path, RecordParser], Iterator[Example]]
    by_line: bool = False


def read_examples(path: str | Path, parser: RecordParser) -> Iterator[Example]:
    """The examples of ``path`` in order, one at a time (its reader from :data:`READERS`)."""
    path = Path(path)
    suffix = data_format(path)
    if suffix not in (SAVED_DATASET, FILES) and not path.is_file():
        raise ValueError(f"{path}: not a file")
    return _noting_skips(READERS[suffix].read(path, parser), parser)


def example_where(path: str | Path) -> Callable[[Example], str]:
    """How errors name an example of ``path``: ``line 3`` (``.jsonl``), ``record 3``
    (other formats); for a directory or pattern of files, the file too (``a.jsonl, line
    3``, its path from the directory, or the pattern's folder)."""
    fmt = data_format(path)
    if fmt != FILES:
        word = "line" if READERS[fmt].by_line else "record"
        return lambda example: f"{word} {example.number}"
    files = file_words(path)
    return lambda example: "{}, {} {}".format(*files[example.file], example.number)


def file_words(path: str | Path) -> list[tuple[str, str]]:
    """For each of a directory's or pattern's :func:`data_files`: its name as errors give
    it (from the directory, or the pattern's folder) and what its examples are numbered
    by (``line`` or ``record``)."""
    files = data_files(path)
    base = Path(path) if not is_pattern(path) else Path(pattern_folder(os.path.expanduser(path)))
    return [
        (
            os.path.relpath(file, base),
            "line" if READERS[data_format(file)].by_line else "record",
        )
        for file in files
    ]


def _noting_skips(examples: Iterator[Example], parser: RecordParser) -> Iterator[Example]:
    """`examples`, then one log line for the records that reading skipped: texts, or
    prompt/completion records' completions, that tokenize to nothing, and conversations
    without an assistant turn to learn; and one for the conversations split into an
    example per assistant turn (:func:`split_note`)."""
    yield from examples
    if unused := parser.unused_chat_settings:
        print(
            f"{parser.path}: no record holds 'messages', so the chat settings given "
            f"({', '.join(unused)}) change nothing in it (a chat template renders "
            "conversations only)",
            flush=True,
        )
    if n := parser.masked_tokens:
        print(
            f"{parser.path}: left out {plural(n, 'token')} that the records' attention_mask "
            "marks as padding",
            flush=True,
        )
    if parser.split_conversations:
        note = split_note(parser.split_conversations, parser.split_examples, parser.chat_turns)
        print(f"{parser.path}: {note}", flush=True)
    skipped = [
        f"{n} record{'s' * (n != 1)} whose {why}"
        for n, why in (
            (parser.empty_texts, "'text' tokenizes to nothing (empty text)"),
            (parser.empty_ids, "'input_ids' is empty"),
            (parser.empty_completions, "'completion' tokenizes to nothing (no token to learn)"),
            (
                parser.empty_conversations
                - parser.empty_completion_turns
                - parser.unrendered_turns,
                "'messages' have no assistant turn (no token to learn)",
            ),
            (
                parser.empty_completion_turns,
                "'completion' messages have no assistant turn (no token to learn)",
            ),
            (
                parser.unrendered_turns,
                "assistant turns render to no token (the chat template writes nothing of them?)",
            ),
        )
        if n
    ]
    if skipped:
        print(f"{parser.path}: skipped {' and '.join(skipped)}", flush=True)
    if n := parser.opening_turns:
        print(
            f"{parser.path}: {n} conversation{'s' * (n != 1)} open{'s' * (n == 1)} with an "
            "assistant message: context, not learned (nothing before it to answer)",
            flush=True,
        )
    if parser.unrendered_roles:
        counts = ", ".join(f"{n} {role!r}" for role, n in parser.unrendered_roles.items())
        print(
            f"{parser.path}: the chat template writes nothing of some messages ({counts}): "
            "their content or tool calls are in no rendering (a role it skips, or tool calls "
            "it does not write?), so the model never sees them",
            flush=True,
        )
    if n := parser.unrendered_reasoning:
        whose = "messages'" if n != 1 else "message's"
        print(
            f"{parser.path}: the chat template writes nothing of {n} assistant {whose} "
            "reasoning: not learned (a template that does not render reasoning_content; "
            "--chat_template gives one that does)",
            flush=True,
        )


def records_reader(
    read: Callable[[Path], Iterator[tuple[int, Any]]], by_line: bool = False
) -> Callable[[Path, RecordParser], Iterator[Example]]:
    """A reader from a function yielding ``(number, record)``: records are parsed (ids,
    labels, or text tokenized, ``_CHUNK`` records per ``encode_batch`` call) a chunk at
    a time, so the file is never all in memory as Python objects."""
    word = "line" if by_line else "record"

    def parse_all(path: Path, parser: RecordParser) -> Iterator[Example]:
        for chunk in itertools.batched(read(path), _CHUNK):
            wheres = [f"{word} {number}" for number, _ in chunk]
            tokenized = parser.tokenize_texts(wheres, [record for _, record in chunk])
            for where, (number, record), tokens in zip(wheres, chunk, tokenized, strict=True):
                parsed = parser.parse(where, record, tokens)
                for ids, labels in parsed if isinstance(parsed, list) else [parsed]:
                    if ids.size:  # else nothing to train on (counted by the parser)
                        yield Example(number, ids, labels)

    return parse_all


_CHUNK = 512  # records parsed (and their texts tokenized) together


# What a pickle of examples may name: containers, text, numbers and numpy arrays.
# Unpickling calls whatever a pickle names, so a data file from elsewhere could run any
# code; anything else is refused (as `torch.load(weights_only=True)` refuses it).
_PICKLE_GLOBALS = {
    *(
        ("builtins", name)
        for name in ("list", "dict", "tuple", "set", "frozenset", "str", "bytes", "bytearray")
        + ("int", "float", "bool", "complex")
    ),
    ("collections", "OrderedDict"),
    ("collections", "defaultdict"),  # its default factory is checked as any other name
    ("_codecs", "encode"),  # protocol 2's bytes
    ("numpy", "dtype"),
    ("numpy", "ndarray"),
    *(
        (f"numpy.{core}.{module}", name)
        for core in ("core", "_core")
        for module, name in (("multiarray", "_reconstruct"), ("multiarray", "scalar"))
        + (("numeric", "_frombuffer"),)
    ),
}


class UnsafePickle(ValueError):
    """A pickle naming something other than `_PICKLE_GLOBALS`."""


class _DataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        plain = "builtins" if module == "__builtin__" else module  # protocols 0-2
        if (plain, name) not in _PICKLE_GLOBALS and not (
            module.startswith("numpy.dtypes") and name.endswith("DType")
        ):
            raise UnsafePickle(
                f"it names {plain}.{name}, which examples have no need of; a .pkl is read "
                "only where it holds lists, dicts, text, numbers and numpy arrays "
                "(unpickling runs what a pickle names: convert other data to .jsonl)"
            )
        return super().find_class(module, name)


def _read_pkl(path: Path) -> Iterator[tuple[int, Any]]:
    try:
        with open_data(path) as f:
            data = _DataUnpickler(f).load()
    except UnsafePickle as e:
        raise ValueError(f"{path}: {e}") from None
    except Exception as e:  # noqa: BLE001 - any unpickling failure: name the file
        raise ValueError(f"{path}: not a readable pickle ({type(e).__name__}: {e})") from None
    if not isinstance(data, (list, tuple)):
        raise ValueError(f"{path}: expected a pickled list of examples, got {type(data).__name__}")
    return enumerate(data)


def read_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """``(1-based line number, parsed object)`` for each non-blank line.

    A generator, read line by line: the caller turns each record into int32 arrays
    before the next is parsed, so the file's JSON (Python ints, ~9x the bytes of the
    arrays) is never all in memory at once. A UTF-8 byte order mark opening the file
    (as Windows editors save it) is dropped. A compressed file (:data:`COMPRESSIONS`)
    is decompressed as it is read.
    """
    with open_data(path) as f:
        for i, raw in _numbered(path, f):
            try:
                line = raw.decode("utf-8-sig" if i == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}: line {i}: not UTF-8 text ({e})") from None
            if not line.strip():
                continue
            try:
                yield i, json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as e:
                # json's message ends "at" where it names a place ("Unterminated string
                # starting at"): the column of the file's line i, the one json read.
                at = " " if e.msg.endswith(" at") else " at "
                raise ValueError(
                    f"{path}: line {i}: invalid JSON: {e.msg}{at}column {e.colno}"
                ) from None


def _numbered(path: Path, f) -> Iterator[tuple[int, bytes]]:
    """``(1-based line number, line)`` of an open file; a decompression error (a damaged
    or truncated ``.gz``) is a ValueError naming the file and the line it stopped at."""
    lines = iter(f)
    for i in itertools.count(1):
        try:
            raw = next(lines)
        except StopIteration:
            return
        except Exception as e:  # noqa: BLE001 - gzip, bz2, lzma and zstandard differ
            raise ValueError(
                f"{path}: line {i}: cannot be read ({type(e).__name__}: {e}); a damaged or "
                "truncated compressed file?"
            ) from None
        yield i, raw


# Compressed data files: the compression's extension after the format's
# (`corpus.jsonl.gz`), decompressed as they are read. Only the formats read as a stream
# can be: `.npy` is memory-mapped and `.parquet` compresses inside the file.
COMPRESSIONS = {".gz": "gzip", ".bz2": "bz2", ".xz": "lzma", ".zst": "zstandard"}
STREAMED_FORMATS = (".jsonl", ".pkl")


def open_data(path: Path):
    """``path`` open for reading bytes, decompressed where its extension is one of
    :data:`COMPRESSIONS` (``.zst`` needs the ``zstandard`` package); ValueError naming
    a file that cannot be read, or a compressed one that is empty (not even a header)."""
    module = COMPRESSIONS.get(path.suffix.lower())
    try:
        if module is not None and os.path.getsize(path) == 0:
            raise ValueError(f"{path}: an empty file, not {path.suffix} data (not even a header)")
        if module is None:
            return open(path, "rb")
        if module == "zstandard":
            zstandard = _optional(module, path, extra="zstd")
            return io.BufferedReader(_ZstdStream(path, zstandard))
        return importlib.import_module(module).open(path, "rb")
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror or e})") from None


class _ZstdStream(io.RawIOBase):
    """A ``.zst`` file's frames decompressed one after another. EOFError where the file
    ends inside a frame: ``zstandard``'s own reader returns what it has there, so a
    truncated file would read as a shorter dataset."""

    def __init__(self, path: Path, zstandard):
        self._file = open(path, "rb")
        self._frame = zstandard.ZstdDecompressor().decompressobj
        self._obj, self._fed = self._frame(), False  # the frame being read; any byte of it
        self._out, self._at = b"", 0  # decompressed bytes, and how many were read

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self._at == len(self._out):
            data = self._file.read(1 << 10)  # 1 KiB a time: a bound on its output
            if not data:
                if self._fed and not self._obj.eof:
                    raise EOFError("the file ends inside a zstd frame")
                return 0
            self._out, self._at = self._decompress(data), 0
        n = min(len(buffer), len(self._out) - self._at)
        buffer[:n] = self._out[self._at : self._at + n]
        self._at += n
        return n

    def _decompress(self, data: bytes) -> bytes:
        out = []
        while data:
            self._fed = True
            out.append(self._obj.decompress(data))
            if not self._obj.eof:
                break
            data = self._obj.unused_data  # the next frame's start
            self._obj, self._fed = self._frame(), False
        return b"".join(out)

    def close(self) -> None:
        self._file.close()
        super().close()


def _read_files(path: Path, parser: RecordParser) -> Iterator[Example]:
    """The examples of a directory's or a pattern's :func:`data_files`, one file after
    another; errors name the file (the parser's ``path`` while it is read). One line
    names the files (and those of a folder left out), one warns of several splits."""
    source, (files, others) = parser.path, _scan(path)
    names = [name for name, _ in file_words(path)]
    shown = ", ".join(names if len(names) <= 6 else [*names[:3], "...", *names[-2:]])
    left_out = _left_out(others) + _runs_left_out(listing(path).runs)
    print(f"{path}: reading {plural(len(names), 'data file')}: {shown}{left_out}", flush=True)
    if len(splits := split_names(names)) > 1:
        base = Path(pattern_folder(str(path)) if is_pattern(path) else path)
        split = "train" if "train" in splits else splits[0]
        print(
            f"warning: {path}: its files' names hold several splits ({', '.join(splits)}), "
            f"all read as one dataset; a pattern picks one (e.g. "
            f"'{_split_pattern(base, names, split)}')",
            flush=True,
        )
    for k, file in enumerate(files):
        parser.path = file
        for example in READERS[data_format(file)].read(file, parser):
            yield example._replace(file=k)
    parser.path = source


def _left_out(others: list[Path]) -> str:
    """`; left out 2 other files (.json.gz, .md)` for a folder's files of no known
    format (JSON arrays in `.json` files among them: a hint that `.jsonl` is read)."""
    if not others:
        return ""
    kinds = sorted({"".join(p.suffixes[-2:]).lower() or p.name for p in others})
    shown = ", ".join(kinds[:5] + ["..."] * (len(kinds) > 5))
    json_hint = (
        "; one JSON record a line is read from .jsonl files"
        if any(".json" in p.name.lower() and ".jsonl" not in p.name.lower() for p in others)
        else ""
    )
    text_hint = (
        '; plain text is not read: a .jsonl file\'s {"text": ...} records are'
        if any(_is_plain_text(p) for p in others) and not json_hint
        else ""
    )
    return f"; left out {plural(len(others), 'other file')} ({shown}){json_hint}{text_hint}"


# Plain text files by name (`.txt`, `.txt.gz`, ...): not data, with a hint (a README.md
# beside data is left out without one).
PLAIN_TEXT_ENDINGS = (".txt", ".text")


def _is_plain_text(path: Path) -> bool:
    """Whether ``path`` is named as plain text (compressed or not)."""
    name = path.name.lower()
    for compression in ("", *COMPRESSIONS):
        if any(name.endswith(e + compression) for e in PLAIN_TEXT_ENDINGS):
            return True
    return False


def _runs_left_out(runs: list[Path]) -> str:
    """`; left out 2 training runs' output directories (runs/a, runs/b)`."""
    if not runs:
        return ""
    shown = ", ".join([str(r) for r in runs[:3]] + ["..."] * (len(runs) > 3))
    what = (
        "a training run's output directory"
        if len(runs) == 1
        else (f"{len(runs)} training runs' output directories")
    )
    return f"; left out {what} ({shown})"


# A data split's names as they appear in file and folder names (`train-00000-of-00002`,
# `validation/`), and the name the warning gives each.
SPLIT_WORDS = {
    "train": "train",
    "training": "train",
    "test": "test",
    "validation": "validation",
    "valid": "validation",
    "val": "validation",
    "dev": "dev",
    "eval": "eval",
    "evaluation": "eval",
}


def _split_pattern(base: Path, names: Sequence[str], split: str) -> str:
    """A pattern of the files of one split: ``base/**/*train*`` where a file's name says
    it, ``base/**/*train*/**`` where a folder's does."""
    for name in names:
        *folders, last = Path(name).parts
        for part, tail in [(last, "")] + [(f, "/**") for f in reversed(folders)]:
            for word in re.split(r"[^a-z]+", part.lower()):
                if SPLIT_WORDS.get(word) == split:
                    return f"{base}/**/*{word}*{tail}"
    return f"{base}/**/*{split}*"


def split_names(names: Sequence[str]) -> list[str]:
    """The splits (:data:`SPLIT_WORDS`) that the files' relative ``names`` hold, as
    words of their paths, sorted; more than one: a folder of several splits."""
    found = set()
    for name in names:
        for word in re.split(r"[^a-z]+", name.lower()):
            if word in SPLIT_WORDS:
                found.add(SPLIT_WORDS[word])
    return sorted(found)


def data_files(path: str | Path) -> list[Path]:
    """The data files that ``path`` names, in sorted order, each read by its own
    format's reader: those a glob pattern matches (``**`` for any folders between;
    each must be of a known format), or those under a directory (at any depth; hidden
    files and folders and files of no known format left out). Files in a token cache's
    folder are left out, and a file or folder reached twice (links) is read once.
    ValueError where there are none, or a folder cannot be listed."""
    return _scan(path)[0]


# The listings of folders and patterns made inside `one_listing` (None outside it).
class Listing(NamedTuple):
    """What listing a folder or pattern found: the data files, in sorted order (each
    real file once, those in a token cache's folder or a run's output directory left
    out), the other files a folder holds (of no known format), links to nothing that
    name a data file, the folders a pattern matched, the folders walked
    (:class:`train.patterns.Folder`) and the run output directories left out."""

    files: list[Path]
    others: list[Path]
    broken: list[Path]
    matched_folders: list[str]
    folders: list[patterns.Folder]
    runs: list[Path]  # training runs' output directories left out with all they hold


# The listings of folders and patterns made inside `one_listing` (None outside it).
_listings: dict[str, Listing] | None = None


@contextlib.contextmanager
def one_listing() -> Iterator[None]:
    """Within it, each folder or pattern is listed once: the trainer's start asks for a
    source's files several times (its stamp, its names, its reading), and a folder of
    many thousand files on a network filesystem is slow to walk."""
    global _listings
    outer = _listings
    _listings = {} if outer is None else outer
    try:
        yield
    finally:
        _listings = outer


def listing(path: str | Path) -> Listing:
    """The :class:`Listing` of a folder or pattern (once within :func:`one_listing`).
    ValueError for a folder that cannot be listed, or a pattern that cannot match."""
    if _listings is None:
        return _list(path)
    key = os.path.abspath(os.path.expanduser(str(path)))
    if key not in _listings:
        _listings[key] = _list(path)
    return _listings[key]


def _scan(path: str | Path) -> tuple[list[Path], list[Path]]:
    """``(data files, other files left out)`` of a folder or pattern (:func:`data_files`);
    ValueError where it names none, or a link to nothing."""
    found = listing(path)
    if found.broken:
        file = found.broken[0]
        raise ValueError(f"{file}: a link to nothing ({os.readlink(file)})")
    if not found.files and is_pattern(path):
        folders = found.matched_folders
        hint = (
            f" (it matches {plural(len(folders), 'folder')}, {folders[0]}: name a folder "
            "itself, or its files with a pattern such as folder/*.jsonl)"
            if folders
            else ""
        )
        raise ValueError(f"{path}: no data file matches the pattern{hint}")
    if not found.files:
        texts = [p for p in found.others if _is_plain_text(p)]
        hint = (
            f"; plain text ({plural(len(texts), 'file')} here) is not read as data: write "
            'each document as a .jsonl record, one {"text": "..."} a line'
            if texts
            else ""
        )
        raise ValueError(
            f"{path}: a directory that is neither a token cache (no meta.json), a dataset "
            f"saved with datasets' save_to_disk (none of {SAVED_DATASET_FILES}), nor a "
            f"folder of data files (none ending in {', '.join(_file_endings())}){hint}"
        )
    if is_pattern(path):
        for file in found.files:
            data_format(file)  # a known format, or its one-line error
    return list(found.files), list(found.others)


def _list(path: str | Path) -> Listing:
    """:func:`listing`, walking the folder or pattern."""
    if is_pattern(path):
        pattern = os.path.expanduser(str(path))
        matches, walked = patterns.walk(pattern)
        below = Path(pattern_folder(pattern))
        files, runs = [], set()
        for p in matches:
            if os.path.isfile(p):
                left_out = _pruned_above(Path(p), below)
                if left_out is None:
                    files.append(Path(p))
                elif is_run_output(left_out):
                    runs.add(left_out)
        broken = [
            Path(p)
            for p in matches
            if os.path.islink(p) and not os.path.exists(p) and file_format(Path(p))
        ]
        folders = [p for p in matches if os.path.isdir(p)]
        return Listing(each_real_file_once(files), [], broken, folders, walked, sorted(runs))
    root = Path(path)
    if is_token_cache(root):
        raise ValueError(f"{path}: a token cache, not a folder of data files")
    if is_run_output(root):
        raise ValueError(
            f"{path}: a training run's output directory (its {SETTINGS_FILE} and "
            f"{LOG_FILE}), not a folder of data files"
        )
    files, others, broken, runs = [], [], [], []

    def unlisted(error: OSError):
        raise ValueError(f"{error.filename}: cannot be listed ({error.strerror})")

    def pruned(folder: str) -> bool:
        if not _prunes(folder):
            return False
        if is_run_output(folder):  # named in the reading line
            runs.append(Path(folder))
        return True

    names, walked = walk_folder(root, prune=pruned, onerror=unlisted)
    for file in names:
        known = file_format(file) is not None
        if known and not file.exists():
            broken.append(file)
        else:
            (files if known else others).append(file)
    return Listing(
        each_real_file_once(sorted(files)), sorted(others), sorted(broken), [], walked, sorted(runs)
    )


def walk_folder(
    root: str | Path,
    *,
    prune: Callable[[str], bool] | None = None,
    onerror: Callable[[OSError], None] | None = None,
) -> tuple[list[Path], list[patterns.Folder]]:
    """``(the files under root, the folders walked)``: every name at any depth that is
    not a folder (links followed; a link to nothing too), hidden ones and those in
    hidden folders left out, each real folder walked once (a link back up is no loop),
    in sorted order; ``prune``: folders under ``root`` left out with all they hold;
    ``onerror``: :func:`os.walk`'s, for a folder that cannot be listed."""
    files, walked, seen = [], [], set()
    for folder, dirs, names in os.walk(root, onerror=onerror, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen or (prune is not None and folder != str(root) and prune(folder)):
            dirs[:] = []
            continue
        seen.add(real)
        walked.append(patterns.Folder(folder, real, frozenset()))
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        files += [Path(folder) / n for n in sorted(names) if not n.startswith(".")]
    return files, walked


def would_read(path: str | Path, file: str | Path) -> bool:
    """Whether the folder or pattern ``path`` would read ``file`` (one a run will write,
    such as its log.jsonl) once it exists: a pattern that matches it through any folder
    its walk entered; a folder whose walk enters the folder above it (links followed),
    a data file's name, nothing hidden on the way."""
    found = listing(path)
    if is_pattern(path):
        return patterns.would_match(str(path), file, found.folders)
    if file_format(Path(file)) is None:
        return False
    above, below = patterns.existing_above(file)
    if any(name.startswith(".") for name in below):
        return False
    return os.path.realpath(above) in {folder.real for folder in found.folders}


def each_real_file_once(files: list[Path]) -> list[Path]:
    """``files`` in order, each real file once (a link to one read already left out)."""
    seen, kept = set(), []
    for file in files:
        if (real := os.path.realpath(file)) not in seen:
            seen.add(real)
            kept.append(file)
    return kept


def _prunes(folder: str | Path) -> bool:
    """Whether a folder's walk leaves ``folder`` out with all it holds: a token cache's
    folder (its index.npy is no data) or a training run's output directory (its
    log.jsonl is no data)."""
    return is_token_cache(folder) or is_run_output(folder)


def _pruned_above(file: Path, below: Path) -> Path | None:
    """The outermost folder between ``below`` and ``file`` that a folder's walk leaves
    out (:func:`_prunes`), or None."""
    found = None
    for folder in file.parents:
        if folder == below or below not in folder.parents:
            break
        if _prunes(folder):
            found = folder
    return found


def is_token_cache(path: str | Path) -> bool:
    """Whether ``path`` is a token cache directory (a ``meta.json`` of its format)."""
    meta = Path(path) / CACHE_META
    if not meta.is_file():
        return False
    try:
        return json.loads(meta.read_text()).get("format") == CACHE_FORMAT
    except (ValueError, OSError, AttributeError):
        return False


def source_files(path: str | Path) -> list[Path]:
    """The files a data source reads: a folder's or pattern's :func:`data_files`, every
    file of a ``save_to_disk`` directory, a data file itself; none for a token cache."""
    if is_token_cache(path):
        return []
    if is_pattern(path) or (Path(path).is_dir() and data_format(path) == FILES):
        return data_files(path)
    path = Path(path)
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


def source_exists(path: str | Path) -> bool:
    """Whether ``path`` is a file or folder, or a pattern that some file matches."""
    if is_pattern(path):
        try:
            return bool(listing(path).files)
        except ValueError:  # a pattern that cannot match: its error comes with reading
            return True
    return os.path.exists(path)


def file_format(path: Path) -> str | None:
    """A file name's format (the key of its reader), its compression's extension aside;
    None where no reader reads it."""
    name = path.name.lower()
    for compression in ("", *COMPRESSIONS):
        for fmt in READERS:
            if fmt.startswith(".") and name.endswith(fmt + compression) and name != fmt:
                if compression and fmt not in STREAMED_FORMATS:
                    return None
                return fmt
    return None


def _file_endings() -> list[str]:
    """The file endings a reader reads: the formats, and the streamed ones compressed."""
    plain = [k for k in READERS if k.startswith(".")]
    return plain + [f"{fmt}{c}" for fmt in STREAMED_FORMATS for c in COMPRESSIONS]


NPY_MAGIC = b"\x93NUMPY"  # the first bytes of every .npy file


def _read_npy(path: Path, parser: RecordParser) -> Iterator[Example]:
    """The rows of an ``[N, L]`` array (or the one ``[L]`` stream), memory-mapped."""
    with open(path, "rb") as f:
        if f.read(len(NPY_MAGIC)) != NPY_MAGIC:
            raise ValueError(f"{path}: not a valid .npy array file (no .npy header)")
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
        yield Example(record, row.astype(np.int32, copy=False), None)  # int32: still mapped


def _columns(path: Path, names: Sequence[str]) -> list[str]:
    """The columns a table's records are read from, the first a table has of:
    ``input_ids`` (+ ``labels``), ``text``, ``prompt`` and ``completion``, ``messages``
    (the last two with :data:`CONVERSATION_COLUMNS`, where the table has them)."""
    if "input_ids" in names:
        return ["input_ids"] + [n for n in ("labels", ATTENTION_MASK) if n in names]
    if "text" in names:
        return ["text"]
    extra = [name for name in CONVERSATION_COLUMNS if name in names]
    if "prompt" in names and "completion" in names:
        return [*PROMPT_COMPLETION, *extra]
    if MESSAGES in names:
        return [MESSAGES, *extra]
    raise ValueError(
        f"{path}: expected a column 'input_ids', 'text' or 'messages', or columns 'prompt' "
        f"and 'completion', got {list(names)}"
    )


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


# A table's columns read beside a conversation's (prompt and completion, or messages).
CONVERSATION_COLUMNS = (TOOLS, CHAT_TEMPLATE_KWARGS)
SAVED_DATASET = "save_to_disk"  # READERS' key for a directory saved by `datasets`
FILES = "files"  # READERS' key for a folder of data files, or a glob pattern's files
CACHE_META = "meta.json"  # what marks a token cache's folder (train.data_cache)
CACHE_FORMAT = "jflash-token-cache"  # its "format"
CACHE_TOKENS, CACHE_INDEX = "tokens.bin", "index.npy"  # a cache's files beside its meta
# What `save_to_disk` writes into a directory: a Dataset's, or a DatasetDict's index.
SAVED_DATASET_FILES = ("state.json", "dataset_info.json", "dataset_dict.json")
# The data formats: the file's lower-case extension (or SAVED_DATASET) -> its reader.
# A new format is one entry here (and its tests in tests/test_train_data.py).
READERS: dict[str, Reader] = {
    ".pkl": Reader(records_reader(_read_pkl)),
    ".jsonl": Reader(records_reader(read_jsonl, by_line=True), by_line=True),
    ".npy": Reader(_read_npy),
    ".parquet": Reader(records_reader(_read_parquet)),
    SAVED_DATASET: Reader(records_reader(_read_saved_dataset)),
    FILES: Reader(_read_files),
}
FORMATS = tuple(READERS)


def data_format(path: str | Path) -> str:
    """The key of ``path``'s reader in :data:`READERS`: a file's is its lower-case
    extension (before a compression's: ``.jsonl`` for ``a.jsonl.gz``); a directory's
    ``save_to_disk`` where the ``datasets`` package saved it, else ``files`` (the data
    files under it); a glob pattern's ``files``. ValueError for a path that does not
    exist, or a file no reader reads."""
    if is_pattern(path):
        return FILES
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path}: no such data file")
    if path.is_dir():
        if (path / CACHE_TOKENS).is_file() and not is_token_cache(path):
            raise ValueError(
                f"{path}: a token cache's {CACHE_TOKENS} with no readable {CACHE_META} of its "
                "format (missing or damaged): rebuild the cache (python -m train.data cache, "
                "or under --data_cache_dir)"
            )
        if any((path / name).is_file() for name in SAVED_DATASET_FILES):
            return SAVED_DATASET
        data_files(path)  # some, or the one-line error
        return FILES
    fmt = file_format(path)
    if fmt is None:
        compression = path.suffix.lower()
        if compression in COMPRESSIONS and Path(path.stem).suffix.lower() in READERS:
            raise ValueError(
                f"{path}: a compressed {Path(path.stem).suffix.lower()} file is not read "
                f"(only {' and '.join(STREAMED_FORMATS)} are read compressed); decompress it"
            )
        if ".json" in path.name.lower():  # `.json`, `.json.gz`: not JSON Lines by name
            raise ValueError(
                f"{path}: a .json file is not read: one JSON record a line is read from a "
                ".jsonl file (rename it where it holds that; a JSON array: convert it)"
            )
        if _is_plain_text(path):
            raise ValueError(
                f"{path}: plain text is not read as data (where would each document end?); "
                'write each document as a .jsonl record, one {"text": "..."} a line'
            )
        raise ValueError(
            f"{path}: unknown data format {path.suffix.lower()!r}; expected a file ending in "
            f"{', '.join(_file_endings())}, a folder of them or a glob pattern, a directory "
            "saved with datasets' save_to_disk, or a token cache directory"
        )
    return fmt
