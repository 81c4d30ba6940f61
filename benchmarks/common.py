"""Timing and reporting helpers shared by the benchmark scripts."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import jax

import jflash
from models.files import folder_error
from train.tools.files import out_error

INTERPRET_HELP = (
    "run without a GPU: the same code on the CPU, Pallas kernels in interpret mode (as "
    "the tests run them); the table and JSON say so, and the times mean nothing. On a "
    "GPU it changes nothing"
)


def add_interpret_flag(parser) -> None:
    """`--interpret`, which `gpu_or_interpret` reads: the one way to run a GPU benchmark
    without a GPU."""
    parser.add_argument("--interpret", action="store_true", help=INTERPRET_HELP)


def interpreted_note(backend: str) -> str:
    """The line printed before an interpreted run's tables (and kept in its JSON)."""
    return (
        f"interpreted: no GPU (jax backend {backend!r}) and --interpret given: Pallas "
        f"kernels in interpret mode, the rest on the {backend}; the times are not GPU "
        "kernel times"
    )


def gpu_or_interpret(script: str, interpret: bool) -> str | None:
    """Whether a script that times GPU kernels runs here, called once its flags are
    parsed and before anything is compiled. On a GPU: None (the kernels run compiled;
    `--interpret` changes nothing). Without one: with `--interpret`, the note for its
    tables and JSON (`table(..., note=)`, `write_json(..., note=)`); without it, one line
    saying so on stderr and exit status 2, instead of a slow interpreted run whose table
    looks like a benchmark's."""
    backend = jax.default_backend()
    if backend == "gpu":
        if interpret:
            print(f"{script}: --interpret: this machine has a GPU, the kernels run compiled")
        return None
    if not interpret:
        print(
            f"{script} times GPU kernels: no GPU found (jax backend {backend!r}); pass "
            "--interpret to run the same code in Pallas interpret mode on CPU, as the tests "
            "do (the times then mean nothing)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    note = interpreted_note(backend)
    print(note, flush=True)
    return note


def balanced_order(labels: list, r: int) -> list:
    """Round `r`'s order of the candidates timed in interleaved rounds, from a balanced
    Latin square (Williams design): over `n` rounds (`2n` for an odd number `n` of
    candidates) each candidate takes every turn once and follows every other candidate
    equally often. A fixed order gave the first candidate's forward 1-4% on identical
    code (H200); a plain rotation still let one candidate always follow the same other
    one, and in `ab.py` the tree's forward, which always followed FlashAttention-3's
    forward+backward, read 1-4% faster than three revisions with the same forward
    (4x H100 node)."""
    n = len(labels)
    first, lo, hi = [0], 1, n - 1
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    period = n if n % 2 == 0 else 2 * n
    k = r % period
    row = [(j + k) % n for j in first]
    if k >= n:  # odd n: the second half of the square runs the rows backwards
        row = row[::-1]
    return [labels[j] for j in row]


def interleaved(n: int, rounds, passes):
    """`(round, pass, candidate index)` in timing order for `n` candidates: each round
    in `rounds` times every candidate's first pass, then every candidate's second, ...
    (a pass follows another candidate's same pass, not a heavier one), each sweep in
    that round's `balanced_order`."""
    for r in rounds:
        order = balanced_order(list(range(n)), r)
        for p in passes:
            for i in order:
                yield r, p, i


# Seconds of load before anything is timed (`heat`).
HEAT_S = 3.0


def heat(calls, seconds: float = HEAT_S) -> None:
    """Run the zero-argument `calls` round-robin for `seconds`, each awaited, before
    anything is timed. A GPU that sat idle while a function compiled starts its next
    loaded second cool and with its power average low, and runs it faster than the
    seconds after it: on an H200 at its power limit identical code read 3% faster in a
    reading that followed compilation (`ab.py --rev HEAD --clocks`, BENCHMARKS.md), so a
    candidate that always came first after compiling, or kept a reading taken right
    after its own compilation, won by that much."""
    if seconds <= 0:
        return
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for call in calls:
            jax.block_until_ready(call())


def jit_passes(attn):
    """Jitted forward and forward+backward of `attn(q, k, v)`, each with its
    argument count (forward+backward also takes the output cotangent)."""
    fwd = jax.jit(attn)

    @jax.jit
    def fwdbwd(q, k, v, do):
        out, vjp = jax.vjp(attn, q, k, v)
        return out, vjp(do)

    return {"fwd": (fwd, 3), "fwdbwd": (fwdbwd, 4)}


def time_fn(fn, *args, warmup: int = 2, iters: int = 10, min_time: float = 0.5) -> float:
    """Median wall time (s) of `fn(*args)` with `block_until_ready`, compile excluded."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    start = time.perf_counter()
    while len(times) < iters or (time.perf_counter() - start < min_time and len(times) < 100):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_pipelined(
    fn, *args, warmup: int = 2, iters: int | None = 10, rounds: int = 3, round_s: float = 0.15
) -> float:
    """Time (s) per call of `fn(*args)` dispatched `iters` times back to back and
    synchronised once (median over `rounds`): the host's launch and sync latency
    overlap the device work, as in a training loop. `time_fn` pays them per call (0.5-0.8
    ms per call on an H200 beside a 5 ms attention call). `iters=None`: as many calls as
    fill `round_s` seconds, at least 3. Only the last call's outputs are kept alive (the
    calls run in order on the device, so waiting for it waits for all)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    if iters is None:
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        iters = max(3, min(200, math.ceil(round_s / (time.perf_counter() - t0))))
    per_call = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = None
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - t0) / iters)
        del out
    return statistics.median(per_call)


