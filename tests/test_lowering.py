"""CI gate: the Triton kernels lower for CUDA on a machine without a GPU.

Catches shape, dtype and primitive errors that interpret mode does not see (Triton
block-shape rules, unsupported ops), by lowering against an abstract H100.
"""

from __future__ import annotations

import dataclasses
import re
import warnings

import jax
import jax.numpy as jnp
import pytest
from conftest import ON_GPU
from jax._src import mesh as mesh_lib

import jflash
import jflash._dispatch as dispatch
from jflash import _mosaic_fwd
from jflash._mosaic_bwd import fuses_dq

_H100 = mesh_lib.AbstractDevice("NVIDIA H100 80GB HBM3", 132, "gpu")


def _cuda_text(fn, *args) -> str:
    """`fn(*args)` lowered for CUDA on a mesh of one abstract H100: its module's text."""
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=_H100)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _mosaic_forward(causal: bool, segments: bool, block_sizes=None):
    """`fwd(q, k, v, seg)`: the Mosaic forward, with `seg` as both ids where `segments`."""

    def fwd(q, k, v, seg):
        return jflash.flash_attention(
            q,
            k,
            v,
            causal=causal,
            segment_ids=seg if segments else None,
            implementation="pallas_mosaic",
            block_sizes=block_sizes,
        )

    return fwd


