"""Pure-pytree entry points: parameters are a nested dict of arrays.

These are what the trainer jits (``config`` and ``attention`` are static,
hashable values)::

    params = models.init_params(config, jax.random.key(0))
    logits = jax.jit(models.logits, static_argnums=0)(config, params, ids)

The NNX :class:`~models.llama.Llama` module is rebuilt abstractly from ``config``
on every trace (no allocation) and bound to ``params``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from models.attention import AttentionConfig, as_attention_config
from models.config import LlamaConfig
from models.llama import Llama
from models.sharding import spec_axes

Params = dict[str, Any]


def init_params(config: LlamaConfig, key: jax.Array) -> Params:
    """Randomly initialised parameters (HF init: normal(initializer_range), norms 1).

    Jit it with ``out_shardings`` to create sharded parameters directly.

    Args:
        config: the model.
        key: a PRNG key.

    Returns:
        The parameter dict (layout in :mod:`models.llama`), in ``config.param_dtype``.
    """
    model = Llama(config, rngs=nnx.Rngs(params=key))
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def abstract_params(config: LlamaConfig) -> Params:
    """The parameter dict as ``jax.ShapeDtypeStruct`` leaves (nothing allocated)."""
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
        nnx.to_pure_dict(nnx.state(model, nnx.Param)),
    )


def _flat_shapes(tree: Params) -> dict[str, tuple[int, ...]]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {
        "/".join(str(getattr(k, "key", k)) for k in path): tuple(leaf.shape) for path, leaf in flat
    }


def check_params(config: LlamaConfig, params: Params) -> None:
    """Raises ``ValueError`` listing missing, unexpected and mis-shaped parameters."""
    want = _flat_shapes(abstract_params(config))
    got = _flat_shapes(params)
    missing = sorted(set(want) - set(got))
    unexpected = sorted(set(got) - set(want))
    misshaped = [
        f"{k}: expected {want[k]}, got {got[k]}"
        for k in sorted(set(want) & set(got))
        if want[k] != got[k]
    ]
    if missing or unexpected or misshaped:
        raise ValueError(
            f"parameters do not match the config: missing={_few(missing)}, "
            f"unexpected={_few(unexpected)}, misshaped={_few(misshaped)}"
        )


def _few(names: list[str], shown: int = 4) -> str:
    """`names` as a list, cut to its first `shown` and a count of the rest."""
    if len(names) <= shown:
        return str(names)
    return f"{names[:shown]} and {len(names) - shown} more"


def bind(config: LlamaConfig, params: Params, attention: AttentionConfig | str = "xla") -> Llama:
    """The :class:`Llama` module holding ``params`` (works under ``jax.jit``).

    Args:
        config: the model.
        params: parameter dict matching ``config``.
        attention: backend, or a kind string for ``AttentionConfig(kind=...)``.
    """
    check_params(config, params)
    attention = as_attention_config(attention)
    abstract = nnx.eval_shape(lambda: Llama(config, attention, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


def logits(
    config: LlamaConfig,
    params: Params,
    input_ids: Int[Array, "B T"],
    positions: Int[Array, "B T"] | None = None,
    *,
    attention: AttentionConfig | str = "xla",
    segment_ids: Int[Array, "B T"] | None = None,
) -> Float[Array, "B T V"]:
    """The model's forward pass: float32 logits ``[B, T, V]``.

    Args:
        config: the model (static under jit).
        params: parameter dict.
        input_ids: token ids ``[B, T]`` in ``[0, V)`` (checked only where concrete,
            not under jit: see :meth:`~models.llama.Llama.hidden_states`).
        positions: global positions ``[B, T]`` (default ``arange(T)``); pass the
            true positions of sequence-sharded or zigzag-ordered tokens.
        attention: attention backend (static under jit).
        segment_ids: packed documents ``[B, T]``: attention stays inside equal ids.
    """
    _check_explicit_splits(params, input_ids, as_attention_config(attention))
    return bind(config, params, attention)(input_ids, positions, segment_ids)


def _named_axes(x) -> tuple:
    """The mesh axes `x`'s type splits it over (Explicit axes; none elsewhere)."""
    spec = getattr(jax.typeof(x), "sharding", None)
    return tuple(entry for entry in (spec.spec if spec is not None else ()) if entry)


