"""The Mosaic GPU kernels with segment ids (packed documents) against the oracle.

On CPU the kernels run in the GPU interpreter; on an sm90 GPU the same tests run
compiled. The kernels are called through the kernel contract (`mosaic_fwd` /
`mosaic_bwd`), the backward with the global LSE and `delta` as `jflash.flash_attention`
gives them.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import INTERPRET, needs_hopper
from jax._src import mesh as mesh_lib
from kernel_cases import assert_close, make_inputs, oracle, random_segments, value_and_grads

import jflash
from jflash._dispatch import delta_from
from jflash._mask import Mask
from jflash._mosaic_bwd import fuses_dq, mosaic_bwd
from jflash._mosaic_fwd import _forward, mosaic_fwd

pytestmark = needs_hopper


@dataclasses.dataclass(frozen=True)
class Case:
    causal: bool = True
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    q_len: int = 256
    kv_len: int | None = None
    segments: int = 4  # documents per row, at random boundaries
    lengths: tuple[int, ...] = ()  # or these document lengths (every row)
    # "packed": sorted ids; "shuffled": contiguous documents, ids not sorted;
    # "interleaved": each token's id drawn at random (documents in pieces).
    order: str = "packed"
    dtype: object = jnp.bfloat16
    batch: int = 1
    deterministic: bool = False

    def __str__(self):
        kv_len = self.kv_len or self.q_len
        docs = "docs" + "_".join(map(str, self.lengths)) if self.lengths else f"{self.segments}"
        return "-".join(
            [
                "causal" if self.causal else "full",
                f"N{self.q_heads}K{self.kv_heads}",
                f"H{self.head_dim}",
                f"T{self.q_len}S{kv_len}",
                f"B{self.batch}",
                f"{docs}{self.order}",
                jnp.dtype(self.dtype).name,
            ]
            + (["deterministic"] if self.deterministic else [])
        )


def segment_ids(case: Case, seed: int):
    """`(q_seg, kv_seg)` int32 `[B, T]`, `[B, S]`."""
    rng = np.random.default_rng(seed)
    kv_len = case.kv_len or case.q_len
    if case.lengths:
        assert sum(case.lengths) == case.q_len == kv_len, case
        row = np.repeat(np.arange(len(case.lengths)), case.lengths)
        q_seg = kv_seg = jnp.asarray(np.tile(row, (case.batch, 1)), jnp.int32)
    elif case.order == "interleaved":
        q_seg = jnp.asarray(rng.integers(0, case.segments, (case.batch, case.q_len)), jnp.int32)
        kv_seg = jnp.asarray(rng.integers(0, case.segments, (case.batch, kv_len)), jnp.int32)
    else:
        q_seg = kv_seg = random_segments(seed, case.batch, case.q_len, case.segments)
        if kv_len != case.q_len:
            kv_seg = random_segments(seed + 1, case.batch, kv_len, case.segments)
    if case.order == "shuffled":
        perm = jnp.asarray(rng.permutation(case.segments) * 7 + 3, jnp.int32)
        q_seg, kv_seg = perm[q_seg], perm[kv_seg]
    return q_seg, kv_seg


def check(got, want, segs, *, causal: bool, dtype):
    """`got` (the kernels' `(out, lse, dq, dk, dv)`) against the oracle's `want`: rows that
    see no key have LSE -inf exactly there (the oracle's loss reports them as 0)."""
    q_len, kv_len = segs[0].shape[1], segs[1].shape[1]
    sees = np.asarray(Mask(causal).dense(q_len, kv_len, segs).any(axis=-1))  # [B, T]
    lse = np.asarray(got[1])
    np.testing.assert_array_equal(np.isneginf(lse), np.broadcast_to(~sees[:, None], lse.shape))
    names = ("out", "lse", "dq", "dk", "dv")[: len(got)]  # the forward's alone, or all
    got = (got[0], jnp.where(jnp.isneginf(got[1]), 0.0, got[1]), *got[2:])
    assert_close(got, want, dtype, names=names)


def case_seed(case: Case) -> int:
    return zlib.crc32(str(case).encode()) % 1000


@functools.partial(jax.jit, static_argnames=("causal", "deterministic", "interpret"))
def kernels(
    q, k, v, do, dlse, segs, *, causal: bool, deterministic: bool = False, interpret=INTERPRET
):
    """`(out, lse, dq, dk, dv)` of the Mosaic kernels, the backward fed the cotangents
    `do`, `dlse` as `jflash.flash_attention`'s VJP feeds them."""
    h = q.shape[-1]
    bs = jflash.default_block_sizes(q.shape[1], h, q.dtype, implementation="pallas_mosaic")
    mask, scale = Mask(causal), h**-0.5
    o, lse = mosaic_fwd(
        q,
        k,
        v,
        segs,
        mask=mask,
        scale=scale,
        out_dtype=q.dtype,
        block_kv=bs.block_kv,
        stages=bs.num_stages,
        interpret=interpret,
    )
    grads = mosaic_bwd(
        q,
        k,
        v,
        do.astype(q.dtype),
        lse,
        delta_from(o, do, dlse),
        segs,
        mask=mask,
        scale=scale,
        grad_dtype=q.dtype,
        block_q_dkv=bs.block_q_dkv,
        block_kv_dq=bs.block_kv_dq,
        stages=bs.num_stages_bwd,
        deterministic=deterministic,
        interpret=interpret,
    )
    return (o, lse, *grads)


def inputs(case: Case, seed: int):
    return make_inputs(
        seed,
        batch=case.batch,
        q_len=case.q_len,
        kv_len=case.kv_len or case.q_len,
        q_heads=case.q_heads,
        kv_heads=case.kv_heads,
        head_dim=case.head_dim,
        dtype=case.dtype,
    )


# Packed documents crossing tile boundaries (query tiles of 64 rows, key tiles of 64 to
# 256), one-token documents, ids not sorted or interleaved, causal and not, GQA / MQA,
# D = 64 (dQ fused into the dK/dV kernel, or the dQ kernel) and 128, T != S, ragged
# lengths, batch > 1.
CASES = [
    Case(q_len=320, segments=5),
    Case(causal=False, head_dim=128, lengths=(70, 1, 1, 60, 1, 123)),
    Case(head_dim=128, q_heads=4, kv_heads=1, q_len=192, order="shuffled"),
    Case(causal=False, q_len=200, kv_len=264, segments=3, deterministic=True, batch=2),
    Case(q_len=128, segments=3, order="interleaved"),
    Case(head_dim=128, q_len=256, segments=3, dtype=jnp.float16, batch=2),
]


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.slow
def test_matches_oracle(case):
    seed = case_seed(case)
    q, k, v, do, dlse = inputs(case, seed)
    segs = segment_ids(case, seed)
    got = kernels(q, k, v, do, dlse, segs, causal=case.causal, deterministic=case.deterministic)
    want = oracle(q, k, v, do, dlse, causal=case.causal, segment_ids=segs)
    check(got, want, segs, causal=case.causal, dtype=case.dtype)


@pytest.mark.slow
def test_rows_that_see_nothing():
    """Queries whose id no key holds: output 0, LSE -inf, dQ 0 (and no NaN anywhere)."""
    case = Case(causal=False, q_heads=2, kv_heads=1, q_len=192, kv_len=128)
    q, k, v, do, dlse = inputs(case, 3)
    q_seg = np.zeros((1, 192), np.int32)
    q_seg[:, 60:130], q_seg[:, 130:] = 9, 1  # no key holds 9
    kv_seg = np.zeros((1, 128), np.int32)
    kv_seg[:, 50:] = 1
    segs = (jnp.asarray(q_seg), jnp.asarray(kv_seg))
    got = kernels(q, k, v, do, dlse, segs, causal=False)
    want = oracle(q, k, v, do, dlse, causal=False, segment_ids=segs)
    check(got, want, segs, causal=False, dtype=case.dtype)
    out, lse, dq = (np.asarray(x, np.float32) for x in got[:3])
    assert np.all(out[:, 60:130] == 0) and np.all(dq[:, 60:130] == 0)
    assert np.all(np.isneginf(lse[:, :, 60:130])) and np.all(np.isfinite(lse[:, :, 130:]))


@pytest.mark.parametrize("second", ["packed", "interleaved"])
def test_vmap_over_calls_with_their_own_ids(second):
    """`jax.vmap` of `flash_attention` over calls with their own segment ids, sorted in
    the first and sorted or not in the second (which kernel runs is chosen once for all
    of them): outputs, LSE and gradients are each call's own."""
    case = Case(q_len=192, segments=3)
    calls = [inputs(case, seed) for seed in (1, 2)]
    q, k, v, do, dlse = (jnp.stack(xs) for xs in zip(*calls, strict=True))
    ids = [segment_ids(case, 1)[0], segment_ids(dataclasses.replace(case, order=second), 2)[0]]
    attend = functools.partial(
        jflash.flash_attention,
        causal=True,
        return_lse=True,
        implementation="pallas_mosaic",
        interpret=INTERPRET,
    )

    def one(q, k, v, do, dlse, seg):
        return value_and_grads(attend, q, k, v, do, dlse, segment_ids=seg)

    got = jax.jit(jax.vmap(one))(q, k, v, do, dlse, jnp.stack(ids))
    for i, seg in enumerate(ids):
        want = oracle(*(x[i] for x in (q, k, v, do, dlse)), causal=True, segment_ids=seg)
        check([x[i] for x in got], want, (seg, seg), causal=True, dtype=case.dtype)


def test_vmap_launches_each_forward_kernel_once(monkeypatch):
    """Under `jax.vmap` with mapped segment ids the forward launches its two kernels
    (any ids, then sorted key ids; each runs where its case holds) once each,
    the mapped calls folded into the batch, and no conditional (XLA's GPU conditional
    waits for its flag on the host): lowered for CUDA, no GPU."""
    import jflash._dispatch as dispatch

    monkeypatch.setattr(dispatch, "_platform", lambda: "gpu")
    monkeypatch.setattr(dispatch, "_is_hopper", lambda: True)
    h100 = mesh_lib.AbstractDevice("NVIDIA H100 80GB HBM3", 132, "gpu")
    q = jax.ShapeDtypeStruct((3, 1, 512, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((3, 1, 512, 2, 64), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((3, 1, 512), jnp.int32)

    def attend(q, k, v, seg):
        return jflash.flash_attention(
            q, k, v, causal=True, segment_ids=seg, implementation="pallas_mosaic"
        )

    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h100)
    with jax.sharding.use_abstract_mesh(mesh):
        traced = jax.jit(jax.vmap(attend)).trace(q, kv, kv, seg)
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.case") == 0
    assert text.count("@mosaic_gpu") == 2  # the two forms, each launched once


def test_forward_outputs_alias_no_input(monkeypatch):
    """With segment ids the forward launches two kernels, and neither's output or LSE is
    aliased to an input (only the work-item counter, Pallas's zeroed scratch, is): XLA's
    dynamic-slice fusion writes a custom call's result straight into the
    `dynamic_update_slice` that stacks it (a `lax.scan`'s outputs, remat's saved
    residuals), which loses what an aliased input held. A second launch that wrote into
    the first one's outputs gave every row stale values under `lax.scan` on an H200, and
    a trainer step infinite gradients. Lowered for CUDA, no GPU."""
    import re

    import jflash._dispatch as dispatch

    monkeypatch.setattr(dispatch, "_platform", lambda: "gpu")
    monkeypatch.setattr(dispatch, "_is_hopper", lambda: True)
    h100 = mesh_lib.AbstractDevice("NVIDIA H100 80GB HBM3", 132, "gpu")
    q = jax.ShapeDtypeStruct((1, 512, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 512, 2, 64), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((1, 512), jnp.int32)

    def attend(q, k, v, seg):
        return jflash.flash_attention(
            q, k, v, causal=True, segment_ids=seg, implementation="pallas_mosaic"
        )

    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h100)
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(attend).trace(q, kv, kv, seg).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
    assert len(calls) == 2
    for call in calls:
        aliased = re.findall(r"output_operand_alias<output_tuple_indices = \[(\d+)\]", call)
        assert aliased == ["2"], aliased  # outputs: (o, lse, the counter)


@pytest.mark.parametrize("order", ["packed", "interleaved"])
def test_scan_stacks_each_layers_output(order):
    """`flash_attention` with segment ids inside a `lax.scan` whose outputs stack each
    step's output and LSE (as remat's saved residuals do in a scanned model), with
    gradients through them: every layer matches the oracle. Sorted ids run the span
    kernel; interleaved ones the id compare, whose outputs the span kernel copies.
    Compiled, XLA fuses the stacking into the kernel's last launch."""
    case = Case(q_len=256, segments=4, order=order)
    q, k, v, do, dlse = inputs(case, 7)
    seg = segment_ids(case, 7)[0]
    scales = jnp.asarray([1.0, 0.5, 2.0], jnp.float32)

    def layers(q, k, v, do, dlse, implementation):
        def one(_, c):
            out, lse = jflash.flash_attention(
                (q * c).astype(q.dtype),
                k,
                v,
                causal=True,
                segment_ids=seg,
                return_lse=True,
                implementation=implementation,
                interpret=INTERPRET if implementation == "pallas_mosaic" else None,
            )
            return None, (out, lse)

        def loss(q, k, v):
            out, lse = jax.lax.scan(one, None, scales)[1]
            dots = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)[None])
            return dots + jnp.sum(jnp.where(jnp.isneginf(lse), 0.0, lse) * dlse[None]), (out, lse)

        (_, (out, lse)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return (out, lse, *grads)

    got = jax.jit(functools.partial(layers, implementation="pallas_mosaic"))(q, k, v, do, dlse)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, do, dlse)]
    with jax.default_matmul_precision("highest"):
        want = jax.jit(functools.partial(layers, implementation="xla"))(*f32)
    for i in range(len(scales)):
        assert_close(
            (got[0][i], got[1][i]), (want[0][i], want[1][i]), case.dtype, names=("out", "lse")
        )
    assert_close(got[2:], want[2:], case.dtype, names=("dq", "dk", "dv"))


@pytest.mark.parametrize("q_offset, k_offset", [(0, 1), (64, 0)], ids=["striped", "later"])
@pytest.mark.slow
def test_sorted_and_unsorted_ids_mask_alike_at_offsets(q_offset, k_offset):
    """The forward's two masks, each row's key span (sorted key ids) and the id compare
    (any other order), give the same output and LSE on a ring block's offsets (a
    striped off-diagonal step: the key one position later; a later query block), and
    match the dense oracle; so does the id compare alone on the sorted ids."""
    case = Case(q_len=192, segments=4)
    q, k, v, *_ = inputs(case, 5)
    q_seg = random_segments(5, 1, 192, 4)
    unsorted = jnp.asarray([3, 0, 2, 1], jnp.int32)[q_seg]  # the same documents
    mask, scale = Mask(True, q_offset=q_offset, k_offset=k_offset), 64**-0.5

    def forward(seg):
        return mosaic_fwd(
            q,
            k,
            v,
            (seg, seg),
            mask=mask,
            scale=scale,
            out_dtype=q.dtype,
            block_kv=128,
            stages=2,
            interpret=INTERPRET,
        )

    by_spans, by_ids = forward(q_seg), forward(unsorted)
    for a, b in zip(by_spans, by_ids, strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    ids_only = dict(mask=mask, scale=scale, out_dtype=q.dtype, block_kv=128, stages=2, wgs=2)
    ids_only = _forward(
        q, k, v, q_seg, q_seg, jnp.bool_(True), forms=(dict(ids_only, interpret=INTERPRET),)
    )
    for a, b in zip(by_spans, ids_only, strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    seen = mask.dense(192, 192, (q_seg, q_seg))[:, None]  # [B, 1, T, S]
    kr, vr = (jnp.repeat(x.astype(jnp.float32), 2, axis=2) for x in (k, v))
    with jax.default_matmul_precision("highest"):
        s = jnp.einsum("btnh,bsnh->bnts", q.astype(jnp.float32), kr) * scale
        s = jnp.where(seen, s, -jnp.inf)
        lse = jax.nn.logsumexp(s, axis=-1)
        p = jnp.where(seen, jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0)[..., None]), 0)
        out = jnp.einsum("bnts,bsnh->btnh", p, vr)
    got_lse = jnp.where(jnp.isneginf(by_spans[1]), 0.0, by_spans[1])
    want_lse = jnp.where(jnp.isneginf(lse), 0.0, lse)
    assert_close((by_spans[0], got_lse), (out, want_lse), case.dtype, names=("out", "lse"))
    assert bool(jnp.isneginf(lse).any()) == (q_offset == 0)  # the first row sees nothing


@pytest.mark.parametrize("causal, head_dim", [(True, 64), (False, 128)])
@pytest.mark.slow
def test_tiles_that_cannot_meet_are_skipped(causal, head_dim):
    """NaN in every input row of the first document (256 rows: whole key tiles): the
    second document's outputs and gradients stay finite and right only if no kernel
    reads those tiles for it (a masked tile would give 0 * NaN = NaN)."""
    case = Case(causal=causal, q_heads=2, kv_heads=1, head_dim=head_dim, q_len=384)
    q, k, v, do, dlse = inputs(case, 5)
    seg = np.zeros((1, 384), np.int32)
    seg[:, 256:300], seg[:, 300:] = 1, 2
    segs = (jnp.asarray(seg), jnp.asarray(seg))
    want = oracle(q, k, v, do, dlse, causal=causal, segment_ids=segs)
    first = slice(0, 256)
    q, k, v, do = (x.at[:, first].set(jnp.nan) for x in (q, k, v, do))
    got = kernels(q, k, v, do, dlse, segs, causal=causal)

    def later(results):  # rows of the other documents (LSE is [B, N, T])
        return [x[:, :, 256:] if i == 1 else x[:, 256:] for i, x in enumerate(results)]

    assert_close(later(got), later(want), case.dtype)
    assert np.isnan(np.asarray(got[0][:, first], np.float32)).all()  # the NaNs were read


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.slow
def test_inside_shard_map(deterministic):
    """Inside a user's `jax.shard_map` with `check_vma=True` (inputs sharded over a
    mesh axis, outputs varying like them): right, and bitwise as outside where
    deterministic. One device: jax 0.11.2's GPU interpreter keeps one barrier table for
    every simulated device of a shard_map and fails its end-of-kernel check at 2."""
    case = Case(causal=True, q_heads=2, kv_heads=1, q_len=128, segments=3)
    q, k, v, do, dlse = inputs(case, 8)
    segs = segment_ids(case, 8)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    spec = jax.sharding.PartitionSpec("data")

    def run(q, k, v, do, dlse, q_seg, kv_seg):
        return kernels(q, k, v, do, dlse, (q_seg, kv_seg), causal=True, deterministic=deterministic)

    inside = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=True))
    got = inside(q, k, v, do, dlse, *segs)
    want = oracle(q, k, v, do, dlse, causal=True, segment_ids=segs)
    check(got, want, segs, causal=True, dtype=case.dtype)
    if deterministic:
        for a, b in zip(got, run(q, k, v, do, dlse, *segs), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("head_dim, deterministic", [(64, False), (64, True), (128, False)])
def test_lowers_for_cuda(head_dim, deterministic):
    """With segment ids the forward, dK/dV (fused dQ or not) and dQ kernels lower for a
    CUDA GPU (no GPU needed, against an abstract H100): layouts, SMEM budget, wgmma and
    TMA operand rules that the interpreter does not check."""
    q = jax.ShapeDtypeStruct((2, 512, 8, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 384, 2, head_dim), jnp.bfloat16)
    ids = (jax.ShapeDtypeStruct((2, 512), jnp.int32), jax.ShapeDtypeStruct((2, 384), jnp.int32))
    dlse = jax.ShapeDtypeStruct((2, 8, 512), jnp.float32)

    def both(q, k, v, do, dlse, segs):
        kw = dict(causal=True, deterministic=deterministic, interpret=False)
        return kernels(q, k, v, do, dlse, segs, **kw)

    h100 = mesh_lib.AbstractDevice("NVIDIA H100 80GB HBM3", 132, "gpu")
    with jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h100)
    ):
        lowered = jax.jit(both).trace(q, kv, kv, q, dlse, ids).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "jflash_mosaic_fwd" in text and "jflash_mosaic_dkv" in text
    fused = fuses_dq(head_dim, deterministic)
    assert ("jflash_mosaic_dq" in text) != fused


