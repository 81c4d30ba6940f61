"""Writing a tool's JSON result: whole or not at all, and a failure in one line."""

from __future__ import annotations

import contextlib
import json
import os


def write_json(path: str, data, flag: str) -> None:
    """`data` into `path` through `path.tmp`, replaced whole: `path` is either the
    earlier file or the new one (a run stopped midway keeps the earlier one), and no
    `.tmp` is left behind. Where it cannot be written: SystemExit with one line naming
    `flag` (the command-line flag that chose the place) and `path` (exit status 1)."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, default=str)
        os.replace(tmp, path)
    except OSError as e:
        raise SystemExit(f"error: {flag}: cannot write {path} ({e.strerror or e})") from None
    finally:
        if os.path.lexists(tmp) and not os.path.isdir(tmp):
            with contextlib.suppress(OSError):
                os.remove(tmp)
