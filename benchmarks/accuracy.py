"""Accuracy over long rows of keys: each implementation's output and gradients against a
float64 computation, jflash's kernels, FlashAttention-3 and cuDNN side by side.

    python benchmarks/accuracy.py                     # 128 queries over 1M and 8M keys, D = 64
    python benchmarks/accuracy.py --keys 65536,1048576 --head-dim 128 --impls jflash_mosaic,fa3
    python benchmarks/accuracy.py --interpret --keys 640 --impls jflash_mosaic,jflash  # CPU

One batch row of `--queries` queries attends to all of `--keys` keys (non-causal: every
query sums over every key), GQA `--heads`/`--kv-heads`, bf16 inputs and output cotangent
drawn from a fixed seed. The reference is float64, computed from the same bf16 values in
chunks of `--chunk` keys. Per implementation and tensor (`o`, `dq`, `dk`, `dv`):

- `err`: the largest |a - r| over the largest |r|;
- `bias`: <a - r, r> / <r, r>, the part of the error along the true values (negative:
  they shrink toward zero);
- `nonfinite`: the count of NaN or infinite entries per tensor, where there are any (then
  that tensor's `err` and `bias` are left empty).

Rounding to nearest leaves errors without a direction: their bias stays near zero however
long the row. An accumulator that drops its low bits toward zero at every addition gives a
bias that grows with the number of key steps, in the tensors summed over the keys (`o`,
`dq`) and not in those summed over the queries (`dk`, `dv`).

Implementations: `jflash` (the Pallas Triton kernels), `jflash_mosaic`, `jflash_mosaic_det`
(`benchmarks/kernel.py`'s names), `cudnn`, `fa3` (where `flash-attn3-jax` is installed; a
missing one is a row saying why). Without a GPU it stops at once with one line saying so
(exit status 2); `--interpret` runs the jflash kernels in interpret mode on the CPU (small
`--keys` only), and the table and JSON say so.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import kernel  # noqa: E402
from benchmarks.common import add_interpret_flag, check_out, gpu_or_interpret, table, write_json  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
TENSORS = ("o", "dq", "dk", "dv")


def draw(keys: int, args):
    """`(q, k, v, do)` in bf16, `[1, T, N, D]` and `[1, S, K, D]`."""
    kq, kk, kv, kd = jax.random.split(jax.random.PRNGKey(args.seed), 4)
    t, n, kh, d = args.queries, args.heads, args.kv_heads, args.head_dim
    normal = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)  # noqa: E731
    return (
        normal(kq, (1, t, n, d)),
        normal(kk, (1, keys, kh, d)),
        normal(kv, (1, keys, kh, d)),
        normal(kd, (1, t, n, d)),
    )


def run(attn, q, k, v, do):
    """`(o, dq, dk, dv)` of one forward and backward call."""

    def both(q, k, v, do):
        o, vjp = jax.vjp(attn, q, k, v)
        return (o, *vjp(do))

    return jax.block_until_ready(jax.jit(both)(q, k, v, do))


class Stats:
    """Running `max |a - r|`, `max |r|`, `<a - r, r>`, `<r, r>` of one tensor, in float64,
    over `a`'s finite entries, and the count of the others (NaN or infinite)."""

    def __init__(self):
        self.worst = self.largest = self.along = self.norm = 0.0
        self.nonfinite = 0

    def add(self, a, r):
        a = a.astype(jnp.float64)
        finite = jnp.isfinite(a)
        self.nonfinite += int(a.size - jnp.sum(finite))
        e = jnp.where(finite, a - r, 0.0)
        self.worst = max(self.worst, float(jnp.max(jnp.abs(e))))
        self.largest = max(self.largest, float(jnp.max(jnp.abs(r))))
        self.along += float(jnp.sum(e * r))
        self.norm += float(jnp.sum(r * r))

    def cells(self, tensor: str) -> dict:
        """`{tensor}_err` and `{tensor}_bias`; both None where an entry is not finite (the
        count is in `nonfinite`): an error over the finite entries would read as a pass."""
        if self.nonfinite:
            return {f"{tensor}_err": None, f"{tensor}_bias": None}
        return {
            f"{tensor}_err": self.worst / self.largest if self.largest else None,
            f"{tensor}_bias": self.along / self.norm if self.norm else None,
        }


