"""The zigzag ring's per-device compute on ONE GPU, without communication.

    python benchmarks/ring_blocks.py                          # 8k and 16k tokens/device, P=2
    python benchmarks/ring_blocks.py --tokens-per-device 8192 --variants
    python benchmarks/ring_blocks.py --tokens-per-device 8192 --rev main  # a change's rank

Without a GPU it stops at once with one line saying so (exit status 2); `--interpret`
runs the same code on the CPU, Pallas kernels in interpret mode as the tests run them,
and its tables and JSON say so (`"interpreted": true`): the times are not kernel times.

`benchmarks/ring.py` measures the ring against its ideal (the whole sequence on one
GPU, ÷ P). This script splits the gap in two without a second GPU: it runs on one
device exactly what one rank of the zigzag ring computes (`jflash.ring_attention_rank`:
the ring's own steps, kernel calls on its blocks, f32 partial results, merges and
accumulations) with the transfers left out, and times each kind of block alone:

* `ideal`: the whole sequence (P x tokens/device) causal, forward+backward, ÷ P;
* `ring_rank<r>`: one rank's P steps (the rank decides which halves an off-diagonal
  step sees, as in the ring); its ratio to `ideal` is the ring's efficiency if the
  transfers were free;
* `diag`: the diagonal step's causal block alone; `block`: one off-diagonal half block
  (c x c keys, no mask, c = tokens/device / 2) alone; both in f32 (as the ring calls
  them: `ring_attention_rank` with one source, on the ring's tiles) and in the input
  dtype (`jflash.flash_attention` forward+backward, its default tiles for the block);
* with `--variants`, the half block in f32 with other tile shapes and pipeline depths
  (around `jflash.default_block_sizes` of the half block; not with `--implementation xla`).

With `--documents MEAN` the sequence is instead one packed row of documents (log-normal
lengths of mean MEAN, `benchmarks/ring.py --documents`' row) in `--layout` order
(`striped`, `zigzag` or `contiguous`): `ideal` is the whole row with its segment ids ÷ P,
and every rank `ring_rank<r>` gets its own shard's ids and each step's source ids (the
ranks' masks differ, so all P are timed). TFLOP/s count the mask area.

With `--rev REV` the dense rank is measured against a git revision of jflash in the same
process (each imported as its own package, as `benchmarks/ab.py` does): the ideal, both
ranks and the diagonal block with the working tree's jflash and with the revision's,
after `--heat` seconds of load, in `--rounds` interleaved rounds (a balanced order), each
keeping its best reading. `new/rev` is the revision's time ÷ the tree's (above 1: the
tree is faster), `<label>_eff` each one's ideal ÷ its rank; `rev_grad_rel_diff` how far
the revision's results are from the tree's, relative to their largest entry. Separate
processes move a rank's time by a few percent; this keeps both in one.

Every row is timed pipelined (calls back to back, one synchronisation) in the same
process, and traced once for device time per kernel (not with `--rev`). Causal TFLOP/s
counts the FLOPs the block really has (as everywhere in BENCHMARKS.md: forward
4·B·N·S²·H/2 for a causal square; a full c x c block is 4·B·N·c²·H), forward+backward
3.5x the forward.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import tempfile
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jflash  # noqa: E402
from benchmarks.common import (  # noqa: E402
    HEAT_S,
    add_interpret_flag,
    check_out,
    device_name,
    gpu_or_interpret,
    table,
    time_pipelined,
    traced_kernels,
    write_json,
)
from benchmarks.kernel import document_flops, relative_gap, retime_rows  # noqa: E402
from benchmarks.ring import document_row  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _inputs(seq: int, args, key=0):
    kq, kk, kv, ko = jax.random.split(jax.random.key(key), 4)
    dt = jnp.bfloat16
    q = jax.random.normal(kq, (1, seq, args.heads, args.head_dim), dt)
    k = jax.random.normal(kk, (1, seq, args.kv_heads, args.head_dim), dt)
    v = jax.random.normal(kv, (1, seq, args.kv_heads, args.head_dim), dt)
    do = jax.random.normal(ko, (1, seq, args.heads, args.head_dim), dt)
    return q, k, v, do


class _Kernel(NamedTuple):
    """The kernel arguments every row passes (`--implementation`, and tiles or None)."""

    implementation: str | None
    block_sizes: jflash.BlockSizes | None = None


def _rank_grads(o, lse, dq, dkv):
    """`ring_attention_rank`'s results as one pytree: dK/dV summed over the steps."""
    dk = sum(d[0] for d in dkv)
    dv = sum(d[1] for d in dkv)
    return o, lse, dq, dk, dv


