"""Pieces shared by the Mosaic GPU (Hopper) kernels: geometry, step ranges, SMEM types.

Every Mosaic kernel here has the same shape: a CTA of three warpgroups, two that
compute (64 rows each: the native wgmma M) and one that streams tiles from HBM into
a ring of shared-memory slots with TMA. A slot is refilled when both compute
warpgroups have arrived on its "free" barrier, so each compute warpgroup visits every
step the memory warpgroup streams; steps outside its own visible range it only
acknowledges ("skip"), which keeps every barrier's phase in step across warpgroups.

With segment ids the streamed steps of a CTA are `[lo, hi)`, the union of its
warpgroups' own ranges: the causal bounds (`kv_range` / `q_range`) intersected with the
tiles whose ids may meet (`jflash._segments`). A warpgroup's own range splits into a
masked run, an unmasked run (tiles that hold one shared id and need no causal or
padding mask) and a masked run (`Steps`); the steps around it it only acknowledges.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jflash import _launch_order
from jflash._mask import Mask
from jflash._segments import kv_tile_range, q_tile_range
from jflash._triton_common import index, pad_to, visible_kv_range, visible_q_range
from jflash._vma import per_device

WG_ROWS = 64  # rows per compute warpgroup: the M of one wgmma
COMPUTE_WGS = 2
# Register split (setmaxnreg): 2 x 232 + 40 per thread x 128 threads = 64,512 of the
# SM's 65,536. Asking for more than the file holds makes the warpgroups wait forever.
COMPUTE_REGS = 232
MEMORY_REGS = 40
SWIZZLE_BYTES = 128

# Index arithmetic in these kernels is int32 and every constant is typed (`index`,
# `jnp.int32`, `jnp.float32`): under `jax_enable_x64` a bare Python int or float given to
# `jnp.where`, `jnp.clip` or a loop bound would be int64 / float64, and the kernel would
# trace differently from the one without x64 (tests/test_x64.py compares the two).


def rem(x, n):
    """`x % n` for non-negative int32 loop indices (`lax.rem` mixes no types)."""
    return lax.rem(index(x), jnp.int32(n))


def smem_tile(shape, dtype, swizzle: int = SWIZZLE_BYTES):
    """An SMEM scratch with the tiling + swizzle (128 bytes unless said) that TMA and
    wgmma want. A wgmma contracts over a B operand's rows `swizzle` bytes of elements
    at a time: a 64-byte swizzle lets a tile of 160 keys be the B of P V."""
    cols = swizzle // jnp.dtype(dtype).itemsize
    return plgpu.SMEM(
        shape,
        dtype,
        transforms=(plgpu.TilingTransform((8, cols)), plgpu.SwizzleTransform(swizzle)),
    )


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Static facts of one problem, in padded coordinates (block multiples)."""

    mask: Mask
    kv_len: int  # real key length (keys past it are masked)
    q_pad: int  # padded lengths
    kv_pad: int
    group: int  # query heads per KV head
    head_dim: int
    q_len: int  # real query length (rows past it are padding: no keys streamed for them)

    @property
    def diag(self) -> int:
        """Query row `i` sees key `j` (causal) when `i + diag >= j`."""
        return self.mask.q_offset - self.mask.k_offset


def kv_range(geom: Geometry, q_start, rows: int, block_kv: int):
    """Key steps of query rows `[q_start, q_start + rows)`: `(n_full, n_end)` int32.

    Steps `[0, n_full)` are fully visible (no mask), `[n_full, n_end)` need the mask,
    later steps are hidden (the Triton kernels' `visible_kv_range`).
    """
    n_full, n_end = visible_kv_range(geom.mask, q_start, rows, block_kv, geom.kv_len)
    return index(n_full), index(n_end)


def q_range(geom: Geometry, k_start, rows: int, block_q: int):
    """Query steps that see keys `[k_start, k_start + rows)`: `(n_begin, n_full, n_q)`.

    Steps `[n_begin, n_full)` need the mask, `[n_full, n_q)` are fully visible (the
    Triton kernels' `visible_q_range` over the padded queries). Key tiles reaching past
    the real length are masked everywhere, so their padded rows of dK/dV stay finite.
    """
    n_begin, n_full, n_q = visible_q_range(geom.mask, k_start, rows, block_q, geom.q_pad)
    n_full = jnp.where(k_start + rows <= geom.kv_len, n_full, n_q)
    return index(n_begin), index(n_full), index(n_q)


def visible(geom: Geometry, q_start, k_start, shape, *, transposed: bool = False):
    """Boolean tile in the WGMMA layout: row/col are queries/keys (keys/queries if
    `transposed`)."""
    q_dim, k_dim = (1, 0) if transposed else (0, 1)
    q_pos = q_start + plgpu.broadcasted_iota(jnp.int32, shape, q_dim, layout=plgpu.Layout.WGMMA)
    k_pos = k_start + plgpu.broadcasted_iota(jnp.int32, shape, k_dim, layout=plgpu.Layout.WGMMA)
    seen = k_pos < geom.kv_len
    if geom.mask.causal:
        seen = seen & (q_pos + geom.diag >= k_pos)
    return seen


