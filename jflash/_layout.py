"""Token orders of a sequence sharded over P devices (DESIGN.md "Public API").

`contiguous`: device r holds tokens `[r*T/P, (r+1)*T/P)`. Causal work is unbalanced:
the last device attends to everything, the first only to itself.

`zigzag`: the sequence is cut into 2P chunks and device r holds chunks r and 2P-1-r
(one early, one late), so every device does the same causal work (the load balancing
of LightSeq / DistFlashAttn, arXiv 2310.03294 §3.2, and ring-flash-attention). A model
permutes its tokens into this order once at the input (positions and labels along);
every layer then works in that order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jaxtyping import Array, Int

LAYOUTS = ("zigzag", "contiguous")


def _check_shards(num_shards: int) -> None:
    if not isinstance(num_shards, (int, np.integer)) or isinstance(num_shards, bool):
        raise ValueError(f"{num_shards=} must be a Python int")
    if num_shards < 1:
        raise ValueError(f"{num_shards=} must be >= 1")


def check_zigzag_len(seq_len: int, num_shards: int) -> None:
    """Raises unless `seq_len` splits into `2 * num_shards` equal chunks."""
    _check_shards(num_shards)
    if seq_len % (2 * num_shards) != 0:
        raise ValueError(f"{seq_len=} must be divisible by {2 * num_shards=} for the zigzag layout")


def zigzag_chunk_order(num_shards: int) -> np.ndarray:
    """Natural chunk index at each zigzag slot: `[0, 2P-1, 1, 2P-2, ..., P-1, P]`."""
    _check_shards(num_shards)
    ranks = np.arange(num_shards)
    return np.stack([ranks, 2 * num_shards - 1 - ranks], axis=1).reshape(-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _permute_chunks(x, num_shards: int, axis: int, inverse: bool):
    """Reorders the 2P chunks of `axis`: into zigzag order, or back when `inverse`."""
    order = zigzag_chunk_order(num_shards)
    order = np.argsort(order) if inverse else order
    seq_len = x.shape[axis]
    chunks = x.reshape(
        *x.shape[:axis], 2 * num_shards, seq_len // (2 * num_shards), *x.shape[axis + 1 :]
    )
    # Under Explicit mesh axes a gather along a sharded dim needs its output sharding
    # spelled out: the chunks stay typed where they are (the permutation moves data).
    typed = jax.typeof(chunks).sharding
    explicit = AxisType.Explicit in typed.mesh.axis_types
    index = (slice(None),) * axis + (jnp.asarray(order),)
    return chunks.at[index].get(out_sharding=typed if explicit else None).reshape(x.shape)


def _permute_chunks_fwd(x, num_shards, axis, inverse):
    return _permute_chunks(x, num_shards, axis, inverse), None


def _permute_chunks_bwd(num_shards, axis, inverse, _, ct):
    # A permutation's transpose is its inverse: a gather again, not the scatter-add
    # autodiff would emit (which jax 0.11.2 cannot place under Explicit axes).
    return (_permute_chunks(ct, num_shards, axis, not inverse),)


_permute_chunks.defvjp(_permute_chunks_fwd, _permute_chunks_bwd)


def _checked(x, num_shards: int, axis: int):
    x = jnp.asarray(x)
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"{axis=} is out of range for an array with {x.ndim=}")
    axis = axis % x.ndim
    check_zigzag_len(x.shape[axis], num_shards)
    return x, int(num_shards), axis


def zigzag(x: Array, num_shards: int, axis: int = 1) -> Array:
    """Natural order -> zigzag order along `axis` (e.g. `[B, T, N, H]` with axis=1).

    Args:
      x: any array; `x.shape[axis]` must be divisible by `2 * num_shards`.
      num_shards: P, the size of the sequence mesh axis.
      axis: the sequence axis.

    Returns:
      `x` with its sequence chunks reordered so that shard r (a contiguous 1/P slice
      of the result) holds natural chunks r and 2P-1-r.
    """
    return _permute_chunks(*_checked(x, num_shards, axis), False)


def unzigzag(x: Array, num_shards: int, axis: int = 1) -> Array:
    """Zigzag order -> natural order along `axis`; the inverse of `zigzag`."""
    return _permute_chunks(*_checked(x, num_shards, axis), True)


def positions(seq_len: int, num_shards: int, layout: str = "zigzag") -> Int[Array, " T"]:
    """Global position `[T]` int32 of every token in `layout` order (for RoPE).

    Args:
      seq_len: T, the global sequence length.
      num_shards: P, the size of the sequence mesh axis.
      layout: `"zigzag"` or `"contiguous"` (natural order: `arange(T)`).
    """
    _check_shards(num_shards)
    if not isinstance(seq_len, (int, np.integer)) or isinstance(seq_len, bool) or seq_len < 1:
        raise ValueError(f"{seq_len=} must be a positive Python int")
    if layout not in LAYOUTS:
        raise ValueError(f"{layout=} is not one of {LAYOUTS}")
    natural = jnp.arange(seq_len, dtype=jnp.int32)
    if layout == "contiguous":
        if seq_len % num_shards != 0:
            raise ValueError(
                f"{seq_len=} must be divisible by {num_shards=} for the contiguous layout"
            )
        return natural
    return zigzag(natural, num_shards, axis=0)
