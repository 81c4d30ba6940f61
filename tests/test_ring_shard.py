"""`jflash.ring_attention_shard` inside a user's `jax.shard_map`, and packed documents
(segment ids) through both ring forms, against the unsharded dense oracle.

The user code here is what a JAX user writes: per-shard model code in their own
`shard_map` over a `("data", "seq")` mesh (full, or partial over `seq` only), with
the default `check_vma=True`.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import INTERPRET, MOSAIC_ONE_DEVICE_LEN, needs_hopper, quick_subset
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from kernel_cases import TOLERANCE, assert_close, make_inputs, oracle, random_segments

import jflash


@dataclasses.dataclass(frozen=True)
class Case:
    num_shards: int = 2  # P (the ring's P for the hybrid strategy)
    a2a: int = 1  # the all-to-all degree of the hybrid strategy
    data: int = 1
    layout: str = "zigzag"
    strategy: str = "ring"
    causal: bool = True
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    seq_len: int = 96
    batch: int = 2
    documents: int = 0  # 0: no segment ids
    # How the documents are labelled: "sorted" (0, 1, ...), "padded" (1, 2, ... and the
    # last document 0, as packers label the padding that ends a row) or "permuted".
    labels: str = "sorted"
    partial: bool = False  # shard_map over `seq` only; `data` stays automatic
    implementation: str = "xla"
    dtype: type = jnp.float32

    def __str__(self):
        parts = [
            f"P{self.num_shards}" + (f"x{self.a2a}" if self.a2a > 1 else ""),
            f"D{self.data}",
            self.layout,
            self.strategy,
            "causal" if self.causal else "full",
            f"N{self.q_heads}K{self.kv_heads}",
            f"T{self.seq_len}",
        ]
        if self.documents:
            parts.append(f"docs{self.documents}")
        if self.labels != "sorted":
            parts.append(self.labels)
        if self.partial:
            parts.append("partial")
        parts.append(self.implementation)
        if self.dtype != jnp.float32:
            parts.append(jnp.dtype(self.dtype).name)
        return "-".join(parts)

    @property
    def seed(self) -> int:
        """From the case, its labels left out: the same inputs under any labels."""
        return zlib.crc32(str(dataclasses.replace(self, labels="sorted")).encode())


def _mesh(case: Case):
    n = case.data * case.num_shards * case.a2a
    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices")
    shape = (case.data, case.num_shards, case.a2a)
    return jax.make_mesh(shape, ("data", "seq", "a2a"), devices=jax.devices()[:n])


def _user_fn(case: Case, mesh):
    """What the user writes: natural-order arrays in, their own shard_map around
    `ring_attention_shard`, natural-order `(out, lse)` out."""
    p, layout = case.num_shards, case.layout
    axis = ("seq", "a2a") if case.strategy == "hybrid" else "seq"
    batch = None if case.partial else "data"
    qkv, lse_spec, seg = P(batch, axis), P(batch, None, axis), P(batch, axis)

    def per_shard(q, k, v, segs):
        return jflash.ring_attention_shard(
            q,
            k,
            v,
            axis_name=axis,
            causal=case.causal,
            layout=case.layout,
            strategy=case.strategy,
            segment_ids=segs,
            return_lse=True,
            implementation=case.implementation,
            interpret=None if case.implementation == "xla" else INTERPRET,
        )

    mapped = jax.shard_map(
        per_shard,
        mesh=mesh,
        in_specs=(qkv, qkv, qkv, None if not case.documents else seg),
        out_specs=(qkv, lse_spec),
        **(
            {"axis_names": set(axis) if case.strategy == "hybrid" else {"seq"}}
            if case.partial
            else {}
        ),
    )

    def fn(q, k, v, segs):
        q, k, v = (jflash.to_layout(x, p, layout) for x in (q, k, v))
        if segs is not None:  # one array, or a (q ids, kv ids) pair
            pair = isinstance(segs, tuple)
            segs = tuple(jflash.to_layout(x, p, layout) for x in (segs if pair else (segs,)))
            segs = segs if pair else segs[0]
        # Explicit mesh axes (jax.make_mesh's default): the user places the shards.
        q, k, v = (jax.reshard(x, qkv) for x in (q, k, v))
        segs = None if segs is None else jax.tree.map(lambda x: jax.reshard(x, seg), segs)
        out, lse = mapped(q, k, v, segs)
        return jflash.from_layout(out, p, layout), jflash.from_layout(lse, p, layout, axis=2)

    return fn


def _value_and_grads(fn, q, k, v, segs, do, dlse):
    def loss(q, k, v):
        out, lse = fn(q, k, v, segs)
        lse_finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
        return jnp.sum(out.astype(jnp.float32) * do) + jnp.sum(lse_finite * dlse), (out, lse)

    (_, (out, lse)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return (out, lse, *grads)


def _inputs(case: Case):
    q, k, v, do, dlse = make_inputs(
        case.seed,
        batch=case.batch,
        q_len=case.seq_len,
        kv_len=case.seq_len,
        q_heads=case.q_heads,
        kv_heads=case.kv_heads,
        head_dim=case.head_dim,
        dtype=case.dtype,
    )
    segs = None
    if case.documents:
        segs = random_segments(case.seed, case.batch, case.seq_len, case.documents)
        n = case.documents
        if case.labels == "padded":
            segs = jnp.asarray(np.concatenate([np.arange(1, n), [0]]), jnp.int32)[segs]
        elif case.labels == "permuted":
            segs = jnp.asarray(np.random.default_rng(case.seed).permutation(n), jnp.int32)[segs]
        elif case.labels == "hashed":  # distinct labels over all of int32
            top = np.iinfo(np.int32).max
            labels = np.random.default_rng(case.seed).choice(top, n, replace=False) * 2 - top
            segs = jnp.asarray(labels, jnp.int32)[segs]
    return q, k, v, segs, do, dlse


def _check(case: Case):
    mesh = _mesh(case)
    q, k, v, segs, do, dlse = _inputs(case)
    fn = _user_fn(case, mesh)
    with jax.set_mesh(mesh):
        actual = jax.jit(functools.partial(_value_and_grads, fn))(q, k, v, segs, do, dlse)
    expected = oracle(q, k, v, do, dlse, causal=case.causal, segment_ids=segs)
    assert_close(actual, expected, case.dtype)
    return actual, expected


GRID = [
    Case(num_shards=p, layout=layout, strategy=strategy, causal=causal, documents=docs)
    for p in (1, 2, 3, 4, 8)
    for layout in jflash.LAYOUTS
    for strategy in ("ring", "allgather")
    for causal, docs in ((True, 0), (True, 7), (False, 5))
    if p in (2, 4) or (causal and docs)  # every P with documents; the rest at P = 2, 4
    if not (strategy == "allgather" and layout == "striped" and causal)
    # allgather gathers the whole K/V once, the same program at every P: P = 8 added to
    # P = 2, 3 and 4 only the grid's slowest compilations
    if not (strategy == "allgather" and p == 8)
]


# The quick set: at P = 2 every layout x strategy and causality with and without
# documents; every other P once.
@pytest.mark.parametrize(
    "case",
    quick_subset(
        sorted(GRID, key=lambda c: c.num_shards != 2),
        lambda c: (c.layout, c.strategy), lambda c: (c.causal, bool(c.documents)),
        lambda c: c.num_shards,
    ),
)  # fmt: skip
def test_shard_in_user_shard_map_matches_oracle(case):
    _check(case)


MESHES = [
    Case(num_shards=2, data=2, documents=5),  # ("data", "seq") = (2, 2)
    Case(num_shards=4, data=2, documents=9, strategy="allgather"),
    Case(num_shards=2, data=2, documents=5, partial=True),  # shard_map over seq only
    Case(num_shards=4, data=2, layout="contiguous", partial=True),
    Case(num_shards=4, q_heads=4, kv_heads=1, documents=6),  # MQA
    Case(num_shards=4, q_heads=4, kv_heads=4, documents=6, causal=False),  # MHA
    Case(num_shards=4, documents=48),  # many documents, most shorter than a shard
    Case(num_shards=8, documents=48, layout="striped"),
    Case(num_shards=4, data=2, documents=9, layout="striped", partial=True),
]


@pytest.mark.parametrize(
    "case",
    quick_subset(
        MESHES, lambda c: c.data, lambda c: c.partial, lambda c: c.kv_heads, lambda c: c.strategy
    ),
)
def test_meshes_heads_and_partial_shard_map(case):
    _check(case)


ULYSSES = [
    Case(strategy="ulysses", num_shards=p, layout=layout, q_heads=8, kv_heads=kv, **kw)
    for p in (1, 2, 4, 8)
    for layout, kv, kw in (
        ("contiguous", 2, {"documents": 7}),  # at P = 4, 8 fewer KV heads than devices
        ("zigzag", 1, {"documents": 5}),  # MQA
        ("striped", 4, {"documents": 6}),
        ("contiguous", 8, {"causal": False, "documents": 3}),
    )
    if p in (2, 4, 8) or kv == 2
] + [
    Case(strategy="ulysses", num_shards=4, data=2, q_heads=8, kv_heads=2, partial=True),
    Case(
        strategy="ulysses",
        num_shards=2,
        q_heads=4,
        kv_heads=2,
        implementation="pallas_triton",
        seq_len=64,
        head_dim=16,
        documents=3,
    ),
]

HYBRID = [
    Case(strategy="hybrid", num_shards=r, a2a=a, layout=layout, q_heads=8, kv_heads=kv, **kw)
    for r, a in ((2, 4), (4, 2), (2, 2))
    for layout, kv, kw in (
        ("zigzag", 2, {"documents": 7}),
        ("striped", 1, {"documents": 5}),
        ("contiguous", 4, {"causal": False}),
    )
] + [
    Case(
        strategy="hybrid",
        num_shards=2,
        a2a=2,
        data=2,
        q_heads=4,
        kv_heads=1,
        documents=4,
        partial=True,
    ),
]


@pytest.mark.parametrize(
    "case",
    quick_subset(
        ULYSSES + HYBRID, lambda c: (c.strategy, c.layout), lambda c: c.implementation,
        lambda c: c.partial,
    ),
)  # fmt: skip
def test_ulysses_and_hybrid_match_oracle(case):
    _check(case)


LABELS = [
    Case(num_shards=p, layout=layout, strategy=strategy, documents=6, labels=labels, **kw)
    for labels in ("padded", "permuted")
    for p, layout, strategy, kw in (
        (2, "zigzag", "ring", {}),
        (4, "striped", "ring", {}),
        (4, "contiguous", "allgather", {}),
        (4, "zigzag", "ulysses", {"q_heads": 8}),
        (2, "zigzag", "hybrid", {"a2a": 2, "q_heads": 8}),
    )
]


@pytest.mark.parametrize("case", quick_subset(LABELS, lambda c: c.strategy, lambda c: c.labels))
def test_documents_labelled_out_of_order_match_oracle(case):
    """One id array whose documents are labelled out of order (padding 0 at the end,
    or shuffled): relabelled along the whole sequence, right on every strategy, and
    the same numbers as the documents labelled in order (the kernels get the same ids)."""
    actual, _ = _check(case)
    in_order, _ = _check(dataclasses.replace(case, labels="sorted"))
    for a, b in zip(actual, in_order, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.multi_device(8)
def test_ulysses_repeated_kv_heads_sum_gradients_in_f32():
    """MQA over 8 devices: each KV head is repeated 8 times for the all-to-all, and
    the copies' bf16 dK/dV are summed in f32 and rounded once. Against one device's
    bf16 gradients (the kernel sums every query head in f32) the RMS error ratios of
    dK and dV read 1.11-1.13 here (each copy is rounded once on its device); summed
    in bf16, as `jnp.repeat`'s transpose sums them, 1.55-1.57."""
    errors = {}
    for p in (1, 8):
        case = Case(
            strategy="ulysses", num_shards=p, q_heads=8, kv_heads=1, seq_len=256,
            dtype=jnp.bfloat16,
        )  # fmt: skip
        actual, expected = _check(case)
        errors[p] = np.array(
            [
                np.sqrt(np.mean((np.asarray(a, np.float32) - np.asarray(e, np.float32)) ** 2))
                for a, e in zip(actual[3:], expected[3:], strict=True)  # dk, dv
            ]
        )
    ratio = errors[8] / errors[1]
    assert (ratio <= 1.3).all(), f"RMS error P=8 / P=1, (dk, dv): {ratio}"