def ring_rank(devices: int, kernel: _Kernel, module=jflash):
    """One rank's forward+backward of a zigzag causal ring of `devices` ranks, every
    step on the rank's own K/V (no transfers); `rank` is traced, as in the ring.
    `module`: the jflash package that runs it (`--rev`: the tree's or the revision's)."""

    @jax.jit
    def run(q, k, v, do, rank):
        return _rank_grads(
            *module.ring_attention_rank(
                q,
                [(k, v)] * devices,
                do,
                rank,
                causal=True,
                layout="zigzag",
                implementation=kernel.implementation,
                block_sizes=kernel.block_sizes,
            )
        )

    return run


def one_block(kernel: _Kernel, causal: bool, out_dtype, batch_pair: bool = False, module=jflash):
    """Forward+backward of one kernel call (what one ring block costs): in f32 as the
    ring calls it (`ring_attention_rank` with one source: a causal diagonal block on
    the zigzag ring's half-block tiles, or a full block), else through
    `jflash.flash_attention` in the input dtype."""

    @jax.jit
    def run(q, k, v, do):
        if batch_pair:  # the step's two half blocks as one call of batch 2
            q, k, v, do = (jnp.concatenate([x, x], axis=0) for x in (q, k, v, do))
        if out_dtype == jnp.float32:
            return _rank_grads(
                *module.ring_attention_rank(
                    q,
                    [(k, v)],
                    do,
                    0,
                    causal=causal,
                    layout="zigzag" if causal else "contiguous",
                    implementation=kernel.implementation,
                    block_sizes=kernel.block_sizes,
                )
            )
        attn = functools.partial(
            module.flash_attention,
            causal=causal,
            implementation=kernel.implementation,
            block_sizes=kernel.block_sizes,
        )
        out, vjp = jax.vjp(attn, q, k, v)
        return out, vjp(do)

    return run


def ideal_call(kernel: _Kernel, module=jflash):
    """Forward+backward of the whole causal sequence in one call (the ideal's work)."""
    attn = functools.partial(
        module.flash_attention, causal=True, implementation=kernel.implementation
    )

    @jax.jit
    def run(q, k, v, do):
        out, vjp = jax.vjp(attn, q, k, v)
        return out, vjp(do)

    return run


def _flops(rows: int, keys: int, causal: bool, args, batch: int = 1) -> float:
    fwd = 4 * batch * args.heads * rows * keys * args.head_dim * (0.5 if causal else 1.0)
    return 3.5 * fwd


def _measure(name: str, fn, inputs, flops: float, args, scale: float = 1.0) -> dict:
    """Pipelined time of `fn(*inputs)` (× `scale`, e.g. ÷ P for the ideal) and device
    time per kernel from one trace. `fn`: a function, or a call already compiled for
    inputs of these shapes."""
    compiled = fn if isinstance(fn, jax.stages.Compiled) else jax.jit(fn).lower(*inputs).compile()
    start = time.perf_counter()
    while time.perf_counter() - start < args.warm_s:  # clocks up before the first row
        jax.block_until_ready(compiled(*inputs))
    t = time_pipelined(compiled, *inputs, warmup=args.warmup, iters=args.iters) * 1e3
    row = {"row": name, "ms": t * scale, "tflops": flops / (t * 1e-3) / 1e12}
    per_kernel = traced_kernels(compiled, inputs, args.trace_iters)
    total = sum(per_kernel.values())

    def ms(ns):  # per call, scaled
        return ns / args.trace_iters / 1e6 * scale

    row["kernels"] = {k: ms(ns) for k, ns in list(per_kernel.items())[:8]}
    # All device time, then the attention kernels against everything else (XLA's adds,
    # converts, slices); None where the trace has no GPU kernels (CPU).
    attention = sum(ns for k, ns in per_kernel.items() if k.startswith("jflash"))
    for key, ns in (
        ("device_ms", total),
        ("attention_ms", attention),
        ("other_ms", total - attention),
    ):
        row[key] = ms(ns) if total else None
    return row


