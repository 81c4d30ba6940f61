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

An H100's memory has 0.7x the H200's bandwidth (3.35 against 4.8 TB/s), and there the
Mosaic dK/dV kernel, which streams Q, dO and the per-query terms of every query head
of its group, loses more to tiles outermost than it gains from the order: 0.835 at 8k
(2.45 against 2.93 ms), where 4k still reads 1.12 and the forward 1.14 / 1.03 at 4k /
8k. So on GPUs of that bandwidth (`NARROW_MEMORY_KINDS`) a dK/dV launch goes tiles first
up to half the tile limit (32 key tiles: 4k).

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
import functools

import jax

from jflash._validation import is_int

# Tiles outermost when a causal launch has at most this many tiles per head and CTAs.
TILES_FIRST_MAX_TILES = 64
TILES_FIRST_MAX_CTAS = 2048
# GPUs (`device_kind` substrings) whose memory bandwidth halves the dK/dV kernel's tile
# limit: the H100 and H800 (HBM3, 2-3.35 TB/s; the module docstring).
NARROW_MEMORY_KINDS = ("H100", "H800")


@functools.cache
def narrow_memory() -> bool:
    """Whether the first CUDA device is one of `NARROW_MEMORY_KINDS` (False without one)."""
    try:
        kind = jax.devices("cuda")[0].device_kind
    except (RuntimeError, IndexError, AttributeError):
        return False
    return any(name in kind for name in NARROW_MEMORY_KINDS)


def tiles_first(
    tiles: int, heads: int, batch: int, *, causal: bool, packed: bool = False, dkv: bool = False
) -> bool:
    """Whether a launch of `tiles` x `heads` x `batch` CTAs puts the tiles outermost.
    `packed`: a backward launch whose tiles' work follows a packed row's documents.
    `dkv`: the Mosaic dK/dV kernel's launch (half the tile limit on `narrow_memory`
    GPUs)."""
    if TILES_FIRST_MAX_TILES < 0 or TILES_FIRST_MAX_CTAS < 0:
        return False  # `tiles_first_limits(-1, -1)`: never
    max_tiles = TILES_FIRST_MAX_TILES // 2 if dkv and narrow_memory() else TILES_FIRST_MAX_TILES
    short = tiles <= max_tiles and tiles * heads * batch <= TILES_FIRST_MAX_CTAS
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
