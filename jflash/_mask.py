"""The static description of which keys a query may see (the kernel contract of `jflash._dispatch`).

A query at global position `q_offset + i` sees a key at `k_offset + j` when `causal` is
off, or when `q_offset + i >= k_offset + j`; segment ids (dynamic) further restrict
attention to equal ids. Positions past the real key length are always hidden.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

# More than any kernel's padding of a length to whole tiles (`Mask.for_kernels`).
KERNEL_MARGIN = 1 << 16


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

    def for_kernels(self, q_len: int, kv_len: int) -> Mask:
        """The same visibility for `q_len` queries and `kv_len` keys, with offsets small
        enough for the kernels' int32 sums of a local position and the diagonal
        (`q_offset - k_offset`, near 2**31 apart at most): only the diagonal decides
        what a query sees, and past `kv_len` (every key seen) or `-q_len` (none) its
        size changes nothing. `KERNEL_MARGIN` to spare keeps the padded rows and keys of
        the last tiles on the same side."""
        if not self.causal:
            return self
        low, high = -(q_len + KERNEL_MARGIN), kv_len + KERNEL_MARGIN
        diag = min(max(self.q_offset - self.k_offset, low), high)
        return Mask(True, q_offset=max(diag, 0), k_offset=max(-diag, 0))

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
