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

from jflash._mask import Mask

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


def cdiv_nonneg(x, d: int):
    """`ceil(max(x, 0) / d)` for a traced int32 `x` and a static `d`."""
    return lax.div(jnp.maximum(x, 0) + (d - 1), jnp.int32(d))


def div_nonneg(x, d: int):
    """`floor(max(x, 0) / d)` for a traced int32 `x` and a static `d`."""
    return lax.div(jnp.maximum(x, 0), jnp.int32(d))


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Static facts of one problem, in padded coordinates (block multiples)."""

    mask: Mask
    q_len: int  # real lengths
    kv_len: int
    q_pad: int  # padded lengths
    kv_pad: int
    group: int  # query heads per KV head
    head_dim: int

    @property
    def diag(self) -> int:
        """Query row `i` sees key `j` (causal) when `i + diag >= j`."""
        return self.mask.q_offset - self.mask.k_offset


def kv_range(geom: Geometry, q_start, rows: int, block_kv: int):
    """Key steps of query rows `[q_start, q_start + rows)`: `(n_full, n_end)`.

    Steps `[0, n_full)` are fully visible (no mask), `[n_full, n_end)` need the mask,
    later steps are hidden. Keys past the real length are masked.
    """
    n_kv = geom.kv_pad // block_kv
    full_static = geom.kv_len // block_kv
    if not geom.mask.causal:
        return jnp.int32(full_static), jnp.int32(n_kv)
    n_end = jnp.minimum(cdiv_nonneg(q_start + rows + geom.diag, block_kv), n_kv)
    n_full = jnp.minimum(div_nonneg(q_start + geom.diag + 1, block_kv), full_static)
    return jnp.minimum(n_full, n_end), n_end


def q_range(geom: Geometry, k_start, rows: int, block_q: int):
    """Query steps that see keys `[k_start, k_start + rows)`: `(n_begin, n_full)`.

    Steps `[n_begin, n_full)` need the mask, `[n_full, n_q)` are fully visible.
    """
    n_q = geom.q_pad // block_q
    keys_real = k_start + rows <= geom.kv_len
    if not geom.mask.causal:
        n_begin = jnp.int32(0)
        n_full = jnp.where(keys_real, 0, n_q).astype(jnp.int32)
        return n_begin, n_full
    n_begin = jnp.minimum(div_nonneg(k_start - geom.diag, block_q), n_q)
    n_full = jnp.minimum(cdiv_nonneg(k_start + rows - 1 - geom.diag, block_q), n_q)
    n_full = jnp.where(keys_real, n_full, n_q).astype(jnp.int32)
    return n_begin, jnp.maximum(n_full, n_begin)


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


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def pad_axis(x, axis: int, size: int, value=0):
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


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


def interpret_params(interpret: bool):
    """`plgpu.kernel(interpret=...)`: the GPU interpreter (threads, barriers, TMA
    simulated on CPU) or None (compiled)."""
    return plgpu.InterpretGPUParams() if interpret else None
