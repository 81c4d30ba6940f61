"""The persistent Mosaic forward's work items: which (batch, head, query tile) a CTA
runs next, and in what order the items are taken.

A persistent launch runs one CTA per SM; each CTA takes work items, one at a time,
until none are left. Compiled, the next item comes from an atomic counter in HBM
(`take_ticket`), so a CTA that finishes early takes more, as the hardware's scheduler
does for a grid of one CTA per item; the GPU interpreter, which has no atomics, deals
them in a fixed order (`WorkItems.dealt`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import memref
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from jflash import _launch_order
from jflash._mosaic_common import TABLE_COLS, WG_ROWS, Geometry, kv_range
from jflash._triton_common import index

# CTAs of a persistent launch in the GPU interpreter: two, so tests run several work
# items per CTA, both directions of the deal and a partial last round.
INTERPRET_CTAS = 2
HOPPER_SMS = 132  # H100 / H200 SXM, where no CUDA device is visible (lowering on CPU)


def sm_count() -> int:
    """Streaming multiprocessors of the first CUDA device (132 on an H100 or H200)."""
    try:
        return int(jax.devices("cuda")[0].core_count)
    except (RuntimeError, AttributeError, IndexError, TypeError, ValueError):
        return HOPPER_SMS


@dataclasses.dataclass(frozen=True)
class WorkItems:
    """A persistent launch: `ctas` CTAs (one per SM, grid axis `cta`) share the
    `tiles x heads x batch` work items that a grid launch would give one CTA each.

    Items are numbered in the order `jflash._launch_order` picks for the grid (its outer
    axis first, batch fastest; with the heads outermost, one KV head's query heads
    take each tile in turn, so that the `group` items that read one K/V stream run
    side by side; with `rows_outer` as well, one batch row after another, so that the
    items in flight share fewer K/V streams), tile rank `r` being tile `tiles - 1 - r`
    (causal rows near the end see the most keys: heaviest first), or `order[b, r]`
    where an order table is given (packed documents: `heaviest_first`). Compiled, a
    CTA takes its next item from an atomic counter when it starts the previous one
    (`take_ticket`), so a CTA that finishes early takes more: what the hardware's CTA
    scheduler does for a grid launch, without a CTA launch per tile, and with each
    item's first K/V and Q loads overlapping the previous item's epilogue. The GPU
    interpreter has no atomics: there CTA `c` takes items `c, 2C - 1 - c, 2C + c,
    ...` (a snake, `dealt`)."""

    tiles: int
    heads: int
    batch: int
    ctas: int
    tiles_first: bool
    group: int = 1  # query heads per KV head
    rows_outer: bool = False  # heads outermost: the batch rows outside them

    @classmethod
    def make(
        cls,
        tiles: int,
        heads: int,
        batch: int,
        *,
        causal: bool,
        interpret: bool,
        group: int = 1,
        rows_outer: bool = False,
    ):
        total = tiles * heads * batch
        ctas = min(total, INTERPRET_CTAS if interpret else sm_count())
        first = _launch_order.tiles_first(tiles, heads, batch, causal=causal)
        return cls(tiles, heads, batch, ctas, first, group, rows_outer and not first)

    @property
    def total(self) -> int:
        return self.tiles * self.heads * self.batch

    @property
    def needs_order(self) -> bool:
        """Packed rows: whether the items take their tiles from an order (`order[b, r]`,
        `heaviest_first`): a row of one query tile has one order, and no table is passed
        for it (`_mosaic_fwd._launch` says why)."""
        return self.tiles > 1

    @property
    def grid(self) -> dict:
        return dict(grid=(self.ctas,), grid_names=("cta",))

    def coords(self, i, order_ref=None):
        """Item `i` -> `(batch, head, tile)` int32 scalars."""
        i = index(i)
        if self.rows_outer:
            per_row = jnp.int32(self.tiles * self.heads)
            b, outer = lax.div(i, per_row), lax.rem(i, per_row)
        else:
            nb = jnp.int32(self.batch)
            b, outer = lax.rem(i, nb), lax.div(i, nb)
        if self.tiles_first:
            rank = lax.div(outer, jnp.int32(self.heads))
            head = lax.rem(outer, jnp.int32(self.heads))
        else:
            # One KV head's query heads after another, each tile's `group` query heads
            # side by side: they read the same K/V while it is in L2.
            g = jnp.int32(self.group)
            member = lax.rem(outer, g)
            rank = lax.rem(lax.div(outer, g), jnp.int32(self.tiles))
            kv_head = lax.div(outer, g * jnp.int32(self.tiles))
            head = kv_head * g + member
        if order_ref is None:
            tile = jnp.int32(self.tiles - 1) - rank
        else:
            tile = order_ref[b * jnp.int32(self.tiles) + rank]
        return b, head, tile

    def dealt(self, c, k):
        """The GPU interpreter's deal: CTA `c`'s `k`-th item (`total` past its last)."""
        c, k = index(c), index(k)
        forward = lax.rem(k, jnp.int32(2)) == 0
        i = k * jnp.int32(self.ctas) + jnp.where(forward, c, jnp.int32(self.ctas - 1) - c)
        return jnp.minimum(i, jnp.int32(self.total))


def take_ticket(counter_ref, ticket_ref) -> None:
    """One thread of the warpgroup adds 1 to `counter_ref` (`[1]` int32 in HBM, zero
    at launch) and writes the value it had into `ticket_ref` (`[1]` int32 in SMEM),
    which the whole warpgroup may read on return (compiled only)."""

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()))
    def _(ctx, counter, ticket):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        mgpu_utils.warpgroup_barrier()  # every thread has read the last ticket
        with mgpu_utils.single_thread(scope=mgpu_utils.ThreadSubset.WARPGROUP):
            old = mgpu_utils.inline_ptx(
                "atom.relaxed.gpu.global.add.u32 $0, [$1], $2;",
                mgpu_utils.memref_ptr(counter),
                mgpu_utils.c(1, i32),
                result_types=i32,
                has_side_effects=True,
            )
            memref.store(old, ticket, [mgpu_utils.c(0, ir.IndexType.get())])
        mgpu_utils.warpgroup_barrier()

    _(counter_ref, ticket_ref)


def heaviest_first(table, tiles: int, wgs: int, batch: int, block_kv: int, geom: Geometry):
    """Packed documents, persistent forward: int32 `[B * tiles]`, each batch row's
    query tiles (`wgs` warpgroup tiles each) by the key steps they stream, most first
    (ties: the later tile first). `table`: `query_table` of the warpgroup tiles."""
    t = table[: batch * tiles * wgs * TABLE_COLS].reshape(batch, tiles, wgs, TABLE_COLS)
    first, end = t[..., 0], t[..., 1]
    q_start = (jnp.arange(tiles * wgs, dtype=jnp.int32) * WG_ROWS).reshape(tiles, wgs)
    _, n_end = kv_range(geom, q_start, WG_ROWS, block_kv)
    end = jnp.minimum(end, n_end[None])
    live = end > first
    lo = jnp.where(live, first, jnp.int32(2**30)).min(axis=-1)
    hi = jnp.where(live, end, jnp.int32(0)).max(axis=-1)
    steps = jnp.maximum(hi - lo, 0)
    key = -(steps * jnp.int32(tiles) + jnp.arange(tiles, dtype=jnp.int32)[None])
    return jnp.argsort(key, axis=-1).astype(jnp.int32).reshape(-1)
