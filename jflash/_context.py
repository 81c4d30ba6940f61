"""The public context-parallel attention: `ring_attention_shard` per shard, inside a
`shard_map`, and `ring_attention` on global arrays (a `shard_map` around the former).

Four strategies over one sequence split across devices: `ring` and `allgather`
(`_ring`: K/V travel, queries stay), `ulysses` (`_ulysses`: an all-to-all over heads,
the single-device kernel on the whole sequence) and `hybrid` (Ulysses over an inner
mesh axis, the ring over an outer one).
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
from jax import lax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, Float

from jflash._block_sizes import BlockSizes
from jflash._dispatch import resolve
from jflash._flash import flash_attention
from jflash._layout import check_layout, check_layout_len, from_layout, to_layout
from jflash._ring import RING_STRATEGIES, _ring_shard, ring_config
from jflash._segments import first_positions, key_first_positions
from jflash._ulysses import check_heads, hybrid_shard, kernel_group, ulysses_shard
from jflash._validation import (
    as_bool,
    check_causal,
    check_qkv,
    check_segment_ids,
    check_unsharded,
    entry_axes,
    is_self_ids,
)
from jflash._vma import (
    check_interpretable,
    match,
    mosaic_interpret_error,
    varying_axes,
    warn_unshared,
)

STRATEGIES = (*RING_STRATEGIES, "ulysses", "hybrid")


def _names(seq_axis, argument: str = "seq_axis") -> tuple[str, ...]:
    names = (seq_axis,) if isinstance(seq_axis, str) else seq_axis
    if not isinstance(names, tuple) or not names or not all(isinstance(a, str) for a in names):
        raise ValueError(f"{argument}={seq_axis!r} must be a mesh axis name or a tuple of them")
    if len(set(names)) != len(names):
        raise ValueError(f"{argument}={seq_axis!r} names a mesh axis twice")
    return names


def _splitting_axes(mesh: Mesh, taken, batch: int, kept=()) -> tuple[str, ...]:
    """The mesh axes, other than `taken` (the sequence's and the heads') and `kept`
    (those already splitting the batch), that can split it further, in mesh order: each
    of size > 1, kept while the product of every kept size divides `batch`
    (`ring_attention`'s default `batch_axes` on Auto axes)."""
    sizes = dict(mesh.shape)
    prod, chosen = math.prod(sizes[a] for a in kept), []
    for name in mesh.axis_names:
        if name in taken or name in kept or sizes[name] == 1:
            continue
        if batch % (prod * sizes[name]) == 0:
            chosen.append(name)
            prod *= sizes[name]
    return tuple(chosen)


def _warn_replicated_batch(idle, spec) -> None:
    """Explicit axes keep q's own batch sharding: warn where it leaves out mesh axes
    (`idle`) that could split the batch, whose devices then all compute the same batch."""
    if idle:
        warnings.warn(
            f"jflash.ring_attention: q's batch is not split over mesh axes {idle} "
            f"(q's spec is {spec}; on Explicit axes the batch keeps q's own sharding), so "
            "their devices each compute the same batch: shard q's batch over them, or "
            "pass batch_axes (batch_axes=() keeps it replicated without this warning)",
            stacklevel=4,
        )


def _warn_undivided_batch(mesh: Mesh, taken, chosen, batch: int) -> None:
    """Auto axes split the batch where their sizes divide it: warn where mesh axes of
    size > 1 are left out (`taken` by the sequence and heads, `chosen` for the batch),
    whose devices then all compute the same batch."""
    sizes = dict(mesh.shape)
    idle = {a: sizes[a] for a in mesh.axis_names if sizes[a] > 1 and a not in (*taken, *chosen)}
    if idle:
        warnings.warn(
            f"jflash.ring_attention: q's batch of {batch} is not split over mesh axes "
            f"{idle}, whose sizes do not divide it beside {chosen or 'no other axes'}, so "
            "their devices each compute the same batch: give a batch they divide, or "
            "pass batch_axes (batch_axes=() keeps it replicated without this warning)",
            stacklevel=4,
        )


def _axis_tuple(axes, argument: str) -> tuple[str, ...]:
    """`axes` (a mesh axis name, or a tuple or list of distinct ones) as a tuple."""
    names = (axes,) if isinstance(axes, str) else axes
    if (
        not isinstance(names, (tuple, list))
        or not all(isinstance(a, str) for a in names)
        or len(set(names)) != len(names)
    ):
        raise ValueError(
            f"{argument}={axes!r} must be a mesh axis name or a tuple of distinct ones"
        )
    return tuple(names)


def _head_axes(mesh: Mesh, seq_names, q, head_axes, shapes) -> tuple[str, ...]:
    """Mesh axes that split the heads (see `ring_attention`): given, or on Explicit
    axes q's own head split; checked to divide q's and k's heads."""
    typed = jax.typeof(q).sharding
    given = head_axes is not None
    if not given:
        explicit = AxisType.Explicit in typed.mesh.axis_types
        head_axes = (typed.spec[2] if explicit and len(typed.spec) > 2 else None) or ()
    head_axes = _axis_tuple(head_axes, "head_axes")
    sizes = dict(mesh.shape)
    for name in head_axes:
        if name not in sizes or name in seq_names:
            source = "" if given else f" (q's heads are split over it: {typed.spec})"
            raise ValueError(
                f"head axis {name!r}{source} must be a mesh axis other than the sequence's "
                f"{seq_names}; {mesh.axis_names=}"
            )
    parts = math.prod(sizes[a] for a in head_axes)
    if shapes.q_heads % parts or shapes.kv_heads % parts:
        raise ValueError(
            f"the heads are split over {head_axes} into {parts} parts, which q's "
            f"{shapes.q_heads} and k's {shapes.kv_heads} heads must both divide (each "
            "part's query heads read their own KV heads)"
        )
    return head_axes


def _batch_axes(mesh: Mesh, seq_axis, q, batch_axes, heads=()) -> tuple[str, ...]:
    """Mesh axes that split the batch dimension (see `ring_attention`), other than the
    sequence's and the heads' (`heads`)."""
    seq_names = _names(seq_axis)
    taken = (*seq_names, *heads)
    sizes = dict(mesh.shape)
    batch = q.shape[0]
    typed = jax.typeof(q).sharding
    if AxisType.Explicit in typed.mesh.axis_types and dict(typed.mesh.shape) != sizes:
        raise ValueError(
            f"q is placed on a mesh with axes {dict(typed.mesh.shape)}, not on the "
            f"mesh={sizes} passed to ring_attention: put q, k and v on that mesh "
            "(jax.device_put with a NamedSharding of it), or pass the mesh they are on"
        )
    if batch_axes is None and AxisType.Explicit in typed.mesh.axis_types:
        # Explicit axes: keep the batch sharding q's type already has (even
        # replicated), so the output's type matches the code around the call.
        batch_axes = typed.spec[0] or ()
        kept = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)
        if set(seq_names) & set(kept):
            raise ValueError(
                f"the batch dimension of q is sharded over {seq_axis=} (q's spec is "
                f"{typed.spec}), the axis the sequence is split over: shard the batch over "
                "other mesh axes, or pass batch_axes (q is then resharded)"
            )
        if set(heads) & set(kept):
            raise ValueError(
                f"q's batch and heads are both split over {sorted(set(heads) & set(kept))} "
                f"(q's spec is {typed.spec}): split each over axes of its own"
            )
        _warn_replicated_batch(_splitting_axes(mesh, taken, batch, kept), typed.spec)
    if batch_axes is None:
        chosen = _splitting_axes(mesh, taken, batch)
        _warn_undivided_batch(mesh, taken, chosen, batch)
        return chosen
    batch_axes = _axis_tuple(batch_axes, "batch_axes")
    for name in batch_axes:
        if name not in sizes or name in taken:
            raise ValueError(
                f"batch axis {name!r} must be a mesh axis other than {seq_axis=}"
                + (f" and the heads' {heads}" if heads else "")
                + f"; {mesh.axis_names=}"
            )
    prod = math.prod(sizes[name] for name in batch_axes)
    if batch % prod != 0:
        raise ValueError(f"{batch=} must be divisible by the product of {batch_axes=} ({prod})")
    return batch_axes


