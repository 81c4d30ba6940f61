"""Ring attention, per shard: exact attention over a sequence sharded across a mesh axis.

The bodies of the `ring` and `allgather` strategies of `jflash.ring_attention_shard`
(`_context`), run inside a `shard_map`. One custom VJP on the per-shard computation
reuses the per-shard `o` and `lse` (the distributed forward is never recomputed):

* ring: every device keeps its queries and visits every K/V shard once (P steps). At
  each step it runs the single-device kernel (`_dispatch.attention_fwd`) on its
  queries against one K/V shard and merges the partial `(o, lse)` in f32 (logaddexp
  of the LSEs). Backward: dQ accumulates locally (whole-block steps of the fused
  Mosaic backward add into one f32 accumulator in their kernels), dK/dV travel around
  the ring with K/V and are home after P steps. Memory per device is one shard's worth.
* allgather: K/V of the whole sequence are gathered once (small with GQA), and each
  contiguous run of local queries (two in zigzag) is one kernel call against all of
  it, with its global position as the causal offset: softmax rows are complete (no
  merges) and the kernel's loops as long as on one device. dK/dV of the whole
  sequence are summed in f32 over devices and scattered to their owners. The offsets
  are static kernel arguments, so each rank has its own `lax.switch` branch.

The ring's causal blocks:

  zigzag (rank r holds chunks r and 2P-1-r; source s holds chunks s and 2P-1-s)
    s == r  plain causal mask on the local block (the local position map is
            monotone, so local causality is global causality)
    s <  r  all local queries vs the FIRST half of the source (chunk s precedes both
            local chunks; chunk 2P-1-s follows both), no mask
    s >  r  the SECOND local half vs the whole source (chunk r precedes both source
            chunks; chunk 2P-1-r follows both), no mask
  striped (rank r holds tokens r, r+P, ...: local index i is global i*P + r)
    s <= r  key j is visible to query i iff j <= i: the plain causal mask
    s >  r  iff j < i: the causal mask shifted by one key (`Mask(k_offset=1)`)
  contiguous: s < r full, s == r causal, s > r nothing (computed and dropped: the
  step time is set by the last rank, which sees every source).

So in zigzag and striped every off-diagonal step costs half a block on every device:
balanced. Striped stays balanced with packed documents, zigzag does not (`_layout`).
Packed documents: the keys' segment ids travel with the keys, and the kernels skip
the tiles whose documents cannot meet.

The rank is traced inside shard_map, so the choice is made with traced slice offsets
rather than `lax.cond` (see `_fwd_step`; a `lax.cond` form with one kernel call per
step measured no faster on 2 and 4 H200s and hid less of the transfers). Steps are
unrolled in Python (P is static): XLA then sees every transfer next to the kernel it
can overlap with.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jflash._block_sizes import BlockSizes
from jflash._dispatch import (
    Kernel,
    attention_bwd,
    attention_fwd,
    delta_from,
    dq_accumulated,
    dq_accumulator,
    resolve,
)
from jflash._layout import check_layout, check_layout_len, unzigzag, zigzag
from jflash._mask import Mask
from jflash._validation import (
    check_array,
    check_causal,
    check_qkv,
    check_segment_ids,
    default_scale,
    is_int,
)
from jflash._vma import vary, varying_axes

RING_STRATEGIES = ("ring", "allgather")


@dataclasses.dataclass(frozen=True)
class _Ring:
    """Everything static about one ring attention call (hashable: a custom_vjp arg)."""

    axis: str | tuple[str, ...]
    num_shards: int
    causal: bool
    layout: str
    strategy: str
    scale: float
    kernel: Kernel


# ---------------------------------------------------------------------------------
# Forward, per shard


def _merge(o, lse, o_blk, lse_blk):
    """Merges two partial results in f32: o `[B,T,N,H]`, lse `[B,N,T]`.

    Rows that saw nothing in both have lse -inf; their weights use a finite stand-in
    so they come out as o = 0, lse = -inf instead of NaN.
    """
    new = jnp.logaddexp(lse, lse_blk)
    safe = jnp.where(jnp.isneginf(new), 0.0, new)

    def weight(x):  # [B,N,T] -> [B,T,N,1]
        return jnp.swapaxes(jnp.exp(x - safe), 1, 2)[..., None]

    return o * weight(lse) + o_blk * weight(lse_blk), new


def _segs(q_seg, kv_seg):
    """The kernels' `segs` argument: None, or the `(q ids, kv ids)` pair."""
    return None if q_seg is None else (q_seg, kv_seg)


