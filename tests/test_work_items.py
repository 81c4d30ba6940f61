"""The persistent Mosaic forward's work items: every (batch, head, tile) runs exactly
once, in the order the grid launch had, and the counter starts from zero on every call.

The deal and the numbering are plain jnp (checked here on CPU); the atomic counter that
hands items out compiled runs on a GPU only (`test_repeated_calls_agree`)."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import needs_hopper
from jax import lax
from kernel_cases import assert_close, make_inputs

import jflash
from jflash import _launch_order
from jflash._work_items import WorkItems


@pytest.mark.parametrize(
    "tiles,heads,batch,causal",
    [(3, 2, 1, True), (5, 3, 2, True), (1, 1, 1, False), (4, 7, 3, False), (64, 2, 1, True)],
)
def test_interpreter_deal_takes_every_item_once(tiles, heads, batch, causal):
    items = WorkItems.make(tiles, heads, batch, causal=causal, interpret=True)
    assert items.ctas == min(2, tiles * heads * batch)
    taken = []
    for c in range(items.ctas):
        for k in itertools.count():
            i = int(items.dealt(c, k))
            if i >= items.total:
                assert i == items.total  # past the last item: the end mark, exactly
                break
            taken.append(i)
    assert sorted(taken) == list(range(items.total))


@pytest.mark.parametrize(
    "tiles,heads,batch,group", [(3, 2, 2, 1), (80, 4, 1, 1), (80, 8, 1, 4), (2, 32, 16, 4)]
)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("rows_outer", [False, True])
def test_items_number_every_tile_heaviest_first(tiles, heads, batch, group, causal, rows_outer):
    """Item numbers map onto (batch, head, tile) one to one; under a causal mask the
    tiles come in the grid launch's order: later (heavier) tiles first, with the tiles
    or the heads outermost as `jflash._launch_order` picks. With the heads outermost,
    one KV head's `group` query heads take each tile one after another, the batch rows
    side by side or, with `rows_outer`, one row after another."""
    items = WorkItems.make(
        tiles, heads, batch, causal=causal, interpret=False, group=group, rows_outer=rows_outer
    )
    coords = [tuple(int(x) for x in items.coords(i)) for i in range(items.total)]
    assert len(set(coords)) == items.total
    assert all(0 <= b < batch and 0 <= h < heads and 0 <= t < tiles for b, h, t in coords)
    first = _launch_order.tiles_first(tiles, heads, batch, causal=causal)
    assert items.tiles_first == first
    ranks = [tiles - 1 - t for _, _, t in coords]
    if first:  # each head's heaviest tiles start before any head's lighter ones
        assert ranks == sorted(ranks)
        assert [b for b, _, _ in coords] == [i % batch for i in range(items.total)]
    else:  # one KV head after another, heaviest first, query heads in turn
        rows = [b for b, _, _ in coords]
        if rows_outer:  # row after row
            assert rows == sorted(rows)
        else:  # the rows side by side
            assert rows == [i % batch for i in range(items.total)]
        for row in range(batch) if rows_outer else [None]:  # side by side: the whole list
            kv_seen = [h // group for b, h, _ in coords if row in (None, b)]
            assert kv_seen == sorted(kv_seen)
        for b, h in itertools.product(range(batch), range(heads)):
            mine = [r for (bb, hh, _), r in zip(coords, ranks, strict=True) if (bb, hh) == (b, h)]
            assert mine == sorted(mine)
        per_tile = [(h, t) for b, h, t in coords if b == 0]
        for start in range(0, len(per_tile), group):
            run = per_tile[start : start + group]
            assert [h for h, _ in run] == [run[0][0] // group * group + m for m in range(group)]
            assert len({t for _, t in run}) == 1


def test_order_table_picks_the_tile():
    items = WorkItems.make(4, 1, 2, causal=True, interpret=False)
    order = jnp.asarray([2, 0, 3, 1, 1, 3, 0, 2], jnp.int32)  # per batch row, rank -> tile
    tiles = {tuple(int(x) for x in items.coords(i, order)) for i in range(items.total)}
    assert tiles == {(b, 0, t) for b in range(2) for t in range(4)}
    assert int(items.coords(0, order)[2]) == 2 and int(items.coords(1, order)[2]) == 1


@pytest.mark.gpu
@needs_hopper
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the counter runs compiled only")
@pytest.mark.parametrize("head_dim,segments", [(128, False), (64, False), (128, True)])
def test_repeated_calls_agree(head_dim, segments):
    """One compiled function called three times gives the same bits each time: each
    launch takes its items from a counter that starts at zero (a counter left over from
    the last call would hand out no items, leaving the output unwritten). 2 x 8 heads x
    16 tiles of 128 rows: 256 items for 132 CTAs."""
    q, k, v, *_ = make_inputs(
        0,
        batch=2,
        q_len=2048,
        kv_len=2048,
        q_heads=8,
        kv_heads=2,
        head_dim=head_dim,
        dtype=jnp.bfloat16,
    )
    seg = None
    if segments:
        seg = jnp.broadcast_to(jnp.arange(2048, dtype=jnp.int32) // 300, (2, 2048))

    @jax.jit
    def f(q, k, v):
        return jflash.flash_attention(
            q,
            k,
            v,
            causal=True,
            segment_ids=seg,
            implementation="pallas_mosaic",
            return_lse=True,
        )

    outs = [jax.block_until_ready(f(q, k, v)) for _ in range(3)]
    ref = jflash.flash_attention(q, k, v, causal=True, segment_ids=seg, implementation="xla")
    np.testing.assert_allclose(
        np.asarray(outs[0][0], np.float32), np.asarray(ref, np.float32), atol=2e-2, rtol=2e-2
    )
    for o, lse in outs[1:]:
        np.testing.assert_array_equal(np.asarray(o), np.asarray(outs[0][0]))
        np.testing.assert_array_equal(np.asarray(lse), np.asarray(outs[0][1]))


def test_vmap_folds_the_mapped_axis_into_the_batch():
    """Compiled, a vmapped forward runs as one launch over the folded batch (its work
    items share one counter). The fold and the split back, with a stand-in kernel that
    works row by row: mapped and unmapped arguments, and the sorted-ids flag true only
    where every mapped call's is."""
    from jflash._mosaic_fwd import _batch_folded

    calls = []

    def run(q, k, v, q_seg, kv_seg, ordered):
        calls.append((q.shape, k.shape))
        o = q * k[:, :1, :1] + v.sum(axis=1, keepdims=True) + q_seg[:, :, None, None]
        o = o * jnp.where(ordered, 1.0, 2.0)
        return o, (q.sum(axis=-1) * kv_seg[:, :1, None]).transpose(0, 2, 1)

    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (3, 2, 16, 4, 8))  # mapped: 3 calls of batch 2
    k = jax.random.normal(keys[1], (2, 16, 1, 8))  # shared by every call
    v = jax.random.normal(keys[2], (3, 2, 16, 1, 8))
    q_seg = jnp.arange(3 * 2 * 16, dtype=jnp.int32).reshape(3, 2, 16) % 5
    kv_seg = jnp.ones((2, 16), jnp.int32)
    axes = (0, None, 0, 0, None, 0)
    for flags, folded_flag in (([True, False, True], False), ([True] * 3, True)):
        ordered = jnp.asarray(flags)
        calls.clear()
        got = jax.vmap(_batch_folded(run), in_axes=axes)(q, k, v, q_seg, kv_seg, ordered)
        # The last call is the folded one (the first: custom_vmap tracing it unmapped).
        assert calls[-1] == ((6, 16, 4, 8), (6, 16, 1, 8))
        want = jax.vmap(run, in_axes=axes)(q, k, v, q_seg, kv_seg, jnp.full((3,), folded_flag))
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    # vmap of vmap folds both axes into one call.
    calls.clear()
    nested = jax.vmap(jax.vmap(_batch_folded(run), in_axes=axes), in_axes=axes)
    twice = lambda x: jnp.stack([x, x + 1])  # noqa: E731
    args = (twice(q), k, twice(v), twice(q_seg), kv_seg, jnp.ones((2, 3), bool))
    got = nested(*args)
    assert calls[-1] == ((12, 16, 4, 8), (12, 16, 1, 8))
    want = jax.vmap(jax.vmap(run, in_axes=axes), in_axes=axes)(*args)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.gpu