def _to_spec(arrays, mesh: Mesh, spec: PartitionSpec):
    """Explicit axes: reshard to `spec` (a no-op when already there), since shard_map
    refuses an input whose typed sharding differs. Auto axes: shard_map constrains."""
    names = {a for entry in spec for a in entry_axes(entry)}
    explicit = {
        a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == AxisType.Explicit
    }
    if not names & explicit:
        return arrays
    if not names <= explicit:
        raise NotImplementedError(
            f"ring_attention needs the axes {sorted(names)} to be all Explicit or all Auto; "
            f"{mesh.axis_names=}, {mesh.axis_types=}"
        )
    return tuple(None if x is None else jax.reshard(x, NamedSharding(mesh, spec)) for x in arrays)


def _specs(
    seq_axis, batch_spec, head_spec=None
) -> tuple[PartitionSpec, PartitionSpec, PartitionSpec]:
    """The global arrays' specs over the mesh: q/k/v/out, LSE and segment ids, the
    sequence split over `seq_axis`, the batch over `batch_spec`, the heads over
    `head_spec`."""
    names = _names(seq_axis)
    seq_spec = names if len(names) > 1 else names[0]
    return (
        PartitionSpec(batch_spec, seq_spec, head_spec, None),
        PartitionSpec(batch_spec, head_spec, seq_spec),
        PartitionSpec(batch_spec, seq_spec),
    )