@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_launches_tiles_first_with_ids(deterministic, monkeypatch):
    """LAUNCH_ORDER: with segment ids the causal backward kernels put their tiles
    outermost at any length (a packed row's tiles are heaviest first only within each
    document), the forward keeps heads outermost; lowered for CUDA, no GPU needed."""
    from jflash import _launch_order

    asked = []  # (packed, tiles first) per launch, in trace order
    decide = _launch_order.tiles_first

    def spy(*args, **kwargs):
        asked.append((kwargs.get("packed", False), decide(*args, **kwargs)))
        return asked[-1][1]

    monkeypatch.setattr(_launch_order, "tiles_first", spy)
    t = 16384  # 128 key tiles per head: heads outermost without ids
    q = jax.ShapeDtypeStruct((1, t, 8, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, t, 2, 64), jnp.bfloat16)
    ids = (jax.ShapeDtypeStruct((1, t), jnp.int32),) * 2
    dlse = jax.ShapeDtypeStruct((1, 8, t), jnp.float32)
    h100 = mesh_lib.AbstractDevice("NVIDIA H100 80GB HBM3", 132, "gpu")
    for segs in (ids, None):
        asked.clear()

        def both(q, k, v, do, dlse, segs):
            kw = dict(causal=True, deterministic=deterministic, interpret=False)
            return kernels(q, k, v, do, dlse, segs, **kw)

        with jax.sharding.use_abstract_mesh(
            jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h100)
        ):
            jax.jit(both).trace(q, kv, kv, q, dlse, segs).lower(lowering_platforms=("cuda",))
        backward = 2 if deterministic else 1  # dK/dV, and the dQ kernel
        if segs is None:
            assert asked and not any(first for _, first in asked), asked
        else:
            assert asked[-backward:] == [(True, True)] * backward, asked
            assert not any(first for _, first in asked[:-backward]), asked


