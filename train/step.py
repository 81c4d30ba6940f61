"""The jitted training step: gradient accumulation, token-normalised loss, the optimizer update.

`input_ids`, `labels`, `segment_ids` and `positions` `[accum, B, T]` arrive in natural
token order, sharded batch over `data x fsdp` and sequence over `seq`. With the zigzag
or striped layout they are all permuted once here (`jflash.to_layout`), and every layer
then works in that order (the ring's own layout). Labels were aligned before sharding, so no shift
ever crosses a shard. Segment ids (the packed document of each token) keep attention
inside each document when `StepSpec.mask_documents`; positions are the RoPE positions
(restarting at each document, or running along the row).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

import jflash
import models


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """What the step needs to know, static under jit."""

    config: models.LlamaConfig
    attention: models.AttentionConfig
    seq_shards: int  # devices one sequence is split over
    layout: str  # token order on the seq axis: "zigzag" | "striped" | "contiguous"
    # The P of `layout` (`jflash.to_layout(x, P, layout)`): `seq_shards`, or the ring
    # axis's size under `--ring_strategy hybrid` (each ring shard is then split
    # contiguously over the all-to-all axis).
    layout_shards: int
    loss_chunk: int
    replicated_head: bool = False  # the LM head is not sharded over `seq`
    # `(stored, compute)` parameter shardings when the weights are gathered once per
    # step (`--gather_once`); None: the model uses the stored parameters directly.
    weights: tuple[Any, Any] | None = None
    mask_documents: bool = False  # attention stays inside equal segment ids
    # `(host, device, max_grad_norm)`: the optimizer-state shardings when the state lives
    # in pinned host memory (`--optimizer_offload`), and the clipping norm (0: none);
    # None: the state stays on the device.
    opt_offload: tuple[Any, Any, float] | None = None


BATCH_KEYS = ("input_ids", "labels", "segment_ids", "positions")


def _reorder(x, spec: StepSpec):
    if spec.layout != "contiguous" and spec.layout_shards > 1:
        return jflash.to_layout(x, spec.layout_shards, spec.layout, axis=1)
    return x


def loss_sums(params, ids, labels, spec: StepSpec, segment_ids=None, positions=None):
    """`(sum of token losses, number of counted tokens)` for one micro-batch `[B, T]`.

    `segment_ids` and `positions` `[B, T]` in natural order (None: one document per
    row; positions `arange(T)`)."""
    ids, labels = _reorder(ids, spec), _reorder(labels, spec)
    if positions is None:
        seq_len = ids.shape[1]
        layout = spec.layout if spec.layout_shards > 1 else "contiguous"
        pos = jflash.positions(seq_len, spec.layout_shards, layout)
        positions = jnp.broadcast_to(pos, ids.shape)
    else:
        positions = _reorder(positions, spec)
    segs = _reorder(segment_ids, spec) if spec.mask_documents else None
    hidden = models.hidden_states(
        spec.config, params, ids, positions, attention=spec.attention, segment_ids=segs
    )
    head, vocab_major = models.lm_head_table(spec.config, params)
    return models.chunked_cross_entropy(
        hidden,
        head,
        labels,
        chunk_size=spec.loss_chunk,
        shards=spec.seq_shards,
        replicated_head=spec.replicated_head,
        vocab_major=vocab_major,
    )


def compute_weights(params, spec: StepSpec):
    """The weights the forward and backward use: `params` itself, or with
    `spec.weights` one gathered copy per step in the compute dtype (one all-gather
    per weight, kept for the backward, instead of per layer in both passes).

    The embedding / LM head stays float32: the loss sums its gradient over the chunks
    in float32, which a compute-dtype copy would round once more. The model casts
    every weight to the compute dtype where it uses it, so the forward is the same.
    """
    if spec.weights is None:
        return params
    dtype = spec.config.compute_dtype

    def gather(path, p, sharding):
        keep = any(getattr(k, "key", None) in ("embed", "lm_head") for k in path)
        return jax.lax.with_sharding_constraint(p if keep else p.astype(dtype), sharding)

    return jax.tree_util.tree_map_with_path(gather, params, spec.weights[1])


def gradients(params, batch: dict[str, jax.Array], spec: StepSpec):
    """`(grads, (loss, count))` of one step's `accum` micro-batches: the f32 gradients
    of the mean token loss (total NLL / total counted tokens), laid out like `params`;
    that loss; the number of counted tokens.

    Args:
      params: the stored parameters.
      batch: `{"input_ids", "labels", "segment_ids", "positions"}` int32 `[accum, B, T]`
        (the last two may be missing: one document per row, running positions).
    """
    weights = compute_weights(params, spec)

    def micro_batch(ids, labels, segs, pos):
        (l_sum, n), g = jax.value_and_grad(loss_sums, has_aux=True)(
            weights, ids, labels, spec, segs, pos
        )
        if spec.weights is not None:  # summed over seq axes straight into the stored shards
            g = jax.lax.with_sharding_constraint(g, spec.weights[0])
        return jax.tree.map(lambda b: b.astype(jnp.float32), g), l_sum, n

    def accumulate(carry, xs):
        grads, loss, count = carry
        g, l_sum, n = micro_batch(*xs)
        grads = jax.tree.map(jnp.add, grads, g)
        return (grads, loss + l_sum, count + n), None

    xs = (batch["input_ids"], batch["labels"], batch.get("segment_ids"), batch.get("positions"))
    if xs[0].shape[0] == 1:
        # One micro-batch: no scan, so no f32 gradient tree is zeroed and added into
        # (16 bytes of memory traffic per parameter less; the same numbers).
        grads, loss_sum, count = micro_batch(*jax.tree.map(lambda x: x[0], xs))
    else:
        zeros = jax.tree.map(jnp.zeros_like, params)
        init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32))
        (grads, loss_sum, count), _ = jax.lax.scan(accumulate, init, xs)
    # The loss is a sum over tokens; normalise by all counted tokens of the step.
    denom = jnp.maximum(count, 1).astype(jnp.float32)
    grads = jax.tree.map(lambda g: g / denom, grads)
    return grads, (loss_sum / denom, count)


def eval_sums(params, batch: dict[str, jax.Array], *, spec: StepSpec):
    """`(sum of token losses, counted tokens)` of one evaluation batch, the training
    step's forward (same mesh, attention, documents and positions) without gradients.

    Args:
      params: the stored parameters.
      batch: as `gradients` takes it, with `accum` 1.
    """
    weights = compute_weights(params, spec)
    return loss_sums(
        weights,
        batch["input_ids"][0],
        batch["labels"][0],
        spec,
        batch["segment_ids"][0],
        batch["positions"][0],
    )


def offloaded_update(tx, grads, opt_state, params, spec: StepSpec):
    """`(new params, new host-resident optimizer state)`: `tx`'s update one parameter at
    a time, each one's state moved host -> device, updated and moved back before the
    next one's comes over, so the device holds one parameter's moments at a time.

    The gradients are clipped by their global norm first (the chain's own clip then sees
    a part of a clipped tree: a no-op). Optimizer state that mirrors the parameters
    (moments, factored second moments) is split by parameter; the rest (step counts) is
    the same in every part's result.
    """
    host, device, max_norm = spec.opt_offload
    if max_norm > 0:
        grads, _ = optax.clip_by_global_norm(max_norm).update(grads, optax.EmptyState())
    params_def = jax.tree.structure(params)
    flat_params = jax.tree_util.tree_flatten_with_path(params)[0]

    def mirrors(tree_def):
        return lambda x: isinstance(x, dict) and jax.tree.structure(x) == tree_def

    def nodes(state, tree_def):  # the state's parameter-shaped subtrees stay whole
        return jax.tree.flatten(state, is_leaf=mirrors(tree_def))

    def pick(tree, path):  # the one-leaf subtree of a parameter-shaped tree at `path`
        node = tree
        for key in path:
            node = node[key.key]
        for key in reversed(path):
            node = {key.key: node}
        return node

    full_nodes, state_def = nodes(opt_state, params_def)
    host_nodes = nodes(host, params_def)[0]
    device_nodes = nodes(device, params_def)[0]
    parts, new_leaves, before = [], [], ()
    for path, _leaf in flat_params:
        part = [pick(n, path) if mirrors(params_def)(n) else n for n in full_nodes]
        part_device = [pick(n, path) if mirrors(params_def)(n) else n for n in device_nodes]
        # One part's transfer waits for the previous part's results.
        part, before = jax.lax.optimization_barrier((part, before))
        part = jax.device_put(part, part_device)
        p, g = pick(params, path), pick(grads, path)
        part_state = jax.tree.unflatten(state_def, part)
        updates, part_state = tx.update(g, part_state, p)
        new_p = optax.apply_updates(p, updates)
        part_def = jax.tree.structure(p)
        part = nodes(part_state, part_def)[0]
        part_host = [pick(n, path) if mirrors(params_def)(n) else n for n in host_nodes]
        part = jax.device_put(part, part_host)
        parts.append(part)
        new_leaves.append(jax.tree.leaves(new_p)[0])
        before = (part, new_leaves[-1])
    merged = []
    for j, n in enumerate(full_nodes):
        if mirrors(params_def)(n):
            leaves = [jax.tree.leaves(part[j])[0] for part in parts]
            merged.append(jax.tree.unflatten(params_def, leaves))
        else:
            merged.append(parts[0][j])
    return jax.tree.unflatten(params_def, new_leaves), jax.tree.unflatten(state_def, merged)


def train_step(
    state: dict[str, Any], batch: dict[str, jax.Array], *, spec: StepSpec, tx, lr: optax.Schedule
):
    """One optimizer step over `accum` micro-batches; loss = total NLL / total tokens.

    Args:
      state: `{"params", "opt_state", "step"}`.
      batch: as `gradients` takes it.
      tx, lr: the optimizer and its learning-rate schedule.

    Returns:
      `(new_state, metrics)`: the loss, the gradient norm, the counted tokens and the
      step's learning rate (computed here, so that the host reads it with the rest one
      step late instead of waiting on the device queue for it).
    """
    params = state["params"]
    grads, (loss, count) = gradients(params, batch, spec)
    grad_norm = optax.tree.norm(grads)  # the clip's own expression: XLA merges the two
    if spec.opt_offload is not None:
        new_params, opt_state = offloaded_update(tx, grads, state["opt_state"], params, spec)
    else:
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)
    new_state = {"params": new_params, "opt_state": opt_state, "step": state["step"] + 1}
    metrics = {"loss": loss, "grad_norm": grad_norm, "tokens": count, "lr": lr(state["step"])}
    return new_state, metrics