def _onto_mesh(x, mesh, spec: PartitionSpec):
    """`x` put onto `mesh` with `spec` (as `jax.device_put` puts it) where its value is
    a concrete jax Array on devices other than the mesh's (committed to one device,
    say), which the jitted `shard_map` would refuse: an array, or one an eager
    `jax.grad` traces (the transfer is differentiated). Anything else (values traced
    under `jax.jit`, numpy arrays, arrays already on the mesh's devices) as it is."""
    # A tracer's concrete value, where it has one (an eager `jax.grad`'s), else None.
    value = x.to_concrete_value() if isinstance(x, jax.core.Tracer) else x
    if (
        isinstance(mesh, Mesh)
        and isinstance(value, jax.Array)
        and value.is_fully_addressable
        and not mesh.is_multi_process
        and value.devices() != set(mesh.devices.flat)
    ):
        return jax.device_put(x, NamedSharding(mesh, spec))
    return x


def _check_strategy(layout: str, strategy: str, causal: bool) -> None:
    check_layout(layout)
    if strategy not in STRATEGIES:
        raise ValueError(f"{strategy=} is not one of {STRATEGIES}")
    if strategy == "allgather" and layout == "striped" and causal:
        # Its local queries are no contiguous run of global positions: one kernel call
        # per run would be one per token.
        raise NotImplementedError(
            f"{strategy=} with {layout=} (causal): use strategy='ring', or the zigzag or "
            "contiguous layout"
        )


def _check_self_attention(shapes, where: str) -> None:
    if shapes.q_len != shapes.kv_len:
        raise ValueError(
            f"context-parallel attention is self-attention: q and k/v {where} lengths "
            f"differ ({shapes.q_len=}, {shapes.kv_len=})"
        )


def _split(names: tuple[str, ...], strategy: str, sizes) -> tuple[int, int]:
    """`(ring shards, all-to-all degree)` of a sequence split over `names`."""
    total = math.prod(sizes)
    if strategy == "hybrid":
        if len(names) != 2:
            raise ValueError(
                f"strategy='hybrid' takes two sequence axes, (ring axis, all-to-all axis), "
                f"ring major; got {names}"
            )
        return sizes[0], sizes[1]
    if strategy == "ulysses":
        return 1, total
    return total, 1


