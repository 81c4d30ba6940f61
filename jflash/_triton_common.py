"""Pieces shared by the Triton-lowered forward and backward kernels."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jflash import _launch_order
from jflash._mask import Mask

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


@dataclasses.dataclass(frozen=True)
class Launch:
    """A launch over (batch * heads) rows x tiles in the order `jflash._launch_order`
    picks. Triton starts programs with the FIRST grid axis fastest (CUDA's x), so the
    outermost axis is last in `grid`. Index maps and kernels see (row, tile) either way."""

    grid: tuple[int, int]
    tile_axis: int  # the tile's grid axis, for `pl.program_id` / `pl.num_programs`

    @classmethod
    def of(cls, tiles: int, heads: int, batch: int, *, causal: bool) -> Launch:
        if _launch_order.tiles_first(tiles, heads, batch, causal=causal):
            return cls(grid=(batch * heads, tiles), tile_axis=1)
        return cls(grid=(tiles, batch * heads), tile_axis=0)

    def index_map(self, fn):
        """`fn(row, tile)` as an index map over `grid`."""
        if self.tile_axis == 1:
            return fn
        return lambda tile, row: fn(row, tile)


_NT = (((1,), (1,)), ((), ()))
_NN = (((1,), (0,)), ((), ()))


def dot(a, b, *, trans_b: bool = False):
    """`a @ b` (or `a @ b.T`) with f32 accumulation.

    HIGHEST keeps f32 inputs in IEEE f32 (Triton's DEFAULT would be TF32); for
    bf16/f16 inputs it changes nothing.
    """
    return lax.dot_general(
        a,
        b,
        _NT if trans_b else _NN,
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


def padded_head_dim(head_dim: int) -> int:
    """Triton tiles need a power-of-two head dim (>= 16): D=100 runs as 128."""
    return max(16, 1 << (head_dim - 1).bit_length())


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def pad_to(x, axis: int, size: int, value=0):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def tile_visibility(
    mask: Mask, q_pos, k_start, shape, kv_len: int, *, masked: bool, q_seg, kseg_ref
):
    """Boolean `[block_q, block_kv]` visibility of one tile, or None when all is visible.

    `masked` tiles (diagonal or ragged) apply the causal and key-padding masks; segment
    ids, when given, apply everywhere. `q_pos` holds the queries' global positions.
    """
    visible = None
    if masked:
        k_idx = k_start + lax.broadcasted_iota(jnp.int32, shape, 1)
        visible = k_idx < kv_len
        if mask.causal:
            visible = visible & (q_pos >= k_idx + mask.k_offset)
    if q_seg is not None:
        seg = q_seg[:, None] == kseg_ref[pl.ds(k_start, shape[1])][None, :]
        visible = seg if visible is None else visible & seg
    return visible


def _div(x, d: int):
    """`x // d` toward zero for an int32 `x` and a static `d` (an int32 divisor, so the
    index arithmetic stays int32 under `jax_enable_x64`)."""
    return lax.div(x, jnp.asarray(d, x.dtype))


def index(x):
    """A static or traced loop bound as int32 (under `jax_enable_x64` a Python int would
    give an int64 loop index)."""
    return jnp.asarray(x, jnp.int32)


def visible_kv_range(mask: Mask, q_start, block_q: int, block_kv: int, kv_len: int):
    """Key-block loop bounds `(n_full, n_end)` for queries `q_start .. q_start+block_q`.

    Blocks `[0, n_full)` need no causal or padding mask; blocks `[n_full, n_end)` do;
    blocks at or past `n_end` are fully hidden and skipped (FlashAttention-2 §3.1.1).
    """
    num_kv = -(-kv_len // block_kv)
    last_full = num_kv if kv_len % block_kv == 0 else num_kv - 1
    if not mask.causal:
        return index(last_full), index(num_kv)
    shift = mask.q_offset - mask.k_offset
    # Key j is visible to query i when j <= i + shift.
    q_start = index(q_start)
    n_end = _div(q_start + (block_q + shift + block_kv - 1), block_kv)
    n_full = _div(q_start + (shift + 1), block_kv)
    n_end = jnp.clip(n_end, index(0), index(num_kv))
    n_full = jnp.clip(n_full, index(0), jnp.minimum(n_end, last_full))
    return n_full, n_end


def visible_q_range(mask: Mask, k_start, block_kv: int, block_q: int, q_len: int):
    """Query-block loop bounds `(n_begin, n_full_from, num_q)` for keys `k_start .. +block_kv`.

    Query blocks before `n_begin` see none of these keys (skipped); blocks in
    `[n_begin, n_full_from)` need the causal mask; the rest see all of them.
    """
    num_q = -(-q_len // block_q)
    if not mask.causal:
        return index(0), index(0), index(num_q)
    shift = mask.q_offset - mask.k_offset
    # Query i sees key j when i >= j - shift; first query of the block that sees k_start:
    k_start = index(k_start)
    first = k_start - shift
    n_begin = jnp.clip(_div(jnp.maximum(first, 0), block_q), index(0), index(num_q))
    # Query blocks whose first query sees the last key of this block need no mask.
    last = k_start + (block_kv - 1 - shift)
    n_full_from = jnp.clip(
        _div(jnp.maximum(last, 0) + (block_q - 1), block_q), n_begin, index(num_q)
    )
    return n_begin, n_full_from, index(num_q)


def runs(lo, hi, tiles, *, split: bool):
    """The loop `[lo, hi)` as `(start, stop, segmented)` runs over the tiles segment ids
    let meet; `segmented` runs compare ids, the rest need not. `tiles` None (no segment
    ids): the loop itself. `split`: the run of tiles where both sides hold one id runs
    without the comparison (tiles needing the causal or padding mask are not split:
    one loop). An empty run has `stop <= start` and runs no step."""
    if tiles is None:
        return [(lo, hi, False)]
    first, end, same_first, same_end = tiles
    if not split:
        return [(jnp.maximum(lo, first), jnp.minimum(hi, end), True)]
    return [
        (jnp.maximum(lo, first), jnp.minimum(hi, same_first), True),
        (jnp.maximum(lo, same_first), jnp.minimum(hi, same_end), False),
        (jnp.maximum(lo, same_end), jnp.minimum(hi, end), True),
    ]


def tile_range_specs(index_map):
    """BlockSpecs of the four `[B, tiles]` int32 segment tile ranges (`jflash._segments`):
    each program reads its own as scalars; `index_map(row, tile) -> (b, tile)`."""
    return [pl.BlockSpec((None, None), index_map)] * 4


def read_tiles(*range_refs):
    """The program's segment tile ranges `(first, end, same_first, same_end)` (None
    without segment ids)."""
    if range_refs[0] is None:
        return None
    return tuple(ref[...] for ref in range_refs)
