"""Writing a tool's output files (JSON, text, images): whole or not at all, and a
failure in one line."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from typing import IO


def write_whole(path: str, write: Callable[[IO], object], flag: str, binary: bool = False) -> None:
    """`write(f)` into `path` through `path.tmp` (`f` open for text, or bytes where
    `binary`), replaced whole: `path` is either the earlier file or the new one (a run
    stopped midway keeps the earlier one), and no `.tmp` is left behind. Where it cannot
    be written: SystemExit with one line naming `flag` (the command-line flag that chose
    the place) and `path` (exit status 1)."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "wb" if binary else "w") as f:
            write(f)
        os.replace(tmp, path)
    except OSError as e:
        raise SystemExit(f"error: {flag}: cannot write {path} ({e.strerror or e})") from None
    finally:
        if os.path.lexists(tmp) and not os.path.isdir(tmp):
            with contextlib.suppress(OSError):
                os.remove(tmp)


def check_writable_file(path: str, flag: str) -> None:
    """Refuses, before the work whose result goes there, a `path` that `write_whole`
    could not write: a directory, or a file whose directory is missing, not a directory,
    or not writable. SystemExit with one line naming `flag` and `path`, as `write_whole`
    fails; creates nothing."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        reason = "it is a directory"
    elif not os.path.exists(folder):
        reason = f"no such directory {folder}"
    elif not os.path.isdir(folder):
        reason = f"{folder} is not a directory"
    elif not os.access(folder, os.W_OK | os.X_OK):
        reason = f"{folder} is not writable"
    else:
        return
    raise SystemExit(f"error: {flag}: cannot write {path} ({reason})")


def write_json(path: str, data, flag: str) -> None:
    """`data` as JSON into `path`, as `write_whole` writes."""
    write_whole(path, lambda f: json.dump(data, f, indent=1, default=str), flag)


def write_text(path: str, text: str, flag: str) -> None:
    """`text` into `path`, as `write_whole` writes."""
    write_whole(path, lambda f: f.write(text), flag)