def _rows(x, start, size: int, axis: int):
    """`x[start : start + size]` along `axis` (`start` may be traced); None stays None."""
    if x is None:
        return None
    if isinstance(start, int):
        return lax.slice_in_dim(x, start, start + size, axis=axis)
    return lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _attend(q, kv, segs, mask: bool | Mask, cfg: _Ring):
    """One kernel call: q `[B,T',N,H]` vs kv `[2,B,S',K,H]` -> f32 `(o, lse)`; `mask`
    a `Mask`, or a bool: causal or not, no offsets."""
    return attention_fwd(
        q,
        kv[0],
        kv[1],
        segs,
        mask=mask if isinstance(mask, Mask) else Mask(mask),
        scale=cfg.scale,
        out_dtype=jnp.float32,
        kernel=cfg.kernel,
    )


def _merge_at(o, lse, start, o_blk, lse_blk):
    """`_merge` into rows `start : start + T''` of `(o, lse)`; `start` may be traced."""
    rows = o_blk.shape[1]
    o_old = lax.dynamic_slice_in_dim(o, start, rows, axis=1)
    lse_old = lax.dynamic_slice_in_dim(lse, start, rows, axis=2)
    o_new, lse_new = _merge(o_old, lse_old, o_blk, lse_blk)
    return (
        lax.dynamic_update_slice_in_dim(o, o_new, start, axis=1),
        lax.dynamic_update_slice_in_dim(lse, lse_new, start, axis=2),
    )


def _by_case(before, if_before, if_after):
    """`if_before()` or `if_after()`: a `lax.cond` where `before` is traced (the rank
    inside a ring), the branch itself where it is a Python bool (`ring_attention_rank`
    with an int rank)."""
    if isinstance(before, bool):
        return if_before() if before else if_after()
    return lax.cond(before, if_before, if_after)


def _fwd_step(step: int, rank, q, kv, q_seg, kv_seg, o, lse, cfg: _Ring):
    """Folds source `(rank - step) % P` (held in `kv`, its ids in `kv_seg`) into the
    running `(o, lse)`.

    The rank is traced, so which half of the block is seen is chosen by data (a
    traced slice offset), not by control flow: every rank runs the same kernels, and
    no conditional sits between a transfer and the kernel it should overlap.
    """
    if step == 0:  # the diagonal block, for every rank: same work everywhere
        return _attend(q, kv, _segs(q_seg, kv_seg), cfg.causal, cfg)
    if not cfg.causal:
        return _merge(o, lse, *_attend(q, kv, _segs(q_seg, kv_seg), False, cfg))
    # For 1 <= step < P the source precedes this rank iff step <= rank.
    before = step <= rank
    if cfg.layout == "striped":
        # One kernel call either way (every rank the same work); which mask by data.
        segs = _segs(q_seg, kv_seg)
        return _merge(
            o,
            lse,
            *_by_case(
                before,
                lambda: _attend(q, kv, segs, Mask(True), cfg),
                lambda: _attend(q, kv, segs, Mask(True, k_offset=1), cfg),
            ),
        )
    if cfg.layout == "zigzag":
        # With halves of c rows, early sources (s < r) are seen as q[:] x kv[:c] and
        # late ones (s > r) as q[c:] x kv[:]. Both contain q[c:] x kv[:c]; the rest
        # is q[h:h+c] x kv[h:h+c] with h = 0 (early) or c (late).
        c = q.shape[1] // 2
        segs = _segs(_rows(q_seg, c, c, 1), _rows(kv_seg, 0, c, 1))
        o, lse = _merge_at(o, lse, c, *_attend(q[:, c:], kv[:, :, :c], segs, False, cfg))
        h = jnp.where(before, 0, c)
        segs = _segs(_rows(q_seg, h, c, 1), _rows(kv_seg, h, c, 1))
        return _merge_at(
            o, lse, h, *_attend(_rows(q, h, c, 1), _rows(kv, h, c, 2), segs, False, cfg)
        )
    # Contiguous: a later source is hidden. Its block is computed and dropped (lse
    # -inf): the step time is the last rank's, which sees every source anyway.
    o_blk, lse_blk = _attend(q, kv, _segs(q_seg, kv_seg), False, cfg)
    return _merge(o, lse, o_blk, jnp.where(before, lse_blk, -jnp.inf))