def drain(free_barriers, num_steps, stages: int) -> None:
    """Interpret mode only: the memory warpgroup observes the last `stages` phases of
    its free barriers. The GPU interpreter checks that every thread saw every phase of
    a barrier it waits on; on hardware the warpgroup just exits (nothing is pending)."""

    @pl.loop(jnp.maximum(num_steps - stages, 0), num_steps)
    def _(j):
        for free in free_barriers:
            plgpu.barrier_wait(free.at[rem(j, stages)])


def one_warp_streams(q, head_dims, interpret: bool) -> bool:
    """Whether a kernel on `q` streams from one warp of its memory warpgroup
    (`plgpu.warp_map`): at `head_dims`, and compiled (the GPU interpreter has no warp
    semantics). Inside `shard_map` too: `launch` hands the kernel unvarying operands."""
    return q.shape[-1] in head_dims and not interpret


def stream_kv(
    srcs,
    slots,
    ready,
    free,
    *,
    batch,
    head,
    group: int,
    steps: Steps,
    block_kv: int,
    stages: int,
    ids=None,
    interpret: bool = False,
    regs: int | None = MEMORY_REGS,
    one_warp: bool = False,
    before=None,
):
    """The memory warpgroup of the forward and dQ kernels: K and V tiles of the KV head
    of query head `head` (`head // group`), key steps `[steps.cta_lo, steps.cta_hi)`.

    The stream's `t`-th step lands in slot `t % stages`; from `t = stages` on, a slot is
    refilled only after both compute warpgroups arrived on its free barrier. K and V have
    separate barriers, so K can be refilled while V of the same step is still being read.
    `ids`, a `(kv_seg [B, S] int32 in HBM, [stages, block_kv] SMEM)` pair, rides with K
    (its ready barrier then counts two arrivals).

    `regs`: the warpgroup's register count, set here (None: the caller set it). A
    persistent kernel streams its work items one after another (`steps.base` steps
    before this one) and drains once, after the last (`interpret=False` here).
    `one_warp`: warp 0 streams alone (`plgpu.warp_map`), instead of the whole warpgroup,
    which synchronises its 4 warps before each copy and polls each barrier with all 128
    threads. Compiled only. `before`: None, or a function issuing copies of its own (the
    item's query rows), called first by the streaming warp(s).
    """
    if regs is not None:
        plgpu.set_max_registers(regs, action="decrease")

    def stream():
        kv_head = lax.div(head, jnp.int32(group))
        base = index(steps.base)
        num_steps = steps.count
        if before is not None:
            before()

        @pl.loop(jnp.int32(0), num_steps)
        def _(t):
            slot = rem(base + t, stages)
            keys = pl.ds((steps.cta_lo + t) * block_kv, block_kv)
            for i, (src, dst, is_ready, is_free) in enumerate(
                zip(srcs, slots, ready, free, strict=True)
            ):

                @pl.when(base + t >= stages)
                def _(is_free=is_free):
                    plgpu.barrier_wait(is_free.at[slot])

                plgpu.copy_gmem_to_smem(
                    src.at[batch, keys, kv_head], dst.at[slot], is_ready.at[slot]
                )
                if i == 0 and ids is not None:
                    ids_ref, ids_smem = ids
                    plgpu.copy_gmem_to_smem(
                        ids_ref.at[batch, keys], ids_smem.at[slot], is_ready.at[slot]
                    )

    if one_warp:

        @plgpu.warp_map
        def _(warp):
            pl.when(warp == 0)(stream)

    else:
        stream()
    if interpret:
        drain(free, index(steps.base) + steps.count, stages)


GRID_YZ_MAX = 65535  # CUDA's largest grid along y and z (x: 2**31 - 1)
SMEM_BYTES = 232448  # Hopper: 227 KiB of shared memory per CTA
# Barriers and the alignment of the small buffers beside the tiles: 1,112 bytes for the
# forward with segment ids and f32 outputs (the largest measured).
_SMEM_SLACK = 2048


def fits_smem(stages: int, fixed: int, per_stage: int) -> bool:
    """Whether `fixed + stages * per_stage` bytes of tiles fit shared memory."""
    return fixed + stages * per_stage + _SMEM_SLACK <= SMEM_BYTES


def fit_stages(name: str, stages: int, fixed: int, per_stage: int) -> int:
    """The deepest pipeline `<= stages` that fits shared memory (at least 2)."""
    while stages > 2 and not fits_smem(stages, fixed, per_stage):
        stages -= 1
    need = fixed + stages * per_stage + _SMEM_SLACK
    if need > SMEM_BYTES:
        raise ValueError(
            f"{name}: {need} bytes of shared memory needed with {stages=}, more than "
            f"{SMEM_BYTES}; use smaller streamed blocks in jflash.BlockSizes"
        )
    return stages


def _element(v, i):
    """The `i`-th value of a vector register (MLIR)."""
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import vector

    return vector.extract(v, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([i]))


def _row_halves(regs, row_regs, fn):
    """For a WGMMA-layout array's registers `regs` and a row vector's `row_regs` (its
    reduced layout): `fn` of the row vector's values, one per row half (a thread's rows
    r and r + 8 of its warp's 16), and the function giving a register's row half. A
    thread holds one register per 8-column tile and row half, in the row vector's
    order."""
    from jaxlib.mlir import ir

    halves = row_regs.size
    assert regs.size % halves == 0, (regs.shape, row_regs.shape)
    half_axis = [i for i, d in enumerate(regs.shape) if d == halves and d > 1]
    assert len(half_axis) == 1 or halves == 1, (regs.shape, row_regs.shape)
    values = [fn(_element(r, 0) if isinstance(r.type, ir.VectorType) else r) for r in row_regs.flat]
    return values, (lambda idx: idx[half_axis[0]] if halves > 1 else 0)


