"""The device mesh `("data", "fsdp", "seq", "seq_a2a")` and how arrays are laid out on it.

FSDP (HF Trainer's `--fsdp full_shard`): every parameter, its gradient and its optimizer
state are sharded over `fsdp` along their largest dimension that divides evenly
(replicated when none does). The batch is split over `data` x `fsdp`; the sequence over
`seq` (the context-parallel axis of every `--ring_strategy`) and, for
`--ring_strategy hybrid` only, also over `seq_a2a` (the all-to-all axis: Ulysses inside
each ring shard; `seq` is then the ring axis, major). XLA inserts the all-gathers /
reduce-scatters.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.sharding import spec_axes

AXES = ("data", "fsdp", "seq", "seq_a2a")
BATCH_AXES = ("data", "fsdp")
SEQ_AXES = ("seq", "seq_a2a")  # ring-major: the sequence's split over both


def parse_mesh(spec: str, num_devices: int, fsdp: bool = True) -> dict[str, int]:
    """`"data=1,fsdp=-1,seq=4"` -> `{"data": 1, "fsdp": N/4, "seq": 4}`, checked.

    One axis may be -1 (the remaining devices). With `fsdp=False` (`--fsdp ""`) a -1
    goes to `data` instead of `fsdp`, and an `fsdp` size above 1 is an error. Raises
    before anything compiles.
    """
    sizes = mesh_sizes(spec)
    for name in AXES:
        sizes.setdefault(name, 1)
    if not fsdp and sizes["fsdp"] > 1:
        raise ValueError(
            f"--mesh {spec!r} gives fsdp={sizes['fsdp']} but --fsdp '' turns FSDP off: "
            "use fsdp=1 (or -1, the devices then go to data), or --fsdp full_shard"
        )
    if not fsdp and sizes["fsdp"] == -1:
        sizes["fsdp"], sizes["data"] = 1, -1 if sizes["data"] == 1 else sizes["data"]
    free = [n for n, s in sizes.items() if s == -1]
    if len(free) > 1:
        raise ValueError(f"--mesh {spec!r}: only one axis may be -1, got {free}")
    if any(s == 0 or s < -1 for s in sizes.values()):
        raise ValueError(f"--mesh {spec!r}: sizes must be positive (or one -1)")
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if free:
        if num_devices % fixed:
            raise ValueError(
                f"--mesh {spec!r}: {num_devices=} is not divisible by the fixed axes' "
                f"product {fixed}"
            )
        sizes[free[0]] = num_devices // fixed
    total = math.prod(sizes.values())
    if total > num_devices:
        raise ValueError(
            f"--mesh {spec!r} needs {total} devices ({sizes}); this machine has {num_devices} "
            f"(on CPU, XLA_FLAGS=--xla_force_host_platform_device_count={total} simulates "
            f"{total})"
        )
    if total < num_devices:
        raise ValueError(
            f"--mesh {spec!r} uses {total} of the {num_devices} devices ({sizes}): a mesh "
            "takes them all; put -1 on one axis, or make fewer visible (CUDA_VISIBLE_DEVICES "
            "on GPUs; on the CPU, XLA_FLAGS=--xla_force_host_platform_device_count)"
        )
    return {n: sizes[n] for n in AXES}


def mesh_sizes(spec: str) -> dict[str, int]:
    """The sizes a `--mesh` spec names, by axis (a -1 kept, axes it leaves out absent),
    checked for form only: every part `axis=int`, each axis one of `AXES`, given once.
    Needs no devices; a ValueError naming the part otherwise."""
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        if "=" not in part:
            raise ValueError(f"--mesh {spec!r}: {part!r} is not axis=size")
        name, _, value = part.partition("=")
        name = name.strip()
        if name not in AXES:
            raise ValueError(f"--mesh {spec!r}: unknown axis {name!r}; axes are {', '.join(AXES)}")
        if name in sizes:
            raise ValueError(f"--mesh {spec!r}: axis {name!r} is given twice")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise ValueError(
                f"--mesh {spec!r}: size of {name!r} is not an int: {value!r}"
            ) from None
    return sizes


def mesh_device_count(spec: str, available: int, platform: str = "") -> int:
    """Devices a `--mesh` spec needs: the product of its sizes, or all for a -1; a
    ValueError naming the spec where it is malformed or needs more than `available`
    (on `platform` "cpu", with how to simulate them)."""
    sizes = mesh_sizes(spec).values()
    need = available if -1 in sizes else math.prod(sizes)
    if need > available:
        hint = ""
        if platform == "cpu":
            flag = f"XLA_FLAGS=--xla_force_host_platform_device_count={need}"
            hint = f" (on CPU, {flag} simulates {need})"
        raise ValueError(
            f"--mesh {spec!r} needs {need} devices; this machine has {available}{hint}"
        )
    return need


def make_mesh(sizes: dict[str, int], devices=None) -> Mesh:
    """A mesh with Auto axes (XLA places the FSDP gathers and scatters), over all
    devices or the given ones."""
    shape = tuple(sizes[a] for a in AXES)
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)


def param_spec(
    shape: tuple[int, ...],
    fsdp_size: int,
    *,
    stacked: bool = False,
    axes=("fsdp",),
    minor_last: bool = False,
) -> P:
    """FSDP spec: shard the largest evenly divisible dimension over `axes` (of total
    size `fsdp_size`).

    `stacked`: dimension 0 indexes scanned layers and is never sharded (the scan
    slices it every iteration).
    `minor_last`: split a stacked leaf's last dimension (the minor one in memory) only
    when no other divides. For state that is only ever gathered whole and updated
    (`--gather_once` with `fsdp=1`): a gather or reduce-scatter moves the split
    dimension's pieces as contiguous blocks, so with the minor one split XLA transposes
    every shard on the way and updates the optimizer state through a transposing
    fusion at a quarter of the memory bandwidth (BENCHMARKS.md, trainer).
    Per-layer FSDP keeps the largest dimension: there XLA picks its gather and matmul
    strategy by the split.
    """
    if fsdp_size == 1 or not shape:
        return P()
    dims = range(1 if stacked else 0, len(shape))
    last = len(shape) - 1
    order = sorted(dims, key=lambda i: (minor_last and stacked and i == last, -shape[i]))
    for dim in order:
        if shape[dim] % fsdp_size == 0 and shape[dim] >= fsdp_size:
            spec = [None] * len(shape)
            spec[dim] = axes[0] if len(axes) == 1 else tuple(axes)
            return P(*spec)
    return P()


def seq_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes the sequence is split over, ring-major: those of `SEQ_AXES` with
    more than one device (`("seq",)` when none has)."""
    return tuple(a for a in SEQ_AXES if mesh.shape[a] > 1) or ("seq",)


