"""jflash: distributed FlashAttention for long-context training in JAX.

Public API (everything else is private):
  flash_attention        single-device exact attention (Pallas GPU kernels, custom VJP)
  ring_attention         the same over a sequence sharded across a mesh axis (global arrays)
  ring_attention_shard   its per-shard form, for code inside the caller's `jax.shard_map`
  ring_attention_rank    one rank's forward+backward of the ring strategy on one device,
                         K/V given per step instead of received (timing a rank's compute)
  to_layout, from_layout, positions   token orders of a sharded sequence (LAYOUTS);
                         zigzag, unzigzag: the zigzag order
  attention_reference    plain-jnp oracle, returns (out, lse)
  BlockSizes, default_block_sizes   kernel tuning knobs
  tiles_first_limits     the kernels' launch order (a context manager for tuning)
  describe               which implementation runs here, and why
  SharedKVWarning        inside a `shard_map`, k or v the same along axes q varies over
  kernel_timeline, KERNEL_SCOPES   the Mosaic kernels' cycles by named scope per
                         warpgroup (Mosaic GPU's on-device profiler; a context manager)
"""

from jflash._block_sizes import BlockSizes, default_block_sizes
from jflash._context import STRATEGIES, ring_attention, ring_attention_shard
from jflash._dispatch import IMPLEMENTATIONS, describe
from jflash._flash import flash_attention
from jflash._launch_order import tiles_first_limits
from jflash._layout import LAYOUTS, from_layout, positions, to_layout, unzigzag, zigzag
from jflash._reference import attention_reference
from jflash._ring import ring_attention_rank
from jflash._timeline import KERNEL_SCOPES, kernel_timeline
from jflash._vma import SharedKVWarning

__version__ = "0.1.0"  # the package's version (pyproject.toml reads it here)

__all__ = [
    "IMPLEMENTATIONS",
    "KERNEL_SCOPES",
    "LAYOUTS",
    "STRATEGIES",
    "BlockSizes",
    "SharedKVWarning",
    "attention_reference",
    "default_block_sizes",
    "describe",
    "flash_attention",
    "from_layout",
    "kernel_timeline",
    "positions",
    "ring_attention",
    "ring_attention_rank",
    "ring_attention_shard",
    "tiles_first_limits",
    "to_layout",
    "unzigzag",
    "zigzag",
]
