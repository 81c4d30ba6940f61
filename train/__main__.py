"""`python -m train` / `jflash-train`: see `train.config` for the flags."""

from __future__ import annotations

import os
import signal
import sys

try:  # jax and the model import for seconds: a Ctrl-C then is no traceback
    from train import outputs
    from train.config import parse_args
    from train.errors import (
        STOP_SIGNALS,
        USER_ERRORS,
        Preempted,
        Terminated,
        disk_error,
        disk_words,
        from_interrupt,
        signal_status,
        signals_as_interrupts,
    )
    from train.loop import run
    from train.words import plural
except KeyboardInterrupt:
    print("interrupted while starting: nothing was run", file=sys.stderr, flush=True)
    sys.exit(128 + signal.SIGINT)


def _leave_together() -> None:
    """A preempted multi-process run: every process stopped at the same step (jax's
    preemption sync point) and saved it. Each leaves jax's distributed service before
    it exits, which waits for the others (jax's shutdown barrier), so process 0, which
    hosts the service, does not take it down under a process still on its way out
    (that one then aborts, SIGABRT, instead of exiting 143). jax does this at a normal
    exit (its atexit handler); `os._exit` skips it."""
    import jax

    if not jax.distributed.is_initialized():
        return
    try:
        jax.distributed.shutdown()
    except Exception as e:  # the checkpoint is saved: exit 143 all the same
        print(f"warning: leaving jax's distributed service: {e}", file=sys.stderr)
        sys.stderr.flush()


def _interrupted(
    output_dir: str, how: str = "interrupted", put_back: bool = False, not_started: bool = False
) -> str:
    """The line Ctrl-C (or SIGTERM) ends a run with: where its last whole checkpoint is.
    `put_back`: the run wrote none, and the checkpoints there are the previous run's
    (`--overwrite_output_dir`), which `run` has said. `not_started`: an
    `--overwrite_output_dir` run stopped before it changed anything (the checkpoints
    there are the previous run's)."""
    if not_started and not put_back:
        return f"{how} before the run started: {output_dir} is as it was"
    return f"{how}: {_last_checkpoint(output_dir, put_back)}"


def _last_checkpoint(output_dir: str, put_back: bool = False) -> str:
    """Where a stopped run's last whole checkpoint is, and how to continue from it
    (`put_back`: as `_interrupted`)."""
    directory = os.path.join(output_dir, "checkpoints")
    steps = outputs.saved_steps(output_dir)
    if put_back:
        return "this run wrote no checkpoint"
    if not steps:
        return f"no checkpoint was written to {directory}"
    return (
        f"the last checkpoint is step {steps[-1]} in {directory}; "
        "continue with --resume_from_checkpoint latest"
    )


def _notes(error: BaseException) -> list[str]:
    """The notes on `error` and the exceptions it was raised from or while handling (a
    Ctrl-C held through a cleanup is raised after it, over the first one)."""
    notes, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        notes += getattr(error, "__notes__", [])
        error = error.__cause__ or error.__context__
    return notes


