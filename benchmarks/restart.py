"""What a restart costs the trainer: a cold start, a resume, and jax's compilation cache.

    python benchmarks/restart.py --model llama3.2-1b --context 32768 --steps 6 \\
        --out benchmarks/results/restart-h200.json

Four runs of `python -m train`, one after another in subprocesses on the same machine, on
made-up rows of `--context` tokens (`--data_path sample`, one example a row), each
saving a checkpoint every `--save-every` steps and keeping one (`--save_total_limit 1`:
the older one is deleted while training goes on), the HF export off. Each run is
stopped by SIGTERM once it has run `--steps` steps, as a preempted job is: the trainer
saves the step it reached and exits.

1. `cold`: a new output directory and an empty `--compilation_cache_dir`;
2. `resume, no cache`: `--resume_from_checkpoint latest` of run 1, without
   `--compilation_cache_dir`;
3. `resume, cache`: the same resume of run 2, with run 1's compilation cache (what a
   job restarted after preemption runs with the flag);
4. `new run, cache`: a new output directory with the warm cache (a second job of the
   same shape; run 1's directory is deleted first, for its disk space).

Each row: seconds from the process's start to its first step's progress line (imports,
the model built or its checkpoint restored, the data, the step's compilation, one
step), the whole process's wall time, the time from the SIGTERM to the process's end
(the save of the step reached) and the trainer's own account of it (its `SIGTERM at
step N` line: the wait for a save already in flight, the step's save, closing the
checkpoints, which deletes the one dropped; then from its last line to the process's
end), and the steps' times from the run's log
(one step per log record, its first step left out: median and slowest, where a periodic save's wait
shows). Prints the table and writes JSON (`--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import check_out, table, write_json  # noqa: E402

STEP_LINE = re.compile(r"^step (\d+)/(\d+)")
RUNS = ("cold", "resume, no cache", "resume, cache", "new run, cache")
COLUMNS = [
    "run",
    "to_first_step_s",
    "wall_s",
    "sigterm_to_exit_s",
    "step_end_s",
    "in_flight_save_s",
    "save_s",
    "close_s",
    "last_line_to_exit_s",
    "median_step_s",
    "slowest_step_s",
    "tokens_per_s",
]


def timed(cmd: list[str], env: dict[str, str], steps: int, timeout: float) -> dict:
    """Runs `cmd`, echoing its output, and stops it with SIGTERM (a preemption: the
    trainer saves the step it reached and exits) once it has run `steps` steps. The
    seconds from its start to its first progress line (`step N/M`), from the SIGTERM to
    its end, and to its end; its first and last steps. SystemExit naming the run where
    it fails, saves nothing, or runs past `timeout` seconds (then killed)."""
    start = time.monotonic()
    first = stopped = last_line = None
    stop = {}
    steps_seen = []
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    watchdog = threading.Timer(timeout, proc.kill)
    watchdog.start()
    saved = False
    for line in proc.stdout:
        print(line, end="", flush=True)
        if line.startswith("SIGTERM: saved a checkpoint"):  # the trainer's last line
            saved, last_line = True, time.monotonic() - start
        stop = stop_times(line) or stop
        if match := STEP_LINE.match(line):
            steps_seen.append(int(match.group(1)))
            first = time.monotonic() - start if first is None else first
            if stopped is None and len(steps_seen) >= steps:
                proc.send_signal(signal.SIGTERM)
                stopped = time.monotonic() - start
    wall = time.monotonic() - start
    proc.wait()
    watchdog.cancel()
    if wall >= timeout:
        raise SystemExit(f"restart.py: {' '.join(cmd)} ran past --timeout={timeout:g} s: killed")
    if first is None or stopped is None or not saved:
        raise SystemExit(
            f"restart.py: {' '.join(cmd)} ended (exit status {proc.returncode}) without "
            f"running {steps} steps and saving on SIGTERM"
        )
    return {
        "to_first_step_s": first,
        "sigterm_to_exit_s": wall - stopped,
        "wall_s": wall,
        "last_line_to_exit_s": wall - last_line,
        "steps": (steps_seen[0], steps_seen[-1]),
        **stop,
    }


def step_times(log: str, first: int, last: int) -> dict:
    """Median and slowest step time (s) and median tokens/s of the records in `log` (one
    per step) of steps `first` to `last`."""
    with open(log) as f:
        records = [json.loads(line) for line in f if line.strip()]
    timed = [r for r in records if "step_s" in r and first <= r["step"] <= last]
    if not timed:
        return {}
    times = [r["step_s"] for r in timed]
    return {
        "median_step_s": statistics.median(times),
        "slowest_step_s": max(times),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
    }


# The trainer's timing of a preemption's stop, the line before its last.
STOP_LINE = re.compile(r"^SIGTERM at step \d+: saved [^(]*\((.*)\); closing took (\S+) s more\b")
STOP_PARTS = {
    "the step's end": "step_end_s",
    "the save in flight": "in_flight_save_s",
    "'s save": "save_s",
}


def stop_times(line: str) -> dict:
    """The parts of the trainer's `SIGTERM at step N: saved 19.8 s after the signal (the
    step's end 1.0 s, the save in flight 8.8 s, step N's save 10.0 s); closing took
    3.6 s more` line, in seconds; {} where `line` is not one."""
    match = STOP_LINE.match(line.strip())
    if not match:
        return {}
    times = {"close_s": float(match.group(2))}
    for part in match.group(1).split(", "):
        what, seconds, _ = part.rsplit(" ", 2)
        key = next((k for words, k in STOP_PARTS.items() if what.endswith(words)), None)
        if key is not None:
            times[key] = float(seconds)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3.2-1b", help="a preset or an HF directory")
    parser.add_argument("--context", type=int, default=32768, help="tokens per row")
    parser.add_argument("--steps", type=int, default=6, help="steps of each run")
    parser.add_argument("--save-every", type=int, default=3, help="steps between saves")
    parser.add_argument("--work", default=None, help="folder for the runs (default: a new temp)")
    parser.add_argument("--out", default=None, help="JSON to write")
    parser.add_argument("--extra", default="", help="more trainer flags for every run, one string")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a run may take")
    args = parser.parse_args(argv)
    if args.out:
        check_out(parser, "--out", args.out)
    for flag, value in (("--context", args.context), ("--steps", args.steps)):
        if value < 1:
            raise SystemExit(f"restart.py: {flag}={value} must be positive")
    if not 1 <= args.save_every <= args.steps:
        raise SystemExit(f"restart.py: --save-every={args.save_every} must be in [1, --steps]")
    work = args.work or tempfile.mkdtemp(prefix="jflash-restart-")
    os.makedirs(work, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    python = [sys.executable, "-m"]
    total = 4 * args.steps + 4  # steps of a whole run: every run is stopped before its end
    cache = os.path.join(work, "xla-cache")
    shutil.rmtree(cache, ignore_errors=True)
    base = [
        *python, "train", "--model_name_or_path", args.model,
        "--data_path", "sample", "--sample_num_examples", str(total),
        "--model_max_length", str(args.context), "--per_device_train_batch_size", "1",
        "--logging_steps", "1", "--save_strategy", "steps", "--save_steps", str(args.save_every),
        "--save_total_limit", "1", "--export_hf", "false", "--max_steps", str(total),
        *shlex.split(args.extra),
    ]  # fmt: skip
    first_run, second_run = os.path.join(work, "run-a"), os.path.join(work, "run-b")
    for folder in (first_run, second_run):
        shutil.rmtree(folder, ignore_errors=True)
    with_cache = ["--compilation_cache_dir", cache]
    resume = ["--resume_from_checkpoint", "latest"]
    # The three runs of one output directory: each resume continues the run before it
    # from the checkpoint its SIGTERM saved (one checkpoint on disk at a time).
    plans = {
        "cold": (first_run, with_cache),
        "resume, no cache": (first_run, resume),
        "resume, cache": (first_run, [*resume, *with_cache]),
        "new run, cache": (second_run, with_cache),
    }
    results = []
    for name in RUNS:
        out, flags = plans[name]
        if out == second_run:
            shutil.rmtree(first_run)  # its checkpoints' disk space
        cmd = [*base, "--output_dir", out, *flags]
        print(f"--- {name}: {' '.join(cmd)}", flush=True)
        row = {"run": name, **timed(cmd, env, args.steps, args.timeout)}
        # Its steps but the first (the compiled step's first call).
        first, last = row.pop("steps")
        log = os.path.join(out, "log.jsonl")
        row.update(step_times(log, first + 1, last))
        print(f"--- {name}: " + ", ".join(f"{k} {row[k]:.3g}" for k in COLUMNS[1:] if k in row))
        row["command"] = " ".join(cmd)
        results.append(row)
    print(table(results, COLUMNS))
    if args.out:
        write_json(args.out, {"model": args.model, "context": args.context,
                              "steps": args.steps, "rows": results})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