@pytest.mark.parametrize("layout", jflash.LAYOUTS)
@pytest.mark.parametrize(
    "num_shards", [pytest.param(p, marks=pytest.mark.multi_device(p)) for p in (2, 4)]
)
def test_relabelled_shards_hold_sorted_ids(layout, num_shards):
    """`_relabelled` inside a shard_map: every shard's ids of documents labelled out of
    order come out sorted, and equal ids stay equal across shards (the whole sequence's
    mask is the same)."""
    from jflash._context import _relabelled

    mesh = jax.make_mesh((num_shards,), ("seq",), devices=jax.devices()[:num_shards])
    natural = np.asarray([3, 0, 2, 1])[random_segments(1, 2, 48, 4)]  # shuffled labels
    natural[:, -5:] = 9  # and padding labelled above them
    seg = jflash.to_layout(jnp.asarray(natural), num_shards, layout)
    fn = jax.shard_map(
        lambda s: _relabelled(s, "seq", num_shards, layout),
        mesh=mesh,
        in_specs=P(None, "seq"),
        out_specs=P(None, "seq"),
    )
    with jax.set_mesh(mesh):
        got = np.asarray(jax.jit(fn)(jax.reshard(seg, P(None, "seq"))))
    for shard in np.split(got, num_shards, axis=1):
        assert np.all(np.diff(shard, axis=1) >= 0)
    back = np.asarray(jflash.from_layout(jnp.asarray(got), num_shards, layout))
    for row, want in zip(back, natural, strict=True):
        np.testing.assert_array_equal(row[:, None] == row[None, :], want[:, None] == want[None, :])


