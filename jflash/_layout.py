"""Token orders of a sequence sharded over P devices.

`contiguous`: device r holds tokens `[r*T/P, (r+1)*T/P)`. Causal work is unbalanced:
the last device attends to everything, the first only to itself.

`zigzag`: the sequence is cut into 2P chunks and device r holds chunks r and 2P-1-r
(one early, one late), so every device does the same causal work (the load balancing
of LightSeq / DistFlashAttn, arXiv 2310.03294 §3.2, and ring-flash-attention). With
packed documents the balance is lost: the work of a rank depends on where documents
fall (1.2-2x the mean on long-tailed document lengths at P = 2-8).

`striped`: device r holds tokens r, r+P, r+2P, ... (Striped Attention, arXiv
2311.09431). Every document, wherever it falls, is spread evenly over the devices, so
the causal work stays balanced with packed documents too (within 0.1% of the mean on
the same distributions), and every device's tokens stay in order.

A model permutes its tokens into the chosen order once at the input (positions,
labels and segment ids along, `to_layout`); every layer then works in that order.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec
from jaxtyping import Array, Int

from jflash._validation import is_int

LAYOUTS = ("zigzag", "contiguous", "striped")


def _check_shards(num_shards: int) -> None:
    if not is_int(num_shards):
        raise ValueError(f"{num_shards=} must be a Python int")
    if num_shards < 1:
        raise ValueError(f"{num_shards=} must be >= 1")


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"{layout=} is not one of {LAYOUTS}")


def check_zigzag_len(seq_len: int, num_shards: int, local_len: int | None = None) -> None:
    """Raises unless `seq_len` splits into `2 * num_shards` equal chunks. `local_len`:
    the length the caller holds per device (inside a `shard_map`), which the message
    names instead of the whole sequence's."""
    _check_shards(num_shards)
    if seq_len % (2 * num_shards) == 0:
        return
    if local_len is None:
        raise ValueError(f"{seq_len=} must be divisible by {2 * num_shards=} for the zigzag layout")
    raise ValueError(
        f"layout='zigzag' holds two equal chunks of the sequence per shard: the local "
        f"length q.shape[1]={local_len} ({seq_len} tokens over {num_shards} shards) is "
        "odd; the whole sequence must be divisible by 2 * shards"
    )


def check_layout_len(
    seq_len: int, num_shards: int, layout: str, local_len: int | None = None
) -> None:
    """Raises unless a `seq_len` sequence splits into `layout` over `num_shards`
    (`local_len`: as `check_zigzag_len`). One shard holds the sequence in natural order
    whatever the layout: any length."""
    check_layout(layout)
    _check_shards(num_shards)
    if num_shards == 1:
        return
    if layout == "zigzag":
        check_zigzag_len(seq_len, num_shards, local_len)
    elif seq_len % num_shards != 0:
        raise ValueError(f"{seq_len=} must be divisible by {num_shards=} for the {layout} layout")


def zigzag_chunk_order(num_shards: int) -> np.ndarray:
    """Natural chunk index at each zigzag slot: `[0, 2P-1, 1, 2P-2, ..., P-1, P]`."""
    _check_shards(num_shards)
    ranks = np.arange(num_shards)
    return np.stack([ranks, 2 * num_shards - 1 - ranks], axis=1).reshape(-1)


