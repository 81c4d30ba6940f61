"""Ulysses: sequence parallelism by all-to-all over heads, and its hybrid with the ring.

ulysses (DeepSpeed-Ulysses, arXiv 2309.14509): each of P devices holds T/P tokens of
every head. One all-to-all turns that into all T tokens of N/P query heads (and of the
KV heads those read); the single-device kernel runs on the whole sequence (causal,
segment ids and GQA exactly as on one device, so no load balancing is needed); one
all-to-all turns the output back. Gradients flow through the same collectives (an
all-to-all's transpose is the reverse all-to-all) and the kernel's own VJP. In the
forward a device sends its shard of Q, K, V and the output once, (2N + 2K) T/P H values
whatever P is, where a ring sends its K/V shard P - 1 times.

KV heads: each device needs the KV heads its query heads read. Where P does not divide
K (GQA with few KV heads, MQA), every KV head is repeated r = P / gcd(K, P) times first:
the fewest copies that split evenly (MQA at P = 8 gives each device one copy, it does
not send eight). The copies' gradients are summed in f32. N must be divisible by P.

hybrid (USP, arXiv 2405.07719; TransformerEngine's a2a+p2p): Ulysses over an inner mesh
axis (fast links, within a node) and the ring over an outer one (few slow hops). The
all-to-all gathers each ring shard whole for N/P_a heads, and the ring runs over the
ring axis on those, with its layout over the P_r ring shards.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from jflash._flash import flash_attention
from jflash._layout import from_layout, to_layout


def kv_repeats(kv_heads: int, degree: int) -> int:
    """How many copies of each KV head an all-to-all over `degree` devices needs."""
    return degree // math.gcd(kv_heads, degree)


def kernel_group(group: int, kv_heads: int, degree: int) -> int:
    """Query heads per KV head of each device's kernels after the all-to-all over
    `degree` devices (a repeated KV head serves fewer query heads; degree 1: `group`)."""
    return group // kv_repeats(kv_heads, degree)


def check_heads(
    q_heads: int, degree: int, axis, head_axes: tuple = (), head_parts: int = 1
) -> None:
    """Refuses an all-to-all degree that does not divide each device's query heads: q's
    `q_heads`, split first into `head_parts` over `head_axes` where those split them."""
    local = q_heads // head_parts
    if head_parts > 1 and local % degree:
        raise ValueError(
            f"q's {q_heads} heads over head_axes={head_axes} ({head_parts} parts) leave "
            f"{local} per device, which the all-to-all degree {degree} (the size of "
            f"{axis!r}) must divide"
        )
    if q_heads % degree != 0:
        raise ValueError(
            f"{q_heads=} must be divisible by the all-to-all degree {degree} (the size of "
            f"{axis!r}): each device takes q_heads / degree heads"
        )


def _to_heads(x, axis):
    """`[B, T', N, H]` sequence-sharded -> `[B, T' P, N / P, H]` head-sharded."""
    return lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)


def _to_sequence(o, lse, axis):
    """The inverse for the outputs: o `[B, T, N/P, H]`, lse `[B, N/P, T]` ->
    `[B, T/P, N, H]`, `[B, N, T/P]`."""
    o = lax.all_to_all(o, axis, split_axis=1, concat_axis=2, tiled=True)
    lse = lax.all_to_all(lse, axis, split_axis=2, concat_axis=1, tiled=True)
    return o, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _repeat_heads(x, r: int):
    """`x [B, T, K, H]` with every head repeated `r` times, `[B, T, K r, H]`."""
    return jnp.repeat(x, r, axis=2)


def _repeat_heads_fwd(x, r: int):
    return _repeat_heads(x, r), None


def _repeat_heads_bwd(r: int, _, ct):
    # The copies' gradients summed in f32 and rounded once: summed in bf16, as
    # `jnp.repeat`'s transpose does, each of the r - 1 additions rounds again (MQA
    # over 8 devices: dK and dV 1.5-3x further from an f32 oracle than one device's).
    b, t, heads, h = ct.shape
    summed = ct.reshape(b, t, heads // r, r, h).astype(jnp.float32).sum(axis=3)
    return (summed.astype(ct.dtype),)


_repeat_heads.defvjp(_repeat_heads_fwd, _repeat_heads_bwd)


def gather_sequence(q, k, v, segs, axis, degree: int):
    """Whole sequence (this `axis` group's), N/P query heads and their KV heads."""
    r = kv_repeats(k.shape[2], degree)
    if r > 1:
        k, v = _repeat_heads(k, r), _repeat_heads(v, r)
    q, k, v = (_to_heads(x, axis) for x in (q, k, v))
    if segs is not None:
        segs = tuple(lax.all_gather(s, axis, axis=1, tiled=True) for s in segs)
    return q, k, v, segs


def ulysses_shard(
    q, k, v, segs, *, axis, degree: int, layout: str, self_ids: bool = False, **attention
):
    """Per-shard Ulysses: `(o [B,T',N,H], lse [B,N,T'] f32)`. The gathered sequence is
    in `layout` order over `degree` shards; the kernel sees it in natural order.
    `self_ids`: the `(q, kv)` ids came as one array, and go to `flash_attention` as one
    (which relabels it). `attention`: `flash_attention`'s keywords (causal, scale,
    kernel choice)."""
    q, k, v, segs = gather_sequence(q, k, v, segs, axis, degree)
    reorder = layout != "contiguous" and degree > 1
    if reorder:
        q, k, v = (from_layout(x, degree, layout) for x in (q, k, v))
        segs = None if segs is None else tuple(from_layout(s, degree, layout) for s in segs)
    if self_ids:
        segs = segs[0]
    o, lse = flash_attention(q, k, v, segment_ids=segs, return_lse=True, **attention)
    if reorder:
        o, lse = to_layout(o, degree, layout), to_layout(lse, degree, layout, axis=2)
    return _to_sequence(o, lse, axis)


def hybrid_shard(q, k, v, segs, *, a2a_axis, degree: int, ring):
    """Per-shard hybrid: the all-to-all over `a2a_axis` (`degree` devices), then
    `ring(q, k, v, segs)` over the ring axis on each whole ring shard."""
    q, k, v, segs = gather_sequence(q, k, v, segs, a2a_axis, degree)
    o, lse = ring(q, k, v, segs)
    return _to_sequence(o, lse, a2a_axis)
