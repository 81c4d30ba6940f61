"""Boundary checks shared by every public entry point: bad input is named in one line."""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
MAX_HEAD_DIM = 256
MAX_POSITION = 2**31 - 1  # the kernels' positions are int32


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The named sizes of one attention problem (the einsum letters used across jflash)."""

    batch: int
    q_len: int
    kv_len: int
    q_heads: int
    kv_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads


def is_int(value) -> bool:
    """A Python or numpy integer, not a bool (True is an int to Python, not a size)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_array(name: str, x) -> None:
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{name} must be a jax or numpy array; got {type(x).__name__}")


def check_qkv(q, k, v, *, empty: bool = False) -> Shapes:
    """Validates BSHD q `[B,T,N,H]`, k/v `[B,S,K,H]` and returns their sizes; with
    `empty`, a batch, length or head count of 0 is taken (`flash_attention`'s empty
    result), else refused."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_array(name, x)
        if x.ndim != 4:
            raise ValueError(
                f"{name} must be rank 4 [batch, seq, heads, head_dim]; got {name}.shape={x.shape}"
            )
        if symbolic := [d for d in x.shape[1:] if not isinstance(d, int)]:
            raise NotImplementedError(
                f"{name}.shape={x.shape} has the symbolic dimension {str(symbolic[0])!r}: the "
                "sequence length, heads and head dim must be concrete (the kernels' tiles and "
                "masks depend on them; a symbolic batch is taken), so jax.export with them fixed"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype=}, {k.dtype=}, {v.dtype=}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise NotImplementedError(f"{q.dtype=} is not supported; use bfloat16, float16 or float32")
    batch, q_len, q_heads, head_dim = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {k.shape=}, {v.shape=}")
    kb, kv_len, kv_heads, kd = k.shape
    if kb != batch:
        raise ValueError(f"batch sizes differ: {q.shape[0]=} vs {k.shape[0]=}")
    if kd != head_dim:
        raise ValueError(f"head dims differ: {q.shape[-1]=} vs {k.shape[-1]=}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise NotImplementedError(f"{head_dim=} is not supported; jflash handles 1..{MAX_HEAD_DIM}")
    if kv_heads == 0 and not (empty and q_heads == 0):
        raise ValueError(f"k and v have no heads: {k.shape=} (heads are axis 2)")
    if kv_heads and q_heads % kv_heads != 0:
        raise ValueError(f"{q_heads=} must be a multiple of {kv_heads=} (GQA/MQA)")
    if 0 in (batch, q_heads, q_len, kv_len) and not empty:
        raise ValueError(f"empty input: {batch=}, {q_heads=}, {q_len=}, {kv_len=} must all be >= 1")
    return Shapes(batch, q_len, kv_len, q_heads, kv_heads, head_dim)


def check_offsets(q_offset, k_offset, shapes: Shapes, causal: bool) -> tuple[int, int]:
    """`(q_offset, k_offset)` as Python ints: the global positions of the first query
    and key, static, >= 0, and every position of the block within int32 (past it the
    kernels' positions would wrap and the mask come out wrong); 0 unless `causal` (they
    only shift the causal mask: without it one would change nothing)."""
    checked = []
    for name, value, length in (
        ("q_offset", q_offset, shapes.q_len),
        ("k_offset", k_offset, shapes.kv_len),
    ):
        if not is_int(value):
            raise ValueError(f"{name}={value!r} must be a static Python int (a global position)")
        if value < 0:
            raise ValueError(f"{name}={value} must be >= 0 (a global position)")
        if value + length - 1 > MAX_POSITION:
            raise ValueError(
                f"{name}={value} puts the last of {length} positions past {MAX_POSITION} "
                "(positions are int32)"
            )
        checked.append(int(value))
    for name, value in zip(("q_offset", "k_offset"), checked, strict=True):
        if value and not causal:
            raise ValueError(
                f"{name}={value} with causal=False: offsets only shift the causal mask "
                "(non-causal attention sees every key); pass causal=True, or no offsets"
            )
    return checked[0], checked[1]


def entry_axes(entry) -> tuple[str, ...]:
    """The mesh axes of a PartitionSpec entry (None, an axis, or a tuple of axes)."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def names_mesh_axes(x) -> bool:
    """Whether `x`'s type names a mesh axis (sharded over Explicit axes)."""
    return any(entry is not None for entry in jax.typeof(x).sharding.spec)


def check_unsharded(where: str, q, k, v, segs) -> None:
    """Refuses inputs (q, k, v and the `check_segment_ids` pair `segs` or None) sharded
    over Explicit mesh axes (their type names the axes): the kernels take one device's
    arrays, and such an input would fail deep inside XLA or Pallas. Inside a full
    `shard_map`, and on Auto axes, nothing is."""
    named = [("q", q), ("k", k), ("v", v), *(("segment_ids", s) for s in segs or ())]
    for name, x in named:
        if names_mesh_axes(x):
            spec = jax.typeof(x).sharding.spec
            raise ValueError(
                f"{name} is sharded over Explicit mesh axes ({name}'s spec is {spec}): {where} "
                "takes one device's arrays; call it inside a jax.shard_map whose manual "
                "axes include those (its axis_names, for a partial shard_map)"
            )