def _chunk_order(layout: str, num_shards: int, seq_len: int) -> np.ndarray:
    """The natural index of the chunk at each slot of `layout` (chunks of equal size:
    2P for zigzag, T single tokens for striped)."""
    if layout == "zigzag":
        return zigzag_chunk_order(num_shards)
    if layout == "striped":
        return np.arange(seq_len).reshape(seq_len // num_shards, num_shards).T.reshape(-1)
    return np.arange(num_shards)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _permute(x, layout: str, num_shards: int, axis: int, inverse: bool):
    """Reorders `axis` into `layout` order, or back when `inverse`."""
    seq_len = x.shape[axis]
    order = _chunk_order(layout, num_shards, seq_len)
    order = np.argsort(order) if inverse else order
    n = len(order)
    shape = (*x.shape[:axis], n, seq_len // n, *x.shape[axis + 1 :])
    typed = jax.typeof(x).sharding
    if AxisType.Explicit not in typed.mesh.axis_types:
        index = (slice(None),) * axis + (jnp.asarray(order),)
        return x.reshape(shape).at[index].get().reshape(x.shape)
    # Explicit mesh axes: every reshape and gather along a sharded dim spells out its
    # output sharding. The chunk dim keeps the sequence's sharding where the chunks
    # split evenly over it; otherwise the sequence is gathered first.
    spec = [*typed.spec, *([None] * (x.ndim - len(typed.spec)))]
    entry = spec[axis]
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    if n % math.prod(typed.mesh.shape[a] for a in names) != 0:
        spec[axis] = entry = None
        x = jax.reshard(x, NamedSharding(typed.mesh, PartitionSpec(*spec)))
    chunked = NamedSharding(typed.mesh, PartitionSpec(*spec[:axis], entry, None, *spec[axis + 1 :]))
    chunks = jax.lax.reshape(x, shape, out_sharding=chunked)
    index = (slice(None),) * axis + (jnp.asarray(order),)
    out = chunks.at[index].get(out_sharding=chunked)
    out = jax.lax.reshape(out, x.shape, out_sharding=jax.typeof(x).sharding)
    return jax.reshard(out, typed)  # the input's type: a permutation moves only data


def _permute_fwd(x, layout, num_shards, axis, inverse):
    return _permute(x, layout, num_shards, axis, inverse), None


def _permute_bwd(layout, num_shards, axis, inverse, _, ct):
    # A permutation's transpose is its inverse: a gather again, not the scatter-add
    # autodiff would emit (which jax 0.11.2 cannot place under Explicit axes).
    return (_permute(ct, layout, num_shards, axis, not inverse),)


_permute.defvjp(_permute_fwd, _permute_bwd)


def _checked(x, num_shards: int, axis: int, layout: str):
    x = jnp.asarray(x)
    if not is_int(axis):
        raise ValueError(f"{axis=} must be a Python int (the sequence axis)")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"{axis=} is out of range for an array with {x.ndim=}")
    axis = axis % x.ndim
    check_layout_len(x.shape[axis], num_shards, layout)
    return x, layout, int(num_shards), axis


def to_layout(x: Array, num_shards: int, layout: str, axis: int = 1) -> Array:
    """Natural order -> `layout` order along `axis` (e.g. `[B, T, N, H]` with axis=1).

    Args:
      x: any array (tokens, positions, labels, segment ids, activations).
      num_shards: P, the size of the sequence mesh axis.
      layout: `"zigzag"` (`x.shape[axis]` divisible by 2P), `"striped"` or
        `"contiguous"` (divisible by P; natural order, returned as is). With P = 1
        every layout is natural order, of any length.
      axis: the sequence axis.

    Returns:
      `x` reordered so that shard r (a contiguous 1/P slice of the result) holds the
      tokens `layout` gives device r.

    Differentiable in reverse mode (custom VJP: the cotangent is reordered back, no
    scatter); forward mode (`jax.jvp`, `jax.jacfwd`) is not defined for the zigzag and
    striped orders, as for `flash_attention`. The same holds for `from_layout`,
    `zigzag` and `unzigzag`.
    """
    x, layout, num_shards, axis = _checked(x, num_shards, axis, layout)
    if layout == "contiguous" or num_shards == 1:
        return x
    return _permute(x, layout, num_shards, axis, False)


def from_layout(x: Array, num_shards: int, layout: str, axis: int = 1) -> Array:
    """`layout` order -> natural order along `axis`; the inverse of `to_layout`."""
    x, layout, num_shards, axis = _checked(x, num_shards, axis, layout)
    if layout == "contiguous" or num_shards == 1:
        return x
    return _permute(x, layout, num_shards, axis, True)


def zigzag(x: Array, num_shards: int, axis: int = 1) -> Array:
    """Natural order -> zigzag order along `axis`: `to_layout(x, num_shards, "zigzag")`.

    Shard r (a contiguous 1/P slice of the result) holds natural chunks r and 2P-1-r
    of 2P; `x.shape[axis]` must be divisible by `2 * num_shards` (any length for one
    shard: natural order, returned as is).
    """
    return to_layout(x, num_shards, "zigzag", axis)


def unzigzag(x: Array, num_shards: int, axis: int = 1) -> Array:
    """Zigzag order -> natural order along `axis`; the inverse of `zigzag`."""
    return from_layout(x, num_shards, "zigzag", axis)


def positions(seq_len: int, num_shards: int, layout: str = "zigzag") -> Int[Array, " T"]:
    """Global position `[T]` int32 of every token in `layout` order (for RoPE).

    Args:
      seq_len: T, the global sequence length.
      num_shards: P, the size of the sequence mesh axis.
      layout: `"zigzag"`, `"striped"` or `"contiguous"` (natural order: `arange(T)`).
    """
    _check_shards(num_shards)
    if not is_int(seq_len) or seq_len < 1:
        raise ValueError(f"{seq_len=} must be a positive Python int")
    return to_layout(jnp.arange(seq_len, dtype=jnp.int32), num_shards, layout, axis=0)
