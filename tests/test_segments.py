"""Packed documents (segment ids) in the Triton kernels, and the kernels inside a
user's `jax.shard_map`.

The kernels visit only the tiles whose segment ids can meet (`jflash._segments`); these
tests check the result against the oracle where documents cross tile boundaries, fill
tiles with many tiny documents or come in no sorted order, and that a skipped tile is
never read.
"""

from __future__ import annotations

import dataclasses
import json
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import INTERPRET, quick_subset
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from kernel_cases import assert_close, make_inputs, oracle, value_and_grads

import jflash
from jflash._mask import Mask
from jflash._segments import (
    SEEDS,
    _hash,
    _table_width,
    first_positions,
    ids_sorted,
    key_first_positions,
    key_spans,
    kv_tile_range,
    q_tile_range,
)

# Small, mixed tiles: every pass cuts the sequence differently, and a few dozen tokens
# already span several tiles.
SMALL = jflash.BlockSizes(
    block_q=32,
    block_kv=16,
    block_q_dkv=16,
    block_kv_dkv=32,
    block_q_dq=16,
    block_kv_dq=32,
)


def ids_from_lengths(lengths, first_id: int = 0):
    """Segment ids `[sum(lengths)]` int32: document `i` is `lengths[i]` tokens of id
    `first_id + i`."""
    return np.repeat(np.arange(first_id, first_id + len(lengths)), lengths).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class Doc:
    """One packed-document problem: per batch row, the document lengths of the keys;
    queries are the last `q_len` key positions (causal: `q_offset = S - T`) unless
    `unsorted`."""

    name: str
    lengths: tuple[tuple[int, ...], ...]
    causal: bool = True
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    q_len: int | None = None
    unsorted: bool = False
    dtype: object = jnp.float32

    def segment_ids(self):
        kv = np.stack([ids_from_lengths(row) for row in self.lengths])
        if self.unsorted:  # the same ids in a random order along the sequence
            rng = np.random.default_rng(zlib.crc32(self.name.encode()))
            kv = np.stack([rng.permutation(row) for row in kv])
        q = kv[:, kv.shape[1] - (self.q_len or kv.shape[1]) :]
        return jnp.asarray(q), jnp.asarray(kv)


DOCS = [
    Doc("cross-tiles", ((37, 50, 41), (64, 1, 63))),
    Doc("one-token-docs", ((1, 1, 5, 1, 30, 1, 1, 20, 1, 3),)),
    Doc("many-per-tile", ((3, 5, 2, 7, 4, 1, 6, 3, 8, 2, 5, 4, 3, 6, 2, 7, 5, 3, 4, 8),)),
    Doc("unsorted", ((20, 30, 14, 32),), unsorted=True),
    Doc("unsorted-full", ((20, 30, 14, 32),), causal=False, unsorted=True),
    Doc("mqa-full", ((40, 24, 1, 31),), causal=False, q_heads=8, kv_heads=1),
    Doc("gqa-T<S", ((50, 70, 40),), q_len=72, q_heads=8, kv_heads=2),
    Doc("ragged-bf16", ((17, 33, 50),), head_dim=40, dtype=jnp.bfloat16),
    Doc("ragged-T<S-full", ((9, 60, 31),), q_len=45, causal=False, dtype=jnp.float16),
]


def _run(doc: Doc, block_sizes=SMALL):
    q_seg, kv_seg = doc.segment_ids()
    batch, kv_len = kv_seg.shape
    q_len = q_seg.shape[1]
    q, k, v, do, dlse = make_inputs(
        zlib.crc32(doc.name.encode()) % 1000,
        batch=batch,
        q_len=q_len,
        kv_len=kv_len,
        q_heads=doc.q_heads,
        kv_heads=doc.kv_heads,
        head_dim=doc.head_dim,
        dtype=doc.dtype,
    )
    offset = kv_len - q_len if doc.causal else 0  # offsets only shift the causal mask
    common = dict(causal=doc.causal, segment_ids=(q_seg, kv_seg), q_offset=offset)
    got = value_and_grads(
        jflash.flash_attention,
        q,
        k,
        v,
        do,
        dlse,
        return_lse=True,
        implementation="pallas_triton",
        interpret=INTERPRET,
        block_sizes=block_sizes,
        **common,
    )
    return got, oracle(q, k, v, do, dlse, **common)