def exp_rows(s, m, scale: float, dtype, chains: int = 4):
    """`(P, P's row sums)` for S `s` (f32, [rows, cols] in the WGMMA layout) and a row
    vector `m` (its reduced layout): `P = exp2(s * scale - m)` in `dtype` (bf16 or f16)
    and the sums of P in f32 (of the f32 exponentials, before rounding), in
    `chains` chains per row and thread.

    Mosaic GPU emits each of the three as a pass over all of a thread's 128 values
    (the FMAs, then the exponentials, then the sums and the conversions), which ptxas
    keeps mostly in that order: the adds and conversions wait for the last
    exponential. Here they are emitted value by value, FMA, exponential, add, and a
    conversion per pair: ptxas then runs the FMAs and adds between the SFU's
    exponentials (one every 8 cycles), though it still puts the conversions after the
    last one."""
    import jax.experimental.mosaic.gpu as mgpu
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, llvm, vector

    rows = s.shape[0]
    pack = {jnp.bfloat16: "bf16x2", jnp.float16: "f16x2"}[jnp.dtype(dtype).type]

    @plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1)),
        return_type=(
            plgpu.ShapeDtypeStruct(s.shape, dtype, layout=plgpu.Layout.WGMMA),
            plgpu.ShapeDtypeStruct((rows,), jnp.float32, layout=plgpu.Layout.WGMMA.reduce(1)),
        ),
    )
    def core(_, s_fa, m_fa):
        f32 = ir.F32Type.get()
        i32 = ir.IntegerType.get_signless(32)
        regs = s_fa.registers
        m_regs = m_fa.registers
        neg_m, half_of = _row_halves(regs, m_regs, arith.negf)
        halves = len(neg_m)
        c = arith.constant(f32, ir.FloatAttr.get(f32, float(scale)))
        sums = [[None] * chains for _ in range(halves)]
        out = np.empty(regs.shape, dtype=object)
        bf2 = ir.VectorType.get((2,), mgpu_utils.dtype_to_ir_type(jnp.dtype(dtype)))
        count = [0] * halves
        for idx in np.ndindex(regs.shape):
            h = half_of(idx)
            reg = regs[idx]
            p = []
            for i in range(2):
                x = llvm.inline_asm(
                    f32, [_element(reg, i), c, neg_m[h]], "fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f"
                )
                e = llvm.inline_asm(f32, [x], "ex2.approx.ftz.f32 $0, $1;", "=f,f")
                p.append(e)
                k = count[h] % chains
                count[h] += 1
                sums[h][k] = e if sums[h][k] is None else arith.addf(sums[h][k], e)
            word = llvm.inline_asm(i32, [p[0], p[1]], f"cvt.rn.{pack}.f32 $0, $2, $1;", "=r,f,f")
            out[idx] = vector.bitcast(bf2, vector.broadcast(ir.VectorType.get((1,), i32), word))
        sum_regs = np.empty(m_regs.shape, dtype=object)
        for h, idx in enumerate(np.ndindex(m_regs.shape)):
            total = None
            for part in sums[h]:
                if part is not None:
                    total = part if total is None else arith.addf(total, part)
            for distance in (1, 2):  # the four threads of a row
                total = arith.addf(total, mgpu_utils.shfl_bfly(total, distance))
            reg_ty = m_regs[idx].type
            sum_regs[idx] = (
                vector.broadcast(reg_ty, total) if isinstance(reg_ty, ir.VectorType) else total
            )
        return (
            mgpu.FragmentedArray(_registers=out, _layout=s_fa.layout, _is_signed=None),
            mgpu.FragmentedArray(_registers=sum_regs, _layout=m_fa.layout, _is_signed=None),
        )

    return core(s, m)


def _row_regs(m_regs, values):
    """A row vector's registers (the shapes and types of `m_regs`) holding `values`, one
    per row half."""
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import vector

    out = np.empty(m_regs.shape, dtype=object)
    for h, idx in enumerate(np.ndindex(m_regs.shape)):
        reg_ty = m_regs[idx].type
        out[idx] = (
            vector.broadcast(reg_ty, values[h]) if isinstance(reg_ty, ir.VectorType) else values[h]
        )
    return out


