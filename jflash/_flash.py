"""`jflash.flash_attention`: single-device exact attention with a custom VJP."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float

from jflash._block_sizes import BlockSizes
from jflash._dispatch import Kernel, attention_bwd, attention_fwd, delta_from, resolve
from jflash._mask import Mask
from jflash._segments import first_positions, key_first_positions
from jflash._validation import (
    as_bool,
    check_causal,
    check_offsets,
    check_qkv,
    check_segment_ids,
    default_scale,
    entry_axes,
    is_self_ids,
    names_mesh_axes,
)
from jflash._vma import check_interpretable, match, warn_unshared


@dataclasses.dataclass(frozen=True)
class _Static:
    mask: Mask
    scale: float
    kernel: Kernel


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, segs, static: _Static):
    return attention_fwd(
        q, k, v, segs, mask=static.mask, scale=static.scale, out_dtype=q.dtype, kernel=static.kernel
    )


def _flash_fwd(q, k, v, segs, static: _Static):
    o, lse = _flash(q, k, v, segs, static)
    # Named residuals: a remat policy that saves "attention_out"/"attention_lse" keeps
    # them, so the backward never re-runs the attention forward kernel.
    o, lse = checkpoint_name(o, "attention_out"), checkpoint_name(lse, "attention_lse")
    return (o, lse), (q, k, v, segs, o, lse)


def _flash_bwd(static: _Static, res, cotangents):
    q, k, v, segs, o, lse = res
    do, dlse = cotangents
    delta = delta_from(o, do, dlse)
    dq, dk, dv = attention_bwd(
        q,
        k,
        v,
        do.astype(q.dtype),
        lse,
        delta,
        segs,
        mask=static.mask,
        scale=static.scale,
        grad_dtype=q.dtype,
        kernel=static.kernel,
    )
    return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B S K H"],
    v: Float[Array, "B S K H"],
    *,
    causal: bool,
    scale: float | None = None,
    segment_ids=None,
    return_lse: bool = False,
    q_offset: int = 0,
    k_offset: int = 0,
    block_sizes: BlockSizes | None = None,
    implementation: str | None = None,
    interpret: bool | None = None,
    deterministic: bool | None = None,
):
    """Exact (Flash) attention on one device, differentiable. Inputs split over
    Explicit mesh axes along the batch and the heads run on each device's part.

    Args:
      q: queries `[B, T, N, H]`; k, v: keys/values `[B, S, K, H]` with `N % K == 0`
        (GQA/MQA: query head `n` reads KV head `n // (N // K)`; pass K/V unrepeated).
      causal: query `q_offset + i` sees key `k_offset + j` only when `>=`. Required
        (`jax.nn.dot_product_attention` defaults to non-causal; a default either way
        would surprise half the callers).
      scale: logit scale, default `H ** -0.5`; finite and above 0.
      segment_ids: `[B, T]` int ids (T == S) or a `(q_ids [B,T], kv_ids [B,S])` pair;
        attention stays inside equal ids (packed sequences). Fastest where each row's
        ids are non-decreasing along it. One array whose documents are each one run of
        tokens is relabelled so (by each id's first position; padding labelled 0 at a
        row's end, labels in any order, labels spread wider than the row as dataset
        indices or hashes are); a pair likewise, by each id's first position among the
        key ids (a query id no key holds becomes one no key has). Others (an id in two
        places) compare ids on every tile at a document boundary and skip only tiles
        whose id ranges are apart (documents labelled out of order ran 8-17x slower so,
        before the relabelling: BENCHMARKS.md).
      return_lse: also return the natural-log log-sum-exp `[B, N, T]` f32 (rows that see
        no key: `-inf`, output 0). Its cotangent flows through the VJP.
      q_offset, k_offset: static global positions of the first query / key (Python
        ints >= 0, every position of the block below 2**31), so a caller can compute
        one block of a larger causal problem (ring attention). They only shift the
        causal mask: with `causal=False` an offset other than 0 is refused.
      block_sizes: tile shapes (`jflash.BlockSizes`); default from
        `default_block_sizes`.
      implementation: `"pallas_triton" | "pallas_mosaic" | "xla" | None` (None: the
        fastest for this device; see `jflash.describe()`).
      interpret: run the Pallas kernel in interpret mode (default: on CPU).
      deterministic: bitwise reproducible gradients. False lets the Mosaic (Hopper)
        backward add dQ contributions with f32 atomics in one fused kernel (faster;
        the low bits vary from run to run); True runs its two-kernel backward. The
        Triton and XLA paths are always deterministic. None (default): True exactly
        when `XLA_FLAGS` has `--xla_gpu_deterministic_ops`, XLA's own switch.

    Returns:
      `out [B, T, N, H]` in q's dtype, or `(out, lse)` with `return_lse=True`.
    """
    shapes = check_qkv(q, k, v, empty=True)
    return_lse = as_bool(return_lse, f"{return_lse=} must be True or False")
    segs = check_segment_ids(segment_ids, shapes)
    empty = 0 in (shapes.batch, shapes.q_len, shapes.q_heads, shapes.kv_len)
    if not empty and any(names_mesh_axes(x) for x in (q, k, v, *(segs or ()))):
        # Split over Explicit mesh axes (batch, heads): each device its own part.
        call = functools.partial(
            flash_attention,
            causal=causal,
            scale=scale,
            q_offset=q_offset,
            k_offset=k_offset,
            block_sizes=block_sizes,
            implementation=implementation,
            interpret=interpret,
            deterministic=deterministic,
        )
        o, lse = _per_device(call, q, k, v, segment_ids, shapes)
        return (o, lse) if return_lse else o
    if empty:
        segs = None
    elif is_self_ids(segment_ids):
        # One array for queries and keys: documents labelled in any order (padding
        # labelled 0 at a row's end too) take the sorted ids' kernels.
        segs = (first_positions(segs[0]),) * 2
    elif segs is not None:  # a pair: relabelled by the key ids, the same way
        segs = key_first_positions(*segs)
    causal = check_causal(causal)
    static = _Static(
        mask=Mask(causal, *check_offsets(q_offset, k_offset, shapes, causal)),
        scale=default_scale(shapes.head_dim, scale),
        kernel=resolve(
            implementation,
            interpret,
            block_sizes,
            q_len=max(shapes.q_len, 1),  # an empty call's other arguments checked alike
            kv_len=max(shapes.kv_len, 1),
            head_dim=shapes.head_dim,
            dtype=q.dtype,
            deterministic=deterministic,
            group=shapes.group if shapes.kv_heads else None,
        ),
    )
    check_interpretable(static.kernel.name, static.kernel.interpret)
    if empty:
        # No queries: an empty output. No keys: every row sees none (0, LSE -inf).
        # Neither depends on the inputs, so their gradients are 0.
        o = jnp.zeros(q.shape, q.dtype)
        lse = jnp.full((shapes.batch, shapes.q_heads, shapes.q_len), -jnp.inf, jnp.float32)
        return (o, lse) if return_lse else o
    warn_unshared("flash_attention", q, k, v)
    q, k, v, *_ = match(q, k, v, *(segs or ()))  # `match`'s docstring says why
    o, lse = _flash(q, k, v, segs, static)
    return (o, lse) if return_lse else o


def _spec(x) -> tuple:
    """`x`'s typed sharding as one entry per dimension (None: not split)."""
    spec = tuple(jax.typeof(x).sharding.spec)
    return spec + (None,) * (x.ndim - len(spec))


