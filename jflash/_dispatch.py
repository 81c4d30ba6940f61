"""Which implementation runs, decided once and explained (`jflash.describe()`).

No silent fallbacks: a named implementation that cannot run raises; `None` picks by
device, and the reason is recorded for `describe()`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import warnings

import jax
import jax.numpy as jnp

from jflash._block_sizes import (
    BlockSizes,
    check_head_shares,
    check_mosaic_block_sizes,
    default_block_sizes,
    mosaic_shape_unsupported,
)
from jflash._mask import Mask
from jflash._mosaic_bwd import (
    FUSED_DQ_HEAD_DIMS,
    SPLIT_DQ_HEAD_DIMS,
    adds_dq_into,
    fused_block_q,
    fuses_dq,
    head_split_rule,
    mosaic_bwd,
)
from jflash._mosaic_fwd import forms, mosaic_fwd
from jflash._reference import xla_bwd, xla_fwd
from jflash._triton_bwd import flash_bwd
from jflash._triton_fwd import flash_fwd
from jflash._validation import as_bool
from jflash._vma import JFLASH_FILES, vary, varying_axes
from jflash._work_items import sm_count

IMPLEMENTATIONS = ("pallas_triton", "pallas_mosaic", "xla")
_last_choice: dict[str, str] = {}


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A resolved implementation: what runs, with which tiles, interpreted or compiled."""

    name: str
    block_sizes: BlockSizes | None
    interpret: bool
    reason: str
    # Bitwise reproducible gradients. Only the Mosaic backward has a faster
    # non-deterministic form (dQ by f32 reduce-add); the others always are.
    deterministic: bool = True
    # The tiles are jflash's defaults (no `block_sizes` given): the Mosaic forward may
    # then pick its three-warpgroup form with its own tiles (`mosaic_fwd`).
    default_tiles: bool = True


def _platform() -> str:
    return jax.default_backend()


def _is_hopper() -> bool:
    """sm90 (H100/H200): where the Mosaic GPU kernels (wgmma, TMA) run."""
    device = jax.devices()[0]
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")) == "9.0"


def mosaic_unsupported(*, head_dim: int, dtype, compiled: bool = True) -> str | None:
    """Why the Mosaic kernels cannot take this problem (None: they can)."""
    if compiled and not _is_hopper():
        kind = jax.devices()[0].device_kind
        return (
            f"compiled needs a Hopper GPU (sm90: H100/H200); this device is {kind!r} "
            "(interpret=True runs it in the GPU interpreter on CPU)"
        )
    return mosaic_shape_unsupported(head_dim, dtype)


# Whether `implementation=None` takes the Mosaic kernels on Hopper where they apply:
# decided by the same-run benchmark against the Triton kernel (BENCHMARKS.md, H100,
# 2026-11-22: 1.15-1.26x Triton forward, 1.18-1.34x forward+backward at 4k-64k).
MOSAIC_IS_DEFAULT_ON_HOPPER = True


def _gpu_default(*, head_dim: int, dtype) -> tuple[str, str]:
    if not MOSAIC_IS_DEFAULT_ON_HOPPER:
        return "pallas_triton", "GPU: the Triton-lowered Pallas kernel (measured fastest here)"
    why = mosaic_unsupported(head_dim=head_dim, dtype=dtype)
    if why is None:
        return "pallas_mosaic", "Hopper: the Mosaic GPU kernels (measured faster than Triton)"
    return "pallas_triton", f"GPU: the Triton-lowered Pallas kernel (Mosaic {why})"


_XLA_DETERMINISTIC = re.compile(r"--xla_gpu_deterministic_ops(=(true|1))?(\s|$)", re.I)


def wants_determinism(deterministic: bool | None) -> bool:
    """The caller's `deterministic`; None follows XLA's own switch, so one
    `XLA_FLAGS=--xla_gpu_deterministic_ops=true` makes a whole training step (XLA's
    scatters, cuDNN and these kernels) reproducible."""
    if deterministic is None:
        return bool(_XLA_DETERMINISTIC.search(os.environ.get("XLA_FLAGS", "")))
    return as_bool(deterministic, f"{deterministic=} must be True, False or None")