def bounded_rowmax(s, m, lim, scale: float, *, interpret: bool = False):
    """The running max after an unmasked step of S `s` (f32, WGMMA layout), skipping the
    row max where it cannot matter. `m`: the running max (scaled base-2 units); `lim`,
    per row, an upper bound of `s * scale` over every key the row can see, less a slack.

    Per warp (its rows' four threads each): where every row's `lim <= m`, no score of
    the step exceeds its row's running max by more than the slack, so `m` stays as it
    is, and `P = exp2(s * scale - m)` is at most 2^slack (finite in the input dtype, `l`
    and `o` far from f32's range) and exact in floating point; the row max, a serial
    chain between S and the first exponential, is skipped. Elsewhere (the item's first
    step, where `m` is -inf; rows whose bound is loose; a NaN) `max(m, rowmax(s) *
    scale)`. Only the max is in the warp's branch: the rescale factor (1 where `m` is
    kept) and what follows run as in the exact step. `interpret`: the same decision in
    jnp for the GPU interpreter (rows in warps of 16, as the WGMMA layout spreads them)."""
    if interpret:
        keep = jnp.all((lim <= m).reshape(-1, 16), axis=1)  # per warp
        return jnp.where(jnp.repeat(keep, 16), m, jnp.maximum(m, s.max(axis=1) * scale))
    import jax.experimental.mosaic.gpu as mgpu
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, nvvm, scf

    row = plgpu.Layout.WGMMA.reduce(1)

    @plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA, row, row),
        return_type=plgpu.ShapeDtypeStruct((s.shape[0],), jnp.float32, layout=row),
    )
    def core(_, s_fa, m_fa, lim_fa):
        f32 = ir.F32Type.get()
        i32 = ir.IntegerType.get_signless(32)
        regs, m_regs = s_fa.registers, m_fa.registers
        m_h, half_of = _row_halves(regs, m_regs, lambda x: x)
        lim_h, _ = _row_halves(regs, lim_fa.registers, lambda x: x)
        halves = len(m_h)
        ok = None
        for h in range(halves):  # ordered: a NaN bound or max is not ok
            c = arith.cmpf(arith.CmpFPredicate.OLE, lim_h[h], m_h[h])
            ok = c if ok is None else arith.andi(ok, c)
        fast = nvvm.vote_sync(arith.constant(i32, ir.IntegerAttr.get(i32, -1)), ok, "all")
        branch = scf.IfOp(fast, [f32] * halves, has_else=True)
        with ir.InsertionPoint(branch.then_block):
            scf.yield_(list(m_h))
        with ir.InsertionPoint(branch.else_block):
            c = arith.constant(f32, ir.FloatAttr.get(f32, float(scale)))
            chain = [[None, None] for _ in range(halves)]
            for idx in np.ndindex(regs.shape):
                h = half_of(idx)
                for i in range(2):  # two chains per row half
                    x = _element(regs[idx], i)
                    chain[h][i] = x if chain[h][i] is None else arith.maximumf(chain[h][i], x)
            new_m = []
            for h in range(halves):
                a, b = chain[h]
                mx = a if b is None else arith.maximumf(a, b)
                for distance in (1, 2):  # the four threads of a row
                    mx = arith.maximumf(mx, mgpu_utils.shfl_bfly(mx, distance))
                new_m.append(arith.maximumf(m_h[h], arith.mulf(mx, c)))
            scf.yield_(new_m)
        return mgpu.FragmentedArray(
            _registers=_row_regs(m_regs, list(branch.results)), _layout=m_fa.layout, _is_signed=None
        )

    return core(s, m, lim)


def hide_keys(s, limit, chunk: int = 64):
    """`s` (f32, [rows, cols] in the WGMMA layout) with each row's keys from `limit` on
    hidden: row r keeps columns `c < limit[r]` and the rest become -inf. `limit` is an
    int32 row vector (the reduced layout); any value is allowed (<= 0 hides the row).

    A thread's columns are taken `chunk` at a time (fewer where they do not divide the
    step: 32 of a 160-key step). A chunk whose columns all lie below
    (or all at or past) both of its rows' limits is kept (or hidden) whole; in the others
    each value costs one compare against an immediate and one select (a thread's column
    is a constant of the register plus its lane's offset, which is taken off the limit
    once per row). On a causal diagonal step only the chunk that holds the diagonal
    needs them. (`visible` builds each value's row and column from Mosaic's iota, a
    few integer operations per value more.)"""
    import jax.experimental.mosaic.gpu as mgpu
    from jax.experimental.mosaic.gpu import utils as mgpu_utils
    from jaxlib.mlir import ir
    from jaxlib.mlir.dialects import arith, scf, vector

    _, cols = s.shape
    chunk = math.gcd(cols, chunk)  # 160-key steps: 32-key chunks

    @plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(1)),
        return_type=plgpu.ShapeDtypeStruct(s.shape, jnp.float32, layout=plgpu.Layout.WGMMA),
    )
    def core(_, s_fa, lim_fa):
        i32 = ir.IntegerType.get_signless(32)
        f32 = ir.F32Type.get()
        layout = s_fa.layout
        regs, lim_regs = s_fa.registers, lim_fa.registers
        # The columns as Mosaic's iota builds them (`TiledLayout.thread_idxs`): a
        # register's linear index is a constant of the register plus the thread's offset
        # (warp and lane); a value of a vector register adds its place in the vector.
        tile_strides = layout.tiling.tile_strides((cols, 1))
        dyn = [mgpu_utils.c(x, i32) for x in tile_strides[-layout.tiled_tiling_rank :]]
        offset = arith.addi(
            mgpu_utils.dyn_dot(layout.warp_indices(), dyn),
            mgpu_utils.dyn_dot(layout.lane_indices(), dyn),
        )
        lane_col = arith.remui(offset, mgpu_utils.c(cols, i32))
        width = ir.VectorType(regs.flat[0].type).shape[0]
        # Per row half: the limit less the lane's column, so that a value's test is its
        # register's constant column against it.
        bound, half_of = _row_halves(regs, lim_regs, lambda x: arith.subi(x, lane_col))
        neg_inf = arith.constant(f32, ir.FloatAttr.get(f32, float("-inf")))
        col0 = {}
        for idx in np.ndindex(regs.shape):
            lin = sum(i * st for i, st in zip(idx, tile_strides, strict=True))
            col0[idx] = lin % cols
            # The lane's offset (under 8 columns) never carries into the next row.
            assert col0[idx] % 8 == 0 and col0[idx] + 8 <= cols, (idx, lin)

        def masked(idx):
            vals = []
            for i in range(width):
                seen = arith.cmpi(
                    arith.CmpIPredicate.slt, mgpu_utils.c(col0[idx] + i, i32), bound[half_of(idx)]
                )
                vals.append(arith.select(seen, _element(regs[idx], i), neg_inf))
            return vector.from_elements(regs[idx].type, vals)

        out = np.empty(regs.shape, dtype=object)
        assert cols % chunk == 0 and chunk % 8 == 0, (cols, chunk)
        low, high = bound[0], bound[0]
        for b in bound[1:]:
            low, high = arith.minsi(low, b), arith.maxsi(high, b)
        hidden_reg = vector.broadcast(regs.flat[0].type, neg_inf)
        for first in range(0, cols, chunk):
            group = [i for i in np.ndindex(regs.shape) if first <= col0[i] < first + chunk]
            if not group:
                continue
            last = max(col0[idx] for idx in group) + width - 1
            types = [regs[idx].type for idx in group]
            # Every column of the chunk below both limits: kept as it is.
            kept = arith.cmpi(arith.CmpIPredicate.sgt, low, mgpu_utils.c(last, i32))
            # Every column at or past both limits: hidden.
            gone = arith.cmpi(arith.CmpIPredicate.sle, high, mgpu_utils.c(first, i32))
            outer = scf.IfOp(kept, types, has_else=True)
            with ir.InsertionPoint(outer.then_block):
                scf.yield_([regs[idx] for idx in group])
            with ir.InsertionPoint(outer.else_block):
                inner = scf.IfOp(gone, types, has_else=True)
                with ir.InsertionPoint(inner.then_block):
                    scf.yield_([hidden_reg] * len(group))
                with ir.InsertionPoint(inner.else_block):
                    scf.yield_([masked(idx) for idx in group])
                scf.yield_(list(inner.results))
            for idx, res in zip(group, outer.results, strict=True):
                out[idx] = res
        return mgpu.FragmentedArray(_registers=out, _layout=layout, _is_signed=None)

    return core(s, limit)


