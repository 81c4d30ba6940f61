"""Writing a tool's output files (JSON, text, images): whole or not at all, one file or
a set of them, and a failure in one line."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import IO, NoReturn

import models.files


def write_whole(path: str, write: Callable[[IO], object], flag: str, binary: bool = False) -> None:
    """`write(f)` into `path` through `path.tmp` (`f` open for text, or bytes where
    `binary`), replaced whole: `path` is either the earlier file or the new one (a run
    stopped midway keeps the earlier one), and no `.tmp` is left behind. Where it cannot
    be written: SystemExit with one line naming `flag` (the command-line flag that chose
    the place) and `path` (exit status 1)."""
    write_set([(path, write, binary)], flag)


def write_set(files: Sequence[tuple[str, Callable[[IO], object], bool]], flag: str) -> None:
    """Each `(path, write, binary)` of `files` as `write_whole` writes it, the files as one
    set: every one is written to its `path.tmp` first, and only when all are written are
    they renamed into place. A file that cannot be written (a full disk, or an error
    while `write` forms it) replaces none of the earlier files: the written `.tmp` files
    are removed, and the error is `write_whole`'s. (A rename that fails, which renaming a
    written file in its own folder rarely does, keeps the files renamed before it.)"""
    staged: list[str] = []
    path = ""
    try:
        for path, write, binary in files:
            if os.path.isdir(path):  # the rename onto it would fail after the others
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
            staged.append(f"{path}.tmp")
            with open(staged[-1], "wb" if binary else "w") as f:
                write(f)
        for path, _, _ in files:
            os.replace(f"{path}.tmp", path)
    except OSError as e:
        raise SystemExit(f"error: {flag}: cannot write {path} ({e.strerror or e})") from None
    finally:
        for tmp in staged:
            if os.path.lexists(tmp) and not os.path.isdir(tmp):
                with contextlib.suppress(OSError):
                    os.remove(tmp)


def out_error(
    path: str,
    flag: str = "--out",
    what: str = "the output",
    *,
    overwrite: bool = False,
    inputs: Sequence[str] = (),
    make_parent: bool = False,
) -> str | None:
    """Why `path` cannot be the file `what` is written to (one line naming `flag` and
    `path`), or None: a directory, one of the `inputs`, a file already there (without
    `overwrite`: another run's result, or any file, is kept), or a file whose directory is
    missing (where not `make_parent`: the writer creates it), not a directory, or one no
    file can be created in (`models.files.cannot_write_in`, tried on the nearest existing
    folder). Creates nothing that stays."""
    if os.path.isdir(path):
        return f"{flag} {path} is a directory; give a file path for {what}"
    if os.path.exists(path) and any(
        os.path.exists(i) and os.path.samefile(path, i) for i in inputs
    ):
        return f"{flag} {path} is one of the inputs; give another file for {what}"
    if os.path.lexists(path) and not overwrite:
        return f"{flag} {path} exists: pass --overwrite to replace it (nothing was written)"
    folder = os.path.dirname(os.path.abspath(path))
    if not make_parent and not os.path.exists(folder):
        return f"{flag} {path}: no such directory {folder}"
    folder = models.files.nearest_existing(folder)
    if not os.path.isdir(folder):
        return f"{flag} {path}: {folder} is a file, not a directory"
    if why := models.files.cannot_write_in(folder):
        return f"{flag} {path}: {folder} is not writable ({why})"
    return None


def refuse(line: str) -> NoReturn:
    """Ends a tool that refuses its input before its work: `error: <line>` on stderr and
    exit status 2, as argparse's refusals and the trainer's (a failure during the work,
    such as a write on a full disk, exits 1)."""
    print(f"error: {line}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def json_writer(data) -> Callable[[IO], object]:
    """The `write` of `data` as JSON for `write_whole` and `write_set`."""
    return lambda f: json.dump(data, f, indent=1, default=str)


def write_json(path: str, data, flag: str) -> None:
    """`data` as JSON into `path`, as `write_whole` writes."""
    write_whole(path, json_writer(data), flag)


def write_text(path: str, text: str, flag: str) -> None:
    """`text` into `path`, as `write_whole` writes."""
    write_whole(path, lambda f: f.write(text), flag)


if __name__ == "__main__":
    import sys

    from train.tools import not_a_command

    sys.exit(not_a_command("train.tools.files"))