def _variants(c: int, args) -> dict[str, object]:
    """Half-block tile shapes and pipeline depths to try (Mosaic knobs), around the
    default tiles of a c x c block."""
    if args.implementation == "xla":
        return {}
    base = jflash.default_block_sizes(
        c,
        args.head_dim,
        jnp.bfloat16,
        kv_len=c,
        implementation=args.implementation or "pallas_mosaic",
    )
    out = {}
    for field, values in (
        ("block_kv", (64, 256)),
        ("num_stages", (3,)),
        ("block_q_dkv", (128,)),
        ("block_kv_dq", (128,)),
        ("num_stages_bwd", (3,)),
    ):
        for value in values:
            if getattr(base, field) != value:
                out[f"{field}={value}"] = dataclasses.replace(base, **{field: value})
    return out


def benchmark(args, done=lambda rows: None) -> list[dict]:
    """`done(rows)` after each `--tokens-per-device` length (the rows so far)."""
    rows = []
    p = args.devices
    for tokens in args.tokens_per_device:
        c = tokens // 2
        kernel = _Kernel(args.implementation)
        whole = _inputs(p * tokens, args)
        measured = [
            _measure(
                "ideal",
                ideal_call(kernel),
                whole,
                _flops(p * tokens, p * tokens, True, args),
                args,
                1 / p,
            )
        ]
        local = _inputs(tokens, args, key=1)
        per_rank = _flops(p * tokens, p * tokens, True, args) / p
        rank_call = ring_rank(p, kernel).lower(*local, jnp.int32(0)).compile()  # rank traced
        for rank in range(min(p, 2)):  # ranks differ only in which halves they see
            measured.append(
                _measure(
                    f"ring_rank{rank}",
                    rank_call,
                    (*local, jnp.int32(rank if rank == 0 else p - 1)),
                    per_rank,
                    args,
                )
            )
        half = _inputs(c, args, key=2)
        pieces = (  # name, causal, inputs, FLOPs
            ("diag", True, local, _flops(tokens, tokens, True, args)),
            ("block", False, half, _flops(c, c, False, args)),
        )
        for dtype in (jnp.float32, jnp.bfloat16):
            tag = "f32" if dtype == jnp.float32 else "bf16"
            for name, causal, inputs, flops in pieces:
                block = one_block(kernel, causal, dtype)
                measured.append(_measure(f"{name}_{tag}", block, inputs, flops, args))
        measured.append(
            _measure(
                "block_pair_f32",
                one_block(kernel, False, jnp.float32, batch_pair=True),
                half,
                _flops(c, c, False, args, batch=2),
                args,
            )
        )
        if args.variants:
            for label, bs in _variants(c, args).items():
                try:
                    measured.append(
                        _measure(
                            f"block_f32 {label}",
                            one_block(kernel._replace(block_sizes=bs), False, jnp.float32),
                            half,
                            _flops(c, c, False, args),
                            args,
                        )
                    )
                except Exception as e:  # noqa: BLE001 - a tile that does not fit is a row
                    measured.append({"row": f"block_f32 {label}", "error": repr(e)[:300]})
        ideal_ms = measured[0]["ms"]
        for row in measured:
            row["tokens_per_device"] = tokens
            row["devices"] = p
            if row["row"].startswith("ring_rank"):
                row["eff_vs_ideal"] = ideal_ms / row["ms"]
        rows.extend(measured)
        print(
            table(
                measured,
                [
                    "tokens_per_device",
                    "row",
                    "ms",
                    "tflops",
                    "device_ms",
                    "other_ms",
                    "eff_vs_ideal",
                ],
                args.note,
            ),
            flush=True,
        )
        for r in measured:
            if r["device_ms"] is None:  # no GPU kernels in the trace (CPU)
                continue
            print(
                r["row"],
                f"attention {r['attention_ms']:.3f} ms, other {r['other_ms']:.3f} ms:",
                {k: round(v, 3) for k, v in r["kernels"].items()},
                flush=True,
            )
        done(rows)
    return rows


