"""Which mesh the model code runs under, where that changes what it must spell out."""

from __future__ import annotations

import jax


def spec_axes(part) -> tuple[str, ...]:
    """The mesh axis names of one PartitionSpec entry (None, a name, or a tuple)."""
    return () if part is None else (part,) if isinstance(part, str) else tuple(part)


def explicit_mesh():
    """The current abstract mesh if it has Explicit axes (output shardings that jax
    cannot infer must then be given), else None."""
    mesh = jax.sharding.get_abstract_mesh()
    explicit = not mesh.empty and jax.sharding.AxisType.Explicit in mesh.axis_types
    return mesh if explicit else None
