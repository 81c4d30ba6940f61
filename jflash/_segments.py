"""Which tiles packed documents let meet (segment ids -> loop bounds).

Attention stays inside equal segment ids. A query tile and a key tile whose id ranges
`[min, max]` do not overlap cannot meet, so the kernels skip them instead of computing
and masking them. For packed documents (ids non-decreasing along the sequence) the
tiles that may meet a query tile are one contiguous run of key tiles, so loop bounds
skip exactly the tiles that hold no pair of the same document; for ids in any other
order the bounds stay correct (every tile that may meet lies inside them) but skip less.

Inside that run, tiles where both sides hold one and the same id need no segment mask:
each range also names the run of such tiles (`[same_first, same_end)`, inside
`[first, end)`), so the kernels compare ids only on tiles at document boundaries.

Where the key ids are sorted (packed documents, in every jflash layout's shards), the
keys a query row sees are one span `[lo, hi)`: its document's keys, cut at the causal
diagonal and the real key length (`key_spans`). The Mosaic forward then masks a tile
with two comparisons of the key position against the row's span instead of comparing
the rows' ids with the key ids streamed beside K.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax


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


def _same(rows_seg, cols_seg, block_rows: int, block_cols: int):
    """`[B, n_rows, n_cols]` bool: tiles whose every pair holds one and the same id."""
    rmin, rmax = tile_bounds(rows_seg, block_rows)
    cmin, cmax = tile_bounds(cols_seg, block_cols)
    row_one, col_one = rmin == rmax, cmin == cmax
    return row_one[:, :, None] & col_one[:, None, :] & (cmin[:, None, :] == rmin[:, :, None])


def _ranges(rows_seg, cols_seg, block_rows: int, block_cols: int):
    """Per row tile, four int32 `[B, n_rows]`: `(first, end)`, the column tiles that may
    meet (`first == end == 0`: none), and `(same_first, same_end)`, the run of column
    tiles from the first one that needs no segment mask (`same_first == same_end ==
    first` when there is none)."""
    meet = _meet(rows_seg, cols_seg, block_rows, block_cols)
    same = _same(rows_seg, cols_seg, block_rows, block_cols)
    c = meet.shape[-1]
    idx = jnp.arange(c, dtype=jnp.int32)
    first = jnp.where(meet.any(axis=-1), jnp.where(meet, idx, c).min(axis=-1), 0)
    end = jnp.where(meet, idx + 1, 0).max(axis=-1)
    same_first = jnp.where(same, idx, c).min(axis=-1)
    # The run stops at the first tile past `same_first` that needs the mask.
    same_end = jnp.where(~same & (idx >= same_first[..., None]), idx, c).min(axis=-1)
    none = same_first == c
    same_first = jnp.where(none, first, same_first)
    same_end = jnp.where(none, first, same_end)
    return tuple(x.astype(jnp.int32) for x in (first, end, same_first, same_end))


def kv_tile_range(q_seg, kv_seg, block_q: int, block_kv: int):
    """For every query tile, the key tiles `[first, end)` that may share a segment id
    and the run `[same_first, same_end)` inside it that needs no segment mask: four
    int32 `[B, ceil(T / block_q)]`."""
    return _ranges(q_seg, kv_seg, block_q, block_kv)


def q_tile_range(q_seg, kv_seg, block_q: int, block_kv: int):
    """For every key tile, the query tiles `[first, end)` that may share a segment id
    and the run `[same_first, same_end)` inside it that needs no segment mask: four
    int32 `[B, ceil(S / block_kv)]`."""
    return _ranges(kv_seg, q_seg, block_kv, block_q)


@jax.custom_batching.custom_vmap
def ids_sorted(seg):
    """Scalar bool: every row of segment ids `[B, L]` is non-decreasing.

    Under `jax.vmap` it stays one scalar, over the rows of every mapped call (`_all_rows`):
    the forward's `lax.cond` on it then still runs one kernel, where a mapped flag would
    make it a select between both kernels, each run on every call.

    Reduced in a kernel of its own: fused into the small concatenation that consumes
    it, XLA ran the whole reduction in a few threads at some shapes (H200: 0.16-0.18 ms
    for one row of 8k or 16k ids, 0.54 ms for four of 4k, against 0.01 ms alone; at 16k
    a twentieth of a D = 128 forward)."""
    return lax.optimization_barrier(jnp.all(seg[:, 1:] >= seg[:, :-1]))


@ids_sorted.def_vmap
def _all_rows(axis_size, in_batched, seg):
    """`ids_sorted` of the rows of all mapped calls (mapped axis first): not mapped."""
    del axis_size
    (batched,) = in_batched
    if batched:
        seg = seg.reshape(-1, seg.shape[-1])
    return ids_sorted(seg), False


def first_positions(seg):
    """Self-attention ids `[B, L]` relabelled by where each id first occurs in its row.

    The mask is the same (equal ids stay equal, different ids different), and where
    each id is one run of tokens (documents, whatever their labels: padding labelled 0
    at a row's end as MaxText and grain label it, labels in any order, hashes or
    dataset indices) the new ids are sorted along the row, so the kernels take sorted
    ids' fast path (`ids_sorted`): key spans instead of the id compare, and tiles
    skipped by id ranges that labels out of order would widen to every document
    between them. Scatters of the runs' starts into two tables and a few gathers (no
    sort, no scan): the sorted rows of every packed call pay for it (`_first`)."""
    ((label, found),) = _first(seg, seg)
    exact = jnp.all(found, axis=1, keepdims=True)
    return jnp.where(exact, label.astype(seg.dtype), seg)


def key_first_positions(q_seg, kv_seg):
    """A `(query ids [B, T], key ids [B, S])` pair relabelled as `first_positions`
    relabels one array, by where each id first occurs among the row's key ids: the key
    ids as `first_positions(kv_seg)`, a query id by its key's label, and a query id that
    no key holds by `S`, which no key's label is (that row sees no key, as before). Rows
    that `first_positions` keeps as they are stay so. The mask is the same; where each
    id's keys are one run, the key ids come out sorted, so a pair labelled in any order
    takes sorted ids' fast path as one array does."""
    # A query id that no key holds is not found: its label is `S`.
    (kv_new, kv_found), (q_new, _) = _first(kv_seg, kv_seg, q_seg)
    exact = jnp.all(kv_found, axis=1, keepdims=True)
    return (
        jnp.where(exact, q_new.astype(q_seg.dtype), q_seg),
        jnp.where(exact, kv_new.astype(kv_seg.dtype), kv_seg),
    )