def _per_device(call, q, k, v, segment_ids, shapes):
    """`call(q, k, v, segment_ids=..., return_lse=True)` on each device's part of inputs
    split over Explicit mesh axes along the batch and the heads (q's split; k, v and
    the ids are resharded to match it), in a `jax.shard_map`: `(out, lse)` split alike.
    A split sequence or head dim is refused by name (a sequence over a mesh axis is
    `ring_attention`'s), as are heads that k's do not divide into equal parts."""
    named = [("q", q), ("k", k), ("v", v)]
    if segment_ids is not None:
        ids = segment_ids if isinstance(segment_ids, (tuple, list)) else (segment_ids,)
        named += [("segment_ids", s) for s in ids]
    mesh = next(jax.typeof(x).sharding.mesh for _, x in named if names_mesh_axes(x))
    for name, x in named:
        spec = _spec(x)
        if spec[1] is not None:
            raise ValueError(
                f"{name} is split along its sequence over the mesh axis {spec[1]!r} ({name}'s "
                f"spec is {jax.typeof(x).sharding.spec}): flash_attention takes whole "
                "sequences; jflash.ring_attention splits one over a mesh axis"
            )
        if x.ndim == 4 and spec[3] is not None:
            raise ValueError(
                f"{name} is split along its head dim over the mesh axis {spec[3]!r} "
                f"({name}'s spec is {jax.typeof(x).sharding.spec}): attention needs each "
                "head whole; split the batch or the heads"
            )
    batch, heads = _spec(q)[0], _spec(q)[2]
    parts = math.prod(mesh.shape[a] for a in entry_axes(heads))
    if shapes.kv_heads % parts:
        raise ValueError(
            f"q's {shapes.q_heads} heads are split over {heads!r} into {parts} parts, which "
            f"k's and v's {shapes.kv_heads} heads do not divide (each part's query heads "
            "read their own KV heads): split fewer ways, or split the batch"
        )
    qkv_spec, ids_spec = P(batch, None, heads, None), P(batch, None)

    # An eager call's concrete mesh (a concrete array placed on it), if any.
    concrete = next(
        (
            x.sharding.mesh
            for _, x in named
            if isinstance(x, jax.Array)
            and not isinstance(x, jax.core.Tracer)
            and isinstance(getattr(x.sharding, "mesh", None), Mesh)
            and names_mesh_axes(x)
        ),
        None,
    )

    def placed(x, spec):
        """`x` split as `spec` on the mesh: in an eager call, moved there (`jax.device_put`:
        numpy ids, or k and v on one device, which `jax.reshard` refuses outside
        `jax.set_mesh`); traced, resharded."""
        if concrete is not None and not isinstance(x, jax.core.Tracer):
            return jax.device_put(x, NamedSharding(concrete, spec))
        return jax.reshard(x, NamedSharding(mesh, spec))

    q, k, v = (placed(x, qkv_spec) for x in (q, k, v))
    if segment_ids is None:
        body = lambda q, k, v: call(q, k, v, return_lse=True)  # noqa: E731
        args, specs = (q, k, v), (qkv_spec,) * 3
    else:
        ids = jax.tree.map(lambda s: placed(s, ids_spec), segment_ids)
        body = lambda q, k, v, ids: call(q, k, v, segment_ids=ids, return_lse=True)  # noqa: E731
        args = (q, k, v, ids)
        specs = ((qkv_spec,) * 3) + (jax.tree.map(lambda _: ids_spec, segment_ids),)
    # Over the axes that split q only: inside a caller's partial shard_map (or a
    # vmap over an axis split elsewhere) the others are not this call's.
    used = {*entry_axes(batch), *entry_axes(heads)}
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=specs,
        out_specs=(qkv_spec, P(batch, heads, None)),
        axis_names=used,
    )(*args)
