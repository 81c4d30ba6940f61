"""FlashAttention-2 forward as a Pallas kernel lowered through Triton.

Grid (query blocks) x (batch * query heads), in `Launch` order; each program keeps one
query tile in registers and streams the K/V tiles of its KV head (`h // group`: GQA
without copies).
Softmax runs in base 2 with the scale folded into one multiply (FA-2 §3.1), key blocks
are split into an unmasked run and a masked run, and fully hidden blocks are skipped.
With segment ids (packed documents) the loops visit only the key tiles that share an id
with the query tile (`jflash._segments`), and compare ids only on tiles at a document
boundary.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jflash import _vma
from jflash._block_sizes import BlockSizes
from jflash._mask import Mask
from jflash._segments import kv_tile_range
from jflash._triton_common import (
    LN2,
    LOG2E,
    Launch,
    dot,
    index,
    pad_to,
    padded_head_dim,
    read_tiles,
    round_up,
    runs,
    tile_range_specs,
    tile_visibility,
    visible_kv_range,
)


def _flash_fwd_kernel(
    q_ref,
    k_ref,
    v_ref,
    qseg_ref,
    kseg_ref,
    first_ref,
    end_ref,
    same_first_ref,
    same_end_ref,
    o_ref,
    lse_ref,
    *,
    scale,
    mask: Mask,
    kv_len,
    block_q,
    block_kv,
    num_heads,
    tile_axis,
):
    i = pl.num_programs(tile_axis) - 1 - pl.program_id(tile_axis)  # longest causal rows first
    q_start = pl.multiple_of(i * block_q, block_q)
    q = q_ref[...]  # [block_q, H]
    qk_scale = scale * LOG2E
    q_pos = mask.q_offset + q_start + lax.broadcasted_iota(jnp.int32, (block_q, block_kv), 0)
    q_seg = None if qseg_ref is None else qseg_ref[...]

    def body(j, carry, *, masked, segmented):
        acc, m, l = carry
        k_start = pl.multiple_of(j * block_kv, block_kv)
        k = k_ref[pl.ds(k_start, block_kv), :]  # [block_kv, H]
        v = v_ref[pl.ds(k_start, block_kv), :]
        s = dot(q, k, trans_b=True)  # [block_q, block_kv] f32, unscaled logits
        visible = tile_visibility(
            mask,
            q_pos,
            k_start,
            (block_q, block_kv),
            kv_len,
            masked=masked,
            q_seg=q_seg if segmented else None,
            kseg_ref=kseg_ref,
        )
        if visible is not None:
            s = jnp.where(visible, s, jnp.float32(-jnp.inf))
        # The running max is kept in base-2 scaled units; taking the max of the unscaled
        # logits (scale > 0) lets `s * qk_scale - m` fuse into one FMA per element.
        m_new = jnp.maximum(m, s.max(axis=1) * qk_scale)
        if visible is not None:
            # Rows that saw nothing yet.
            m_use = jnp.where(m_new == -jnp.inf, jnp.float32(0.0), m_new)
        else:
            m_use = m_new
        p = jnp.exp2(s * qk_scale - m_use[:, None])  # [block_q, block_kv] f32
        corr = jnp.exp2(m - m_use)
        l = l * corr + p.sum(axis=1)
        pv = dot(p.astype(v.dtype), v)
        return acc * corr[:, None] + pv, m_new, l

    # Unmasked key blocks `[0, n_full)`, masked ones `[n_full, n_end)`, each cut to the
    # key tiles that share a segment id with this query tile.
    n_full, n_end = visible_kv_range(mask, q_start, block_q, block_kv, kv_len)
    tiles = read_tiles(first_ref, end_ref, same_first_ref, same_end_ref)
    carry = (
        jnp.zeros((block_q, q.shape[-1]), jnp.float32),
        jnp.full((block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    for masked, (lo, hi) in ((False, (index(0), n_full)), (True, (n_full, n_end))):
        for start, stop, segmented in runs(lo, hi, tiles, split=not masked):
            step = functools.partial(body, masked=masked, segmented=segmented)
            carry = lax.fori_loop(start, stop, step, carry)
    acc, m, l = carry
    empty = l == 0.0
    l_safe = jnp.where(empty, jnp.float32(1.0), l)
    o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, jnp.float32(-jnp.inf), (m + jnp.log2(l_safe)) * LN2)


def flash_fwd(
    q,
    k,
    v,
    segs,
    *,
    mask: Mask,
    scale: float,
    out_dtype,
    block_sizes: BlockSizes,
    interpret: bool,
):
    """Forward of the kernel contract: `(o [B,T,N,H] out_dtype, lse [B,N,T] f32)`."""
    b, t, n, h = q.shape
    s_len, kh = k.shape[1], k.shape[2]
    group = n // kh
    hp = padded_head_dim(h)
    bq, bk = block_sizes.block_q, block_sizes.block_kv
    # Inside a user's shard_map, inputs and outputs must vary over the same mesh axes.
    q, k, v, *seg_ids = _vma.match(q, k, v, *(segs or ()))
    segs = tuple(seg_ids) or None
    tp, sp = round_up(t, bq), round_up(s_len, bk)
    q = pad_to(pad_to(q, 3, hp), 1, tp)
    k = pad_to(pad_to(k, 3, hp), 1, sp)
    v = pad_to(pad_to(v, 3, hp), 1, sp)
    nq = tp // bq
    launch = Launch.of(nq, n, b, causal=mask.causal)

    @launch.index_map
    def q_map(bh, i):
        return (bh // n, nq - 1 - i, bh % n, 0)

    @launch.index_map
    def kv_map(bh, i):
        return (bh // n, 0, (bh % n) // group, 0)

    in_specs = [
        pl.BlockSpec((None, bq, None, hp), q_map),
        pl.BlockSpec((None, sp, None, hp), kv_map),
        pl.BlockSpec((None, sp, None, hp), kv_map),
    ]
    args = [q, k, v]
    if segs is None:
        in_specs += [None] * 6
        args += [None] * 6
    else:
        q_seg, kv_seg = segs
        at_q_tile = launch.index_map(lambda bh, i: (bh // n, nq - 1 - i))
        in_specs += [
            pl.BlockSpec((None, bq), at_q_tile),
            pl.BlockSpec((None, sp), launch.index_map(lambda bh, i: (bh // n, 0))),
            *tile_range_specs(at_q_tile),
        ]
        args += [
            pad_to(q_seg, 1, tp),
            pad_to(kv_seg, 1, sp),
            *kv_tile_range(q_seg, kv_seg, bq, bk),
        ]
    kernel = functools.partial(
        _flash_fwd_kernel,
        scale=scale,
        mask=mask,
        kv_len=s_len,
        block_q=bq,
        block_kv=bk,
        num_heads=n,
        tile_axis=launch.tile_axis,
    )
    o, lse = _vma.per_device(
        pl.pallas_call(
            kernel,
            grid=launch.grid,
            in_specs=in_specs,
            out_specs=[
                pl.BlockSpec((None, bq, None, hp), q_map),
                pl.BlockSpec(
                    (None, None, bq), launch.index_map(lambda bh, i: (bh // n, bh % n, nq - 1 - i))
                ),
            ],
            out_shape=[
                _vma.struct((b, tp, n, hp), out_dtype),
                _vma.struct((b, n, tp), jnp.float32),
            ],
            compiler_params=plgpu.CompilerParams(
                num_warps=block_sizes.num_warps, num_stages=block_sizes.num_stages
            ),
            interpret=interpret,
            name="jflash_fwd",
        )
    )(*args)
    return o[:, :t, :, :h], lse[:, :, :t]