PALLAS = [
    Case(num_shards=2, seq_len=64, q_heads=2, kv_heads=1, head_dim=16, implementation=impl, **kw)
    for impl in ("pallas_triton",)
    for kw in (
        {"documents": 5},
        {"documents": 4, "strategy": "allgather", "layout": "contiguous"},
        {"documents": 3, "causal": False},
        {"documents": 5, "layout": "striped"},
    )
]


@pytest.mark.parametrize("case", quick_subset(PALLAS, lambda c: c.implementation))
def test_pallas_kernels_in_user_shard_map(case):
    _check(case)


# The Mosaic kernels (Hopper's default) in a user's shard_map, compiled: every strategy,
# causal and not, D = 64 and 128, with documents, and on a mesh of one device (one GPU
# runs those: the kernels' one-warp streams inside a shard_map). Their outputs must vary
# over the shard_map's axes like their inputs (a sum of dO over the devices gave wrong
# dQ once).
MOSAIC = [
    Case(
        seq_len=MOSAIC_ONE_DEVICE_LEN if kw.get("num_shards") == 1 else 512,
        q_heads=4,
        kv_heads=2,
        implementation="pallas_mosaic",
        dtype=jnp.bfloat16,
        **kw,
    )
    for kw in (
        {"head_dim": 64, "num_shards": 1, "documents": 3},
        {"head_dim": 128, "num_shards": 1, "causal": False},
        {"head_dim": 64, "causal": False, "documents": 5},
        {"head_dim": 64, "strategy": "allgather", "layout": "contiguous"},
        {"head_dim": 128, "strategy": "ulysses"},
        {"head_dim": 64, "strategy": "ulysses", "causal": False, "documents": 3},
        {"head_dim": 128, "layout": "striped", "documents": 7},
        {"head_dim": 64, "num_shards": 2, "a2a": 2, "strategy": "hybrid", "documents": 4},
        {"head_dim": 128, "num_shards": 4, "documents": 7},
    )
]


@needs_hopper
@pytest.mark.parametrize(
    "case",
    # One device: interpreted on CPU too, 15-25 s each there.
    [pytest.param(c, marks=pytest.mark.slow) if c.num_shards == 1 else c for c in MOSAIC],
    ids=str,
)
def test_mosaic_kernels_in_user_shard_map(case):
    if INTERPRET and case.num_shards > 1:
        pytest.skip(
            "compiled on Hopper GPUs only: jax 0.11.2's GPU interpreter fails in a "
            "shard_map over 2+ devices (tests/test_lowering.py checks their types on CPU)"
        )
    _check(case)


def test_documents_across_shards_one_token_documents_and_empty_rows():
    """Documents span shard boundaries; one-token documents; q ids with no key of
    their id (a (q, kv) pair of ids): those rows give 0 and LSE -inf, never NaN."""
    case = Case(num_shards=4, seq_len=96, layout="contiguous", documents=1)
    mesh = _mesh(case)
    q, k, v, _, do, dlse = _inputs(case)
    # kv: documents 0 (tokens 0-29, crossing the shard boundary at 24), then one-token
    # documents 1..6, then 7 (36-95). q: the same, but tokens 60-64 carry id 99, which
    # no key has.
    kv_ids = np.concatenate([np.zeros(30), np.arange(1, 7), np.full(60, 7)]).astype(np.int32)
    q_ids = kv_ids.copy()
    q_ids[60:65] = 99
    q_seg = jnp.asarray(np.stack([q_ids, q_ids]))
    kv_seg = jnp.asarray(np.stack([kv_ids, kv_ids]))
    fn = _user_fn(dataclasses.replace(case, documents=2), mesh)
    with jax.set_mesh(mesh):
        actual = jax.jit(functools.partial(_value_and_grads, fn))(
            q, k, v, (q_seg, kv_seg), do, dlse
        )
    expected = oracle(q, k, v, do, dlse, causal=True, segment_ids=(q_seg, kv_seg))
    out, lse = np.asarray(actual[0]), np.asarray(actual[1])
    assert np.all(out[:, 60:65] == 0) and np.all(np.isneginf(lse[:, :, 60:65]))
    finite_lse = np.where(np.isfinite(lse), lse, 0.0)  # as the oracle helper reports it
    assert_close((actual[0], finite_lse, *actual[2:]), expected, jnp.float32)


@pytest.mark.parametrize("strategy", ["ring", "ulysses"])
@pytest.mark.slow
def test_error_flat_in_num_shards_with_documents(strategy):
    """bf16 with documents: on the same inputs, the error against the oracle does not
    grow with P (partial results merge in f32)."""
    base = Case(num_shards=1, seq_len=128, documents=6, q_heads=8, kv_heads=1, strategy=strategy)
    q, k, v, segs, do, dlse = _inputs(base)
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
    want, _ = oracle(q, k, v, do, dlse, causal=True, segment_ids=segs)[:2]
    errors = []
    for p in (1, 2, 4, 8):
        case = dataclasses.replace(base, num_shards=p)
        mesh = _mesh(case)
        with jax.set_mesh(mesh):
            out, _ = jax.jit(_user_fn(case, mesh))(q, k, v, segs)
        errors.append(float(jnp.abs(out.astype(jnp.float32) - want.astype(jnp.float32)).max()))
    assert max(errors) <= 2 * errors[0] + TOLERANCE[jnp.bfloat16]["out"], errors


def test_inside_checkpoint_and_scan_over_layers():
    """Per-shard layers under `jax.checkpoint` (saving the attention residuals by
    name) and `lax.scan`, inside the user's shard_map: gradients equal the oracle's."""
    case = Case(num_shards=4, documents=5)
    mesh = _mesh(case)
    q, k, v, segs, _, _ = _inputs(case)
    ws = jax.random.normal(jax.random.key(3), (3, case.head_dim, case.head_dim)) * 0.3
    p = case.num_shards
    policy = jax.checkpoint_policies.save_only_these_names("attention_out", "attention_lse")

    def layers(attend, q, k, v, ws):
        def layer(x, w):
            y = attend(x @ w, k, v)
            return x + y, None

        return jax.lax.scan(jax.checkpoint(layer, policy=policy), q, ws)[0]

    def per_shard(q, k, v, segs, ws):
        attend = functools.partial(
            lambda x, k, v: jflash.ring_attention_shard(
                x, k, v, axis_name="seq", causal=True, segment_ids=segs, implementation="xla"
            )
        )
        return layers(attend, q, k, v, ws)

    spec = P("data", "seq")
    mapped = jax.shard_map(
        per_shard, mesh=mesh, in_specs=(spec, spec, spec, spec, P()), out_specs=spec
    )

    def ring_loss(q, k, v, segs, ws):
        zq, zk, zv, zs = (jax.reshard(jflash.zigzag(x, p, axis=1), spec) for x in (q, k, v, segs))
        return jnp.sum(jflash.unzigzag(mapped(zq, zk, zv, zs, ws), p, axis=1) ** 2)

    def ref_loss(q, k, v, segs, ws):
        def attend(x, k, v):
            return jflash.attention_reference(x, k, v, causal=True, segment_ids=segs)[0]

        return jnp.sum(layers(attend, q, k, v, ws) ** 2)

    with jax.set_mesh(mesh):
        got = jax.jit(jax.grad(ring_loss, argnums=(0, 1, 2, 4)))(q, k, v, segs, ws)
    with jax.default_matmul_precision("highest"):
        want = jax.grad(ref_loss, argnums=(0, 1, 2, 4))(q, k, v, segs, ws)
    for name, a, e in zip(("dq", "dk", "dv", "dw"), got, want, strict=True):
        scale = max(1.0, float(jnp.abs(e).max()))
        np.testing.assert_allclose(a, e, atol=1e-4 * scale, rtol=1e-4, err_msg=name)