def wgmma_into(accs, products, *, interpret: bool):
    """`acc_i + a_i @ b_i` on the tensor cores, for each accumulator and `(a, b)` pair.

    `a` may be a zero-argument function (a register operand converted where it is
    issued, e.g. `lambda: p.astype(bf16)`).

    The wgmmas are issued together and waited for once (`run_state` over all the
    accumulators: one `wgmma.wait_group` instead of one per product). The GPU
    interpreter has no rule for `run_state` accumulators nor for register operands,
    so in interpret mode the products are plain f32-accumulating dots added in
    registers: the same numbers, not the same instructions.
    """
    if interpret:
        # The GPU interpreter's wgmma takes SMEM operands only: read both operands
        # (a register value reads as itself) and multiply with f32 accumulation.
        out = []
        for acc, (a, b) in zip(accs, products, strict=True):
            a = (a() if callable(a) else a)[...]
            product = jnp.dot(a, b[...], preferred_element_type=jnp.float32)
            out.append(acc + product)
        return tuple(out)

    def issue(refs):
        for ref, (a, b) in zip(refs, products, strict=True):
            plgpu.wgmma(ref, a() if callable(a) else a, b)

    return pl.run_state(issue)(tuple(plgpu.ACC.init(acc) for acc in accs))


def wgmma_sum(acc, products, *, interpret: bool):
    """`acc + sum_j a_j @ b_j` into one accumulator, waited for once."""
    if interpret:
        for a, b in products:
            a = a() if callable(a) else a
            acc = acc + jnp.dot(a[...], b[...], preferred_element_type=jnp.float32)
        return acc

    def issue(ref):
        for a, b in products:
            plgpu.wgmma(ref, a, b)

    return pl.run_state(issue)(plgpu.ACC.init(acc))


def wgmma_pair(inits, products, first, then, *, interpret: bool):
    """Two accumulators `r_i = init_i + a_i @ b_i` issued together (`products[i]`: an
    `(a, b)` pair, or a list of them summed into `r_i`); `x = first(r_0)` runs while
    `r_1`'s wgmmas are still on the tensor cores. Returns `(x, then(x, r_1))`, both f32
    of the accumulators' shapes (written back into them: no extra registers).

    Each `plgpu.wgmma` commits its own group, so reading `r_0` waits for `r_0`'s only.
    """
    products = [p if isinstance(p, list) else [p] for p in products]
    if interpret:
        r0, r1 = (wgmma_sum(i, p, interpret=True) for i, p in zip(inits, products, strict=True))
        x = first(r0)
        return x, then(x, r1)

    def issue(refs):
        for ref, prods in zip(refs, products, strict=True):
            for a, b in prods:
                plgpu.wgmma(ref, a() if callable(a) else a, b)
        x = first(plgpu.wgmma_accumulator_load(refs[0], wait_n=len(products[1])))
        y = then(x, plgpu.wgmma_accumulator_load(refs[1], wait_n=0))
        refs[0][...] = x
        refs[1][...] = y

    return pl.run_state(issue)(tuple(plgpu.ACC.init(acc) for acc in inits))