def _check_explicit_splits(params: Params, input_ids, attention: AttentionConfig) -> None:
    """On Explicit mesh axes, ValueError for what the model does not run split there:
    parameters (sharded parameters run on Auto axes, as the trainer's FSDP does), and a
    sequence split outside the ``ring`` attention (the others take whole sequences)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if axes := _named_axes(leaf):
            name = "/".join(str(getattr(k, "key", k)) for k in path)
            raise ValueError(
                f"parameter {name} is split over the Explicit mesh axes {axes}: the model "
                "runs sharded parameters on Auto axes (jax.make_mesh(..., axis_types="
                "(AxisType.Auto,) * n), as the trainer does); on Explicit axes pass them "
                "replicated"
            )
    spec = tuple(jax.typeof(input_ids).sharding.spec) if hasattr(input_ids, "ndim") else ()
    if attention.kind != "ring" and len(spec) > 1 and spec[1] is not None:
        raise ValueError(
            f"input_ids are split along the sequence over the Explicit mesh axis "
            f"{spec[1]!r}: attention kind {attention.kind!r} takes whole sequences; "
            "AttentionConfig(kind='ring', ...) splits one"
        )
    if attention.kind == "ring" and hasattr(input_ids, "ndim"):
        # The ring returns its output split along the sequence: ids given whole would
        # change the layers' type from the first attention on (a scan refuses that).
        mesh, axes = attention.mesh, spec_axes(attention.seq_axis)
        kinds = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
        explicit = all(kinds[a] == jax.sharding.AxisType.Explicit for a in axes)
        split = spec_axes(spec[1]) if len(spec) > 1 else ()
        if explicit and any(mesh.shape[a] > 1 for a in axes) and split != axes:
            seq = axes[0] if len(axes) == 1 else axes
            raise ValueError(
                f"input_ids are {'split over ' + repr(spec[1]) if split else 'whole'} along "
                f"the sequence, where the 'ring' attention splits it over the Explicit mesh "
                f"axis {seq!r}: put them split so, jax.device_put(input_ids, "
                f"NamedSharding(mesh, P(None, {seq!r})))"
            )


def hidden_states(
    config: LlamaConfig,
    params: Params,
    input_ids: Int[Array, "B T"],
    positions: Int[Array, "B T"] | None = None,
    *,
    attention: AttentionConfig | str = "xla",
    segment_ids: Int[Array, "B T"] | None = None,
) -> Float[Array, "B T D"]:
    """Final-norm hidden states ``[B, T, D]`` in the compute dtype (for chunked losses);
    arguments as :func:`logits`."""
    _check_explicit_splits(params, input_ids, as_attention_config(attention))
    return bind(config, params, attention).hidden_states(input_ids, positions, segment_ids)


def lm_head_table(config: LlamaConfig, params: Params) -> tuple[Any, bool]:
    """The output projection's leaf as stored, for :func:`models.chunked_cross_entropy`:
    ``(embedding [V, D], True)`` when tied, else ``(kernel [D, V], False)``; pass the
    flag as its ``vocab_major`` and nothing is transposed. Works on any tree laid out
    like the parameters (e.g. their shardings)."""
    if config.tie_word_embeddings:
        return params["embed"]["embedding"], True
    return params["lm_head"]["kernel"], False


def lm_head_weight(config: LlamaConfig, params: Params) -> Float[Array, "D V"]:
    """The output projection ``[D, V]`` in the parameter dtype (tied: ``embedding.T``)."""
    if config.tie_word_embeddings:
        return jnp.asarray(params["embed"]["embedding"]).T
    return jnp.asarray(params["lm_head"]["kernel"])