def _mesh_ordered(axis):
    """`(axes, index)`: the ring's axes in the mesh's order, as `lax.ppermute` takes
    them, and `index[r]`, the position there of rank r (ranks count over `axis` in
    its own order, major first, as `lax.axis_index` and `lax.all_gather` do)."""
    names = (axis,) if isinstance(axis, str) else tuple(axis)
    sizes = [lax.axis_size(n) for n in names]
    mesh_names = jax.sharding.get_abstract_mesh().axis_names
    if not set(names) <= set(mesh_names):  # axes not of a mesh (vmap's, say): as named
        return axis, np.arange(math.prod(sizes))
    ordered = tuple(sorted(names, key=mesh_names.index))
    ranks = np.arange(math.prod(sizes)).reshape(sizes)
    index = np.empty(ranks.size, int)
    mesh_major = np.transpose(ranks, [names.index(n) for n in ordered]).reshape(-1)
    index[mesh_major] = np.arange(ranks.size)
    return (ordered[0] if len(ordered) == 1 else ordered), index


def _shift(x, cfg: _Ring):
    """Sends `x` to the next rank on the ring (rank r receives from r-1)."""
    if x is None:
        return None
    p = cfg.num_shards
    if isinstance(cfg.axis, str):
        return lax.ppermute(x, cfg.axis, [(j, (j + 1) % p) for j in range(p)])
    # A tuple of axes: jax's ppermute takes them in the mesh's order (and refuses
    # another), so the pairs name each rank's position in that order.
    axes, at = _mesh_ordered(cfg.axis)
    return lax.ppermute(x, axes, [(int(at[j]), int(at[(j + 1) % p])) for j in range(p)])


def _ring_fwd_shard(q, k, v, q_seg, kv_seg, cfg: _Ring):
    """Per-shard forward, ring strategy: `(o [B,T',N,H] q.dtype, lse [B,N,T'] f32)`."""
    p = cfg.num_shards
    rank = lax.axis_index(cfg.axis)
    kv = jnp.stack([k, v])  # [2,B,S',K,H]: one transfer per step, at KV-head size
    o = lse = None
    for step in range(p):
        # Issued before this step's kernel and not consumed by it: the transfer of the
        # next block overlaps this block's compute. Key ids travel with their keys.
        nxt = (_shift(kv, cfg), _shift(kv_seg, cfg)) if step < p - 1 else (None, None)
        o, lse = _fwd_step(step, rank, q, kv, q_seg, kv_seg, o, lse, cfg)
        kv, kv_seg = nxt
    return o.astype(q.dtype), lse


# ---------------------------------------------------------------------------------
# Backward, per shard


def _grads(q, kv, do, lse, delta, segs, mask: bool | Mask, cfg: _Ring, acc=None):
    """One kernel call: `(dq [B,T',N,H], dkv [2,B,S',K,H])`, both f32; `mask` as in
    `_attend`. With `acc` (`dq_accumulator`), dQ is added into it and returned as None."""
    dq, dk, dv = attention_bwd(
        q,
        kv[0],
        kv[1],
        do,
        lse,
        delta,
        segs,
        mask=mask if isinstance(mask, Mask) else Mask(mask),
        scale=cfg.scale,
        grad_dtype=jnp.float32,
        kernel=cfg.kernel,
        dq_into=acc,
    )
    return dq, jnp.stack([dk, dv])