def ab_benchmark(args, modules: dict, done=lambda rows: None) -> list[dict]:
    """`--rev`: the dense rank's rows (ideal, both ranks, the diagonal block in f32),
    each with every package of `modules` (label -> jflash; "new" the working tree's),
    timed in `args.rounds` interleaved rounds after `args.heat` seconds of load, each
    keeping its best reading; `done(rows)` after each length."""
    rows, p, labels = [], args.devices, list(modules)
    kernel = _Kernel(args.implementation)
    for tokens in args.tokens_per_device:
        whole, local = _inputs(p * tokens, args), _inputs(tokens, args, key=1)
        per_rank = _flops(p * tokens, p * tokens, True, args) / p
        rank_at = (*local, jnp.int32(0))  # the ranks differ only in the traced rank
        makers = {  # the call per package, compiled once for its inputs' shapes
            "ideal": (lambda m: ideal_call(kernel, m), whole),
            "rank": (lambda m: ring_rank(p, kernel, m), rank_at),
            "diag": (lambda m: one_block(kernel, True, jnp.float32, module=m), local),
        }
        compiled = {
            (key, label): make(m).lower(*inputs).compile()
            for key, (make, inputs) in makers.items()
            for label, m in modules.items()
        }
        kinds = (  # name, its call, its inputs, FLOPs, time scale
            ("ideal", "ideal", whole, per_rank, 1 / p),
            ("ring_rank0", "rank", rank_at, per_rank, 1),
            ("ring_rank1", "rank", (*local, jnp.int32(p - 1)), per_rank, 1),
            ("diag_f32", "diag", local, _flops(tokens, tokens, True, args), 1),
        )
        measured = []
        for name, key, inputs, flops, scale in kinds:
            calls = {label: compiled[key, label] for label in labels}
            base = jax.tree.leaves(calls["new"](*inputs))
            row = {"row": name, "tokens_per_device": tokens, "devices": p}
            for label in labels[1:]:
                leaves = jax.tree.leaves(calls[label](*inputs))
                row[f"{label}_grad_rel_diff"] = max(map(relative_gap, leaves, base))
            del base
            entries = [({}, {"fwdbwd": (calls[label], inputs, flops)}) for label in labels]
            retime_rows(entries, args.rounds, heat_s=args.heat, round_s=args.min_time / 3)
            best = {  # ms
                label: timed["fwdbwd_ms"] for label, (timed, _) in zip(labels, entries, strict=True)
            }
            for label, t in best.items():
                row[f"{label}_ms"] = t * scale
                row[f"{label}_tflops"] = flops / (t * 1e-3 * scale) / 1e12
            for label in labels[1:]:
                row[f"new/{label}"] = best[label] / best["new"]
            measured.append(row)
        for row in measured:
            if row["row"].startswith("ring_rank"):
                for label in labels:
                    row[f"{label}_eff"] = measured[0][f"{label}_ms"] / row[f"{label}_ms"]
        rows.extend(measured)
        columns = ["tokens_per_device", "row", *(f"{label}_ms" for label in labels)]
        columns += [f"new/{label}" for label in labels[1:]]
        columns += [f"{label}_eff" for label in labels]
        columns += [f"{label}_grad_rel_diff" for label in labels[1:]]
        print(table(measured, columns, args.note), flush=True)
        done(rows)
    return rows