def traced_kernels(fn, args, iterations: int) -> dict[str, float]:
    """Device time (ns) per kernel name, summed over `iterations` calls of `fn(*args)`
    run under a `jax.profiler` trace, longest first (empty without a GPU)."""
    from train.tools.trace import kernel_durations

    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            jax.block_until_ready([fn(*args) for _ in range(iterations)])
        return kernel_durations(trace_dir)


def device_name() -> str:
    """The device in result file names: its model ("h200" for "NVIDIA H200", "h100" for
    "NVIDIA H100 80GB HBM3"), else the whole kind as a slug ("cpu")."""
    kind = jax.devices()[0].device_kind
    model = re.search(r"\b[A-Z]+[0-9]+[A-Za-z]*\b", kind.replace("NVIDIA ", ""))
    if model:
        return model.group(0).lower()
    return kind.replace("NVIDIA ", "").replace(" ", "-").lower()


# Where a run's rows so far go (`write_json(..., partial=True)`): beside its results file,
# so a run cut short keeps them and the last whole run's results stay as they were.
PARTIAL = ".partial"


def source_commit() -> dict:
    """`{"commit": ..., "changed": bool}`: the checkout's HEAD, and whether its tracked
    files differ from it (the run measured code no commit holds); `{}` outside a git
    checkout."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args):  # Popen: scripts' tests replace `subprocess.run` with their fakes
        with subprocess.Popen(
            ["git", "-C", root, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        ) as proc:
            out, _ = proc.communicate(timeout=30)
        if proc.returncode:
            raise subprocess.CalledProcessError(proc.returncode, args)
        return out.strip()

    try:
        commit = git("rev-parse", "HEAD")
        changed = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"commit": commit, "changed": changed}


def write_json(path: str, payload: dict, *, note: str | None = None, partial: bool = False):
    """`payload` with the date, device, jax version and the checkout's commit (and whether
    its tracked files differ from it), at `path`, whole or not at all (a
    file beside it renamed into place); with an interpreted run's `note`
    (`gpu_or_interpret`) also `"interpreted": true` and the note. With `partial` (the rows
    of a run still going) at `path + PARTIAL` instead, which the whole run's write
    removes."""
    target = path + PARTIAL if partial else path
    os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
    marker = {"interpreted": True, "interpreted_note": note} if note else {}
    payload = {
        "date": time.strftime("%Y-%m-%d"),
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "jflash": jflash.__version__,
        **source_commit(),
        **({"partial": True} if partial else {}),
        **marker,
        **payload,
    }
    with open(target + ".tmp", "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(target + ".tmp", target)
    if not partial and os.path.exists(path + PARTIAL):
        os.remove(path + PARTIAL)
    print(f"wrote {target}", flush=True)


def check_out(parser, flag: str, path: str, *, directory: bool = False) -> None:
    """`parser.error` (one line, before any work) where `path`, a results file (or with
    `directory` a folder of them), cannot be written (`train.tools.files.out_error`,
    `models.files.folder_error`); a missing folder is made when the results are."""
    if directory:
        error = folder_error(path, flag)
    else:
        error = out_error(path, flag, "the results", overwrite=True, make_parent=True)
    if error:
        parser.error(error)


def check_positive(parser, args, *names: str, zero: tuple[str, ...] = ()) -> None:
    """`parser.error` naming the first flag of `names` (attributes of `args`, flags
    `--<name>` with dashes; a list's every item; None skipped) that is not positive, or below 0 for
    those also in `zero`."""
    for name in (*names, *zero):
        value = getattr(args, name)
        for v in value if isinstance(value, list) else [value]:
            if v is not None and not (v >= 0 if name in zero else v > 0):
                rule = "at least 0" if name in zero else "positive"
                flag = "--" + name.replace("_", "-")
                parser.error(f"{flag} {v}: must be {rule}")


def table(rows: list[dict], columns: list[str], note: str | None = None) -> str:
    """A Markdown table of `rows` (missing values shown as '-'), after the line `note`
    where one is given (an interpreted run's, `gpu_or_interpret`)."""

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
        return "-" if v is None else str(v)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(([note] if note else []) + lines)


def parse_specs(text: str, flag: str, kind: str, kinds: tuple[str, ...]) -> list[tuple]:
    """`kind:S:D,...` (a `flag`'s value) -> `[(kind, S, D)]`; ValueError naming the bad
    item."""
    specs = []
    for item in filter(None, text.split(",")):
        parts = item.split(":")
        if len(parts) != 3 or parts[0] not in kinds:
            raise ValueError(f"{flag} item {item!r}: want {kind}:S:D, {kind} {' or '.join(kinds)}")
        try:
            seq, hd = int(parts[1]), int(parts[2])
        except ValueError:
            raise ValueError(f"{flag} item {item!r}: S and D must be integers") from None
        if seq < 1 or hd < 1:
            raise ValueError(f"{flag} item {item!r}: S and D must be positive")
        specs.append((parts[0], seq, hd))
    return specs


@contextlib.contextmanager
def as_hopper(pkg=jflash, narrow_memory: bool | None = None):
    """While inside, `pkg` (a jflash package: this one, or a revision `ab.py` exports)
    picks its kernels as on a Hopper GPU whatever this process's devices are, to lower or
    compile them for one from a CPU machine (`kernel_modules.py`, `deviceless.py`).
    `narrow_memory`: also launch as on an H100 (True) or an H200 (False), where the
    package's launch order asks (`_launch_order.narrow_memory`)."""
    dispatch = sys.modules[f"{pkg.__name__}._dispatch"]
    order = sys.modules.get(f"{pkg.__name__}._launch_order")
    patch_order = narrow_memory is not None and hasattr(order, "narrow_memory")
    saved = dispatch._platform, dispatch._is_hopper
    saved_order = order.narrow_memory if patch_order else None
    dispatch._platform, dispatch._is_hopper = (lambda: "gpu"), (lambda: True)
    if patch_order:
        order.narrow_memory = lambda: narrow_memory
    try:
        yield
    finally:
        dispatch._platform, dispatch._is_hopper = saved
        if patch_order:
            order.narrow_memory = saved_order