def tile_grid(
    tiles: int,
    heads: int,
    batch: int,
    tile_name: str,
    *,
    causal: bool,
    packed: bool = False,
    rows_outer: bool = False,
    dkv: bool = False,
) -> dict:
    """`grid` and `grid_names` of a (tiles, heads, batch) launch in the order
    `jflash._launch_order` picks (`packed`: a backward launch with segment ids). CTAs
    start with the LAST grid axis fastest (Pallas Mosaic GPU reverses the grid onto
    CUDA's x, y, z), so the outermost axis is first. `rows_outer`: where the heads
    would be outermost, the batch rows go outside them (one row's heads and tiles
    before the next row's) instead of running side by side. `dkv`: the dK/dV kernel's
    launch (`_launch_order.tiles_first`).

    CUDA allows at most `GRID_YZ_MAX` along y and z: more batch rows than that (calls
    folded by `jax.vmap`, say) keep the rows fastest, on x; more tiles than that (rows
    of over 8M tokens) go fastest."""
    if _launch_order.tiles_first(tiles, heads, batch, causal=causal, packed=packed, dkv=dkv):
        return dict(grid=(tiles, heads, batch), grid_names=(tile_name, "heads", "batch"))
    if (rows_outer and batch <= GRID_YZ_MAX) or tiles > GRID_YZ_MAX:
        return dict(grid=(batch, heads, tiles), grid_names=("batch", "heads", tile_name))
    return dict(grid=(heads, tiles, batch), grid_names=("heads", tile_name, "batch"))


# Mosaic GPU's on-device profiler (`profiling`): None, or `(directory, {kernel name:
# ranges per warpgroup}, {names of those compiled with it so far})`.
_PROFILE: tuple[str, dict[str, int], set[str]] | None = None


@contextlib.contextmanager
def profiling(directory: str, spaces: dict[str, int]):
    """Kernels named in `spaces` and traced inside this context record their
    `jax.named_scope` regions per warpgroup with the SM clock, and write a Perfetto
    trace per call into `directory`; each warpgroup keeps `spaces[name]` ranges (4 int32
    of shared memory each; later ones are dropped). Outside it the kernels are built as
    always: their named scopes change no instruction. `jflash.kernel_timeline` is the
    checked entry. Yields the set of the named kernels built with the profiler inside
    the context (the GPU interpreter's are not)."""
    global _PROFILE
    compiled: set[str] = set()
    previous, _PROFILE = _PROFILE, (str(directory), dict(spaces), compiled)
    try:
        yield compiled
    finally:
        _PROFILE = previous


def profile_bytes(kernel_name: str, warpgroups: int, interpret: bool) -> int:
    """Shared memory that the on-device profiler takes from kernel `kernel_name` of
    `warpgroups` warpgroups where `profiling` names it (16 bytes per range and
    warpgroup), else 0."""
    if _PROFILE is None or interpret or kernel_name not in _PROFILE[1]:
        return 0
    return 16 * _PROFILE[1][kernel_name] * warpgroups


def _compiler_params(kernel_name: str, interpret: bool = False):
    """`approx_math` and no reduction scratch for every kernel; the profiler's buffer
    for the ones `profiling` names (compiled only: the GPU interpreter records none)."""
    extra = {}
    if _PROFILE is not None and kernel_name in _PROFILE[1]:
        directory, space, compiled = _PROFILE[0], _PROFILE[1][kernel_name], _PROFILE[2]
        if interpret:
            warnings.warn(
                f"jflash.kernel_timeline: {kernel_name} runs in the GPU interpreter here, "
                "which records no timeline (compiled kernels on Hopper do)",
                stacklevel=2,
            )
        else:
            compiled.add(kernel_name)
            extra = dict(profile_space=space, profile_dir=directory, profile_bounds_check=True)
    # Row max/sum of the WGMMA layout stay inside a warp (shuffles): no SMEM scratch for
    # reductions, which buys the f32-output variants their slots.
    return plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0, **extra)


def launch(
    body,
    *,
    out_type,
    scratch_types,
    grid,
    grid_names,
    kernel_name: str,
    interpret: bool,
    wgs: int = COMPUTE_WGS,
):
    """`plgpu.kernel` with what every jflash Mosaic kernel shares: `wgs` compute (two, or
    the D = 64 forward's three) + 1 memory warpgroups, approximate exp2/reciprocal, and
    the GPU interpreter when asked.

    Inside a `jax.shard_map` the kernel runs per device (`_vma.per_device`): its
    operands typed as unvarying, its outputs marked varying like them."""
    kernel = plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=scratch_types,
        grid=grid,
        grid_names=grid_names,
        num_threads=wgs + 1,
        thread_name="wg",
        compiler_params=_compiler_params(kernel_name, interpret),
        kernel_name=kernel_name,
        # The GPU interpreter simulates warpgroups, barriers and TMA on CPU.
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    return per_device(kernel)


# ----------------------------------------------------------------------------- steps

TABLE_COLS = 4  # per tile: (first, end, same_first, same_end), see `_table`