def _bound_sizes(names: tuple[str, ...]) -> tuple[int, ...]:
    """The size of each of `names` in the enclosing `shard_map`; a clear error where
    one is not bound there."""
    sizes = []
    for name in names:
        try:
            sizes.append(int(lax.axis_size(name)))
        except NameError:
            axis_name = name
            among = "" if len(names) == 1 else f" (of {names})"
            raise ValueError(
                f"{axis_name=}{among} is not a manual axis here: call ring_attention_shard inside "
                "jax.shard_map over that mesh axis (with it in axis_names for a partial "
                "shard_map), or call jflash.ring_attention on global arrays"
            ) from None
    return tuple(sizes)


def _check_split(names: tuple[str, ...], axis_name, q, k, v) -> None:
    """Under `check_vma`, q, k and v must each vary over every axis of `names`: one
    that does not holds the same values on every device of that axis (the
    `shard_map`'s in_specs leave its sequence whole), and the ring would attend over
    P copies of it. Without `check_vma` (nothing varies) there is nothing to read."""
    if not varying_axes(lax.axis_index(names)):
        return
    for name, x in (("q", q), ("k", k), ("v", v)):
        whole = sorted(set(names) - varying_axes(x))
        if whole:
            raise ValueError(
                f"{name} is the same on every device of {whole} ({name}'s manual-axis type "
                f"does not vary over it): ring_attention_shard takes this device's shard of "
                f"a sequence split over {axis_name=}; split dimension 1 over it in the "
                "shard_map's in_specs"
            )