def test_global_ring_attention_with_documents():
    """`jflash.ring_attention` (global arrays) takes segment ids too: the same numbers."""
    case = Case(num_shards=4, documents=6, data=2)
    mesh = _mesh(case)
    q, k, v, segs, do, dlse = _inputs(case)
    p = case.num_shards

    def fn(q, k, v, segs):
        zq, zk, zv, zs = (jflash.zigzag(x, p, axis=1) for x in (q, k, v, segs))
        out, lse = jflash.ring_attention(
            zq,
            zk,
            zv,
            mesh=mesh,
            causal=True,
            segment_ids=zs,
            return_lse=True,
            implementation="xla",
        )
        return jflash.unzigzag(out, p, axis=1), jflash.unzigzag(lse, p, axis=2)

    with jax.set_mesh(mesh):
        actual = jax.jit(functools.partial(_value_and_grads, fn))(q, k, v, segs, do, dlse)
    assert_close(actual, oracle(q, k, v, do, dlse, causal=True, segment_ids=segs), jnp.float32)


@pytest.mark.multi_device(8)
@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_ring_over_axes_named_out_of_mesh_order(layout):
    """The sequence split over `("y", "x")` of an `("x", "y")` mesh, y major: each
    ring transfer goes to the next rank in that order (jax refuses a ppermute over
    axes named out of the mesh's order; the ring maps its ranks onto that order)."""
    mesh = jax.make_mesh((2, 4), ("x", "y"), devices=jax.devices()[:8])
    case = Case(num_shards=8, layout=layout, documents=5, seq_len=128)
    q, k, v, segs, do, dlse = _inputs(case)

    def fn(q, k, v, segs):
        zq, zk, zv, zs = (jflash.to_layout(x, 8, layout) for x in (q, k, v, segs))
        out, lse = jflash.ring_attention(
            zq, zk, zv, mesh=mesh, seq_axis=("y", "x"), causal=True, layout=layout,
            segment_ids=zs, return_lse=True, implementation="xla",
        )  # fmt: skip
        return jflash.from_layout(out, 8, layout), jflash.from_layout(lse, 8, layout, axis=2)

    with jax.set_mesh(mesh):
        actual = jax.jit(functools.partial(_value_and_grads, fn))(q, k, v, segs, do, dlse)
    assert_close(actual, oracle(q, k, v, do, dlse, causal=True, segment_ids=segs), jnp.float32)


@pytest.mark.parametrize("strategy", jflash.STRATEGIES)
@pytest.mark.parametrize("labels", ["permuted", "hashed"])
def test_global_ring_attention_relabels_one_id_array(strategy, labels, monkeypatch):
    """One id array given to `jflash.ring_attention`, its documents labelled out of
    order (shuffled, or over all of int32), reaches every kernel as sorted ids
    (relabelled along the whole sequence, as the per-shard form relabels it), and the
    answer is the oracle's."""
    _check_relabelled(strategy, False, monkeypatch, labels)


@pytest.mark.parametrize("strategy", jflash.STRATEGIES)
def test_global_ring_attention_relabels_an_id_pair(strategy, monkeypatch):
    """The same ids given as a `(q_ids, kv_ids)` pair: relabelled by the key ids along
    the whole sequence, so they too reach every kernel as sorted ids; the oracle's
    answer."""
    _check_relabelled(strategy, True, monkeypatch)


def _check_relabelled(strategy, pair, monkeypatch, labels="permuted"):
    from jflash import _dispatch

    seen = []

    def spy(*args, segs, **kwargs):
        if segs is not None:
            jax.debug.callback(lambda *ids: seen.extend(np.asarray(i) for i in ids), *segs)
        return xla_fwd(*args, segs=segs, **kwargs)

    xla_fwd = _dispatch.xla_fwd
    monkeypatch.setattr(_dispatch, "xla_fwd", spy)
    jax.clear_caches()  # a call traced before, with other labels, would skip the spy
    hybrid = strategy == "hybrid"
    case = Case(num_shards=2, a2a=2 if hybrid else 1, strategy=strategy, documents=6)
    case = dataclasses.replace(case, labels=labels)
    mesh = _mesh(case)
    q, k, v, segs, _, _ = _inputs(case)
    assert not np.all(np.diff(np.asarray(segs), axis=1) >= 0)
    p, seq_axis = case.num_shards, ("seq", "a2a") if hybrid else "seq"
    zq, zk, zv, zs = (jflash.zigzag(x, p, axis=1) for x in (q, k, v, segs))
    with jax.set_mesh(mesh):
        out = jflash.ring_attention(
            zq, zk, zv, mesh=mesh, seq_axis=seq_axis, causal=True,
            segment_ids=(zs, zs) if pair else zs, strategy=strategy, implementation="xla",
        )  # fmt: skip
        out = jax.block_until_ready(jflash.unzigzag(out, p, axis=1))
    assert seen
    for ids in seen:
        assert np.all(np.diff(ids, axis=1) >= 0), ids
    want, _ = jflash.attention_reference(q, k, v, causal=True, segment_ids=segs)
    tol = TOLERANCE[jnp.float32]["out"]
    np.testing.assert_allclose(out, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("strategy", ["ring", "allgather"])
def test_one_shard_runs_the_single_device_kernels(strategy):
    """A sequence axis of size 1 (a trainer's `seq=1`) calls `flash_attention`'s kernels:
    outputs and gradients in q's dtype, not one ring step's f32 partials converted
    afterwards; the same numbers as `flash_attention`, bit for bit."""
    mesh = jax.make_mesh((1,), ("seq",), devices=jax.devices()[:1])
    shape = dict(batch=2, q_len=64, kv_len=64, q_heads=4, kv_heads=2, head_dim=32)
    q, k, v = make_inputs(3, **shape, dtype=jnp.bfloat16)[:3]

    def loss(attend, q, k, v):
        return jnp.sum(attend(q, k, v).astype(jnp.float32) ** 2)

    def ring(q, k, v):
        return jflash.ring_attention(
            q, k, v, mesh=mesh, causal=True, strategy=strategy, implementation="xla"
        )

    def flash(q, k, v):
        return jflash.flash_attention(q, k, v, causal=True, implementation="xla")

    grad = jax.grad(functools.partial(loss, ring), argnums=(0, 1, 2))
    program = str(jax.make_jaxpr(grad)(q, k, v))
    assert "name=_flash" in program and "_ring_shard" not in program
    want = jax.jit(jax.grad(functools.partial(loss, flash), argnums=(0, 1, 2)))(q, k, v)
    for a, e in zip(jax.jit(grad)(q, k, v), want, strict=True):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(e, np.float32))
    # One shard holds the sequence in natural order whatever the layout: an odd length
    # runs (zigzag's two chunks per shard need none), and the layout helpers pass it as is.
    odd = tuple(x[:, :63] for x in (q, k, v))
    out = jflash.ring_attention(
        *odd, mesh=mesh, causal=True, layout="zigzag", strategy=strategy, implementation="xla"
    )
    same = jflash.flash_attention(*odd, causal=True, implementation="xla")
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(same, np.float32))
    for helper in (jflash.zigzag, jflash.unzigzag):
        np.testing.assert_array_equal(helper(jnp.arange(7), 1, axis=0), np.arange(7))
    np.testing.assert_array_equal(jflash.positions(7, 1, "zigzag"), np.arange(7))
    with pytest.raises(ValueError, match="seq_len=7 must be divisible by 2 \\* num_shards=4"):
        jflash.zigzag(jnp.arange(7), 2, axis=0)


