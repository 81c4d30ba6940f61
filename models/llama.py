"""Flax NNX Llama-2/3 decoder, numerically matching HF ``LlamaForCausalLM``.

Parameter tree (``nnx.to_pure_dict(nnx.state(model, nnx.Param))``), with L stacked
layers in front of every per-layer leaf::

    embed/embedding                 [V, D]
    layers/input_norm/scale         [L, D]
    layers/attn/q_proj/kernel       [L, D, N*H]
    layers/attn/k_proj/kernel       [L, D, K*H]
    layers/attn/v_proj/kernel       [L, D, K*H]
    layers/attn/o_proj/kernel       [L, N*H, D]
    layers/post_attn_norm/scale     [L, D]
    layers/mlp/gate_proj/kernel     [L, D, F]
    layers/mlp/up_proj/kernel       [L, D, F]
    layers/mlp/down_proj/kernel     [L, F, D]
    final_norm/scale                [D]
    lm_head/kernel                  [D, V]   (absent when embeddings are tied)

Kernels are ``[in, out]``: an HF ``nn.Linear.weight`` loads with a transpose only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int

from models.attention import AttentionConfig, attend
from models.config import REMAT_POLICIES, LlamaConfig
from models.rope import apply_rope, inv_frequencies, rope_cos_sin
from models.sharding import explicit_mesh

# Names saved by remat="save_attn": the attention output, and the log-sum-exp if
# the attention kernel tags it (its backward needs both; neither is recomputed).
SAVE_ATTN_NAMES: tuple[str, ...] = ("attention_out", "attention_lse")
# Saved by remat="save_dots" besides every matmul output: the MLP's activation
# `silu(gate) * up`, the down projection's input. Recomputing it read gate and up again
# in every layer's backward (8 ms of a 1B step at 32k on an H100); saving it costs
# 0.5 GB per layer there and gained 0.6% on one H200 (BENCHMARKS.md, trainer).
SAVE_DOTS_NAMES: tuple[str, ...] = ("mlp_activation",)
# Each layer's input, tagged inside the checkpointed layer: the offload policies move it
# to host memory (the other policies keep the layer input on the device as before).
LAYER_INPUT_NAME = "layer_input"
# What remat="offload_*" moves to pinned host memory in the forward pass (and back in
# the backward): every residual its on-device counterpart saves.
OFFLOAD_NAMES: dict[str, tuple[str, ...]] = {
    "offload_attn": (LAYER_INPUT_NAME, *SAVE_ATTN_NAMES),
    "offload_full": (LAYER_INPUT_NAME,),
}
DEFAULT_ATTENTION = AttentionConfig()


def _linear(config: LlamaConfig, d_in: int, d_out: int, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(
        d_in,
        d_out,
        use_bias=False,
        dtype=config.compute_dtype,
        param_dtype=config.weight_dtype,
        kernel_init=nnx.initializers.normal(config.initializer_range),
        rngs=rngs,
    )


class RMSNorm(nnx.Module):
    """Root-mean-square norm with HF's cast order.

    Normalises in float32, casts back to the input dtype, then multiplies by the
    scale (cast to the input dtype): ``scale * (x32 * rsqrt(mean(x32^2) + eps)).astype(x.dtype)``.
    """

    def __init__(self, dim: int, eps: float, *, param_dtype: jnp.dtype) -> None:
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: Float[Array, "... D"]) -> Float[Array, "... D"]:
        with jax.named_scope("rmsnorm"):
            x32 = x.astype(jnp.float32)
            variance = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
            normed = (x32 * jax.lax.rsqrt(variance + self.eps)).astype(x.dtype)
            return self.scale[...].astype(x.dtype) * normed


class MLP(nnx.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = _linear(config, d, f, rngs)
        self.up_proj = _linear(config, d, f, rngs)
        self.down_proj = _linear(config, f, d, rngs)

    def __call__(self, x: Float[Array, "B T D"]) -> Float[Array, "B T D"]:
        with jax.named_scope("mlp"):
            act = jax.nn.silu(self.gate_proj(x)) * self.up_proj(x)
            return self.down_proj(checkpoint_name(act, "mlp_activation"))


class Attention(nnx.Module):
    """Grouped-query self-attention with rotate-half RoPE and an injected backend."""

    def __init__(self, config: LlamaConfig, attention: AttentionConfig, *, rngs: nnx.Rngs) -> None:
        d, n, k, h = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.q_proj = _linear(config, d, n * h, rngs)
        self.k_proj = _linear(config, d, k * h, rngs)
        self.v_proj = _linear(config, d, k * h, rngs)
        self.o_proj = _linear(config, n * h, d, rngs)
        self.num_heads, self.num_kv_heads, self.head_dim = n, k, h
        self.attention = attention

    def __call__(
        self,
        x: Float[Array, "B T D"],
        cos: Float[Array, "B T H"],
        sin: Float[Array, "B T H"],
        positions: Int[Array, "B T"],
        segment_ids: Int[Array, "B T"] | None = None,
    ) -> Float[Array, "B T D"]:
        with jax.named_scope("attention"):
            b, t, _ = x.shape
            q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)
            k = self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
            v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
            with jax.named_scope("rope"):
                q = apply_rope(q, cos, sin)
                k = apply_rope(k, cos, sin)
            with jax.named_scope(f"attention_{self.attention.kind}"):
                out = attend(q, k, v, positions, self.attention, segment_ids)
            # LightSeq's rematerialisation-aware checkpointing: remat="save_attn"
            # keeps this tensor so the backward pass never reruns attention.
            out = checkpoint_name(out, "attention_out")
            return self.o_proj(out.reshape(b, t, self.num_heads * self.head_dim))


def _seq_tiled(fn, x: Float[Array, "B T D"], tile: int, shards: int) -> Float[Array, "B T D"]:
    """``fn(x)`` for a token-wise ``fn``, ``tile`` tokens of each of the ``shards``
    sequence shards at a time (``tile`` 0: the whole sequence at once): a ``lax.map``
    over tiles of a checkpointed ``fn``, so ``fn``'s intermediates exist for one tile
    forward and backward (the backward reruns ``fn`` per tile). The sequence splits
    as ``[shards, tiles, tile]``: each step of the map takes one tile from every shard,
    so a sequence-sharded ``x`` stays sharded."""
    if not tile:
        return fn(x)
    b, t, d = x.shape
    n = t // (shards * tile)
    tiles = jnp.moveaxis(x.reshape(b, shards, n, tile, d), 2, 0)  # [n, B, S, tile, D]

    @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
    def one(xt):
        return fn(xt.reshape(b, shards * tile, d)).reshape(b, shards, tile, d)

    with jax.named_scope("seq_tiles"):
        out = jax.lax.map(one, tiles)
    return jnp.moveaxis(out, 0, 2).reshape(b, t, d)


def _tile(config: LlamaConfig, x: Float[Array, "B T D"], shards: int) -> int:
    """Tokens per sequence tile of the token-wise parts (norms, MLP) for ``x``; 0: none."""
    if x.shape[1] % shards:
        raise ValueError(f"{x.shape[1]} tokens do not split over {shards} sequence shards")
    return config.mlp_tile_for(x.shape[1] // shards)


class DecoderLayer(nnx.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, config: LlamaConfig, attention: AttentionConfig, *, rngs: nnx.Rngs) -> None:
        self.input_norm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, param_dtype=config.weight_dtype
        )
        self.attn = Attention(config, attention, rngs=rngs)
        self.post_attn_norm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, param_dtype=config.weight_dtype
        )
        self.mlp = MLP(config, rngs=rngs)
        self.config = config
        self.seq_shards = attention.seq_shards

    def _mlp_block(self, x: Float[Array, "B T D"]) -> Float[Array, "B T D"]:
        return x + self.mlp(self.post_attn_norm(x))

    def __call__(
        self,
        x: Float[Array, "B T D"],
        cos: Float[Array, "B T H"],
        sin: Float[Array, "B T H"],
        positions: Int[Array, "B T"],
        segment_ids: Int[Array, "B T"] | None = None,
    ) -> Float[Array, "B T D"]:
        x = checkpoint_name(x, LAYER_INPUT_NAME)
        tile = _tile(self.config, x, self.seq_shards)
        normed = _seq_tiled(self.input_norm, x, tile, self.seq_shards)
        x = x + self.attn(normed, cos, sin, positions, segment_ids)
        return _seq_tiled(self._mlp_block, x, tile, self.seq_shards)


def _check_ids(input_ids: Int[Array, "B T"], vocab_size: int) -> None:
    """ValueError naming the first of the concrete ``input_ids`` outside ``[0, vocab_size)``
    (evaluated on the device, also while a jit traces around them)."""
    with jax.ensure_compile_time_eval():
        bad = (input_ids < 0) | (input_ids >= vocab_size)
        if not bool(bad.any()):
            return
        b, t = np.unravel_index(int(jnp.argmax(bad)), bad.shape)
        value = int(input_ids[b, t])
    raise ValueError(
        f"input id {value} (input_ids[{b}, {t}]) is out of range for vocab_size={vocab_size}"
    )


def _check_position_order(
    positions: Int[Array, "B T"], segment_ids: Int[Array, "B T"] | None
) -> None:
    """ValueError where a position repeats inside one row's segment (the whole row
    without segment ids): the dense ``xla`` attention masks causally by position, so
    positions that restart at each packed document need one segment id per document,
    or a token would see later tokens of another."""
    with jax.ensure_compile_time_eval():
        pos = np.asarray(positions).astype(np.int64)
        segs = np.zeros_like(pos) if segment_ids is None else np.asarray(segment_ids)
    for row in range(pos.shape[0]):
        pairs = np.stack([segs[row].astype(np.int64), pos[row]], axis=1)
        _, first, counts = np.unique(pairs, axis=0, return_index=True, return_counts=True)
        if (counts > 1).any():
            seg, at = pairs[first[counts > 1][0]]
            where = np.flatnonzero((pairs == (seg, at)).all(axis=1))[:2]
            inside = "the row" if segment_ids is None else f"segment id {seg}"
            raise ValueError(
                f"position {at} repeats inside {inside} (positions[{row}, {where[0]}] and "
                f"[{row}, {where[1]}]): the xla attention masks causally by position, so "
                "positions that restart at each packed document need segment_ids with one "
                "id per document"
            )


def _check_token_order(
    positions: Int[Array, "B T"], segment_ids: Int[Array, "B T"] | None, kind: str
) -> None:
    """ValueError where a token's position is not above that of every earlier token of
    its segment (its row without segment ids): the ``jflash`` and ``cudnn`` kernels mask
    causally by token order, so tokens out of order (zigzag, reversed) would attend by
    the wrong mask while RoPE took their true positions."""
    with jax.ensure_compile_time_eval():
        pos = np.asarray(positions).astype(np.int64)
        segs = np.zeros_like(pos) if segment_ids is None else np.asarray(segment_ids)
    for row in range(pos.shape[0]):
        order = np.lexsort((np.arange(pos.shape[1]), segs[row]))  # by segment, then index
        seg, at = segs[row][order], pos[row][order]
        bad = np.flatnonzero((seg[1:] == seg[:-1]) & (at[1:] <= at[:-1]))
        if bad.size:
            before, after = order[bad[0]], order[bad[0] + 1]
            inside = "the row" if segment_ids is None else f"segment id {seg[bad[0]]}"
            raise ValueError(
                f"positions[{row}, {after}]={at[bad[0] + 1]} follows positions[{row}, "
                f"{before}]={at[bad[0]]} inside {inside}: attention kind {kind!r} masks "
                "causally by token order, so each document's tokens must come in rising "
                "positions; use kind 'xla' (it masks by position) or natural order"
            )


def _embed_lookup(embed: nnx.Embed, input_ids: Int[Array, "B T"]) -> Float[Array, "B T D"]:
    """Token embedding gather; under an Explicit-axes mesh the output keeps the
    ids' sharding (``[B, T]`` as the ids, D replicated), which jax cannot infer."""
    table = embed.embedding[...].astype(embed.dtype)
    if explicit_mesh() is not None:
        spec = jax.typeof(input_ids).sharding.spec
        out_sharding = jax.sharding.PartitionSpec(*spec, None)
        return table.at[input_ids].get(out_sharding=out_sharding)
    return jnp.take(table, input_ids, axis=0)


