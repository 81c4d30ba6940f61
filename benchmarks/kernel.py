"""Single-device attention kernels: jflash vs cuDNN, FlashAttention-3, a Triton-language
kernel and XLA, in one process.

    python benchmarks/kernel.py                   # 4k-64k, causal and full: ratios to cuDNN, FA3
    python benchmarks/kernel.py --masks causal    # causal rows only (--masks full: the rest)
    python benchmarks/kernel.py --sweep           # time/TFLOP/s/memory vs S, heads, D + PNGs
    python benchmarks/kernel.py --tune            # block-size candidates for jflash
    python benchmarks/kernel.py --long 131072     # fwd+bwd memory at very long S
    python benchmarks/kernel.py --kernels         # fwd+bwd time per GPU kernel (traced)
    python benchmarks/kernel.py --launch-order    # launch order A/B per kernel (--impls)
    python benchmarks/kernel.py --documents       # 64k packed documents vs FA3 varlen
    python benchmarks/kernel.py --documents --tune --which fwd  # Mosaic block sizes on them

Without a GPU it stops at once with one line saying so (exit status 2); `--interpret`
runs the same code on the CPU, Pallas kernels in interpret mode as the tests run them,
and its tables and JSON say so (`"interpreted": true`): the times are not kernel times.

Each shape's rows (and `--documents`' rows) are timed again in `--rounds` interleaved
rounds (default 3; a balanced order, each pass in its own sweep) after `--heat` seconds
of load, and keep their best times, so the ratios between them carry neither the GPU's
drift nor the order's bias, nor the head start of a reading right after compiling. A
time is per call of calls dispatched back to back and synchronised once per batch
(`common.time_pipelined`), as a training loop runs them: the host's launch and sync
latency, 0.5-0.8 ms per call on an H200 beside a 5 ms attention call, is not in it.

Causal TFLOP/s: forward 4·B·N·S²·H/2, forward+backward 3.5× that; full (non-causal)
attention counts 4·B·N·S²·H. With packed documents the count is the mask area: visible
(query, key) pairs × 4·H per head.

Peers outside jax, each imported where installed and otherwise a row saying why (never a
dependency): `--impls fa3` is `flash_attn3_jax.flash_mha` (FlashAttention-3, D = 64
and 128), `--impls jax_triton` the Triton-language kernel of `benchmarks/triton_attention.py`
through `jax_triton.triton_call`, `--impls tokamax` tokamax's Pallas Mosaic GPU
FlashAttention (`tokamax.dot_product_attention(..., implementation="mosaic")`, forward
and backward on Hopper); jax-triton and tokamax are in the `bench` extra.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jflash  # noqa: E402
from benchmarks import balance  # noqa: E402
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
    time_pipelined,
    traced_kernels,
    write_json,
)
from train.tools.trace import kernel_label  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


# Benchmark row names of jflash's implementations (the rest are jax's own):
# (implementation, deterministic). `jflash_mosaic` is the default Mosaic backward
# (fused dQ, f32 reduce-add); `jflash_mosaic_det` its bitwise-reproducible two-kernel form.
JFLASH = {
    "jflash": ("pallas_triton", None),
    "jflash_mosaic": ("pallas_mosaic", False),
    "jflash_mosaic_det": ("pallas_mosaic", True),
    "jflash_xla": ("xla", None),
}


# Peers that are optional imports: row name -> what they are, for the skip notes.
PEERS = {
    "fa3": "FlashAttention-3 (flash_attn3_jax.flash_mha)",
    "jax_triton": "Triton-language kernel (benchmarks/triton_attention.py via jax_triton)",
    "tokamax": "tokamax's Pallas Mosaic GPU kernels (tokamax.dot_product_attention)",
}
TOKAMAX_IMPLEMENTATION = "mosaic"  # tokamax.dot_product_attention's implementation=
# Every row name: jflash's, the peers', and jax.nn.dot_product_attention's own.
IMPLS = (*JFLASH, "cudnn", "xla", *PEERS)
FA3_HEAD_DIMS = (64, 128)  # flash-attn3-jax 0.2.3: forward and backward run at both


class PeerUnavailable(Exception):
    """A peer that cannot run here: its message is the table cell."""


def _import_failure(e: Exception) -> str:
    if isinstance(e, ImportError):
        return f"not installed ({e})"
    return f"import failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}"


def peer_fn(impl: str, causal: bool, head_dim: int):
    """`attn(q, k, v)` of a peer in PEERS, or PeerUnavailable saying why not."""
    if impl == "fa3":
        if head_dim not in FA3_HEAD_DIMS:
            raise PeerUnavailable(f"flash-attn3-jax: D={head_dim} not timed (D=64 and 128 only)")
        try:
            from flash_attn3_jax import flash_mha
        except Exception as e:  # noqa: BLE001 - missing or built for another jax: a row
            raise PeerUnavailable(_import_failure(e)) from e
        return functools.partial(flash_mha, is_causal=causal)
    if impl == "jax_triton":
        try:
            from benchmarks import triton_attention
        except Exception as e:  # noqa: BLE001 - missing or built for another jax: a row
            raise PeerUnavailable(_import_failure(e)) from e
        return functools.partial(triton_attention.attention, causal=causal)
    if impl == "tokamax":
        try:
            import tokamax
        except Exception as e:  # noqa: BLE001 - missing or built for another jax: a row
            raise PeerUnavailable(_import_failure(e)) from e
        return functools.partial(
            tokamax.dot_product_attention, is_causal=causal, implementation=TOKAMAX_IMPLEMENTATION
        )
    raise ValueError(f"unknown peer {impl!r}: one of {sorted(PEERS)}")


def attention_fn(
    impl: str,
    block_sizes=None,
    causal: bool = True,
    head_dim: int = 128,
    segment_ids=None,
    interpret: bool = False,
):
    """`attn(q, k, v)` of `impl`: jflash's (with `segment_ids`, if given; its Pallas
    kernels in interpret mode with `interpret`) or a peer's."""
    if impl in JFLASH:
        implementation, deterministic = JFLASH[impl]
        return functools.partial(
            jflash.flash_attention,
            causal=causal,
            segment_ids=segment_ids,
            block_sizes=block_sizes,
            implementation=implementation,
            deterministic=deterministic,
            interpret=interpret or None,
        )
    if impl in PEERS:
        return peer_fn(impl, causal, head_dim)
    return functools.partial(jax.nn.dot_product_attention, is_causal=causal, implementation=impl)