# The child of `test_work_items_without_keys`: the forward of q ids that no key holds
# for most query tiles, as the ring's blocks of packed documents give it, written to
# the .npz named by argv[1]. Compiled (a GPU), 1,024 work items share the SMs;
# interpreted, 8 share the interpreter's two CTAs.
_ITEMS_WITHOUT_KEYS = """
import sys
import jax, jax.numpy as jnp, numpy as np
from jflash._mask import Mask
from jflash._mosaic_fwd import mosaic_fwd
gpu = jax.default_backend() == "gpu"
t, s, n = (4096, 2048, 32) if gpu else (512, 256, 2)
ks = jax.random.split(jax.random.key(7), 3)
q = jax.random.normal(ks[0], (1, t, n, 128), jnp.bfloat16)
k, v = (jax.random.normal(x, (1, s, n // 4 or 1, 128), jnp.bfloat16) for x in ks[1:])
q_seg = np.full((1, t), 7, np.int32)
q_seg[:, t // 3 : 3 * t // 4], q_seg[:, 3 * t // 4 :] = 8, 2  # 7 and 8: no key holds them
kv_seg = np.ones((1, s), np.int32)
kv_seg[:, s // 2 :] = 2
segs = (jnp.asarray(q_seg), jnp.asarray(kv_seg))
out = {}
for dtype in (jnp.float32, jnp.bfloat16):  # f32: the ring's partial outputs
    o, lse = mosaic_fwd(q, k, v, segs, mask=Mask(False), scale=128**-0.5, out_dtype=dtype,
                        block_kv=128, stages=2, interpret=not gpu)
    out[jnp.dtype(dtype).name] = np.asarray(o, np.float32)
    out["lse_" + jnp.dtype(dtype).name] = np.asarray(lse)
inputs = {name: np.asarray(x, np.float32) for name, x in zip("qkv", (q, k, v))}
np.savez(sys.argv[1], q_seg=q_seg, kv_seg=kv_seg, **inputs, **out)
"""


