"""Whether a process that left a folder behind still runs.

A folder a process writes under a temporary name (a token cache being built, a
profile's worker files) is left behind when the process is killed outright (SIGKILL,
the kernel's out-of-memory killer): nothing of it runs to remove the folder. Its next
run removes it only where the folder's owner is known to have ended: a process is
named by its id and its start time, so a later process given the same id is not taken
for it, and on another host nothing can be told.
"""

from __future__ import annotations

import os
import socket


def started(pid: int) -> str | None:
    """When process ``pid`` started (Linux: its start time in /proc, clock ticks since
    boot), ``"zombie"`` for a process that has ended but is not reaped yet, None where
    unknown (no such process, or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return "zombie" if fields[0] == "Z" else fields[19]


def record(pid: int) -> dict:
    """What names process ``pid``: its id and its start time (:func:`started`)."""
    return {"pid": pid, "started": started(pid)}


def runs(process) -> bool:
    """Whether the process a :func:`record` names still runs; True where that cannot be
    told (a record not of :func:`record`'s form, or no /proc and the id in use)."""
    if not isinstance(process, dict):
        return True
    pid, start = process.get("pid"), process.get("started")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return True
    try:
        os.kill(pid, 0)  # signal 0: only whether the process exists
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: in use
        return True
    now = started(pid)
    if now == "zombie":
        return False
    return start is None or now is None or now == start  # else: the id was reused


def host() -> str:
    """This machine's name, as a folder's owner record gives it."""
    return socket.gethostname()