def compare(outputs: dict, q, k, v, do, *, chunk: int, scale: float) -> dict:
    """Every implementation's `(o, dq, dk, dv)` in `outputs` against float64, the keys in
    chunks: the row's LSE (pass 1), `o` and `delta = rowsum(dO o)` (pass 2), then each
    chunk's dS, which gives its dK and dV and adds into dQ (pass 3). `{name: cells}`."""
    stats = {name: {t: Stats() for t in TENSORS} for name in outputs}
    keys, kh = k.shape[1], k.shape[2]
    with jax.enable_x64(True):
        f64 = lambda x: x[0].astype(jnp.float64)  # noqa: E731
        qg = f64(q).reshape(q.shape[1], kh, -1, q.shape[3])  # [T, K, G, D]
        dog = f64(do).reshape(qg.shape)
        spans = [(s, min(s + chunk, keys)) for s in range(0, keys, chunk)]

        @jax.jit
        def scores(kc):
            return jnp.einsum("tkgd,skd->kgts", qg, kc) * scale

        @jax.jit
        def row_max_sum(kc, m, l):
            s = scores(kc)
            m2 = jnp.maximum(m, s.max(-1))
            return m2, l * jnp.exp(m - m2) + jnp.exp(s - m2[..., None]).sum(-1)

        @jax.jit
        def out_part(kc, vc, lse):
            p = jnp.exp(scores(kc) - lse[..., None])
            return jnp.einsum("kgts,skd->tkgd", p, vc)

        @jax.jit
        def grads_part(kc, vc, lse, delta):
            p = jnp.exp(scores(kc) - lse[..., None])
            ds = p * (jnp.einsum("tkgd,skd->kgts", dog, vc) - delta)
            dq = jnp.einsum("kgts,skd->tkgd", ds, kc) * scale
            dk = jnp.einsum("kgts,tkgd->skd", ds, qg) * scale
            dv = jnp.einsum("kgts,tkgd->skd", p, dog)
            return dq, dk, dv

        m = jnp.full(qg.shape[1:3] + qg.shape[:1], -jnp.inf, jnp.float64)  # [K, G, T]
        l = jnp.zeros_like(m)
        for a, b in spans:
            m, l = row_max_sum(f64(k[:, a:b]), m, l)
        lse = m + jnp.log(l)
        o = sum(out_part(f64(k[:, a:b]), f64(v[:, a:b]), lse) for a, b in spans)
        delta = jnp.einsum("tkgd,tkgd->kgt", dog, o)[..., None]
        dq = jnp.zeros_like(qg)
        for a, b in spans:
            dq_c, dk_c, dv_c = grads_part(f64(k[:, a:b]), f64(v[:, a:b]), lse, delta)
            dq = dq + dq_c
            for name, (_, _, dk, dv) in outputs.items():
                stats[name]["dk"].add(dk[0, a:b], dk_c)
                stats[name]["dv"].add(dv[0, a:b], dv_c)
        for name, (o_a, dq_a, _, _) in outputs.items():
            stats[name]["o"].add(o_a[0].reshape(o.shape), o)
            stats[name]["dq"].add(dq_a[0].reshape(dq.shape), dq)
    cells = {}
    for name, s in stats.items():
        cells[name] = {c: v for t in TENSORS for c, v in s[t].cells(t).items()}
        if bad := [f"{t}: {s[t].nonfinite}" for t in TENSORS if s[t].nonfinite]:
            cells[name]["nonfinite"] = ", ".join(bad)
    return cells


def parse_keys(text: str) -> list[int]:
    try:
        keys = [int(x) for x in text.split(",")]
        if min(keys) >= 1:
            return keys
    except ValueError:
        pass
    raise ValueError(f"--keys {text!r}: comma-separated positive integers")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", default="1048576,8388608", help="keys per row, comma-separated")
    p.add_argument("--queries", type=int, default=128)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--impls", default="jflash_mosaic,jflash_mosaic_det,jflash,cudnn,fa3")
    p.add_argument("--chunk", type=int, default=1 << 20, help="keys per float64 chunk")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default=None, help="JSON path (default: results/accuracy-<gpu>.json)")
    add_interpret_flag(p)
    args = p.parse_args(argv)
    if args.out:
        check_out(p, "--out", args.out)
    try:
        keys = parse_keys(args.keys)
        for flag in ("queries", "heads", "kv_heads", "head_dim", "chunk"):
            if (value := getattr(args, flag)) < 1:
                raise ValueError(f"--{flag.replace('_', '-')} {value}: must be >= 1")
        if unknown := [n for n in args.impls.split(",") if n not in kernel.IMPLS]:
            raise ValueError(
                f"--impls {args.impls}: unknown {unknown}; rows are {', '.join(kernel.IMPLS)}"
            )
        if args.heads % args.kv_heads:
            raise ValueError(
                f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}"
            )
    except ValueError as e:
        p.error(str(e))
    note = gpu_or_interpret("benchmarks/accuracy.py", args.interpret)
    names = args.impls.split(",")
    rows = []
    for n_keys in keys:
        q, k, v, do = draw(n_keys, args)
        outputs, failed = {}, {}
        for name in names:
            try:
                attn = kernel.attention_fn(
                    name, causal=False, head_dim=args.head_dim, interpret=args.interpret
                )
                outputs[name] = run(attn, q, k, v, do)
            except kernel.PeerUnavailable as e:
                failed[name] = str(e)
            except Exception as e:  # noqa: BLE001 - a row saying why, not a crash
                failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        cells = compare(outputs, q, k, v, do, chunk=args.chunk, scale=args.head_dim**-0.5)
        for name in names:
            row = {"keys": n_keys, "impl": name, **cells.get(name, {})}
            if name in failed:
                row["error"] = failed[name]
            rows.append(row)
            print(row, flush=True)
        del q, k, v, do, outputs
    columns = ["keys", "impl", *(f"{t}_{m}" for t in TENSORS for m in ("err", "bias"))]
    columns += ["nonfinite", "error"]
    print(table(rows, columns, note=note))
    shape = dict(queries=args.queries, heads=args.heads, kv_heads=args.kv_heads)
    out = args.out or os.path.join(RESULTS, f"accuracy-{kernel.device_name()}.json")
    write_json(out, {"head_dim": args.head_dim, **shape, "rows": rows}, note=note)
    return rows


if __name__ == "__main__":
    main()