@pytest.mark.parametrize(
    "implementation, head_dim, seq, dtype",
    [
        ("xla", 32, 64, jnp.float32),
        pytest.param("pallas_mosaic", 64, 256, jnp.bfloat16, marks=needs_hopper),
    ],
)
def test_flash_attention_in_data_parallel_shard_map(implementation, head_dim, seq, dtype):
    """The single-device op inside a plain data-parallel shard_map, check_vma on."""
    if implementation != "xla" and INTERPRET:
        pytest.skip("compiled on a Hopper GPU only (the GPU interpreter runs on one device)")
    n = 2 if implementation != "xla" else 4
    if jax.device_count() < n:
        pytest.skip(f"needs {n} devices")
    mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
    q, k, v, do, dlse = make_inputs(
        5, batch=4, q_len=seq, kv_len=seq, q_heads=4, kv_heads=2, head_dim=head_dim, dtype=dtype
    )
    segs = random_segments(5, 4, seq, 3)
    spec = P("data")

    def fn(q, k, v, segs):
        return jax.shard_map(
            lambda q, k, v, s: jflash.flash_attention(
                q,
                k,
                v,
                causal=True,
                segment_ids=s,
                return_lse=True,
                implementation=implementation,
            ),  # fmt: skip
            mesh=mesh,
            in_specs=(spec,) * 4,
            out_specs=(spec, spec),
        )(q, k, v, segs)

    with jax.set_mesh(mesh):
        placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v, segs)]
        actual = jax.jit(functools.partial(_value_and_grads, fn))(*placed, do, dlse)
    assert_close(actual, oracle(q, k, v, do, dlse, causal=True, segment_ids=segs), dtype)


@pytest.mark.multi_device(4)
@pytest.mark.parametrize("call", ["flash_attention", "ring_attention_shard"])
def test_kv_whole_over_an_axis_that_splits_qs_heads_is_warned_of(call):
    """Tensor parallelism with k and v left whole over "tp" while q's heads are split
    over it: each device's query heads would read the first KV heads, a wrong answer
    the types cannot tell from a K/V shared across a batch split. A warning at the
    caller's line names the axis; split alike, nothing is said and the answer is
    right."""
    mesh = jax.make_mesh((2, 2), ("tp", "seq"), (AxisType.Auto,) * 2, devices=jax.devices()[:4])
    q, k, v, do, dlse = make_inputs(
        0, batch=1, q_len=32, kv_len=32, q_heads=4, kv_heads=2, head_dim=16, dtype=jnp.float32
    )

    def per_shard(q, k, v):
        if call == "flash_attention":
            return jflash.flash_attention(q, k, v, causal=True, implementation="xla")
        return jflash.ring_attention_shard(
            q, k, v, axis_name="seq", causal=True, layout="contiguous", implementation="xla"
        )

    seq = "seq" if call == "ring_attention_shard" else None  # flash_attention: whole
    heads = P(None, seq, "tp")
    for kv_spec, warned in ((P(None, seq), True), (heads, False)):
        mapped = jax.shard_map(
            per_shard, mesh=mesh, in_specs=(heads, kv_spec, kv_spec), out_specs=heads
        )
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            out = jax.jit(mapped)(q, k, v)
        said = [w for w in got if "k or v do not" in str(w.message)]
        assert [w.filename for w in said] == ([__file__] if warned else []), said
        if warned:
            assert "mesh axes ['tp']" in str(said[0].message)
            assert said[0].category is jflash.SharedKVWarning
            with warnings.catch_warnings(record=True) as got:  # silenced by its class
                warnings.simplefilter("always")
                warnings.filterwarnings("ignore", category=jflash.SharedKVWarning)
                specs = dict(in_specs=(heads, kv_spec, kv_spec), out_specs=heads)
                jax.jit(jax.shard_map(per_shard, mesh=mesh, **specs))(q, k, v)  # traced anew
            assert not [w for w in got if "k or v do not" in str(w.message)]
        else:
            expected = oracle(q, k, v, do, dlse, causal=True)
            assert_close((out,), expected[:1], jnp.float32, names=("out",))


@pytest.mark.parametrize("strategy", ["flash_attention", "ring", "allgather", "ulysses"])
def test_kv_shared_over_data_gets_gradients_summed_over_it(strategy):
    """One K/V for every batch row, replicated over "data", while q is split over it
    (check_vma on): the forward is each row's attention to the shared K/V, and the
    K/V gradients are the sum over "data" of the rows' gradients (the VJP's gradient
    varied over "data" where its input did not, and jax refused it)."""
    if jax.device_count() < 2:
        pytest.skip("needs 2 devices")
    seq = 2 if jax.device_count() >= 4 else 1  # 2 GPUs: the ring of one
    mesh = jax.make_mesh((2, seq), ("data", "seq"), devices=jax.devices()[: 2 * seq])
    q, k, v, do, dlse = make_inputs(
        11, batch=2, q_len=64, kv_len=64, q_heads=4, kv_heads=2, head_dim=32, dtype=jnp.float32
    )
    k1, v1 = k[:1], v[:1]
    if strategy == "flash_attention":
        q_spec, kv_spec, lse_spec = P("data"), P(), P("data")
        order = back = lambda x, axis=1: x  # noqa: E731

        def per_shard(q, k, v):
            return jflash.flash_attention(q, k, v, causal=True, return_lse=True)

    else:
        q_spec, kv_spec, lse_spec = P("data", "seq"), P(None, "seq"), P("data", None, "seq")

        def order(x, axis=1):
            return jflash.to_layout(x, seq, "zigzag", axis=axis)

        def back(x, axis=1):
            return jflash.from_layout(x, seq, "zigzag", axis=axis)

        def per_shard(q, k, v):
            return jflash.ring_attention_shard(
                q, k, v, axis_name="seq", causal=True, strategy=strategy, return_lse=True
            )

    mapped = jax.shard_map(
        per_shard, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec), out_specs=(q_spec, lse_spec)
    )

    def fn(q, k, v, segs):
        del segs
        q = jax.reshard(order(q), q_spec)
        k, v = (jax.reshard(order(x), kv_spec) for x in (k, v))
        out, lse = mapped(q, k, v)
        return back(out), back(lse, axis=2)

    with jax.set_mesh(mesh), pytest.warns(UserWarning, match=r"mesh axes \['data'\] and k or v"):
        actual = jax.jit(functools.partial(_value_and_grads, fn))(q, k1, v1, None, do, dlse)
    shared = (jnp.broadcast_to(x, k.shape) for x in (k1, v1))
    out, lse, dq, dk, dv = oracle(q, *shared, do, dlse, causal=True)
    expected = (out, lse, dq, dk.sum(0, keepdims=True), dv.sum(0, keepdims=True))
    assert_close(actual, expected, jnp.float32)