def _remat(fn, policy: str, scan_layers: bool):
    """Wraps a layer function with the configured rematerialisation policy."""
    if policy == "none":
        return fn
    # Inside lax.scan the loop boundary already stops CSE across iterations.
    prevent_cse = not scan_layers
    if policy == "full":
        return jax.checkpoint(
            fn, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=prevent_cse
        )
    if policy == "save_attn":
        names = jax.checkpoint_policies.save_only_these_names(*SAVE_ATTN_NAMES)
        return jax.checkpoint(fn, policy=names, prevent_cse=prevent_cse)
    if policy == "save_dots":
        names = jax.checkpoint_policies.save_only_these_names(*SAVE_ATTN_NAMES, *SAVE_DOTS_NAMES)
        both = jax.checkpoint_policies.save_from_both_policies(
            names, jax.checkpoint_policies.dots_with_no_batch_dims_saveable
        )
        return jax.checkpoint(fn, policy=both, prevent_cse=prevent_cse)
    if policy in OFFLOAD_NAMES:
        names = jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=(),
            names_which_can_be_offloaded=OFFLOAD_NAMES[policy],
            offload_src="device",
            offload_dst="pinned_host",
        )
        return jax.checkpoint(fn, policy=names, prevent_cse=prevent_cse)
    raise ValueError(f"remat policy={policy!r} not in {REMAT_POLICIES}")