def _add(dq, dq_blk):
    """`dq + dq_blk`; None (the block's dQ went into the shared accumulator) adds nothing."""
    return dq if dq_blk is None else dq + dq_blk


def _bwd_step(step: int, rank, q, kv, q_seg, kv_seg, do, lse, delta, dq, cfg: _Ring, acc=None):
    """Adds this step's dQ into `dq` (or, for whole blocks, into the shared accumulator
    `acc` where the kernel can: `dq_accumulator`); returns it and the f32 dK/dV of the
    source.

    Same blocks as `_fwd_step`. Only local values go in (never the dK/dV arriving
    from the neighbour), so the kernels do not wait for that transfer.
    """
    if step == 0 or not cfg.causal:
        segs = _segs(q_seg, kv_seg)
        dq_blk, dkv = _grads(q, kv, do, lse, delta, segs, cfg.causal and step == 0, cfg, acc)
        return _add(dq, dq_blk), dkv
    before = step <= rank
    if cfg.layout == "striped":
        segs = _segs(q_seg, kv_seg)
        dq_blk, dkv = _by_case(
            before,
            lambda: _grads(q, kv, do, lse, delta, segs, Mask(True), cfg, acc),
            lambda: _grads(q, kv, do, lse, delta, segs, Mask(True, k_offset=1), cfg, acc),
        )
        return _add(dq, dq_blk), dkv
    if cfg.layout == "zigzag":
        c = q.shape[1] // 2
        segs = _segs(_rows(q_seg, c, c, 1), _rows(kv_seg, 0, c, 1))
        dq_blk, dkv_blk = _grads(
            q[:, c:], kv[:, :, :c], do[:, c:], lse[..., c:], delta[..., c:], segs, False, cfg
        )
        dq = dq.at[:, c:].add(dq_blk)
        dkv = jnp.concatenate([dkv_blk, jnp.zeros_like(dkv_blk)], axis=2)
        h = jnp.where(before, 0, c)
        segs = _segs(_rows(q_seg, h, c, 1), _rows(kv_seg, h, c, 1))
        dq_blk, dkv_blk = _grads(
            _rows(q, h, c, 1),
            _rows(kv, h, c, 2),
            _rows(do, h, c, 1),
            _rows(lse, h, c, 2),
            _rows(delta, h, c, 2),
            segs,
            False,
            cfg,
        )
        dq = lax.dynamic_update_slice_in_dim(dq, _rows(dq, h, c, 1) + dq_blk, h, axis=1)
        dkv = lax.dynamic_update_slice_in_dim(dkv, _rows(dkv, h, c, 2) + dkv_blk, h, axis=2)
        return dq, dkv
    # Contiguous: a later source's block is computed and dropped, as in the forward.
    dq_blk, dkv = _grads(q, kv, do, lse, delta, _segs(q_seg, kv_seg), False, cfg)
    # `where`, not a 0/1 product: exp(s - lse) of hidden keys may overflow to inf.
    return dq + jnp.where(before, dq_blk, 0.0), jnp.where(before, dkv, 0.0)


def _ring_bwd_shard(q, k, v, q_seg, kv_seg, o, lse, do, dlse, cfg: _Ring):
    """Per-shard backward: `(dq, dk, dv)` in the dtypes of q, k, v."""
    p = cfg.num_shards
    rank = lax.axis_index(cfg.axis)
    delta = delta_from(o, do, dlse)  # once, from the global o: [B,N,T'] f32
    do = do.astype(q.dtype)
    kv = jnp.stack([k, v])
    dq = jnp.zeros(q.shape, jnp.float32)
    acc = dq_accumulator(q, cfg.kernel)  # whole blocks' dQ, added in their kernels
    # Steps 1 .. P-1 first, the diagonal step 0 last: the last hop of the dK/dV sums
    # (f32) then flies during step 0's kernels instead of after all of them, and what
    # waits at the start is the first K/V transfer (half the bytes, and it depends
    # only on the forward's K/V, so in a model XLA can issue it during earlier work).
    # A shard's own dK/dV (step 0) stays home: P - 1 hops of f32 per call, not P. At
    # step i >= 1 rank r holds source (r - i) % P and the running sum of its
    # contributions from ranks r - i + 1 .. r - 1 (received from r - 1, which held it
    # at step i - 1). After step P - 1 the sum belongs to rank r + 1: the last shift
    # delivers it home.
    arriving = None
    visiting, visiting_seg = (_shift(kv, cfg), _shift(kv_seg, cfg)) if p > 1 else (None, None)
    for step in range(1, p):
        nxt = (_shift(visiting, cfg), _shift(visiting_seg, cfg)) if step < p - 1 else (None, None)
        dq, dkv = _bwd_step(
            step, rank, q, visiting, q_seg, visiting_seg, do, lse, delta, dq, cfg, acc
        )
        arriving = _shift(dkv if arriving is None else arriving + dkv, cfg)
        visiting, visiting_seg = nxt
    dq, own = _bwd_step(0, rank, q, kv, q_seg, kv_seg, do, lse, delta, dq, cfg, acc)
    dkv = own if arriving is None else own + arriving
    if acc is not None:
        dq = dq + dq_accumulated(acc, q, cfg.scale)
    return dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype)


