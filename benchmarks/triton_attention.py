"""A Triton-language fused attention, called from JAX through `jax_triton.triton_call`:
a peer column of `benchmarks/kernel.py` (`--impls jax_triton`), never used by jflash.

The algorithm of the Triton fused-attention tutorial (FlashAttention-2): the forward
streams key/value blocks past a block of queries with an online softmax (base-2
exponentials, the scale folded into the exponent) and keeps the log-sum-exp; the backward
is one kernel for dK/dV (a program per key block and KV head, looping over the query
heads of its group and the query blocks: no atomics) and one for dQ (a program per query
block and head), from the forward's log-sum-exp and D = rowsum(dO * O). Causal programs
stream the unmasked blocks first and mask only the diagonal ones.

Layout [batch, seq, heads, head_dim] as in `jflash.flash_attention`; bf16 or fp16;
D = 64 or 128; grouped-query attention (K/V heads dividing the query heads); the
sequence a multiple of 128. Needs `triton` and `jax-triton` (the `bench` extra).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import jax_triton as jt
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
SEQ_MULTIPLE = 128  # every block size below divides it

# (block_q, block_kv, num_warps, num_stages) per head dim: the forward's blocks.
FWD_CONFIG = {64: (128, 64, 4, 3), 128: (128, 64, 8, 3)}
# (block_q, block_kv, num_warps, num_stages) per head dim: the backward's. The dK/dV
# kernel streams block_q queries past block_kv keys; the dQ kernel block_q keys past
# block_kv queries. At D = 128 on an H200 (16k causal) 64 rows and 8 warps ran
# forward+backward at 2.6x the tutorial's (32, 128, 4, ...) blocks; at D = 64 they ran slower.
BWD_CONFIG = {64: (32, 128, 4, 3), 128: (64, 128, 8, 3)}


@triton.jit
def _fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    SCALE: tl.constexpr,
    SEQ: tl.constexpr,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HEADS
    h = bh % HEADS
    kvh = h // (HEADS // KV_HEADS)
    q_row: tl.constexpr = HEADS * HEAD_DIM  # elements between two positions
    kv_row: tl.constexpr = KV_HEADS * HEAD_DIM
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q_base = Q + b.to(tl.int64) * SEQ * q_row + h * HEAD_DIM
    k_base = K + b.to(tl.int64) * SEQ * kv_row + kvh * HEAD_DIM
    v_base = V + b.to(tl.int64) * SEQ * kv_row + kvh * HEAD_DIM
    q = tl.load(q_base + offs_m[:, None] * q_row + offs_d[None, :])
    qk_scale = SCALE * 1.4426950408889634
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # Unmasked blocks: every key before this query block (all keys if not causal).
    hi = start_m * BLOCK_M if CAUSAL else SEQ
    for start_n in range(0, hi, BLOCK_N):
        kt = tl.load(k_base + (start_n + offs_n)[None, :] * kv_row + offs_d[:, None])
        qk = tl.dot(q, kt) * qk_scale
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + (start_n + offs_n)[:, None] * kv_row + offs_d[None, :])
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    if CAUSAL:  # the diagonal blocks, masked
        for start_n in range(start_m * BLOCK_M, (start_m + 1) * BLOCK_M, BLOCK_N):
            kt = tl.load(k_base + (start_n + offs_n)[None, :] * kv_row + offs_d[:, None])
            qk = tl.dot(q, kt) * qk_scale
            visible = offs_m[:, None] >= (start_n + offs_n)[None, :]
            qk = tl.where(visible, qk, -1.0e6)
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.math.exp2(qk - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + (start_n + offs_n)[:, None] * kv_row + offs_d[None, :])
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
    acc = acc / l_i[:, None]
    o_base = O + b.to(tl.int64) * SEQ * q_row + h * HEAD_DIM
    tl.store(o_base + offs_m[:, None] * q_row + offs_d[None, :], acc.to(O.dtype.element_ty))
    # Base-2 log-sum-exp of the scaled scores, [batch, heads, seq].
    tl.store(LSE + bh.to(tl.int64) * SEQ + offs_m, m_i + tl.math.log2(l_i))


@triton.jit
def _dkdv_block(
    dk,
    dv,
    k,
    v,
    q_base,
    do_base,
    LSE,
    DELTA,
    stat_base,
    start_m,
    offs_m,
    offs_n,
    offs_d,
    q_row: tl.constexpr,
    qk_scale,
    MASK: tl.constexpr,
):
    """dK, dV += one block of queries' share (`MASK`: the causal diagonal)."""
    rows = start_m + offs_m
    qt = tl.load(q_base + rows[None, :] * q_row + offs_d[:, None])
    lse = tl.load(LSE + stat_base + rows)
    pt = tl.math.exp2(tl.dot(k, qt) * qk_scale - lse[None, :])
    if MASK:
        pt = tl.where(rows[None, :] >= offs_n[:, None], pt, 0.0)
    do = tl.load(do_base + rows[:, None] * q_row + offs_d[None, :])
    dv = tl.dot(pt.to(do.dtype), do, dv)
    delta = tl.load(DELTA + stat_base + rows)
    dpt = tl.dot(v, tl.trans(do))
    dst = pt * (dpt - delta[None, :])
    dk = tl.dot(dst.to(qt.dtype), tl.trans(qt), dk)
    return dk, dv


