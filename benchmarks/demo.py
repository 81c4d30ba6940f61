"""`make demo` (kernel stage): jflash vs the oracle on a small causal GQA problem.

Prints the error of the output, LSE and gradients against `jflash.attention_reference`
and the time of each implementation that runs here (interpret mode on CPU).
"""

from __future__ import annotations

import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jflash  # noqa: E402


def main():
    b, t, n, kh, h = 1, 256, 8, 2, 64
    ks = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(ks[0], (b, t, n, h), jnp.float32)
    k = jax.random.normal(ks[1], (b, t, kh, h), jnp.float32)
    v = jax.random.normal(ks[2], (b, t, kh, h), jnp.float32)
    do = jax.random.normal(ks[3], (b, t, n, h), jnp.float32)
    print(jflash.describe())
    print(f"problem: causal, q {q.shape}, k/v {k.shape} (GQA {n}/{kh}), f32")

    def run(fn):
        def loss(q, k, v):
            out = fn(q, k, v)
            return jnp.sum(out * do), out

        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
        jax.block_until_ready(grad(q, k, v))  # compile
        t0 = time.perf_counter()
        grads, out = jax.block_until_ready(grad(q, k, v))
        return out, grads, time.perf_counter() - t0

    with jax.default_matmul_precision("highest"):
        ref_out, ref_grads, ref_t = run(lambda q, k, v: jflash.attention_reference(q, k, v)[0])
    impls = {"xla": dict(implementation="xla")}
    if jax.default_backend() == "gpu":
        impls["pallas_triton"] = dict(implementation="pallas_triton")
    else:
        impls["pallas_triton (interpret)"] = dict(implementation="pallas_triton", interpret=True)
    print(f"{'implementation':28s} {'max|out err|':>12s} {'max|grad err|':>13s} {'fwd+bwd':>9s}")
    print(f"{'oracle (dense f32)':28s} {0.0:12.1e} {0.0:13.1e} {ref_t * 1e3:7.1f}ms")
    for name, kw in impls.items():
        out, grads, t = run(lambda q, k, v, kw=kw: jflash.flash_attention(q, k, v, **kw))
        out_err = float(jnp.abs(out - ref_out).max())
        grad_err = max(float(jnp.abs(a - r).max()) for a, r in zip(grads, ref_grads, strict=True))
        print(f"{name:28s} {out_err:12.1e} {grad_err:13.1e} {t * 1e3:7.1f}ms")
        assert out_err < 1e-4 and grad_err < 1e-3, "jflash disagrees with the oracle"
    print("ok: jflash matches the oracle")


if __name__ == "__main__":
    main()