# jax 0.11.2's GPU interpreter runs each simulated warpgroup as a program of its own on
# XLA's CPU client and waits for all of them from another one: with fewer host threads
# than that, a kernel whose warpgroups wait on each other hangs (seen on a 2-core
# machine with 1-3 CPU devices; with 4 or 8 the same calls ran).
INTERPRETER_THREADS = 4


def _warn_interpreter_threads() -> None:
    cores, devices = os.cpu_count() or 1, jax.local_device_count("cpu")
    if max(cores, devices) < INTERPRETER_THREADS:
        warnings.warn(
            f"jflash: the Mosaic kernels in the GPU interpreter can hang with fewer than "
            f"{INTERPRETER_THREADS} host threads (this process: {cores} cores, {devices} CPU "
            "devices); set XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax "
            "starts, as jflash's tests do",
            stacklevel=3,
        )


def _off_gpu(platform: str) -> str:
    """Why `implementation=None` runs the XLA path on a backend other than a GPU."""
    return f"{platform=}: no compiled Pallas kernel, blockwise XLA"


def resolve(
    implementation: str | None,
    interpret: bool | None,
    block_sizes: BlockSizes | None,
    *,
    q_len: int,
    kv_len: int,
    head_dim: int,
    dtype,
    deterministic: bool | None = None,
    group: int | None = None,
) -> Kernel:
    """Turns the user's `implementation` / `interpret` / `block_sizes` /
    `deterministic` into a `Kernel`. `group`: query heads per KV head of the kernels'
    calls, which `BlockSizes.head_shares_dkv` must divide (None: the backward checks)."""
    platform = _platform()
    deterministic = wants_determinism(deterministic)
    if interpret is not None:  # not truth-tested: interpret="no" would interpret
        interpret = as_bool(interpret, f"{interpret=} must be True, False or None")
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{implementation=} is not one of {IMPLEMENTATIONS}")
    if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
        raise ValueError(f"block_sizes must be a jflash.BlockSizes; got {type(block_sizes)=}")
    if implementation is None:
        if interpret:
            implementation, reason = "pallas_triton", "interpret=True asks for the Pallas kernel"
        elif platform == "gpu":
            implementation, reason = _gpu_default(head_dim=head_dim, dtype=dtype)
        else:
            implementation, reason = "xla", _off_gpu(platform)
    else:
        reason = "named by the caller"
    if implementation == "pallas_mosaic":
        if interpret is None:
            interpret = platform != "gpu"
        why = mosaic_unsupported(head_dim=head_dim, dtype=dtype, compiled=not interpret)
        if why is not None:
            raise NotImplementedError(
                f"implementation='pallas_mosaic' {why}; use 'pallas_triton' (any head dim, "
                "dtype, segment ids) or implementation=None"
            )
        if interpret:
            _warn_interpreter_threads()
        default_tiles = block_sizes is None
        if default_tiles:
            block_sizes = default_block_sizes(
                q_len,
                head_dim,
                dtype,
                kv_len=kv_len,
                implementation="pallas_mosaic",
                deterministic=deterministic,
            )
        fused = fused_block_q(head_dim) if fuses_dq(head_dim, deterministic) else ()
        check_mosaic_block_sizes(block_sizes, fused_block_q=fused)
        if group is not None:
            check_head_shares(block_sizes.head_shares_dkv, group)
        kernel = Kernel(
            "pallas_mosaic", block_sizes, bool(interpret), reason, deterministic, default_tiles
        )
    elif implementation == "xla":
        if interpret:
            raise ValueError(f"{interpret=} only applies to Pallas implementations, not 'xla'")
        if block_sizes is not None:
            if reason == "named by the caller":
                raise ValueError(
                    f"block_sizes={block_sizes} tiles the Pallas kernels; "
                    "implementation='xla' takes none"
                )
            warnings.warn(
                f"block_sizes is not used: {reason} (implementation='xla' takes no tiles)",
                skip_file_prefixes=JFLASH_FILES,  # the caller's line, at any depth
            )
        kernel = Kernel("xla", None, False, reason)
    else:
        if interpret is None:
            interpret = platform != "gpu"
        if not interpret and platform != "gpu":
            raise NotImplementedError(
                f"implementation='pallas_triton' compiled needs a GPU; {platform=}. "
                "Pass interpret=True (slow, for tests) or implementation='xla'"
            )
        if block_sizes is None:
            block_sizes = default_block_sizes(
                q_len, head_dim, dtype, "cpu" if interpret else "gpu", kv_len=kv_len
            )
        if block_sizes.head_shares_dkv:
            raise ValueError(
                f"BlockSizes.head_shares_dkv={block_sizes.head_shares_dkv} splits the Mosaic "
                "dK/dV launch; implementation='pallas_triton' takes 0"
            )
        kernel = Kernel("pallas_triton", block_sizes, bool(interpret), reason)
    _last_choice.update(
        implementation=kernel.name,
        reason=kernel.reason,
        interpret=str(kernel.interpret),
        deterministic=str(kernel.deterministic),
        block_sizes=repr(kernel.block_sizes),
    )
    return kernel