def causal_flops(batch, heads, seq, head_dim):
    return 4 * batch * heads * seq * seq * head_dim / 2


def attention_flops(batch, heads, seq, head_dim, causal: bool = True):
    """Forward FLOPs: the causal count, or twice it for full attention."""
    return causal_flops(batch, heads, seq, head_dim) * (1 if causal else 2)


def draw_inputs(batch, seq, heads, kv_heads, head_dim, dtype=jnp.bfloat16, q_scale: float = 1.0):
    """Standard normal q, k, v and dO; `q_scale` multiplies q (larger: peakier softmax)."""
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (batch, seq, heads, head_dim), dtype)
    if q_scale != 1.0:
        q = (q.astype(jnp.float32) * q_scale).astype(dtype)
    k = jax.random.normal(ks[1], (batch, seq, kv_heads, head_dim), dtype)
    v = jax.random.normal(ks[2], (batch, seq, kv_heads, head_dim), dtype)
    do = jax.random.normal(ks[3], (batch, seq, heads, head_dim), dtype)
    return q, k, v, do


def measure(
    impl,
    *,
    batch,
    seq,
    heads,
    kv_heads,
    head_dim,
    dtype=jnp.bfloat16,
    block_sizes=None,
    passes=("fwd", "fwdbwd"),
    causal=True,
    reference=None,
    timers=None,
):
    """One row: TFLOP/s, ms and temporaries of `impl`'s forward and forward+backward, or
    `*_error` cells. `reference` (a dict shared by the rows of one shape and mask): the
    first row's outputs (of its second call) are kept there and every later row's are
    checked against them (`check_outputs`); a row whose outputs differ is not timed.
    `timers` (a dict): each timed pass's `(compiled, inputs, flops)` is left there for
    `retime_rows`."""
    row = dict(
        impl=impl,
        mask="causal" if causal else "full",
        seq_len=seq,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        batch=batch,
    )
    try:
        attn = attention_fn(impl, block_sizes, causal=causal, head_dim=head_dim)
    except PeerUnavailable as e:
        for name in passes:
            row[f"{name}_error"] = str(e)
        return row
    q, k, v, do = draw_inputs(batch, seq, heads, kv_heads, head_dim, dtype)
    jitted = jit_passes(attn)
    fwd, fwdbwd = jitted["fwd"][0], jitted["fwdbwd"][0]
    flops = attention_flops(batch, heads, seq, head_dim, causal)
    for name, fn, args, mult in (
        ("fwd", fwd, (q, k, v), 1.0),
        ("fwdbwd", fwdbwd, (q, k, v, do), 3.5),
    ):
        if name not in passes:
            continue
        try:
            compiled = fn.lower(*args).compile()
            mem = compiled.memory_analysis()
            # A later call's outputs: a peer that keeps state between calls can be right
            # on the first and wrong on every one timed (`peer_repeat.py`).
            compiled(*args)
            if reference is not None and not check_outputs(row, name, compiled(*args), reference):
                return row
            t = time_pipelined(compiled, *args, iters=None)
        except Exception as e:  # noqa: BLE001 - OOM / unsupported reported as a row
            msg = str(e).splitlines()[0][:120]
            row[f"{name}_error"] = "out of memory" if "RESOURCE_EXHAUSTED" in str(e) else msg
            continue
        row[f"{name}_ms"] = t * 1e3
        row[f"{name}_tflops"] = mult * flops / t / 1e12
        if timers is not None:
            timers[name] = (compiled, args, mult * flops)
        if mem is not None:
            row[f"{name}_temp_gib"] = mem.temp_size_in_bytes / 2**30
    return row


# Agreement between implementations of one problem (bf16 outputs, f32 accumulation):
# the forward's max |diff| (absolute, as in `--documents`), and forward+backward's max
# |diff| over the output and dQ, dK, dV, each relative to that array's largest |value|.
FWD_TOLERANCE, FWDBWD_TOLERANCE = 0.05, 0.02


def relative_gap(a, b) -> float:
    """max |a - b| over the largest |b| (f32): how far `a` is from the reference `b`."""
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))


def check_outputs(row: dict, name: str, outputs, reference: dict) -> bool:
    """The first row of a shape keeps its `name` pass's outputs in `reference`; a later
    row gets `max_abs_diff` (forward) or `grad_rel_diff` (forward+backward) against them
    and, past the tolerance, a `{name}_error` cell. False where the row has that error."""
    leaves = [x.astype(jnp.float32) for x in jax.tree.leaves(outputs)]
    if name not in reference:
        reference[name], reference[f"{name}_impl"] = leaves, row["impl"]
        return True
    if name == "fwd":
        key, tolerance = "max_abs_diff", FWD_TOLERANCE
        diff = max(
            float(jnp.max(jnp.abs(a - b))) for a, b in zip(leaves, reference[name], strict=True)
        )
    else:
        key, tolerance = "grad_rel_diff", FWDBWD_TOLERANCE
        diff = max(map(relative_gap, leaves, reference[name]))
    row[key] = diff
    if not diff <= tolerance:  # NaN fails too
        row[f"{name}_error"] = (
            f"wrong output: {key} vs {reference[f'{name}_impl']} {diff:.3g} > {tolerance}"
        )
        return False
    return True


SHAPES = [  # (seq, head_dim)
    (4096, 128),
    (8192, 128),
    (16384, 128),
    (65536, 128),
    (4096, 64),
    (16384, 64),
    (65536, 64),
]


# Default rows: the main table names every peer (a missing one is a note and a row
# saying why); the sweep, --kernels and --launch-order keep jax's and jflash's own.
MAIN_IMPLS = "jflash,jflash_mosaic,jflash_mosaic_det,cudnn,fa3,tokamax,jax_triton,xla"
OTHER_IMPLS = "jflash,jflash_mosaic,cudnn,xla"

