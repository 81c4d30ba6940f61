"""Ring attention across devices against the one-device kernel, in one process.

    python benchmarks/ring.py                                  # the efficiency table
    python benchmarks/ring.py --profile                        # + device time breakdown
    python benchmarks/ring.py --longest                        # longest fwd+bwd, 1 vs P
    python benchmarks/ring.py --devices 4 --documents --layouts zigzag,striped,contiguous \\
        --strategies ring --tokens-per-device 8192,16384 --passes fwdbwd --profile
    python benchmarks/ring.py --devices 4 --strategies ring,ulysses,hybrid,allgather \\
        --layouts zigzag --passes fwdbwd --cp-model                 # + cp_model's prediction
    python benchmarks/ring.py --tokens-per-device 16384 --devices 2 --layouts zigzag \\
        --strategies ring --longest --longest-start 131072     # one table row + longest
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python benchmarks/ring.py --interpret \\
        --tokens-per-device 128 --heads 4 --kv-heads 2 --head-dim 32 --implementation xla

Without a GPU it stops at once with one line saying so (exit status 2); `--interpret`
runs the same code on the CPU (the last example: on simulated CPU devices), Pallas
kernels in interpret mode as the tests run them, and its tables and JSON say so
(`"interpreted": true`): the times are not kernel times.

Ideal time at P devices: forward(+backward) of the whole sequence (P x tokens per
device) on one device with the same kernel, divided by P. Efficiency = ideal /
measured, with two timings of the same compiled calls: `*_ms`, one call then a
synchronisation (host launch and sync latency paid per call), and `*_pipe_ms`, calls
dispatched back to back and synchronised once (as a training loop runs them).
`--profile` reads each pass's device time from a `jax.profiler` trace with
`train.tools.trace`: attention kernels, other compute, communication and its exposed part
(a NCCL kernel running while no compute kernel does), idle; averaged over devices and
profiled iterations. Only GPU device tracks are read, so on CPU it is not measured.

`--rounds R` (R > 1): after a sequence's rows, it and its one-device ideal are timed
R - 1 more times in interleaved rounds (a balanced order: each takes every turn and
follows every other equally often), after `--heat` seconds of load, and every time is
the best of those R - 1 (the first, taken right after compiling, is dropped); the
efficiencies are recomputed from those. It holds every row's compiled calls and inputs
until then. Rows timed once each, minutes apart, read up to 6% apart on identical calls.

Every row's inputs are the ideal's, permuted into the row's layout (`jflash.positions`),
and the row's output is checked against the ideal's (`max_abs_diff`; past 0.05 the row
gets an `error`). Strategies: `hybrid` runs on a (P/2, 2) mesh, the ring over P/2
shards of a 2-way all-to-all (2x2 on 4 devices; it needs an even P >= 4).

`--documents [MEAN]`: packed documents, log-normal lengths (mean MEAN tokens, default
4096; sigma 1; capped at 16 x MEAN; seed 0: `benchmarks/balance.py`'s first row), one
packed row of P x tokens per device. Per-token segment ids go to the call in the row's
layout order; the ideal is one device's `flash_attention` on the same packed row
(natural order), so efficiency is the same ratio of times, and TFLOP/s (`tflops_*`:
per device; `ideal_tflops_*`: the one device) count the mask area: visible (query, key)
pairs x 4 x H per head (forward; x 3.5 forward+backward). Beside it: the per-rank
imbalance `balance.py` predicts for the layout (max over ranks / mean of the mask area
and of the kernel tiles visited), and with `--profile` the measured one: max / mean
over devices of each device's attention-kernel time in the trace (GPU only).

`--row-timeout S` (default 600; 0: none): a row (or its one-device ideal) that has
not finished after S seconds stops the run with every thread's stack printed and exit
code 1: a kernel that hangs the GPU cannot be interrupted in the process. A SIGTERM
(`timeout`, as `multi_gpu.sh` stops a step) prints the stacks too before the process
ends. Before each row starts, the rows so far and it, with an `error` saying it did
not finish, go to `<out>.partial` beside the JSON, so a run stopped there names the row
it stopped in and keeps the rows before it, and the JSON of the last whole run stays as
it was; the finished run writes the JSON and removes the partial file.

`--cp-model`: beside each forward+backward row, `benchmarks/cp_model.py`'s prediction
for its strategy and P (`model_eff_fwdbwd`, `model_exposed_ms`), with the kernel rate
taken from this run's one-device ideal and the link bandwidth measured here (ppermute
of 256 MiB per device over every device; 1 MiB on CPU), cp_model's defaults otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import functools
import json
import math
import os
import signal
import sys
import tempfile
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jflash  # noqa: E402
from benchmarks import balance, cp_model  # noqa: E402
from benchmarks.common import (  # noqa: E402
    HEAT_S,
    add_interpret_flag,
    check_out,
    device_name,
    gpu_or_interpret,
    heat,
    interleaved,
    jit_passes,
    table,
    time_fn,
    time_pipelined,
    write_json,
)
from train.metrics import compiled_bytes  # noqa: E402
from train.tools.capacity import search_longest  # noqa: E402
from train.tools.trace import parse as parse_trace  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16, "f32": jnp.float32}
PASSES = ("fwd", "fwdbwd")
OUT_TOLERANCE = 0.05  # max |ring - one device| of the outputs (bf16), as kernel.py's check
DOC_SEED, DOC_CAP, DOC_TILE = 0, 16, 128  # documents: seed, cap (x mean), balance.py's tile
NOTES = {
    "eff": "ideal / measured; ideal = one device's time for the whole sequence (the same "
    "packed documents where the row has them) / P; *_pipe: calls back to back",
    "tflops": "per device, on the mask area: visible (query, key) pairs x 4 x H per head "
    "(forward), x 3.5 forward+backward; ideal_tflops_*: the one device's",
    "predicted_*_imbalance": "balance.py: max over ranks / mean of the mask area and of "
    "the kernel tiles visited (128-token tiles), for the row's layout",
    "fwdbwd_attention_imbalance": "measured: max over devices / mean of each device's "
    "attention-kernel time in a jax.profiler trace (--profile, GPU); absent: not measured",
    "model_*": "benchmarks/cp_model.py's prediction (config.links: the bandwidth it used)",
    "max_abs_diff": "the row's output against the one device's, in the row's layout order",
}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _words(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def default_device_counts() -> list[int]:
    """1 (the ring's own overhead), every power of two below the count, and the count."""
    n = len(jax.devices())
    counts = {1, n} | {1 << i for i in range(n.bit_length()) if 1 << i <= n}
    return sorted(counts)


def draw_inputs(seq, args, sharding=None):
    dtype = DTYPES[args.dtype]
    ks = jax.random.split(jax.random.key(0), 4)
    shapes = [
        (args.batch, seq, args.heads, args.head_dim),
        (args.batch, seq, args.kv_heads, args.head_dim),
        (args.batch, seq, args.kv_heads, args.head_dim),
        (args.batch, seq, args.heads, args.head_dim),
    ]
    place = sharding if sharding is not None else jax.devices()[0]
    return [
        jax.device_put(jax.random.normal(key, shape, jnp.float32).astype(dtype), place)
        for key, shape in zip(ks, shapes, strict=True)
    ]


def _error(e: Exception) -> str:
    return "out of memory" if "RESOURCE_EXHAUSTED" in str(e) else str(e).splitlines()[0][:160]


def jitted_passes(attn, documents: bool, names=PASSES) -> dict:
    """`common.jit_passes(attn)`, or with documents its form for `attn(q, k, v, ids)`:
    the ids are an argument (not a constant XLA could fold), inputs `(q, k, v, ids, do)`.
    Only the passes in `names`."""
    if documents:

        @jax.jit
        def fwdbwd(q, k, v, ids, do):
            out, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, ids), q, k, v)
            return out, vjp(do)

        passes = {"fwd": (jax.jit(attn), 4), "fwdbwd": (fwdbwd, 5)}
    else:
        passes = jit_passes(attn)
    return {name: passes[name] for name in names}