# ---------------------------------------------------------------------------------
# The allgather strategy: K/V gathered once, one kernel call per query chunk


def _query_chunks(rank: int, shard_len: int, cfg: _Ring) -> list[tuple[int, int, int, int]]:
    """`(start, length, global position, keys seen)` of each contiguous run of this
    rank's queries: causal runs see the key prefix up to their last position, so the
    kernels get only that prefix (no key tiles without work, no dK/dV rows of zeros).
    Non-causal: one run that sees every key."""
    p = cfg.num_shards
    if not cfg.causal:
        return [(0, shard_len, 0, p * shard_len)]
    if cfg.layout == "zigzag":
        c = shard_len // 2
        return [
            (a, c, chunk * c, (chunk + 1) * c) for a, chunk in ((0, rank), (c, 2 * p - 1 - rank))
        ]
    return [(0, shard_len, rank * shard_len, (rank + 1) * shard_len)]


def _by_rank(body, cfg: _Ring, *args):
    """`body(r, *args)` for this device's rank r. Query positions are static kernel
    offsets, so each rank has its own branch (`lax.switch`: every device runs one);
    non-causal attention does not depend on them."""
    if not cfg.causal or cfg.num_shards == 1:
        return body(0, *args)
    branches = [functools.partial(body, r) for r in range(cfg.num_shards)]
    return lax.switch(lax.axis_index(cfg.axis), branches, *args)


def _gathered(x, axis: int, cfg: _Ring):
    """Every shard's `x`, concatenated along `axis` in natural order: one all-gather."""
    if x is None:
        return None
    x = lax.all_gather(x, cfg.axis, axis=axis, tiled=True)
    if cfg.layout == "zigzag" and cfg.num_shards > 1:
        x = unzigzag(x, cfg.num_shards, axis=axis)
    return x


def _chunk_mask(offset: int, cfg: _Ring) -> Mask:
    return Mask(cfg.causal, q_offset=offset, k_offset=0)


def _gather_fwd_shard(q, k, v, q_seg, kv_seg, cfg: _Ring):
    """Per-shard forward, allgather strategy: each query run against the whole
    sequence in one kernel call, so every row's softmax is complete (no merges) and
    the kernel's key loops are as long as on one device."""

    def body(rank, q, kv, q_seg, kv_seg):
        parts = [
            attention_fwd(
                q[:, a : a + n],
                kv[0, :, :seen],
                kv[1, :, :seen],
                _segs(_rows(q_seg, a, n, 1), _rows(kv_seg, 0, seen, 1)),
                mask=_chunk_mask(offset, cfg),
                scale=cfg.scale,
                out_dtype=q.dtype,
                kernel=cfg.kernel,
            )
            for a, n, offset, seen in _query_chunks(rank, q.shape[1], cfg)
        ]
        return (
            jnp.concatenate([o for o, _ in parts], axis=1),
            jnp.concatenate([lse for _, lse in parts], axis=2),
        )

    kv = _gathered(jnp.stack([k, v]), 2, cfg)  # [2,B,S,K,H], at KV-head size
    return _by_rank(body, cfg, q, kv, q_seg, _gathered(kv_seg, 1, cfg))


