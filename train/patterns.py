"""Glob patterns of data files: ``corpus/*.jsonl.gz``, ``'root/**/train*.jsonl'``.

A pattern matches as the shell and Python's ``glob`` match one (``*``, ``?``,
``[abc]``/``[!abc]`` within a name, ``**`` for any folders between, names beginning
with ``.`` only where the pattern's name begins with one), but its walk reads each real
folder once: ``glob`` follows a link to a folder at every level of ``**``, and a link
back up (``data/all -> ..``) makes its walk grow without bound.
"""

from __future__ import annotations

import os
import re

WILDCARDS = "*?["


def is_pattern(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a glob pattern (``*``, ``?`` or ``[``) rather than a path
    that exists."""
    return not os.path.lexists(path) and any(c in str(path) for c in WILDCARDS)


def pattern_folder(pattern: str) -> str:
    """The folder of a pattern before its first wildcard: what its files are named from."""
    head = re.split(r"[*?\[]", pattern, maxsplit=1)[0]
    return os.path.dirname(head) or "."


def expand(pattern: str) -> list[str]:
    """The paths (files and folders) that ``pattern`` matches, sorted, named as the
    pattern names them (``~`` expanded)."""
    base, prefix, regex, depth = _compile(pattern)
    hidden = _names_hidden(pattern)
    found, seen = [], set()
    for folder, dirs, names in os.walk(base, followlinks=True):
        real = os.path.realpath(folder)
        rel = os.path.relpath(folder, base)
        level = 0 if rel == "." else rel.count(os.sep) + 1
        if real in seen:
            dirs[:] = []
            continue
        seen.add(real)
        if not hidden:
            dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in dirs + names:
            path = name if rel == "." else os.path.join(rel, name)
            if regex.fullmatch(path.replace(os.sep, "/")):
                found.append(prefix + path)
        if depth is not None and level + 1 >= depth:
            dirs[:] = []
    return sorted(found)


def matches(pattern: str, path: str | os.PathLike[str]) -> bool:
    """Whether ``pattern`` matches ``path`` (which need not exist yet: a file a run
    will write), comparing real paths."""
    base, _, regex, _ = _compile(pattern)
    rel = os.path.relpath(os.path.realpath(path), os.path.realpath(base))
    if rel == os.pardir or rel.startswith(os.pardir + os.sep) or rel == ".":
        return False
    return regex.fullmatch(rel.replace(os.sep, "/")) is not None


def _compile(pattern: str) -> tuple[str, str, re.Pattern[str], int | None]:
    """``(folder to walk, prefix of the names found, regex of the path below the
    folder, its depth in names or None for any)``."""
    pattern = os.path.expanduser(str(pattern))
    parts = pattern.split(os.sep)
    first = next(i for i, p in enumerate(parts) if any(c in p for c in WILDCARDS))
    fixed, rest = parts[:first], parts[first:]
    if not fixed:
        base, prefix = ".", ""
    elif fixed == [""]:
        base = prefix = os.sep
    else:
        base = os.sep.join(fixed)
        prefix = base + os.sep
    pieces = []
    for k, part in enumerate(rest):
        last = k == len(rest) - 1
        if part == "**":
            name = r"(?!\.)[^/]+"
            pieces.append(f"{name}(?:/{name})*" if last else f"(?:{name}/)*")
        else:
            pieces.append(_name(part) + ("" if last else "/"))
    depth = None if "**" in rest else len(rest)
    return base, prefix, re.compile("".join(pieces)), depth


def _name(part: str) -> str:
    """The regex of one name of a pattern (no ``/`` in what it matches)."""
    out = [] if part.startswith(".") else [r"(?!\.)"]
    i = 0
    while i < len(part):
        c = part[i]
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[" and (end := part.find("]", i + 2)) != -1:
            inner = part[i + 1 : end]
            negate = inner.startswith("!")
            inner = re.sub(r"([\\^\[])", r"\\\1", inner[1:] if negate else inner)
            out.append(f"[{'^/' if negate else ''}{inner}]")
            i = end
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def _names_hidden(pattern: str) -> bool:
    """Whether a name of ``pattern`` after its fixed folder begins with ``.``."""
    parts = os.path.expanduser(str(pattern)).split(os.sep)
    first = next(i for i, p in enumerate(parts) if any(c in p for c in WILDCARDS))
    return any(p.startswith(".") and p not in (".", "..") for p in parts[first:])