def main(argv: list[str] | None = None) -> int:
    cfg = None
    # SIGTERM ends the run as Ctrl-C does: a save in flight finishes, one line names the
    # last checkpoint (while the loop trains, it saves the step reached first:
    # `train.loop._Preemption`). SIGTERM (and SIGHUP, a terminal closed, unless ignored:
    # `nohup`) outside the training loop, or inside it with `--save_on_preemption false`
    # or `--save_strategy no`: handled as Ctrl-C is (`Terminated`).
    with signals_as_interrupts():
        try:
            cfg = parse_args(argv)
            summary = run(cfg)
        except BaseException as e:
            interrupt = from_interrupt(e)
            if interrupt is None:
                if (disk := disk_error(e)) is not None:  # the machine's, not the settings'
                    line = disk_words(disk)
                    if cfg is not None:
                        where = "" if disk.filename else f" (writing under {cfg.run.output_dir})"
                        line += f"{where}; {_last_checkpoint(cfg.run.output_dir)}"
                    print(f"error: {line}", file=sys.stderr, flush=True)
                    if _other_processes() is not None:  # not jax's shutdown barrier
                        sys.stdout.flush()
                        os._exit(1)
                    return 1
                if isinstance(e, USER_ERRORS):
                    print(f"error: {e}", file=sys.stderr)
                    return 2
                if (peers := _other_processes()) is not None:
                    _end_apart(cfg, *peers)
                raise
            # The loop has closed its checkpoints (a save in flight finished) and logs. Exit
            # now: XLA's threads may still hold the interrupted step, and tearing down the
            # interpreter around them aborts the process.
            stop = interrupt.signum if isinstance(interrupt, (Terminated, Preempted)) else None
            how = STOP_SIGNALS[stop] if stop is not None else "interrupted"
            notes = _notes(e)
            put_back = any(n.startswith(outputs.PUT_BACK) for n in notes)
            not_started = outputs.NOT_STARTED in notes
            if isinstance(interrupt, Preempted):  # raised by the loop: the run had started
                last = "" if interrupt.saved else _last_checkpoint(cfg.run.output_dir, put_back)
                line = interrupt.line(last=last)
            else:
                line = _interrupted(cfg.run.output_dir, how, put_back, not_started) if cfg else how
            try:
                print(line, file=sys.stderr)
                sys.stdout.flush()
                sys.stderr.flush()
            except OSError:  # a terminal closed (SIGHUP): no one to tell
                pass
            if isinstance(interrupt, Preempted):
                _leave_together()
            os._exit(signal_status(signal.SIGINT if stop is None else stop))
        peers = _other_processes()
        if summary["losses"] and (peers is None or peers[0] == 0):  # the run's line: process 0's
            print(_done_line(cfg, summary))
        return 0


def _other_processes() -> tuple[int, int] | None:
    """`(this process's index, the process count)` in a multi-process run, else None."""
    import jax

    if not jax.distributed.is_initialized() or jax.process_count() == 1:
        return None
    return jax.process_index(), jax.process_count()


def _end_apart(cfg, index: int, count: int) -> None:
    """An unexpected error on one process of a multi-process run: most often the
    collective a stopped process left (killed, Ctrl-C, a lost host), which fails here at
    once (gloo) or at jax's heartbeat timeout; a save in flight had at most
    `train.loop.SAVE_WAIT_AFTER_ERROR_S` to commit. The traceback, one line saying so
    and where the last checkpoint is, and the process ends now: jax's shutdown at exit
    would wait for the stopped process, then abort with a C++ stack."""
    import traceback

    traceback.print_exc()
    last = f"; {_last_checkpoint(cfg.run.output_dir)}" if cfg is not None else ""
    try:
        print(
            f"error on process {index} of {count}: where another process of the run "
            f"stopped, this is the collective it left{last}",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
    except OSError:
        pass
    os._exit(1)


def _done_line(cfg, summary: dict) -> str:
    """`done: 300 steps, final loss 4.1234; checkpoint 300 in <out>/checkpoints, the HF
    model in <out>/hf`: what the run leaves, and where; a run told to keep no weights
    says so (`--save_strategy no --export_hf false`, as a benchmark config runs)."""
    out = cfg.run.output_dir
    steps = outputs.saved_steps(out)
    kept = [f"checkpoint {steps[-1]} in {os.path.join(out, 'checkpoints')}"] if steps else []
    if cfg.run.export_hf:
        kept.append(f"the HF model in {os.path.join(out, 'hf')}")
    where = "; " + ", ".join(kept) if kept else ""
    if not kept and cfg.run.save_strategy == "no":
        where = "; no weights kept (--save_strategy no, --export_hf false)"
    trained = plural(summary["total_steps"], "step")
    return f"done: {trained}, final loss {summary['losses'][-1]:.4f}{where}"


if __name__ == "__main__":
    sys.exit(main())