def _gather_bwd_shard(q, k, v, q_seg, kv_seg, o, lse, do, dlse, cfg: _Ring):
    """Per-shard backward, allgather strategy: dQ is complete per query run; the
    whole sequence's dK/dV (f32) is summed over devices and scattered to its owners."""
    delta = delta_from(o, do, dlse)
    do = do.astype(q.dtype)

    def body(rank, q, kv, q_seg, kv_seg, do, lse, delta):
        dqs, dkvs = [], []
        for a, n, offset, seen in _query_chunks(rank, q.shape[1], cfg):
            dq, dk, dv = attention_bwd(
                q[:, a : a + n],
                kv[0, :, :seen],
                kv[1, :, :seen],
                do[:, a : a + n],
                lse[..., a : a + n],
                delta[..., a : a + n],
                _segs(_rows(q_seg, a, n, 1), _rows(kv_seg, 0, seen, 1)),
                mask=_chunk_mask(offset, cfg),
                scale=cfg.scale,
                grad_dtype=jnp.float32,
                kernel=cfg.kernel,
            )
            dqs.append(dq.astype(q.dtype))
            # Padded and summed, not `.at[:, :, :seen].add` into zeros: that form inside
            # the per-rank `lax.switch` crashes XLA:CPU (segfault, jax 0.11.2).
            pad = [(0, 0)] * 2 + [(0, kv.shape[2] - seen)] + [(0, 0)] * 2
            dkvs.append(jnp.pad(jnp.stack([dk, dv]), pad))
        return jnp.concatenate(dqs, axis=1), sum(dkvs[1:], dkvs[0])

    kv = _gathered(jnp.stack([k, v]), 2, cfg)
    args = (q, kv, q_seg, _gathered(kv_seg, 1, cfg), do, lse, delta)
    dq, dkv = _by_rank(body, cfg, *args)
    if cfg.num_shards > 1:
        if cfg.layout == "zigzag":
            dkv = zigzag(dkv, cfg.num_shards, axis=2)
        # Rank r receives the sum over devices of its own shard's rows.
        dkv = lax.psum_scatter(dkv, cfg.axis, scatter_dimension=2, tiled=True)
    return dq, dkv[0].astype(k.dtype), dkv[1].astype(v.dtype)


_SHARD_BODIES = {
    "ring": (_ring_fwd_shard, _ring_bwd_shard),
    "allgather": (_gather_fwd_shard, _gather_bwd_shard),
}


# The custom VJP sits on the per-shard computation, so it composes with the caller's
# shard_map, jit, checkpoint, scan and vmap. Its residuals are the per-shard o and
# lse: a remat policy that saves the names below keeps them, and the distributed
# forward is never recomputed in the backward pass.
@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _ring_shard(q, k, v, q_seg, kv_seg, cfg: _Ring):
    return _SHARD_BODIES[cfg.strategy][0](q, k, v, q_seg, kv_seg, cfg)


def _ring_shard_fwd(q, k, v, q_seg, kv_seg, cfg: _Ring):
    o, lse = _ring_shard(q, k, v, q_seg, kv_seg, cfg)
    o, lse = checkpoint_name(o, "attention_out"), checkpoint_name(lse, "attention_lse")
    return (o, lse), (q, k, v, q_seg, kv_seg, o, lse)


def _ring_shard_bwd(cfg: _Ring, res, cotangents):
    q, k, v, q_seg, kv_seg, o, lse = res
    do, dlse = cotangents
    # Inside a check_vma shard_map, residuals a remat policy sent to host memory come
    # back without their manual-axis types (jax 0.11.2); the cotangent `do` still has
    # them (those of the output, i.e. of q, k and v), so every residual and gradient
    # takes its axes: the kernels build their output types from their operands.
    axes = varying_axes(q, k, v, do)
    q, k, v, o, lse = (vary(x, axes) for x in (q, k, v, o, lse))
    dq, dk, dv = _SHARD_BODIES[cfg.strategy][1](q, k, v, q_seg, kv_seg, o, lse, do, dlse, cfg)
    return vary(dq, axes), vary(dk, axes), vary(dv, axes), None, None