def _first(table_ids, *lookups):
    """For each of `lookups` (ids `[B, M]`), `(label [B, M], found [B, M])`: where each
    id first occurs in its row of `table_ids [B, L]` (`L` where it is not found).

    Two tables per row (one scatter), each slot holding the first position of the runs
    that start in it (the runs' starts only are scattered, so a long document is not
    thousands of atomics on one address). The first has a slot per value where the
    row's ids span fewer than `L` values, exact then; otherwise both hash the ids, with
    different seeds, into a power of two of at least `2 L` slots. A slot's position is
    an id's first position exactly when that position holds the id (a position holding
    the id is never before its first, and the slot's is never after it), so an id is
    found unless another id took its slot in both tables: for a row of n documents
    about n³ / (4 L)² of the time (`first_positions` then keeps the row as it is)."""
    b, length = table_ids.shape
    width = _table_width(length)
    lo = table_ids.min(axis=1, keepdims=True)
    # Offsets from the row's smallest id, unsigned: exact over the whole int range.
    narrow = (table_ids.max(axis=1, keepdims=True) - lo).astype(_unsigned(lo)) < length

    def slots(x):
        """`[B, 2 M]`: `x`'s slots in both tables, the second's after the first's."""
        offset = (x - lo).astype(_unsigned(x))
        by_value = jnp.where((x >= lo) & (offset < length), offset, 0).astype(jnp.int32)
        one, two = (_hash(x, width, seed) for seed in SEEDS)
        return jnp.concatenate([jnp.where(narrow, by_value, one), two + width], axis=1)

    twice = functools.partial(jnp.tile, reps=(1, 2))
    t = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
    rows = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, 2 * length))
    start = jnp.concatenate([jnp.ones((b, 1), bool), table_ids[:, 1:] != table_ids[:, :-1]], axis=1)
    own = slots(table_ids)
    bins = jnp.where(twice(start), own, 2 * width)  # out of bounds: dropped
    first = jnp.full((b, 2 * width), length, jnp.int32).at[rows, bins].min(twice(t), mode="drop")

    def look_up(ids):
        at = jnp.take_along_axis(first, own if ids is table_ids else slots(ids), axis=1)
        held = jnp.take_along_axis(table_ids, jnp.minimum(at, length - 1), axis=1)
        hit = (at < length) & (held == twice(ids))
        (at_one, at_two), (hit_one, hit_two) = jnp.split(at, 2, axis=1), jnp.split(hit, 2, axis=1)
        return jnp.where(hit_one, at_one, jnp.where(hit_two, at_two, length)), hit_one | hit_two

    return [look_up(ids) for ids in lookups]


