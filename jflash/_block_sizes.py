"""Tuning knobs of the Pallas kernels: one frozen dataclass, one function of defaults."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jflash._validation import MAX_HEAD_DIM, SUPPORTED_DTYPES, as_bool, is_int

# What the Mosaic (Hopper) kernels take: wgmma operands of 2 bytes, these head dims.
MOSAIC_HEAD_DIMS = (64, 128)
MOSAIC_DTYPES = (jnp.bfloat16, jnp.float16)


def mosaic_shape_unsupported(head_dim: int, dtype) -> str | None:
    """Why the Mosaic kernels cannot take this head dim or dtype (None: they can)."""
    if head_dim not in MOSAIC_HEAD_DIMS:
        return f"{head_dim=} is not one of {MOSAIC_HEAD_DIMS}"
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in MOSAIC_DTYPES]:
        return f"dtype={jnp.dtype(dtype).name} is not bfloat16/float16 (wgmma operands)"
    return None


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile shapes and launch parameters of the Pallas kernels.

    Attributes:
      block_q, block_kv: forward tile (queries per program, keys per loop step).
      block_q_dkv, block_kv_dkv: dK/dV kernel (queries per loop step, keys per program).
      block_q_dq, block_kv_dq: dQ kernel (queries per program, keys per loop step).
      num_warps, num_stages: forward launch parameters.
      num_warps_bwd, num_stages_bwd: backward launch parameters.
      head_shares_dkv: Mosaic dK/dV launch: CTAs per KV head, each over
        group / head_shares_dkv of its query heads (a divisor of the group); 0 (the
        default) lets jflash choose: several only for causal launches of up to a wave
        and a half, and two for causal rows of 16k queries or more at head dim 128
        (8k in launches of up to four waves; docs/library.md). The Triton kernels take
        0 only.

    For `implementation="pallas_mosaic"`: the per-program rows (`block_q`,
    `block_kv_dkv`, `block_q_dq`) are 64 per compute warpgroup (two per CTA), the
    streamed blocks (`block_kv`, `block_q_dkv`, `block_kv_dq`) are 64 or more (every
    block is a power of two), `num_stages`/`num_stages_bwd` are the TMA pipeline depths
    (lowered where shared memory would overflow) and `num_warps*` are unused.
    """

    block_q: int = 128
    block_kv: int = 64
    block_q_dkv: int = 64
    block_kv_dkv: int = 64
    block_q_dq: int = 64
    block_kv_dq: int = 64
    num_warps: int = 8
    num_stages: int = 3
    num_warps_bwd: int = 4
    num_stages_bwd: int = 2
    head_shares_dkv: int = 0

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not is_int(value):
                raise ValueError(f"BlockSizes.{f.name}={value!r} must be an int")
            object.__setattr__(self, f.name, int(value))  # numpy ints as Python ints
            if f.name.startswith("block_") and not (_is_pow2(value) and value >= 16):
                raise ValueError(f"BlockSizes.{f.name}={value} must be a power of two >= 16")
            if f.name.startswith("num_warps") and value not in (1, 2, 4, 8, 16):
                raise ValueError(f"BlockSizes.{f.name}={value} must be 1, 2, 4, 8 or 16")
            if f.name.startswith("num_stages") and not 1 <= value <= 8:
                raise ValueError(f"BlockSizes.{f.name}={value} must be in 1..8")
            if f.name == "head_shares_dkv" and value < 0:
                raise ValueError(f"BlockSizes.{f.name}={value} must be >= 0 (0: jflash chooses)")


def _fit(block: int, length: int) -> int:
    """Shrinks a block for short sequences (never below 16, stays a power of two)."""
    cap = max(16, 1 << (max(length, 1) - 1).bit_length())
    return min(block, cap)


