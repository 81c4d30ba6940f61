"""Pieces shared by the Mosaic GPU (Hopper) kernels: geometry, step ranges, SMEM types.

Every Mosaic kernel here has the same shape: a CTA of three warpgroups, two that
compute (64 rows each: the native wgmma M) and one that streams tiles from HBM into
a ring of shared-memory slots with TMA. A slot is refilled when both compute
warpgroups have arrived on its "free" barrier, so each compute warpgroup visits every
step the memory warpgroup streams; steps outside its own visible range it only
acknowledges ("skip"), which keeps every barrier's phase in step across warpgroups.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jflash import _launch_order
from jflash._mask import Mask
from jflash._triton_common import visible_kv_range, visible_q_range

WG_ROWS = 64  # rows per compute warpgroup: the M of one wgmma
COMPUTE_WGS = 2
# Register split (setmaxnreg): 2 x 232 + 40 per thread x 128 threads = 64,512 of the
# SM's 65,536. Asking for more than the file holds makes the warpgroups wait forever.
COMPUTE_REGS = 232
MEMORY_REGS = 40
SWIZZLE_BYTES = 128


def smem_tile(shape, dtype):
    """An SMEM scratch with the tiling + 128-byte swizzle that TMA and wgmma want."""
    cols = SWIZZLE_BYTES // jnp.dtype(dtype).itemsize
    return plgpu.SMEM(
        shape,
        dtype,
        transforms=(plgpu.TilingTransform((8, cols)), plgpu.SwizzleTransform(SWIZZLE_BYTES)),
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
    return jnp.asarray(n_full, jnp.int32), jnp.asarray(n_end, jnp.int32)


def q_range(geom: Geometry, k_start, rows: int, block_q: int):
    """Query steps that see keys `[k_start, k_start + rows)`: `(n_begin, n_full, n_q)`.

    Steps `[n_begin, n_full)` need the mask, `[n_full, n_q)` are fully visible (the
    Triton kernels' `visible_q_range` over the padded queries). Key tiles reaching past
    the real length are masked everywhere, so their padded rows of dK/dV stay finite.
    """
    n_begin, n_full, n_q = visible_q_range(geom.mask, k_start, rows, block_q, geom.q_pad)
    n_full = jnp.where(k_start + rows <= geom.kv_len, n_full, n_q)
    return jnp.asarray(n_begin, jnp.int32), n_full.astype(jnp.int32), n_q


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
            plgpu.barrier_wait(free.at[lax.rem(j, stages)])


def stream_kv(
    srcs,
    slots,
    ready,
    free,
    *,
    batch,
    head,
    group: int,
    num_steps,
    block_kv: int,
    stages: int,
    interpret: bool = False,
):
    """The memory warpgroup of the forward and dQ kernels: K and V tiles of the KV head
    of query head `head` (`head // group`).

    Step `j` lands in slot `j % stages`; from step `stages` on, a slot is refilled only
    after both compute warpgroups arrived on its free barrier. K and V have separate
    barriers, so K can be refilled while V of the same step is still being read.
    """
    plgpu.set_max_registers(MEMORY_REGS, action="decrease")
    kv_head = lax.div(head, jnp.int32(group))

    @pl.loop(0, num_steps)
    def _(j):
        slot = lax.rem(j, stages)
        rows = (batch, pl.ds(j * block_kv, block_kv), kv_head)
        for src, dst, is_ready, is_free in zip(srcs, slots, ready, free, strict=True):

            @pl.when(j >= stages)
            def _(is_free=is_free):
                plgpu.barrier_wait(is_free.at[slot])

            plgpu.copy_gmem_to_smem(src.at[rows], dst.at[slot], is_ready.at[slot])

    if interpret:
        drain(free, num_steps, stages)


SMEM_BYTES = 232448  # Hopper: 227 KiB of shared memory per CTA
_SMEM_SLACK = 512  # barriers and alignment


def fit_stages(name: str, stages: int, fixed: int, per_stage: int) -> int:
    """The deepest pipeline `<= stages` that fits shared memory (at least 2)."""
    while stages > 2 and fixed + stages * per_stage + _SMEM_SLACK > SMEM_BYTES:
        stages -= 1
    need = fixed + stages * per_stage + _SMEM_SLACK
    if need > SMEM_BYTES:
        raise ValueError(
            f"{name}: {need} bytes of shared memory needed with {stages=}, more than "
            f"{SMEM_BYTES}; use smaller streamed blocks in jflash.BlockSizes"
        )
    return stages


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


def wgmma_pair(inits, products, first, then, *, interpret: bool):
    """Two wgmmas `r_i = init_i + a_i @ b_i` issued together; `x = first(r_0)` runs while
    the second is still on the tensor cores. Returns `(x, then(x, r_1))`, both f32 of
    the accumulators' shapes (written back into them: no extra registers).

    Each `plgpu.wgmma` commits its own group, so reading `r_0` waits for one group only.
    """
    if interpret:
        r0, r1 = wgmma_into(inits, products, interpret=True)
        x = first(r0)
        return x, then(x, r1)

    def issue(refs):
        for ref, (a, b) in zip(refs, products, strict=True):
            plgpu.wgmma(ref, a() if callable(a) else a, b)
        x = first(plgpu.wgmma_accumulator_load(refs[0], wait_n=1))
        y = then(x, plgpu.wgmma_accumulator_load(refs[1], wait_n=0))
        refs[0][...] = x
        refs[1][...] = y

    return pl.run_state(issue)(tuple(plgpu.ACC.init(acc) for acc in inits))


def tile_grid(tiles: int, heads: int, batch: int, tile_name: str, *, causal: bool) -> dict:
    """`grid` and `grid_names` of a (tiles, heads, batch) launch in the order
    `jflash._launch_order` picks. CTAs start with the LAST grid axis fastest (Pallas
    Mosaic GPU reverses the grid onto CUDA's x, y, z), so the outermost axis is first."""
    if _launch_order.tiles_first(tiles, heads, batch, causal=causal):
        return dict(grid=(tiles, heads, batch), grid_names=(tile_name, "heads", "batch"))
    return dict(grid=(heads, tiles, batch), grid_names=("heads", tile_name, "batch"))


def launch(body, *, out_type, scratch_types, grid, grid_names, kernel_name: str, interpret: bool):
    """`plgpu.kernel` with what every jflash Mosaic kernel shares: 2 compute + 1 memory
    warpgroups, approximate exp2/reciprocal, and the GPU interpreter when asked."""
    return plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=scratch_types,
        grid=grid,
        grid_names=grid_names,
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        # Row max/sum of the WGMMA layout stay inside a warp (shuffles): no SMEM
        # scratch for reductions, which buys the f32-output variants their slots.
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
        kernel_name=kernel_name,
        # The GPU interpreter simulates warpgroups, barriers and TMA on CPU.
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )


def query_tile_cta(geom: Geometry, block_kv: int):
    """Forward and dQ kernels: `(cta_start, cta_end)`, this CTA's first query row and the
    key steps its memory warpgroup streams.

    Query tiles launch heaviest first (causal rows near the end see the most keys); the
    CTA streams the range of its last warpgroup, whose rows see the most keys.
    """
    rows = COMPUTE_WGS * WG_ROWS
    tile = geom.q_pad // rows - 1 - lax.axis_index("q_tiles")
    cta_start = tile * rows
    _, cta_end = kv_range(geom, cta_start + rows - WG_ROWS, WG_ROWS, block_kv)
    return cta_start, cta_end