def time_passes(attn, inputs, args, row: dict, prefix: str = "", documents=False) -> dict:
    """Fills `row[prefix+'fwd_ms']`, `row[prefix+'fwdbwd_ms']` (or `..._error`): wall
    time of one synchronised call; `..._pipe_ms`: per call, dispatched back to back;
    `..._compile_s`: lowering and compiling. Returns `{pass: (compiled, its inputs)}`
    of the passes that ran, warm."""
    ran = {}
    for name, (fn, nargs) in jitted_passes(attn, documents, args.passes).items():
        try:
            t0 = time.perf_counter()
            compiled = fn.lower(*inputs[:nargs]).compile()
            row[f"{prefix}{name}_compile_s"] = time.perf_counter() - t0
            t = time_fn(
                compiled, *inputs[:nargs], warmup=args.warmup, iters=args.iters, min_time=0.0
            )
            t_pipe = time_pipelined(compiled, *inputs[:nargs], warmup=0, iters=args.iters)
        except Exception as e:  # noqa: BLE001 - an OOM / unsupported shape is a row, not a crash
            row[f"{prefix}{name}_error"] = _error(e)
            continue
        row[f"{prefix}{name}_ms"] = t * 1e3
        row[f"{prefix}{name}_pipe_ms"] = t_pipe * 1e3
        ran[name] = (compiled, inputs[:nargs])
    return ran


def output_of(ran: dict):
    """The attention output of one call of a pass that ran (None if none ran)."""
    for name, (compiled, inputs) in ran.items():
        out = compiled(*inputs)
        return out[0] if name == "fwdbwd" else out
    return None


def document_row(seq: int, mean: int) -> list[int]:
    """The `--documents MEAN` row: log-normal document lengths packing `seq` tokens
    (seed `DOC_SEED`, each capped at `DOC_CAP` x the mean)."""
    return balance.document_lengths(seq, np.random.default_rng(DOC_SEED), mean, DOC_CAP * mean)


