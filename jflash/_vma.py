"""Manual-axis types inside a user's `jax.shard_map` (jax's `check_vma=True`).

Inside `shard_map`, every value records which manual mesh axes it varies over. A value
built fresh (a loop carry, a kernel's output) varies over none, and jax refuses to mix it
with one that varies. These helpers give values the types their inputs have, and run
each Pallas kernel per device (`per_device`); outside `shard_map` they change nothing.
"""

from __future__ import annotations

import os
import warnings

import jax
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

# jflash's own files: a warning's `skip_file_prefixes`, so that it names the caller's line.
JFLASH_FILES = (os.path.dirname(os.path.abspath(__file__)) + os.sep,)


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


class SharedKVWarning(UserWarning):
    """Inside a `jax.shard_map`, q varies over mesh axes that k or v do not: k and v are
    taken as the same on every device along those axes. Right for a K/V shared across a
    batch split there; a wrong answer where the axes split q's heads. Where the sharing
    is meant: `warnings.filterwarnings("ignore", category=jflash.SharedKVWarning)`."""


def warn_unshared(where: str, q, k, v) -> None:
    """Warns, at the caller's line, where q varies over manual axes that k or v do not.
    That is right for a K/V shared over an axis that splits q's batch (`match` sums
    its gradient there), and a wrong answer where the axis splits q's heads: each
    device's query heads then read the first KV heads. The types do not say which
    dimension an axis splits."""
    axes = sorted(varying_axes(q) - (varying_axes(k) & varying_axes(v)))
    if axes:
        warnings.warn(
            f"{where}: q varies over the mesh axes {axes} and k or v do not, so k and v "
            "are taken as the same on every device along them. Right for a K/V shared "
            "across a batch split there; if q's heads are split over them, split k's and "
            "v's heads there too (as they are, each device's query heads read the first "
            "KV heads: a wrong answer)",
            SharedKVWarning,
            skip_file_prefixes=JFLASH_FILES,  # the caller's line, at any depth
        )


def match(*xs):
    """`xs`, each marked as varying over the union of their axes: then every value
    built from them (outputs, loop carries) can take the type of the first. The public
    functions match q, k, v (and the segment ids) before their custom VJPs: a K/V
    shared over "data" while q is split over it then enters the VJP varying like q, and
    jax's transpose of that mark sums its gradient over "data" (jax refuses a VJP whose
    gradient varies where its input does not)."""
    axes = varying_axes(*xs)
    return tuple(vary(x, axes) for x in xs)


# A no-op whose type says "the same on every device": what `per_device` hands a kernel.
# No gradient passes through it (no differentiation rule): it lives inside the kernels'
# custom VJPs.
_unvarying_p = Primitive("jflash_unvarying")
_unvarying_p.def_impl(lambda x: x)
_unvarying_p.def_abstract_eval(lambda a: a.update(manual_axis_type=jax.sharding.ManualAxisType()))
mlir.register_lowering(_unvarying_p, lambda ctx, x: [x])
batching.primitive_batchers[_unvarying_p] = lambda args, dims: (_unvarying_p.bind(*args), dims[0])


def unvarying(x):
    """`x` typed as not varying over any manual axis (a no-op in value; `x` itself
    outside `shard_map`, or for a Ref, which is never varying here)."""
    if x is None or not isinstance(x, jax.Array) or not varying_axes(x):
        return x
    return _unvarying_p.bind(x)


def struct(shape, dtype) -> jax.ShapeDtypeStruct:
    """An output shape for a Pallas call run by `per_device`: varying over no manual
    axis (`pallas_call` under `check_vma` takes no shape without a type)."""
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.sharding.ManualAxisType())


def per_device(kernel):
    """`kernel` (a Pallas call, its output shapes `struct`s) called with every
    operand typed as unvarying (`unvarying`), its outputs marked varying over the axes
    its operands varied over: each device's kernel reads and writes its own buffers.
    Inside `shard_map`, Mosaic GPU's `plgpu.warp_map` refuses Refs that vary over a
    manual axis (`plgpu.kernel` keeps the operands' types on its Refs, jax 0.11.2), and
    the Pallas interpreters mix varying and unvarying values inside a kernel body.
    Called inside the kernels' custom VJPs: jax's transpose of the outputs' mark, were
    it made at the `shard_map`'s boundary instead, would sum their cotangents over the
    devices (wrong gradients)."""

    def call(*args):
        axes = varying_axes(*(x for x in args if isinstance(x, jax.Array)))
        out = kernel(*(unvarying(x) for x in args))
        return jax.tree.map(lambda x: vary(x, axes), out)

    return call


def mosaic_interpret_error(num_devices: int) -> NotImplementedError:
    return NotImplementedError(
        f"implementation='pallas_mosaic' in interpret mode cannot run on {num_devices} "
        "devices: jax 0.11.2's GPU interpreter keeps one barrier table for every device "
        "of a shard_map and fails its end-of-kernel check ('Barrier remains allocated'). "
        "It runs on a one-device mesh, and compiled on Hopper GPUs; in interpret mode "
        "use implementation='pallas_triton' or 'xla'"
    )


def check_interpretable(implementation: str, interpret: bool) -> None:
    """Refuses the interpreted Mosaic kernels where jax 0.11.2's GPU interpreter fails
    deep inside; compiled kernels run there. Inside a `shard_map` over 2+ devices it
    fails, whatever the kernel's own axes (a data-parallel `shard_map` too), and only
    after the call has returned (its check runs in a callback)."""
    mesh = jax.sharding.get_abstract_mesh()
    if interpret and implementation == "pallas_mosaic" and mesh.manual_axes and mesh.size > 1:
        raise mosaic_interpret_error(mesh.size)