def _table(ranges, n_tiles: int):
    """Flat int32 `[B * n_tiles * TABLE_COLS]` of `jflash._segments`' per-tile
    `(first, end, same_first, same_end)`; tiles past the ids' length (padding) get
    empty ranges."""
    table = jnp.stack(ranges, axis=-1).astype(jnp.int32)
    return pad_to(table, 1, n_tiles).reshape(-1)


def query_table(q_seg, kv_seg, block_q: int, block_kv: int, n_tiles: int):
    """Forward and dQ kernels: the key tiles each `block_q`-row query tile streams."""
    return _table(kv_tile_range(q_seg, kv_seg, block_q, block_kv), n_tiles)


def key_table(q_seg, kv_seg, block_q: int, block_kv: int, n_tiles: int):
    """dK/dV kernel: the query tiles each `block_kv`-row key tile streams."""
    return _table(q_tile_range(q_seg, kv_seg, block_q, block_kv), n_tiles)


def _read_table(table_ref, batch, tile, n_tiles: int):
    base = (batch * n_tiles + tile) * TABLE_COLS
    return tuple(table_ref[base + i] for i in range(TABLE_COLS))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Steps:
    """One warpgroup's share of its CTA's stream `[cta_lo, cta_hi)` (int32 scalars):
    steps `[cta_lo, lo)` and `[hi, cta_hi)` it only acknowledges, `[lo, clear_lo)` and
    `[clear_hi, hi)` it computes with the mask, `[clear_lo, clear_hi)` without. A pytree:
    loops may carry it (the persistent forward carries its next item's)."""

    cta_lo: jax.Array
    cta_hi: jax.Array
    lo: jax.Array
    clear_lo: jax.Array
    clear_hi: jax.Array
    hi: jax.Array
    # Steps the CTA streamed before this work item (the persistent forward; 0 for one
    # item per CTA): the slots and their barriers' phases run on across a CTA's items.
    base: jax.Array | int = 0

    def slot(self, j, stages: int):
        """The shared-memory slot of step `j` (the CTA's `base + j - cta_lo`-th)."""
        return rem(index(self.base) + j - self.cta_lo, stages)

    @property
    def count(self):
        """Steps the CTA streams for this work item."""
        return self.cta_hi - self.cta_lo


def lockstep(steps: Steps) -> Steps:
    """A warpgroup that computes every step of its CTA's stream: its own unmasked run
    stays unmasked, every other step runs with the mask (for warpgroups that share
    each step's work, e.g. the split dQ of the dK/dV kernel)."""
    lo, hi = steps.cta_lo, steps.cta_hi
    clear_lo = jnp.clip(steps.clear_lo, lo, hi)
    clear_hi = jnp.clip(steps.clear_hi, clear_lo, hi)
    return Steps(lo, hi, lo, clear_lo, clear_hi, hi, steps.base)


def _own_steps(visible_steps, clear_steps, seg):
    """`(lo, clear_lo, clear_hi, hi)` of one warpgroup: the causal / padding bounds
    (visible `[a, b)`, no mask needed in `[c, d)`) intersected with the segment ids'
    `(first, end, same_first, same_end)` (None: no segment ids)."""
    lo, hi = (index(x) for x in visible_steps)
    c_lo, c_hi = (index(x) for x in clear_steps)
    if seg is None:
        return lo, c_lo, c_hi, hi
    first, end, same_first, same_end = seg
    lo = jnp.maximum(lo, first)
    hi = jnp.maximum(jnp.minimum(hi, end), lo)
    c_lo = jnp.clip(jnp.maximum(c_lo, same_first), lo, hi)
    c_hi = jnp.clip(jnp.minimum(c_hi, same_end), c_lo, hi)
    return lo, c_lo, c_hi, hi


def _cta_steps(per_wg, wg, base=0) -> Steps:
    """The CTA's stream: the union of its warpgroups' ranges (empty ones left out), and
    warpgroup `wg`'s own share of it (an empty one at `cta_lo`)."""
    empty = [hi <= lo for lo, _, _, hi in per_wg]
    big = jnp.int32(jnp.iinfo(jnp.int32).max)
    cta_lo = functools.reduce(
        jnp.minimum, [jnp.where(e, big, r[0]) for e, r in zip(empty, per_wg, strict=True)]
    )
    cta_hi = functools.reduce(
        jnp.maximum, [jnp.where(e, jnp.int32(0), r[3]) for e, r in zip(empty, per_wg, strict=True)]
    )
    cta_lo = jnp.minimum(cta_lo, cta_hi)
    own = list(per_wg[0])
    own_empty = empty[0]
    for w in range(1, len(per_wg)):
        own = [jnp.where(wg == w, x, y) for x, y in zip(per_wg[w], own, strict=True)]
        own_empty = jnp.where(wg == w, empty[w], own_empty)
    own = [jnp.where(own_empty, cta_lo, x) for x in own]
    return Steps(cta_lo, cta_hi, *own, base)