def single_device(seq, args, documents=None) -> tuple[dict, list, object, dict]:
    """The ideal's numerator, the whole sequence on device 0: `(row, natural-order
    inputs, output, the passes time_passes ran)`; with documents, their segment ids are
    the inputs' fourth."""
    causal, impl = not args.non_causal, args.implementation
    inputs = draw_inputs(seq, args)
    if documents is None:
        attn = functools.partial(
            jflash.flash_attention, causal=causal, implementation=impl, interpret=args.interpret
        )
    else:
        ids = np.repeat(np.arange(len(documents), dtype=np.int32), documents)
        inputs.insert(3, jax.device_put(np.tile(ids, (args.batch, 1)), jax.devices()[0]))

        def attn(q, k, v, ids):
            return jflash.flash_attention(
                q,
                k,
                v,
                causal=causal,
                segment_ids=ids,
                implementation=impl,
                interpret=args.interpret,
            )

    row: dict = {}
    ran = time_passes(attn, inputs, args, row, documents=documents is not None)
    return row, inputs, output_of(ran), ran


def ring_fn(mesh, layout, strategy, args, seq_axis="seq", documents=False):
    attn = functools.partial(
        jflash.ring_attention,
        mesh=mesh,
        seq_axis=seq_axis,
        causal=not args.non_causal,
        layout=layout,
        strategy=strategy,
        implementation=args.implementation,
        interpret=args.interpret,
    )
    if documents:
        return lambda q, k, v, ids: attn(q, k, v, segment_ids=ids)
    return attn


