"""Which mesh the model code runs under, where that changes what it must spell out."""

from __future__ import annotations

import jax


def explicit_mesh():
    """The current abstract mesh if it has Explicit axes (output shardings that jax
    cannot infer must then be given), else None."""
    mesh = jax.sharding.get_abstract_mesh()
    explicit = not mesh.empty and jax.sharding.AxisType.Explicit in mesh.axis_types
    return mesh if explicit else None