def ring_attention_shard(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B T K H"],
    v: Float[Array, "B T K H"],
    *,
    axis_name: str | tuple[str, ...],
    causal: bool,
    layout: str = "zigzag",
    strategy: str = "ring",
    segment_ids=None,
    scale: float | None = None,
    return_lse: bool = False,
    block_sizes: BlockSizes | None = None,
    implementation: str | None = None,
    interpret: bool | None = None,
    deterministic: bool | None = None,
):
    """Exact self-attention over a sequence split across `axis_name`, per shard.

    Call it inside your own `jax.shard_map` (full, or partial with `axis_name` among
    its `axis_names`), like `lax.psum`: q, k, v are this device's shard of a sequence
    split into P shards over `axis_name`, in `layout` order. Its gradients are custom
    VJPs on this per-shard computation and the collectives' own transposes, so it
    composes with `jax.jit`, `jax.checkpoint` (the attention residuals are named
    `attention_out` / `attention_lse`), `lax.scan`, `vmap` and NNX modules, with
    `check_vma` on or off.

    Args:
      q: this shard's queries `[B, T_local, N, H]`; k, v: keys/values
        `[B, T_local, K, H]`, `N % K == 0` (GQA/MQA: K/V travel at KV-head size).
      axis_name: the mesh axis the sequence is split over, or a tuple of axes split
        jointly, major first. `strategy="hybrid"` takes two: `(ring_axis, a2a_axis)`.
        The axes that split dimension 1 in the `shard_map`'s in_specs, in their order
        there: an axis that splits the batch instead, or a tuple in another order,
        cannot be told apart, and gives a wrong causal answer.
      causal: causal mask on global positions (required: non-causal ignores order).
      layout: `"zigzag"` (shard r holds chunks r and 2P-1-r of 2P: balanced causal
        work; each ring shard's length even: T_local, times the all-to-all degree
        with `"hybrid"`), `"striped"` (shard r holds tokens r, r+P, ...: balanced
        with packed documents too) or `"contiguous"` (shard r holds chunk r). The
        global sequence must be in that order (`jflash.to_layout` before sharding);
        natural-order tokens give wrong causal attention silently. With `"hybrid"`
        P is the ring axis's size: `to_layout(x, P_ring, layout)`, and each ring
        shard is split contiguously over the all-to-all axis.
      strategy: `"ring"` (K/V rotate, one `ppermute` per step overlapped with the
        kernel), `"allgather"` (K/V gathered once; not with the striped layout when
        causal), `"ulysses"` (an all-to-all over heads: each device runs the kernel
        on the whole sequence for N/P heads; N % P == 0) or `"hybrid"` (Ulysses over
        the second axis of `axis_name`, the ring over the first). See
        `jflash.ring_attention` for when each is the one to use. Over an axis of
        size 1 every strategy runs `jflash.flash_attention`'s kernels on the shard.
      segment_ids: this shard's ids `[B, T_local]` int (packed documents: attention
        stays inside equal ids; a document may span shards), in the same layout
        order as q, or a `(q_ids, kv_ids)` pair. Rows that see no key give 0 and LSE
        `-inf`. One array is relabelled by each id's first position along the whole
        sequence (the shards gather it), as `jflash.flash_attention` relabels one, and
        a pair by each id's first position among the key ids: documents labelled in
        any order reach the kernels as sorted ids.
      scale, return_lse, block_sizes, implementation, interpret, deterministic: as in
        `jflash.flash_attention`.

    Returns:
      `out [B, T_local, N, H]` in q's dtype, or `(out, lse [B, N, T_local] f32)`.
    """
    names = _names(axis_name, "axis_name")
    shapes = check_qkv(q, k, v)
    return_lse = as_bool(return_lse, f"{return_lse=} must be True or False")
    causal = check_causal(causal)
    _check_strategy(layout, strategy, causal)
    ring_shards, degree = _split(names, strategy, _bound_sizes(names))
    _check_split(names, axis_name, q, k, v)
    _check_self_attention(shapes, "shard")
    if degree > 1:
        check_heads(shapes.q_heads, degree, names[-1] if strategy == "hybrid" else axis_name)
    shard_len = shapes.q_len * degree  # what one ring shard holds after the all-to-all
    shards = ring_shards if ring_shards > 1 else degree
    check_layout_len(shard_len * ring_shards, shards, layout, local_len=shapes.q_len)
    segs = check_segment_ids(segment_ids, shapes)
    check_unsharded("ring_attention_shard", q, k, v, segs)
    warn_unshared("ring_attention_shard", q, k, v)
    q, k, v, *_ = match(q, k, v, *(segs or ()))  # `match`'s docstring says why
    # Ids relabelled along the whole sequence (as `flash_attention` relabels them: one
    # array by its own first positions, a pair by the key ids'), so that documents
    # labelled in any order reach the kernels as sorted ids on every shard.
    self_ids = is_self_ids(segment_ids)
    kernel_choice = dict(
        block_sizes=block_sizes,
        implementation=implementation,
        interpret=interpret,
        deterministic=deterministic,
    )
    if strategy == "ulysses":
        resolved = resolve(
            implementation,
            interpret,
            block_sizes,
            q_len=shard_len,
            kv_len=shard_len,
            head_dim=shapes.head_dim,
            dtype=q.dtype,
            deterministic=deterministic,
            group=kernel_group(shapes.group, shapes.kv_heads, degree),
        )
        check_interpretable(resolved.name, resolved.interpret)
        o, lse = ulysses_shard(
            q,
            k,
            v,
            segs,
            axis=axis_name,
            degree=degree,
            layout=layout,
            causal=causal,
            scale=scale,
            self_ids=self_ids,
            **kernel_choice,
        )
        return (o, lse) if return_lse else o
    ring_axis = names[0] if strategy == "hybrid" else axis_name
    cfg = ring_config(
        ring_axis,
        ring_shards,
        shard_len * ring_shards,
        causal=causal,
        layout=layout,
        strategy="ring" if strategy == "hybrid" else strategy,
        head_dim=shapes.head_dim,
        dtype=q.dtype,
        scale=scale,
        group=kernel_group(shapes.group, shapes.kv_heads, degree),
        **kernel_choice,
    )
    check_interpretable(cfg.kernel.name, cfg.kernel.interpret)

    def ring(q, k, v, segs):
        if ring_shards == 1:
            # One ring shard (a mesh axis of size 1, or a hybrid's ring axis of size 1):
            # the single-device kernels, outputs and gradients in q's dtype, instead of
            # one ring step's f32 partial output and gradients converted afterwards.
            return flash_attention(
                q,
                k,
                v,
                segment_ids=segs[0] if self_ids else segs,
                return_lse=True,
                causal=causal,
                scale=scale,
                **kernel_choice,
            )
        q_seg, kv_seg = (None, None) if segs is None else segs
        if self_ids:
            q_seg = kv_seg = _relabelled(q_seg, ring_axis, ring_shards, layout)
        elif segs is not None:
            q_seg, kv_seg = _relabelled_pair(q_seg, kv_seg, ring_axis, ring_shards, layout)
        return _ring_shard(q, k, v, q_seg, kv_seg, cfg)

    if strategy == "hybrid":
        o, lse = hybrid_shard(q, k, v, segs, a2a_axis=names[1], degree=degree, ring=ring)
    else:
        o, lse = ring(q, k, v, segs)
    return (o, lse) if return_lse else o