_ring_shard.defvjp(_ring_shard_fwd, _ring_shard_bwd)


def ring_config(
    axis: str | tuple[str, ...],
    num_shards: int,
    seq_len: int,
    *,
    causal: bool,
    layout: str,
    strategy: str,
    head_dim: int,
    dtype,
    scale: float | None = None,
    implementation: str | None = None,
    interpret: bool | None = None,
    block_sizes: BlockSizes | None = None,
    deterministic: bool | None = None,
    group: int | None = None,
) -> _Ring:
    """The static config of a ring over `num_shards` shards of a `seq_len` sequence
    (inputs checked by the caller), with the kernel resolved for the blocks it runs.
    `group`: query heads per KV head of its kernels' calls (`resolve`)."""
    shard_len = seq_len // num_shards
    # Zigzag causal steps use half blocks; tiles sized for them fit the diagonal too.
    # The allgather strategy runs each query run against the whole sequence.
    q_block = shard_len // 2 if layout == "zigzag" and causal else shard_len
    kv_block = seq_len if strategy == "allgather" else q_block
    return _Ring(
        axis=axis,
        num_shards=num_shards,
        causal=causal,
        layout=layout,
        strategy=strategy,
        scale=default_scale(head_dim, scale),
        kernel=resolve(
            implementation,
            interpret,
            block_sizes,
            q_len=q_block,
            kv_len=kv_block,
            head_dim=head_dim,
            dtype=dtype,
            deterministic=deterministic,
            group=group,
        ),
    )


# ---------------------------------------------------------------------------------
# One rank of the ring, on one device


def _check_rank(rank, p: int):
    """`rank` as a Python int in `[0, p)`, or a traced int32 scalar (checked for its
    type here; out of range, the caller makes its results NaN); anything else (a float,
    a bool, a vector) is refused by name."""
    if is_int(rank):
        if not 0 <= rank < p:
            raise ValueError(f"{rank=} must be in [0, {p}) for {p} sources")
        return int(rank)
    if isinstance(rank, jax.Array) and rank.shape == () and jnp.issubdtype(rank.dtype, jnp.integer):
        if not isinstance(rank, jax.core.Tracer) and not 0 <= int(rank) < p:
            raise ValueError(f"{rank=} must be in [0, {p}) for {p} sources")
        return rank.astype(jnp.int32)
    raise ValueError(f"{rank=} must be an int in [0, {p}) or a traced int scalar")


