"""Rotary position embedding in HF's rotate-half layout.

The inverse frequencies reproduce ``transformers.modeling_rope_utils`` (``default``,
``linear`` and ``llama3`` types) operation by operation in float32, so HF q/k
weights load with a transpose only (no interleave permutation). Angles are
computed from *global* position ids in float32: the angle is one elementwise f32
product ``position * inv_freq`` (no matmul, so no reduced-precision pass can touch
it), which lets sequence-sharded or zigzag-ordered tokens pass their true positions.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from models.config import RopeConfig


def inv_frequencies(head_dim: int, rope: RopeConfig) -> np.ndarray:
    """Inverse frequencies ``[H // 2]`` float32, as HF computes them.

    Args:
        head_dim: H (even).
        rope: theta and scaling type.

    Returns:
        A float32 numpy array (a compile-time constant of the model).
    """
    if head_dim % 2:
        raise ValueError(f"{head_dim=} must be even for rotate-half RoPE")
    f32 = np.float32
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(f32) / f32(head_dim)
    inv_freq = (f32(1.0) / (f32(rope.theta) ** exponent)).astype(f32)
    if rope.type == "default":
        return inv_freq
    if rope.type == "linear":
        return (inv_freq / f32(rope.factor)).astype(f32)
    if rope.type == "llama3":
        # Llama 3.1 "rope scaling" (transformers _compute_llama3_parameters): long
        # wavelengths are divided by `factor`, short ones kept, the band between
        # them interpolated smoothly.
        factor = f32(rope.factor)
        low, high = rope.low_freq_factor, rope.high_freq_factor
        old_len = rope.original_max_position_embeddings
        low_freq_wavelen = old_len / low
        high_freq_wavelen = old_len / high
        wavelen = (f32(2 * math.pi) / inv_freq).astype(f32)
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq).astype(f32)
        smooth = ((f32(old_len) / wavelen - f32(low)) / f32(high - low)).astype(f32)
        smoothed = ((f32(1) - smooth) * scaled / factor + smooth * scaled).astype(f32)
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return np.where(is_medium, smoothed, scaled).astype(f32)
    raise ValueError(f"unknown rope type {rope.type!r}")


def rope_cos_sin(
    positions: Int[Array, "B T"], inv_freq: Float[np.ndarray, " half"]
) -> tuple[Float[Array, "B T H"], Float[Array, "B T H"]]:
    """cos and sin tables ``[B, T, H]`` float32 for global ``positions``.

    Args:
        positions: global token positions (any integer dtype).
        inv_freq: ``[H // 2]`` from :func:`inv_frequencies`.
    """
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def rotate_half(x: Float[Array, "... H"]) -> Float[Array, "... H"]:
    """``[x1, x2] -> [-x2, x1]`` on the last axis (HF layout)."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def apply_rope(
    x: Float[Array, "B T N H"], cos: Float[Array, "B T H"], sin: Float[Array, "B T H"]
) -> Float[Array, "B T N H"]:
    """Rotates ``x`` (queries or keys) by the position angles.

    The rotation runs in float32 and the result is cast back to ``x.dtype``
    (for float32 inputs this is exactly HF's arithmetic).
    """
    x32 = x.astype(jnp.float32)
    cos = cos[:, :, None, :]
    sin = sin[:, :, None, :]
    return (x32 * cos + rotate_half(x32) * sin).astype(x.dtype)