@needs_hopper
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the counter runs compiled only")
def test_vmapped_calls_agree_with_each_call():
    """Compiled, `jax.vmap` of the forward (q mapped, K/V shared) gives each call's
    own result bit for bit: one launch over the folded batch, one counter."""
    q, k, v, *_ = make_inputs(
        1, batch=3, q_len=1024, kv_len=1024, q_heads=8, kv_heads=2, head_dim=128,
        dtype=jnp.bfloat16,
    )  # fmt: skip

    def attend(q, k, v):
        return jflash.flash_attention(q, k, v, causal=True, implementation="pallas_mosaic")

    mapped = jax.jit(jax.vmap(attend, in_axes=(0, None, None)))(q[:, None], k[:1], v[:1])
    for i in range(3):
        one = jax.jit(attend)(q[i : i + 1], k[:1], v[:1])
        np.testing.assert_array_equal(np.asarray(mapped[i]), np.asarray(one))


@pytest.mark.gpu
@needs_hopper
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the counter runs compiled only")
@pytest.mark.parametrize("head_dim", [128, 64])
def test_calls_inside_a_scan_under_checkpoint_agree_with_each_call(head_dim):
    """Compiled, the forward inside `lax.scan` (a loop: one buffer for the counter
    across iterations, unless each starts from zero) under `jax.checkpoint` and
    `jax.grad`, as a model's layers call it: each iteration's output equals the same
    call made alone, bit for bit, and the gradients match the XLA path's. The scan
    stacks each layer's dQ, which the fused backward reduce-adds into an f32 buffer
    aliased to its output (split by columns at D = 128, by rows at D = 64)."""
    q, k, v, *_ = make_inputs(
        2, batch=1, q_len=2048, kv_len=2048, q_heads=8, kv_heads=2, head_dim=head_dim,
        dtype=jnp.bfloat16,
    )  # fmt: skip
    qs = jnp.stack([q, q * 0.5, q * -1.0])  # three "layers"

    def attend(q, implementation="pallas_mosaic"):
        return jflash.flash_attention(q, k, v, causal=True, implementation=implementation)

    def layers(qs, implementation="pallas_mosaic"):
        body = jax.checkpoint(lambda c, q: (c, attend(q, implementation)))
        return lax.scan(body, None, qs)[1]

    outs = jax.jit(layers)(qs)
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(outs[i]), np.asarray(jax.jit(attend)(qs[i])))

    def loss(qs, implementation="pallas_mosaic"):
        return jnp.sum(layers(qs, implementation).astype(jnp.float32) ** 2)

    got = jax.jit(jax.grad(loss))(qs)
    want = jax.jit(jax.grad(functools.partial(loss, implementation="xla")))(qs)
    assert_close([got], [want], jnp.bfloat16, names=("dq",))