@pytest.mark.multi_device(8)
@pytest.mark.parametrize("segmented", [False, True])
def test_flash_attention_on_inputs_split_over_explicit_axes(segmented):
    """`flash_attention` on inputs split over Explicit mesh axes along the batch and the
    heads (`jax.make_mesh`'s default axes, no shard_map) runs each device's part: the
    values, LSE and gradients are the one-device call's, split as q is; k, v and the ids
    split otherwise (or not) are resharded to match q; eager, jitted and inside a
    caller's partial shard_map. A split sequence or head dim, and heads k's do not
    divide, are refused by name."""
    mesh = jax.make_mesh((2, 2, 2), ("data", "tp", "x"), devices=jax.devices()[:8])
    q, k, v, do, dlse = make_inputs(
        0, batch=4, q_len=32, kv_len=32, q_heads=8, kv_heads=4, head_dim=16, dtype=jnp.float32
    )
    segs = (
        jnp.repeat(jnp.arange(4, dtype=jnp.int32)[None], 4, 0).repeat(8, 1) if segmented else None
    )

    def attend(q, k, v, segs):
        return jflash.flash_attention(
            q, k, v, causal=True, segment_ids=segs, return_lse=True, implementation="xla"
        )

    expected = _value_and_grads(attend, q, k, v, segs, do, dlse)
    layouts = [
        (P("data", None, "tp"), P("data", None, "tp")),
        (P(("data", "x")), P()),  # k and v whole: resharded to q's split
        (P(None, None, ("tp", "x")), P("data")),
    ]
    with jax.set_mesh(mesh):
        for q_spec, kv_spec in layouts:
            args = [jax.reshard(q, q_spec), *(jax.reshard(x, kv_spec) for x in (k, v))]
            ids = None if segs is None else jax.reshard(segs, P(q_spec[0]))
            for run in (lambda f: f, jax.jit):
                actual = run(functools.partial(_value_and_grads, attend))(*args, ids, do, dlse)
                assert_close(actual, expected, jnp.float32)
                assert jax.typeof(actual[0]).sharding.spec[:3] == (*q_spec, None, None)[:3]
        partial = jax.shard_map(attend, mesh=mesh, in_specs=P(), out_specs=P(), axis_names={"x"})
        args = [jax.reshard(x, P("data", None, "tp")) for x in (q, k, v)]
        ids = None if segs is None else jax.reshard(segs, P("data"))
        actual = jax.jit(functools.partial(_value_and_grads, partial))(*args, ids, do, dlse)
        assert_close(actual, expected, jnp.float32)
        # vmapped over a leading axis that is split too (the per-example types name
        # only the heads' axis).
        stacked = jax.reshard(jnp.stack([q, 2 * q]), P("data", None, None, "tp"))
        per_example = jax.vmap(lambda q: attend(q, q[:, :, :4], q[:, :, :4], segs)[0])
        want = jnp.stack([attend(x, x[:, :, :4], x[:, :, :4], segs)[0] for x in (q, 2 * q)])
        assert_close((jax.jit(per_example)(stacked),), (want,), jnp.float32, names=("out",))
        for q_spec, error in (
            (P(None, "data"), "q is split along its sequence over the mesh axis 'data'"),
            (P(None, None, None, "tp"), "q is split along its head dim over the mesh axis 'tp'"),
            (
                P(None, None, ("data", "tp", "x")),
                "q's 8 heads are split over ('data', 'tp', 'x') into 8 parts, which k's and "
                "v's 4 heads do not divide",
            ),
        ):
            with pytest.raises(ValueError, match=re.escape(error)):
                attend(jax.reshard(q, q_spec), k, v, None)
    # Eager, outside `jax.set_mesh` (as the README's first sharded example runs): q on
    # the mesh, k and v on one device, the ids a numpy array; all moved to q's split.
    placed = jax.device_put(q, NamedSharding(mesh, P("data", None, "tp")))
    ids = None if segs is None else np.asarray(segs)
    out, lse = attend(placed, k, v, ids)
    assert_close((out, lse), expected[:2], jnp.float32, names=("out", "lse"))
    assert out.sharding.spec[:3] == ("data", None, "tp")


