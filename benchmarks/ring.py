"""Ring attention across devices against the one-device kernel, in one process.

    python benchmarks/ring.py                                  # the efficiency table
    python benchmarks/ring.py --profile                        # + device time breakdown
    python benchmarks/ring.py --longest                        # longest fwd+bwd, 1 vs P
    python benchmarks/ring.py --tokens-per-device 16384 --devices 2 --layouts zigzag \
        --strategies ring --longest --longest-start 131072     # one table row + longest
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python benchmarks/ring.py \\
        --tokens-per-device 128 --heads 4 --kv-heads 2 --head-dim 32 --implementation xla

Ideal time at P devices: forward(+backward) of the whole sequence (P x tokens per
device) on one device with the same kernel, divided by P. Efficiency = ideal /
measured, with two timings of the same compiled calls: `*_ms`, one call then a
synchronisation (host launch and sync latency paid per call), and `*_pipe_ms`, calls
dispatched back to back and synchronised once (as a training loop runs them).
`--profile` reads each pass's device time from a `jax.profiler` trace with
`train.tools.trace`: attention kernels, other compute, communication and its exposed part
(a NCCL kernel running while no compute kernel does), idle; averaged over devices and
profiled iterations. Only GPU device tracks are read, so on CPU it is not measured.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jflash  # noqa: E402
from benchmarks.common import (  # noqa: E402
    device_name,
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


def time_passes(attn, inputs, args, row: dict, prefix: str = "") -> dict:
    """Fills `row[prefix+'fwd_ms']`, `row[prefix+'fwdbwd_ms']` (or `..._error`): wall
    time of one synchronised call; and `..._pipe_ms`: per call, dispatched back to back.
    Returns `{pass: (compiled, its inputs)}` of the passes that ran, warm."""
    ran = {}
    for name, (fn, nargs) in jit_passes(attn).items():
        try:
            compiled = fn.lower(*inputs[:nargs]).compile()
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


def single_device(seq, args) -> dict:
    """The ideal's numerator: the whole sequence on device 0."""
    attn = functools.partial(
        jflash.flash_attention, causal=not args.non_causal, implementation=args.implementation
    )
    row: dict = {}
    time_passes(attn, draw_inputs(seq, args), args, row)
    return row


def ring_fn(mesh, layout, strategy, args):
    return functools.partial(
        jflash.ring_attention,
        mesh=mesh,
        causal=not args.non_causal,
        layout=layout,
        strategy=strategy,
        implementation=args.implementation,
    )


# ----------------------------------------------------------------------------------
# Device time from a profile trace


BREAKDOWN = ("busy_ms", "idle_ms", "attention_ms", "other_ms", "comm_ms", "exposed_comm_ms")


def device_breakdown(trace_dir: str, iterations: int) -> dict | None:
    """Per iteration, averaged over devices: busy, idle, attention kernels, other
    compute (merges, casts, copies), communication and its exposed part (ms), read by
    `train.tools.trace` from the newest trace (the whole trace is one window); None when the
    trace has no GPU device tracks (CPU runs)."""
    try:
        report = parse_trace(trace_dir)
    except (FileNotFoundError, ValueError):
        return None
    if report.platform != "gpu":
        return None
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


def profile_passes(ran: dict, iterations: int, row: dict) -> bool:
    """Traces `iterations` back-to-back calls of each pass `time_passes` ran (as
    `time_pipelined` runs them) and fills `row['<pass>_<field>']` for the fields of
    `device_breakdown`; False when the trace has no GPU device tracks."""
    for name, (compiled, inputs) in ran.items():
        with tempfile.TemporaryDirectory() as trace_dir:
            with jax.profiler.trace(trace_dir):
                jax.block_until_ready([compiled(*inputs) for _ in range(iterations)])
            parts = device_breakdown(trace_dir, iterations)
        if parts is None:
            return False
        row.update({f"{name}_{k}": v for k, v in parts.items()})
    return True


# ----------------------------------------------------------------------------------
# Main table


