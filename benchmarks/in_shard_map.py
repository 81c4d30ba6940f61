"""What a `shard_map` costs the one-device kernels, in one process.

    python benchmarks/in_shard_map.py            # causal 32k D = 64, 16k and 64k D = 128
    python benchmarks/in_shard_map.py --shapes causal:16384:128 --rounds 6
    python benchmarks/in_shard_map.py --interpret --shapes causal:256:64 --tokens 256 \\
        --heads 4 --kv-heads 2 --rounds 2                       # the code path on CPU

Per shape, two calls of the same attention on one device: `direct`,
`jflash.flash_attention`, and `shard_map`, `jflash.ring_attention_shard` inside a
`jax.shard_map` over a mesh of one device, as the ring runs its kernels on every device of
a larger mesh (and as `jflash.ring_attention` runs on a mesh of one device). Both run the
same kernels (inside the `shard_map` each kernel's operands are handed over typed as
unvarying, `_vma.per_device`, so they stream from one warp there too): a ratio off 1 is
what the `shard_map` itself costs, or the timing's noise. Forward and forward+backward of
each are timed in `--rounds` interleaved rounds (`common.interleaved`,
`common.time_pipelined`), each one's best; the outputs are compared (`max_abs_diff`).
Columns: ms and `shard_map/direct` (above 1: the call inside the `shard_map` is slower),
then each call's device time, summed over its kernels from a trace of 10 calls
(`*_device_ms`; per kernel in the JSON's `*_kernels`): wall time beyond it is the host's
or the gaps between kernels. Shapes are `mask:S:D` (`ab.py`'s), `--tokens` per call (batch
= tokens // S), GQA `--heads`/`--kv-heads`, bf16.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jflash  # noqa: E402
from benchmarks.common import (  # noqa: E402
    add_interpret_flag,
    check_out,
    device_name,
    gpu_or_interpret,
    interleaved,
    jit_passes,
    parse_specs,
    table,
    time_pipelined,
    traced_kernels,
    write_json,
)
from benchmarks.kernel import draw_inputs  # noqa: E402
from train.tools.trace import kernel_label  # noqa: E402

SHAPES = "causal:32768:64,causal:16384:128,causal:65536:128"
CALLS = ("direct", "shard_map")


def calls(mesh, causal: bool, interpret: bool):
    """The two calls, `(q, k, v) -> out`, on the one-device `mesh`."""
    options = dict(causal=causal, interpret=interpret or None)

    def direct(q, k, v):
        return jflash.flash_attention(q, k, v, **options)

    @functools.partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=P(None, "seq"),
        out_specs=P(None, "seq"),
    )
    def in_shard_map(q, k, v):
        return jflash.ring_attention_shard(q, k, v, axis_name="seq", **options)

    return {"direct": direct, "shard_map": in_shard_map}


def device_ms(fn, args, iterations: int = 10) -> dict[str, float]:
    """Device time (ms) per call of each kernel `fn` launches, from a trace of
    `iterations` calls (empty on a CPU)."""
    jax.block_until_ready([fn(*args) for _ in range(3)])  # clocks up
    spent = traced_kernels(fn, args, iterations)
    return {kernel_label(name): ns / iterations / 1e6 for name, ns in spent.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shapes", default=SHAPES, help="comma list of mask:S:D")
    p.add_argument("--tokens", type=int, default=65536, help="tokens per call")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", default=None, help="JSON path (default: results/)")
    add_interpret_flag(p)
    args = p.parse_args(argv)
    if args.out:
        check_out(p, "--out", args.out)
    try:
        shapes = parse_specs(args.shapes, "--shapes", "shape", ("causal", "full"))
    except ValueError as e:
        p.error(str(e))
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds} must be at least 1")
    if args.tokens < 1:
        p.error(f"--tokens {args.tokens} must be at least 1")
    if args.heads < 1 or args.kv_heads < 1 or args.heads % args.kv_heads:
        p.error(f"--heads {args.heads}: not a positive multiple of --kv-heads {args.kv_heads}")
    note = gpu_or_interpret("benchmarks/in_shard_map.py", args.interpret)
    mesh = jax.make_mesh(
        (1,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1]
    )
    rows = []
    for mask, seq, head_dim in shapes:
        batch = max(1, args.tokens // seq)
        q, k, v, do = draw_inputs(batch, seq, args.heads, args.kv_heads, head_dim, jnp.bfloat16)
        passes = {
            name: jit_passes(attend)
            for name, attend in calls(mesh, mask == "causal", args.interpret).items()
        }
        outs = [passes[name]["fwd"][0](q, k, v) for name in CALLS]
        diff = jnp.abs(outs[0].astype(jnp.float32) - outs[1].astype(jnp.float32)).max()
        row = dict(shape=f"{mask} S={seq} D={head_dim} B={batch}", max_abs_diff=float(diff))
        del outs
        for _, pass_name, i in interleaved(len(CALLS), range(args.rounds), ("fwd", "fwdbwd")):
            fn, arity = passes[CALLS[i]][pass_name]
            ms = 1e3 * time_pipelined(fn, *(q, k, v, do)[:arity], iters=None)
            key = f"{CALLS[i]}_{pass_name}_ms"
            row[key] = min(row.get(key, ms), ms)
        for pass_name in ("fwd", "fwdbwd"):
            row[f"shard_map/direct_{pass_name}"] = (
                row[f"shard_map_{pass_name}_ms"] / row[f"direct_{pass_name}_ms"]
            )
            for name in CALLS:  # where the time goes: device time per kernel
                fn, arity = passes[name][pass_name]
                spent = device_ms(fn, (q, k, v, do)[:arity])
                row[f"{name}_{pass_name}_kernels"] = spent
                row[f"{name}_{pass_name}_device_ms"] = sum(spent.values())
        rows.append(row)
        print(row, flush=True)
    columns = ["shape", "max_abs_diff"]
    columns += [f"{n}_{p}_ms" for n in CALLS for p in ("fwd", "fwdbwd")]
    columns += ["shard_map/direct_fwd", "shard_map/direct_fwdbwd"]
    columns += [f"{n}_{p}_device_ms" for n in CALLS for p in ("fwd", "fwdbwd")]
    print(table(rows, columns, note))
    out = args.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results", f"in-shard-map-{device_name()}.json"
    )
    write_json(out, {"rows": rows}, note=note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