@pytest.mark.multi_device(8)
@pytest.mark.parametrize("strategy", ["ring", "allgather", "ulysses"])
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_ring_attention_keeps_a_tensor_parallel_head_split(strategy, axis_type):
    """Global ring_attention with the heads split over "tp" (on Explicit axes q's own
    split; on Auto axes `head_axes="tp"`): each device attends its own heads, the
    output and LSE come split over "tp" as q is, values and gradients the one-device
    attention's; no warning calls "tp" an idle batch axis. Heads that k's do not
    divide over "tp" are refused by name."""
    mesh = jax.make_mesh(
        (2, 2, 2), ("data", "tp", "seq"), (axis_type,) * 3, devices=jax.devices()[:8]
    )
    q, k, v, do, dlse = make_inputs(
        3, batch=2, q_len=64, kv_len=64, q_heads=8, kv_heads=4, head_dim=16, dtype=jnp.float32
    )
    spec = P("data", "seq", "tp")
    heads = {} if axis_type == AxisType.Explicit else {"head_axes": "tp"}

    def fn(q, k, v, segs):
        del segs
        place = jax.reshard if axis_type == AxisType.Explicit else jax.lax.with_sharding_constraint
        placed = [place(jflash.to_layout(x, 2, "zigzag", axis=1), spec) for x in (q, k, v)]
        out, lse = jflash.ring_attention(
            *placed, mesh=mesh, causal=True, strategy=strategy, return_lse=True,
            implementation="xla", **heads,
        )  # fmt: skip
        if axis_type == AxisType.Explicit:
            assert jax.typeof(out).sharding.spec[:3] == ("data", "seq", "tp")
            assert tuple(jax.typeof(lse).sharding.spec) == ("data", "tp", "seq")
        return jflash.from_layout(out, 2, "zigzag", axis=1), jflash.from_layout(
            lse, 2, "zigzag", axis=2
        )

    with jax.set_mesh(mesh), warnings.catch_warnings():
        warnings.simplefilter("error")  # no idle-batch warning about "tp"
        actual = jax.jit(functools.partial(_value_and_grads, fn))(q, k, v, None, do, dlse)
    assert_close(actual, oracle(q, k, v, do, dlse, causal=True), jnp.float32)
    with (
        jax.set_mesh(mesh),
        pytest.raises(
            ValueError, match="split over \\('tp',\\) into 2 parts, which q's 8 and k's 1 heads"
        ),
    ):
        jflash.ring_attention(q, k[:, :, :1], v[:, :, :1], mesh=mesh, causal=True, head_axes="tp")
    if strategy == "ulysses":  # 2 heads over tp leave 1 a device, which seq=2 cannot split
        two = (q[:, :, :2], k[:, :, :2], v[:, :, :2])
        match = r"q's 2 heads over head_axes=\('tp',\) \(2 parts\) leave 1 per device, which "
        with jax.set_mesh(mesh), pytest.raises(ValueError, match=match):
            jflash.ring_attention(*two, mesh=mesh, causal=True, strategy="ulysses", head_axes="tp")


@pytest.mark.multi_device(4)
def test_inputs_sharded_over_explicit_axes_are_named():
    """A batch split over an Explicit axis that the shard_map leaves to jax: named in
    one line, not a type error deep inside XLA or Pallas."""
    mesh = jax.make_mesh((2, 2), ("data", "seq"), devices=jax.devices()[:4])
    q, k, v, *_ = make_inputs(
        0, batch=2, q_len=32, kv_len=32, q_heads=2, kv_heads=1, head_dim=16, dtype=jnp.float32
    )
    call = {"causal": True, "implementation": "xla"}
    spec = P(None, "seq")

    def per_shard(q, k, v):
        return jflash.ring_attention_shard(q, k, v, axis_name="seq", **call)

    partial = jax.shard_map(per_shard, mesh=mesh, in_specs=spec, out_specs=spec, axis_names={"seq"})
    with jax.set_mesh(mesh):
        args = [jax.reshard(x, P("data", "seq")) for x in (q, k, v)]
        with pytest.raises(ValueError, match=r"q is sharded over Explicit mesh axes .*'data'"):
            jax.jit(partial)(*args)


@pytest.mark.multi_device(2)
def test_interpreted_triton_kernel_under_check_vma():
    """The Pallas (Triton) kernels in interpret mode run inside a user's `shard_map`
    with `check_vma=True` over 2 devices, gradients too (as compiled ones do: each
    device's kernel gets operands typed as unvarying, `_vma.per_device`); jax 0.11.2's
    interpreter alone mixes varying and unvarying values inside the kernel body."""
    mesh = jax.make_mesh((2,), ("seq",), devices=jax.devices()[:2])
    q, k, v, do, dlse = make_inputs(
        0, batch=1, q_len=64, kv_len=64, q_heads=2, kv_heads=1, head_dim=16, dtype=jnp.float32
    )
    spec = P(None, "seq")

    def per_shard(q, k, v, segs):
        return jflash.ring_attention_shard(
            q,
            k,
            v,
            axis_name="seq",
            causal=True,
            segment_ids=segs,
            layout="contiguous",
            return_lse=True,
            implementation="pallas_triton",
            interpret=INTERPRET,
        )

    fn = jax.shard_map(
        per_shard,
        mesh=mesh,
        in_specs=(spec, spec, spec, None),
        out_specs=(spec, P(None, None, "seq")),
    )
    with jax.set_mesh(mesh):
        args = [jax.reshard(x, spec) for x in (q, k, v)]
        actual = jax.jit(functools.partial(_value_and_grads, fn))(*args, None, do, dlse)
    assert_close(actual, oracle(q, k, v, do, dlse, causal=True), jnp.float32)