@pytest.mark.parametrize(
    "q_heads, kv_heads, head_dim, seq, dtype, causal, segments",
    [
        (32, 8, 128, 4096, jnp.bfloat16, True, False),
        (8, 1, 64, 1000, jnp.float16, True, True),
        (4, 4, 100, 777, jnp.bfloat16, False, False),
        (4, 2, 256, 256, jnp.float32, True, False),
    ],
)
def test_lowers_for_cuda(monkeypatch, q_heads, kv_heads, head_dim, seq, dtype, causal, segments):
    monkeypatch.setattr(dispatch, "_platform", lambda: "gpu")
    q = jax.ShapeDtypeStruct((2, seq, q_heads, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((2, seq, kv_heads, head_dim), dtype)
    seg = jax.ShapeDtypeStruct((2, seq), jnp.int32) if segments else None

    def fwd_bwd(q, k, v, seg):
        def loss(q, k, v):
            out, lse = jflash.flash_attention(
                q,
                k,
                v,
                causal=causal,
                segment_ids=seg,
                return_lse=True,
                implementation="pallas_triton",
                interpret=False,
            )
            return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    text = _cuda_text(fwd_bwd, q, kv, kv, seg)
    for name in ("jflash_fwd", "jflash_bwd_dkv", "jflash_bwd_dq"):
        assert name in text, f"{name} missing from the CUDA lowering"


@pytest.mark.parametrize(
    "q_heads, kv_heads, head_dim, seq, kv_seq, dtype, causal, q_offset, deterministic",
    [
        (32, 8, 128, 4096, 4096, jnp.bfloat16, True, 0, False),
        (32, 8, 128, 4096, 4096, jnp.bfloat16, True, 0, True),
        (8, 1, 64, 1000, 1000, jnp.float16, True, 0, False),
        (4, 4, 128, 300, 700, jnp.bfloat16, False, 0, True),
        (4, 4, 64, 300, 700, jnp.bfloat16, False, 0, True),
        (4, 2, 64, 256, 512, jnp.bfloat16, True, 256, False),
        # From 16k queries the D = 64 forward runs three compute warpgroups.
        (8, 2, 64, 16384, 16384, jnp.bfloat16, True, 0, False),
    ],
)
def test_mosaic_lowers_for_cuda(
    monkeypatch, q_heads, kv_heads, head_dim, seq, kv_seq, dtype, causal, q_offset, deterministic
):
    """The Mosaic GPU kernels lower (Pallas -> Mosaic GPU MLIR) without a GPU.

    The GPU interpreter (tests/test_flash.py) checks their numbers on CPU but not their
    lowering (layouts, SMEM budget, wgmma operand rules): this gate does.
    """
    monkeypatch.setattr(dispatch, "_platform", lambda: "gpu")
    monkeypatch.setattr(dispatch, "_is_hopper", lambda: True)
    q = jax.ShapeDtypeStruct((2, seq, q_heads, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((2, kv_seq, kv_heads, head_dim), dtype)

    def fwd_bwd(q, k, v):
        def loss(q, k, v):
            out, lse = jflash.flash_attention(
                q,
                k,
                v,
                causal=causal,
                q_offset=q_offset,
                return_lse=True,
                implementation="pallas_mosaic",
                deterministic=deterministic,
            )
            return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    text = _cuda_text(fwd_bwd, q, kv, kv)
    for name in ("jflash_mosaic_fwd", "jflash_mosaic_dkv"):
        assert name in text, f"{name} missing from the CUDA lowering"
    # The fused backward adds dQ with TMA reduce-adds into an aliased f32 buffer; the
    # two-kernel one (deterministic) runs the dQ kernel instead.
    fused = fuses_dq(head_dim, deterministic)
    assert ("jflash_mosaic_dq" in text) != fused
    assert ("cp.reduce.async.bulk.tensor" in text) == fused


@pytest.mark.parametrize(
    "head_dim, deterministic, segments",
    [(128, False, False), (64, False, False), (64, True, False), (128, False, True)],
)
def test_mosaic_f32_partials_lower_for_cuda(monkeypatch, head_dim, deterministic, segments):
    """The ring's variant: f32 partial outputs and f32 gradients (larger SMEM tiles);
    with segment ids at D = 128 two stages of the default key block do not fit, and the
    forward streams smaller blocks (Mosaic's own shared-memory check runs here)."""
    from jflash._mask import Mask
    from jflash._mosaic_bwd import mosaic_bwd
    from jflash._mosaic_fwd import mosaic_fwd

    q = jax.ShapeDtypeStruct((1, 512, 8, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 512, 2, head_dim), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((1, 8, 512), jnp.float32)
    bs = jflash.default_block_sizes(512, head_dim, jnp.bfloat16, implementation="pallas_mosaic")
    mask = Mask(True, 512, 256)

    def both(q, k, v, do, lse, delta, seg):
        segs = (seg, seg) if segments else None
        o, lse_out = mosaic_fwd(
            q,
            k,
            v,
            segs,
            mask=mask,
            scale=0.1,
            out_dtype=jnp.float32,
            block_kv=bs.block_kv,
            stages=bs.num_stages,
        )
        grads = mosaic_bwd(
            q,
            k,
            v,
            do,
            lse,
            delta,
            mask=mask,
            scale=0.1,
            grad_dtype=jnp.float32,
            block_q_dkv=bs.block_q_dkv,
            block_kv_dq=bs.block_kv_dq,
            segs=segs,
            stages=bs.num_stages_bwd,
            deterministic=deterministic,
        )
        return o, lse_out, grads

    seg = jax.ShapeDtypeStruct((1, 512), jnp.int32)
    traced = jax.jit(both).trace(q, kv, kv, q, lse, lse, seg)
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("mosaic_gpu") >= 3


@pytest.mark.parametrize(
    "head_dim, dtype, hopper, want",
    [
        (128, jnp.bfloat16, True, "pallas_mosaic"),  # segment ids too: the kernels take them
        (64, jnp.float16, True, "pallas_mosaic"),
        (100, jnp.bfloat16, True, "pallas_triton"),
        (128, jnp.float32, True, "pallas_triton"),
        (128, jnp.bfloat16, False, "pallas_triton"),
    ],
)
def test_default_dispatch_on_gpu(monkeypatch, head_dim, dtype, hopper, want):
    """`implementation=None` on a GPU: Mosaic on sm90 where it applies, Triton otherwise,
    and the reason names what ruled Mosaic out."""
    monkeypatch.setattr(dispatch, "_platform", lambda: "gpu")
    monkeypatch.setattr(dispatch, "_is_hopper", lambda: hopper)
    kernel = dispatch.resolve(
        None,
        None,
        None,
        q_len=1024,
        kv_len=1024,
        head_dim=head_dim,
        dtype=dtype,
    )
    assert kernel.name == want
    if want == "pallas_triton" and hopper:
        assert "Mosaic" in kernel.reason


def test_named_mosaic_refuses_what_it_cannot_run(monkeypatch):
    monkeypatch.setattr(dispatch, "_platform", lambda: "gpu")
    monkeypatch.setattr(dispatch, "_is_hopper", lambda: True)
    common = dict(q_len=64, kv_len=64)
    with pytest.raises(NotImplementedError, match="head_dim=100"):
        dispatch.resolve("pallas_mosaic", None, None, head_dim=100, dtype=jnp.bfloat16, **common)
    with pytest.raises(NotImplementedError, match="dtype=float32"):
        dispatch.resolve("pallas_mosaic", None, None, head_dim=128, dtype=jnp.float32, **common)
    monkeypatch.setattr(dispatch, "_is_hopper", lambda: False)
    with pytest.raises(NotImplementedError, match="Hopper GPU .*interpret=True"):
        dispatch.resolve("pallas_mosaic", False, None, head_dim=128, dtype=jnp.bfloat16, **common)
    kernel = dispatch.resolve(
        "pallas_mosaic", True, None, head_dim=128, dtype=jnp.bfloat16, **common
    )  # the GPU interpreter needs no Hopper
    assert kernel.name == "pallas_mosaic" and kernel.interpret
    monkeypatch.setattr(dispatch, "_is_hopper", lambda: True)
    with pytest.raises(ValueError, match="BlockSizes.block_q=128"):
        dispatch.resolve(
            "pallas_mosaic",
            None,
            jflash.BlockSizes(block_q=128),
            head_dim=128,
            dtype=jnp.bfloat16,
            **common,
        )


def test_interpreted_mosaic_warns_where_the_interpreter_can_hang(monkeypatch):
    """The GPU interpreter hangs with too few host threads for its warpgroups (2 cores
    and 1-3 CPU devices); interpreting the Mosaic kernels there says so and how to fix
    it, and stays quiet with enough threads (the tests' 8 devices) or compiled."""
    import warnings

    common = dict(q_len=64, kv_len=64, head_dim=64, dtype=jnp.bfloat16)
    monkeypatch.setattr(dispatch.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(dispatch.jax, "local_device_count", lambda backend=None: 1)
    with pytest.warns(UserWarning, match=r"can hang .* 2 cores, 1 CPU devices.*device_count=8"):
        dispatch.resolve("pallas_mosaic", True, None, **common)
    monkeypatch.setattr(dispatch.jax, "local_device_count", lambda backend=None: 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dispatch.resolve("pallas_mosaic", True, None, **common)
        monkeypatch.setattr(dispatch.jax, "local_device_count", lambda backend=None: 1)
        dispatch.resolve("pallas_triton", True, None, **common)  # one thread per program


def test_determinism_switch(monkeypatch):
    """`deterministic=None` follows XLA's `--xla_gpu_deterministic_ops`; the fused dQ
    refuses query blocks other than one wgmma M, naming the way out."""
    monkeypatch.setattr(dispatch, "_platform", lambda: "gpu")
    monkeypatch.setattr(dispatch, "_is_hopper", lambda: True)
    common = dict(q_len=64, kv_len=64, head_dim=64, dtype=jnp.bfloat16)
    for flags, want in (
        ("", False),
        ("--xla_gpu_deterministic_ops=true", True),
        ("--foo=1 --xla_gpu_deterministic_ops", True),
        ("--xla_gpu_deterministic_ops=false", False),
    ):
        monkeypatch.setenv("XLA_FLAGS", flags)
        assert dispatch.resolve("pallas_mosaic", None, None, **common).deterministic == want
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=true")
    kernel = dispatch.resolve("pallas_mosaic", None, None, deterministic=False, **common)
    assert not kernel.deterministic
    with pytest.raises(ValueError, match="deterministic='yes'"):
        dispatch.resolve("pallas_mosaic", None, None, deterministic="yes", **common)
    # D=64 fuses dQ at 64-query steps (each warpgroup its own) and 128 (split by rows).
    wider = jflash.BlockSizes(block_q=64, block_kv=128, block_q_dkv=256)
    with pytest.raises(ValueError, match="block_q_dkv=256.*takes 64 or 128.*deterministic=True"):
        dispatch.resolve("pallas_mosaic", None, wider, deterministic=False, **common)
    assert dispatch.resolve("pallas_mosaic", None, wider, deterministic=True, **common)
    wide = jflash.BlockSizes(block_q=64, block_kv=128, block_q_dkv=128)
    assert dispatch.resolve("pallas_mosaic", None, wide, deterministic=False, **common)
    # The defaults: 128-query steps for the fused dQ, 64 for the two-kernel backward.
    for det, want in ((False, 128), (True, 64)):
        kernel = dispatch.resolve("pallas_mosaic", None, None, deterministic=det, **common)
        assert kernel.block_sizes.block_q_dkv == want
    # D=128 fuses dQ at 64-query steps only (split by columns between the warpgroups).
    common["head_dim"] = 128
    with pytest.raises(ValueError, match="block_q_dkv=128.*deterministic=True"):
        dispatch.resolve("pallas_mosaic", None, wide, deterministic=False, **common)
    assert dispatch.resolve("pallas_mosaic", None, wide, deterministic=True, **common)


@pytest.mark.parametrize(
    "kernel, head_dim, seq, segments",
    [
        ("fwd", 128, 4096, False),
        ("fwd", 64, 4096, False),
        ("fwd", 64, 16384, False),  # three compute warpgroups, one Q slot
        ("fwd", 64, 65536, False),  # three, and the second Q slot
        ("fwd", 128, 4096, True),
        ("dkv", 128, 4096, False),
        ("dkv", 64, 4096, False),
        ("dkv", 64, 4096, True),
    ],
)
def test_timeline_default_space_fits_each_kernel(monkeypatch, kernel, head_dim, seq, segments):
    """`jflash.kernel_timeline`'s default profiler buffer fits beside each kernel's own
    shared memory. Mosaic's check runs as the kernel lowers; right after it, the
    profiler's trace writer (a host callback) needs a GPU backend and stops the
    lowering here on CPU: reaching it means the kernel passed the check (on a GPU the
    lowering goes on and passes)."""
    monkeypatch.setattr(dispatch, "_platform", lambda: "gpu")
    monkeypatch.setattr(dispatch, "_is_hopper", lambda: True)
    q = jax.ShapeDtypeStruct((1, seq, 8, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, seq, 2, head_dim), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((1, seq), jnp.int32) if segments else None

    def loss(q, k, v, seg):
        out = jflash.flash_attention(
            q, k, v, causal=True, segment_ids=seg, implementation="pallas_mosaic"
        )
        return jnp.sum(out.astype(jnp.float32))

    fn = loss if kernel == "fwd" else jax.grad(loss, argnums=(0, 1, 2))
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=_H100)
    # Where the forward's second Q slot does not fit beside the profiler's buffer, the
    # profiled kernel keeps one, and a warning says so.
    second_slot = head_dim == 128 or seq >= _mosaic_fwd.THREE_WG_MEMORY_Q_MIN_LEN
    one_slot = kernel == "fwd" and not segments and second_slot
    with (
        jax.sharding.use_abstract_mesh(mesh),
        jflash.kernel_timeline("unused", kernels=kernel),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        lowering = jax.jit(fn).trace(q, kv, kv, seg)
        said = [w for w in caught if "keeps one Q slot" in str(w.message)]
        assert bool(said) == one_slot, [str(w.message) for w in caught]
        if ON_GPU:  # a GPU backend takes the trace writer too: the whole lowering passes
            lowering.lower(lowering_platforms=("cuda",))
        else:
            with pytest.raises(ValueError, match="different from the lowering platform cuda"):
                lowering.lower(lowering_platforms=("cuda",))


def test_mosaic_pipeline_depth_fits_shared_memory():
    """`fit_stages` lowers the K/V pipeline depth until the CTA's tiles fit 227 KiB, and
    names the numbers when even two stages cannot fit."""
    from jflash._mosaic_common import SMEM_BYTES, fit_stages

    rows, h = 128, 128
    q_tile, f32_out, kv_stage = rows * h * 2, rows * h * 4, 2 * 128 * h * 2
    assert fit_stages("fwd", 3, q_tile, kv_stage) == 3  # bf16 output reuses Q's slot
    assert fit_stages("fwd", 3, q_tile + f32_out, kv_stage) == 2  # the ring's f32 output
    assert q_tile + f32_out + 2 * kv_stage <= SMEM_BYTES
    with pytest.raises(ValueError, match="jflash_mosaic_dq: .* bytes of shared memory"):
        fit_stages("jflash_mosaic_dq", 4, q_tile, 2 * 512 * h * 2)
    bs = jflash.default_block_sizes(4096, 128, jnp.bfloat16, implementation="pallas_mosaic")
    assert (bs.block_q, bs.block_kv_dkv, bs.block_q_dq) == (64, 64, 64)


@pytest.mark.parametrize(
    "where, head_dim, causal, documents",
    [
        ("user_shard_map", 64, True, False),
        ("user_shard_map", 128, False, False),
        ("ring", 64, False, False),
        ("allgather", 64, True, False),
        ("ulysses", 128, True, False),
        # With segment ids the forward launches two kernels, the second into refs.
        ("user_shard_map", 64, True, True),
        ("ring", 128, True, True),
    ],
)
def test_mosaic_gradients_inside_shard_map_sum_nothing_over_devices(
    monkeypatch, where, head_dim, causal, documents
):
    """The Mosaic kernels' outputs vary over the `shard_map`'s axes like their inputs.

    `plgpu.kernel` returns them typed as the same on every device; marked varying only
    at the `shard_map`'s boundary (outside the custom VJP), the transpose of that mark
    summed dO over the devices: wrong dQ on 2 H100s (non-causal ring and allgather at
    D=64), and Ulysses failed to trace its backward. On one sequence shard per device
    the backward needs no all-reduce: the lowering has none (the Triton kernels' neither).
    With segment ids the forward's two kernels (the second writing into the first's
    outputs through refs) lower there too.
    """
    monkeypatch.setattr(dispatch, "_platform", lambda: "gpu")
    monkeypatch.setattr(dispatch, "_is_hopper", lambda: True)
    mesh = jax.sharding.AbstractMesh(
        (2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), abstract_device=_H100
    )
    spec = jax.sharding.PartitionSpec(None, "x")
    q = jax.ShapeDtypeStruct((1, 512, 4, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 512, 2, head_dim), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((1, 512), jnp.int32)

    if where == "user_shard_map":  # data-parallel: each device attends over its rows

        def attend(q, k, v, seg):
            out = jflash.flash_attention(
                q, k, v, causal=causal, segment_ids=seg if documents else None,
                implementation="pallas_mosaic",
            )  # fmt: skip
            return jnp.sum(out.astype(jnp.float32)), out

        def grads(q, k, v, seg):
            body = jax.grad(lambda *a: attend(*a)[0], argnums=(0, 1, 2))
            specs = (spec, spec, spec, jax.sharding.PartitionSpec(None, "x"))
            return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=spec)(q, k, v, seg)

    else:

        def grads(q, k, v, seg):
            def loss(q, k, v):
                out = jflash.ring_attention(
                    q, k, v, mesh=mesh, seq_axis="x", causal=causal, strategy=where,
                    segment_ids=seg if documents else None, implementation="pallas_mosaic",
                )  # fmt: skip
                return jnp.sum(out.astype(jnp.float32))

            return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    with jax.sharding.use_abstract_mesh(mesh):
        traced = jax.jit(grads).trace(q, kv, kv, seg)
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "jflash_mosaic_dkv" in text
    assert "all_reduce" not in text


@pytest.mark.parametrize("layout", ["striped", "zigzag"])
def test_ring_steps_add_dq_into_one_accumulator(monkeypatch, layout):
    """The ring's whole-block steps (every striped step, inside its `lax.cond` on the
    traced rank; zigzag's diagonal) add their dQ into one f32 accumulator through the
    fused Mosaic backward, compiled: it lowers for CUDA, and `dq_accumulator` gives one
    only where the kernel can (not interpreted, not the two-kernel backward, no query
    padding)."""
    monkeypatch.setattr(dispatch, "_platform", lambda: "gpu")
    monkeypatch.setattr(dispatch, "_is_hopper", lambda: True)
    q = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)

    def rank_grads(q, k, v, do, rank):
        return jflash.ring_attention_rank(
            q, [(k, v)] * 2, do, rank, causal=True, layout=layout,
            implementation="pallas_mosaic",
        )  # fmt: skip

    rank = jax.ShapeDtypeStruct((), jnp.int32)
    text = _cuda_text(rank_grads, q, kv, kv, q, rank)
    assert "jflash_mosaic_dkv" in text and "jflash_mosaic_dq" not in text

    def kernel(**kw):
        return dispatch.resolve("pallas_mosaic", kw.get("interpret", False), None, q_len=256,
                                kv_len=256, head_dim=128, dtype=jnp.bfloat16,
                                deterministic=kw.get("deterministic", False))  # fmt: skip

    x = jnp.zeros((1, 256, 4, 128), jnp.bfloat16)
    assert dispatch.dq_accumulator(x, kernel()) is not None
    assert dispatch.dq_accumulator(x, kernel(interpret=True)) is None
    assert dispatch.dq_accumulator(x, kernel(deterministic=True)) is None
    assert dispatch.dq_accumulator(x[:, :200], kernel()) is None  # padded queries


@pytest.mark.parametrize("long", [True, False], ids=["long", "4k"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("segments", [False, True])
@pytest.mark.parametrize("given", [False, True])
def test_d64_forward_warpgroups_follow_the_tiles(monkeypatch, given, segments, causal, long):
    """From 16k queries at D = 64 (8k non-causal) the forward runs three warpgroups with
    its own tiles, in the overlapped loop, unless the caller chose the tiles
    (`block_sizes`): then two run those. Under that length two run, without overlap,
    except for packed documents: the span kernel runs three there, without overlap in
    128-key steps. With segment ids two
    kernels are lowered: first two warpgroups comparing ids (they run where the key ids
    are not sorted), then the span kernel (for sorted key ids; elsewhere it copies the
    first one's outputs)."""
    from jflash import _mosaic_fwd

    monkeypatch.setattr(dispatch, "_platform", lambda: "gpu")
    monkeypatch.setattr(dispatch, "_is_hopper", lambda: True)
    launched = []
    launch = _mosaic_fwd.launch

    def spy(kernel, **kwargs):
        k = kernel.keywords
        launched.append((k["wgs"], k["block_kv"], bool(k["spans_only"])))
        return launch(kernel, **kwargs)

    monkeypatch.setattr(_mosaic_fwd, "launch", spy)
    threshold = _mosaic_fwd.THREE_WG_MIN_LEN if causal else _mosaic_fwd.THREE_WG_MIN_LEN_FULL
    assert threshold > 4096
    seq = threshold if long else 4096
    q = jax.ShapeDtypeStruct((1, seq, 8, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, seq, 2, 64), jnp.bfloat16)
    bs = jflash.default_block_sizes(seq, 64, jnp.bfloat16, implementation="pallas_mosaic")

    seg = jax.ShapeDtypeStruct((1, seq), jnp.int32)

    fwd = _mosaic_forward(causal, segments, bs if given else None)

    # The launches are chosen while tracing. The default tiles' loops (two and three
    # warpgroups, causal and not) are lowered here too; the caller's tiles run the
    # two-warpgroup loop, and the kernels for ids lower in the documents cases of
    # `test_forward_streams_from_one_warp`.
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=_H100)
    with jax.sharding.use_abstract_mesh(mesh):
        traced = jax.jit(fwd).trace(q, kv, kv, seg)
        lower = not given and not segments
        text = traced.lower(lowering_platforms=("cuda",)).as_text() if lower else None
    # With ids: the kernel for any ids, then the one for sorted ids (spans only).
    tiles = bs.block_kv
    ids = [(2, tiles, False)] if segments else []
    if given:
        assert launched == ids + [(2, tiles, segments)]
    elif long or segments:
        assert launched == ids + [(3, 128, segments)]
    else:
        assert launched == [(2, tiles, False)]
    assert text is None or text.count("jflash_mosaic_fwd") >= len(launched)


@pytest.mark.parametrize(
    "seq,kv_seq,head_dim,causal,segments,want",
    [
        (4096, 4096, 64, True, False, {(64, 256), (64, 128)}),  # two warpgroups, cut steps
        (16384, 16384, 64, True, False, {(64, 128)}),  # three warpgroups
        (4096, 4096, 128, True, False, {(64, 128)}),  # overlapped
        (1000, 1000, 64, False, False, {(64, 256), (64, 128)}),  # keys past the length
        (1000, 1000, 128, False, False, {(64, 160)}),  # 160-key steps (`FULL_BLOCK_KV`)
        (4096, 4096, 64, True, True, set()),  # ids: compared, or the rows' spans
    ],
    ids=["d64-4k", "d64-16k", "d128-4k", "d64-full-odd", "d128-full-odd", "ids"],
)
def test_masked_forward_steps_hide_keys_by_row_limits(
    monkeypatch, seq, kv_seq, head_dim, causal, segments, want
):
    """Every compiled forward loop masks a step without segment ids through `hide_keys`
    (each row's count of keys it sees), on each step width the loop traces (256 keys
    and the cut last step's 128, the 128-key loops, non-causal D = 128's 160); with
    ids it compares them or the rows' spans instead. The values are checked on a GPU
    (`test_mosaic_matches_oracle`, compiled: causal, offsets, lengths that are not whole
    tiles)."""
    from jflash import _mosaic_fwd

    monkeypatch.setattr(dispatch, "_platform", lambda: "gpu")
    monkeypatch.setattr(dispatch, "_is_hopper", lambda: True)
    widths = set()
    hide = _mosaic_fwd.hide_keys

    def spy(s, limit, **kwargs):
        widths.add(tuple(s.shape))
        assert tuple(limit.shape) == (s.shape[0],) and limit.dtype == jnp.int32
        return hide(s, limit, **kwargs)

    monkeypatch.setattr(_mosaic_fwd, "hide_keys", spy)
    q = jax.ShapeDtypeStruct((1, seq, 8, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, kv_seq, 2, head_dim), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((1, seq), jnp.int32)

    fwd = _mosaic_forward(causal, segments)

    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=_H100)
    with jax.sharding.use_abstract_mesh(mesh):
        jax.jit(fwd).trace(q, kv, kv, seg).lower(lowering_platforms=("cuda",))
    assert widths == want


@pytest.mark.parametrize(
    "seq, head_dim, dtype, causal, segments, want",
    [
        (4096, 64, jnp.bfloat16, True, False, True),
        (16384, 64, jnp.bfloat16, True, False, True),  # three warpgroups
        (4096, 128, jnp.bfloat16, True, False, True),
        (1000, 128, jnp.bfloat16, False, False, True),  # 160-key steps
        (4096, 64, jnp.float16, True, False, True),
        (4096, 128, jnp.float16, True, False, False),  # `BOUND_HEAD_DIMS`
        (4096, 64, jnp.bfloat16, True, True, False),  # segment ids: the exact max
    ],
    ids=["d64-4k", "d64-16k", "d128-4k", "d128-full", "d64-f16", "d128-f16", "ids"],
)
def test_forward_bounds_its_row_max_where_it_pays(
    monkeypatch, seq, head_dim, dtype, causal, segments, want
):
    """The dense forward's loops skip an unmasked step's row max where the key-norm
    bound allows (`BOUNDED_MAX`): a warp's vote in the kernel, the key norms as an input.
    fp16 at D = 128 and segment ids keep the exact loop: no vote. The values are checked
    on a GPU (`test_mosaic_forward_bounded_max`)."""
    monkeypatch.setattr(dispatch, "_platform", lambda: "gpu")
    monkeypatch.setattr(dispatch, "_is_hopper", lambda: True)
    q = jax.ShapeDtypeStruct((1, seq, 8, head_dim), dtype)
    kv = jax.ShapeDtypeStruct((1, seq, 2, head_dim), dtype)
    seg = jax.ShapeDtypeStruct((1, seq), jnp.int32)

    fwd = _mosaic_forward(causal, segments)

    assert _mosaic_fwd.BOUNDED_MAX
    assert ("nvvm.vote.sync" in _cuda_text(fwd, q, kv, kv, seg)) == want


def test_d64_forward_cuts_the_last_step(monkeypatch):
    """At D = 64 under 16k queries (two warpgroups, 256-key steps, 128 query rows per
    tile) a warpgroup whose rows see only the first half of its last step computes that
    half alone (causal: every other tile's diagonal step): the kernel lowers a Q K^T of
    128 keys beside its 256-key ones, and its P V over 128 keys."""
    monkeypatch.setattr(dispatch, "_platform", lambda: "gpu")
    monkeypatch.setattr(dispatch, "_is_hopper", lambda: True)
    q = jax.ShapeDtypeStruct((1, 4096, 8, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 4096, 2, 64), jnp.bfloat16)

    def fwd(q, k, v):
        return jflash.flash_attention(q, k, v, causal=True, implementation="pallas_mosaic")

    text = _cuda_text(fwd, q, kv, kv)
    assert "wgmma.mma_async.sync.aligned.m64n256k16" in text  # Q K^T of a whole step
    assert "wgmma.mma_async.sync.aligned.m64n128k16" in text  # Q K^T of a cut one


@pytest.mark.parametrize(
    "seq, head_dim, padded", [(16384, 64, False), (1000, 128, False), (1003, 64, True)]
)
def test_mosaic_forward_copies_no_padded_inputs(monkeypatch, seq, head_dim, padded):
    """Compiled, the forward's TMA copies read zeros past the ends of Q, K and V and drop
    stores past the output's: the arrays are padded only to Mosaic's 8-row tiling, never
    to whole query tiles (192 rows at D = 64 from 16k queries, which divide no power of
    two). At 1003 rows Q, K and V are padded to 1008."""
    monkeypatch.setattr(dispatch, "_platform", lambda: "gpu")
    monkeypatch.setattr(dispatch, "_is_hopper", lambda: True)
    q = jax.ShapeDtypeStruct((1, seq, 8, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, seq, 2, head_dim), jnp.bfloat16)

    def fwd(q, k, v):
        return jflash.flash_attention(q, k, v, causal=True, implementation="pallas_mosaic")

    text = _cuda_text(fwd, q, kv, kv)
    assert "jflash_mosaic_fwd" in text
    assert ("stablehlo.pad" in text) == padded


@pytest.mark.parametrize("documents", [False, True], ids=["", "documents"])
@pytest.mark.parametrize("how", ["checkpoint_scan", "vmap", "user_shard_map_checkpoint"])
def test_mosaic_forward_lowers_as_models_call_it(monkeypatch, how, documents):
    """The compiled Mosaic kernels as the models and users call them: inside
    `jax.checkpoint` (the attention names saved) inside `lax.scan` over layers, under
    `jax.grad`; under `jax.vmap`; and the same checkpointed layers inside a user's
    `jax.shard_map` (`check_vma=True`). A kernel given a mutable buffer (a `jax.new_ref`
    made per call) failed the first and the third: under `jax.checkpoint` the buffer
    became a residual of the custom VJP, which jax refuses. With segment ids the
    forward's second kernel writes into the first's outputs through refs."""
    monkeypatch.setattr(dispatch, "_platform", lambda: "gpu")
    monkeypatch.setattr(dispatch, "_is_hopper", lambda: True)
    policy = jax.checkpoint_policies.save_only_these_names("attention_out", "attention_lse")

    def attend(h):
        kv = h[:, :, :2]
        seg = None
        if documents:  # two documents per row
            seg = jnp.broadcast_to((jnp.arange(h.shape[1]) >= 200).astype(jnp.int32), h.shape[:2])
        return jflash.flash_attention(
            h, kv, kv, causal=True, segment_ids=seg, implementation="pallas_mosaic"
        )

    def loss(x, ws):
        def layer(h, w):
            return jax.checkpoint(lambda h: attend((h @ w).astype(h.dtype)), policy=policy)(h), None

        y, _ = jax.lax.scan(layer, x, ws)
        return jnp.sum(y.astype(jnp.float32))

    x = jax.ShapeDtypeStruct((2, 512, 8, 128), jnp.bfloat16)
    ws = jax.ShapeDtypeStruct((2, 128, 128), x.dtype)
    mesh = jax.sharding.AbstractMesh(
        (2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), abstract_device=_H100
    )
    if how == "checkpoint_scan":
        fn, args = jax.grad(loss, argnums=(0, 1)), (x, ws)
    elif how == "vmap":
        fn, args = jax.vmap(attend), (jax.ShapeDtypeStruct((3, *x.shape), x.dtype),)
    else:
        spec, rep = jax.sharding.PartitionSpec("x"), jax.sharding.PartitionSpec()

        def body(x, ws):
            dx, dw = jax.grad(loss, argnums=(0, 1))(x, ws)
            return dx, jax.lax.psum(dw, "x")

        fn = jax.shard_map(body, mesh=mesh, in_specs=(spec, rep), out_specs=(spec, rep))
        args = (x, ws)
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "jflash_mosaic_fwd" in text
    assert "atom.relaxed.gpu.global.add" in text  # the work items' counter


@pytest.fixture
def mapped(monkeypatch):
    """The functions passed to `plgpu.warp_map` (one warp of a memory warpgroup
    streams) while the test traces."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    calls = []
    warp_map = plgpu.warp_map

    def spy(f):
        calls.append(f)
        return warp_map(f)

    monkeypatch.setattr(plgpu, "warp_map", spy)
    return calls


def _causal_mosaic_grads(**options):
    """q, k, v -> the gradients of a causal Mosaic attention's sum, with `options`."""

    def grads(q, k, v):
        def loss(q, k, v):
            out = jflash.flash_attention(
                q, k, v, causal=True, implementation="pallas_mosaic", **options
            )
            return jnp.sum(out.astype(jnp.float32))

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    return grads


@pytest.mark.parametrize(
    "head_dim, in_shard_map, want",
    [(64, False, True), (128, False, False), (64, True, True), (128, True, False)],
    ids=["d64", "d128", "d64-shard-map", "d128-shard-map"],
)
@pytest.mark.parametrize("deterministic", [False, True], ids=["fused", "deterministic"])
def test_backward_streams_from_one_warp(
    monkeypatch, mapped, head_dim, in_shard_map, want, deterministic
):
    """At D = 64 the backward's kernels (dK/dV, and the deterministic dQ kernel)
    stream their inputs from one warp of the memory warpgroup (`plgpu.warp_map`), inside
    a `shard_map` too (`_vma.unvarying`: `mpmd_map` refuses Refs that vary over its
    axes); at D = 128 from the whole warpgroup. All lower."""
    from jflash import _mosaic_fwd

    monkeypatch.setattr(dispatch, "_platform", lambda: "gpu")
    monkeypatch.setattr(dispatch, "_is_hopper", lambda: True)
    monkeypatch.setattr(_mosaic_fwd, "MEMORY_WARP_HEAD_DIMS", ())  # the backward's only
    q = jax.ShapeDtypeStruct((1, 512, 4, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 512, 2, head_dim), jnp.bfloat16)

    grads = _causal_mosaic_grads(deterministic=deterministic)
    mesh = jax.sharding.AbstractMesh(
        (2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), abstract_device=_H100
    )
    spec = jax.sharding.PartitionSpec(None, "x")  # each device attends over its rows
    fn = jax.shard_map(grads, mesh=mesh, in_specs=spec, out_specs=spec) if in_shard_map else grads
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(fn).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
    assert "jflash_mosaic_dkv" in text
    assert ("jflash_mosaic_dq" in text) == deterministic
    assert len(mapped) == (2 if deterministic else 1) * want


@pytest.mark.parametrize("head_dim, seq", [(64, 512), (64, 16384), (128, 512)])
@pytest.mark.parametrize("in_shard_map", [False, True], ids=["plain", "shard-map"])
@pytest.mark.parametrize("documents", [False, True], ids=["dense", "documents"])
def test_forward_streams_from_one_warp(monkeypatch, mapped, head_dim, seq, in_shard_map, documents):
    """The forward streams K and V from one warp of the memory warpgroup
    (`plgpu.warp_map`) at `MEMORY_WARP_HEAD_DIMS`, on two and three compute warpgroups
    (D = 64 from 16k queries) and with segment ids (both launches), inside a `shard_map`
    too. All lower."""
    from jflash import _mosaic_fwd

    monkeypatch.setattr(dispatch, "_platform", lambda: "gpu")
    monkeypatch.setattr(dispatch, "_is_hopper", lambda: True)
    q = jax.ShapeDtypeStruct((2, seq, 4, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, seq, 2, head_dim), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((2, seq), jnp.int32)

    def forward(q, k, v, ids):
        segs = (ids, ids) if documents else None
        return jflash.flash_attention(
            q, k, v, causal=True, segment_ids=segs, implementation="pallas_mosaic"
        )

    mesh = jax.sharding.AbstractMesh(
        (2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), abstract_device=_H100
    )
    spec = jax.sharding.PartitionSpec("x")  # each device attends over its batch rows
    fn = (
        jax.shard_map(forward, mesh=mesh, in_specs=spec, out_specs=spec)
        if in_shard_map
        else forward
    )
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(fn).trace(q, kv, kv, ids).lower(lowering_platforms=("cuda",)).as_text()
    assert "jflash_mosaic_fwd" in text
    want = head_dim in _mosaic_fwd.MEMORY_WARP_HEAD_DIMS
    assert len(mapped) == (2 if documents else 1) * want


@pytest.mark.parametrize("devices", [1, 2], ids=["one-device", "two-devices"])
def test_ring_attention_streams_from_one_warp(monkeypatch, mapped, devices):
    """Every Mosaic kernel `ring_attention` launches at D = 64 (forward and dK/dV)
    streams from one warp, inside its `shard_map`: on a mesh of one device (the
    trainer's one-GPU runs), and on two (each ring step's calls). Both lower."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    monkeypatch.setattr(dispatch, "_platform", lambda: "gpu")
    monkeypatch.setattr(dispatch, "_is_hopper", lambda: True)
    bodies = []  # the kernel name of every Mosaic kernel body traced
    kernel = plgpu.kernel

    def spy(body, **kwargs):
        def counted(*args, **kw):
            bodies.append(kwargs["kernel_name"])
            return body(*args, **kw)

        return kernel(counted, **kwargs)

    monkeypatch.setattr(plgpu, "kernel", spy)
    q = jax.ShapeDtypeStruct((1, 512, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 512, 2, 64), jnp.bfloat16)
    mesh = jax.sharding.AbstractMesh(
        (devices,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,), abstract_device=_H100
    )

    def grads(q, k, v):
        def loss(q, k, v):
            out = jflash.ring_attention(
                q, k, v, mesh=mesh, causal=True, implementation="pallas_mosaic"
            )
            return jnp.sum(out.astype(jnp.float32))

        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(grads).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
    assert "jflash_mosaic_fwd" in text and "jflash_mosaic_dkv" in text
    assert {"jflash_mosaic_fwd", "jflash_mosaic_dkv"} <= set(bodies)
    assert len(bodies) >= (2 if devices == 1 else 6)  # 2 ring steps: 3 forward calls
    assert len(mapped) == len(bodies)


def _lowered_split(monkeypatch, head_dim=128, shares=0, in_shard_map=False, sms=132, **options):
    """The CUDA lowering's text of a causal Mosaic backward of 512 tokens, 8 query heads
    over 2 KV heads (8 dK/dV CTAs before any split), with `head_shares_dkv=shares` (0:
    jflash's choice) on a GPU of `sms` SMs, in a 2-device `shard_map` if asked."""
    from jflash import _mosaic_bwd

    monkeypatch.setattr(dispatch, "_platform", lambda: "gpu")
    monkeypatch.setattr(dispatch, "_is_hopper", lambda: True)
    monkeypatch.setattr(_mosaic_bwd, "sm_count", lambda: sms)
    q = jax.ShapeDtypeStruct((1, 512, 8, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 512, 2, head_dim), jnp.bfloat16)
    tiles = jflash.default_block_sizes(
        256, head_dim, jnp.bfloat16, implementation="pallas_mosaic", **options
    )
    grads = _causal_mosaic_grads(
        block_sizes=dataclasses.replace(tiles, head_shares_dkv=shares), **options
    )
    mesh = jax.sharding.AbstractMesh(
        (2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), abstract_device=_H100
    )
    spec = jax.sharding.PartitionSpec(None, "x")
    fn = jax.shard_map(grads, mesh=mesh, in_specs=spec, out_specs=spec) if in_shard_map else grads
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(fn).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()


def _f32_heads(text: str, heads: int, head_dim: int) -> bool:
    """Whether the lowering holds an f32 `[1, T, heads, head_dim]` tensor (T: 512, or
    256 on each of 2 devices). With 8 query heads over 2 KV heads, 2 heads are the f32
    dK/dV accumulators of a split launch, 4 the slices of 2 shares (the output, dO and
    the fused dQ have 8)."""
    return re.search(rf"tensor<1x(512|256)x{heads}x{head_dim}xf32>", text) is not None


@pytest.mark.parametrize("in_shard_map", [False, True], ids=["plain", "shard-map"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_dkv_shares_add_into_their_kv_heads(monkeypatch, head_dim, in_shard_map):
    """Compiled, each CTA of a split dK/dV launch adds its dK and dV into its KV head's
    f32 accumulators (TMA reduce-adds, as the fused dQ): no f32 slice per share, no sum
    after; one CTA per KV head stores its own, in bf16. It lowers inside a `shard_map`
    too (the accumulators unvarying, as dQ's)."""
    two = _lowered_split(monkeypatch, head_dim, 2, in_shard_map)
    assert _f32_heads(two, 2, head_dim) and not _f32_heads(two, 4, head_dim)
    one = _lowered_split(monkeypatch, head_dim, 1, in_shard_map)
    assert not _f32_heads(one, 2, head_dim) and not _f32_heads(one, 4, head_dim)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_deterministic_dkv_shares_sum_in_a_fixed_order(monkeypatch, head_dim):
    """The deterministic backward's split launch writes one f32 slice per share, which
    XLA sums in a fixed order: no reduce-add, whose order would follow the CTAs' (the
    deterministic dQ has none either)."""
    text = _lowered_split(monkeypatch, head_dim, 2, deterministic=True)
    assert "cp.reduce.async.bulk.tensor" not in text
    assert _f32_heads(text, 4, head_dim)


@pytest.mark.parametrize("sms, split", [(132, True), (6, True), (4, False)])
def test_head_split_takes_the_devices_sm_count(monkeypatch, sms, split):
    """The dK/dV launch's rule counts waves in the GPU's SMs (`sm_count`): 8 CTAs (4 key
    tiles x 2 KV heads) split on 132 SMs and on 6 (1.33 waves), not on 4 (2 waves)."""
    assert _f32_heads(_lowered_split(monkeypatch, sms=sms), 2, 128) == split


@pytest.mark.parametrize(
    "call, head_dim, seq",
    [("flash", 128, 128), ("flash", 64, 192), ("flash", 64, 512), ("rank", 128, 256)],
)
def test_packed_forward_passes_no_int_that_may_merge_with_its_counter(
    monkeypatch, call, head_dim, seq
):
    """Each packed forward launch takes one `int32[1]` operand, the zeroed work-item
    counter Pallas adds and the launch writes in place. A row of one query tile (here
    at batch 1: 128 or 192 queries, and a zigzag rank's half blocks of 128) has no tile
    order: as `[0]`, a constant, XLA merged it with the counter's equal zeros, and the
    launch read its order from the counter's running count (outputs never computed, on
    an H100). `benchmarks/deviceless.py` checks the compiled HLO itself."""
    monkeypatch.setattr(dispatch, "_platform", lambda: "gpu")
    monkeypatch.setattr(dispatch, "_is_hopper", lambda: True)
    q = jax.ShapeDtypeStruct((1, seq, 2, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, seq, 1, head_dim), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((1, seq), jnp.int32)

    def run(q, k, v, ids):
        if call == "flash":
            return jflash.flash_attention(
                q, k, v, causal=True, segment_ids=ids, implementation="pallas_mosaic"
            )
        return jflash.ring_attention_rank(
            q, [(k, v)] * 2, q, jnp.int32(0), causal=True, layout="zigzag",
            implementation="pallas_mosaic", segment_ids=(ids, [ids] * 2),
        )  # fmt: skip

    text = _cuda_text(run, q, kv, kv, ids)
    calls = [line for line in text.splitlines() if "custom_call @mosaic_gpu" in line]
    operand_types = [line.rsplit(" : (", 1)[1].split(") -> ", 1)[0] for line in calls]
    packed = [types for types in operand_types if "x3x" in types]  # the rows' (id, lo, hi)
    assert len(packed) == (2 if call == "flash" else 6)
    assert [types.count("tensor<1xi32>") for types in packed] == [1] * len(packed)