def test_work_items_without_keys(tmp_path):
    """DEADLOCK: a persistent forward CTA that takes several work items in a row whose
    query ids meet no key (the ring's blocks of packed documents) finishes, rows that
    see no key get o = 0 and LSE -inf, and the rest match the oracle. Before, two such
    items in a row deadlocked the CTA's compute warpgroups (the GPU hung; so does the
    interpreter): the forward runs in a child process with a time limit."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    path = tmp_path / "out.npz"
    limit = 300
    try:
        run = subprocess.run(
            [sys.executable, "-c", _ITEMS_WITHOUT_KEYS, str(path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=limit,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the forward did not finish in {limit} s: its warpgroups deadlocked")
    assert run.returncode == 0, run.stderr[-3000:]
    got = np.load(path)
    t, n = got["q"].shape[1:3]
    q, k, v = (jnp.asarray(got[name], jnp.bfloat16) for name in "qkv")  # exact: bf16 drawn
    segs = (jnp.asarray(got["q_seg"]), jnp.asarray(got["kv_seg"]))
    do, dlse = jnp.zeros((1, t, n, 128), jnp.float32), jnp.zeros((1, n, t), jnp.float32)
    want = oracle(q, k, v, do, dlse, causal=False, segment_ids=segs)
    unseen = got["q_seg"][0] != 2
    for name in ("float32", "bfloat16"):
        o, lse = got[name], got["lse_" + name]
        assert np.all(o[:, unseen] == 0) and np.all(np.isneginf(lse[:, :, unseen])), name
        assert_close(
            (o[:, ~unseen], lse[:, :, ~unseen]),
            (want[0][:, ~unseen], want[1][:, :, ~unseen]),
            jnp.bfloat16,
            names=("out", "lse"),
        )


@pytest.mark.slow
@pytest.mark.parametrize(
    "q_ids, kv_ids, causal",
    [
        ([2] * 128, [1] * 128, False),  # no row sees a key: the whole call is empty
        ([2] * 128, [1] * 102 + [2] * 26, False),  # every row sees the last 26 keys
        ([0] * 102 + [1] * 26 + [2] * 128, None, True),  # a diagonal block
    ],
    ids=["none", "tail", "diagonal"],
)
def test_ring_blocks_of_packed_documents_in_f32(q_ids, kv_ids, causal):
    """The forward calls of one zigzag rank's steps over packed documents (a ring of two,
    512 tokens, documents of 102, 256 and 154: rank 0's second chunk against the
    source's halves, and its diagonal block), f32 outputs as the ring takes them, against
    the oracle: rows that see no key give o = 0 and LSE -inf."""
    kv_ids = q_ids if kv_ids is None else kv_ids
    segs = tuple(jnp.asarray([ids], jnp.int32) for ids in (q_ids, kv_ids))
    q, k, v, do, dlse = make_inputs(
        5,
        batch=1,
        q_len=len(q_ids),
        kv_len=len(kv_ids),
        q_heads=2,
        kv_heads=1,
        head_dim=128,
        dtype=jnp.bfloat16,
    )
    bs = jflash.default_block_sizes(q.shape[1], 128, q.dtype, implementation="pallas_mosaic")
    o, lse = mosaic_fwd(
        q,
        k,
        v,
        segs,
        mask=Mask(causal),
        scale=128**-0.5,
        out_dtype=jnp.float32,
        block_kv=bs.block_kv,
        stages=bs.num_stages,
        interpret=INTERPRET,
    )
    want = oracle(q, k, v, do, dlse, causal=causal, segment_ids=segs)[:2]
    check((o, lse), want, segs, causal=causal, dtype=jnp.bfloat16)
    sees = np.asarray(Mask(causal).dense(q.shape[1], k.shape[1], segs).any(axis=-1))  # [B, T]
    assert np.all(np.asarray(o)[~sees] == 0)