def seq_shards(sizes: dict[str, int]) -> int:
    """Devices one sequence is split over."""
    return math.prod(sizes[a] for a in SEQ_AXES)


def shard_axes(mesh: Mesh, over_seq: bool) -> tuple[str, ...]:
    """The axes parameters are sharded over: `fsdp`, and with `over_seq` also the
    sequence axes (ZeRO-3 across the sequence-parallel group: HF Trainer's `--fsdp
    full_shard` on the same GPUs that split the sequence)."""
    over = tuple(a for a in SEQ_AXES if mesh.shape[a] > 1) if over_seq else ()
    return ("fsdp", *over)


def param_shardings(
    abstract_tree, mesh: Mesh, axes: tuple[str, ...] = ("fsdp",), minor_last: bool = False
):
    """NamedShardings for a pytree of arrays/ShapeDtypeStructs (params or opt state).

    Leaves under a `layers` key are scanned-layer stacks (dimension 0 = layer).
    `minor_last`: see `param_spec` (the `--gather_once` layout).
    """
    fsdp_size = math.prod(mesh.shape[a] for a in axes)

    def shard(path, x):
        stacked = any(getattr(k, "key", None) == "layers" for k in path)
        spec = param_spec(
            tuple(np.shape(x)), fsdp_size, stacked=stacked, axes=axes, minor_last=minor_last
        )
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(shard, abstract_tree)


def compute_shardings(shardings, axes: tuple[str, ...]):
    """`shardings` (a pytree of NamedShardings) with `axes` dropped from every spec:
    the layout of a copy gathered over `axes` (and still split over the others)."""

    def drop(s: NamedSharding) -> NamedSharding:
        def part(p):
            rest = tuple(a for a in spec_axes(p) if a not in axes)
            return rest[0] if len(rest) == 1 else (rest or None)

        return NamedSharding(s.mesh, P(*(part(p) for p in s.spec)))

    return jax.tree.map(drop, shardings)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """`[batch, seq]` token arrays: batch over data x fsdp, sequence over the sequence
    axes (`seq_axes`)."""
    axes = seq_axes(mesh)
    return NamedSharding(mesh, P(BATCH_AXES, axes[0] if len(axes) == 1 else axes))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