@triton.jit
def _dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    SCALE: tl.constexpr,
    SEQ: tl.constexpr,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    start_n = tl.program_id(0) * BLOCK_N
    bkv = tl.program_id(1)
    b = bkv // KV_HEADS
    kvh = bkv % KV_HEADS
    group: tl.constexpr = HEADS // KV_HEADS
    q_row: tl.constexpr = HEADS * HEAD_DIM
    kv_row: tl.constexpr = KV_HEADS * HEAD_DIM
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    kv_off = b.to(tl.int64) * SEQ * kv_row + kvh * HEAD_DIM + offs_n[:, None] * kv_row
    k = tl.load(K + kv_off + offs_d[None, :])
    v = tl.load(V + kv_off + offs_d[None, :])
    qk_scale = SCALE * 1.4426950408889634
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for g in range(group):  # the query heads sharing this K/V head: no atomics
        h = kvh * group + g
        q_base = Q + b.to(tl.int64) * SEQ * q_row + h * HEAD_DIM
        do_base = DO + b.to(tl.int64) * SEQ * q_row + h * HEAD_DIM
        stat_base = (b * HEADS + h).to(tl.int64) * SEQ
        lo = 0
        if CAUSAL:  # the diagonal query blocks, masked; then the later ones
            for start_m in range(start_n, start_n + BLOCK_N, BLOCK_M):
                dk, dv = _dkdv_block(
                    dk,
                    dv,
                    k,
                    v,
                    q_base,
                    do_base,
                    LSE,
                    DELTA,
                    stat_base,
                    start_m,
                    offs_m,
                    offs_n,
                    offs_d,
                    q_row,
                    qk_scale,
                    True,
                )
            lo = start_n + BLOCK_N
        for start_m in range(lo, SEQ, BLOCK_M):
            dk, dv = _dkdv_block(
                dk,
                dv,
                k,
                v,
                q_base,
                do_base,
                LSE,
                DELTA,
                stat_base,
                start_m,
                offs_m,
                offs_n,
                offs_d,
                q_row,
                qk_scale,
                False,
            )
    tl.store(DK + kv_off + offs_d[None, :], (dk * SCALE).to(DK.dtype.element_ty))
    tl.store(DV + kv_off + offs_d[None, :], dv.to(DV.dtype.element_ty))


@triton.jit
def _dq_block(
    dq,
    q,
    do,
    lse,
    delta,
    k_base,
    v_base,
    start_n,
    offs_m,
    offs_n,
    offs_d,
    kv_row: tl.constexpr,
    qk_scale,
    MASK: tl.constexpr,
):
    """dQ += one block of keys' share (`MASK`: the causal diagonal)."""
    cols = start_n + offs_n
    kt = tl.load(k_base + cols[None, :] * kv_row + offs_d[:, None])
    vt = tl.load(v_base + cols[None, :] * kv_row + offs_d[:, None])
    p = tl.math.exp2(tl.dot(q, kt) * qk_scale - lse[:, None])
    if MASK:
        p = tl.where(offs_m[:, None] >= cols[None, :], p, 0.0)
    dp = tl.dot(do, vt)
    ds = p * (dp - delta[:, None])
    return tl.dot(ds.to(kt.dtype), tl.trans(kt), dq)


