"""Manual-axis types inside a user's `jax.shard_map` (jax's `check_vma=True`).

Inside `shard_map`, every value records which manual mesh axes it varies over. A kernel
whose output shapes or loop carries are built fresh carries no such axes, and jax then
refuses it. These helpers give kernels the types their inputs have; outside
`shard_map` they change nothing.
"""

from __future__ import annotations

import jax
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir


def varying_axes(*xs) -> frozenset:
    """The manual axes any of `xs` varies over (empty outside `shard_map`)."""
    axes = frozenset()
    for x in xs:
        if x is not None:
            axes |= jax.typeof(x).manual_axis_type.varying
    return axes


def vary(x, axes: frozenset):
    """`x` marked as varying over `axes` (a no-op for axes it already varies over)."""
    if x is None:
        return None
    missing = tuple(sorted(axes - jax.typeof(x).manual_axis_type.varying))
    return lax.pcast(x, missing, to="varying") if missing else x


def match(*xs):
    """`xs`, each marked as varying over the union of their axes: then every value
    built from them (outputs, loop carries) can take the type of the first. The public
    functions match q, k, v (and the segment ids) before their custom VJPs: a K/V
    shared over "data" while q is split over it then enters the VJP varying like q, and
    jax's transpose of that mark sums its gradient over "data" (jax refuses a VJP whose
    gradient varies where its input does not)."""
    axes = varying_axes(*xs)
    return tuple(vary(x, axes) for x in xs)


# A no-op whose type says "the same on every device". A Mosaic kernel's operands pass
# through it inside `shard_map`: each device's kernel reads only its own buffers, and
# `plgpu.warp_map` (an `mpmd_map` nested in the kernel, jax 0.11.2) refuses Refs that
# vary over a manual axis, where `pallas_call` strips those types from its Refs itself.
# `_mosaic_common.launch` marks the kernel's outputs varying again, inside the custom
# VJP that holds it; no gradient passes through here (no differentiation rule).
_unvarying_p = Primitive("jflash_unvarying")
_unvarying_p.def_impl(lambda x: x)
_unvarying_p.def_abstract_eval(lambda a: a.update(manual_axis_type=type(a.manual_axis_type)()))
mlir.register_lowering(_unvarying_p, lambda ctx, x: [x])
batching.primitive_batchers[_unvarying_p] = lambda args, dims: (_unvarying_p.bind(*args), dims[0])


def unvarying(x):
    """`x` typed as not varying over any manual axis (a no-op in value; `x` itself
    outside `shard_map`, or for a Ref, which is never varying here)."""
    if x is None or not isinstance(x, jax.Array) or not varying_axes(x):
        return x
    return _unvarying_p.bind(x)


def struct(shape, dtype, like) -> jax.ShapeDtypeStruct:
    """An output shape for a Pallas call that varies like the array `like`."""
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(like).manual_axis_type)


def mosaic_interpret_error(num_devices: int) -> NotImplementedError:
    return NotImplementedError(
        f"implementation='pallas_mosaic' in interpret mode cannot run on {num_devices} "
        "devices: jax 0.11.2's GPU interpreter keeps one barrier table for every device "
        "of a shard_map and fails its end-of-kernel check ('Barrier remains allocated'). "
        "It runs on a one-device mesh, and compiled on Hopper GPUs; in interpret mode "
        "use implementation='pallas_triton' or 'xla'"
    )


def check_interpretable(implementation: str, interpret: bool, *xs) -> None:
    """Refuses an interpreted Pallas kernel where jax 0.11.2's interpreters fail deep
    inside; compiled kernels run there. Inside a `shard_map` over 2+ devices the GPU
    (Mosaic) interpreter fails, whatever the kernel's own axes (a data-parallel
    `shard_map` too), and only after the call has returned (its check runs in a
    callback). Inside `shard_map(check_vma=True)` no Pallas interpreter carries
    manual-axis types through a kernel body, and each fails with a type error."""
    mesh = jax.sharding.get_abstract_mesh()
    if interpret and implementation == "pallas_mosaic" and mesh.manual_axes and mesh.size > 1:
        raise mosaic_interpret_error(mesh.size)
    if interpret and implementation != "xla" and varying_axes(*xs):
        raise NotImplementedError(
            f"implementation={implementation!r} in interpret mode cannot run inside "
            "jax.shard_map with check_vma=True (jax 0.11.2's Pallas interpreter loses the "
            "manual-axis types): pass check_vma=False to that shard_map, or use "
            "implementation='xla'; compiled on a GPU it runs with check_vma=True"
        )