def describe() -> str:
    """Says which implementation `implementation=None` picks here, and why.

    Also names the choice of the last *traced* call ("last traced call: ..."): it is
    recorded when a call is traced, so a cached `jax.jit` call does not update it.
    """
    platform = _platform()
    lines = [f"backend: {platform} ({jax.devices()[0].device_kind})"]
    if platform == "gpu":
        for head_dim, dtype in ((128, jnp.bfloat16), (100, jnp.bfloat16), (128, jnp.float32)):
            default, why = _gpu_default(head_dim=head_dim, dtype=dtype)
            lines.append(
                f"implementation=None, {head_dim=}, {jnp.dtype(dtype).name}: {default!r} ({why})"
            )
        if _is_hopper():
            lines.extend([forms(), head_split_rule(sm_count())])
    else:
        lines.append(
            f"implementation=None -> 'xla' ({_off_gpu(platform)}; deterministic: only the "
            "Mosaic kernels fuse dQ)"
        )
    if platform == "gpu":
        deterministic = wants_determinism(None)
        lines.append(
            f"deterministic=None -> {deterministic} (XLA_FLAGS "
            + ("has" if deterministic else "lacks")
            + " --xla_gpu_deterministic_ops): the Mosaic backward at head_dim in "
            + f"{FUSED_DQ_HEAD_DIMS + SPLIT_DQ_HEAD_DIMS} "
            + ("runs two kernels" if deterministic else "fuses dQ with f32 atomic adds")
        )
    if _last_choice:
        lines.append("last traced call: " + ", ".join(f"{k}={v}" for k, v in _last_choice.items()))
    return "\n".join(lines)


def kernel_segs(segs):
    """The Pallas kernels' int32 segment ids. 64-bit ids (x64) become their rank among
    this call's q and kv ids: equal ids stay equal, different ids (beyond int32 too)
    stay different and in order, so the kernels skip the same tiles."""
    if segs is None or segs[0].dtype.itemsize <= 4:
        return segs
    table = jnp.sort(jnp.concatenate(segs, axis=1), axis=1)
    # Unrolled: an XLA while loop would make the host wait on the GPU at every trip.
    rank = jax.vmap(functools.partial(jnp.searchsorted, method="scan_unrolled"))
    return tuple(rank(table, s).astype(jnp.int32) for s in segs)


def attention_fwd(q, k, v, segs, *, mask: Mask, scale: float, out_dtype, kernel: Kernel):
    """Kernel contract, forward: `(o [B,T,N,H] out_dtype, lse [B,N,T] f32)`.

    Attention of `q` against one K/V block under `mask`; rows that see nothing get
    o = 0, lse = -inf, so partial results merge with `logaddexp`.
    """
    mask = mask.for_kernels(q.shape[1], k.shape[1])
    if kernel.name == "xla":
        return xla_fwd(q, k, v, mask=mask, segs=segs, scale=scale, out_dtype=out_dtype)
    segs = kernel_segs(segs)
    if kernel.name == "pallas_mosaic":
        bs = kernel.block_sizes
        return mosaic_fwd(
            q,
            k,
            v,
            segs,
            mask=mask,
            scale=scale,
            out_dtype=out_dtype,
            block_kv=bs.block_kv,
            stages=bs.num_stages,
            interpret=kernel.interpret,
            own_tiles=kernel.default_tiles,
        )
    return flash_fwd(
        q,
        k,
        v,
        segs,
        mask=mask,
        scale=scale,
        out_dtype=out_dtype,
        block_sizes=kernel.block_sizes,
        interpret=kernel.interpret,
    )