def _check_problem(seq_len, kv_len, head_dim, dtype) -> None:
    """The sizes `default_block_sizes` is asked about, as `flash_attention` takes them."""
    for name, value in (("seq_len", seq_len), ("kv_len", kv_len), ("head_dim", head_dim)):
        if value is None and name == "kv_len":
            continue
        if not is_int(value) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"{head_dim=} is not supported; jflash handles 1..{MAX_HEAD_DIM}")
    try:
        supported = jnp.dtype(dtype) in SUPPORTED_DTYPES
    except TypeError:
        supported = False
    if not supported:
        raise ValueError(f"{dtype=} must be bfloat16, float16 or float32")


def default_block_sizes(
    seq_len: int,
    head_dim: int,
    dtype,
    device_kind: str = "gpu",
    kv_len: int | None = None,
    implementation: str = "pallas_triton",
    deterministic: bool = False,
) -> BlockSizes:
    """The one place where tile shapes are chosen (measured on H100/H200, BENCHMARKS.md).

    Args:
      seq_len: query length; kv_len: key length (defaults to seq_len).
      head_dim: head dimension before padding.
      dtype: input dtype (f32 tiles are halved to fit shared memory).
      device_kind: "gpu" (the default) for a compiled kernel, "cpu" for interpret mode
        (big tiles, few grid steps: the interpreter is slow per step, not per element);
        the Mosaic tiles are the same for both.
      implementation: "pallas_triton" (the default) or "pallas_mosaic" (head_dim 64 or
        128, bfloat16 or float16: the `BlockSizes` notes).
      deterministic: (default False) the Mosaic backward without the fused dQ (its own
        query steps).
    """
    _check_problem(seq_len, kv_len, head_dim, dtype)
    if device_kind not in ("gpu", "cpu"):
        raise ValueError(f"{device_kind=} must be 'gpu' (compiled) or 'cpu' (interpret mode)")
    deterministic = as_bool(deterministic, f"{deterministic=} must be a bool")
    if implementation == "pallas_mosaic":
        if why := mosaic_shape_unsupported(head_dim, dtype):
            raise ValueError(f"the Mosaic kernels take no tiles here: {why}")
        return mosaic_block_sizes(head_dim, deterministic=deterministic)
    if implementation != "pallas_triton":
        raise ValueError(
            f"{implementation=}: block sizes exist for 'pallas_triton' and 'pallas_mosaic' "
            "('xla' takes none)"
        )
    kv_len = seq_len if kv_len is None else kv_len
    wide = np.dtype(dtype).itemsize >= 4 or head_dim > 128
    if device_kind == "cpu":
        bq, bk = 64, 64
        return BlockSizes(
            block_q=_fit(bq, seq_len),
            block_kv=_fit(bk, kv_len),
            block_q_dkv=_fit(bq, seq_len),
            block_kv_dkv=_fit(bk, kv_len),
            block_q_dq=_fit(bq, seq_len),
            block_kv_dq=_fit(bk, kv_len),
        )
    # Triton tiles from `benchmarks/kernel.py --tune` sweeps at 16k on an H100 (bf16,
    # causal, GQA 32/8): forward 128x128, 8 warps, 3 stages 3% ahead of 128x64; dK/dV
    # 64q x 128kv with dQ 128q x 64kv, 8 warps, 3 stages 3% ahead of 64x64; D = 64 best
    # at 128x64 / 64x64. Rerun the sweep on new hardware.
    if wide:  # f32 tiles or D > 128: halve the tiles so they fit shared memory
        fwd = (64, 32, 4, 2)
        bwd = (32, 32, 32, 32, 4, 2)
    elif head_dim <= 64:
        fwd = (128, 64, 8, 4)
        bwd = (64, 64, 64, 64, 4, 2)
    else:
        fwd = (128, 128, 8, 3)
        bwd = (64, 128, 128, 64, 8, 3)
    return BlockSizes(
        block_q=_fit(fwd[0], seq_len),
        block_kv=_fit(fwd[1], kv_len),
        num_warps=fwd[2],
        num_stages=fwd[3],
        block_q_dkv=_fit(bwd[0], seq_len),
        block_kv_dkv=_fit(bwd[1], kv_len),
        block_q_dq=_fit(bwd[2], seq_len),
        block_kv_dq=_fit(bwd[3], kv_len),
        num_warps_bwd=bwd[4],
        num_stages_bwd=bwd[5],
    )


