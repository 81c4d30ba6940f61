"""CI gate: the Triton kernels lower for CUDA on a machine without a GPU.

Catches shape, dtype and primitive errors that interpret mode does not see (Triton
block-shape rules, unsupported ops), by lowering against an abstract H100.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax._src import mesh as mesh_lib

import jflash
import jflash._dispatch as dispatch

_H100 = mesh_lib.AbstractDevice("NVIDIA H100 80GB HBM3", 132, "gpu")


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

    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=_H100)
    with jax.sharding.use_abstract_mesh(mesh):
        text = jax.jit(fwd_bwd).trace(q, kv, kv, seg).lower(lowering_platforms=("cuda",)).as_text()
    for name in ("jflash_fwd", "jflash_bwd_dkv", "jflash_bwd_dq"):
        assert name in text, f"{name} missing from the CUDA lowering"
