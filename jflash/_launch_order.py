"""Which grid axis the kernels launch outermost: one decision for Mosaic and Triton.

A GPU starts a kernel's CTAs in grid order and a freed SM takes the next one. Two
orders for a (tiles, heads, batch) launch whose causal tiles are numbered heaviest
first:

- heads outermost: the CTAs in flight share one head's K/V (or Q/dO) stream in L2.
  Best on long sequences; but the last heads' heaviest causal tiles start when most
  SMs are busy, a tail of up to one heavy tile.
- tiles outermost: every head's heaviest causal tile starts in the first wave and the
  lightest tiles fill the tail (longest-processing-time-first), at the price of that
  locality. Best on short causal launches with few CTAs, as on the ring's blocks.

Measured per kernel on an H200 (`benchmarks/kernel.py --launch-order`; BENCHMARKS.md,
"Launch order of short causal launches"), heads-first ÷ tiles-first device time,
causal, 32/8 heads, batch 1, Mosaic and Triton: 4k 1.11-1.64, 8k 1.04-1.28 (the dK/dV
kernel most), 16k 0.98-1.02, 32k-64k 0.98-1.02.

Packed documents change the backward's case. A key (or query) tile's causal work is
set by its document, so a row's tiles are heaviest first only within each document,
and heads outermost starts the last head's copy of the row's last long document when
every other CTA is nearly done. The Mosaic backward kernels with segment ids
(`packed=True`) therefore go tiles first at every length: each head's tiles of a
document start together. Measured on packed rows of long-tailed documents
(`--launch-order --documents`), the Mosaic dK/dV kernel's heads-first ÷ tiles-first
time: 1.08-1.09 at 32k tokens (D = 64 and 128), 1.06 / 1.00 at 64k (D = 64 / 128).
The persistent forward keeps heads outermost there (0.94-1.00 tiles first).

Where the heads are outermost, the batch rows of a launch go either side by side
(fastest) or one after another (outside the heads). One row after another, the CTAs in
flight share one row's streams in L2 instead of each row's: the Mosaic backward kernels
take it at every head dim (`_mosaic_bwd.BWD_ROWS_OUTER`), the persistent forward at
D = 128 (`_mosaic_fwd.ROWS_OUTER_HEAD_DIMS`); tiles outermost keeps the rows fastest.
"""

from __future__ import annotations

import contextlib

from jflash._validation import is_int

# Tiles outermost when a causal launch has at most this many tiles per head and CTAs.
TILES_FIRST_MAX_TILES = 64
TILES_FIRST_MAX_CTAS = 2048


def tiles_first(tiles: int, heads: int, batch: int, *, causal: bool, packed: bool = False) -> bool:
    """Whether a launch of `tiles` x `heads` x `batch` CTAs puts the tiles outermost.
    `packed`: a backward launch whose tiles' work follows a packed row's documents."""
    if TILES_FIRST_MAX_TILES < 0 or TILES_FIRST_MAX_CTAS < 0:
        return False  # `tiles_first_limits(-1, -1)`: never
    short = tiles <= TILES_FIRST_MAX_TILES and tiles * heads * batch <= TILES_FIRST_MAX_CTAS
    return causal and (packed or short)


@contextlib.contextmanager
def tiles_first_limits(max_tiles: int, max_ctas: int):
    """Kernels traced inside the block put the tiles outermost up to these limits
    instead of the measured defaults (`-1, -1`: never; very large: always), the knob
    `benchmarks/kernel.py --launch-order` times both orders with. It acts when a
    function is traced: one compiled before keeps its order."""
    global TILES_FIRST_MAX_TILES, TILES_FIRST_MAX_CTAS
    for name, value in (("max_tiles", max_tiles), ("max_ctas", max_ctas)):
        if not is_int(value):
            raise ValueError(f"{name}={value!r} must be an int (-1: never tiles first)")
    saved = TILES_FIRST_MAX_TILES, TILES_FIRST_MAX_CTAS
    TILES_FIRST_MAX_TILES, TILES_FIRST_MAX_CTAS = int(max_tiles), int(max_ctas)
    try:
        yield
    finally:
        TILES_FIRST_MAX_TILES, TILES_FIRST_MAX_CTAS = saved
