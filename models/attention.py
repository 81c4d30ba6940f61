"""Attention injection: one call site, four backends chosen by config.

``AttentionConfig.kind`` picks the backend:

* ``"xla"``   -- dense causal softmax attention in plain jnp (float32 softmax),
  masked by *global positions* (``q_pos >= k_pos``), so it is also correct for
  zigzag-ordered tokens on one device. Memory is O(T*S): a reference, not a kernel.
* ``"cudnn"`` -- ``jax.nn.dot_product_attention(implementation="cudnn")`` (GPU).
* ``"jflash"`` -- ``jflash.flash_attention`` (Pallas kernels; GQA native).
* ``"ring"``  -- ``jflash.ring_attention`` over ``mesh[seq_axis]``; inputs are
  sequence-sharded global arrays in ``layout`` order.

All backends take BSHD ``q [B, T, N, H]`` and ``k, v [B, S, K, H]`` with
``N % K == 0``; K/V are never repeated. Optional ``segment_ids [B, T]`` (packed
documents) keep attention inside equal ids on every backend: ``xla`` masks densely,
``cudnn`` passes a dense mask, ``jflash`` and ``ring`` skip the masked tiles.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

import jflash

AttentionKind = Literal["xla", "cudnn", "jflash", "ring"]
ATTENTION_KINDS: tuple[str, ...] = get_args(AttentionKind)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Which attention the model calls, and the distributed context it needs.

    Attributes:
        kind: ``xla | cudnn | jflash | ring``.
        implementation: forwarded to ``jflash.flash_attention`` / ``ring_attention``
            (``None`` lets jflash choose; ``"xla"`` runs its blockwise reference).
        mesh: the device mesh (``ring`` only).
        seq_axis: mesh axis the sequence is sharded over (``ring`` only); the
            ``hybrid`` strategy takes two, ``(ring_axis, all_to_all_axis)``.
        layout: ``zigzag``, ``striped`` or ``contiguous`` token order (``ring`` only).
        strategy: one of ``jflash.STRATEGIES``: ``ring`` (ppermute K/V), ``allgather``,
            ``ulysses`` (all-to-all over heads) or ``hybrid`` (``ring`` kind only).
        batch_axes: mesh axes splitting the batch (``ring`` only; ``None`` lets
            ``jflash.ring_attention`` pick every other mesh axis that divides B).
    """

    kind: AttentionKind = "xla"
    implementation: str | None = None
    mesh: Mesh | None = None
    seq_axis: str | tuple[str, ...] = "seq"
    layout: str = "zigzag"  # one of jflash.LAYOUTS
    strategy: str = "ring"  # one of jflash.STRATEGIES
    batch_axes: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.kind not in ATTENTION_KINDS:
            raise ValueError(f"attention kind={self.kind!r} not in {ATTENTION_KINDS}")
        if self.kind == "ring":
            if self.mesh is None:
                raise ValueError("attention kind='ring' needs a mesh")
            axes = (self.seq_axis,) if isinstance(self.seq_axis, str) else self.seq_axis
            if not set(axes) <= set(self.mesh.axis_names):
                raise ValueError(
                    f"seq_axis={self.seq_axis!r} not in mesh axes {self.mesh.axis_names}"
                )
        if self.layout not in jflash.LAYOUTS:
            raise ValueError(f"layout={self.layout!r} must be one of {jflash.LAYOUTS}")
        if self.strategy not in jflash.STRATEGIES:
            raise ValueError(f"strategy={self.strategy!r} must be one of {jflash.STRATEGIES}")

    @property
    def seq_shards(self) -> int:
        """How many devices split the sequence the model sees (``ring``'s mesh axes; 1
        for the other kinds)."""
        if self.kind != "ring" or self.mesh is None:
            return 1
        axes = (self.seq_axis,) if isinstance(self.seq_axis, str) else self.seq_axis
        return int(np.prod([self.mesh.shape[a] for a in axes]))

    @property
    def layout_shards(self) -> int:
        """The P of the token order ``ring`` expects, ``jflash.to_layout(x, P, layout)``
        and ``jflash.positions(T, P, layout)``: ``seq_shards``, but the ring axis's
        size alone under ``hybrid`` (each ring shard is split contiguously over the
        all-to-all axis); 1 for the other kinds (natural order)."""
        if self.strategy == "hybrid" and self.seq_shards > 1:
            return int(self.mesh.shape[self.seq_axis[0]])
        return self.seq_shards

    def positions(self, seq_len: int) -> Int[Array, " T"]:
        """``[seq_len]`` global positions of the tokens in the order this attention
        expects them (``arange`` unless ``ring`` splits them in a zigzag or striped
        layout): the positions a model gives tokens it is not told the positions of."""
        layout = self.layout if self.layout_shards > 1 else "contiguous"
        return jflash.positions(seq_len, self.layout_shards, layout)