MAIN_COLUMNS = [
    "impl",
    "mask",
    "seq_len",
    "head_dim",
    "fwd_tflops",
    "fwdbwd_tflops",
    "fwd_vs_cudnn",
    "fwdbwd_vs_cudnn",
    "fwd_vs_fa3",
    "fwdbwd_vs_fa3",
    "fwdbwd_temp_gib",
    "max_abs_diff",
    "grad_rel_diff",
    "fwd_error",
    "fwdbwd_error",
]


def peer_notes(impls) -> list[str]:
    """One line per peer of `impls` that cannot run here (and why): printed before the
    table, so a missing optional package is said once, not only in its cells."""
    notes = []
    for impl in impls:
        if impl in PEERS:
            try:
                peer_fn(impl, True, 128)
            except PeerUnavailable as e:
                notes.append(f"note: {impl} ({PEERS[impl]}) skipped: {e}")
    return notes


def add_ratios(rows: list[dict], baselines=("cudnn", "fa3")) -> None:
    """`{pass}_vs_{baseline}` on every row: the baseline's time ÷ the row's (above 1: the
    row is faster), from the TFLOP/s of the same shape and mask."""

    def key(r, impl):
        return r.get("seq_len"), r.get("head_dim"), r.get("mask"), impl

    by = {key(r, r["impl"]): r for r in rows}
    for r in rows:
        for baseline in baselines:
            base = by.get(key(r, baseline), {})
            for p in ("fwd", "fwdbwd"):
                if f"{p}_tflops" in r and f"{p}_tflops" in base:
                    r[f"{p}_vs_{baseline}"] = r[f"{p}_tflops"] / base[f"{p}_tflops"]


def retime_rows(
    entries: list[tuple[dict, dict]],
    rounds: int,
    iters: int | None = None,
    heat_s: float = HEAT_S,
    round_s: float = 0.15,
) -> None:
    """Time one shape's rows (`(row, timers)`, `timers` from `measure`: pass name ->
    `(compiled, inputs, FLOPs)`) in `rounds` interleaved rounds after `heat_s` seconds
    of load (`common.heat`), each reading a `time_pipelined` one (`iters`, `round_s`),
    each row keeping its best; the reading `measure` took right after compiling is
    dropped (it ran on a GPU cooled by the compilation). Each round times every row's
    forward, then every forward+backward, in an order from a balanced Latin square (each
    row takes every turn and follows every other equally often). Rows timed once, one
    after the other, carry the GPU's drift and the order's bias into their ratios (1-4%
    on identical code in `ab.py`)."""
    calls = [functools.partial(c, *a) for _, timers in entries for c, a, _ in timers.values()]
    heat(calls, heat_s)
    best = {}
    for _, name, i in interleaved(len(entries), range(rounds), ("fwd", "fwdbwd")):
        timers = entries[i][1]
        if name in timers:
            compiled, inputs, _ = timers[name]
            t = time_pipelined(compiled, *inputs, iters=iters, round_s=round_s)
            best[i, name] = min(best.get((i, name), float("inf")), t)
    for (i, name), t in best.items():
        row, timers = entries[i]
        row[f"{name}_ms"], row[f"{name}_tflops"] = t * 1e3, timers[name][2] / t / 1e12
        row["rounds"] = rounds