# Mosaic GPU kernels: every CTA has two compute warpgroups of 64 rows (the M of one
# wgmma), so the per-warpgroup row blocks are fixed at 64; the streamed blocks and the
# pipeline depth are the knobs. Stages are lowered automatically where a variant
# (f32 outputs for the ring) would not fit shared memory.
MOSAIC_WG_ROWS = 64
_MOSAIC_FIXED = ("block_q", "block_kv_dkv", "block_q_dq")
_MOSAIC_STREAMED = ("block_kv", "block_q_dkv", "block_kv_dq")


def mosaic_block_sizes(head_dim: int, *, deterministic: bool = False) -> BlockSizes:
    """Defaults of the Mosaic GPU kernels (measured on H100/H200, BENCHMARKS.md);
    `deterministic`: for the two-kernel backward."""
    return BlockSizes(
        block_q=MOSAIC_WG_ROWS,
        # D=64: a 256-key step halves the steps (barriers, rescales) per key; its f32
        # S still fits the registers (no spill), and 2 stages beat 3 (measured with
        # `benchmarks/kernel.py --tune --tune-impl jflash_mosaic --which fwd --head-dim 64`).
        # D=128: S and O at 256 keys would not fit.
        block_kv=256 if head_dim <= 64 else 128,
        num_stages=2,
        # D=64, fused dQ: 128-query dK/dV steps, the dQ split by rows between the
        # warpgroups (`jflash._mosaic_bwd.ROW_SPLIT_DQ_HEAD_DIMS`). The two-kernel
        # backward keeps K and V in registers there, which 64-query steps leave room for.
        block_q_dkv=128 if head_dim == 64 and not deterministic else 64,
        block_kv_dkv=MOSAIC_WG_ROWS,
        block_q_dq=MOSAIC_WG_ROWS,
        block_kv_dq=64,
        num_stages_bwd=2,
        num_warps=4,  # unused by Mosaic (warpgroups: 2 compute + 1 memory)
        num_warps_bwd=4,
    )


def check_head_shares(shares: int, group: int) -> None:
    """`BlockSizes.head_shares_dkv` (`shares`) is 0 or divides `group`, the query heads
    per KV head."""
    if shares and group % shares:
        raise ValueError(
            f"BlockSizes.head_shares_dkv={shares} must divide the {group} query heads per "
            "KV head (or be 0: jflash chooses)"
        )


def check_mosaic_block_sizes(bs: BlockSizes, *, fused_block_q: tuple[int, ...] = ()) -> None:
    """`fused_block_q`: the query steps the fused dQ takes here (empty: dQ not fused)."""
    if fused_block_q and bs.block_q_dkv not in fused_block_q:
        allowed = " or ".join(map(str, fused_block_q))
        raise ValueError(
            f"BlockSizes.block_q_dkv={bs.block_q_dkv}: the fused dQ of the Mosaic backward "
            f"(deterministic=False) at this head dim takes {allowed} queries per step; use "
            f"{allowed}, or deterministic=True"
        )
    for name in _MOSAIC_FIXED:
        if getattr(bs, name) != MOSAIC_WG_ROWS:
            raise ValueError(
                f"BlockSizes.{name}={getattr(bs, name)}: the Mosaic kernels give each "
                f"warpgroup {MOSAIC_WG_ROWS} rows; it must be {MOSAIC_WG_ROWS}"
            )
    for name in _MOSAIC_STREAMED:
        if getattr(bs, name) % 64:
            raise ValueError(
                f"BlockSizes.{name}={getattr(bs, name)}: the Mosaic kernels stream 64 or more"
            )
    for name in ("num_stages", "num_stages_bwd"):
        if getattr(bs, name) < 2:
            raise ValueError(f"BlockSizes.{name}={getattr(bs, name)}: Mosaic pipelines need >= 2")
