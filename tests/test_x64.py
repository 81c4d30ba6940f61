"""Every implementation under `jax_enable_x64` (Python ints become int64 there, so any
index arithmetic that mixes them with int32 program ids would fail to trace).

x64 is switched on globally (`jax.config.update`), as users do: the Mosaic GPU
interpreter runs each warpgroup in a thread of its own, and a `jax.enable_x64(True)`
context holds for the calling thread only, so under a context the interpreter's threads
would run without x64 a kernel traced with it.
"""

from __future__ import annotations

import contextlib

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import INTERPRET, ON_GPU, needs_hopper
from kernel_cases import assert_close, make_inputs, oracle, value_and_grads

import jflash
import jflash._dispatch as dispatch
from jflash._mosaic_bwd import fuses_dq


@contextlib.contextmanager
def x64(enabled: bool = True):
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", enabled)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", before)


# (implementation, dtype, options, shapes): the Mosaic cases are one 128-row CTA per
# query head (the GPU interpreter takes seconds per CTA).
_GQA = dict(batch=1, q_len=128, kv_len=128, q_heads=2, kv_heads=1)
_MHA = dict(batch=1, q_len=128, kv_len=128, q_heads=1, kv_heads=1)
_SHAPES = dict(batch=2, q_len=96, kv_len=128, q_heads=4, kv_heads=2)
CASES = [
    pytest.param("pallas_triton", jnp.float32, dict(causal=True), _SHAPES, id="triton-causal"),
    pytest.param(
        "pallas_triton",
        jnp.float32,
        dict(causal=True, q_offset=32, segments=True),
        _SHAPES,
        id="triton-causal-offset-segments",
    ),
    pytest.param("pallas_triton", jnp.bfloat16, dict(causal=False), _SHAPES, id="triton-full"),
    pytest.param(
        "xla", jnp.float32, dict(causal=True, segments=True), _SHAPES, id="xla-causal-segments"
    ),
    # D=64: dQ fused into the dK/dV kernel (deterministic=False).
    pytest.param(
        "pallas_mosaic",
        jnp.bfloat16,
        dict(causal=True, head_dim=64),
        _GQA,
        id="mosaic-causal",
        marks=needs_hopper,
    ),
    # D=128: the dQ kernel; segment ids (documents of 32 keys) mask or skip each tile.
    pytest.param(
        "pallas_mosaic",
        jnp.bfloat16,
        dict(causal=False, head_dim=128, segments=True),
        _MHA,
        id="mosaic-full-segments",
        marks=[needs_hopper, pytest.mark.slow],  # 10 s in the interpreter
    ),
]


def _segment_ids(batch: int, kv_len: int):
    """int64 ids (as any integer array is under x64): documents of 32 keys, a row of
    four and a row of three."""
    ids = np.repeat([[0, 1, 2, 3], [5, 5, 6, 7]][:batch], kv_len // 4, axis=1)
    return jnp.asarray(ids)


def _run(implementation, q, k, v, do, dlse, options):
    options = dict(options)
    q_len, kv_len = q.shape[1], k.shape[1]
    if options.pop("segments", False):
        kv_seg = _segment_ids(k.shape[0], kv_len)
        assert kv_seg.dtype == (jnp.int64 if jax.config.jax_enable_x64 else jnp.int32)
        options["segment_ids"] = (kv_seg[:, kv_len - q_len :], kv_seg)
    kernel = dict(implementation=implementation)
    if implementation != "xla":
        kernel["interpret"] = INTERPRET
    got = value_and_grads(
        jflash.flash_attention, q, k, v, do, dlse, return_lse=True, **kernel, **options
    )
    return got, oracle(q, k, v, do, dlse, **options)


@pytest.mark.parametrize("implementation, dtype, options, shapes", CASES)
def test_x64(implementation, dtype, options, shapes):
    """Right under x64 (against the oracle); the Mosaic kernels also bitwise as without
    x64 (the same kernels run: `test_mosaic_kernels_trace_identically`)."""
    options = dict(options)
    head_dim = options.pop("head_dim", 64)
    inputs = make_inputs(11, head_dim=head_dim, dtype=dtype, **shapes)
    with x64():
        got, want = _run(implementation, *inputs, options)
    assert not jax.config.jax_enable_x64
    assert [x.dtype for x in got] == [dtype, jnp.float32, dtype, dtype, dtype]
    assert_close(got, want, dtype)
    if implementation != "pallas_mosaic":
        return
    without, _ = _run(implementation, *inputs, options)
    names = ["out", "lse", "dq", "dk", "dv"]
    # Compiled, the fused dQ adds in f32 with atomics: its order varies from run to run.
    if ON_GPU and fuses_dq(head_dim, options.get("deterministic", False)):
        names.remove("dq")
    for name, a, b in zip(["out", "lse", "dq", "dk", "dv"], got, without, strict=True):
        if name in names:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


@pytest.mark.parametrize("implementation", ["xla", "pallas_triton"])
def test_ids_that_differ_above_int32_stay_apart(implementation):
    """int64 ids equal in their low 32 bits are still different documents."""
    shapes = dict(batch=1, q_len=64, kv_len=64, q_heads=2, kv_heads=1, head_dim=32)
    q, k, v, do, dlse = make_inputs(3, dtype=jnp.float32, **shapes)
    small = jnp.asarray(np.repeat([[0, 1]], 32, axis=1), jnp.int32)
    kernel = dict(implementation=implementation, causal=True, return_lse=True)
    if implementation != "xla":
        kernel["interpret"] = INTERPRET
    want = value_and_grads(jflash.flash_attention, q, k, v, do, dlse, segment_ids=small, **kernel)
    with x64():
        wide = jnp.asarray(small, jnp.int64) * 2**32 + 5  # 5 and 2**32 + 5
        got = value_and_grads(jflash.flash_attention, q, k, v, do, dlse, segment_ids=wide, **kernel)
    assert_close(got, want, jnp.float32)


# ----------------------------------------------------------------------------- traces


def _kernels(jaxpr) -> dict[str, object]:
    """The kernels (Mosaic `plgpu.kernel`s, Triton `pallas_call`s) in a traced program,
    by kernel name."""
    found = {}

    def walk(j):
        for eqn in j.eqns:
            name = str(eqn.params.get("name", ""))
            if name.startswith("jflash_"):
                found[name] = eqn
            else:
                for sub in jex.jaxprs_in_params(eqn.params):
                    walk(sub)

    walk(jaxpr.jaxpr)
    return found


def _signature(eqn) -> list[str]:
    """The kernel as text, with every value's type (weak types, and the index literals
    that the text shows without one, included)."""
    lines = [str(eqn)]

    def walk(j):
        for var in (*j.constvars, *j.invars):
            lines.append(repr(var.aval))
        for e in j.eqns:
            lines.append(f"{e.primitive}: " + ", ".join(repr(x.aval) for x in e.invars))
            for sub in jex.jaxprs_in_params(e.params):
                walk(sub)

    for sub in jex.jaxprs_in_params(eqn.params):
        walk(sub)
    return lines


def _traced_kernels(implementation, *, causal, segments, head_dim, deterministic, interpret):
    q = jax.ShapeDtypeStruct((1, 200, 4, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 264, 2, head_dim), jnp.bfloat16)

    def loss(q, k, v):
        segs = None
        if segments:
            kv_seg = jnp.asarray(np.repeat([[0, 1, 1, 2]], 66, axis=1))
            segs = (kv_seg[:, 64:], kv_seg)
        out, lse = jflash.flash_attention(
            q,
            k,
            v,
            causal=causal,
            q_offset=64 if causal else 0,  # offsets only shift the causal mask
            segment_ids=segs,
            return_lse=True,
            implementation=implementation,
            interpret=interpret,
            deterministic=deterministic,
        )
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))

    return _kernels(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, kv, kv))