def as_attention_config(attention: AttentionConfig | str) -> AttentionConfig:
    """Accepts a kind string (``"xla"``) as shorthand for ``AttentionConfig(kind=...)``."""
    if isinstance(attention, AttentionConfig):
        return attention
    return AttentionConfig(kind=attention)


def dense_causal_attention(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B S K H"],
    v: Float[Array, "B S K H"],
    q_positions: Int[Array, "B T"],
    k_positions: Int[Array, "B S"],
    q_segment_ids: Int[Array, "B T"] | None = None,
    k_segment_ids: Int[Array, "B S"] | None = None,
) -> Float[Array, "B T N H"]:
    """Dense softmax attention, causal by global position, float32 softmax.

    Follows HF's eager order of operations: ``(q @ k^T) * scale``, add mask,
    float32 softmax, probabilities cast to ``q.dtype``, then ``@ v``. With segment
    ids a query sees only keys of its own segment (positions may then restart at
    each segment: causality is only compared inside one).
    """
    b, t, n, h = q.shape
    kv_heads = k.shape[2]
    qg = q.reshape(b, t, kv_heads, n // kv_heads, h)
    scores = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (h**-0.5)
    allowed = q_positions[:, :, None] >= k_positions[:, None, :]  # [B, T, S]
    if q_segment_ids is not None:
        allowed &= q_segment_ids[:, :, None] == k_segment_ids[:, None, :]
    scores = jnp.where(allowed[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, n, h).astype(q.dtype)


def attend(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B S K H"],
    v: Float[Array, "B S K H"],
    positions: Int[Array, "B T"],
    attention: AttentionConfig,
    segment_ids: Int[Array, "B T"] | None = None,
) -> Float[Array, "B T N H"]:
    """Causal self-attention with the configured backend.

    Args:
        q: queries, RoPE applied.
        k: keys, RoPE applied.
        v: values.
        positions: global token positions; the ``xla`` backend masks with them;
            the kernels mask by index (``ring`` by its layout), so tokens must be
            in natural order (or ``attention.layout`` order for ``ring``).
        attention: the backend choice.
        segment_ids: packed documents: attention stays inside equal ids (in the
            same token order as q; ``None``: one document per row).

    Returns:
        The attention output in ``q.dtype``.
    """
    kind = attention.kind
    if kind == "xla":
        return dense_causal_attention(q, k, v, positions, positions, segment_ids, segment_ids)
    if kind == "cudnn":
        mesh = attention.mesh
        platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
        if platform != "gpu":
            raise ValueError(
                f"attention kind='cudnn' needs NVIDIA GPUs (cuDNN), but this runs on "
                f"{platform!r}: use 'ring', 'jflash' or 'xla'"
            )
        mask = None
        if segment_ids is not None:  # dense [B, 1, T, S]: cuDNN takes no segment ids
            mask = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
        return jax.nn.dot_product_attention(
            q, k, v, mask=mask, is_causal=True, implementation="cudnn"
        )
    if kind == "jflash":
        return jflash.flash_attention(
            q, k, v, causal=True, segment_ids=segment_ids, implementation=attention.implementation
        )
    if kind == "ring":
        extra = {}
        if segment_ids is not None:
            if "segment_ids" not in inspect.signature(jflash.ring_attention).parameters:
                raise NotImplementedError(
                    "attention kind='ring' with segment_ids (packed documents): this "
                    "jflash.ring_attention takes no segment ids; pass --mask_documents "
                    "false (attention crosses documents) or use another attention kind"
                )
            extra["segment_ids"] = segment_ids
        return jflash.ring_attention(
            q,
            k,
            v,
            **extra,
            mesh=attention.mesh,
            seq_axis=attention.seq_axis,
            causal=True,
            layout=attention.layout,
            strategy=attention.strategy,
            batch_axes=attention.batch_axes,
            implementation=attention.implementation,
        )
    raise ValueError(f"attention kind={kind!r} not in {ATTENTION_KINDS}")