def benchmark(args, on_row=lambda rows: None) -> list[dict]:
    """The table; `on_row(rows)` after each row (the JSON survives a run cut short)."""
    rows, ideal_cache = [], {}
    for tokens in args.tokens_per_device:
        for p in args.devices:
            seq = tokens * p
            if seq not in ideal_cache:
                ideal_cache[seq] = single_device(seq, args)
            ideal = ideal_cache[seq]
            mesh = jax.make_mesh((p,), ("seq",), devices=jax.devices()[:p])
            sharding = NamedSharding(mesh, P(None, "seq"))
            inputs = draw_inputs(seq, args, sharding)
            for layout in args.layouts:
                for strategy in args.strategies:
                    row = dict(
                        tokens_per_device=tokens,
                        devices=p,
                        seq_len=seq,
                        layout=layout,
                        strategy=strategy,
                    )
                    attn = ring_fn(mesh, layout, strategy, args)
                    with jax.set_mesh(mesh):
                        ran = time_passes(attn, inputs, args, row)
                        if args.profile and "fwdbwd_ms" in row:
                            if not profile_passes(ran, args.profile_iters, row):
                                print(
                                    "device breakdown: not measured (the trace has no GPU "
                                    "device tracks)",
                                    flush=True,
                                )
                            else:
                                row["exposed_comm_frac"] = (
                                    row["fwdbwd_exposed_comm_ms"] / row["fwdbwd_pipe_ms"]
                                )
                    for name in ("fwd", "fwdbwd", "fwd_pipe", "fwdbwd_pipe"):
                        if f"{name}_ms" in ideal:
                            row[f"ideal_{name}_ms"] = ideal[f"{name}_ms"] / p
                            if f"{name}_ms" in row:
                                row[f"eff_{name}"] = row[f"ideal_{name}_ms"] / row[f"{name}_ms"]
                        elif f"{name}_error" in ideal:
                            row[f"ideal_{name}_error"] = ideal[f"{name}_error"]
                    rows.append(row)
                    print(table([row], COLUMNS).splitlines()[-1], flush=True)
                    on_row(rows)
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
PROFILE_COLUMNS = ["tokens_per_device", "devices", "layout", "strategy"] + [
    f"{p}_{k}" for p in ("fwd", "fwdbwd") for k in BREAKDOWN
]


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
                jflash.flash_attention, causal=True, implementation=args.implementation
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

        with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
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
        help="pallas_triton | pallas_mosaic | xla (default: jflash's choice)",
    )
    parser.add_argument("--non-causal", action="store_true")
    parser.add_argument("--layouts", type=_words, default=["zigzag", "contiguous"])
    parser.add_argument("--strategies", type=_words, default=["ring", "allgather"])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="read each pass's device time (attention, other compute, communication "
        "exposed or not, idle) from a jax.profiler trace (GPU)",
    )
    parser.add_argument("--profile-iters", type=int, default=3)
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
    args = parser.parse_args(argv)
    args.devices = args.devices or default_device_counts()
    if max(args.devices) > len(jax.devices()):
        parser.error(f"{args.devices=} but only {len(jax.devices())} devices")
    print(jflash.describe())
    out = args.out or RESULTS
    if os.path.isdir(out) or not out.endswith(".json"):  # a directory: the standard name
        out = os.path.join(out, f"ring-{len(jax.devices())}x{device_name()}.json")
    config = {k: v for k, v in vars(args).items() if k != "out"}
    print(table([], COLUMNS))
    rows = benchmark(args, on_row=lambda rows: write_json(out, {"config": config, "rows": rows}))
    print()
    print(table(rows, COLUMNS))
    if args.profile:
        print("\nDevice time per iteration (ms, mean over devices; calls back to back):")
        print(table(rows, PROFILE_COLUMNS))
    payload = {"config": config, "rows": rows}
    if args.longest:
        write_json(out, payload)  # the table survives a search stopped from outside
        payload["longest"] = longest(args)
    write_json(out, payload)


if __name__ == "__main__":
    main()
