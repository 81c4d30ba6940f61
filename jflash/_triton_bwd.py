"""FlashAttention-2 backward as two Pallas kernels lowered through Triton.

`jflash_bwd_dkv`: grid (key blocks) x (batch * KV heads) in `Launch` order; each program
owns one K/V tile and loops over every query head of its group and the query blocks that
can see it, accumulating dK and dV in f32 registers (GQA without atomics or repeated K/V).
`jflash_bwd_dq`: grid (query blocks) x (batch * query heads), likewise; loops over visible
key blocks. Both recompute probabilities from the saved LSE (FA-2 §3.2);
`delta = rowsum(dO * O)` minus the LSE cotangent is precomputed by the caller.
With segment ids both loops visit only the tiles that share an id with the program's
tile (`jflash._segments`), comparing ids only on tiles at a document boundary.
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
from jflash._segments import kv_tile_range, q_tile_range
from jflash._triton_common import (
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
    visible_q_range,
)


def _flash_bwd_dkv_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    qseg_ref,
    kseg_ref,
    first_ref,
    end_ref,
    same_first_ref,
    same_end_ref,
    dk_ref,
    dv_ref,
    *,
    scale,
    mask: Mask,
    q_len,
    block_q,
    block_kv,
    group,
    tile_axis,
):
    j = pl.program_id(tile_axis)
    k_start = pl.multiple_of(j * block_kv, block_kv)
    k = k_ref[...]  # [block_kv, H]
    v = v_ref[...]
    qk_scale = scale * LOG2E
    k_pos = mask.k_offset + k_start + lax.broadcasted_iota(jnp.int32, (block_kv, block_q), 0)
    k_seg = None if kseg_ref is None else kseg_ref[...]
    # Masked query blocks `[n_begin, n_full_from)`, unmasked ones `[n_full_from, num_q)`,
    # each cut to the query tiles that share a segment id with this key tile.
    n_begin, n_full_from, num_q = visible_q_range(mask, k_start, block_kv, block_q, q_len)
    tiles = read_tiles(first_ref, end_ref, same_first_ref, same_end_ref)
    steps = [
        (masked, *run)
        for masked, lo, hi in ((True, n_begin, n_full_from), (False, n_full_from, num_q))
        for run in runs(lo, hi, tiles, split=not masked)
    ]

    def body(i, carry, *, g, masked, segmented):
        dk, dv = carry
        q_start = pl.multiple_of(i * block_q, block_q)
        rows = pl.ds(q_start, block_q)
        q = q_ref[rows, g, :]  # [block_q, H]
        do = do_ref[rows, g, :]
        lse = lse_ref[g, rows]  # [block_q] f32, natural log, +inf on empty rows
        delta = delta_ref[g, rows]
        s_t = dot(k, q, trans_b=True) * qk_scale
        p_t = jnp.exp2(s_t - (lse * LOG2E)[None, :])  # [block_kv, block_q] f32
        visible = None
        if masked:
            q_idx = (
                mask.q_offset + q_start + lax.broadcasted_iota(jnp.int32, (block_kv, block_q), 1)
            )
            visible = q_idx >= k_pos
        if segmented:
            seg = k_seg[:, None] == qseg_ref[rows][None, :]
            visible = seg if visible is None else visible & seg
        if visible is not None:
            p_t = jnp.where(visible, p_t, jnp.float32(0.0))
        dv = dv + dot(p_t.astype(do.dtype), do)
        dp_t = dot(v, do, trans_b=True)
        ds_t = p_t * (dp_t - delta[None, :])  # [block_kv, block_q] f32
        dk = dk + dot(ds_t.astype(q.dtype), q)
        return dk, dv

    def head(g, carry):
        for masked, start, stop, segmented in steps:
            step = functools.partial(body, g=g, masked=masked, segmented=segmented)
            carry = lax.fori_loop(start, stop, step, carry)
        return carry

    zeros = jnp.zeros((block_kv, k.shape[-1]), jnp.float32)
    dk, dv = lax.fori_loop(index(0), index(group), head, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _flash_bwd_dq_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    qseg_ref,
    kseg_ref,
    first_ref,
    end_ref,
    same_first_ref,
    same_end_ref,
    dq_ref,
    *,
    scale,
    mask: Mask,
    kv_len,
    block_q,
    block_kv,
    tile_axis,
):
    i = pl.num_programs(tile_axis) - 1 - pl.program_id(tile_axis)
    q_start = pl.multiple_of(i * block_q, block_q)
    q = q_ref[...]  # [block_q, H]
    do = do_ref[...]
    lse2 = lse_ref[...] * LOG2E  # [block_q]
    delta = delta_ref[...]
    qk_scale = scale * LOG2E
    q_pos = mask.q_offset + q_start + lax.broadcasted_iota(jnp.int32, (block_q, block_kv), 0)
    q_seg = None if qseg_ref is None else qseg_ref[...]

    def body(j, dq, *, masked, segmented):
        k_start = pl.multiple_of(j * block_kv, block_kv)
        k = k_ref[pl.ds(k_start, block_kv), :]
        v = v_ref[pl.ds(k_start, block_kv), :]
        s = dot(q, k, trans_b=True) * qk_scale
        p = jnp.exp2(s - lse2[:, None])  # [block_q, block_kv] f32
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
            p = jnp.where(visible, p, jnp.float32(0.0))
        dp = dot(do, v, trans_b=True)
        ds = p * (dp - delta[:, None])
        return dq + dot(ds.astype(k.dtype), k)

    n_full, n_end = visible_kv_range(mask, q_start, block_q, block_kv, kv_len)
    tiles = read_tiles(first_ref, end_ref, same_first_ref, same_end_ref)
    dq = jnp.zeros((block_q, q.shape[-1]), jnp.float32)
    for masked, (lo, hi) in ((False, (index(0), n_full)), (True, (n_full, n_end))):
        for start, stop, segmented in runs(lo, hi, tiles, split=not masked):
            step = functools.partial(body, masked=masked, segmented=segmented)
            dq = lax.fori_loop(start, stop, step, dq)
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def flash_bwd(
    q,
    k,
    v,
    do,
    lse,
    delta,
    segs,
    *,
    mask: Mask,
    scale: float,
    grad_dtype,
    block_sizes: BlockSizes,
    interpret: bool,
):
    """Backward of the kernel contract: `(dq, dk, dv)` in `grad_dtype`.

    `lse` `[B,N,T]` is the saved (global) natural-log LSE, `delta` `[B,N,T]` is
    `rowsum(dO * O) - dLSE` in f32.
    """
    b, t, n, h = q.shape
    s_len, kh = k.shape[1], k.shape[2]
    group = n // kh
    hp = padded_head_dim(h)
    # Inside a user's shard_map, inputs and outputs must vary over the same mesh axes.
    q, k, v, do, lse, delta, *seg_ids = _vma.match(q, k, v, do, lse, delta, *(segs or ()))
    segs = tuple(seg_ids) or None
    lse = jnp.where(jnp.isneginf(lse), jnp.inf, lse)  # empty rows: p = 0
    params = plgpu.CompilerParams(
        num_warps=block_sizes.num_warps_bwd, num_stages=block_sizes.num_stages_bwd
    )

    # dK, dV: one program per (key block, batch, KV head).
    bq, bk = block_sizes.block_q_dkv, block_sizes.block_kv_dkv
    tp, sp = round_up(t, bq), round_up(s_len, bk)
    qp = pad_to(pad_to(q, 3, hp), 1, tp)
    dop = pad_to(pad_to(do, 3, hp), 1, tp)
    kp = pad_to(pad_to(k, 3, hp), 1, sp)
    vp = pad_to(pad_to(v, 3, hp), 1, sp)
    lsep, deltap = pad_to(lse, 2, tp), pad_to(delta, 2, tp)
    launch = Launch.of(sp // bk, kh, b, causal=mask.causal)
    at = launch.index_map
    group_spec = pl.BlockSpec((None, tp, group, hp), at(lambda bk_, j: (bk_ // kh, 0, bk_ % kh, 0)))
    tile_spec = pl.BlockSpec((None, bk, None, hp), at(lambda bk_, j: (bk_ // kh, j, bk_ % kh, 0)))
    row_spec = pl.BlockSpec((None, group, tp), at(lambda bk_, j: (bk_ // kh, bk_ % kh, 0)))
    in_specs = [group_spec, tile_spec, tile_spec, group_spec, row_spec, row_spec]
    args = [qp, kp, vp, dop, lsep, deltap]
    if segs is None:
        in_specs += [None] * 6
        args += [None] * 6
    else:
        at_kv_tile = at(lambda bk_, j: (bk_ // kh, j))
        in_specs += [
            pl.BlockSpec((None, tp), at(lambda bk_, j: (bk_ // kh, 0))),
            pl.BlockSpec((None, bk), at_kv_tile),
            *tile_range_specs(at_kv_tile),
        ]
        args += [pad_to(segs[0], 1, tp), pad_to(segs[1], 1, sp), *q_tile_range(*segs, bq, bk)]
    dk, dv = _vma.per_device(
        pl.pallas_call(
            functools.partial(
                _flash_bwd_dkv_kernel,
                scale=scale,
                mask=mask,
                q_len=t,
                block_q=bq,
                block_kv=bk,
                group=group,
                tile_axis=launch.tile_axis,
            ),
            grid=launch.grid,
            in_specs=in_specs,
            out_specs=[tile_spec, tile_spec],
            out_shape=[_vma.struct((b, sp, kh, hp), grad_dtype)] * 2,
            compiler_params=params,
            interpret=interpret,
            name="jflash_bwd_dkv",
        )
    )(*args)

    # dQ: one program per (query block, batch, query head).
    bq, bk = block_sizes.block_q_dq, block_sizes.block_kv_dq
    tp, sp = round_up(t, bq), round_up(s_len, bk)
    nq = tp // bq
    qp = pad_to(pad_to(q, 3, hp), 1, tp)
    dop = pad_to(pad_to(do, 3, hp), 1, tp)
    kp = pad_to(pad_to(k, 3, hp), 1, sp)
    vp = pad_to(pad_to(v, 3, hp), 1, sp)
    lsep, deltap = pad_to(lse, 2, tp), pad_to(delta, 2, tp)
    launch = Launch.of(nq, n, b, causal=mask.causal)
    at = launch.index_map
    q_spec = pl.BlockSpec((None, bq, None, hp), at(lambda bh, i: (bh // n, nq - 1 - i, bh % n, 0)))
    kv_spec = pl.BlockSpec(
        (None, sp, None, hp), at(lambda bh, i: (bh // n, 0, (bh % n) // group, 0))
    )
    row_spec = pl.BlockSpec((None, None, bq), at(lambda bh, i: (bh // n, bh % n, nq - 1 - i)))
    in_specs = [q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec]
    args = [qp, kp, vp, dop, lsep, deltap]
    if segs is None:
        in_specs += [None] * 6
        args += [None] * 6
    else:
        at_q_tile = at(lambda bh, i: (bh // n, nq - 1 - i))
        in_specs += [
            pl.BlockSpec((None, bq), at_q_tile),
            pl.BlockSpec((None, sp), at(lambda bh, i: (bh // n, 0))),
            *tile_range_specs(at_q_tile),
        ]
        args += [pad_to(segs[0], 1, tp), pad_to(segs[1], 1, sp), *kv_tile_range(*segs, bq, bk)]
    dq = _vma.per_device(
        pl.pallas_call(
            functools.partial(
                _flash_bwd_dq_kernel,
                scale=scale,
                mask=mask,
                kv_len=s_len,
                block_q=bq,
                block_kv=bk,
                tile_axis=launch.tile_axis,
            ),
            grid=launch.grid,
            in_specs=in_specs,
            out_specs=q_spec,
            out_shape=_vma.struct((b, tp, n, hp), grad_dtype),
            compiler_params=params,
            interpret=interpret,
            name="jflash_bwd_dq",
        )
    )(*args)
    return dq[:, :t, :, :h], dk[:, :s_len, :, :h], dv[:, :s_len, :, :h]