@pytest.mark.multi_device(2)
@pytest.mark.skipif(not INTERPRET, reason="the GPU interpreter's limit; compiled Mosaic runs")
@pytest.mark.parametrize("call", ["flash_attention", "ring_attention_shard"])
def test_mosaic_interpreter_in_a_shard_map_over_devices_is_refused(call):
    """The GPU interpreter fails its end-of-kernel barrier check in a `shard_map` over
    2+ devices whatever the sequence axis's size: a data-parallel `shard_map` around
    `flash_attention`, or `ring_attention_shard` over a "seq" axis of size 1 beside
    "data" of 2, is refused by name before tracing a kernel, as `ring_attention` is."""
    mesh = jax.make_mesh((2, 1), ("data", "seq"), devices=jax.devices()[:2])
    q, k, v, *_ = make_inputs(
        0, batch=2, q_len=64, kv_len=64, q_heads=2, kv_heads=1, head_dim=64, dtype=jnp.bfloat16
    )
    spec = P("data", "seq")
    options = dict(causal=True, implementation="pallas_mosaic", interpret=True)

    def per_shard(q, k, v):
        if call == "flash_attention":
            return jflash.flash_attention(q, k, v, **options)
        return jflash.ring_attention_shard(q, k, v, axis_name="seq", **options)

    attend = jax.shard_map(per_shard, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
    args = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
    with pytest.raises(NotImplementedError, match="in interpret mode cannot run on 2 devices"):
        jax.jit(attend)(*args)


@pytest.mark.multi_device(2)
def test_errors_name_the_problem():
    auto = (jax.sharding.AxisType.Auto,) * 2
    mesh = jax.make_mesh((1, 2), ("data", "seq"), devices=jax.devices()[:2], axis_types=auto)
    q, k, v, *_ = make_inputs(
        0, batch=1, q_len=16, kv_len=16, q_heads=2, kv_heads=1, head_dim=16, dtype=jnp.float32
    )
    call = {"causal": True, "implementation": "xla"}
    with pytest.raises(ValueError, match="axis_name='seq' is not a manual axis here"):
        jflash.ring_attention_shard(q, k, v, axis_name="seq", **call)
    with pytest.raises(ValueError, match="return_lse='no' must be True or False"):
        jflash.ring_attention_shard(q, k, v, axis_name="seq", return_lse="no", **call)

    def mapped(body, *args):
        spec = P(None, "seq")
        with jax.set_mesh(mesh):
            return jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)(*args)

    with pytest.raises(ValueError, match="axis_name='sp' is not a manual axis"):
        mapped(
            lambda q, k, v: jflash.ring_attention_shard(q, k, v, axis_name="sp", **call), q, k, v
        )
    # Of several axes, the one not bound is named.
    with pytest.raises(ValueError, match=r"^axis_name='sp' \(of \('seq', 'sp'\)\) is not a manual"):
        mapped(
            lambda q, k, v: jflash.ring_attention_shard(
                q, k, v, axis_name=("seq", "sp"), strategy="hybrid", **call
            ),
            q,
            k,
            v,
        )
    # Ulysses over two axes splits the heads over both: the error names both.
    wide = jax.make_mesh((2, 1), ("data", "seq"), devices=jax.devices()[:2], axis_types=auto)
    three = jnp.concatenate([q, q[:, :, :1]], axis=2)  # 3 query heads, 1 KV head
    heads = (
        r"q_heads=3 must be divisible by the all-to-all degree 2 \(the size of \('data', 'seq'\)\)"
    )
    with pytest.raises(ValueError, match=heads):
        jflash.ring_attention(
            three, k, v, mesh=wide, seq_axis=("data", "seq"), strategy="ulysses", **call
        )
    local = r"the local length q.shape\[1\]=7 \(14 tokens over 2 shards\) is odd"
    with pytest.raises(ValueError, match=local):
        mapped(
            lambda q, k, v: jflash.ring_attention_shard(q, k, v, axis_name="seq", **call),
            q[:, :14],
            k[:, :14],
            v[:, :14],
        )
    with pytest.raises(TypeError, match="causal"):
        jflash.ring_attention_shard(q, k, v, axis_name="seq")  # causal is required
    with pytest.raises(ValueError, match=r"axis_name=\['seq'\] must be a mesh axis name"):
        jflash.ring_attention_shard(q, k, v, axis_name=["seq"], **call)
    with pytest.raises(ValueError, match=r"axis_name=\('seq', 'seq'\) names a mesh axis twice"):
        mapped(
            lambda q, k, v: jflash.ring_attention_shard(q, k, v, axis_name=("seq", "seq"), **call),
            q,
            k,
            v,
        )
    with pytest.raises(ValueError, match=r"seq_axis=\('seq', 'seq'\) names a mesh axis twice"):
        jflash.ring_attention(q, k, v, mesh=mesh, seq_axis=("seq", "seq"), **call)
    with pytest.raises(ValueError, match="seq_axis='seq' is already a manual axis here"):
        mapped(lambda q, k, v: jflash.ring_attention(q, k, v, mesh=mesh, **call), q, k, v)

    # Inside a shard_map over another axis: refused by name, on Auto and Explicit axes
    # (jax's own errors were a mesh mismatch, a manual-axis type error, and gradients
    # that failed to lower).
    def nested(outer):
        with jax.set_mesh(outer):
            return jax.shard_map(
                lambda q, k, v: jflash.ring_attention(q, k, v, mesh=outer, **call),
                mesh=outer,
                in_specs=P("data"),
                out_specs=P("data"),
                axis_names={"data"},
            )(q, k, v)

    explicit = (jax.sharding.AxisType.Explicit,) * 2
    for outer in (
        mesh,
        jax.make_mesh((1, 2), ("data", "seq"), explicit, devices=jax.devices()[:2]),
    ):
        with pytest.raises(ValueError, match=r"called inside a jax.shard_map over \['data'\]"):
            nested(outer)
    # in_specs that leave the sequence whole: every device would hold all of it, and
    # the ring would attend over 2 copies (with check_vma, q's type says so).
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"q is the same on every device of"):
        jax.shard_map(
            lambda q, k, v: jflash.ring_attention_shard(q, k, v, axis_name="seq", **call),
            mesh=mesh,
            in_specs=P(),
            out_specs=P(None, "seq"),
        )(q, k, v)
    with pytest.raises(NotImplementedError, match="strategy='allgather' with layout='striped'"):
        jflash.ring_attention(q, k, v, mesh=mesh, layout="striped", strategy="allgather", **call)
    with pytest.raises(ValueError, match="seq_len=15 must be divisible by num_shards=2 for the"):
        jflash.ring_attention(q[:, :15], k[:, :15], v[:, :15], mesh=mesh, layout="striped", **call)
    with pytest.raises(ValueError, match="segment ids have"):
        mapped(
            lambda q, k, v, s: jflash.ring_attention_shard(
                q, k, v, axis_name="seq", segment_ids=s, **call
            ),
            q,
            k,
            v,
            jnp.zeros((1, 8), jnp.int32),
        )
    with pytest.raises(ValueError, match="segment ids must be integers"):
        jflash.ring_attention(q, k, v, mesh=mesh, segment_ids=jnp.zeros((1, 16)), **call)
    with pytest.raises(ValueError, match="kv segment ids have"):
        ids = jnp.zeros((1, 16), jnp.int32)
        jflash.ring_attention(q, k, v, mesh=mesh, segment_ids=(ids, ids[:, :8]), **call)


@pytest.mark.parametrize("layout", jflash.LAYOUTS)
@pytest.mark.parametrize("num_shards", [1, 2, 3, 4])
def test_layouts_round_trip(layout, num_shards):
    x = jnp.arange(2 * 24).reshape(2, 24)
    y = jflash.to_layout(x, num_shards, layout)
    np.testing.assert_array_equal(jflash.from_layout(y, num_shards, layout), x)
    np.testing.assert_array_equal(jflash.positions(24, num_shards, layout), y[0])
    # The gradient of a permutation is its inverse.
    w = jax.random.normal(jax.random.key(0), (2, 24))
    g = jax.grad(lambda x: jnp.sum(jflash.to_layout(x, num_shards, layout) * w))(x * 1.0)
    np.testing.assert_array_equal(g, jflash.from_layout(w, num_shards, layout))


def test_striped_and_zigzag_orders():
    np.testing.assert_array_equal(jflash.positions(8, 2, "striped"), [0, 2, 4, 6, 1, 3, 5, 7])
    np.testing.assert_array_equal(jflash.positions(8, 2, "zigzag"), [0, 1, 6, 7, 2, 3, 4, 5])
    np.testing.assert_array_equal(jflash.positions(8, 2, "contiguous"), np.arange(8))
    with pytest.raises(ValueError, match="layout='ring' is not one of"):
        jflash.to_layout(jnp.arange(8), 2, "ring", axis=0)


def test_striped_layout_balances_packed_documents(tmp_path):
    """`benchmarks/balance.py`: with long-tailed packed documents the striped layout
    keeps every rank's causal work within 5% of the mean; zigzag does not."""
    from benchmarks import balance

    lengths = balance.document_lengths(4 * 4096, np.random.default_rng(0), 2048, 16384)
    for layout, bound in (("striped", (1.0, 1.05)), ("zigzag", (1.1, 10.0))):
        area, tiles = balance.rank_work(lengths, 4, layout, 128)
        assert area.sum() == sum(n * (n + 1) // 2 for n in lengths)  # every pair, once
        for work in (area, tiles):
            assert bound[0] <= work.max() / work.mean() <= bound[1], (layout, work)
    out = tmp_path / "balance.json"
    balance.main(["--shards", "2", "--tokens-per-gpu", "2048", "--rows", "2", "--out", str(out)])
    assert out.exists()
