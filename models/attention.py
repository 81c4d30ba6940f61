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
``N % K == 0``; K/V are never repeated.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

import jflash

AttentionKind = Literal["xla", "cudnn", "jflash", "ring"]
ATTENTION_KINDS: tuple[str, ...] = ("xla", "cudnn", "jflash", "ring")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Which attention the model calls, and the distributed context it needs.

    Attributes:
        kind: ``xla | cudnn | jflash | ring``.
        implementation: forwarded to ``jflash.flash_attention`` / ``ring_attention``
            (``None`` lets jflash choose; ``"xla"`` runs its blockwise reference).
        mesh: the device mesh (``ring`` only).
        seq_axis: mesh axis the sequence is sharded over (``ring`` only).
        layout: ``zigzag`` or ``contiguous`` token order (``ring`` only).
        strategy: ``ring`` (ppermute K/V) or ``allgather`` (``ring`` only).
        batch_axes: mesh axes splitting the batch (``ring`` only; ``None`` lets
            ``jflash.ring_attention`` pick every other mesh axis that divides B).
    """

    kind: AttentionKind = "xla"
    implementation: str | None = None
    mesh: Mesh | None = None
    seq_axis: str = "seq"
    layout: Literal["zigzag", "contiguous"] = "zigzag"
    strategy: Literal["ring", "allgather"] = "ring"
    batch_axes: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.kind not in ATTENTION_KINDS:
            raise ValueError(f"attention kind={self.kind!r} not in {ATTENTION_KINDS}")
        if self.kind == "ring":
            if self.mesh is None:
                raise ValueError("attention kind='ring' needs a mesh")
            if self.seq_axis not in self.mesh.axis_names:
                raise ValueError(
                    f"seq_axis={self.seq_axis!r} not in mesh axes {self.mesh.axis_names}"
                )
        if self.layout not in ("zigzag", "contiguous"):
            raise ValueError(f"layout={self.layout!r} must be 'zigzag' or 'contiguous'")
        if self.strategy not in ("ring", "allgather"):
            raise ValueError(f"strategy={self.strategy!r} must be 'ring' or 'allgather'")


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
) -> Float[Array, "B T N H"]:
    """Dense softmax attention, causal by global position, float32 softmax.

    Follows HF's eager order of operations: ``(q @ k^T) * scale``, add mask,
    float32 softmax, probabilities cast to ``q.dtype``, then ``@ v``.
    """
    b, t, n, h = q.shape
    kv_heads = k.shape[2]
    qg = q.reshape(b, t, kv_heads, n // kv_heads, h)
    scores = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (h**-0.5)
    allowed = q_positions[:, :, None] >= k_positions[:, None, :]  # [B, T, S]
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

    Returns:
        The attention output in ``q.dtype``.
    """
    kind = attention.kind
    if kind == "xla":
        return dense_causal_attention(q, k, v, positions, positions)
    if kind == "cudnn":
        mesh = attention.mesh
        platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
        if platform != "gpu":
            raise ValueError(
                f"attention kind='cudnn' needs NVIDIA GPUs (cuDNN), but this runs on "
                f"{platform!r}: use 'ring', 'jflash' or 'xla'"
            )
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    if kind == "jflash":
        return jflash.flash_attention(q, k, v, causal=True, implementation=attention.implementation)
    if kind == "ring":
        return jflash.ring_attention(
            q,
            k,
            v,
            mesh=attention.mesh,
            seq_axis=attention.seq_axis,
            causal=True,
            layout=attention.layout,
            strategy=attention.strategy,
            batch_axes=attention.batch_axes,
            implementation=attention.implementation,
        )
    raise ValueError(f"attention kind={kind!r} not in {ATTENTION_KINDS}")