def dq_accumulator(q, kernel: Kernel):
    """An f32 Ref of q's shape that `attention_bwd(..., dq_into=)` calls may add their dQ
    into, divided by the softmax scale (the fused Mosaic backward, compiled; the caller
    multiplies the sum by `scale` once), or None where the kernel cannot: then each call
    returns its dQ. Unvarying inside a `shard_map` (Pallas refuses varying
    Refs); read it with `dq_accumulated`."""
    if kernel.name != "pallas_mosaic":
        return None
    bs = kernel.block_sizes
    if not adds_dq_into(
        q.shape, q.shape[-1], kernel.deterministic, bs.block_q_dkv, kernel.interpret
    ):
        return None
    return jax.new_ref(jnp.zeros(q.shape, jnp.float32))


def dq_accumulated(acc, q, scale: float):
    """The dQ summed in `acc` (from `dq_accumulator`): read, marked varying like `q`, and
    multiplied by `scale` (the kernels add `dS K`)."""
    return vary(acc[...], varying_axes(q)) * scale


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _first_order_only(name: str, args):
    """`args` as they are; differentiated (a gradient of a gradient through the Pallas
    backward kernels, which have no derivative), a one-line error naming `name`."""
    return args


@_first_order_only.defjvp
def _second_order(name: str, primals, tangents):
    raise NotImplementedError(
        f"a gradient of a gradient through implementation={name!r} is not defined (its "
        "backward kernels have no derivative of their own); implementation='xla' has one"
    )


def attention_bwd(
    q,
    k,
    v,
    do,
    lse,
    delta,
    segs,
    *,
    mask: Mask,
    scale: float,
    grad_dtype,
    kernel: Kernel,
    dq_into=None,
):
    """Kernel contract, backward: `(dq, dk, dv)` in `grad_dtype`.

    Uses the *global* `lse` `[B,N,T]` and `delta = rowsum(dO * O_global) - dLSE`
    `[B,N,T]` f32, so nothing of the forward is recomputed. `dq_into`: an accumulator
    from `dq_accumulator` (f32 gradients); dQ / scale is added into it and dQ returned
    as None.
    """
    mask = mask.for_kernels(q.shape[1], k.shape[1])
    if kernel.name == "xla":
        return xla_bwd(
            q, k, v, do, lse, delta, mask=mask, segs=segs, scale=scale, grad_dtype=grad_dtype
        )
    segs = kernel_segs(segs)
    q, k, v, do, lse, delta = _first_order_only(kernel.name, (q, k, v, do, lse, delta))
    if kernel.name == "pallas_mosaic":
        bs = kernel.block_sizes
        return mosaic_bwd(
            q,
            k,
            v,
            do,
            lse,
            delta,
            segs,
            mask=mask,
            scale=scale,
            grad_dtype=grad_dtype,
            block_q_dkv=bs.block_q_dkv,
            block_kv_dq=bs.block_kv_dq,
            stages=bs.num_stages_bwd,
            deterministic=kernel.deterministic,
            interpret=kernel.interpret,
            dq_into=dq_into,
            head_shares=bs.head_shares_dkv,
        )
    if dq_into is not None:
        raise ValueError(f"dq_into is for the fused Mosaic backward, not {kernel.name!r}")
    return flash_bwd(
        q,
        k,
        v,
        do,
        lse,
        delta,
        segs,
        mask=mask,
        scale=scale,
        grad_dtype=grad_dtype,
        block_sizes=kernel.block_sizes,
        interpret=kernel.interpret,
    )


def delta_from(o, do, dlse=None):
    """`rowsum(dO * O) - dLSE` in f32, `[B,N,T]` (FA-2 §3.2's D, plus the LSE cotangent)."""
    delta = jnp.einsum("btnh,btnh->bnt", o.astype(jnp.float32), do.astype(jnp.float32))
    return delta if dlse is None else delta - dlse.astype(jnp.float32)