def _check_traces(implementation, expected, **kw):
    """The kernels trace to the same program with and without x64, with no 64-bit value
    inside (tracing only: no GPU needed)."""
    without = _traced_kernels(implementation, **kw)
    with x64():
        with_x64 = _traced_kernels(implementation, **kw)
    assert set(without) == set(with_x64) == expected
    for name in expected:
        sig = _signature(with_x64[name])
        wide = [line for line in sig if any(t in line for t in ("int64", "float64"))]
        assert not wide, f"{name}: 64-bit values under x64: {wide[:3]}"
        assert sig == _signature(without[name]), f"{name} traces differently under x64"


@pytest.mark.parametrize("interpret", [False, True], ids=["compiled", "interpret"])
@pytest.mark.parametrize(
    "causal, segments, head_dim, deterministic",
    [(True, False, 64, False), (True, True, 64, True), (False, True, 128, False)],
)
def test_mosaic_kernels_trace_identically(
    monkeypatch, causal, segments, head_dim, deterministic, interpret
):
    """The forward, dK/dV (fused dQ or not) and dQ kernels."""
    monkeypatch.setattr(dispatch, "_platform", lambda: "gpu")
    monkeypatch.setattr(dispatch, "_is_hopper", lambda: True)
    fused = fuses_dq(head_dim, deterministic)
    expected = {"jflash_mosaic_fwd", "jflash_mosaic_dkv"} | (
        set() if fused else {"jflash_mosaic_dq"}
    )
    _check_traces(
        "pallas_mosaic",
        expected,
        causal=causal,
        segments=segments,
        head_dim=head_dim,
        deterministic=deterministic,
        interpret=interpret,
    )


@pytest.mark.parametrize("interpret", [False, True], ids=["compiled", "interpret"])
@pytest.mark.parametrize("causal, segments", [(True, False), (True, True), (False, True)])
def test_triton_kernels_trace_identically(monkeypatch, causal, segments, interpret):
    """The forward, dK/dV and dQ kernels."""
    monkeypatch.setattr(dispatch, "_platform", lambda: "gpu")
    _check_traces(
        "pallas_triton",
        {"jflash_fwd", "jflash_bwd_dkv", "jflash_bwd_dq"},
        causal=causal,
        segments=segments,
        head_dim=64,
        deterministic=None,
        interpret=interpret,
    )


def test_first_positions_of_64_bit_ids():
    """64-bit ids are relabelled by first position beyond int32, both where they span
    fewer values than the row has tokens (a slot per value) and where they span more
    (hashed, all 64 bits: ids equal in their low 32 bits stay apart)."""
    from jflash._segments import first_positions

    with x64():
        ids = jnp.asarray([[2**40] * 3 + [2**40 + 1] * 3 + [2**40 - 1] * 2], jnp.int64)
        np.testing.assert_array_equal(first_positions(ids), [[0, 0, 0, 3, 3, 3, 6, 6]])
        apart = ids.at[0, 3:6].set(-(2**40))
        np.testing.assert_array_equal(first_positions(apart), [[0, 0, 0, 3, 3, 3, 6, 6]])
        low_bits_equal = jnp.asarray([[2**40 + 5] * 4 + [5] * 4 + [2**40 + 5] * 2], jnp.int64)
        np.testing.assert_array_equal(
            first_positions(low_bits_equal), [[0, 0, 0, 0, 4, 4, 4, 4, 0, 0]]
        )