def seq_mesh(p: int, strategy: str):
    """`(mesh, seq_axis, layout shards)` of a sequence over P devices: the hybrid
    strategy's ring over P/2 shards of a 2-way all-to-all, one axis otherwise."""
    devices = jax.devices()[:p]
    if strategy == "hybrid":
        if p < 4 or p % 2:
            raise ValueError(f"strategy 'hybrid' needs an even P >= 4 (P/2 ring x 2 a2a); P={p}")
        return jax.make_mesh((p // 2, 2), ("seq", "a2a"), devices=devices), ("seq", "a2a"), p // 2
    return jax.make_mesh((p,), ("seq",), devices=devices), "seq", p


def check_output(row: dict, out, expected, pos) -> None:
    """`row['max_abs_diff']` of the row's output against the one device's (in the row's
    layout order); past `OUT_TOLERANCE` (or NaN) the row gets an `error`."""
    want = jax.device_put(expected[:, pos], out.sharding)
    diff = float(jnp.max(jnp.abs(out.astype(jnp.float32) - want.astype(jnp.float32))))
    row["max_abs_diff"] = diff
    if not diff <= OUT_TOLERANCE:
        row["error"] = f"wrong output: max |diff| vs one device {diff:.3g} > {OUT_TOLERANCE}"


def attention_pairs(seq: int, causal: bool, documents=None) -> int:
    """Visible (query, key) pairs, the mask area: of the packed documents' lengths, or
    of the whole sequence as one document."""
    return sum(n * (n + 1) // 2 if causal else n * n for n in documents or [seq])


# ----------------------------------------------------------------------------------
# cp_model's prediction beside a measured row


def link_gbps() -> dict:
    """GB/s per device for cp_model, each collective at 256 MiB per device over every
    device measured here (1 MiB on CPU): `ppermute` (the ring's hops), `all_to_all`
    (Ulysses), `all_gather` (the all-gather strategy); or cp_model's default."""
    if len(jax.devices()) < 2:
        return {"intra_gbps": 195.0, "from": "cp_model default (NVLink of 2 H200s)"}
    mib = 256 if jax.default_backend() == "gpu" else 1
    rows = {r["op"]: r["gbps"] for r in cp_model.measure([mib])["rows"]}
    return {
        "intra_gbps": rows["ppermute"],
        "a2a_gbps": rows["all_to_all"],
        "gather_gbps": rows["all_gather"],
        "from": f"ppermute, all_to_all, all_gather of {mib} MiB per device, measured here",
    }


def model_prediction(row: dict, ideal: dict, args, links: dict) -> None:
    """cp_model's forward+backward prediction for the row's strategy and P. Its kernel
    rate is the one device's measured (pipelined) rate on the whole sequence, undone
    for cp_model's short-call fall-off; its other inputs are cp_model's defaults
    (short_call_tokens 200, ring overhead 18 ns per token, latency 15 us). One node of
    2-GPU "nodes" joined at the same bandwidth: the hybrid is the 2x2 that runs here,
    and the other strategies' predictions are those of one node."""
    p, seq = row["devices"], row["seq_len"]
    if p < 2 or "fwdbwd_pipe_ms" not in ideal:
        return
    flops = 7 * args.batch * args.heads * args.head_dim * seq * seq  # causal fwd+bwd, B x
    rate = flops / (ideal["fwdbwd_pipe_ms"] * 1e-3) / 1e12
    gbps = links["intra_gbps"]
    machine = cp_model.Machine(
        rate * (seq + 200) / seq, 200.0, 18.0, gbps, gbps, 15.0, 2,
        links.get("a2a_gbps"), links.get("gather_gbps"),
    )  # fmt: skip
    shape = cp_model.Shape(args.heads, args.kv_heads, args.head_dim)
    for pred in cp_model.predict(p, row["tokens_per_device"], shape, machine):
        if pred.strategy == row["strategy"] and pred.efficiency > 0:
            row["model_eff_fwdbwd"] = pred.efficiency
            row["model_ms"] = pred.time_ms * args.batch
            row["model_exposed_ms"] = pred.exposed_ms * args.batch
            if pred.note:
                row["model_note"] = pred.note


# ----------------------------------------------------------------------------------
# Device time from a profile trace


BREAKDOWN = ("busy_ms", "idle_ms", "attention_ms", "other_ms", "comm_ms", "exposed_comm_ms")


def gpu_trace(trace_dir: str):
    """`train.tools.trace`'s report of the newest trace (the whole trace is one window),
    or None when it has no GPU device tracks (CPU runs)."""
    try:
        report = parse_trace(trace_dir)
    except (FileNotFoundError, ValueError):
        return None
    return report if report.platform == "gpu" else None


def breakdown_of(report, iterations: int) -> dict:
    """Per iteration, averaged over devices: busy, idle, attention kernels, other
    compute (merges, casts, copies), communication and its exposed part (ms)."""
    m = report.mean
    values = {
        "busy_ms": m.busy_ms,
        "idle_ms": m.idle_ms,
        "attention_ms": m.attention_ms,
        "other_ms": (m.other_ms or 0.0) + (m.matmul_ms or 0.0),
        "comm_ms": m.comm_ms,
        "exposed_comm_ms": m.exposed_comm_ms,
    }
    return {k: v / iterations for k, v in values.items()}


def device_breakdown(trace_dir: str, iterations: int) -> dict | None:
    """`breakdown_of` the newest trace in `trace_dir`; None when it has no GPU device
    tracks (CPU runs)."""
    report = gpu_trace(trace_dir)
    return None if report is None else breakdown_of(report, iterations)


def profile_passes(ran: dict, iterations: int, row: dict) -> bool:
    """Traces `iterations` back-to-back calls of each pass `time_passes` ran (as
    `time_pipelined` runs them) and fills `row['<pass>_<field>']` for the fields of
    `breakdown_of`; `row['<pass>_rank_attention_ms']`, each device's attention kernels
    per iteration in device order, and `row['<pass>_attention_imbalance']`, their max
    over their mean. False when the trace has no GPU device tracks."""
    for name, (compiled, inputs) in ran.items():
        with tempfile.TemporaryDirectory() as trace_dir:
            with jax.profiler.trace(trace_dir):
                jax.block_until_ready([compiled(*inputs) for _ in range(iterations)])
            report = gpu_trace(trace_dir)
        if report is None:
            return False
        row.update({f"{name}_{k}": v for k, v in breakdown_of(report, iterations).items()})
        order = sorted(report.devices, key=lambda d: int(d.split(":")[1]))
        ranks = [report.devices[d].attention_ms for d in order]
        if all(x is not None for x in ranks) and sum(ranks) > 0:
            row[f"{name}_rank_attention_ms"] = [x / iterations for x in ranks]
            row[f"{name}_attention_imbalance"] = max(ranks) / (sum(ranks) / len(ranks))
    return True


# ----------------------------------------------------------------------------------
# Main table


def document_fields(lengths: list[int], causal: bool, shards: int, layout: str, strategy: str):
    """A documents row's mask (`dense_pairs`: the same tokens as one document) and
    balance.py's predicted per-rank imbalance (rings only: Ulysses runs the whole
    sequence per device)."""
    seq = sum(lengths)
    fields = {
        "documents": len(lengths),
        "longest_document": max(lengths),
        "mask_pairs": attention_pairs(seq, causal, lengths),
        "dense_pairs": attention_pairs(seq, causal),
        "document_lengths": lengths,
    }
    fields["mask_fraction"] = fields["mask_pairs"] / fields["dense_pairs"]
    if strategy != "ulysses" and shards > 1:
        tile = math.gcd(DOC_TILE, seq // shards)  # whole tiles per rank (tiny runs)
        area, tiles = balance.rank_work(lengths, shards, layout, tile)
        fields["predicted_area_imbalance"] = float(area.max() / area.mean())
        fields["predicted_tile_imbalance"] = float(tiles.max() / tiles.mean())
    return fields


def mesh_scope(mesh):
    """`jax.set_mesh(mesh)`, or nothing for a one-device candidate (`mesh` None)."""
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()


def retime(candidates: list[tuple[dict, dict, object]], rounds: int, args) -> None:
    """Rounds 2..`rounds` of timing for one sequence's candidates (`(row, ran, mesh)`:
    the one-device ideal and every layout x strategy row), after `args.heat` seconds of
    load (`common.heat`): each round times every forward, then every forward+backward,
    once per call and back to back, in an order from a balanced Latin square; each
    `*_ms` becomes the best of those timings. The row's own first timing, taken right
    after its compilation left the GPUs idle, is dropped: such a reading ran up to 3%
    fast on one H200 (`ab.py`'s null run, BENCHMARKS.md). Candidates measured minutes
    apart each once read up to 6% apart on identical calls (4x H100); interleaved, a
    drift of the clocks reaches all of them."""

    def in_mesh(mesh, fn):
        with mesh_scope(mesh):
            return fn()

    heat(
        [
            functools.partial(in_mesh, mesh, functools.partial(compiled, *inputs))
            for _, ran, mesh in candidates
            for compiled, inputs in ran.values()
        ],
        args.heat,
    )
    best = {}
    for r, name, i in interleaved(len(candidates), range(1, rounds), PASSES):
        row, ran, mesh = candidates[i]
        if name not in ran:
            continue
        compiled, inputs = ran[name]
        with mesh_scope(mesh):
            t = time_fn(compiled, *inputs, warmup=1, iters=args.iters, min_time=0.0)
            t_pipe = time_pipelined(compiled, *inputs, warmup=0, iters=args.iters)
        t0, p0 = best.get((i, name), (float("inf"), float("inf")))
        best[i, name] = (min(t0, t), min(p0, t_pipe))
        row["rounds"] = r + 1
    for (i, name), (t, t_pipe) in best.items():
        row = candidates[i][0]
        row[f"{name}_ms"], row[f"{name}_pipe_ms"] = t * 1e3, t_pipe * 1e3


def derive(row: dict, ideal: dict, p: int, pairs: int, args, links, documents: bool) -> None:
    """A row's fields from its times and the ideal's: `ideal_*_ms`, `eff_*`,
    `tflops_*`, the exposed share of communication, the model's prediction."""
    for name in ("fwd", "fwdbwd", "fwd_pipe", "fwdbwd_pipe"):
        if f"{name}_ms" in ideal:
            row[f"ideal_{name}_ms"] = ideal[f"{name}_ms"] / p
            if f"{name}_ms" in row:
                row[f"eff_{name}"] = row[f"ideal_{name}_ms"] / row[f"{name}_ms"]
        elif f"{name}_error" in ideal:
            row[f"ideal_{name}_error"] = ideal[f"{name}_error"]
    for name in ("fwd_pipe", "fwdbwd_pipe"):
        flops = 4 * args.batch * args.heads * args.head_dim * pairs
        flops *= 3.5 if name == "fwdbwd_pipe" else 1.0
        if f"{name}_ms" in row:
            row[f"tflops_{name}"] = flops / (p * row[f"{name}_ms"] * 1e9)
        if f"{name}_ms" in ideal:
            row[f"ideal_tflops_{name}"] = flops / (ideal[f"{name}_ms"] * 1e9)
    if "fwdbwd_exposed_comm_ms" in row and "fwdbwd_pipe_ms" in row:
        row["exposed_comm_frac"] = row["fwdbwd_exposed_comm_ms"] / row["fwdbwd_pipe_ms"]
    if links is not None and not documents and not args.non_causal:
        model_prediction(row, ideal, args, links)


# Seconds past `--row-timeout` after which faulthandler's watchdog stops a row that
# never lets the timer below run (a thread holding the GIL): the watchdog walks the
# stacks without the GIL, while the threads change them, and can crash the process
# mid-dump; the timer dumps them holding the GIL.
WATCHDOG_GRACE_S = 30.0


def _stop_row(timeout: float) -> None:
    """`--row-timeout`'s end: every thread's stack on stderr, then exit code 1."""
    sys.stderr.write(f"Timeout ({datetime.timedelta(seconds=timeout)})!\n")
    faulthandler.dump_traceback(all_threads=True)
    sys.stderr.flush()
    os._exit(1)


@contextlib.contextmanager
def row_watch(rows: list[dict], row: dict, args, on_row):
    """Around one row: `on_row` first sees it as unfinished, and past `--row-timeout`
    seconds the process stops (stacks printed, exit code 1)."""
    on_row([*rows, dict(row, error="did not finish: the run stopped during this row")])
    timer = None
    if args.row_timeout:
        timer = threading.Timer(args.row_timeout, _stop_row, (args.row_timeout,))
        timer.daemon = True
        timer.start()
        faulthandler.dump_traceback_later(args.row_timeout + WATCHDOG_GRACE_S, exit=True)
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()
        faulthandler.cancel_dump_traceback_later()


def benchmark(args, on_row=lambda rows: None, links: dict | None = None) -> list[dict]:
    """The table; `on_row(rows)` after each row (the JSON survives a run cut short)."""
    rows, ideal_cache = [], {}
    columns = table_columns(args)
    causal = not args.non_causal
    for tokens in args.tokens_per_device:
        for p in args.devices:
            seq = tokens * p
            lengths = None
            if args.documents:
                lengths = document_row(seq, args.documents)
            if seq not in ideal_cache:
                ideal_cache.clear()  # one sequence's inputs and output held at a time
                one = dict(tokens_per_device=tokens, devices=1, seq_len=seq, strategy="ideal")
                with row_watch(rows, one, args, on_row):
                    ideal_cache[seq] = single_device(seq, args, lengths)
            ideal, natural, expected, ideal_ran = ideal_cache[seq]
            group = [(ideal, ideal_ran, None)]  # what --rounds times again
            pairs = attention_pairs(seq, causal, lengths)
            for layout in args.layouts:
                for strategy in args.strategies:
                    t_row = time.perf_counter()
                    row = dict(
                        tokens_per_device=tokens,
                        devices=p,
                        seq_len=seq,
                        layout=layout,
                        strategy=strategy,
                    )
                    try:
                        mesh, axis, shards = seq_mesh(p, strategy)
                    except ValueError as e:
                        row["error"] = str(e)
                        rows.append(row)
                        print(f"{tokens} tokens, P={p}, {strategy}: {e}", flush=True)
                        continue
                    if lengths is not None:
                        row.update(document_fields(lengths, causal, shards, layout, strategy))
                    pos = np.asarray(jflash.positions(seq, shards, layout))
                    sharding = NamedSharding(mesh, P(None, axis))
                    inputs = [jax.device_put(x[:, pos], sharding) for x in natural]
                    attn = ring_fn(mesh, layout, strategy, args, axis, lengths is not None)
                    with row_watch(rows, row, args, on_row), jax.set_mesh(mesh):
                        ran = time_passes(attn, inputs, args, row, documents=lengths is not None)
                        out = output_of(ran) if expected is not None else None
                        if args.profile and "fwdbwd_ms" in row:
                            if not profile_passes(ran, args.profile_iters, row):
                                print(
                                    "device breakdown: not measured (the trace has no GPU "
                                    "device tracks)",
                                    flush=True,
                                )
                    if out is not None:
                        check_output(row, out, expected, pos)
                    if args.rounds > 1 and ran:
                        group.append((row, ran, mesh))
                    del ran, inputs, out
                    derive(row, ideal, p, pairs, args, links, lengths is not None)
                    row["row_s"] = time.perf_counter() - t_row
                    rows.append(row)
                    print(table([row], columns).splitlines()[-1], flush=True)
                    errors = {k: v for k, v in row.items() if k.endswith("error")}
                    if errors:
                        print(f"  {errors}", flush=True)
                    on_row(rows)
            if len(group) > 1:
                print(f"{args.rounds} rounds, {tokens} tokens per device, P={p}:", flush=True)
                retime(group, args.rounds, args)
                for row, _, _ in group[1:]:
                    derive(row, ideal, p, pairs, args, links, lengths is not None)
                    print(table([row], columns).splitlines()[-1], flush=True)
                on_row(rows)
            del group
    _zigzag_speedups(rows)
    return rows


def _zigzag_speedups(rows: list[dict]) -> None:
    """contiguous time / zigzag time for the same tokens, P and strategy."""
    index = {(r["tokens_per_device"], r["devices"], r["strategy"], r["layout"]): r for r in rows}
    for r in rows:
        if r["layout"] != "zigzag":
            continue
        other = index.get((r["tokens_per_device"], r["devices"], r["strategy"], "contiguous"))
        for t in ("fwdbwd", "fwdbwd_pipe"):
            if other and f"{t}_ms" in other and f"{t}_ms" in r:
                r[f"zigzag_speedup_{t}"] = other[f"{t}_ms"] / r[f"{t}_ms"]


COLUMNS = [
    "tokens_per_device",
    "devices",
    "layout",
    "strategy",
    "fwd_ms",
    "eff_fwd",
    "fwd_pipe_ms",
    "eff_fwd_pipe",
    "fwdbwd_ms",
    "eff_fwdbwd",
    "fwdbwd_pipe_ms",
    "eff_fwdbwd_pipe",
    "zigzag_speedup_fwdbwd_pipe",
    "exposed_comm_frac",
]
DOCUMENT_COLUMNS = [
    "documents",
    "mask_fraction",
    "tflops_fwdbwd_pipe",
    "ideal_tflops_fwdbwd_pipe",
    "predicted_area_imbalance",
    "predicted_tile_imbalance",
    "fwdbwd_attention_imbalance",
    "max_abs_diff",
]
MODEL_COLUMNS = ["model_eff_fwdbwd", "model_exposed_ms", "max_abs_diff"]
PROFILE_COLUMNS = ["tokens_per_device", "devices", "layout", "strategy"] + [
    f"{p}_{k}" for p in ("fwd", "fwdbwd") for k in BREAKDOWN
]


def table_columns(args) -> list[str]:
    if args.documents:
        return COLUMNS + DOCUMENT_COLUMNS
    return COLUMNS + (MODEL_COLUMNS if args.cp_model else ["max_abs_diff"])


# ----------------------------------------------------------------------------------
# Longest sequence that fits (compile-time memory analysis, optionally run once)


def fits(attn, seq, args, sharding, limit: int) -> tuple[bool, float]:
    """Whether forward+backward at `seq` fits in `limit` bytes per device (compiled
    memory analysis: arguments + outputs + temporaries), and that total in GiB."""
    shapes = draw_inputs_abstract(seq, args, sharding)
    try:
        compiled = jit_passes(attn)["fwdbwd"][0].lower(*shapes).compile()
    except Exception as e:  # noqa: BLE001 - a compile-time OOM means it does not fit
        if "RESOURCE_EXHAUSTED" in str(e):
            return False, float("nan")
        raise
    used = compiled_bytes(compiled)
    return used <= limit, used / 2**30


def draw_inputs_abstract(seq, args, sharding):
    dtype = DTYPES[args.dtype]
    q = (args.batch, seq, args.heads, args.head_dim)
    kv = (args.batch, seq, args.kv_heads, args.head_dim)
    return [jax.ShapeDtypeStruct(s, dtype, sharding=sharding) for s in (q, kv, kv, q)]


def longest(args) -> dict | None:
    """Longest causal forward+backward that fits on 1 device vs on all of them.

    "Fits" is XLA's compiled memory analysis (arguments + outputs + temporaries per
    device) against the device's allocator limit (`bytes_limit`, or
    `--longest-limit-gib`); nothing runs unless `--longest-run`.
    """
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    if args.longest_limit_gib is not None:
        limit = int(args.longest_limit_gib * 2**30)
    if limit is None:
        print("longest: this backend reports no device memory limit; skipped")
        return None
    n = len(jax.devices())
    result: dict = {
        "bytes_limit_gib": limit / 2**30,
        "limit_from": "--longest-limit-gib"
        if args.longest_limit_gib is not None
        else "device bytes_limit",
        "method": "compiled memory analysis (arguments + outputs + temporaries per device) "
        "<= limit" + ("; the longest then run once" if args.longest_run else "; not run"),
        "refine_steps": args.longest_refine,
    }
    for p in sorted({1, n}):
        if p == 1:
            # One device, no mesh: a 1-device mesh's (Explicit) "seq" sharding would reach
            # the kernel's einsums as a sharded type and fail to trace.
            mesh, sharding = None, SingleDeviceSharding(jax.devices()[0])
            attn = functools.partial(
                jflash.flash_attention,
                causal=True,
                implementation=args.implementation,
                interpret=args.interpret,
            )
        else:
            mesh = jax.make_mesh((p,), ("seq",), devices=jax.devices()[:p])
            sharding = NamedSharding(mesh, P(None, "seq"))
            attn = ring_fn(mesh, "zigzag", "ring", args)

        def fits_at(seq, attn=attn, sharding=sharding, p=p) -> dict:
            try:
                ok, gib = fits(attn, seq, args, sharding, limit)
            except Exception as e:  # noqa: BLE001 - a length that fails to compile is a probe
                error = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
                print(f"longest: P={p} seq={seq} failed to compile: {error}", flush=True)
                return {"fits": False, "gib": None, "error": error}
            print(
                f"longest: P={p} seq={seq} needs {gib:.4g} GiB/device: "
                f"{'fits' if ok else 'does not fit'}",
                flush=True,
            )
            return {"fits": ok, "gib": None if math.isnan(gib) else gib}

        with mesh_scope(mesh):
            # Bisection lengths: zigzag splits the sequence into 2P chunks, and whole
            # 1024-token blocks keep the kernel's tiles full (gcd: small --longest-start).
            best, probes = search_longest(
                fits_at,
                args.longest_start,
                args.longest_max,
                refine=args.longest_refine,
                granule=math.gcd(args.longest_start, 2 * n * 1024),
            )
            if best is not None and args.longest_run:
                row: dict = {}
                args_once = argparse.Namespace(**{**vars(args), "warmup": 0, "iters": 1})
                time_passes(
                    attn, draw_inputs(best, args, sharding if p > 1 else None), args_once, row
                )
                result[f"P{p}_ran"] = "fwdbwd_ms" in row
                result[f"P{p}_run"] = row
        result[f"P{p}_longest"] = best
        result[f"P{p}_probes"] = probes
    if result.get("P1_longest") and result.get(f"P{n}_longest"):
        result["ratio"] = result[f"P{n}_longest"] / result["P1_longest"]
    print(json.dumps({k: v for k, v in result.items() if not k.endswith("_probes")}))
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tokens-per-device", type=_ints, default=[4096, 8192, 16384, 32768, 65536]
    )
    parser.add_argument(
        "--devices",
        type=_ints,
        default=None,
        help="device counts P (default: 1, powers of two, all)",
    )
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument(
        "--implementation",
        default=None,
        choices=jflash.IMPLEMENTATIONS,
        help="pallas_triton | pallas_mosaic | xla (default: jflash's choice)",
    )
    parser.add_argument("--non-causal", action="store_true")
    parser.add_argument("--layouts", type=_words, default=["zigzag", "contiguous"])
    parser.add_argument("--strategies", type=_words, default=["ring", "allgather"])
    parser.add_argument(
        "--passes",
        type=_words,
        default=list(PASSES),
        help="fwd,fwdbwd: the passes timed (each is compiled; fwdbwd alone halves that)",
    )
    parser.add_argument(
        "--documents",
        type=int,
        nargs="?",
        const=4096,
        default=None,
        metavar="MEAN",
        help="packed documents of log-normal lengths, mean MEAN tokens (default 4096), "
        "capped at 16 x MEAN, seed 0: segment ids in the layout; TFLOP/s on the mask area",
    )
    parser.add_argument(
        "--cp-model",
        action="store_true",
        help="benchmarks/cp_model.py's prediction beside each fwd+bwd row (links measured)",
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="time each sequence's rows and its one-device ideal again in this many "
        "interleaved rounds (balanced order) and keep each one's best",
    )
    parser.add_argument(
        "--heat",
        type=float,
        default=HEAT_S,
        help="with --rounds: seconds of load before the rounds (the GPUs cooled compiling)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="read each pass's device time (attention, other compute, communication "
        "exposed or not, idle) from a jax.profiler trace (GPU)",
    )
    parser.add_argument("--profile-iters", type=int, default=3)
    parser.add_argument(
        "--row-timeout",
        type=float,
        default=600,
        help="seconds a row may take before the run stops, stacks printed (0: no limit)",
    )
    parser.add_argument(
        "--longest",
        action="store_true",
        help="also find the longest causal fwd+bwd on 1 vs all devices",
    )
    parser.add_argument("--longest-start", type=int, default=16384)
    parser.add_argument("--longest-max", type=int, default=1 << 23)
    parser.add_argument(
        "--longest-refine",
        type=int,
        default=4,
        help="bisection steps after doubling (resolution: 1/2**N of the last doubling)",
    )
    parser.add_argument(
        "--longest-limit-gib",
        type=float,
        default=None,
        help="memory limit per device (default: the device's allocator limit; CPU has none)",
    )
    parser.add_argument(
        "--longest-run",
        action="store_true",
        help="run the longest fitting length once to confirm it",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="JSON path (default: benchmarks/results/ring-<devices>x<gpu>.json: ring-2xh200.json)",
    )
    add_interpret_flag(parser)
    args = parser.parse_args(argv)
    for flag, values, allowed in (
        ("--layouts", args.layouts, jflash.LAYOUTS),
        ("--strategies", args.strategies, jflash.STRATEGIES),
        ("--passes", args.passes, PASSES),
    ):
        for value in values or [""]:
            if value not in allowed:
                parser.error(f"{flag} {value!r}: not one of {', '.join(allowed)}")
    for flag, values in (
        ("--tokens-per-device", args.tokens_per_device),
        ("--devices", args.devices),
    ):
        if values is not None and (not values or min(values) < 1):
            parser.error(f"{flag} {','.join(map(str, values))}: each must be >= 1")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: must be >= 1")
    if not args.row_timeout >= 0:
        parser.error(f"--row-timeout {args.row_timeout}: must be >= 0 seconds (0: no limit)")
    if args.documents is not None and args.documents < 1:
        parser.error(f"--documents {args.documents}: the mean document length must be >= 1")
    for flag, value in (
        ("--heads", args.heads),
        ("--kv-heads", args.kv_heads),
        ("--head-dim", args.head_dim),
        ("--batch", args.batch),
    ):
        if value < 1:
            parser.error(f"{flag} {value}: must be >= 1")
    if args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads}: not a multiple of --kv-heads {args.kv_heads}")
    odd = [t for t in args.tokens_per_device or () if t % 2]
    if odd and "zigzag" in args.layouts and max(args.devices or default_device_counts()) > 1:
        parser.error(
            f"--tokens-per-device {odd[0]}: the zigzag layout halves each device's tokens; "
            "give an even count"
        )
    out = args.out or RESULTS
    if os.path.isdir(out) or not out.endswith(".json"):  # a directory: the standard name
        out = os.path.join(out, f"ring-{len(jax.devices())}x{device_name()}.json")
    check_out(parser, "--out", out)
    note = gpu_or_interpret("benchmarks/ring.py", args.interpret)
    # The kernels' interpret=: None compiles them (on a GPU), and the XLA one has none.
    args.interpret = True if note and args.implementation != "xla" else None
    args.devices = args.devices or default_device_counts()
    if max(args.devices) > len(jax.devices()):
        parser.error(f"{args.devices=} but only {len(jax.devices())} devices")
    faulthandler.register(signal.SIGTERM, chain=True)  # stacks, then the default: exit
    print(jflash.describe())
    config = {k: v for k, v in vars(args).items() if k != "out"}
    config["notes"] = NOTES
    save = functools.partial(write_json, note=note)
    links = None
    if args.cp_model:
        links = config["links"] = link_gbps()
        rates = ", ".join(f"{k[:-5]} {v:.1f}" for k, v in links.items() if k.endswith("_gbps"))
        print(f"cp_model links, GB/s: {rates} ({links['from']})", flush=True)
    columns = table_columns(args)
    print(table([], columns))
    rows = benchmark(
        args,
        on_row=lambda rows: save(out, {"config": config, "rows": rows}, partial=True),
        links=links,
    )
    print()
    print(table(rows, columns, note))
    if args.profile:
        print("\nDevice time per iteration (ms, mean over devices; calls back to back):")
        print(table(rows, PROFILE_COLUMNS, note))
    payload = {"config": config, "rows": rows}
    if args.longest:
        save(out, payload, partial=True)  # the table survives a search stopped from outside
        payload["longest"] = longest(args)
    save(out, payload)


if __name__ == "__main__":
    main()
