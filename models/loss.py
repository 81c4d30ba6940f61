"""Next-token cross-entropy for the trainer.

Labels are *aligned* with the logits: ``labels[b, t]`` is the target of
``logits[b, t]`` (``-100`` = ignored). Make them once, in natural token order,
with :func:`next_token_labels` -- before any zigzag permutation, so sequence
sharding never needs a shift across shards.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jaxtyping import Array, Bool, Float, Int

from models.sharding import explicit_mesh, spec_axes

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
    shards: int = 1,
    replicated_head: bool = False,
    vocab_major: bool = False,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[Float[Array, ""], Int[Array, ""]]:
    """:func:`cross_entropy` of ``hidden @ lm_head`` without materialising all logits.

    Scans over chunks of ``chunk_size`` tokens, so peak memory is one chunk's
    ``[B, chunk, V]`` float32 logits instead of ``[B, T, V]`` (16 GiB at T=32k, V=128k).
    Under differentiation the same scan also forms the gradients (a custom VJP: the
    softmax minus the one-hot, in ``hidden.dtype``, times ``lm_head`` and ``hidden``),
    so the logits are computed once, every matmul runs in ``hidden.dtype`` with float32
    accumulation, and ``lm_head``'s gradient is summed over the chunks in float32.

    Args:
        hidden: final-norm hidden states (``models.hidden_states``).
        lm_head: output projection ``[D, V]`` (``models.lm_head_weight``), or ``[V, D]``
            with ``vocab_major``; cast to ``hidden.dtype`` for the matmuls; its gradient
            comes back in its own dtype and shape.
        labels: aligned targets.
        mask: optional extra mask.
        chunk_size: tokens per chunk; must divide T (a T shorter than it is one
            chunk).
        shards: how many contiguous pieces the sequence axis is sharded into (the mesh's
            ``seq`` axis): each chunk takes ``chunk_size // shards`` tokens of every
            piece, so each device works on its own tokens instead of all of them.
        replicated_head: with ``shards > 1``, say whether ``lm_head`` is replicated over
            the devices that split the tokens. Then each shard sums its own tokens'
            ``lm_head`` gradient over the chunks, and the shards' sums are added once
            after the loop; otherwise XLA adds them at every chunk (a ``[D, V]`` float32
            all-reduce per chunk: 1 GiB at a 128k vocabulary). Leave it False when
            ``lm_head`` is sharded over those devices (each computes its slice of the
            vocabulary for every token). Either way the result is the same.
        vocab_major: ``lm_head`` is ``[V, D]``, e.g. a tied embedding table
            (``models.lm_head_table``): used as stored, so neither it nor its gradient
            is transposed (a copy of the table each way).
        ignore_index: label value to skip.
    """
    b, t, d = hidden.shape
    if lm_head.ndim != 2 or lm_head.shape[1 if vocab_major else 0] != d:
        want = "[V, D]" if vocab_major else "[D, V]"
        raise ValueError(f"{lm_head.shape=} is not {want} for hidden's D={d} ({vocab_major=})")
    if labels.shape != (b, t):
        raise ValueError(f"{labels.shape=} does not match hidden's [B, T] = {(b, t)}")
    if t < chunk_size:  # a short sequence: one chunk
        chunk_size = t
    if shards < 1 or chunk_size % shards:
        raise ValueError(f"{chunk_size=} must be a positive multiple of {shards=}")
    if t % chunk_size:
        raise ValueError(f"sequence length {t=} must be divisible by {chunk_size=}")
    mesh = explicit_mesh()
    if mesh is not None:
        axes = spec_axes(jax.typeof(hidden).sharding.spec[1])
        ways = math.prod(mesh.shape[a] for a in axes)
        if ways != shards:
            raise ValueError(
                f"hidden's token axis is sharded {ways} ways over {axes} on an Explicit "
                f"mesh; pass shards={ways} (got {shards=})"
            )
    valid = labels != ignore_index
    if mask is not None:
        valid = valid & mask
    safe = jnp.where(valid, labels, 0)
    per_shard = replicated_head and shards > 1
    if mesh is not None:
        _check_explicit_head(hidden, lm_head, per_shard, vocab_major)
    return _fused_cross_entropy(
        hidden, lm_head, safe, valid, chunk_size, shards, per_shard, vocab_major
    )


def _chunks(x, chunk_size: int, shards: int):
    """``[B, T, ...]`` -> ``[n, B, shards, chunk_size // shards, ...]``: step ``i`` takes
    the ``i``-th piece of every shard (a sharded ``T`` keeps its split on ``shards``)."""
    b, t = x.shape[:2]
    n, per = t // chunk_size, chunk_size // shards
    return jnp.moveaxis(x.reshape(b, shards, n, per, *x.shape[2:]), 2, 0)


def _unchunk(x, t: int):
    """Inverse of :func:`_chunks`."""
    x = jnp.moveaxis(x, 0, 2)
    return x.reshape(x.shape[0], t, *x.shape[4:])


def _check_explicit_head(hidden, w, per_shard: bool, vocab_major: bool) -> None:
    """On Explicit axes, refuses an LM head `w` the loop cannot place: one sharded over
    the axes that split the tokens where each token shard keeps its own gradient sum
    (`per_shard`), and one split by vocabulary (split along D it runs)."""
    spec = jax.typeof(w).sharding.spec
    w_axes = {a for part in spec for a in spec_axes(part)}
    tokens = jax.typeof(hidden).sharding.spec[1]
    if per_shard and w_axes & set(spec_axes(tokens)):
        raise ValueError(
            f"replicated_head=True, but lm_head is sharded {PartitionSpec(*spec)} over the "
            f"axes that split the tokens ({tokens}); pass replicated_head=False"
        )
    if (tuple(spec) + (None, None))[0 if vocab_major else 1] is not None:
        raise ValueError(
            f"lm_head's vocabulary is split over Explicit mesh axes (its spec is {spec}): "
            "on Explicit axes the chunked loss takes it whole or split along D (split by "
            "vocabulary it runs on Auto axes, as the trainer's)"
        )


def _dw_spec(hidden, w, per_shard: bool):
    """Under an Explicit-axes mesh, the sharding of the weight gradient's running sum
    (jax cannot infer it; Auto meshes do): the weight's own, with a leading axis over
    the token shards when each shard keeps its own sum. None on other meshes."""
    if explicit_mesh() is None:
        return None
    w_spec = tuple(jax.typeof(w).sharding.spec)
    w_spec += (None,) * (w.ndim - len(w_spec))
    if not per_shard:
        return PartitionSpec(*w_spec)
    return PartitionSpec(jax.typeof(hidden).sharding.spec[1], *w_spec)


def _scan_chunks(
    hidden, lm_head, labels, valid, chunk_size, shards, per_shard, vocab_major, *, grads: bool
):
    """`(loss sum, count)`, and with `grads` the gradients of the loss sum:
    `(d hidden [B, T, D] in hidden.dtype, d lm_head float32 in lm_head's shape)`.

    `per_shard`: the weight gradient is summed per token shard (`[shards, *lm_head]`,
    split like the tokens) and over the shards after the loop."""
    w = lm_head.astype(hidden.dtype)
    w_dims = "vd" if vocab_major else "dv"
    dw_spec = _dw_spec(hidden, w, per_shard)

    def body(carry, xs):
        h, lab, m = xs
        logits = jnp.einsum(f"bpcd,{w_dims}->bpcv", h, w, preferred_element_type=jnp.float32)
        lse = jax.nn.logsumexp(logits, axis=-1)
        target = jnp.take_along_axis(logits, lab[..., None], axis=-1)[..., 0]
        loss = carry[0] + jnp.sum(jnp.where(m, lse - target, 0.0))
        count = carry[1] + jnp.sum(m, dtype=jnp.int32)
        if not grads:
            return (loss, count), None
        vocab = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
        probs = jnp.exp(logits - lse[..., None])
        dlogits = jnp.where(m[..., None], probs - (vocab == lab[..., None]), 0.0)
        dlogits = dlogits.astype(h.dtype)
        dh = jnp.einsum(f"bpcv,{w_dims}->bpcd", dlogits, w, preferred_element_type=jnp.float32)
        dw = carry[2] + jnp.einsum(
            f"bpcd,bpcv->{'p' if per_shard else ''}{w_dims}",
            h,
            dlogits,
            preferred_element_type=jnp.float32,
            out_sharding=dw_spec,
        )
        return (loss, count, dw), dh.astype(h.dtype)

    init = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))
    if grads:
        shape = (shards, *lm_head.shape) if per_shard else lm_head.shape
        init = (*init, jnp.zeros(shape, jnp.float32, out_sharding=dw_spec))
    xs = tuple(_chunks(x, chunk_size, shards) for x in (hidden, labels, valid))
    carry, dh = jax.lax.scan(body, init, xs)
    if not grads:
        return carry
    loss, count, dw = carry
    if per_shard:
        dw = dw.sum(axis=0)  # the one reduction over the token shards
    return (loss, count), (_unchunk(dh, hidden.shape[1]), dw)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _fused_cross_entropy(hidden, lm_head, labels, valid, *static):
    return _scan_chunks(hidden, lm_head, labels, valid, *static, grads=False)


def _fused_fwd(hidden, lm_head, labels, valid, *static):
    out, (dh, dw) = _scan_chunks(hidden, lm_head, labels, valid, *static, grads=True)
    return out, (dh, dw.astype(lm_head.dtype))


def _fused_bwd(chunk_size, shards, per_shard, vocab_major, res, cts):
    dh, dw = res
    g = cts[0]  # the count is an integer: no cotangent
    scaled = [(x.astype(jnp.float32) * g).astype(x.dtype) for x in (dh, dw)]
    return *scaled, None, None


_fused_cross_entropy.defvjp(_fused_fwd, _fused_bwd)
