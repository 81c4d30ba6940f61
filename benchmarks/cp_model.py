"""A model of one layer's context-parallel attention (forward + backward) per strategy.

From measured inputs it predicts, for P = 2 ... 1024 GPUs (`--gpus-per-node` per node)
and 8k-128k tokens per GPU, the time of one attention layer's forward and backward per
strategy, the communication left exposed, the efficiency (the ideal, one GPU's kernel
time for the whole sequence ÷ P, over the predicted time), and the strategy it would
pick. Inputs:

* the single-GPU kernel rate, forward+backward TFLOP/s on causal FLOPs
  (`benchmarks/kernel.py`; default: the Mosaic kernel on one H200 at 16k-64k), and how
  it falls for short calls: rate x L / (L + `--short-call-tokens`) for calls of L query
  rows (default calibrated on the measured one-rank ring compute at 8k and 16k);
* the ring's own work beside its kernels per step and token (merges, f32 sums;
  `benchmarks/ring_blocks.py`; default measured on one H200);
* link bandwidths per GPU and direction, within a node and across nodes, and a
  per-collective latency: given as flags (defaults: NVLink as measured by
  `--measure` on 2 H200s for 256 MiB messages; 400 Gb/s InfiniBand per GPU), or
  measured here with `--measure` on the GPUs of this machine (ppermute, all-to-all and
  all-gather sweeps).

Strategies, as `jflash.ring_attention` runs them:

* ring (zigzag): P steps, each half a block pair of compute; K/V (bf16) travel in the
  forward, K/V and f32 dK/dV in the backward, each hop hidden behind the step's kernels
  when it is shorter. A ring wider than a node waits on its node-crossing hops.
* allgather: K/V of the whole sequence gathered once, dK/dV (f32) reduce-scattered: not
  overlapped with the kernels.
* ulysses: all-to-all of Q, K, V and the output (forward), of dO, dQ, dK, dV
  (backward), on the critical path; KV heads repeated P / gcd(K, P) times; needs
  P <= N and N % P == 0. The kernel runs on the whole sequence.
* hybrid: Ulysses over the GPUs of a node, the ring across nodes on whole node shards.

Check against measurement: `--check` prints the model's P = 2 ring beside the measured
2-GPU efficiencies in BENCHMARKS.md (0.908 at 8k, 0.968 at 16k tokens per GPU).

    python benchmarks/cp_model.py --out benchmarks/results/cp-model-h200.json
    python benchmarks/cp_model.py --measure   # on a machine with several GPUs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import check_out, check_positive  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Machine:
    kernel_tflops: float  # single-GPU attention forward+backward, causal FLOPs
    short_call_tokens: float  # the rate at L query rows is kernel_tflops * L / (L + this)
    ring_overhead_ns: float  # ring work beside the kernels, per token per step
    intra_gbps: float  # GB/s per GPU and direction within a node
    inter_gbps: float  # GB/s per GPU and direction across nodes
    latency_us: float  # per collective call or ring hop
    gpus_per_node: int
    # Within a node, the all-to-all's and the all-gather's own GB/s per GPU (`--measure`
    # reports each; NCCL runs them apart from the ring's sends); None: `intra_gbps`.
    a2a_gbps: float | None = None
    gather_gbps: float | None = None


@dataclasses.dataclass(frozen=True)
class Shape:
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    bytes_per_value: int = 2  # bf16 activations


@dataclasses.dataclass(frozen=True)
class Prediction:
    strategy: str
    time_ms: float
    exposed_ms: float
    efficiency: float
    note: str = ""


def _ms(flops: float, rows: int, m: Machine) -> float:
    """Kernel time of `flops` in calls of `rows` query rows."""
    rate = m.kernel_tflops * rows / (rows + m.short_call_tokens)
    return flops / (rate * 1e12) * 1e3


def _send_ms(nbytes: float, gbps: float, m: Machine) -> float:
    return nbytes / (gbps * 1e9) * 1e3 + m.latency_us * 1e-3


def ideal_ms(p: int, tokens: int, s: Shape, m: Machine) -> float:
    """One GPU's kernel time for the whole causal sequence, ÷ P (fwd + bwd)."""
    t = p * tokens
    return _ms(7 * s.q_heads * s.head_dim * t * t, t, m) / p