def main_table(args):
    for note in peer_notes(args.impls):
        print(note, flush=True)
    rows = []
    for (seq, hd), causal in itertools.product(SHAPES, args.masks):
        if (args.seqs and seq not in args.seqs) or (args.head_dims and hd not in args.head_dims):
            continue
        reference = {}  # the first row's outputs: later rows are checked against them
        entries = []  # (row, timers): what --rounds times again
        for impl in args.impls:
            if impl == "xla" and seq > 8192:
                rows.append(
                    dict(
                        impl=impl,
                        mask="causal" if causal else "full",
                        seq_len=seq,
                        head_dim=hd,
                        fwd_error="skipped: O(S²) memory",
                    )
                )
                continue
            timers = {}
            row = measure(
                impl,
                batch=max(1, args.tokens // seq),
                seq=seq,
                heads=32,
                kv_heads=8,
                head_dim=hd,
                causal=causal,
                reference=reference,
                timers=timers,
            )
            rows.append(row)
            entries.append((row, timers))
            print(
                {k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()},
                flush=True,
            )
        retime_rows(entries, args.rounds, heat_s=args.heat)
        reference.clear()
        del entries
    add_ratios(rows)
    print(table(rows, MAIN_COLUMNS, args.note))
    # One mask alone (a run split in two) names its file after it.
    suffix = "" if len(args.masks) == 2 else "-causal" if args.masks[0] else "-full"
    path = os.path.join(args.out, f"kernel-{device_name()}{suffix}.json")
    write_json(path, {"rows": rows}, note=args.note)


def run_candidates(args, impl: str, candidates, baselines, name: str):
    """Times `(BlockSizes, passes, label)` candidates of `impl` at the `--tune` shape
    (`--seq`, `--head-dim`, `--heads`, `--kv-heads`, causal; the main table's batch,
    `--tokens // --seq`), and the `baselines` (whole implementations) beside them, in
    `--rounds` interleaved rounds after `--heat` seconds of load (`retime_rows`); table
    + JSON."""
    shape = dict(
        batch=max(1, args.tokens // args.seq),
        seq=args.seq,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
    )
    runs = [(impl, dict(block_sizes=bs, passes=passes), label) for bs, passes, label in candidates]
    runs += [(baseline, {}, baseline) for baseline in baselines]  # whole implementations
    rows, entries = [], []
    for run, options, label in runs:
        timers = {}
        row = measure(run, timers=timers, **options, **shape)
        row["block_sizes"] = label
        rows.append(row)
        entries.append((row, timers))
        print(row, flush=True)
    retime_rows(entries, args.rounds, iters=args.iters, heat_s=args.heat)
    add_ratios(rows, baselines)
    ratios = [f"{p}_vs_{b}" for b in baselines for p in ("fwd", "fwdbwd")]
    columns = ["block_sizes", "fwd_tflops", "fwdbwd_tflops", *ratios, "fwd_error", "fwdbwd_error"]
    print(table(rows, columns, args.note))
    write_json(
        os.path.join(args.out, f"{name}-{device_name()}-{args.seq}-{args.head_dim}.json"),
        {"rows": rows},
        note=args.note,
    )


def tune(args):
    """Times jflash block-size candidates at one shape: forward ones, then backward ones."""
    if args.tune_impl == "jflash_mosaic":
        return tune_mosaic(args)
    base = jflash.default_block_sizes(args.seq, args.head_dim, jnp.bfloat16)
    # Candidates around the winners of the 16k sweeps (the defaults in jflash/_block_sizes.py).
    fwd_candidates = [
        (128, 128, 8, 3),
        (128, 64, 8, 3),
        (128, 64, 8, 4),
        (256, 64, 8, 2),
        (128, 128, 8, 4),
        (64, 128, 8, 3),
        (128, 128, 8, 2),
        (64, 64, 4, 3),
    ]
    bwd_candidates = [
        (64, 128, 128, 64, 8, 3),
        (64, 128, 128, 64, 8, 2),
        (64, 64, 64, 64, 4, 2),
        (64, 128, 128, 64, 8, 4),
        (64, 128, 128, 128, 8, 3),
        (128, 128, 128, 64, 8, 3),
        (64, 128, 64, 128, 8, 3),
        (32, 128, 128, 32, 8, 2),
    ]
    candidates = []
    for bq, bk, w, s in fwd_candidates if args.which in ("fwd", "both") else []:
        bs = dataclasses.replace(base, block_q=bq, block_kv=bk, num_warps=w, num_stages=s)
        candidates.append((bs, ("fwd",), f"fwd q{bq} kv{bk} w{w} s{s}"))
    for qd, kd, qq, kq, w, s in bwd_candidates if args.which in ("bwd", "both") else []:
        bs = dataclasses.replace(
            base,
            block_q_dkv=qd,
            block_kv_dkv=kd,
            block_q_dq=qq,
            block_kv_dq=kq,
            num_warps_bwd=w,
            num_stages_bwd=s,
        )
        candidates.append((bs, ("fwdbwd",), f"bwd dkv q{qd} kv{kd} dq q{qq} kv{kq} w{w} s{s}"))
    run_candidates(args, "jflash", candidates, ["cudnn"], "kernel-tune")


def kernel_split(args, iterations: int = 20):
    """Forward+backward at the `--seq`/`--head-dim` shape, traced: ms per call of each
    GPU kernel from `--kernel-share` of the call up, per implementation (which pass of
    ours or a peer's is the slower, and what the small kernels around them cost). With
    `--documents`: the packed row of `--documents-tokens` (jflash given its segment
    ids, `fa3` its variable-length kernel given the documents' offsets)."""
    seq = args.documents_tokens if args.documents else args.seq
    inputs = draw_inputs(1, seq, args.heads, args.kv_heads, args.head_dim)
    lengths = document_lengths(seq) if args.documents else None
    rows = []
    for impl in args.impls:
        try:
            if lengths is None:
                attn = attention_fn(impl, head_dim=args.head_dim)
            else:
                attn = document_attention_fn(impl, lengths)
        except PeerUnavailable as e:
            print(f"note: {impl} skipped: {e}", flush=True)
            continue
        compiled = jit_passes(attn)["fwdbwd"][0].lower(*inputs).compile()
        jax.block_until_ready([compiled(*inputs) for _ in range(3)])  # clocks up
        spent = traced_kernels(compiled, inputs, iterations)
        total = sum(spent.values())
        for name, ns in spent.items():
            if ns < args.kernel_share * total:
                continue
            rows.append(
                dict(
                    impl=impl,
                    kernel=kernel_label(name),
                    ms=ns / iterations / 1e6,
                    share=ns / total,
                    name=name,
                )
            )
        rows.append(dict(impl=impl, kernel="(all)", ms=total / iterations / 1e6, share=1.0))
    print(table(rows, ["impl", "kernel", "ms", "share"], args.note))
    packed = "-documents" if args.documents else ""
    name = f"kernel-split{packed}-{device_name()}-{seq}-{args.head_dim}.json"
    write_json(os.path.join(args.out, name), {"rows": rows}, note=args.note)


def long_context(args):
    """Forward+backward at very long S: memory stays linear (compiler estimate + peak).
    jflash's kernels (Mosaic where the GPU runs them, Triton), cuDNN and FA3 where
    installed; an implementation that cannot run here is a row saying why."""
    rows = []
    for impl in ("jflash_mosaic", "jflash", "cudnn", "fa3"):
        row = measure(
            impl,
            batch=1,
            seq=args.long,
            heads=args.heads,
            kv_heads=args.kv_heads,
            head_dim=128,
            passes=("fwdbwd",),
        )
        rows.append(row)
        print(row, flush=True)
    stats = jax.devices()[0].memory_stats() or {}
    print(
        table(
            rows,
            [
                "impl",
                "seq_len",
                "heads",
                "fwdbwd_ms",
                "fwdbwd_tflops",
                "fwdbwd_temp_gib",
                "fwdbwd_error",
            ],
            args.note,
        )
    )
    write_json(
        os.path.join(args.out, f"kernel-long-{device_name()}.json"),
        {"rows": rows, "peak_bytes_in_use": stats.get("peak_bytes_in_use")},
        note=args.note,
    )


SWEEP_LABELS = {
    "jflash": "jflash, Triton kernel",
    "jflash_mosaic": "jflash, Mosaic kernel (default on Hopper)",
    "jflash_mosaic_det": "jflash, Mosaic, deterministic",
    "cudnn": "cuDNN (jax.nn.dot_product_attention)",
    "fa3": "FlashAttention-3 (flash-attn3-jax)",
    "xla": "plain XLA attention",
}


def sweep_device(device_kind: str, interpreted: bool) -> str:
    """The device named in the sweep's figure (an interpreted run's says so)."""
    return device_kind + (" (interpreted, no GPU: not kernel times)" if interpreted else "")


def plot_sweep(results: dict, device_kind: str, png: str) -> None:
    """The sweep's 3x3 figure: time, TFLOP/s and temporary memory against each axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(3, 3, figsize=(15, 12))
    for col, (axis, rows) in enumerate(results.items()):
        for r_i, (metric, label) in enumerate(
            [
                ("fwdbwd_ms", "fwd+bwd time (ms)"),
                ("fwdbwd_tflops", "fwd+bwd TFLOP/s"),
                ("fwdbwd_temp_gib", "fwd+bwd temp memory (GiB)"),
            ]
        ):
            ax = grid[r_i][col]
            for impl in dict.fromkeys(r["impl"] for r in rows):
                pts = [(r["x"], r[metric]) for r in rows if r["impl"] == impl and metric in r]
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", label=SWEEP_LABELS.get(impl, impl))
            ax.set_xlabel(axis)
            ax.set_ylabel(label)
            ax.set_xscale("log", base=2)
            if metric != "fwdbwd_tflops":
                ax.set_yscale("log")
            ax.grid(True, alpha=0.3)
    fig.suptitle(f"Causal attention, GQA 4:1, bf16, batch 1 — {device_kind}")
    handles = {}  # one legend for the figure: per-panel legends hid the curves
    for ax in grid.flat:
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, h)
    fig.legend(
        handles.values(),
        handles.keys(),
        loc="upper center",
        ncol=len(handles),
        bbox_to_anchor=(0.5, 0.965),
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


def sweep(args):
    """A FlashAttention study: time, TFLOP/s and memory against S, heads and head dim."""
    os.makedirs(args.out, exist_ok=True)
    impls = args.impls
    seqs = [int(x) for x in args.sweep_seqs.split(",")]
    mid = seqs[len(seqs) // 2]  # the heads and head-dim axes run at a middle length
    axes = {
        "seq_len": [dict(seq=s, heads=32, head_dim=128) for s in seqs],
        "heads": [dict(seq=mid, heads=h, head_dim=128) for h in (8, 16, 32, 64)],
        "head_dim": [dict(seq=mid, heads=32, head_dim=d) for d in (32, 64, 128, 256)],
    }
    results = {}
    for axis, points in axes.items():
        results[axis] = []
        for p in points:
            for impl in impls:
                if impl == "xla" and p["seq"] * p["seq"] * p["heads"] * 4 > args.xla_max_bytes:
                    continue
                if impl == "cudnn" and p["head_dim"] > 128:
                    continue
                row = measure(
                    impl,
                    batch=1,
                    seq=p["seq"],
                    heads=p["heads"],
                    kv_heads=max(1, p["heads"] // 4),
                    head_dim=p["head_dim"],
                )
                row["x"] = p[{"seq_len": "seq", "heads": "heads", "head_dim": "head_dim"}[axis]]
                results[axis].append(row)
                print(row, flush=True)
    png = os.path.join(args.out, f"kernel-sweep-{device_name()}.png")
    plot_sweep(results, sweep_device(jax.devices()[0].device_kind, bool(args.note)), png)
    path = os.path.join(args.out, f"kernel-sweep-{device_name()}.json")
    write_json(path, results, note=args.note)


def tune_mosaic(args):
    """Mosaic candidates: streamed block and pipeline depth per pass (rows per warpgroup
    are fixed at 64)."""
    candidates = mosaic_candidates(args, args.seq)
    run_candidates(args, "jflash_mosaic", candidates, ["cudnn"], "kernel-tune-mosaic")


def mosaic_candidates(args, seq: int) -> list:
    """`(BlockSizes, passes, label)` of the Mosaic kernels around their defaults at
    `seq` tokens and `--head-dim`, for `--which` pass."""
    base = jflash.default_block_sizes(
        seq, args.head_dim, jnp.bfloat16, implementation="pallas_mosaic"
    )
    candidates = []
    fwd = ((256, 2), (256, 3), (128, 2), (128, 3), (64, 3), (64, 4))
    for bk, s in fwd if args.which in ("fwd", "both") else []:
        bs = dataclasses.replace(base, block_kv=bk, num_stages=s)
        candidates.append((bs, ("fwd",), f"fwd kv{bk} s{s}"))
    # The dK/dV kernel streams 64 queries per step (one wgmma M: the fused dQ needs it,
    # and at D=128 a wider step's f32 S and dP would not fit next to dK and dV); the dQ
    # kernel's key step (64 or 128: the N of its S and dP wgmmas) and the stage count
    # (lowered per kernel where shared memory would overflow) are the knobs.
    bwd = ((64, 64, 2), (64, 64, 3), (64, 64, 4), (64, 128, 2), (64, 128, 3))
    for qd, kq, s in bwd if args.which in ("bwd", "both") else []:
        bs = dataclasses.replace(base, block_q_dkv=qd, block_kv_dq=kq, num_stages_bwd=s)
        candidates.append((bs, ("fwdbwd",), f"bwd dkv q{qd} dq kv{kq} s{s}"))
    return candidates


def launch_order(args, iterations: int = 10, repeats: int = 2):
    """Forward+backward at each `--sweep-seqs` length (causal, `--head-dim`) for each
    jflash implementation in `--impls`, once with every launch heads-outermost and once
    tiles-outermost (`jflash.tiles_first_limits`), alternating `repeats` times: device ms
    per kernel from a trace. The evidence behind the default limits. With `--documents`
    each length is one packed row of documents (`document_lengths`, ids in order)."""
    policies = {"heads_first": (-1, -1), "tiles_first": (1 << 40, 1 << 40)}
    impls = [impl for impl in args.impls if impl in JFLASH]
    seqs = [int(x) for x in args.sweep_seqs.split(",")]
    spent = {}  # (impl, seq, policy, kernel) -> [ms per call, one per repeat]
    for impl, seq in itertools.product(impls, seqs):
        inputs = draw_inputs(1, seq, args.heads, args.kv_heads, args.head_dim)
        seg = document_ids(document_lengths(seq)) if args.documents else None
        attn = attention_fn(impl, segment_ids=seg)
        for _, (policy, limits) in itertools.product(range(repeats), policies.items()):
            jax.clear_caches()
            with jflash.tiles_first_limits(*limits):
                compiled = jit_passes(attn)["fwdbwd"][0].lower(*inputs).compile()
            jax.block_until_ready([compiled(*inputs) for _ in range(3)])  # clocks up
            call = {}  # kernel -> ms per call, summed over its launches' names
            for name, ns in traced_kernels(compiled, inputs, iterations).items():
                kernel = next((k for k in ("fwd", "dkv", "dq") if f"_{k}" in name), None)
                if name.startswith("jflash") and kernel is not None:
                    call[kernel] = call.get(kernel, 0.0) + ns / iterations / 1e6
            for kernel, ms in call.items():
                spent.setdefault((impl, seq, policy, kernel), []).append(ms)
    rows = []
    for impl, seq, kernel in itertools.product(impls, seqs, ("fwd", "dkv", "dq")):
        heads = min(spent.get((impl, seq, "heads_first", kernel), [0]))
        tiles = min(spent.get((impl, seq, "tiles_first", kernel), [0]))
        if heads and tiles:
            rows.append(
                dict(
                    impl=impl,
                    seq_len=seq,
                    kernel=kernel,
                    heads_first_ms=heads,
                    tiles_first_ms=tiles,
                    heads_over_tiles=heads / tiles,
                )
            )
    if rows:
        print(table(rows, list(rows[0]), args.note))
    else:  # an interpreted run launches no kernel
        print("note: the traces hold no jflash kernel's device time; nothing to compare")
    packed = "-documents" if args.documents else ""
    name = f"kernel-launch-order{packed}-{device_name()}-{args.head_dim}.json"
    raw = [dict(impl=k[0], seq_len=k[1], policy=k[2], kernel=k[3], ms=v) for k, v in spent.items()]
    write_json(os.path.join(args.out, name), {"rows": rows, "raw": raw}, note=args.note)


def document_lengths(tokens: int, *, seed: int = 0) -> list[int]:
    """The packed row's document lengths (`balance.packed_row_lengths`)."""
    return balance.packed_row_lengths(tokens, seed)


# How `document_ids` labels the documents of a packed row; every order gives the same
# mask (the same documents), so the same work and outputs:
# - sorted: document i holds i (ids non-decreasing along the row);
# - padded: documents 1, 2, ... and the last one 0, as packers label the padding that
#   ends a row (MaxText, grain);
# - permuted: a fixed random permutation of the labels (each document still one run);
# - pair: the permuted labels as a `(query ids, key ids)` pair, which jflash relabels by
#   the key ids' first positions (as it relabels one array by its own);
# - hashed: distinct labels spread over all of int32 (dataset indices, hashes), wider
#   than the row, which jflash relabels through hash tables.
ID_ORDERS = ("sorted", "padded", "permuted", "pair", "hashed")


def document_ids(lengths, batch: int = 1, order: str = "sorted"):
    """Segment ids `[batch, sum(lengths)]` int32 of documents of `lengths` packed in a
    row, labelled as `order` (`ID_ORDERS`), every batch row alike (`pair`: the same
    array twice, as query and key ids; `hashed`: distinct labels drawn from all of
    int32, as dataset indices or hashes would be)."""
    n = len(lengths)
    if order == "sorted":
        labels = np.arange(n)
    elif order == "padded":
        labels = np.concatenate([np.arange(1, n), [0]])
    elif order in ("permuted", "pair"):
        labels = np.random.default_rng(0).permutation(n)
    elif order == "hashed":
        info = np.iinfo(np.int32)
        labels = np.random.default_rng(0).choice(info.max, n, replace=False) * 2 + info.min
    else:
        raise ValueError(f"id order {order!r}: expected one of {ID_ORDERS}")
    ids = np.repeat(labels.astype(np.int32), lengths)
    ids = jnp.asarray(np.broadcast_to(ids, (batch, ids.size)))
    return (ids, ids) if order == "pair" else ids


def parse_id_orders(text: str) -> list[str]:
    """`sorted,padded,...` -> the orders, in turn; ValueError naming a bad one."""
    orders = [o for o in text.split(",") if o]
    bad = [o for o in orders if o not in ID_ORDERS]
    if bad or not orders:
        raise ValueError(f"--id-orders {text!r}: a comma list of {', '.join(ID_ORDERS)}")
    return orders


def document_flops(lengths, heads: int, head_dim: int) -> float:
    """Forward FLOPs on the causal mask area: sum of L·(L+1)/2 pairs, 4·H each, per head."""
    pairs = sum(n * (n + 1) // 2 for n in lengths)
    return 4.0 * pairs * head_dim * heads


def document_attention_fn(impl: str, lengths):
    """`attn(q, k, v)` of `impl` on one packed row of documents of `lengths` (batch 1):
    jflash's given their segment ids, FA3 as its variable-length kernel given their
    offsets; PeerUnavailable for a peer with no such form or that cannot run here (a
    peer for the table, never a dependency)."""
    if impl in JFLASH:
        return attention_fn(impl, segment_ids=document_ids(lengths))
    if impl != "fa3":
        raise PeerUnavailable("no packed-documents form here (jflash's or fa3 only)")
    try:
        from flash_attn3_jax import flash_mha_varlen
    except Exception as e:  # noqa: BLE001 - missing or built for another jax: a row
        raise PeerUnavailable(_import_failure(e)) from e
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    longest = max(lengths)

    def attn(q, k, v):
        # Keywords: the sixth positional parameter is `seqused_k`, not a length.
        out = flash_mha_varlen(
            q[0], k[0], v[0], cu, cu, max_seqlen_q=longest, max_seqlen_k=longest, is_causal=True
        )
        return out[None]

    return attn


def documents(args):
    """Causal attention over `--documents-tokens` packed documents (`--heads`,
    `--kv-heads`, `--head-dim`: GQA 32/8, D=128 by default; bf16), TFLOP/s on the mask
    area: jflash's default, jflash on the same tokens as one document (what skipping
    tiles gains), jflash's Triton kernel named, FA3 varlen."""
    tokens, heads, kv_heads, head_dim = (
        args.documents_tokens,
        args.heads,
        args.kv_heads,
        args.head_dim,
    )
    lengths = document_lengths(tokens)
    print(f"{len(lengths)} documents in {tokens} tokens, longest {max(lengths)}", flush=True)
    seg = document_ids(lengths)
    q, k, v, do = draw_inputs(1, tokens, heads, kv_heads, head_dim)
    doc_flops = document_flops(lengths, heads, head_dim)
    whole_flops = document_flops([tokens], heads, head_dim)

    def jflash_fn(implementation, segment_ids, block_sizes=None):
        return functools.partial(
            jflash.flash_attention,
            causal=True,
            segment_ids=segment_ids,
            implementation=implementation,
            block_sizes=block_sizes,
        )

    try:
        fa3, fa3_error = document_attention_fn("fa3", lengths), None
    except PeerUnavailable as e:
        fa3, fa3_error = None, str(e)
    peers = [
        ("jflash (default)", "documents", jflash_fn(None, seg), doc_flops, None),
        ("jflash (default)", "one document", jflash_fn(None, None), whole_flops, None),
    ]
    for order in parse_id_orders(args.id_orders):  # the same documents, labelled otherwise
        if order != "sorted":
            attn = jflash_fn(None, document_ids(lengths, order=order))
            peers.append((f"jflash (default), {order} ids", "documents", attn, doc_flops, None))
    if not args.tune:
        triton = jflash_fn("pallas_triton", seg)
        peers.append(("jflash pallas_triton", "documents", triton, doc_flops, None))
    peers.append(("flash_attn3_jax varlen", "documents", fa3, doc_flops, fa3_error))
    if args.tune:  # the Mosaic block-size candidates on the packed row, not the Triton one
        for bs, _, label in mosaic_candidates(args, tokens):
            attn = jflash_fn("pallas_mosaic", seg, bs)
            peers.append((f"jflash_mosaic {label}", "documents", attn, doc_flops, None))
    rows, entries = [], []
    expected = None  # jflash's default output on the documents: every peer must match it
    for impl, mask, attn, flops, error in peers:
        row = dict(
            impl=impl,
            mask=mask,
            tokens=tokens,
            documents=len(lengths) if mask == "documents" else 1,
        )
        if error is not None:
            row["fwd_error"] = error
            rows.append(row)
            continue
        jitted, timers = jit_passes(attn), {}
        if mask == "documents":
            try:
                out = jitted["fwd"][0](q, k, v).astype(jnp.float32)
            except Exception as e:  # noqa: BLE001 - a peer that cannot run is a row
                row["fwd_error"] = str(e).splitlines()[0][:120]
                rows.append(row)
                continue
            if expected is None:
                expected = out
            row["max_abs_diff"] = float(jnp.max(jnp.abs(out - expected)))
            if not row["max_abs_diff"] <= 0.05:  # bf16 outputs of one problem; NaN fails
                row["fwd_error"] = f"wrong output: max |diff| vs jflash {row['max_abs_diff']:.3g}"
            del out
        for name, mult in (("fwd", 1.0), ("fwdbwd", 3.5)):
            fn, nargs = jitted[name]
            inputs = (q, k, v, do)[:nargs]
            try:
                compiled = fn.lower(*inputs).compile()
                t = time_pipelined(compiled, *inputs, iters=args.iters)
            except Exception as e:  # noqa: BLE001 - a peer that cannot run is a row
                row[f"{name}_error"] = str(e).splitlines()[0][:120]
                continue
            row[f"{name}_ms"] = t * 1e3
            row[f"{name}_tflops"] = mult * flops / t / 1e12
            timers[name] = (compiled, inputs, mult * flops)
        rows.append(row)
        entries.append((row, timers))
        print(
            {k_: (round(v_, 3) if isinstance(v_, float) else v_) for k_, v_ in row.items()},
            flush=True,
        )
    retime_rows(entries, args.rounds, args.iters, heat_s=args.heat)
    del entries
    whole = next(r for r in rows if r["mask"] == "one document")
    for r in rows:
        for p in ("fwd", "fwdbwd"):
            if f"{p}_ms" in r and f"{p}_ms" in whole:
                r[f"{p}_speedup_vs_one_document"] = whole[f"{p}_ms"] / r[f"{p}_ms"]
    columns = [
        "impl",
        "mask",
        "fwd_ms",
        "fwd_tflops",
        "fwdbwd_ms",
        "fwdbwd_tflops",
        "fwdbwd_speedup_vs_one_document",
        "max_abs_diff",
        "fwd_error",
        "fwdbwd_error",
    ]
    print(table(rows, columns, args.note))
    write_json(
        os.path.join(args.out, f"kernel-documents-{device_name()}.json"),
        {
            "rows": rows,
            "lengths": lengths,
            "shape": dict(tokens=tokens, heads=heads, kv_heads=kv_heads, head_dim=head_dim),
            "mask_pairs": int(doc_flops / (4 * head_dim * heads)),
        },
        note=args.note,
    )


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument(
        "--sweep-replot", metavar="JSON", help="redraw a sweep's PNG from its JSON (no GPU)"
    )
    parser.add_argument("--tune", action="store_true")
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="main table, --tune and --documents: each shape's rows timed again in this many "
        "interleaved rounds (balanced order), each keeping its best",
    )
    parser.add_argument(
        "--heat",
        type=float,
        default=HEAT_S,
        help="seconds of load before a shape's rounds (the GPU cooled while compiling)",
    )
    parser.add_argument(
        "--kernels",
        action="store_true",
        help="time per GPU kernel at the --seq shape (with --documents: the packed row)",
    )
    parser.add_argument(
        "--kernel-share",
        type=float,
        default=0.01,
        help="--kernels: leave out kernels under this share of the call (0: list all)",
    )
    parser.add_argument(
        "--launch-order",
        action="store_true",
        help="jflash kernels of --impls, heads- vs tiles-outermost launch, per --sweep-seqs "
        "(with --documents: packed rows of that many tokens)",
    )
    parser.add_argument("--long", type=int, default=0, help="sequence length for the memory run")
    parser.add_argument(
        "--documents", action="store_true", help="packed documents vs one document vs FA3"
    )
    parser.add_argument(
        "--documents-tokens", type=int, default=65536, help="--documents: tokens in the pack"
    )
    parser.add_argument(
        "--iters",
        type=int,
        default=None,
        help="--documents and --tune: calls per timed batch (default: as many as fill 0.15 s)",
    )
    parser.add_argument(
        "--id-orders",
        default="sorted",
        help="--documents: jflash rows with the documents labelled in these orders too "
        f"(a comma list of {', '.join(ID_ORDERS)}: the same mask, see `document_ids`)",
    )
    parser.add_argument(
        "--which",
        default="both",
        choices=("fwd", "bwd", "both"),
        help="--tune: which pass's candidates",
    )
    parser.add_argument("--seq", type=int, default=16384, help="--tune and --kernels shape")
    parser.add_argument("--head-dim", type=int, default=128, help="--tune and --kernels shape")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument(
        "--impls",
        default=None,
        help="rows: jflash, jflash_mosaic, jflash_mosaic_det, jflash_xla, cudnn, xla, and "
        f"the optional peers fa3, tokamax, jax_triton (default: {MAIN_IMPLS} for the main table, "
        f"{OTHER_IMPLS} otherwise)",
    )
    parser.add_argument(
        "--masks",
        default="causal,full",
        help="main table: causal and/or full (non-causal) attention",
    )
    parser.add_argument(
        "--seqs", default="", help="main table: only these of its sequence lengths (4096,...)"
    )
    parser.add_argument(
        "--head-dims", default="", help="main table: only these of its head dims (64,128)"
    )
    parser.add_argument(
        "--tokens",
        type=int,
        default=65536,
        help="main table and --tune: tokens per call (batch = tokens // seq, at least 1)",
    )
    parser.add_argument(
        "--tune-impl", default="jflash", choices=("jflash", "jflash_mosaic"), help="--tune: which"
    )
    parser.add_argument(
        "--sweep-seqs",
        default="1024,2048,4096,8192,16384,32768",
        help="--sweep: sequence lengths (the other axes use the middle one)",
    )
    parser.add_argument(
        "--xla-max-bytes",
        type=float,
        default=40 * 2**30,
        help="--sweep: skip plain XLA attention whose S²·N·4 exceeds this",
    )
    parser.add_argument("--out", default=RESULTS)
    add_interpret_flag(parser)
    args = parser.parse_args(argv)
    main_only = not (
        args.sweep_replot
        or args.sweep
        or args.tune
        or args.kernels
        or args.launch_order
        or args.documents
        or args.long
    )
    args.impls = (args.impls or (MAIN_IMPLS if main_only else OTHER_IMPLS)).split(",")
    if unknown := [impl for impl in args.impls if impl not in IMPLS]:
        parser.error(
            f"--impls {','.join(args.impls)}: unknown {unknown}; rows are {', '.join(IMPLS)}"
        )
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: must be >= 1")
    try:
        orders = parse_id_orders(args.id_orders)
    except ValueError as e:
        parser.error(str(e))
    if orders != ["sorted"] and not args.documents:
        parser.error(f"--id-orders {args.id_orders}: it labels --documents' rows; add --documents")
    if not 0 <= args.kernel_share < 1:
        parser.error(f"--kernel-share {args.kernel_share}: a share of the call, 0 to below 1")
    masks = {"causal": True, "full": False}
    if any(m not in masks for m in args.masks.split(",")):
        parser.error(f"--masks {args.masks!r}: a comma list of causal, full")
    args.masks = list(dict.fromkeys(masks[m] for m in args.masks.split(",")))
    try:
        args.seqs = [int(x) for x in args.seqs.split(",") if x]
    except ValueError:
        parser.error(f"--seqs {args.seqs!r}: a comma list of sequence lengths")
    try:
        args.head_dims = [int(x) for x in args.head_dims.split(",") if x]
    except ValueError:
        parser.error(f"--head-dims {args.head_dims!r}: a comma list of head dims")
    shown = {hd for _, hd in SHAPES}
    if main_only and any(hd not in shown for hd in args.head_dims):
        parser.error(f"--head-dims {args.head_dims}: the main table has head dims {sorted(shown)}")
    lengths = {seq for seq, _ in SHAPES}
    if main_only and any(seq not in lengths for seq in args.seqs):
        given = ",".join(map(str, args.seqs))
        parser.error(f"--seqs {given}: the main table has lengths {sorted(lengths)}")
    if main_only and not any(
        (not args.seqs or seq in args.seqs) and (not args.head_dims or hd in args.head_dims)
        for seq, hd in SHAPES
    ):
        given = ",".join(map(str, args.seqs)), ",".join(map(str, args.head_dims))
        parser.error("--seqs {} with --head-dims {}: no shape of the table".format(*given))
    for flag, value in (("--tokens", args.tokens), ("--seq", args.seq), ("--long", args.long)):
        if value < 0 or (value == 0 and flag != "--long"):
            parser.error(f"{flag} {value}: must be positive")
    if args.heads < 1 or args.kv_heads < 1 or args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads}: not a positive multiple of --kv-heads {args.kv_heads}")
    if args.sweep_replot and not os.path.isfile(args.sweep_replot):
        parser.error(f"--sweep-replot {args.sweep_replot}: no such file")
    if not args.sweep_replot:
        check_out(parser, "--out", args.out, directory=True)
    # Everything but redrawing a figure times kernels.
    args.note = (
        None if args.sweep_replot else gpu_or_interpret("benchmarks/kernel.py", args.interpret)
    )
    if args.sweep_replot:
        with open(args.sweep_replot) as f:
            results = json.load(f)
        axes = {k: v for k, v in results.items() if k in ("seq_len", "heads", "head_dim")}
        png = args.sweep_replot.removesuffix(".json") + ".png"
        plot_sweep(axes, sweep_device(results.get("device", "?"), results.get("interpreted")), png)
    elif args.sweep:
        sweep(args)
    elif args.launch_order:  # with --documents: on packed rows
        launch_order(args)
    elif args.kernels:  # with --documents: on the packed row
        kernel_split(args)
    elif args.documents:  # with --tune: the Mosaic candidates on the packed row
        documents(args)
    elif args.tune:
        tune(args)
    elif args.long:
        long_context(args)
    else:
        main_table(args)


if __name__ == "__main__":
    main()