def is_self_ids(segment_ids) -> bool:
    """Whether `segment_ids` came as one array for queries and keys (not None, not a
    pair): `flash_attention` and the ring relabel such ids by their own first
    positions, a pair by its key ids' (`key_first_positions`)."""
    return segment_ids is not None and not isinstance(segment_ids, (tuple, list))


def check_segment_ids(segment_ids, shapes: Shapes):
    """Normalises `segment_ids` to a `(q_segment_ids [B,T], kv_segment_ids [B,S])` pair.

    Accepts None, one int array `[B, T]` (self-attention, T == S) or a pair.
    """
    if segment_ids is None:
        return None
    if isinstance(segment_ids, (tuple, list)):
        if len(segment_ids) != 2:
            raise ValueError(
                "segment_ids must be an array [batch, T] or a (q_ids, kv_ids) pair; got a "
                f"{type(segment_ids).__name__} of {len(segment_ids)} (a list or tuple is "
                "read as the pair: pass the ids of one array as an array)"
            )
        q_seg, kv_seg = segment_ids
    else:
        if shapes.q_len != shapes.kv_len:
            raise ValueError(
                "one segment_ids array labels queries and keys alike, but "
                f"q_len={shapes.q_len} != kv_len={shapes.kv_len}: pass a "
                "(q_ids [batch, q_len], kv_ids [batch, kv_len]) pair"
            )
        q_seg = kv_seg = segment_ids
    check_array("q segment ids", q_seg)
    check_array("kv segment ids", kv_seg)
    want_q = (shapes.batch, shapes.q_len)
    want_kv = (shapes.batch, shapes.kv_len)
    if tuple(q_seg.shape) != want_q:
        raise ValueError(f"q segment ids have {q_seg.shape=}; expected [batch, q_len] = {want_q}")
    if tuple(kv_seg.shape) != want_kv:
        raise ValueError(
            f"kv segment ids have {kv_seg.shape=}; expected [batch, kv_len] = {want_kv}"
        )
    for name, s in (("q", q_seg), ("kv", kv_seg)):
        if not jnp.issubdtype(s.dtype, jnp.integer):
            raise ValueError(f"{name} segment ids must be integers; got {s.dtype=}")
    if max(q_seg.dtype.itemsize, kv_seg.dtype.itemsize) > 4:
        if jax.config.jax_enable_x64:
            # 64-bit ids (x64) stay 64-bit: int32 would merge ids that differ only
            # above bit 31. The XLA path compares them as they are; the Pallas kernels
            # take their ranks (`_dispatch.kernel_segs`).
            return q_seg.astype(jnp.int64), kv_seg.astype(jnp.int64)
        for name, s in (("q", q_seg), ("kv", kv_seg)):
            _check_int32_ids(name, s)
    return q_seg.astype(jnp.int32), kv_seg.astype(jnp.int32)


def _check_int32_ids(name: str, ids) -> None:
    """Without x64, 64-bit ids (a numpy array: jax has none then) become int32; ids
    past its range would wrap, and ids that differ only above bit 31 would meet."""
    if ids.dtype.itemsize <= 4 or isinstance(ids, jax.core.Tracer):
        return
    ids = np.asarray(ids)
    info = np.iinfo(np.int32)
    if ids.size and (ids.min() < info.min or ids.max() > info.max):
        raise ValueError(
            f"{name} segment ids ({ids.dtype}, {ids.min()}..{ids.max()}) do not fit int32 "
            "and jax_enable_x64 is off: they would wrap and unrelated documents meet; "
            "renumber them (np.unique(ids, return_inverse=True)) or enable x64"
        )


def as_bool(value, error: str) -> bool:
    """`value` as a Python bool; anything but a (numpy) bool raises `ValueError(error)`,
    not truth-tested (a string "no" would be True)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(error)
    return bool(value)


def check_causal(causal) -> bool:
    if isinstance(causal, (jax.Array, jax.core.Tracer)):
        raise ValueError(
            f"causal must be a Python bool, got a jax array ({jax.typeof(causal)}): the mask "
            "is static; pass True or False, or mark it static in jax.jit"
        )
    return as_bool(causal, f"{causal=} must be True or False")


def default_scale(head_dim: int, scale: float | None) -> float:
    if scale is None:
        return head_dim**-0.5
    if isinstance(scale, jax.core.Tracer):
        raise ValueError(
            f"{scale=} is traced; the scale is static (a kernel constant): pass a Python "
            "float, or mark it static in jax.jit"
        )
    array = isinstance(scale, (np.ndarray, jax.Array))
    if isinstance(scale, (bool, np.bool_)) or not (
        isinstance(scale, numbers.Real)
        or (array and scale.ndim == 0 and np.dtype(scale.dtype).kind in "fiu")
    ):
        raise ValueError(f"{scale=} must be a finite positive number")
    scale = float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{scale=} must be finite and positive")
    return scale
