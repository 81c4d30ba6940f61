"""Remat that saves the attention outputs never re-runs the attention forward kernels.

The custom VJPs name their residuals ("attention_out", "attention_lse"); a layer under
`save_only_these_names` of those names must run the forward kernel once, not twice
(LightSeq's rematerialization-aware checkpointing).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name

import jflash

SAVE_ATTN = jax.checkpoint_policies.save_only_these_names("attention_out", "attention_lse")


def _kernel_counts(attention, policy):
    q = jax.random.normal(jax.random.key(0), (1, 128, 2, 32))
    k = jax.random.normal(jax.random.key(1), (1, 128, 1, 32))

    def layer(x):
        out = checkpoint_name(attention(x * 2.0, k, k), "attention_out")
        return jnp.sum(jnp.sin(out))

    text = str(jax.make_jaxpr(jax.grad(jax.checkpoint(layer, policy=policy)))(q))
    return text.count("name=jflash_fwd"), text.count("name=jflash_bwd_dkv")


def _ring(q, k, v):
    mesh = jax.make_mesh(
        (2,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2]
    )
    return jflash.ring_attention(
        q, k, v, mesh=mesh, causal=True, implementation="pallas_triton", interpret=True
    )


@pytest.mark.parametrize(
    "attention",
    [
        functools.partial(
            jflash.flash_attention, causal=True, implementation="pallas_triton", interpret=True
        ),
        pytest.param(_ring, marks=pytest.mark.multi_device(2)),
    ],
    ids=["flash", "ring"],
)
def test_save_attn_runs_forward_once(attention):
    fwd_saved, bwd_saved = _kernel_counts(attention, SAVE_ATTN)
    fwd_full, bwd_full = _kernel_counts(attention, jax.checkpoint_policies.nothing_saveable)
    assert bwd_saved == bwd_full > 0
    # Full remat re-runs the forward in the backward pass; save_attn does not.
    assert fwd_full == 2 * fwd_saved, (fwd_full, fwd_saved)