@triton.jit
def _dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
    SCALE: tl.constexpr,
    SEQ: tl.constexpr,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // HEADS
    h = bh % HEADS
    kvh = h // (HEADS // KV_HEADS)
    q_row: tl.constexpr = HEADS * HEAD_DIM
    kv_row: tl.constexpr = KV_HEADS * HEAD_DIM
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q_off = b.to(tl.int64) * SEQ * q_row + h * HEAD_DIM + offs_m[:, None] * q_row
    q = tl.load(Q + q_off + offs_d[None, :])
    do = tl.load(DO + q_off + offs_d[None, :])
    lse = tl.load(LSE + bh.to(tl.int64) * SEQ + offs_m)
    delta = tl.load(DELTA + bh.to(tl.int64) * SEQ + offs_m)
    k_base = K + b.to(tl.int64) * SEQ * kv_row + kvh * HEAD_DIM
    v_base = V + b.to(tl.int64) * SEQ * kv_row + kvh * HEAD_DIM
    qk_scale = SCALE * 1.4426950408889634
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    hi = start_m if CAUSAL else SEQ
    for start_n in range(0, hi, BLOCK_N):  # unmasked: keys before the diagonal
        dq = _dq_block(
            dq,
            q,
            do,
            lse,
            delta,
            k_base,
            v_base,
            start_n,
            offs_m,
            offs_n,
            offs_d,
            kv_row,
            qk_scale,
            False,
        )
    if CAUSAL:  # the diagonal key blocks, masked
        for start_n in range(start_m, start_m + BLOCK_M, BLOCK_N):
            dq = _dq_block(
                dq,
                q,
                do,
                lse,
                delta,
                k_base,
                v_base,
                start_n,
                offs_m,
                offs_n,
                offs_d,
                kv_row,
                qk_scale,
                True,
            )
    tl.store(DQ + q_off + offs_d[None, :], (dq * SCALE).to(DQ.dtype.element_ty))


def check_shapes(q, k, v) -> None:
    """One-line ValueErrors for what these kernels do not cover."""
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4:
        raise ValueError(f"q, k, v must be [batch, seq, heads, head_dim]: {q.shape=}, {k.shape=}")
    batch, seq, heads, head_dim = q.shape
    if k.shape[0] != batch or k.shape[1] != seq or k.shape[3] != head_dim:
        raise ValueError(f"k/v {k.shape} do not match q {q.shape} (self-attention only)")
    if head_dim not in FWD_CONFIG:
        raise ValueError(f"head_dim={head_dim} is not supported (64 or 128)")
    if seq % SEQ_MULTIPLE:
        raise ValueError(f"seq={seq} must be a multiple of {SEQ_MULTIPLE}")
    if heads % k.shape[2]:
        raise ValueError(f"kv heads {k.shape[2]} must divide query heads {heads}")
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"dtype must be bf16 or fp16 throughout: {q.dtype}, {k.dtype}, {v.dtype}")


def _dims(q, k, causal):
    batch, seq, heads, head_dim = q.shape
    return dict(
        SCALE=1.0 / math.sqrt(head_dim),
        SEQ=seq,
        HEADS=heads,
        KV_HEADS=k.shape[2],
        HEAD_DIM=head_dim,
        CAUSAL=causal,
    )


def _forward(q, k, v, causal):
    batch, seq, heads, head_dim = q.shape
    block_m, block_n, warps, stages = FWD_CONFIG[head_dim]
    out, lse = jt.triton_call(
        q,
        k,
        v,
        kernel=_fwd_kernel,
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((batch, heads, seq), jnp.float32),
        ],
        grid=(seq // block_m, batch * heads),
        num_warps=warps,
        num_stages=stages,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        **_dims(q, k, causal),
    )
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _attention(q, k, v, causal):
    return _forward(q, k, v, causal)[0]


def _attention_fwd(q, k, v, causal):
    out, lse = _forward(q, k, v, causal)
    return out, (q, k, v, out, lse)


def _attention_bwd(causal, residuals, do):
    q, k, v, out, lse = residuals
    batch, seq, heads, _ = q.shape
    kv_heads = k.shape[2]
    do = do.astype(q.dtype)
    # D = rowsum(dO * O) per query and head, [batch, heads, seq] f32 (an XLA fusion).
    delta = jnp.einsum("bshd,bshd->bhs", do.astype(jnp.float32), out.astype(jnp.float32))
    dims = _dims(q, k, causal)
    block_q, block_kv, warps, stages = BWD_CONFIG[q.shape[3]]
    common = dict(num_warps=warps, num_stages=stages, **dims)
    dk, dv = jt.triton_call(
        q,
        k,
        v,
        do,
        lse,
        delta,
        kernel=_dkdv_kernel,
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        grid=(seq // block_kv, batch * kv_heads),
        BLOCK_M=block_q,
        BLOCK_N=block_kv,
        **common,
    )
    (dq,) = jt.triton_call(
        q,
        k,
        v,
        do,
        lse,
        delta,
        kernel=_dq_kernel,
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype)],
        grid=(seq // block_kv, batch * heads),
        BLOCK_M=block_kv,
        BLOCK_N=block_q,
        **common,
    )
    return dq, dk, dv


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(q, k, v, *, causal: bool = True):
    """softmax(q kᵀ / √D) v on [batch, seq, heads, head_dim] inputs through the Triton
    kernels above (differentiable: the backward is the two Triton kernels)."""
    check_shapes(q, k, v)
    return _attention(q, k, v, bool(causal))
