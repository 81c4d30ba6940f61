"""`python -m train` / `jflash-train`: see `train.config` for the flags."""

from __future__ import annotations

import os
import sys

from train import outputs
from train.config import parse_args
from train.loop import TrainingError, run


def _interrupted(output_dir: str) -> str:
    """The line Ctrl-C ends a run with: where its last whole checkpoint is."""
    directory = os.path.join(output_dir, "checkpoints")
    steps = outputs.saved_steps(output_dir)
    if not steps:
        return f"interrupted: no checkpoint was written to {directory}"
    return (
        f"interrupted: the last checkpoint is step {steps[-1]} in {directory}; "
        "continue with --resume_from_checkpoint latest"
    )


def _from_interrupt(error: BaseException | None) -> bool:
    """Whether Ctrl-C caused `error`: a KeyboardInterrupt, or an error raised while one
    was handled. Ctrl-C during a checkpoint save reaches the loop as Orbax's
    `RuntimeError('Event loop stopped before Future completed.')`."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, KeyboardInterrupt):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def main(argv: list[str] | None = None) -> int:
    cfg = None
    try:
        cfg = parse_args(argv)
        summary = run(cfg)
    except BaseException as e:
        if not _from_interrupt(e):
            # NotImplementedError: a kernel option this setup cannot run (jflash names it).
            if isinstance(e, (TrainingError, ValueError, NotImplementedError)):
                print(f"error: {e}", file=sys.stderr)
                return 2
            raise
        # The loop has closed its checkpoints (a save in flight finished) and logs. Exit
        # now: XLA's threads may still hold the interrupted step, and tearing down the
        # interpreter around them aborts the process.
        print(_interrupted(cfg.run.output_dir) if cfg else "interrupted", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    if summary["losses"]:
        print(f"done: {summary['total_steps']} steps, final loss {summary['losses'][-1]:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