def query_tile_steps(
    geom: Geometry,
    block_kv: int,
    table_ref,
    batch,
    wg,
    wgs: int = COMPUTE_WGS,
    *,
    tile=None,
    base=0,
):
    """Forward and dQ kernels: `(cta_start, Steps)`, query tile `tile`'s first row and
    the key steps it streams and `wg` (of `wgs` compute warpgroups) computes
    (`table_ref`: `query_table` of the 64-row query tiles, or None; `base`:
    `Steps.base`). A warpgroup whose rows are all padding gets no steps.

    Without `tile`, the grid's `q_tiles` axis launches heaviest first (causal rows near
    the end see the most keys).
    """
    rows = wgs * WG_ROWS
    tiles = geom.q_pad // rows
    if tile is None:
        tile = tiles - 1 - lax.axis_index("q_tiles")
    cta_start = tile * rows
    per_wg = []
    for w in range(wgs):
        n_full, n_end = kv_range(geom, cta_start + w * WG_ROWS, WG_ROWS, block_kv)
        # A warpgroup whose rows are all padding streams nothing (its output is cut off).
        real = cta_start + w * WG_ROWS < geom.q_len
        n_full, n_end = (jnp.where(real, x, jnp.int32(0)) for x in (n_full, n_end))
        seg = None
        if table_ref is not None:
            seg = _read_table(table_ref, batch, tile * wgs + w, tiles * wgs)
        per_wg.append(_own_steps((0, n_end), (0, n_full), seg))
    return cta_start, _cta_steps(per_wg, wg, base)


def key_tile_steps(geom: Geometry, block_q: int, table_ref, batch, wg):
    """dK/dV kernel: `(cta_start, Steps)`, this CTA's first key row and the query steps
    (per query head) it streams and `wg` computes (`table_ref`: `key_table` of the
    64-row key tiles, or None). Causal: `[n_begin, n_full)` needs the mask."""
    rows = COMPUTE_WGS * WG_ROWS
    tiles = geom.kv_pad // rows
    tile = lax.axis_index("kv_tiles")
    cta_start = tile * rows
    per_wg = []
    for w in range(COMPUTE_WGS):
        n_begin, n_full, n_q = q_range(geom, cta_start + w * WG_ROWS, WG_ROWS, block_q)
        seg = None
        if table_ref is not None:
            seg = _read_table(table_ref, batch, tile * COMPUTE_WGS + w, tiles * COMPUTE_WGS)
        per_wg.append(_own_steps((n_begin, n_q), (n_full, n_q), seg))
    return cta_start, _cta_steps(per_wg, wg)


def run_steps(
    steps: Steps,
    step,
    skip,
    carry,
    *,
    mask_first: bool,
    mask_last: bool,
    skip_first: bool,
    reverse=None,
):
    """A warpgroup's share of the stream, in stream order: `step(j, carry, masked=...)`
    on its own steps, `skip(j, None)` on the rest. The static flags leave out runs that
    are always empty (without segment ids: the forward's first masked run and leading
    skips, the dK/dV kernel's last masked run).

    `reverse` (a traced bool, or None: never): the stream runs from `cta_hi - 1` down to
    `cta_lo` instead, the same runs backwards, in one code path for both directions."""
    if reverse is not None:
        return _run_steps_either_way(
            steps, step, skip, carry, mask=mask_first or mask_last, reverse=reverse
        )
    if skip_first:
        lax.fori_loop(steps.cta_lo, steps.lo, skip, None)
    if mask_first:
        carry = lax.fori_loop(steps.lo, steps.clear_lo, functools.partial(step, masked=True), carry)
    carry = lax.fori_loop(
        steps.clear_lo, steps.clear_hi, functools.partial(step, masked=False), carry
    )
    if mask_last:
        carry = lax.fori_loop(steps.clear_hi, steps.hi, functools.partial(step, masked=True), carry)
    lax.fori_loop(steps.hi, steps.cta_hi, skip, None)
    return carry


def _run_steps_either_way(steps: Steps, step, skip, carry, *, mask: bool, reverse):
    """`run_steps` forwards or (`reverse`) backwards: five runs whose kinds come in the
    same order both ways (skip, masked, unmasked, masked, skip), each over its range in
    the direction's order."""
    s = steps
    fwd = [
        (s.cta_lo, s.lo),
        (s.lo, s.clear_lo),
        (s.clear_lo, s.clear_hi),
        (s.clear_hi, s.hi),
        (s.hi, s.cta_hi),
    ]
    runs = []
    for i, (a, b) in enumerate(fwd):
        ra, rb = fwd[len(fwd) - 1 - i]
        runs.append((jnp.where(reverse, ra, a), jnp.where(reverse, rb, b)))
    kinds = ["skip", "masked", "clear", "masked", "skip"]
    for (a, b), kind in zip(runs, kinds, strict=True):
        if kind == "masked" and not mask:
            continue

        def at(i, a=a, b=b):  # the run's i-th step in the direction's order
            return jnp.where(reverse, a + b - 1 - i, i)

        if kind == "skip":
            lax.fori_loop(a, b, lambda i, c: skip(at(i), c), None)
        else:
            fn = functools.partial(step, masked=kind == "masked")
            carry = lax.fori_loop(a, b, lambda i, c, fn=fn: fn(at(i), c), carry)
    return carry


def row_ids(ref):
    """Segment ids of a tile's rows (`[rows]` int32 in SMEM) in the WGMMA row layout."""
    return plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(1))


def col_ids(ref):
    """Segment ids of a tile's columns in the WGMMA column layout."""
    return plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(0))


def same_segment(row_ids_, col_ids_, shape):
    """Boolean tile in the WGMMA layout: row and column hold the same segment id."""
    return lax.broadcast_in_dim(row_ids_, shape, [0]) == lax.broadcast_in_dim(col_ids_, shape, [1])