class Llama(nnx.Module):
    """Llama-2/3 causal LM (``LlamaForCausalLM``).

    The L decoder layers are one :class:`DecoderLayer` whose parameters carry a
    leading ``[L]`` axis; ``config.scan_layers`` runs them with ``jax.lax.scan``,
    otherwise a Python loop slices the same stacked parameters.

    Args:
        config: architecture and numerics.
        attention: which attention backend to call (default dense ``xla``).
        rngs: ``nnx.Rngs`` with a ``params`` stream.
    """

    def __init__(
        self,
        config: LlamaConfig,
        attention: AttentionConfig = DEFAULT_ATTENTION,
        *,
        rngs: nnx.Rngs,
    ) -> None:
        self.config = config
        self.embed = nnx.Embed(
            config.vocab_size,
            config.hidden_size,
            dtype=config.compute_dtype,
            param_dtype=config.weight_dtype,
            embedding_init=nnx.initializers.normal(config.initializer_range),
            rngs=rngs,
        )
        self.seq_shards = attention.seq_shards
        self.attention = attention
        make_layer = functools.partial(DecoderLayer, config, attention)
        layer_graph = nnx.graphdef(nnx.eval_shape(lambda: make_layer(rngs=nnx.Rngs(0))))
        keys = jax.random.split(rngs.params(), config.num_layers)
        stacked = jax.vmap(lambda key: nnx.state(make_layer(rngs=nnx.Rngs(params=key))))(keys)
        self.layers = nnx.merge(layer_graph, stacked)
        self.final_norm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, param_dtype=config.weight_dtype
        )
        if not config.tie_word_embeddings:
            self.lm_head = _linear(config, config.hidden_size, config.vocab_size, rngs)

    def hidden_states(
        self,
        input_ids: Int[Array, "B T"],
        positions: Int[Array, "B T"] | None = None,
        segment_ids: Int[Array, "B T"] | None = None,
    ) -> Float[Array, "B T D"]:
        """Final-norm hidden states in the compute dtype.

        Args:
            input_ids: token ids ``[B, T]`` in ``[0, V)``. Concrete ids (an eager call)
                are checked: ValueError naming the first id outside it. Traced ids (under
                jit) cannot be: there an id of V or more gives NaN logits, a negative one
                counts from the end of the vocabulary (the trainer checks its data's ids
                when it loads them).
            positions: global position of every token (default ``arange(T)``, or
                under a ``ring`` attention its layout's, ``AttentionConfig.positions``);
                pass the true positions of sequence-sharded or permuted tokens, or
                positions that restart at each packed document (HF's packed
                ``position_ids``) together with ``segment_ids``, one id per document:
                the ``xla`` attention masks causally by position, so a position that
                repeats inside one id would let a token see a later one; the
                ``jflash`` and ``cudnn`` kernels mask by token order, so each
                document's tokens must come in rising positions (permuted tokens go
                to ``xla`` or ``ring`` with its layout). Concrete positions are
                checked: ValueError naming the first repeat or the first token out
                of order.
            segment_ids: packed documents, in the same token order: attention stays
                inside equal ids (None: one document per row).
        """
        config = self.config
        input_ids = jnp.asarray(input_ids)
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids.shape={input_ids.shape}: expected [B, T] token rows")
        if not isinstance(input_ids, jax.core.Tracer):
            _check_ids(input_ids, config.vocab_size)
        b, t = input_ids.shape
        if positions is None:  # the attention's token order (the ring's layout)
            positions = jnp.broadcast_to(
                jnp.asarray(self.attention.positions(t), jnp.int32), (b, t)
            )
        positions = jnp.asarray(positions)
        segment_ids = None if segment_ids is None else jnp.asarray(segment_ids)
        if positions.shape != (b, t):
            raise ValueError(f"positions.shape={positions.shape} != input_ids.shape={(b, t)}")
        if segment_ids is not None and segment_ids.shape != (b, t):
            raise ValueError(f"segment_ids.shape={segment_ids.shape} != input_ids.shape={(b, t)}")
        kind = self.attention.kind
        if not isinstance(positions, jax.core.Tracer):  # concrete: checked here
            if kind == "xla":
                _check_position_order(positions, segment_ids)
            elif kind in ("jflash", "cudnn"):
                _check_token_order(positions, segment_ids, kind)
        with jax.named_scope("embed"):
            x = _embed_lookup(self.embed, input_ids)
        with jax.named_scope("rope"):
            cos, sin = rope_cos_sin(positions, inv_frequencies(config.head_dim, config.rope))

        layer_graph, layer_state = nnx.split(self.layers)

        def layer_fn(x, state):
            return nnx.merge(layer_graph, state)(x, cos, sin, positions, segment_ids)

        layer_fn = _remat(layer_fn, config.remat, config.scan_layers)
        if config.scan_layers:

            def body(x, state):
                with jax.named_scope("layer"):
                    return layer_fn(x, state), None

            x, _ = jax.lax.scan(body, x, layer_state)
        else:
            for i in range(config.num_layers):
                with jax.named_scope(f"layer_{i}"):
                    x = layer_fn(x, jax.tree.map(lambda a, i=i: a[i], layer_state))
        with jax.named_scope("final_norm"):
            tile = _tile(config, x, self.seq_shards)
            return _seq_tiled(self.final_norm, x, tile, self.seq_shards)

    def lm_head_weight(self) -> Float[Array, "D V"]:
        """The output projection ``[D, V]`` (the embedding transposed when tied)."""
        if self.config.tie_word_embeddings:
            return self.embed.embedding[...].T
        return self.lm_head.kernel[...]

    def project(self, hidden: Float[Array, "B T D"]) -> Float[Array, "B T V"]:
        """Logits ``[B, T, V]`` float32 (compute-dtype inputs, float32 accumulation)."""
        with jax.named_scope("lm_head"):
            w = self.lm_head_weight().astype(hidden.dtype)
            return jnp.einsum("btd,dv->btv", hidden, w, preferred_element_type=jnp.float32)

    def __call__(
        self,
        input_ids: Int[Array, "B T"],
        positions: Int[Array, "B T"] | None = None,
        segment_ids: Int[Array, "B T"] | None = None,
    ) -> Float[Array, "B T V"]:
        """Float32 logits ``[B, T, V]``; see :meth:`hidden_states` for the arguments."""
        return self.project(self.hidden_states(input_ids, positions, segment_ids))
