"""Plain-jnp oracle and the blockwise XLA implementation.

`attention_reference` is the oracle every kernel is tested against: dense, f32 softmax.
`xla_fwd` / `xla_bwd` implement the kernel contract (`jflash._dispatch`) with `lax.scan` over key
blocks, so memory stays linear in the sequence length; they are the `"xla"`
implementation and run everywhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jflash._mask import Mask
from jflash._validation import (
    check_causal,
    check_offsets,
    check_qkv,
    check_segment_ids,
    default_scale,
)
from jflash._vma import vary, varying_axes

_HIGHEST = jax.lax.Precision.HIGHEST


def _grouped(q, num_kv_heads: int):
    """`[B,T,N,H]` -> `[B,T,K,G,H]`: query heads grouped by the KV head they read."""
    b, t, n, h = q.shape
    return q.reshape(b, t, num_kv_heads, n // num_kv_heads, h)


def attention_reference(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B S K H"],
    v: Float[Array, "B S K H"],
    *,
    causal: bool,
    scale: float | None = None,
    segment_ids=None,
    q_offset: int = 0,
    k_offset: int = 0,
) -> tuple[Float[Array, "B T N H"], Float[Array, "B N T"]]:
    """Dense exact attention in f32; returns `(out [B,T,N,H] in q.dtype, lse [B,N,T] f32)`.

    Its arguments are `jflash.flash_attention`'s, with the same meaning and checks:
    `causal` (required), `scale` (None: `1/sqrt(H)`), `segment_ids` (None, `[B, T]` ids
    for queries and keys alike, or a `(q_ids [B, T], kv_ids [B, S])` pair: a query sees
    the keys of its id), and `q_offset` / `k_offset` (causal only: the global positions
    of the first query and key). Rows that see no key get output 0 and LSE `-inf`.
    """
    shapes = check_qkv(q, k, v)
    segs = check_segment_ids(segment_ids, shapes)
    scale = default_scale(shapes.head_dim, scale)
    causal = check_causal(causal)
    offsets = check_offsets(q_offset, k_offset, shapes, causal)
    mask = Mask(causal, *offsets).dense(shapes.q_len, shapes.kv_len, segs)
    qg = _grouped(q.astype(jnp.float32), shapes.kv_heads)
    s = jnp.einsum("btkgh,bskh->bkgts", qg, k.astype(jnp.float32), precision=_HIGHEST) * scale
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)  # [B,K,G,T]
    p = jnp.where(mask[:, None, None], jnp.exp(s - _finite(lse)[..., None]), 0.0)
    o = jnp.einsum("bkgts,bskh->btkgh", p, v.astype(jnp.float32), precision=_HIGHEST)
    b, t, n, h = q.shape
    return o.reshape(b, t, n, h).astype(q.dtype), lse.reshape(b, n, t)


def _finite(lse):
    """LSE with -inf rows replaced by 0 so `exp(s - lse)` stays finite (those p are masked)."""
    return jnp.where(jnp.isneginf(lse), 0.0, lse)


def _mm(spec: str, a, b):
    """f32-accumulating einsum; f32 inputs stay f32 (GPU XLA would default to TF32)."""
    precision = _HIGHEST if a.dtype == jnp.float32 else None
    return jnp.einsum(spec, a, b, precision=precision, preferred_element_type=jnp.float32)


def _kv_blocks(x, block: int):
    """`[B,S,K,H]` -> `[nblk, B, block, K, H]`, zero-padded."""
    b, s, kh, h = x.shape
    nblk = -(-s // block)
    x = jnp.pad(x, ((0, 0), (0, nblk * block - s), (0, 0), (0, 0)))
    return jnp.moveaxis(x.reshape(b, nblk, block, kh, h), 1, 0)


def _block_mask(mask: Mask, segs, q_len: int, kv_len: int, start, block: int):
    """Visibility `[B|1, T, block]` of keys `start .. start+block` (padding hidden)."""
    qi = jnp.arange(q_len)[:, None] + mask.q_offset
    kj = start + jnp.arange(block)[None, :]
    visible = kj < kv_len
    if mask.causal:
        visible = visible & (qi >= kj + mask.k_offset)
    visible = visible[None]
    if segs is not None:
        q_seg, kv_seg = segs
        kv_seg = jax.lax.dynamic_slice_in_dim(
            jnp.pad(kv_seg, ((0, 0), (0, block))), start, block, axis=1
        )
        visible = visible & (q_seg[:, :, None] == kv_seg[:, None, :])
    return visible


def xla_fwd(q, k, v, *, mask: Mask, segs, scale: float, out_dtype, block: int = 512):
    """Blockwise forward: `(o [B,T,N,H] out_dtype, lse [B,N,T] f32)`."""
    b, t, n, h = q.shape
    kv_len, kh = k.shape[1], k.shape[2]
    block = min(block, kv_len)
    qg = _grouped(q, kh)
    # Inside a shard_map the carries vary like the inputs they are built from.
    axes = varying_axes(q, k, v, *(segs or ()))
    init = tuple(
        vary(x, axes)
        for x in (
            jnp.full((b, kh, n // kh, t), -jnp.inf, jnp.float32),
            jnp.zeros((b, kh, n // kh, t), jnp.float32),
            jnp.zeros((b, t, kh, n // kh, h), jnp.float32),
        )
    )

    def step(carry, xs):
        m, l, acc = carry
        start, kb, vb = xs
        s = _mm("btkgh,bskh->bkgts", qg, kb) * scale
        vis = _block_mask(mask, segs, t, kv_len, start, block)[:, None, None]
        s = jnp.where(vis, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        m_safe = _finite(m_new)
        p = jnp.exp(s - m_safe[..., None])
        corr = jnp.exp(m - m_safe)
        l = l * corr + p.sum(-1)
        pv = _mm("bkgts,bskh->btkgh", p.astype(v.dtype), vb)
        acc = acc * jnp.moveaxis(corr, -1, 1)[..., None] + pv
        return (m_new, l, acc), None

    nblk = -(-kv_len // block)
    starts = jnp.arange(nblk, dtype=jnp.int32) * block
    (m, l, acc), _ = jax.lax.scan(step, init, (starts, _kv_blocks(k, block), _kv_blocks(v, block)))
    l_safe = jnp.where(l == 0, 1.0, l)
    o = acc / jnp.moveaxis(l_safe, -1, 1)[..., None]
    lse = jnp.where(l == 0, -jnp.inf, m + jnp.log(l_safe))
    return o.reshape(b, t, n, h).astype(out_dtype), lse.reshape(b, n, t)


def xla_bwd(
    q, k, v, do, lse, delta, *, mask: Mask, segs, scale: float, grad_dtype, block: int = 512
):
    """Blockwise backward given the saved global `lse` and `delta = rowsum(dO*O) - dlse`.

    Returns `(dq, dk, dv)` in `grad_dtype`.
    """
    b, t, n, h = q.shape
    kv_len, kh = k.shape[1], k.shape[2]
    g = n // kh
    block = min(block, kv_len)
    qg = _grouped(q, kh)
    dog = _grouped(do, kh)
    lse_g = jnp.where(jnp.isneginf(lse), jnp.inf, lse).reshape(b, kh, g, t)
    delta_g = delta.reshape(b, kh, g, t)

    def step(dq, xs):
        start, kb, vb = xs
        s = _mm("btkgh,bskh->bkgts", qg, kb) * scale
        vis = _block_mask(mask, segs, t, kv_len, start, block)[:, None, None]
        p = jnp.where(vis, jnp.exp(s - lse_g[..., None]), 0.0)
        dv = _mm("bkgts,btkgh->bskh", p.astype(do.dtype), dog)
        dp = _mm("btkgh,bskh->bkgts", dog, vb)
        ds = (p * (dp - delta_g[..., None]) * scale).astype(q.dtype)
        dq = dq + _mm("bkgts,bskh->btkgh", ds, kb)
        dk = _mm("bkgts,btkgh->bskh", ds, qg)
        return dq, (dk.astype(grad_dtype), dv.astype(grad_dtype))

    nblk = -(-kv_len // block)
    starts = jnp.arange(nblk, dtype=jnp.int32) * block
    dq0 = vary(
        jnp.zeros((b, t, kh, g, h), jnp.float32),
        varying_axes(q, k, v, do, lse, delta, *(segs or ())),
    )
    dq, (dk, dv) = jax.lax.scan(step, dq0, (starts, _kv_blocks(k, block), _kv_blocks(v, block)))

    def unblock(x):
        return jnp.moveaxis(x, 0, 1).reshape(b, nblk * block, kh, h)[:, :kv_len]

    return dq.reshape(b, t, n, h).astype(grad_dtype), unblock(dk), unblock(dv)
