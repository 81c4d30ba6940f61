"""Next-token cross-entropy for the trainer.

Labels are *aligned* with the logits: ``labels[b, t]`` is the target of
``logits[b, t]`` (``-100`` = ignored). Make them once, in natural token order,
with :func:`next_token_labels` -- before any zigzag permutation, so sequence
sharding never needs a shift across shards.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

IGNORE_INDEX = -100


def next_token_labels(
    input_ids: Int[Array, "B T"], ignore_index: int = IGNORE_INDEX
) -> Int[Array, "B T"]:
    """``labels[:, t] = input_ids[:, t + 1]``; the last position is ignored."""
    pad = jnp.full_like(input_ids[:, :1], ignore_index)
    return jnp.concatenate([input_ids[:, 1:], pad], axis=1)


def cross_entropy(
    logits: Float[Array, "B T V"],
    labels: Int[Array, "B T"],
    mask: Bool[Array, "B T"] | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[Float[Array, ""], Int[Array, ""]]:
    """Summed token cross-entropy and the number of counted tokens.

    Args:
        logits: unnormalised scores (upcast to float32).
        labels: aligned targets; ``ignore_index`` entries are not counted.
        mask: optional extra ``True``-means-count mask.
        ignore_index: label value to skip.

    Returns:
        ``(sum_loss, num_tokens)``: float32 and int32 scalars; the mean is their
        ratio (sum both over micro-batches and devices first).
    """
    if logits.shape[:2] != labels.shape:
        raise ValueError(f"logits.shape={logits.shape} does not match labels.shape={labels.shape}")
    logits = logits.astype(jnp.float32)
    valid = labels != ignore_index
    if mask is not None:
        valid = valid & mask
    safe = jnp.where(valid, labels, 0)
    target = jnp.take_along_axis(logits, safe[..., None], axis=-1)[..., 0]
    nll = jax.nn.logsumexp(logits, axis=-1) - target
    return jnp.sum(jnp.where(valid, nll, 0.0)), jnp.sum(valid, dtype=jnp.int32)


def chunked_cross_entropy(
    hidden: Float[Array, "B T D"],
    lm_head: Float[Array, "D V"],
    labels: Int[Array, "B T"],
    mask: Bool[Array, "B T"] | None = None,
    *,
    chunk_size: int = 1024,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[Float[Array, ""], Int[Array, ""]]:
    """:func:`cross_entropy` of ``hidden @ lm_head`` without materialising all logits.

    Scans over sequence chunks of ``chunk_size`` tokens and rematerialises each
    chunk's ``[B, chunk, V]`` float32 logits in the backward pass, so peak memory
    is one chunk's logits instead of ``[B, T, V]`` (e.g. 16 GiB at T=32k, V=128k).

    Args:
        hidden: final-norm hidden states (``models.hidden_states``).
        lm_head: output projection (``models.lm_head_weight``), cast to ``hidden.dtype``.
        labels: aligned targets.
        mask: optional extra mask.
        chunk_size: tokens per chunk; must divide T.
        ignore_index: label value to skip.
    """
    b, t, d = hidden.shape
    if t % chunk_size:
        raise ValueError(f"sequence length {t=} must be divisible by {chunk_size=}")
    n = t // chunk_size
    if mask is None:
        mask = jnp.ones((b, t), bool)
    w = lm_head.astype(hidden.dtype)

    def chunks(x):
        return jnp.moveaxis(x.reshape(b, n, chunk_size, *x.shape[2:]), 1, 0)

    @jax.checkpoint
    def body(carry, xs):
        h, lab, m = xs
        logits = jnp.einsum("btd,dv->btv", h, w, preferred_element_type=jnp.float32)
        loss, count = cross_entropy(logits, lab, m, ignore_index)
        return (carry[0] + loss, carry[1] + count), None

    init = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))
    (loss, count), _ = jax.lax.scan(body, init, (chunks(hidden), chunks(labels), chunks(mask)))
    return loss, count