def _ring(p: int, shard: int, heads: int, kv_heads: int, gbps: float, s: Shape, m: Machine):
    """`(time, exposed)` of a zigzag ring over `p` shards of `shard` tokens."""
    step_flops = 7 * heads * s.head_dim * shard * shard  # fwd+bwd, half a block pair
    rows = max(1, shard // 2)
    fwd_c = _ms(step_flops / 3.5, rows, m) + m.ring_overhead_ns * shard * 1e-6 / 2
    bwd_c = _ms(step_flops * 2.5 / 3.5, rows, m) + m.ring_overhead_ns * shard * 1e-6 / 2
    kv = 2 * kv_heads * s.head_dim * shard
    fwd_x = _send_ms(kv * s.bytes_per_value, gbps, m) if p > 1 else 0.0
    bwd_x = _send_ms(kv * (s.bytes_per_value + 4), gbps, m) if p > 1 else 0.0
    exposed = (p - 1) * (max(0.0, fwd_x - fwd_c) + max(0.0, bwd_x - bwd_c))
    return p * (fwd_c + bwd_c) + exposed, exposed


def _all_to_all_ms(nbytes: float, p: int, m: Machine, intra_gbps: float | None = None) -> float:
    """Each GPU sends (P-1)/P of `nbytes`: the part for its node's GPUs over the node's
    links (at `intra_gbps`, default `m.intra_gbps`), the rest through the network."""
    local = min(p, m.gpus_per_node)
    t = nbytes * (local - 1) / p / ((intra_gbps or m.intra_gbps) * 1e9) * 1e3
    if p > local:
        t += nbytes * (p - local) / p / (m.inter_gbps * 1e9) * 1e3
    return t + m.latency_us * 1e-3


def _ulysses_traffic(p: int, tokens: int, s: Shape) -> float:
    """Bytes one GPU moves through all-to-alls per layer, forward + backward."""
    kv = s.kv_heads * (p // math.gcd(s.kv_heads, p))
    return 2 * (2 * s.q_heads + 2 * kv) * tokens * s.head_dim * s.bytes_per_value


def predict(p: int, tokens: int, s: Shape, m: Machine) -> list[Prediction]:
    ideal = ideal_ms(p, tokens, s, m)
    out = []
    crosses = p > m.gpus_per_node
    ring_gbps = m.inter_gbps if crosses else m.intra_gbps
    t, x = _ring(p, tokens, s.q_heads, s.kv_heads, ring_gbps, s, m)
    out.append(Prediction("ring", t, x, ideal / t))

    kv_seq = 2 * s.kv_heads * s.head_dim * tokens * p
    # An all-gather (and the reduce-scatter of dK/dV) moves as much as an all-to-all.
    gather = _all_to_all_ms(kv_seq * s.bytes_per_value, p, m, m.gather_gbps)
    scatter = _all_to_all_ms(kv_seq * 4, p, m, m.gather_gbps)
    # One call per zigzag query run (half a shard) against the keys it sees.
    compute = _ms(7 * s.q_heads * s.head_dim * (tokens * p) ** 2, tokens // 2, m) / p
    t = compute + gather + scatter
    out.append(Prediction("allgather", t, gather + scatter, ideal / t, "holds the whole K/V"))

    if p <= s.q_heads and s.q_heads % p == 0:
        x = _all_to_all_ms(_ulysses_traffic(p, tokens, s), p, m, m.a2a_gbps)
        out.append(Prediction("ulysses", ideal + x, x, ideal / (ideal + x)))
    else:
        out.append(Prediction("ulysses", math.inf, math.inf, 0.0, f"P > N={s.q_heads}"))

    a = math.gcd(min(p, m.gpus_per_node), s.q_heads)
    r = p // a
    if a > 1 and r > 1:
        inner = Machine(**{**dataclasses.asdict(m), "gpus_per_node": a})
        x_a2a = _all_to_all_ms(_ulysses_traffic(a, tokens, s), a, inner, m.a2a_gbps)
        kv_local = s.kv_heads * (a // math.gcd(s.kv_heads, a)) // a
        t_ring, x_ring = _ring(r, a * tokens, s.q_heads // a, kv_local, m.inter_gbps, s, m)
        t = t_ring + x_a2a
        out.append(Prediction("hybrid", t, x_a2a + x_ring, ideal / t, f"{a} a2a x {r} ring"))
    else:
        out.append(Prediction("hybrid", math.inf, math.inf, 0.0, "needs 2+ nodes"))
    return out


def measure(sizes_mib: list[float]) -> dict:
    """GB/s per device of ppermute, all-to-all and all-gather on this machine's GPUs."""
    import time

    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P

    n = jax.device_count()
    if n < 2:
        raise SystemExit(f"--measure needs 2+ devices; this machine has {n}")
    mesh = jax.make_mesh((n,), ("x",))
    ops = {
        "ppermute": lambda x: lax.ppermute(x, "x", [(i, (i + 1) % n) for i in range(n)]),
        "all_to_all": lambda x: lax.all_to_all(x, "x", 0, 0, tiled=True),
        "all_gather": lambda x: lax.all_gather(x, "x", tiled=True),
    }
    rows = []
    for mib in sizes_mib:
        elems = int(mib * 2**20 / 2) // n * n
        x = jax.device_put(jnp.ones((n * elems,), jnp.bfloat16), jax.NamedSharding(mesh, P("x")))
        for name, op in ops.items():
            f = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
            f(x).block_until_ready()
            t0 = time.perf_counter()
            for _ in range(10):
                y = f(x)
            y.block_until_ready()
            sec = (time.perf_counter() - t0) / 10
            moved = elems * 2 * (1 if name == "ppermute" else (n - 1) / n)
            if name == "all_gather":
                moved = elems * 2 * (n - 1)
            rows.append({"op": name, "mib": mib, "ms": sec * 1e3, "gbps": moved / sec / 1e9})
            print(f"{name:>10} {mib:>8.0f} MiB  {sec * 1e3:8.3f} ms  {rows[-1]['gbps']:7.1f} GB/s")
    return {"devices": n, "device": jax.devices()[0].device_kind, "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--kernel-tflops", type=float, default=510.0)
    ap.add_argument("--short-call-tokens", type=float, default=200.0)
    ap.add_argument("--ring-overhead-ns", type=float, default=18.0)
    ap.add_argument("--intra-gbps", type=float, default=195.0, help="NVLink per GPU")
    ap.add_argument("--inter-gbps", type=float, default=50.0, help="400 Gb/s IB per GPU")
    ap.add_argument("--a2a-gbps", type=float, default=None, help="all-to-all (default: intra)")
    ap.add_argument("--gather-gbps", type=float, default=None, help="all-gather (default: intra)")
    ap.add_argument("--latency-us", type=float, default=15.0)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--gpus", type=int, nargs="+", default=[2**i for i in range(1, 11)])
    ap.add_argument("--tokens-per-gpu", type=int, nargs="+", default=[2048, 8192, 32768, 131072])
    ap.add_argument("--check", action="store_true", help="P = 2 ring vs measured 2 GPUs")
    ap.add_argument("--measure", action="store_true", help="link sweep on this machine")
    ap.add_argument("--out", default=None, help="JSON file to write")
    args = ap.parse_args(argv)
    if args.out:
        check_out(ap, "--out", args.out)
    check_positive(
        ap,
        args,
        *("kernel_tflops", "intra_gbps", "inter_gbps", "a2a_gbps", "gather_gbps"),
        *("gpus_per_node", "q_heads", "kv_heads", "head_dim", "gpus", "tokens_per_gpu"),
        zero=("short_call_tokens", "ring_overhead_ns", "latency_us"),
    )
    if args.q_heads % args.kv_heads:
        ap.error(f"--q-heads {args.q_heads}: not a multiple of --kv-heads {args.kv_heads}")
    result: dict = {"args": vars(args)}
    if args.measure:
        result["links"] = measure([16, 64, 256, 1024])
    m = Machine(
        args.kernel_tflops,
        args.short_call_tokens,
        args.ring_overhead_ns,
        args.intra_gbps,
        args.inter_gbps,
        args.latency_us,
        args.gpus_per_node,
        args.a2a_gbps,
        args.gather_gbps,
    )
    s = Shape(args.q_heads, args.kv_heads, args.head_dim)
    names = ("ring", "allgather", "ulysses", "hybrid")
    print(
        f"one attention layer, fwd+bwd, N={s.q_heads} K={s.kv_heads} D={s.head_dim} bf16; "
        f"kernel {m.kernel_tflops:g} TFLOP/s; links {m.intra_gbps:g} / {m.inter_gbps:g} GB/s "
        f"(node / network), {m.gpus_per_node} GPUs per node"
    )
    print("efficiency (exposed communication ms) per strategy; * = pick")
    print(f"{'tokens/GPU':>10} {'P':>5} {'ideal ms':>9} " + "".join(f"{n:>20}" for n in names))
    rows = []
    for tokens in args.tokens_per_gpu:
        for p in args.gpus:
            preds = predict(p, tokens, s, m)
            best = max(preds, key=lambda x: x.efficiency)
            cells = []
            for x in preds:
                mark = "*" if x is best else " "
                cell = "-" if x.efficiency == 0 else f"{x.efficiency:.3f} ({x.exposed_ms:.2f})"
                cells.append(f"{cell + mark:>20}")
            ideal = ideal_ms(p, tokens, s, m)
            print(f"{tokens:>10} {p:>5} {ideal:>9.2f} " + "".join(cells))
            rows.append(
                {
                    "tokens_per_gpu": tokens,
                    "gpus": p,
                    "ideal_ms": ideal,
                    "pick": best.strategy,
                    **{x.strategy: dataclasses.asdict(x) for x in preds},
                }
            )
    result["rows"] = rows
    if args.check:
        print("\nP = 2 ring, predicted vs measured (2x H200, BENCHMARKS.md):")
        for tokens, measured in ((8192, 0.908), (16384, 0.968)):
            ring = predict(2, tokens, s, m)[0]
            print(f"  {tokens:>6} tokens/GPU: predicted {ring.efficiency:.3f}, measured {measured}")
            result.setdefault("check", []).append(
                {"tokens_per_gpu": tokens, "predicted": ring.efficiency, "measured": measured}
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