SEEDS = (0, 0x9E3779B9)  # `_first`'s two tables' hashes


def _table_width(length: int) -> int:
    """`_first`'s slots per table and row of `length` ids: a power of two, at least
    `2 * length`."""
    return 1 << max(1, (2 * length - 1).bit_length())


def _unsigned(seg):
    return jnp.uint64 if seg.dtype.itemsize > 4 else jnp.uint32


def _mix(x):
    """A bijection of uint32 that spreads every input bit over the output's high bits
    (MurmurHash3's finaliser)."""
    for shift, mult in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        x = (x ^ (x >> shift)) * jnp.uint32(mult)
    return x ^ (x >> 16)


def _hash(ids, width: int, seed: int = 0):
    """Ids of any int dtype -> int32 slots in `[0, width)` (`width` a power of two),
    from all of their bits."""
    bits = lax.bitcast_convert_type(ids, _unsigned(ids))
    if ids.dtype.itemsize > 4:
        high = _mix((bits >> 32).astype(jnp.uint32))
        bits = bits.astype(jnp.uint32) ^ high  # the low 32 bits, the high mixed in
    mixed = _mix(bits ^ jnp.uint32(seed))
    return (mixed >> (33 - width.bit_length())).astype(jnp.int32)


def _search(sorted_ids, ids, side: str):
    """Per row, where each of `ids [B, M]` falls in `sorted_ids [B, L]`: int32 `[B, M]`.
    Unrolled, so that no XLA while loop runs inside the attention call."""

    def one(row_sorted, row_ids):
        return jnp.searchsorted(row_sorted, row_ids, side=side, method="scan_unrolled")

    return jax.vmap(one)(sorted_ids, ids).astype(jnp.int32)


def key_spans(q_seg, kv_seg, *, causal: bool, diag: int, kv_len: int):
    """`[B, 2, T]` int32: for each query row the keys `[lo, hi)` it sees, exact where
    `kv_seg` is sorted (`ids_sorted`): the keys of its id (none: `lo == hi`), with
    `hi` cut at the real key length and, if `causal`, after the row's diagonal (row
    `i` sees key `j` when `i + diag >= j`)."""
    lo, hi = (_search(kv_seg, q_seg, side) for side in ("left", "right"))
    hi = jnp.minimum(hi, jnp.int32(kv_len))
    if causal:
        rows = jnp.arange(q_seg.shape[1], dtype=jnp.int32) + jnp.int32(diag + 1)
        hi = jnp.minimum(hi, rows[None])
    return jnp.stack([lo, hi], axis=1)
