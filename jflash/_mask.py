"""The static description of which keys a query may see (the kernel contract of `jflash._dispatch`).

A query at global position `q_offset + i` sees a key at `k_offset + j` when `causal` is
off, or when `q_offset + i >= k_offset + j`; segment ids (dynamic) further restrict
attention to equal ids. Positions past the real key length are always hidden.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Mask:
    causal: bool = True
    q_offset: int = 0
    k_offset: int = 0

    def __post_init__(self):
        for name in ("q_offset", "k_offset"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name}={value!r} must be a static Python int")

    def dense(self, q_len: int, kv_len: int, segment_ids=None):
        """Boolean `[B|1, T, S]` visibility matrix (for the oracle and the XLA path)."""
        qi = jnp.arange(q_len)[:, None] + self.q_offset
        kj = jnp.arange(kv_len)[None, :] + self.k_offset
        visible = (qi >= kj) if self.causal else jnp.ones((q_len, kv_len), bool)
        visible = visible[None]
        if segment_ids is not None:
            q_seg, kv_seg = segment_ids
            visible = visible & (q_seg[:, :, None] == kv_seg[:, None, :])
        return visible