@pytest.mark.parametrize(
    "doc",
    quick_subset(
        DOCS,
        lambda d: d.causal,
        lambda d: d.unsorted,
        lambda d: d.dtype,
        ids=lambda d: d.name,
    ),
)
def test_documents_match_oracle(doc):
    got, want = _run(doc)
    assert_close(got, want, doc.dtype)
    np.testing.assert_array_equal(np.isneginf(got[1]), np.isneginf(want[1]))


def test_default_tiles_match_oracle():
    """The default tile shapes of this device on one packed batch row."""
    doc = Doc("default-tiles", ((100, 3, 60, 1, 92),), q_heads=4, kv_heads=1, head_dim=64)
    got, want = _run(doc, block_sizes=None)
    assert_close(got, want, doc.dtype)


def test_tile_ranges_cover_every_meeting_pair():
    """For ids in any order, every (query, key) pair with equal ids lies in the tile
    ranges, and the runs left without a segment mask hold only pairs of one id; for
    sorted ids, the ranges hold exactly the tiles with such a pair and the runs exactly
    the tiles of one id."""
    rng = np.random.default_rng(0)
    bq, bk = 16, 32
    nq, nk = -(-70 // bq), -(-90 // bk)
    for sort in (True, False):
        q_seg = rng.integers(0, 4, size=(3, 70))
        kv_seg = rng.integers(0, 4, size=(3, 90))
        if sort:
            q_seg, kv_seg = np.sort(q_seg, axis=1), np.sort(kv_seg, axis=1)
        pairs = q_seg[:, :, None] == kv_seg[:, None, :]  # [B, T, S]
        meet = np.zeros((3, nq, nk), bool)
        same = np.zeros((3, nq, nk), bool)
        for i, j in np.ndindex(nq, nk):
            tile = pairs[:, i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
            meet[:, i, j], same[:, i, j] = tile.any((1, 2)), tile.all((1, 2))
        args = (jnp.asarray(q_seg), jnp.asarray(kv_seg), bq, bk)
        cols, rows = np.arange(nk), np.arange(nq)

        def spans(lo, hi, idx):
            return (idx >= np.asarray(lo)[..., None]) & (idx < np.asarray(hi)[..., None])

        first, end, same_first, same_end = kv_tile_range(*args)
        in_range, in_run = spans(first, end, cols), spans(same_first, same_end, cols)
        first, end, same_first, same_end = q_tile_range(*args)
        in_range_t = spans(first, end, rows).transpose(0, 2, 1)
        in_run_t = spans(same_first, same_end, rows).transpose(0, 2, 1)
        for ranges, runs in ((in_range, in_run), (in_range_t, in_run_t)):
            assert not (meet & ~ranges).any()
            assert not (runs & ~same).any() and not (runs & ~ranges).any()
            if sort:
                np.testing.assert_array_equal(ranges, meet)
                np.testing.assert_array_equal(runs, same)
        assert same.any() or not sort  # the sorted case has runs to check


@pytest.mark.parametrize(
    "causal, q_offset, k_offset", [(True, 0, 0), (True, 40, 0), (True, 0, 25), (False, 0, 0)]
)
def test_key_spans_are_the_mask_where_key_ids_are_sorted(causal, q_offset, k_offset):
    """Each row's `[lo, hi)` holds exactly the keys the dense mask shows it (ids, the
    causal diagonal at any offset, nothing for ids the keys lack); `ids_sorted` tells
    sorted key ids from the rest, and for those the spans would be wrong."""
    rng = np.random.default_rng(1)
    mask = Mask(causal=causal, q_offset=q_offset, k_offset=k_offset)
    q_seg = jnp.asarray(np.sort(rng.integers(0, 6, size=(3, 70)), axis=1), jnp.int32)
    kv_seg = jnp.asarray(np.sort(rng.integers(1, 5, size=(3, 90)), axis=1), jnp.int32)
    assert bool(ids_sorted(kv_seg))
    spans = np.asarray(key_spans(q_seg, kv_seg, causal=causal, diag=q_offset - k_offset, kv_len=90))
    assert spans.shape == (3, 2, 70) and spans.dtype == np.int32
    keys = np.arange(90)
    seen = (keys >= spans[:, 0, :, None]) & (keys < spans[:, 1, :, None])
    np.testing.assert_array_equal(seen, np.asarray(mask.dense(70, 90, (q_seg, kv_seg))))
    assert not seen[q_seg == 0].any() and not seen[q_seg == 5].any()  # ids with no key
    shuffled = kv_seg.at[:, :10].set(4)  # a document's keys in two places
    assert not bool(ids_sorted(shuffled))
    spans = np.asarray(key_spans(q_seg, shuffled, causal=False, diag=0, kv_len=90))
    seen = (keys >= spans[:, 0, :, None]) & (keys < spans[:, 1, :, None])
    assert (seen != np.asarray(Mask(causal=False).dense(70, 90, (q_seg, shuffled)))).any()


def test_first_positions_sort_documents_in_any_labels_and_keep_every_mask():
    """Rows whose documents are each one run of tokens come out sorted, whatever their
    labels (in order, padding labelled 0 or below at the end, shuffled, one document,
    labels far apart, 24 one-token documents labelled wider than the row); a row with an
    id in two places keeps its mask but not sorted. Every row's mask (which pairs share
    an id) stays the same."""
    top = np.iinfo(np.int32).max
    rows = {
        "padded": ids_from_lengths((5, 9, 3, 7)) + 1,
        "padded below": np.concatenate([ids_from_lengths((10, 6, 4)) + 3, [-2] * 4]),
        "sorted": ids_from_lengths((4, 8, 6, 6)) + 40,
        "one run": np.full(24, 9),
        "shuffled": np.asarray([2, 0, 3, 1])[ids_from_lengths((6, 6, 6, 6))],
        "padding id earlier": np.concatenate([ids_from_lengths((8, 8)), [0] * 8]),
        "interleaved": np.random.default_rng(0).integers(0, 3, 24),
        "ids far apart": np.concatenate([[1] * 12, [top] * 8, [0] * 4]),
        "hash-like ids": np.repeat([10**9, 7, -5 * 10**8, 123456789], 6),
        "ids wider than the row": np.arange(24)[::-1] * 2,
    }
    rows["padded"][-6:] = 0
    seg = jnp.asarray(np.stack(list(rows.values())), jnp.int32)
    got = np.asarray(jax.jit(first_positions)(seg))
    for (name, want), row in zip(rows.items(), got, strict=True):
        same = want[:, None] == want[None, :]
        np.testing.assert_array_equal(row[:, None] == row[None, :], same, err_msg=name)
        one_run_each = name not in ("padding id earlier", "interleaved")
        assert bool(np.all(np.diff(row) >= 0)) == one_run_each, name
    assert bool(ids_sorted(first_positions(seg[:5]))) and not bool(ids_sorted(seg[:5]))


def test_key_first_positions_keep_the_mask_of_any_pair():
    """A (query ids, key ids) pair relabelled by the key ids: which query meets which key
    stays the same for pairs of any lengths and values (the int32 extremes too); where
    each id's keys are one run, the key ids come out sorted; a query id no key holds
    becomes the key count (no key's label); for one array as both, the same as
    `first_positions`."""
    rng = np.random.default_rng(3)
    info = np.iinfo(np.int32)
    runs = relabelled = 0
    for trial in range(80):
        # A few lengths, so that the jitted relabelling compiles for few shapes.
        t, s = (int(x) for x in rng.choice([1, 2, 9, 24, 40], 2))
        if trial % 4 in (0, 3):  # documents as runs, labelled in any order (3: any int32)
            labels = rng.permutation(9) if trial % 4 == 0 else rng.integers(info.min, info.max, 9)
            kv = np.repeat(labels, rng.integers(1, 6, 9))[:s]
            kv = np.pad(kv, (0, s - kv.size), constant_values=kv[-1])
            kv = np.stack([kv, kv[::-1]])
        elif trial % 4 == 1:
            kv = rng.integers(-4, 12, (2, s))
        else:
            kv = rng.choice([info.min + 1, info.max, 0, 1], (2, s))
        q = rng.choice(np.concatenate([kv.ravel(), [info.min, info.max, -7, 99]]), (2, t))
        q, kv = jnp.asarray(q, jnp.int32), jnp.asarray(kv, jnp.int32)
        q_new, kv_new = (np.asarray(x) for x in jax.jit(key_first_positions)(q, kv))
        want = np.asarray(q)[:, :, None] == np.asarray(kv)[:, None, :]
        np.testing.assert_array_equal(q_new[:, :, None] == kv_new[:, None, :], want)
        if trial % 4 in (0, 3):  # sorted, or as they were (hashed ids sharing a slot)
            done = ~np.all(kv_new == np.asarray(kv), axis=1) | np.all(np.diff(kv, axis=1) >= 0)
            assert np.all(np.diff(kv_new[done], axis=1) >= 0)
            absent = ~want.any(axis=2) & done[:, None]
            np.testing.assert_array_equal(q_new[absent], s)
            runs, relabelled = runs + 2, relabelled + int(done.sum())
        if t == s:
            one = np.asarray(first_positions(kv))
            for got in key_first_positions(kv, kv):
                np.testing.assert_array_equal(np.asarray(got), one)
    # Rows of at most 9 documents in 64 hash slots or more: few share a slot.
    assert relabelled >= 0.9 * runs, (relabelled, runs)


def test_ids_that_share_hash_slots_stay_as_they_are():
    """Ids spread wider than the row are relabelled through two hash tables of their
    values: an id whose slot another id took in one table is found in the other; where
    two documents' ids share their slots in both, the row (and a pair's query ids) stay
    as they are, since one label would join the two documents."""
    width = _table_width(16)
    a = 10**9
    others = np.arange(-(10**6), 10**6)
    same = [
        np.asarray(_hash(jnp.asarray(others, jnp.int32), width, seed))
        == int(_hash(jnp.asarray([a], jnp.int32), width, seed)[0])
        for seed in SEEDS
    ]
    both, first_only, neither = (
        int(others[m & (others != a)][0])
        for m in (same[0] & same[1], same[0] & ~same[1], ~same[0] & ~same[1])
    )
    seg = jnp.asarray([[a] * 8 + [x] * 8 for x in (both, first_only, neither)], jnp.int32)
    got = np.asarray(first_positions(seg))
    np.testing.assert_array_equal(got, [seg[0], [0] * 8 + [8] * 8, [0] * 8 + [8] * 8])
    q = jnp.asarray([[x, a, 5] for x in (both, first_only, neither)], jnp.int32)
    q_new, kv_new = (np.asarray(x) for x in key_first_positions(q, seg))
    np.testing.assert_array_equal(q_new, [q[0], [8, 0, 16], [8, 0, 16]])
    np.testing.assert_array_equal(kv_new, got)


def test_flash_attention_relabels_an_id_pair(monkeypatch):
    """A `(q_ids, kv_ids)` pair whose documents are labelled out of order reaches the
    kernel as sorted ids (relabelled by the key ids, as one array is by its own), and
    the answer is the oracle's on the ids as given."""
    from jflash import _dispatch

    seen = []

    def spy(*args, segs, **kwargs):
        jax.debug.callback(lambda *ids: seen.extend(np.asarray(i) for i in ids), *segs)
        return xla_fwd(*args, segs=segs, **kwargs)

    xla_fwd = _dispatch.xla_fwd
    monkeypatch.setattr(_dispatch, "xla_fwd", spy)
    kv_seg = np.asarray([3, 0, 2, 1])[ids_from_lengths((20, 12, 16, 16))][None]
    q_seg = kv_seg[:, 16:].copy()
    q_seg[:, -4:] = 8  # no key has id 8: those rows see nothing
    shape = dict(batch=1, q_len=48, kv_len=64, q_heads=4, kv_heads=2, head_dim=32)
    q, k, v = make_inputs(5, **shape, dtype=jnp.float32)[:3]
    segs = (jnp.asarray(q_seg), jnp.asarray(kv_seg))
    out = jflash.flash_attention(q, k, v, causal=False, segment_ids=segs, implementation="xla")
    out = jax.block_until_ready(out)
    assert len(seen) == 2 and np.all(np.diff(seen[1], axis=1) >= 0), seen
    want, _ = jflash.attention_reference(q, k, v, causal=False, segment_ids=segs)
    np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(out)[:, -4:], 0)


@pytest.mark.parametrize("implementation", ["pallas_triton", "xla"])
def test_padding_at_a_rows_end_masks_as_labelled(implementation):
    """`flash_attention` with one id array whose rows end in padding labelled 0: the
    oracle's result on the ids as given (the padding attends within itself), and the
    same bits as the same documents labelled in order (the same sorted ids reach the
    kernels)."""
    lengths = ((20, 30, 14), (9, 41, 14))
    padded = np.stack([ids_from_lengths(row) + 1 for row in lengths])
    padded[:, -14:] = 0
    in_order = np.stack([ids_from_lengths(row) for row in lengths])
    q, k, v, do, dlse = make_inputs(
        7, batch=2, q_len=64, kv_len=64, q_heads=4, kv_heads=2, head_dim=32, dtype=jnp.float32
    )
    kernel = dict(causal=True, implementation=implementation)
    if implementation == "pallas_triton":
        kernel.update(block_sizes=SMALL, interpret=INTERPRET)

    def attend(ids):
        ids = jnp.asarray(ids)
        return value_and_grads(
            jflash.flash_attention, q, k, v, do, dlse, return_lse=True, segment_ids=ids, **kernel
        )

    got = attend(padded)
    want = oracle(q, k, v, do, dlse, causal=True, segment_ids=jnp.asarray(padded))
    assert_close(got, want, jnp.float32)
    alike = attend(in_order)
    for a, b in zip(got, alike, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_skipped_tiles_are_never_read(causal):
    """Key tiles of a document no query has are NaN: were any kernel to load them, the
    NaN would reach the output or the gradients (0 * NaN). Query rows of a document no
    key has see nothing: output 0, LSE -inf, gradients 0."""
    q_seg = ids_from_lengths((32, 32, 32))  # documents 0, 1, 2
    q_seg[32:64] = 7  # no key has id 7
    kv_seg = ids_from_lengths((32, 64, 32))  # 0, 1 (no query), 2
    kv_seg[32:96] = 5
    q_seg, kv_seg = jnp.asarray(q_seg[None]), jnp.asarray(kv_seg[None])
    q, k, v, do, dlse = make_inputs(
        3, batch=1, q_len=96, kv_len=128, q_heads=4, kv_heads=2, head_dim=32, dtype=jnp.float32
    )
    hidden = (kv_seg == 5)[:, :, None, None]
    k_nan, v_nan = jnp.where(hidden, jnp.nan, k), jnp.where(hidden, jnp.nan, v)
    # Queries at positions 32..127: causally they see every key of their document.
    common = dict(causal=causal, segment_ids=(q_seg, kv_seg), q_offset=32 if causal else 0)
    bs = jflash.BlockSizes(
        block_q=32, block_kv=32, block_q_dkv=32, block_kv_dkv=32, block_q_dq=32, block_kv_dq=32
    )
    kernel = dict(implementation="pallas_triton", interpret=INTERPRET, block_sizes=bs, **common)
    got = value_and_grads(
        jflash.flash_attention, q, k_nan, v_nan, do, dlse, return_lse=True, **kernel
    )
    want = oracle(q, k, v, do, dlse, **common)
    for name, x in zip(("out", "lse", "dq", "dk", "dv"), got, strict=True):
        x = np.asarray(x)
        assert not np.isnan(x).any(), f"{name} has NaN: a skipped tile was read"
    assert_close(got, want, jnp.float32)
    _, lse = jflash.flash_attention(q, k_nan, v_nan, return_lse=True, **kernel)
    np.testing.assert_array_equal(np.isneginf(lse[:, :, 32:64]), True)
    np.testing.assert_array_equal(got[0][:, 32:64], 0.0)
    np.testing.assert_array_equal(got[2][:, 32:64], 0.0)
    np.testing.assert_array_equal(np.asarray(got[3])[:, 32:96], 0.0)
    np.testing.assert_array_equal(np.asarray(got[4])[:, 32:96], 0.0)


def _sharded_inputs(mesh):
    lengths = ((20, 30, 14), (64,), (1, 62, 1), (10, 10, 44))
    seg = jnp.asarray(np.stack([ids_from_lengths(row) for row in lengths]))
    inputs = make_inputs(
        5, batch=4, q_len=64, kv_len=64, q_heads=4, kv_heads=2, head_dim=32, dtype=jnp.float32
    )
    return [jax.device_put(x, NamedSharding(mesh, P("data"))) for x in (*inputs, seg)]


def _per_shard(q, k, v, do, dlse, seg):
    return value_and_grads(
        jflash.flash_attention,
        q,
        k,
        v,
        do,
        dlse,
        return_lse=True,
        causal=True,
        segment_ids=seg,
        implementation="pallas_triton",
        interpret=INTERPRET,
        block_sizes=SMALL,
    )


@pytest.mark.parametrize("check_vma", [True, False], ids=["check_vma", "no_check_vma"])
def test_inside_shard_map(check_vma):
    """Forward and gradients per shard inside a user's `shard_map` over "data" (4 CPU
    devices; on a GPU machine as many GPUs as there are, up to 4), with `check_vma` on
    and off, interpreted or compiled."""
    mesh = jax.make_mesh((min(4, jax.device_count()),), ("data",))
    with jax.set_mesh(mesh):
        q, k, v, do, dlse, seg = _sharded_inputs(mesh)
        fn = jax.jit(
            jax.shard_map(_per_shard, in_specs=P("data"), out_specs=P("data"), check_vma=check_vma)
        )
        got = fn(q, k, v, do, dlse, seg)
    want = oracle(
        *(np.asarray(x) for x in (q, k, v, do, dlse)), causal=True, segment_ids=np.asarray(seg)
    )
    assert_close(got, want, jnp.float32)


def test_inside_shard_map_lowers_for_cuda(monkeypatch):
    """Compiled for CUDA on a machine without a GPU: forward and both backward kernels
    inside `shard_map(check_vma=True)` take the manual-axis types of their inputs."""
    from jax._src import mesh as mesh_lib

    import jflash._dispatch as dispatch

    monkeypatch.setattr(dispatch, "_platform", lambda: "gpu")
    h100 = mesh_lib.AbstractDevice("NVIDIA H100 80GB HBM3", 132, "gpu")
    mesh = jax.sharding.AbstractMesh((4,), ("data",), abstract_device=h100)
    sharded = NamedSharding(mesh, P("data"))
    q = jax.ShapeDtypeStruct((8, 256, 4, 64), jnp.bfloat16, sharding=sharded)
    kv = jax.ShapeDtypeStruct((8, 256, 2, 64), jnp.bfloat16, sharding=sharded)
    seg = jax.ShapeDtypeStruct((8, 256), jnp.int32, sharding=sharded)

    def grads(q, k, v, seg):
        def loss(q, k, v):
            out = jflash.flash_attention(
                q,
                k,
                v,
                causal=True,
                segment_ids=seg,
                implementation="pallas_triton",
                interpret=False,
            )
            return jnp.sum(out.astype(jnp.float32))

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    with jax.sharding.use_abstract_mesh(mesh):
        fn = jax.shard_map(grads, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
        text = jax.jit(fn).trace(q, kv, kv, seg).lower(lowering_platforms=("cuda",)).as_text()
    for name in ("jflash_fwd", "jflash_bwd_dkv", "jflash_bwd_dq"):
        assert name in text, f"{name} missing from the CUDA lowering"


@pytest.mark.slow
def test_documents_benchmark_on_cpu(tmp_path):
    """`benchmarks/kernel.py --documents` end to end at a tiny size: every row, the
    lengths pack the tokens exactly, the JSON is written."""
    from benchmarks import kernel

    lengths = kernel.document_lengths(65536)
    assert sum(lengths) == 65536 and 9000 <= max(lengths) <= 16384
    kernel.main(
        [
            "--documents",
            "--documents-tokens",
            "128",
            "--heads",
            "2",
            "--kv-heads",
            "1",
            "--head-dim",
            "32",
            "--iters",
            "1",
            "--rounds",
            "2",
            "--out",
            str(tmp_path),
            "--interpret",
        ]
    )
    (path,) = tmp_path.glob("kernel-documents-*.json")
    payload = json.loads(path.read_text())
    timed = [r for r in payload["rows"] if "fwd_ms" in r]
    assert timed and all(r["rounds"] == 2 for r in timed)
    assert sum(payload["lengths"]) == 128
    rows = {(r["impl"], r["mask"]): r for r in payload["rows"]}
    for key in (
        ("jflash (default)", "documents"),
        ("jflash (default)", "one document"),
        ("jflash pallas_triton", "documents"),
    ):
        assert rows[key]["fwd_tflops"] > 0 and rows[key]["fwdbwd_tflops"] > 0, key
    assert rows["jflash pallas_triton", "documents"]["max_abs_diff"] <= 0.05
    fa3 = rows["flash_attn3_jax varlen", "documents"]
    assert "fwd_tflops" in fa3 or "fwd_error" in fa3


def test_documents_tune_times_mosaic_block_sizes_on_the_packed_row(tmp_path, monkeypatch):
    """`kernel.py --documents --tune`: each Mosaic candidate's block sizes reach
    `flash_attention` with the packed row's segment ids, one row per candidate beside
    jflash's default and FA3 (here every call runs the XLA path: CPU)."""
    import jflash
    from benchmarks import kernel

    seen, real = [], jflash.flash_attention

    def spy(q, k, v, *, implementation=None, block_sizes=None, segment_ids=None, **kw):
        seen.append((implementation, block_sizes, segment_ids is not None))
        return real(q, k, v, implementation="xla", segment_ids=segment_ids, **kw)

    monkeypatch.setattr(jflash, "flash_attention", spy)
    tiny = ["--documents-tokens", "128", "--heads", "2", "--kv-heads", "1", "--head-dim", "64"]
    kernel.main(["--documents", "--tune", "--which", "fwd", *tiny, "--iters", "1",
                 "--rounds", "1", "--out", str(tmp_path), "--interpret"])  # fmt: skip
    (path,) = tmp_path.glob("kernel-documents-*.json")
    rows = {r["impl"]: r for r in json.loads(path.read_text())["rows"]}
    labels = [label for _, _, label in kernel.mosaic_candidates(kernel.argparse.Namespace(
        head_dim=64, which="fwd"), 128)]  # fmt: skip
    assert labels and all(label.startswith("fwd kv") for label in labels)
    for label in labels:
        assert rows[f"jflash_mosaic {label}"]["fwd_tflops"] > 0
    assert "jflash pallas_triton" not in rows
    tuned = [(bs.block_kv, bs.num_stages) for impl, bs, ids in seen if impl == "pallas_mosaic"]
    assert all(ids for impl, _, ids in seen if impl == "pallas_mosaic")
    assert {f"fwd kv{b} s{s}" for b, s in tuned} == set(labels)
