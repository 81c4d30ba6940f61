"""Writing files so that nothing is lost: a file replaced only once its new content is
whole (`atomic_write`), and a folder tried for writing before any work is done in it
(`cannot_write_in`, on the `nearest_existing` folder of a path not yet made)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from typing import IO


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "wb") -> Iterator[IO]:
    """A file opened at ``path + ".tmp"`` and renamed over ``path`` when the block ends;
    if the block raises, the partial file is removed and ``path`` is left untouched."""
    tmp = path + ".tmp"
    try:
        with open(tmp, mode) as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def cannot_write_in(folder: str) -> str | None:
    """Why no file can be created in the existing directory `folder` (the error's text),
    or None. Tried by creating and removing an empty file there: the permission bits do
    not tell (root passes them, and so do `/proc` and a read-only mount)."""
    try:
        fd, name = tempfile.mkstemp(dir=folder, prefix=".jflash-write-probe-")
    except OSError as e:
        return e.strerror or str(e)
    os.close(fd)
    with contextlib.suppress(OSError):
        os.remove(name)
    return None


def nearest_existing(path: str) -> str:
    """`path` itself where it exists, else its nearest existing ancestor."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def folder_error(out: str, flag: str) -> str | None:
    """Why directory `out` (the value of option `flag`) cannot be written: it is a file,
    lies under one, or no file can be created in it or its nearest existing folder; or
    None. Creates nothing that stays."""
    path = os.path.abspath(out)
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{flag}={out!r} is a file, not a directory"
    probe = nearest_existing(path)
    if not os.path.isdir(probe):
        return f"{flag}={out!r} cannot be created: {probe} is a file"
    if why := cannot_write_in(probe):
        what = "is not writable" if probe == path else f"cannot be created in {probe}"
        return f"{flag}={out!r} {what} ({why})"
    return None
