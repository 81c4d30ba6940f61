"""Which tiles packed documents let meet (segment ids -> loop bounds).

Attention stays inside equal segment ids. A query tile and a key tile whose id ranges
`[min, max]` do not overlap cannot meet, so the kernels skip them instead of computing
and masking them. For packed documents (ids non-decreasing along the sequence) the
tiles that may meet a query tile are one contiguous run of key tiles, so loop bounds
skip exactly the tiles that hold no pair of the same document; for ids in any other
order the bounds stay correct (every tile that may meet lies inside them) but skip less.
"""

from __future__ import annotations

import jax.numpy as jnp


def tile_bounds(seg, block: int):
    """Per-tile `(min, max)` of segment ids `[B, L]` -> two `[B, ceil(L / block)]`.

    The last, ragged tile is padded with its own last id, so padding widens nothing.
    """
    b, length = seg.shape
    n = -(-length // block)
    padded = jnp.pad(seg, ((0, 0), (0, n * block - length)), mode="edge")
    tiles = padded.reshape(b, n, block)
    return tiles.min(axis=-1), tiles.max(axis=-1)


def _meet(rows_seg, cols_seg, block_rows: int, block_cols: int):
    """`[B, n_rows, n_cols]` bool: tiles whose id ranges overlap."""
    rmin, rmax = tile_bounds(rows_seg, block_rows)
    cmin, cmax = tile_bounds(cols_seg, block_cols)
    return (cmin[:, None, :] <= rmax[:, :, None]) & (cmax[:, None, :] >= rmin[:, :, None])


def _first_last(meet):
    """Per row of `meet [B, R, C]`: `(lo, hi)` int32 `[B, R]`, the first tile that may
    meet and one past the last (lo == hi == 0: none)."""
    c = meet.shape[-1]
    idx = jnp.arange(c, dtype=jnp.int32)
    any_ = meet.any(axis=-1)
    lo = jnp.where(meet, idx, c).min(axis=-1)
    hi = jnp.where(meet, idx + 1, 0).max(axis=-1)
    return jnp.where(any_, lo, 0).astype(jnp.int32), hi.astype(jnp.int32)


def kv_tile_range(q_seg, kv_seg, block_q: int, block_kv: int):
    """For every query tile, the key tiles `[lo, hi)` that may share a segment id:
    two int32 `[B, ceil(T / block_q)]`."""
    return _first_last(_meet(q_seg, kv_seg, block_q, block_kv))


def q_tile_range(q_seg, kv_seg, block_q: int, block_kv: int):
    """For every key tile, the query tiles `[lo, hi)` that may share a segment id:
    two int32 `[B, ceil(S / block_kv)]`."""
    return _first_last(_meet(kv_seg, q_seg, block_kv, block_q))
