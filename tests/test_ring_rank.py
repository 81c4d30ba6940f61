"""`jflash.ring_attention_rank`: one ring rank's compute on one device, against the oracle.

Each rank is given, step by step, the K/V shard the ring would bring it; its output,
LSE and dQ must be its rows of the one-device oracle, and the dK/dV it returns per
step, summed over ranks, each source's gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ON_GPU

import jflash


def _inputs(seq=32, heads=2, kv_heads=1, head_dim=16):
    keys = jax.random.split(jax.random.key(7), 4)
    q = jax.random.normal(keys[0], (1, seq, heads, head_dim), jnp.float32)
    k, v = (jax.random.normal(x, (1, seq, kv_heads, head_dim), jnp.float32) for x in keys[1:3])
    do = jax.random.normal(keys[3], q.shape, jnp.float32)
    return q, k, v, do


def _oracle(q, k, v, do, causal):
    """`(out, lse), (dq, dk, dv)` of the dense f32 oracle."""

    @jax.jit
    def run(q, k, v, do):
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        out, vjp = jax.vjp(lambda *a: jflash.attention_reference(*a, causal=causal), *f32)
        return out, vjp((do.astype(jnp.float32), jnp.zeros_like(out[1])))

    return run(q, k, v, do)


def _shards(x, p, layout, axis=1):
    """The P shards of x in layout order."""
    return jnp.split(jflash.to_layout(x, p, layout, axis=axis), p, axis=axis)


def _ranks(rank_fn, q, k, v, do, p, layout):
    """Every rank's `(o, lse, dq, dkv)` from `rank_fn(q, sources, do, rank)`, fed the K/V
    shard the ring would bring at each step, and the per-step dK, dV summed back onto
    their source shards, concatenated in layout order."""
    qs, ks, vs, dos = (_shards(x, p, layout) for x in (q, k, v, do))
    dk_sum = [jnp.zeros(ks[0].shape, jnp.float32) for _ in range(p)]
    dv_sum = [jnp.zeros(vs[0].shape, jnp.float32) for _ in range(p)]
    results = []
    for rank in range(p):
        sources = [(ks[(rank - s) % p], vs[(rank - s) % p]) for s in range(p)]
        results.append(rank_fn(qs[rank], sources, dos[rank], rank))
        for s, (dk, dv) in enumerate(results[-1][3]):
            dk_sum[(rank - s) % p] += dk
            dv_sum[(rank - s) % p] += dv
    return results, jnp.concatenate(dk_sum, 1), jnp.concatenate(dv_sum, 1)


@pytest.mark.parametrize(
    "layout,causal,p,traced",
    [
        ("zigzag", True, 2, True),
        ("striped", True, 4, True),
        # An int rank picks each step's mask while tracing (no `lax.cond`).
        ("striped", True, 4, False),
        ("contiguous", False, 2, True),
    ],
)
def test_ranks_together_are_the_oracle(layout, causal, p, traced):
    q, k, v, do = _inputs()
    (o_ref, lse_ref), (dq_ref, dk_ref, dv_ref) = _oracle(q, k, v, do, causal)
    want = {name: _shards(x, p, layout) for name, x in (("o", o_ref), ("dq", dq_ref))}
    want["lse"] = _shards(lse_ref, p, layout, axis=2)
    # Traced: one compiled function for every rank, as inside the ring.
    run = jax.jit(
        lambda q, sources, do, rank: jflash.ring_attention_rank(
            q, sources, do, rank, causal=causal, layout=layout, implementation="xla"
        ),
        static_argnums=() if traced else (3,),
    )
    results, dk_sum, dv_sum = _ranks(
        lambda q, sources, do, rank: run(q, sources, do, jnp.int32(rank) if traced else rank),
        q,
        k,
        v,
        do,
        p,
        layout,
    )
    for rank, (o, lse, dq, dkv) in enumerate(results):
        np.testing.assert_allclose(o, want["o"][rank], atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(lse, want["lse"][rank], atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(dq, want["dq"][rank], atol=2e-5, rtol=2e-5)
        assert len(dkv) == p and all(d[0].dtype == jnp.float32 for d in dkv)
    for got, ref in ((dk_sum, dk_ref), (dv_sum, dv_ref)):
        want = jflash.to_layout(ref, p, layout, axis=1)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("layout,p", [("striped", 4), ("zigzag", 2)])
def test_ranks_with_documents_are_the_oracle(layout, p):
    """Packed documents (one crossing every shard boundary, a one-token one): each rank
    given its query ids and every step's source key ids, the rank traced."""
    q, k, v, do = _inputs()
    ids = jnp.asarray([[0] * 5 + [1] + [2] * 13 + [3] * 9 + [4] * 4], jnp.int32)

    @jax.jit
    def oracle(q, k, v, do):
        ref = functools.partial(jflash.attention_reference, causal=True, segment_ids=ids)
        out, vjp = jax.vjp(ref, q, k, v)
        return out, vjp((do, jnp.zeros_like(out[1])))

    (o_ref, lse_ref), (dq_ref, dk_ref, dv_ref) = oracle(q, k, v, do)
    id_shards = _shards(ids, p, layout)
    run = jax.jit(
        lambda q, sources, do, rank, seg: jflash.ring_attention_rank(
            q,
            sources,
            do,
            rank,
            causal=True,
            layout=layout,
            implementation="xla",
            segment_ids=seg,
        )
    )

    def rank_fn(q, sources, do, rank):
        kv_ids = [id_shards[(rank - s) % p] for s in range(p)]
        return run(q, sources, do, jnp.int32(rank), (id_shards[rank], kv_ids))

    results, dk_sum, dv_sum = _ranks(rank_fn, q, k, v, do, p, layout)
    for rank, (o, lse, dq, _) in enumerate(results):
        np.testing.assert_allclose(o, _shards(o_ref, p, layout)[rank], atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(
            lse, _shards(lse_ref, p, layout, axis=2)[rank], atol=2e-5, rtol=2e-5
        )
        np.testing.assert_allclose(dq, _shards(dq_ref, p, layout)[rank], atol=2e-5, rtol=2e-5)
    for got, ref in ((dk_sum, dk_ref), (dv_sum, dv_ref)):
        np.testing.assert_allclose(
            got, jflash.to_layout(ref, p, layout, axis=1), atol=2e-5, rtol=2e-5
        )


def test_bad_arguments_are_named():
    q, k, v, do = _inputs(seq=8)
    with pytest.raises(ValueError, match="at least one"):
        jflash.ring_attention_rank(q, [], do, 0, causal=True, layout="zigzag")
    with pytest.raises(ValueError, match="rank=2"):
        jflash.ring_attention_rank(q, [(k, v)] * 2, do, 2, causal=True, layout="zigzag")
    for rank in (-1, np.int64(2), 1.5, True, jnp.float32(1), jnp.array([0, 1]), jnp.int32(2)):
        with pytest.raises(ValueError, match="rank="):
            jflash.ring_attention_rank(q, [(k, v)] * 2, do, rank, causal=True, layout="zigzag")
    with pytest.raises(TypeError, match="do must be a jax or numpy array"):
        jflash.ring_attention_rank(q, [(k, v)], [0.0], 0, causal=True, layout="zigzag")
    with pytest.raises(ValueError, match="layout='spiral'"):
        jflash.ring_attention_rank(q, [(k, v)], do, 0, causal=True, layout="spiral")
    with pytest.raises(ValueError, match="as long as q"):
        jflash.ring_attention_rank(q, [(k[:, :4], v[:, :4])], do, 0, causal=True, layout="zigzag")
    # two ranks of 7: 14 tokens, not 4k; the message names the length the caller holds
    with pytest.raises(ValueError, match=r"the local length q.shape\[1\]=7 \(14 tokens over 2"):
        jflash.ring_attention_rank(
            q[:, :7], [(k[:, :7], v[:, :7])] * 2, do[:, :7], 0, causal=True, layout="zigzag"
        )
    # a source that is not a (k, v) pair, and do of another dtype than q's (once taken
    # as it was: its dQ then came out of another cotangent)
    with pytest.raises(ValueError, match=r"sources\[1\] must be a \(k, v\) pair; got tuple of 3"):
        jflash.ring_attention_rank(q, [(k, v), (k, v, k)], do, 0, causal=True, layout="zigzag")
    with pytest.raises(ValueError, match=r"sources\[0\] must be a \(k, v\) pair; got ArrayImpl"):
        jflash.ring_attention_rank(q, [k, k], do, 0, causal=True, layout="zigzag")
    with pytest.raises(ValueError, match=r"do.dtype=int32 must be q's \(float32\)"):
        jflash.ring_attention_rank(
            q, [(k, v)] * 2, do.astype(jnp.int32), 0, causal=True, layout="zigzag"
        )
    # One rank holds its sequence in natural order whatever the layout: any length.
    jflash.ring_attention_rank(
        q[:, :7], [(k[:, :7], v[:, :7])], do[:, :7], 0, causal=True, layout="zigzag"
    )
    ids = jnp.zeros((1, 8), jnp.int32)
    for bad, match in (
        (ids, "pair"),
        ((ids, ids), "one \\[B, T'\\] array per source \\(2\\); got ArrayImpl"),
        ((ids, [ids]), "per source \\(2\\); got list of 1"),
        ((ids, [ids, ids[:, :4]]), "kv segment ids have"),
        ((ids, [ids, ids.astype(jnp.float32)]), "must be integers"),
    ):
        with pytest.raises(ValueError, match=match):
            jflash.ring_attention_rank(
                q, [(k, v)] * 2, do, 0, causal=True, layout="zigzag", segment_ids=bad
            )


_COMPILED_ONLY = pytest.mark.skipif(
    not ON_GPU, reason="the traced rank's cases interpreted are the XLA ones' (above)"
)


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout,causal,p,head_dim,traced,documents",
    [
        ("zigzag", True, 2, 128, False, False),
        ("striped", True, 3, 128, False, False),
        ("zigzag", False, 2, 64, False, False),
        # Compiled only: the rank traced, as inside the ring (the half blocks' rows
        # chosen by data), through the column halves (D = 128) and the rows split
        # (D = 64), and with packed documents (the kernels' segment-id forms).
        pytest.param("zigzag", True, 2, 128, True, False, marks=_COMPILED_ONLY),
        pytest.param("zigzag", True, 2, 64, True, False, marks=_COMPILED_ONLY),
        pytest.param("zigzag", True, 2, 128, True, True, marks=_COMPILED_ONLY),
    ],
)
def test_mosaic_ranks_together_are_the_oracle(layout, causal, p, head_dim, traced, documents):
    """The Mosaic kernels on a ring's blocks at P >= 2 (f32 partials, offsets, the fused
    backward's f32 dK/dV: at D = 128 through the dQ tile by column halves), rank by rank
    on one device: compiled on a Hopper GPU, in the GPU interpreter elsewhere (which
    cannot run the kernels inside a shard_map of several devices). Compiled, a rank
    holds 256 queries (zigzag: half blocks of 128, each a whole query tile of the
    kernels); interpreted, 128. `traced`: the rank a traced int32, as inside the ring;
    `documents`: packed documents, one crossing the shards."""
    from conftest import INTERPRET, ON_HOPPER
    from kernel_cases import assert_close, oracle

    if not (INTERPRET or ON_HOPPER):
        pytest.skip("the Mosaic kernels need a Hopper GPU (or the CPU interpreter)")
    dtype = jnp.bfloat16
    rows = 64 if INTERPRET else 128
    n = rows * 2 * p
    q, k, v, do = (x.astype(dtype) for x in _inputs(n, 2, 1, head_dim))
    ids = None
    if documents:  # three documents, the middle one over the shards' halves
        lengths = [n // 5, n // 2, n - n // 5 - n // 2]
        ids = jnp.asarray([np.repeat(np.arange(3), lengths)], jnp.int32)
    no_dlse = jnp.zeros((1, 2, n), jnp.float32)
    o_ref, lse_ref, dq_ref, dk_ref, dv_ref = oracle(
        q, k, v, do, no_dlse, causal=causal, segment_ids=ids
    )
    id_shards = None if ids is None else _shards(ids, p, layout)

    @functools.partial(jax.jit, static_argnums=() if traced else (3,))
    def run(q, sources, do, rank, seg):
        return jflash.ring_attention_rank(
            q,
            sources,
            do,
            rank,
            causal=causal,
            layout=layout,
            implementation="pallas_mosaic",
            interpret=INTERPRET,
            deterministic=False,
            segment_ids=seg,
        )

    def rank_fn(q, sources, do, rank):
        seg = None
        if id_shards is not None:
            seg = (id_shards[rank], [id_shards[(rank - s) % p] for s in range(p)])
        return run(q, sources, do, jnp.int32(rank) if traced else rank, seg)

    results, dk_sum, dv_sum = _ranks(rank_fn, q, k, v, do, p, layout)
    got = [jnp.concatenate([r[i] for r in results], 2 if i == 1 else 1) for i in range(3)]
    got += [dk_sum, dv_sum]
    want = [jflash.to_layout(o_ref, p, layout, axis=1)]
    want.append(jflash.to_layout(lse_ref, p, layout, axis=2))
    want += [jflash.to_layout(x, p, layout, axis=1) for x in (dq_ref, dk_ref, dv_ref)]
    assert_close(got, want, dtype)


@pytest.mark.parametrize("layout,causal", [("zigzag", True), ("contiguous", False)])
def test_traced_rank_out_of_range_is_nan(layout, causal):
    """A traced rank cannot be refused while tracing; one outside [0, P) makes the
    results NaN instead of another rank's (it once ran as rank mod P)."""
    q, k, v, do = _inputs(seq=8)
    run = jax.jit(
        lambda rank: jflash.ring_attention_rank(
            q, [(k, v)] * 2, do, rank, causal=causal, layout=layout, implementation="xla"
        )
    )
    for rank in (-1, 2, 3):
        o, lse, dq, dkv = run(jnp.int32(rank))
        for name, x in (("o", o), ("lse", lse), ("dq", dq)):
            assert bool(jnp.isnan(x).all()), f"rank={rank}: {name} not all NaN"
        # each step's dK/dV: NaN on the keys the rank attends (the others get none)
        for s, (dk, dv) in enumerate(dkv):
            assert bool(jnp.isnan(dk).any() & jnp.isnan(dv).any()), f"rank={rank}: step {s}"
    for rank in (0, 1):
        results = run(jnp.int32(rank))
        assert not any(bool(jnp.isnan(leaf).any()) for leaf in jax.tree.leaves(results))