def _relabelled(seg, axis, shards: int, layout: str):
    """This ring shard's self-attention ids `[B, T_local]` relabelled by first position
    along the natural sequence (`first_positions` of the whole sequence's ids, which
    every shard gathers and relabels alike): where each document is one run of the
    sequence, every shard's ids come out sorted in any layout (its tokens are in
    natural order), and equal ids stay equal across shards."""
    (ids,) = _relabelled_along(
        lambda whole: (first_positions(whole),), (seg,), axis, shards, layout
    )
    return ids


def _relabelled_pair(q_seg, kv_seg, axis, shards: int, layout: str):
    """This ring shard's `(query ids, key ids)` relabelled as `_relabelled` relabels
    one array, by `key_first_positions` of the whole sequence's pair."""
    return _relabelled_along(key_first_positions, (q_seg, kv_seg), axis, shards, layout)


def _relabelled_along(relabel, segs, axis, shards: int, layout: str):
    """`relabel(*whole)` of the whole sequence's ids in natural order (each of `segs`
    gathered over `axis`), cut back to this shard's part of each, in layout order."""
    local = segs[0].shape[1]
    natural = [
        from_layout(lax.all_gather(s, axis, axis=1, tiled=True), shards, layout) for s in segs
    ]
    start = lax.axis_index(axis) * local
    return tuple(
        lax.dynamic_slice_in_dim(to_layout(s, shards, layout), start, local, axis=1)
        for s in relabel(*natural)
    )


