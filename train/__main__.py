"""`python -m train` / `jflash-train`: see `train.config` for the flags."""

from __future__ import annotations

import sys

from train.config import parse_args
from train.loop import TrainingError, run


def main(argv: list[str] | None = None) -> int:
    try:
        summary = run(parse_args(argv))
    # NotImplementedError: a kernel option this setup cannot run (jflash names it).
    except (TrainingError, ValueError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if summary["losses"]:
        print(f"done: {summary['total_steps']} steps, final loss {summary['losses'][-1]:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