def documents_benchmark(args, done=lambda rows: None) -> list[dict]:
    """`ideal` and every rank of a ring of `--devices` over one packed row per
    `--tokens-per-device`, in `--layout` order."""
    rows = []
    p, layout = args.devices, args.layout
    attn = functools.partial(
        jflash.flash_attention, causal=True, implementation=args.implementation
    )

    def ideal(q, k, v, do, ids):
        out, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, segment_ids=ids), q, k, v)
        return out, vjp(do)

    for tokens in args.tokens_per_device:
        seq = p * tokens
        lengths = document_row(seq, args.documents)
        ids = jnp.asarray(np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)[None])
        flops = 3.5 * document_flops(lengths, args.heads, args.head_dim)
        whole = (*_inputs(seq, args), ids)
        measured = [_measure("ideal", ideal, whole, flops, args, 1 / p)]
        shards = [jnp.split(jflash.to_layout(x, p, layout, axis=1), p, axis=1) for x in whole]
        q_s, k_s, v_s, do_s, id_s = shards
        # Each rank's output is checked against its rows of the whole row's.
        want = jnp.split(jflash.to_layout(jax.jit(ideal)(*whole)[0], p, layout, axis=1), p, 1)

        @jax.jit
        def rank_fn(q, ks, vs, do, rank, q_ids, kv_ids):
            return _rank_grads(
                *jflash.ring_attention_rank(
                    q,
                    list(zip(ks, vs, strict=True)),
                    do,
                    rank,
                    causal=True,
                    layout=layout,
                    implementation=args.implementation,
                    segment_ids=(q_ids, kv_ids),
                )
            )

        for rank in range(p):
            src = [(rank - step) % p for step in range(p)]
            inputs = (
                q_s[rank],
                [k_s[s] for s in src],
                [v_s[s] for s in src],
                do_s[rank],
                jnp.int32(rank),
                id_s[rank],
                [id_s[s] for s in src],
            )
            row = _measure(f"ring_rank{rank}", rank_fn, inputs, flops / p, args)
            got = rank_fn(*inputs)[0].astype(jnp.float32)
            row["max_abs_diff"] = float(jnp.max(jnp.abs(got - want[rank].astype(jnp.float32))))
            measured.append(row)
        ideal_ms = measured[0]["ms"]
        for row in measured:
            row.update(tokens_per_device=tokens, devices=p, layout=layout, documents=len(lengths))
            if row["row"].startswith("ring_rank"):
                row["eff_vs_ideal"] = ideal_ms / row["ms"]
        rows.extend(measured)
        columns = ["tokens_per_device", "layout", "row", "ms", "tflops", "device_ms"]
        columns += ["attention_ms", "other_ms", "eff_vs_ideal", "max_abs_diff"]
        print(table(measured, columns, args.note), flush=True)
        done(rows)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens-per-device", type=_ints, default=[8192, 16384])
    parser.add_argument("--devices", type=int, default=2, help="ring size P being emulated")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--implementation", default=None, choices=jflash.IMPLEMENTATIONS)
    parser.add_argument("--variants", action="store_true", help="half-block tile variants")
    parser.add_argument(
        "--documents", type=int, default=0, help="packed documents of this mean length"
    )
    parser.add_argument(
        "--layout",
        default="zigzag",
        choices=("zigzag", "striped", "contiguous"),
        help="--documents: the ring's layout",
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--trace-iters", type=int, default=3)
    parser.add_argument(
        "--warm-s", type=float, default=1.0, help="seconds of calls before each row's timing"
    )
    parser.add_argument(
        "--rev", default=None, help="git revision whose jflash the dense rank is measured against"
    )
    parser.add_argument("--rounds", type=int, default=4, help="--rev: interleaved rounds")
    parser.add_argument(
        "--min-time", type=float, default=0.5, help="--rev: seconds per reading of a call"
    )
    parser.add_argument(
        "--heat", type=float, default=HEAT_S, help="--rev: seconds of load before a row's rounds"
    )
    parser.add_argument(
        "--out", default=None, help="JSON path (default: results/ring-blocks-p<P>-<gpu>.json)"
    )
    add_interpret_flag(parser)
    args = parser.parse_args(argv)
    if args.out:
        check_out(parser, "--out", args.out)
    if args.devices < 1:
        parser.error(f"{args.devices=} must be >= 1")
    if not args.tokens_per_device:
        parser.error("--tokens-per-device: at least one length")
    for t in args.tokens_per_device:
        if t % 2:
            parser.error(f"tokens per device {t} must be even (zigzag halves)")
    if args.documents < 0:
        parser.error(f"--documents {args.documents}: must be a mean length > 0 (or 0: none)")
    if args.documents and args.variants:
        parser.error("--variants times the dense ring's half blocks, not with --documents")
    if args.rev is not None and (args.documents or args.variants):
        parser.error("--rev times the dense rank's rows, not with --documents or --variants")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: at least 1")
    commit = None
    if args.rev is not None:
        from benchmarks import ab

        try:
            commit = ab.commit_of(args.rev)
        except ValueError as e:
            parser.error(str(e))
    args.note = gpu_or_interpret("benchmarks/ring_blocks.py", args.interpret)
    name = f"ring-blocks-p{args.devices}"
    if args.documents:
        name += f"-documents-{args.layout}"
    if commit:
        name += "-ab"
    out = args.out or os.path.join(RESULTS, f"{name}-{device_name()}.json")
    kept = {k: v for k, v in vars(args).items() if k not in ("out", "note")}
    if commit:
        kept["rev_commit"] = commit
    # Each finished length goes to `<out>.partial` at once, so a run stopped during a
    # later one keeps it; `out` itself is written (and the partial file removed) only
    # when every length has run.

    def done(rows):
        write_json(out, {"args": kept, "rows": rows}, note=args.note, partial=True)

    if commit:
        with tempfile.TemporaryDirectory() as tmp:
            modules = {
                "new": ab.import_tree(os.path.join(tmp, "tree")),
                "rev": ab.import_revision(commit, os.path.join(tmp, "rev")),
            }
            rows = ab_benchmark(args, modules, done)
    else:
        rows = (documents_benchmark if args.documents else benchmark)(args, done)
    write_json(out, {"args": kept, "rows": rows}, note=args.note)


if __name__ == "__main__":
    main()