def ring_attention(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B T K H"],
    v: Float[Array, "B T K H"],
    *,
    mesh: Mesh,
    seq_axis: str | tuple[str, ...] = "seq",
    causal: bool,
    layout: str = "zigzag",
    strategy: str = "ring",
    segment_ids=None,
    scale: float | None = None,
    return_lse: bool = False,
    batch_axes: str | tuple[str, ...] | None = None,
    head_axes: str | tuple[str, ...] | None = None,
    block_sizes: BlockSizes | None = None,
    implementation: str | None = None,
    interpret: bool | None = None,
    deterministic: bool | None = None,
):
    """Exact self-attention over a sequence sharded along `seq_axis`, differentiable.

    Global arrays in, global arrays out: builds a `jax.shard_map` over `mesh` around
    `jflash.ring_attention_shard` (one implementation; on a mesh of one device that
    runs `jflash.flash_attention`'s kernels). Pass global arrays (jitted or
    not); the sequence dimension is split over the `seq_axis` mesh axes. Called
    outside `jax.jit`, arrays on other devices than the mesh's (committed to one
    device, say) are first put onto it, as `jax.device_put` would. Works with
    Explicit and Auto mesh axes, inside `jax.jit` next to other sharded code. Code
    that is already inside a `shard_map` (over any axes) calls `ring_attention_shard`:
    this function is refused there.

    Args:
      q: queries `[B, T, N, H]`; k, v: keys/values `[B, T, K, H]`, `N % K == 0`
        (GQA/MQA: K/V travel at KV-head size, never repeated by the ring; Ulysses
        repeats them only as far as its degree needs). The sequence is in `layout`
        order (`jflash.to_layout` converts from natural order; forgetting it gives
        wrong causal attention silently: compare with `flash_attention` on a small
        input once).
      mesh: the device mesh.
      seq_axis: mesh axis the sequence is sharded over, or a tuple of axes (major
        first); `strategy="hybrid"` takes `(ring_axis, a2a_axis)`.
      causal: causal mask on global positions (required: non-causal ignores order).
      layout: `"zigzag"` (rank r holds chunks r and 2P-1-r of 2P: balanced causal
        work; T % 2P == 0), `"striped"` (rank r holds tokens r, r+P, ...: balanced
        with packed documents too; T % P == 0) or `"contiguous"` (rank r holds
        chunk r; T % P == 0). With `"hybrid"`, P is the ring axis's size.
      strategy: `"ring"` (K/V rotate with one `ppermute` per step, overlapped with the
        kernel: memory of one shard, the one for the longest sequences),
        `"allgather"` (the whole sequence's K/V gathered on every device, one kernel
        call per run of local queries, dK/dV reduce-scattered: faster at short
        per-device lengths, where the ring's per-step kernel calls are short),
        `"ulysses"` (all-to-all over heads, the whole sequence per device for N/P
        heads: the least traffic at large P on one node; N % P == 0), or `"hybrid"`
        (Ulysses within the second axis, the ring across the first: for jobs that
        span nodes).
      segment_ids: `[B, T]` int ids in the same layout order as q (packed documents;
        attention stays inside equal ids, across shard boundaries too), or a
        `(q_ids, kv_ids)` pair. One array is relabelled along the whole sequence,
        as `ring_attention_shard` relabels one.
      scale: logit scale, default `H ** -0.5`.
      return_lse: also return the f32 log-sum-exp `[B, N, T]`; its cotangent flows.
      batch_axes: mesh axes that split the batch. Default: on Auto axes, every other
        mesh axis of size > 1, in mesh order, kept while the product of the kept
        sizes divides B; on Explicit axes, the batch sharding q's type already has
        (so the output's type matches the code around the call; a warning names the
        axes it leaves out that could split the batch). The batch is replicated over
        the rest (each of those devices computes the same thing).
      head_axes: mesh axes that split the heads (tensor parallelism): q's and k/v's
        heads are split alike over them (both divisible by their size), each device
        attends its own heads. Default: on Explicit axes, the head split q's type
        already has; on Auto axes, none. Not among the batch's or sequence's axes.
      block_sizes, implementation, interpret, deterministic: kernel choice, as in
        `jflash.flash_attention`; resolved once for the per-shard block lengths.
        `"pallas_mosaic"` in interpret mode runs only on a one-device mesh (the GPU
        interpreter's limit); compiled, it runs on any mesh of Hopper GPUs.

    Returns:
      `out [B, T, N, H]` in q's dtype and layout order, or `(out, lse)` with
      `return_lse=True`; sharded like the inputs.
    """
    if not isinstance(mesh, (Mesh, AbstractMesh)):
        raise ValueError(f"{mesh=} must be a jax.sharding.Mesh (the sequence is split over it)")
    names = _names(seq_axis)
    shapes = check_qkv(q, k, v)
    causal = check_causal(causal)
    _check_strategy(layout, strategy, causal)
    for name in names:
        if name not in mesh.axis_names:
            raise ValueError(f"{seq_axis=} is not an axis of the mesh; {mesh.axis_names=}")
    manual = list(jax.sharding.get_abstract_mesh().manual_axes)
    if set(names) & set(manual):
        raise ValueError(
            f"{seq_axis=} is already a manual axis here (inside a jax.shard_map over it): "
            "ring_attention takes global arrays; on this device's shard call "
            "jflash.ring_attention_shard"
        )
    if manual:
        # Its own shard_map would nest in the caller's, and jax 0.11.2 fails to lower
        # gradients through nested shard_maps (or to trace them with a concrete mesh).
        raise ValueError(
            f"ring_attention is called inside a jax.shard_map over {manual}: it takes "
            "global arrays and builds its own shard_map, which jax 0.11.2 cannot nest; "
            f"there call jflash.ring_attention_shard, with {seq_axis=} among that "
            "shard_map's axis_names"
        )
    sizes = dict(mesh.shape)
    ring_shards, degree = _split(names, strategy, [sizes[n] for n in names])
    _check_self_attention(shapes, "sequence")
    seq_len = shapes.q_len
    check_layout_len(seq_len, ring_shards if ring_shards > 1 else degree, layout)
    if seq_len % (ring_shards * degree) != 0:
        raise ValueError(f"{seq_len=} must be divisible by the {ring_shards * degree} devices")
    # the all-to-all's axis: hybrid's last, all of Ulysses' (a tuple, over them together)
    a2a = names[-1] if strategy == "hybrid" else seq_axis
    if degree > 1:
        check_heads(shapes.q_heads, degree, a2a)
    segs = check_segment_ids(segment_ids, shapes)
    if is_self_ids(segment_ids):
        # One array goes to every shard as one array, which relabels it along the
        # whole sequence (a pair as a pair, relabelled by its key ids).
        segs = segs[0]
    return_lse = as_bool(return_lse, f"{return_lse=} must be True or False")
    heads = _head_axes(mesh, names, q, head_axes, shapes)
    head_parts = math.prod(sizes[a] for a in heads)
    if degree > 1:  # each device's all-to-all splits its own heads further
        check_heads(shapes.q_heads, degree, a2a, heads, head_parts)
    batch = _batch_axes(mesh, seq_axis, q, batch_axes, heads)
    # Resolved here once as well, so a kernel that cannot run is named before tracing.
    cfg = ring_config(
        names[0],
        ring_shards,
        seq_len,
        causal=causal,
        layout=layout,
        strategy="allgather" if strategy == "allgather" else "ring",
        head_dim=shapes.head_dim,
        dtype=q.dtype,
        scale=scale,
        implementation=implementation,
        interpret=interpret,
        block_sizes=block_sizes,
        deterministic=deterministic,
        group=kernel_group(shapes.group, shapes.kv_heads // head_parts, degree),
    )
    if cfg.kernel.name == "pallas_mosaic" and cfg.kernel.interpret and mesh.size > 1:
        raise mosaic_interpret_error(mesh.size)
    qkv_spec, _, seg_spec = _specs(seq_axis, batch or None, heads or None)
    q, k, v = (_onto_mesh(x, mesh, qkv_spec) for x in (q, k, v))
    segs = jax.tree.map(lambda ids: _onto_mesh(ids, mesh, seg_spec), segs)
    options = dict(
        axis_name=seq_axis,
        causal=causal,
        layout=layout,
        strategy=strategy,
        scale=cfg.scale,
        # Unused by the XLA path (`resolve` above warned once): not warned again per shard.
        block_sizes=None if cfg.kernel.name == "xla" else block_sizes,
        implementation=implementation,
        interpret=interpret,
        deterministic=deterministic,
    )
    o, lse = _shard_mapped(
        q,
        k,
        v,
        segs,
        mesh=mesh,
        batch_spec=batch or None,  # a tuple of axis names splits the batch over all of them
        head_spec=heads or None,
        options=tuple(options.items()),
    )
    return (o, lse) if return_lse else o


@functools.partial(jax.jit, static_argnames=("mesh", "batch_spec", "head_spec", "options"))
def _shard_mapped(q, k, v, segs, *, mesh, batch_spec, head_spec, options):
    """`ring_attention_shard` (keyword arguments `options`) in a `shard_map` over
    `mesh`, on global arrays. Jitted: an eager `shard_map` would run the ring op by
    op (seconds for a few tokens on CPU), and a second call reuses the program."""
    options = dict(options)
    qkv_spec, lse_spec, seg_spec = _specs(options["axis_name"], batch_spec, head_spec)

    def body(q, k, v, segs):
        return ring_attention_shard(q, k, v, segment_ids=segs, return_lse=True, **options)

    q, k, v = _to_spec((q, k, v), mesh, qkv_spec)
    if segs is not None:  # one id array, or a (q ids, kv ids) pair
        pair = isinstance(segs, tuple)
        segs = _to_spec(segs if pair else (segs,), mesh, seg_spec)
        segs = segs if pair else segs[0]
    seg_specs = jax.tree.map(lambda _: seg_spec, segs)
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(qkv_spec, qkv_spec, qkv_spec, seg_specs),
        out_specs=(qkv_spec, lse_spec),
    )(q, k, v, segs)
