"""Glob patterns of data files: ``corpus/*.jsonl.gz``, ``'root/**/train*.jsonl'``.

A pattern matches as the shell and Python's ``glob`` match one (``*``, ``?``,
``[abc]``/``[!abc]`` within a name, ``**`` for any folders between, names beginning
with ``.`` only where the pattern's name begins with one; ``.`` and ``..`` as folders),
walking only the folders that can lead to a match, in sorted order. Where ``**`` could
follow a link back up (``data/all -> ..``) without end, as ``glob`` does, the walk does
not enter a folder it is already inside.
"""

from __future__ import annotations

import os
import re
from typing import NamedTuple

WILDCARDS = "*?["
ANY_FOLDERS = "**"


def is_pattern(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a glob pattern (``*``, ``?`` or ``[``) rather than a path
    that exists."""
    return not os.path.lexists(path) and any(c in str(path) for c in WILDCARDS)


def pattern_folder(pattern: str) -> str:
    """The folder of a pattern before its first wildcard: what its files are named from."""
    head = re.split(r"[*?\[]", pattern, maxsplit=1)[0]
    return os.path.dirname(head) or "."


class Folder(NamedTuple):
    """A folder a pattern's walk entered: its path (as the pattern names it), its real
    path, and where in the pattern its names stand (:func:`walk`)."""

    path: str
    real: str
    states: frozenset[int]


def expand(pattern: str) -> list[str]:
    """The paths (files and folders) that ``pattern`` matches, sorted, named as the
    pattern names them (``~`` expanded). ValueError for a pattern that cannot match
    (a character range out of order)."""
    return walk(pattern)[0]


def walk(pattern: str) -> tuple[list[str], list[Folder]]:
    """``(the paths matched, sorted; the folders entered)`` of ``pattern``."""
    compiled = _Compiled(pattern)
    found: list[str] = []
    folders: list[Folder] = []
    prefix = compiled.prefix

    def visit(path: str, rel: str, states: frozenset[int], inside: frozenset[str]) -> None:
        real = os.path.realpath(path)
        folders.append(Folder(prefix + rel if rel else compiled.base, real, states))
        for i in compiled.closure(states):  # `.` and `..`: named, not listed
            if i < len(compiled.parts) and compiled.parts[i] in (".", ".."):
                name = compiled.parts[i]
                step = os.path.join(path, name)
                if os.path.isdir(step):
                    after = frozenset({i + 1})
                    step_rel = f"{rel}{os.sep}{name}" if rel else name
                    if compiled.accepts(after):
                        found.append(prefix + step_rel)
                    visit(step, step_rel, after, inside)
        try:
            names = sorted(os.listdir(path))
        except OSError:  # unreadable: as glob, nothing under it matches
            return
        for name in names:
            after = compiled.step(states, name)
            if not after:
                continue
            child = os.path.join(path, name)
            child_rel = f"{rel}{os.sep}{name}" if rel else name
            if compiled.accepts(after):
                found.append(prefix + child_rel)
            if compiled.continues(after) and os.path.isdir(child):
                child_real = os.path.realpath(child)
                if compiled.unbounded and (child_real in inside or child_real == real):
                    continue  # a link back up: `**` would go round it without end
                visit(child, child_rel, after, inside | {real})

    visit(compiled.base, "", frozenset({0}), frozenset())
    return sorted(found), folders


def would_match(pattern: str, path: str | os.PathLike[str], folders: list[Folder]) -> bool:
    """Whether ``pattern`` matches ``path`` once it exists (a file a run will write),
    reached through any of the ``folders`` its walk entered (:func:`walk`): the
    nearest folder above ``path`` that exists, by its real path, and ``path``'s names
    below it."""
    compiled = _Compiled(pattern)
    above, below = existing_above(path)
    real = os.path.realpath(above)
    for folder in folders:
        if folder.real != real:
            continue
        states = folder.states
        for name in below:
            states = compiled.step(states, name)
        if states and compiled.accepts(states):
            return True
    return False


def existing_above(path: str | os.PathLike[str]) -> tuple[str, list[str]]:
    """``(the nearest folder at or above path that exists, the names below it to
    path)``: where a file a run will write would be reached from."""
    above, below = os.path.abspath(os.path.expanduser(os.fspath(path))), []
    while not os.path.isdir(above):
        above, name = os.path.split(above)
        below.insert(0, name)
    return above, below


class _Compiled:
    """A pattern as the folder its walk starts from and one matcher per name after it
    (an automaton over names: its states are indices into :attr:`parts`)."""

    def __init__(self, pattern: str):
        pattern = os.path.expanduser(str(pattern))
        parts = pattern.split(os.sep)
        first = next((i for i, p in enumerate(parts) if any(c in p for c in WILDCARDS)), None)
        if first is None:  # no wildcard: the path itself
            first = len(parts) - 1
        fixed, self.parts = parts[:first], parts[first:]
        if not fixed:
            self.base, self.prefix = ".", ""
        elif fixed == [""]:
            self.base = self.prefix = os.sep
        else:
            self.base = os.sep.join(fixed)
            self.prefix = self.base + os.sep
        self.unbounded = ANY_FOLDERS in self.parts
        self.names: list[re.Pattern[str] | None] = []
        for part in self.parts:
            if part in (ANY_FOLDERS, ".", ".."):
                self.names.append(None)
                continue
            try:
                self.names.append(re.compile(_name(part)))
            except re.error as e:
                raise ValueError(f"{pattern}: {part!r} is not a pattern of names ({e})") from None

    def closure(self, states: frozenset[int]) -> frozenset[int]:
        """``states`` and those ``**`` reaches by matching no folder."""
        out, todo = set(states), list(states)
        while todo:
            i = todo.pop()
            if i < len(self.parts) and self.parts[i] == ANY_FOLDERS and i + 1 not in out:
                out.add(i + 1)
                todo.append(i + 1)
        return frozenset(out)

    def step(self, states: frozenset[int], name: str) -> frozenset[int]:
        """The states after one more name of a path."""
        out = set()
        for i in self.closure(states):
            if i >= len(self.parts):
                continue
            part, regex = self.parts[i], self.names[i]
            if part == ANY_FOLDERS:
                if not name.startswith("."):
                    out.add(i)
            elif regex is not None and regex.fullmatch(name):
                out.add(i + 1)
        return frozenset(out)

    def accepts(self, states: frozenset[int]) -> bool:
        """Whether a path in ``states`` is matched (its names are the pattern's)."""
        return len(self.parts) in self.closure(states)

    def continues(self, states: frozenset[int]) -> bool:
        """Whether a folder in ``states`` can hold a match."""
        return any(i < len(self.parts) for i in self.closure(states))


def _name(part: str) -> str:
    """The regex of one name of a pattern (``*``, ``?``, ``[...]``; a ``]`` first in a
    set is in the set, as in glob)."""
    out = [] if part.startswith(".") else [r"(?!\.)"]
    i = 0
    while i < len(part):
        c = part[i]
        if c == "*":
            out.append(".*")
        elif c == "?":
            out.append(".")
        elif c == "[":
            start = i + 1 + (part[i + 1 : i + 2] == "!")
            end = part.find("]", start + 1)  # `[]]`, `[!]]`: the first `]` is in the set
            if end == -1:
                out.append(re.escape(c))
            else:
                inner = part[i + 1 : end]
                negate = inner.startswith("!")
                inner = re.sub(r"([\\^\[\]])", r"\\\1", inner[1:] if negate else inner)
                out.append(f"[{'^' if negate else ''}{inner}]")
                i = end
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)
