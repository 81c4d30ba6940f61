"""Shared helpers for kernel tests: input drawing, the tolerance table, grad checks."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import jflash

# Fixed per-dtype tolerances (atol = rtol) against the f32 oracle on upcast inputs at
# HIGHEST precision. Written once; never loosened to make a test pass (a change says why
# in its commit).
TOLERANCE = {
    jnp.float32: {"out": 2e-5, "lse": 2e-5, "grad": 1e-4},
    jnp.float16: {"out": 4e-3, "lse": 1e-3, "grad": 1.5e-2},
    jnp.bfloat16: {"out": 3e-2, "lse": 1e-2, "grad": 8e-2},
}


def draw(key, shape, dtype):
    """Fresh normal inputs (never zeros), rounded to `dtype`."""
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def make_inputs(seed, *, batch, q_len, kv_len, q_heads, kv_heads, head_dim, dtype):
    ks = jax.random.split(jax.random.key(seed), 5)
    q = draw(ks[0], (batch, q_len, q_heads, head_dim), dtype)
    k = draw(ks[1], (batch, kv_len, kv_heads, head_dim), dtype)
    v = draw(ks[2], (batch, kv_len, kv_heads, head_dim), dtype)
    do = draw(ks[3], (batch, q_len, q_heads, head_dim), jnp.float32)
    dlse = draw(ks[4], (batch, q_heads, q_len), jnp.float32)
    return q, k, v, do, dlse


def random_segments(seed, batch, length, num_segments):
    """Sorted segment ids `[B, L]` with random boundaries (packed sequences)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, length), num_segments - 1, replace=False))
        out.append(np.searchsorted(cuts, np.arange(length), side="right"))
    return jnp.asarray(np.stack(out), jnp.int32)


def value_and_grads(fn, q, k, v, do, dlse, **kwargs):
    """`(out, lse, dq, dk, dv)` with random cotangents on both outputs (never `.sum()`)."""

    def loss(q, k, v):
        out, lse = fn(q, k, v, **kwargs)
        lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(out.astype(jnp.float32) * do) + jnp.sum(lse * dlse), (out, lse)

    (_, (out, lse)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return (out, lse, *grads)


@functools.partial(jax.jit, static_argnames="options")
def _oracle(q, k, v, do, dlse, segment_ids, options):
    """One compiled program (op-by-op dispatch costs ~30 s per case on a GPU), shared by
    every case of the same shapes and options (the segment ids are traced)."""
    return value_and_grads(
        jflash.attention_reference, q, k, v, do, dlse, segment_ids=segment_ids, **dict(options)
    )


def oracle(q, k, v, do, dlse, segment_ids=None, **kwargs):
    """The oracle on inputs upcast to f32 at HIGHEST precision."""
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    with jax.default_matmul_precision("highest"):
        return _oracle(*f32, do, dlse, segment_ids, tuple(sorted(kwargs.items())))


def assert_close(actual, expected, dtype, names=("out", "lse", "dq", "dk", "dv")):
    tol = TOLERANCE[dtype]
    for name, a, e in zip(names, actual, expected, strict=True):
        a = np.asarray(a, np.float32)
        e = np.asarray(e, np.float32)
        assert not np.isnan(a).any(), f"{name} has NaN"
        t = tol["out"] if name == "out" else tol["lse"] if name == "lse" else tol["grad"]
        # Gradients scale with the cotangent; compare relative to the largest entry.
        scale = max(1.0, float(np.abs(e[np.isfinite(e)]).max(initial=0.0)))
        np.testing.assert_allclose(a, e, atol=t * scale, rtol=t, err_msg=name)
