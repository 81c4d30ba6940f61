"""One Mosaic kernel at a time on a small problem, max error vs the oracle (GPU).

    python benchmarks/mosaic_smoke.py fwd|bwd [seq] [head_dim] [causal] [--interpret]

Run each stage under `timeout`: a pipeline bug shows up as a hang, not an error. Without
a GPU it stops at once, saying so; `--interpret` runs the stage in jax's GPU interpreter
on CPU (its times are then the interpreter's).
"""

from __future__ import annotations

import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jflash  # noqa: E402
from benchmarks.common import gpu_or_interpret  # noqa: E402


def main():
    argv = [a for a in sys.argv[1:] if a != "--interpret"]
    if not argv or argv[0] not in ("fwd", "bwd"):
        sys.exit(
            "usage: benchmarks/mosaic_smoke.py fwd|bwd [seq] [head_dim] [causal] [--interpret]"
        )
    stage = argv[0]
    seq = int(argv[1]) if len(argv) > 1 else 256
    hd = int(argv[2]) if len(argv) > 2 else 128
    causal = (argv[3] if len(argv) > 3 else "1") == "1"
    gpu_or_interpret("benchmarks/mosaic_smoke.py", "--interpret" in sys.argv[1:])
    ks = jax.random.split(jax.random.key(0), 4)
    shape_q, shape_kv = (1, seq, 4, hd), (1, seq, 2, hd)
    q = jax.random.normal(ks[0], shape_q, jnp.bfloat16)
    k = jax.random.normal(ks[1], shape_kv, jnp.bfloat16)
    v = jax.random.normal(ks[2], shape_kv, jnp.bfloat16)
    do = jax.random.normal(ks[3], shape_q, jnp.bfloat16)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    t = time.time()
    if stage == "fwd":
        out, lse = jflash.flash_attention(
            q, k, v, causal=causal, return_lse=True, implementation="pallas_mosaic"
        )
        out.block_until_ready()
        want, want_lse = jflash.attention_reference(*f32, causal=causal)
        print(
            f"fwd {seq=} {hd=} {causal=} {time.time() - t:.1f}s "
            f"out err {float(jnp.abs(out.astype(jnp.float32) - want).max()):.4f} "
            f"lse err {float(jnp.abs(lse - want_lse).max()):.5f}",
            flush=True,
        )
    else:

        def grads(fn, *args, **kw):
            return jax.grad(
                lambda q, k, v: jnp.sum(fn(q, k, v, causal=causal, **kw)[0] * do), (0, 1, 2)
            )(*args)

        fn = jax.jit(
            lambda q, k, v: grads(
                lambda *a, **kw: (jflash.flash_attention(*a, **kw),),
                q,
                k,
                v,
                implementation="pallas_mosaic",
            )
        )
        compiled = fn.lower(q, k, v).compile()
        print(f"  compiled in {time.time() - t:.1f}s", flush=True)
        t1 = time.time()
        got = compiled(q, k, v)
        jax.block_until_ready(got)
        print(f"  ran in {time.time() - t1:.2f}s", flush=True)
        want = grads(jflash.attention_reference, *f32)
        errs = [
            float(jnp.abs(a.astype(jnp.float32) - b).max()) for a, b in zip(got, want, strict=True)
        ]
        scale = [float(jnp.abs(b).max()) for b in want]
        print(f"bwd {seq=} {hd=} {causal=} {time.time() - t:.1f}s err {errs} of {scale}")


if __name__ == "__main__":
    main()
