"""Counts in words, as the trainer's lines and its tools' reports write them (no jax
import: the tools' parent processes use it too)."""

from __future__ import annotations


def plural(n: int, word: str, *, grouped: bool = False) -> str:
    """`1 step`, `2 steps`; `grouped`: thousands grouped (`1,200 steps`)."""
    count = f"{n:,}" if grouped else f"{n}"
    return f"{count} {word}" if n == 1 else f"{count} {word}s"