def ring_attention_rank(
    q: jax.Array,
    sources,
    do: jax.Array,
    rank,
    *,
    causal: bool,
    layout: str,
    scale: float | None = None,
    implementation: str | None = None,
    interpret: bool | None = None,
    block_sizes: BlockSizes | None = None,
    deterministic: bool | None = None,
    segment_ids=None,
):
    """What rank `rank` of the `ring` strategy computes, on one device, without transfers.

    The same steps as `ring_attention(..., strategy="ring")` over `P = len(sources)`
    shards (kernel calls on the ring's blocks, f32 partial results, merges and sums),
    with step `s`'s K/V given instead of received, so one rank's compute can be timed
    on one device (`benchmarks/ring_blocks.py`).

    Args:
      q, do: the rank's queries and output cotangent `[B, T', N, H]` (its shard, in
        `layout` order).
      sources: `P` pairs `(k, v)` `[B, T', K, H]`: at step `s` the shard of rank
        `(rank - s) % P`.
      rank: an int in `[0, P)`, or a traced int scalar (as inside the ring); others
        (a float, a bool, an array of ranks) are refused by name. A traced rank outside
        `[0, P)` makes o, lse and dq NaN, and each step's dkv where the rank attends.
      causal, layout, scale, implementation, interpret, block_sizes, deterministic: as
        in `ring_attention`.
      segment_ids: None, or `(q_ids, kv_ids)` for packed documents: the rank's query
        ids `[B, T']` and a list of `P` key ids `[B, T']`, one per source (what travels
        with its K/V), in `layout` order like q.

    Returns:
      `(o, lse, dq, dkv)`: the rank's output (q's dtype) and LSE `[B, N, T']` f32, its
      f32 dQ, and per step the f32 `(dk, dv)` of that step's source (what travels back
      to its owner).
    """
    causal = check_causal(causal)
    check_layout(layout)
    sources = list(sources)
    if not sources:
        raise ValueError("sources must hold at least one (k, v) pair (one per ring step)")
    for s, source in enumerate(sources):
        if not (isinstance(source, (tuple, list)) and len(source) == 2):
            got = type(source).__name__ + (
                f" of {len(source)}" if isinstance(source, (tuple, list)) else ""
            )
            raise ValueError(f"sources[{s}] must be a (k, v) pair; got {got}")
    shapes = [check_qkv(q, k, v) for k, v in sources]
    check_array("do", do)
    if any(s.kv_len != shapes[0].q_len for s in shapes) or do.shape != q.shape:
        raise ValueError(
            f"every source's k and v, and do, must be as long as q ({q.shape[1]=}) with "
            f"do of q's shape; got {[k.shape for k, _ in sources]}, {do.shape=}"
        )
    if do.dtype != q.dtype:
        raise ValueError(f"do.dtype={do.dtype} must be q's ({q.dtype}), as o's cotangent")
    p = len(sources)
    check_layout_len(p * q.shape[1], p, layout, local_len=q.shape[1])
    rank = _check_rank(rank, p)
    q_seg, kv_segs = None, [None] * p
    if segment_ids is not None:
        if not (isinstance(segment_ids, (tuple, list)) and len(segment_ids) == 2):
            raise ValueError(
                "segment_ids must be a (q ids, [kv ids per source]) pair for ring_attention_rank"
            )
        q_ids, kv_ids = segment_ids
        if not isinstance(kv_ids, (tuple, list)) or len(kv_ids) != p:
            raise ValueError(
                f"segment_ids' kv ids must be a list of one [B, T'] array per source ({p}); "
                f"got {type(kv_ids).__name__}"
                + (f" of {len(kv_ids)}" if isinstance(kv_ids, (tuple, list)) else "")
            )
        pairs = [check_segment_ids((q_ids, ids), shapes[0]) for ids in kv_ids]
        q_seg, kv_segs = pairs[0][0], [pair[1] for pair in pairs]
    cfg = ring_config(
        "rank",
        p,
        p * q.shape[1],
        causal=causal,
        layout=layout,
        strategy="ring",
        head_dim=q.shape[-1],
        dtype=q.dtype,
        scale=scale,
        implementation=implementation,
        interpret=interpret,
        block_sizes=block_sizes,
        deterministic=deterministic,
        group=shapes[0].group,
    )
    kvs = [jnp.stack([k, v]) for k, v in sources]
    o = lse = None
    for step in range(p):
        o, lse = _fwd_step(step, rank, q, kvs[step], q_seg, kv_segs[step], o, lse, cfg)
    if isinstance(rank, jax.core.Tracer):
        # A traced rank cannot be refused while tracing: one outside [0, P) makes o, the
        # LSE and dQ NaN, and through the LSE every dK/dV block the rank attends, instead
        # of another rank's results.
        bad = (rank < 0) | (rank >= p)
        o = jnp.where(bad, jnp.nan, o)
        lse = jnp.where(bad, jnp.nan, lse)
    o = o.astype(q.dtype)
    delta = delta_from(o, do)
    do = do.astype(q.dtype)
    dq = jnp.zeros(q.shape, jnp.float32)
    acc = dq_accumulator(q, cfg.kernel)
    dkv = [None] * p
    for step in (*range(1, p), 0):  # the ring's order: the diagonal step last
        dq, dkv[step] = _bwd_step(
            step, rank, q, kvs[step], q_seg, kv_segs[step], do, lse, delta, dq, cfg, acc
        )
    if acc is not None:
        dq = dq + dq_accumulated(acc, q, cfg.scale)
    return o, lse, dq, [(d[0], d[1]) for d in dkv]
