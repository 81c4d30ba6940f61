"""FlashAttention backward as Pallas Mosaic GPU kernels (Hopper: TMA, wgmma).

The kernels take the *global* LSE and `delta = rowsum(dO * O) - dLSE`, so no forward
is recomputed (the ring's contract), as `-LSE / scale` and `-delta`. In the dK/dV
kernel the tensor cores add them into the S^T and dP^T accumulators (a K = 16 wgmma of
ones times their bf16 parts, `_row_parts`, streamed with Q and dO), so `P = exp2(S *
scale * log2 e)` and `dS = P * dP` take no broadcast operand and no thread loads them:
there they vary along the columns, 16 values per thread. Held as broadcast operands
they cost 32 registers per thread next to dK and dV; loaded into the accumulators at
each step's start they stalled it (9% of the compute warps' stall samples at D = 128);
from the tensor cores the non-causal D = 128 backward runs 3% faster, the rest even
(H200, BENCHMARKS.md). Their K = 16 wgmmas are 5% of the kernel's tensor work at D = 128;
loaded into registers once the step's wgmmas are issued, as FlashAttention-3 does, the
terms spilled registers here and the backward ran 1-7% slower. The dQ kernel holds two
such registers per thread and adds them after its matmuls (starting its accumulators
there cost it 2-4%: more moves per step).

- dK/dV: one CTA per 128 keys of one KV head (two compute warpgroups of 64 keys);
  the memory warpgroup (one warp of it at D = 64, `MEMORY_WARP_HEAD_DIMS`) streams (Q,
  dO, LSE and delta parts) tiles of every query head of the group in turn, so GQA needs
  no repeated K/V and no reduction afterwards (causal, D = 128, no segment ids: every
  other head from the last query step down, `ALTERNATE_PASSES_SPLITS`). A causal launch
  of few CTAs, or of long rows at D = 128, shares each group among several CTAs instead,
  each reading its KV head's K and V in place and adding its dK/dV into that KV head's
  f32 accumulators with TMA reduce-adds (`head_split`).
- dQ, two ways:
  - fused (`deterministic=False`; gradients in the inputs' dtype or f32): the dK/dV kernel
    also forms each step's dQ contribution `dS K` (dS goes through shared memory) and
    adds it to an f32 dQ in HBM with a TMA reduce-add, unscaled: the softmax scale
    multiplies the sum once, where it is converted (as in FlashAttention-3; 32 fewer
    multiplies per thread and step). 5 matmuls per tile instead of 7; the order of the
    f32 additions varies from run to run. The warpgroups share their dS^T through
    shared memory, and each adds a `[64, 64]` part of the dQ over all 128 keys, which
    keeps its accumulator at 32 registers: at D = 128 one column half of a 64-query step
    (`SPLIT_DQ_HEAD_DIMS`), at D = 64 the rows of 64 of a 128-query step's queries
    (`ROW_SPLIT_DQ_HEAD_DIMS`; with `block_q_dkv=64` each warpgroup adds its own keys'
    dQ instead).
  - two kernels (deterministic): a second kernel, one CTA per 128 queries of one head,
    recomputes S and dP while its memory warpgroup (one warp of it at D = 64) streams
    K and V. No atomics: bitwise reproducible.

The fused D = 128 kernel reads a zero from shared memory at every step and indexes its
fixed K, V and dQ tiles with it. Without it, LLVM hoists the two dozen 64-bit wgmma
descriptors of those tiles out of the step loop, where ptxas spills them (412 bytes;
none now): forward+backward 472 -> 591 TFLOP/s at 64k on an H100 (BENCHMARKS.md).

Both kernels issue the S and dP wgmmas together and exponentiate S while dP is still
on the tensor cores (`wgmma_pair`: dQ kernel -4 to -5%). Left to itself, ptxas puts
the wait for dP^T after a quarter of the exponentials; the fused D = 128 step therefore
issues dV = P^T dO between them (one wgmma scope for S^T, dP^T, dV and dK), which ptxas
cannot reorder: every exponential runs under dP^T and dS is formed under dV (+0-3%
forward+backward at D = 128, H200). Tiles fixed for a warpgroup's whole loop are wgmma
A operands from registers (`A_IN_REGS`: K and V of the dK/dV kernel at D <= 64, Q and
dO of the dQ kernel), which takes their reads off shared memory: at D=64 the fused
kernel's binding resource (now at cuDNN's backward).

Rows that see no key start S at -inf, so their probabilities are exactly 0.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jflash._block_sizes import check_head_shares
from jflash._mosaic_common import (
    COMPUTE_REGS,
    COMPUTE_WGS,
    MEMORY_REGS,
    WG_ROWS,
    Geometry,
    col_ids,
    drain,
    fit_stages,
    key_table,
    key_tile_steps,
    launch,
    lockstep,
    one_warp_streams,
    query_table,
    query_tile_steps,
    rem,
    row_ids,
    run_steps,
    same_segment,
    smem_tile,
    stream_kv,
    tile_grid,
    visible,
    wgmma_into,
    wgmma_pair,
    wgmma_sum,
)
from jflash._triton_common import LOG2E, pad_to, round_up
from jflash._vma import match, struct, vary, varying_axes
from jflash._work_items import HOPPER_SMS, sm_count

# Head dims where the dK/dV kernel fuses the dQ. At D=64 with 64-query steps each
# warpgroup adds its own keys' dQ (H100: 0.94-0.97x cuDNN against 0.91 for two kernels);
# 128-query steps split it by rows (`ROW_SPLIT_DQ_HEAD_DIMS`, the default). At D=128 an
# own [64, 128] f32 accumulator next to dK and dV spills registers and doubles the
# reduce-add traffic (0.62-0.79x, commit c8ba412): D=128 splits the dQ by columns
# (`SPLIT_DQ_HEAD_DIMS`).
FUSED_DQ_HEAD_DIMS = (64,)
# Register split of the split-dQ kernel (setmaxnreg): 2 x 240 + 24 per thread x 128
# threads = 64,512, as COMPUTE_REGS / MEMORY_REGS; its memory warpgroup needs no more.
# Against 232 + 40: no spill instead of 84 bytes, forward+backward 1-2% faster.
SPLIT_REGS = (240, 24)
# Head dims where the fused dQ is split between the warpgroups (`_dkv_kernel`'s
# `split`): both write their dS^T to shared memory, and each forms the dQ of its half
# of the columns from all of the CTA's keys, so a warpgroup holds a [64, D/2] f32
# accumulator (32 registers at D=128) and the reduce-add traffic is one [64, D] tile per
# step, not two. f32 gradients (the ring's) leave through the [64, D/2] f32 dQ tile of
# each warpgroup, one column half at a time.
SPLIT_DQ_HEAD_DIMS = (128,)
# The dK/dV kernel's named scopes, one each per step, which Mosaic GPU's on-device
# profiler records (`_mosaic_common.profiling`, `benchmarks/timeline.py --kernel dkv`);
# outside the profiler they change no instruction. Every form waits for its inputs;
# the rest are the fused D = 128 step's (the dQ split by columns). The end of its wgmma
# scope, which waits for dV and dK, is left out (no scope can hold it alone).
DKV_STEP_SCOPES = {
    "in_wait": "wait for the step's Q, dO and per-query terms",
    "s_wait": "wait for S^T (dP^T still on the tensor cores)",
    "exp": "P = exp2(S^T): the probabilities, masked where needed; issue dV += P dO",
    "dp_wait": "wait for dP^T",
    "ds": "dS^T = P (dP^T): to shared memory for the dQ, issue dK += dS^T Q",
    "ds_wait": "release the Q/dO slot, wait for the other warpgroup's dS^T",
    "dq": "this warpgroup's dQ column half from both dS^T, reduce-added into HBM",
}
# Splits whose causal dK/dV kernel streams the odd query heads of its group backwards,
# from the last query step down to the diagonal. A CTA streams its group's heads in
# turn, each from its diagonal to the end; a later key tile's CTA has fewer steps per
# head, so head by head the CTAs in flight drift apart along the sequence and the Q, dO
# and dQ blocks they share leave L2 between one CTA's use and the next. A head walked
# back down starts where the previous one ended, which keeps the odd heads as close
# together as the even ones. H200, causal 64k, D = 128: DRAM read 25 -> 12.8 GB and
# written 16.1 -> 9.2 GB per call, forward+backward +1.1-1.7% at 16k and +0.3-0.7% at
# 64k (BENCHMARKS.md). Every head backwards: 22.3 GB read, slower. At D = 64 (the rows
# split) it read 0.996-0.998x, and with segment ids (a key tile's queries end with its
# document: short passes, no drift to undo) 0.988x on the 64k packed row: not taken.
ALTERNATE_PASSES_SPLITS = ("cols",)
# Head dims where 128-query steps (`block_q_dkv=128`) split the fused dQ by rows: both
# warpgroups write their dS^T [64 keys, 128 queries] to shared memory, and each forms
# the dQ of 64 of the step's queries over all of the CTA's 128 keys ([64, D] f32, 32
# registers at D=64), one reduce-add of [64, D] per warpgroup and step, so half the
# reduce-add traffic per query of 64-query steps. K and V stay in shared memory there
# (S^T and dP^T at 128 queries take the registers they had). FlashAttention-3's
# D = 64 backward shares its work the same way. H200, against each warpgroup's own dQ
# at 64-query steps: forward+backward 1.06x (causal 16k), 1.08x (32k), 1.16x (full
# 16k); 1.10-1.14x cuDNN (BENCHMARKS.md).
ROW_SPLIT_DQ_HEAD_DIMS = (64,)

# Head dims whose backward kernels (dK/dV, and the deterministic dQ kernel) stream
# their inputs from one warp of the memory warpgroup (`plgpu.warp_map`) instead of all
# four, where each copy first synchronised the warpgroup (a `bar.sync` per copy) and
# 128 threads polled every barrier: 114 instructions per step and warp beside the
# compute warps' ~470. Forward+backward 1.01-1.02x at causal 32k D = 64 (two runs),
# 0.987-0.988x at causal 16k and 64k D = 128; deterministic 1.01x at causal 4k and 16k
# D = 64, 0.995x at 16k D = 128 (H200, BENCHMARKS.md). Inside `shard_map` too:
# `launch` hands the kernel operands that vary over no manual axis.
MEMORY_WARP_HEAD_DIMS = (64,)

# The backward kernels whose launches take the batch rows one after another where the
# heads are outermost (`tile_grid`'s `rows_outer`), instead of side by side: with 16
# rows of 4k tokens the dK/dV CTAs in flight stream one row's Q, dO and dQ instead of
# 16 rows', which L2 then serves. H200, forward+backward against the rows side by side
# (the forward unchanged): full 4k 1.038x (D = 128), 1.028x (D = 64); causal 4k and 16k,
# full 16k 1.007-1.012x; deterministic full 4k D = 128 1.033x (BENCHMARKS.md). Batch 1
# launches are the same either way.
BWD_ROWS_OUTER = ("dkv", "dq")

# A causal dK/dV launch of one wave or less (a CTA per SM of the GPU, `sm_count`; one
# CTA per 128 keys of a KV head: short rows, few KV heads, batch 1) shares each KV head's
# group of query heads among `head_split` CTAs: each share reads its KV head's K and V in
# place (1.02-1.13x forward+backward over a repeated copy of them, 1k-8k rows) and adds
# its dK and dV into the KV head's f32 accumulators with TMA reduce-adds, cast after the
# kernel (1.03-1.04x at 1k-2k, D = 128, over an f32 slice per share summed by XLA, which
# the deterministic backward keeps; FlashAttention-3 runs a CTA per query head and adds
# its GQA dK/dV the same way). With a CTA per KV head such a launch runs as long as its
# heaviest tile (the first keys see every query) while the other SMs idle. On an H200,
# forward+backward, GQA 4:1, four shares: 1k tokens x 8 KV heads (64 CTAs) 0.181 ->
# 0.117 ms, 8k x 2 KV heads (128 CTAs) 1.23 -> 0.90 ms. Shares: the least that
# reaches HEAD_SPLIT_MIN_CTAS, none past HEAD_SPLIT_MAX_CTAS, which bounds the reduce-adds
# into each accumulator's rows and the interpreter's f32 slices (one per share: 2048 x 128
# keys x D x 4 bytes each of dK and dV, 128 MiB at D = 128).
# Past one wave the SMs take new tiles as they finish, and the heaviest tile (n query
# tiles of work, the mean n / 2) stays longer than an SM's mean share of the work while
# the launch is under two waves; two shares (not more: four read 0.99x at 192 CTAs) up to
# HEAD_SPLIT_TWO_SHARES_WAVES, a wave and a half. Unsplit time / two shares, D = 128 / 64:
# 160 CTAs 1.10 / 1.13, 192 CTAs 1.06 / 1.04, 224 CTAs 1.01 / 0.99, 256 CTAs 0.97 / 0.96
# (BENCHMARKS.md, "Short causal launches"). A non-causal launch (every tile the same
# work) was 4-8% slower at 128 CTAs, so it does not split.
# Measured on 132 SMs (H200); a wave is the GPU's own SM count.
HEAD_SPLIT_TWO_SHARES_WAVES = 1.5
HEAD_SPLIT_MIN_CTAS = 512
HEAD_SPLIT_MAX_CTAS = 2048

# Long causal rows at these head dims (`LONG_ROWS_TWO_SHARES_MIN_LEN` queries or more,
# no segment ids, dQ fused) share each KV head's query heads between two CTAs at any
# launch size, each streaming half the group. A CTA per KV head streams the group's
# heads in turn, each from its diagonal to the last query step (or back), so CTAs of
# different key tiles drift into different heads and the Q, dO and dQ tiles they share
# leave L2 between them; half the group halves that drift, for the f32 reduce-adds of
# dK and dV and twice the K/V loads. H100, forward+backward, 32/8 heads, against a CTA
# per KV head: causal 64k x 1 1.02 / 1.02 (two runs), 16k x 4 1.04; 4k x 16 0.975, full
# 16k 0.995; four shares 1.01 (64k, 16k), 0.958 (4k); D = 64 (128-query steps, dQ
# split by rows) 0.983 at causal 16k (BENCHMARKS.md, "Kept changes").
# Rows of LONG_ROWS_SHORT_LAUNCH_MIN_LEN queries or more take two shares too where the
# launch is at most LONG_ROWS_SHORT_LAUNCH_WAVES waves: causal 8k x 1 (512 CTAs, 3.9
# waves on 132 SMs; a ring's 8k diagonal block) 1.03x in three runs, one ring rank at
# 8k tokens per GPU 1.01x; 8k x 2 (7.8 waves) 1.008x, 8k x 4 (15.5 waves) 0.999x, 8k x 8
# (4096 CTAs) 0.971x, so longer launches of such rows keep one (H100, BENCHMARKS.md).
LONG_ROWS_TWO_SHARES_MIN_LEN = 16384
LONG_ROWS_SHORT_LAUNCH_MIN_LEN = 8192
LONG_ROWS_SHORT_LAUNCH_WAVES = 4
LONG_ROWS_TWO_SHARES_HEAD_DIMS = (128,)


def head_split(
    ctas: int, group: int, causal: bool, sms: int = HOPPER_SMS, *, long_rows: bool = False
) -> int:
    """The CTAs per KV head of a dK/dV launch of `ctas` (one per key tile and KV head)
    on a GPU of `sms` SMs (one wave): 1 unless it is causal and at most
    `HEAD_SPLIT_TWO_SHARES_WAVES` waves, or of `long_rows` (`long_rows_split`); past one
    wave 2 where 2 divides `group`; at most one wave, the least divisor of `group` that
    takes it to `HEAD_SPLIT_MIN_CTAS`, else the largest, none that takes it past
    `HEAD_SPLIT_MAX_CTAS`."""
    if not causal:
        return 1
    two = 2 if group % 2 == 0 else 1
    if ctas > HEAD_SPLIT_TWO_SHARES_WAVES * sms:
        return two if long_rows else 1
    if ctas > sms:
        return two
    shares = [d for d in range(1, group + 1) if group % d == 0]
    shares = [d for d in shares if d == 1 or ctas * d <= HEAD_SPLIT_MAX_CTAS]
    return next((d for d in shares if ctas * d >= HEAD_SPLIT_MIN_CTAS), shares[-1])


def long_rows_split(
    head_dim: int, q_len: int, segments: bool, fused: bool, ctas: int, sms: int
) -> bool:
    """Whether a causal dK/dV launch of `ctas` CTAs on `sms` SMs takes two shares for
    its long rows (the `LONG_ROWS_*` rule): rows of `LONG_ROWS_TWO_SHARES_MIN_LEN`
    queries or more at any size, of `LONG_ROWS_SHORT_LAUNCH_MIN_LEN` or more in a
    launch of at most `LONG_ROWS_SHORT_LAUNCH_WAVES` waves; without segment ids, dQ
    fused."""
    long_enough = q_len >= LONG_ROWS_TWO_SHARES_MIN_LEN or (
        q_len >= LONG_ROWS_SHORT_LAUNCH_MIN_LEN and ctas <= LONG_ROWS_SHORT_LAUNCH_WAVES * sms
    )
    return head_dim in LONG_ROWS_TWO_SHARES_HEAD_DIMS and long_enough and not segments and fused


def head_split_rule(sms: int) -> str:
    """`head_split` on a GPU of `sms` SMs, in one line (for `jflash.describe`)."""
    two = int(HEAD_SPLIT_TWO_SHARES_WAVES * sms)
    return (
        f"the Mosaic backward: a causal dK/dV launch (a CTA per 128 keys and KV head) of at "
        f"most {sms} CTAs (one wave on {sms} SMs) shares each KV head's query heads among "
        f"the least number of CTAs that reaches {HEAD_SPLIT_MIN_CTAS} (none past "
        f"{HEAD_SPLIT_MAX_CTAS}), one of {sms + 1}-{two} CTAs among two, as does one of "
        f"any size over rows of {LONG_ROWS_TWO_SHARES_MIN_LEN} queries or more, and one of "
        f"at most {LONG_ROWS_SHORT_LAUNCH_WAVES * sms} CTAs over rows of "
        f"{LONG_ROWS_SHORT_LAUNCH_MIN_LEN} or more, at head_dim "
        f"{'/'.join(map(str, LONG_ROWS_TWO_SHARES_HEAD_DIMS))} (no segment ids, dQ "
        "fused); the shares add their f32 dK/dV (deterministic: slices summed in a fixed "
        "order); other launches run a CTA per KV head (BlockSizes.head_shares_dkv sets it)"
    )


# Which tiles, fixed for a warpgroup's whole loop, are wgmma A operands from registers
# instead of shared memory, per kernel and head dim: the dK/dV kernel's K and V, the
# dQ kernel's Q and dO. Each costs D/4 registers per thread.
A_IN_REGS = {"dkv": lambda d: d <= 64, "dq": lambda d: d <= 128}


def fuses_dq(head_dim: int, deterministic: bool, grads_storable: bool = True) -> bool:
    """Whether the backward adds dQ inside the dK/dV kernel (f32 reduce-add).
    `grads_storable`: the gradients are in the inputs' dtype or f32; the split dQ needs
    that (another dtype's output tile does not fit beside its dS and dQ tiles)."""
    if deterministic:
        return False
    return head_dim in FUSED_DQ_HEAD_DIMS or (head_dim in SPLIT_DQ_HEAD_DIMS and grads_storable)


def adds_dq_into(q_shape, head_dim: int, deterministic: bool, block_q_dkv: int, interpret: bool):
    """Whether `mosaic_bwd` can add dQ into a caller's f32 accumulator of `q_shape`
    (`dq_into`): the fused kernel, compiled (the interpreter has no reduce-add), and no
    query padding (the accumulator is the queries' own shape)."""
    t = q_shape[1]
    pad = max(COMPUTE_WGS * WG_ROWS, block_q_dkv)
    return not interpret and fuses_dq(head_dim, deterministic) and t % pad == 0


def splits_dq(
    head_dim: int, deterministic: bool, block_q: int, grads_storable: bool = True
) -> str | None:
    """How the fused dQ is shared between the warpgroups at `block_q` queries per step:
    "cols" (`SPLIT_DQ_HEAD_DIMS`), "rows" (`ROW_SPLIT_DQ_HEAD_DIMS` at 128-query
    steps), or None (not fused, or each warpgroup adds its own keys' dQ)."""
    if not fuses_dq(head_dim, deterministic, grads_storable):
        return None
    if head_dim in SPLIT_DQ_HEAD_DIMS:
        return "cols"
    if head_dim in ROW_SPLIT_DQ_HEAD_DIMS and block_q == COMPUTE_WGS * WG_ROWS:
        return "rows"
    return None


def fused_block_q(head_dim: int) -> tuple[int, ...]:
    """The query steps (`block_q_dkv`) the fused dQ takes at `head_dim`."""
    if head_dim in ROW_SPLIT_DQ_HEAD_DIMS:
        return (WG_ROWS, COMPUTE_WGS * WG_ROWS)
    return (WG_ROWS,)


def _store_tile(value, smem, dst, add: bool = False):
    """Registers -> SMEM -> HBM (TMA; `add`: a reduce-add into `dst`), waiting until
    SMEM may be reused (the write completes by the kernel's end, which no CTA waits
    for)."""
    smem[...] = value.astype(smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, dst, reduction_op="add" if add else None)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


# The dK/dV kernel's per-query terms (-LSE/scale, -delta) as bf16 parts: an f32 `x` is
# `c0 + c1 + c2` exactly, 8 significant bits each (the columns past 3 are zero), which
# the tensor cores add into S^T and dP^T as `ones @ parts^T` (a K = 16 wgmma, bf16
# whatever the inputs' dtype: f32's range). -inf stays -inf in c0.
PARTS = 16


def _bf16_head(x):
    """The f32 `x` cut to its top 8 significant bits (exactly a bf16): the low 16 bits
    of its pattern cleared. Not `x.astype(bf16).astype(f32)`: XLA's GPU compiler drops
    such a round trip (excess precision allowed by default), which left the parts after
    the first all zero there and the terms at bf16 precision."""
    bits = lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFF0000)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _row_parts(x):
    """f32 `[B, N, T]` -> bf16 `[B, N, T, PARTS]` whose columns sum to `x` exactly.

    Built as 32-bit words, two parts each, padded with zero words and viewed as bf16:
    XLA's GPU fusion of a 16-column bf16 concatenation wrote one element per thread
    (BENCHMARKS.md, the backward's terms)."""
    x = x.astype(jnp.float32)
    finite = jnp.isfinite(x)
    halves, rest = [], x
    for _ in range(3):
        part = _bf16_head(rest)
        halves.append(lax.bitcast_convert_type(part, jnp.uint32) >> 16)  # its bf16 bits
        rest = jnp.where(finite, rest - part, jnp.float32(0.0))
    # Little-endian: the word's low half is the lower column.
    words = jnp.stack([halves[0] | (halves[1] << 16), halves[2]], -1)
    words = jnp.pad(words, [(0, 0)] * x.ndim + [(0, PARTS // 2 - 2)])
    return lax.bitcast_convert_type(words, jnp.bfloat16).reshape(*x.shape, PARTS)


def _parts_tile(shape):
    """SMEM for `_row_parts` tiles (and their ones): 16 bf16 columns, 32-byte swizzle."""
    return plgpu.SMEM(
        shape,
        jnp.bfloat16,
        transforms=(plgpu.TilingTransform((8, PARTS)), plgpu.SwizzleTransform(2 * PARTS)),
    )


def _bcast(x, shape, dim):
    return lax.broadcast_in_dim(x, shape, [dim])


# ----------------------------------------------------------------------------- dK/dV


def _dkv_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    s_parts_ref,
    dp_parts_ref,
    *refs,
    geom: Geometry,
    block_q: int,
    stages: int,
    qk_scale: float,
    scale: float,
    grads_in_input_dtype: bool,
    segments: bool,
    fused: bool,
    split: str | None,
    memory_warp: bool,
    interpret: bool,
    shares: int,
    add_shares: bool,
):
    """`refs`: with segment ids, `q_seg`, `kv_seg` and the `key_table` first; then, if
    `fused`, the f32 dQ this kernel adds into: `[B, T, N, H]`, or in interpret mode (the
    GPU interpreter has no TMA reduce-add) one `[B, T, N, H]` slice per (key tile,
    warpgroup; per key tile if `split`), summed after; then the outputs and the scratch.

    `split` (fused only, `splits_dq`): the warpgroups share each step's dS^T through
    shared memory (two buffers, by step parity, and a barrier pair `ds_ready`) and each
    adds the dQ of its half of the columns ("cols") or of the step's queries ("rows").
    Both then walk the CTA's whole stream in lockstep (steps outside a warpgroup's own
    range run masked: P = 0 there).

    `shares`: CTAs per KV head (`head_split`): the grid's head index is KV head
    `index // shares`'s share `index % shares`; the CTA reads that KV head's K and V in
    place (`geom.group` is the share's query heads). `add_shares`: it adds its dK/dV
    into that KV head's f32 `[B, S, K, H]` accumulators (TMA reduce-add), which then
    come before the scratch in place of the outputs; else it writes its own f32 slice
    of `[B, S, K * shares, H]` outputs, summed after (interpreted: no reduce-add;
    deterministic: a fixed order of additions)."""
    qseg_ref = kvseg_ref = table_ref = dq_ref = None
    if segments:
        qseg_ref, kvseg_ref, table_ref, *refs = refs
    if fused:
        dq_ref, *refs = refs
    (
        dk_ref,
        dv_ref,
        k_smem2,
        v_smem2,
        q_smem,
        do_smem,
        s_parts,
        dp_parts,
        out_smem2,
        ds_smem2,
        dq_smem2,
        k_ids2,
        q_ids,
        kv_ready,
        in_ready,
        free,
        ds_ready,
        opaque,
        ones_smem2,
    ) = refs
    bk = WG_ROWS
    batch = lax.axis_index("batch")
    kv_head = lax.axis_index("heads")
    wg = lax.axis_index("wg")
    cta_start, st = key_tile_steps(geom, block_q, table_ref, batch, wg)
    per_head = st.cta_hi - st.cta_lo  # query steps streamed per query head

    def backwards(g):
        """Whether query head g of the group is streamed from the last query step down
        (`ALTERNATE_PASSES_SPLITS`: its odd heads, causal without segment ids; None:
        never)."""
        if geom.mask.causal and not segments and split in ALTERNATE_PASSES_SPLITS:
            return rem(g, 2) == 1
        return None

    if split is not None:
        st = lockstep(st)

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        regs = SPLIT_REGS[0] if split is not None else COMPUTE_REGS
        plgpu.set_max_registers(regs, action="increase")
        k_start = cta_start + wg * bk
        k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
        # The KV head whose K and V this share reads (int32 under x64 too).
        kv_in = lax.div(kv_head, jnp.int32(shares)) if shares > 1 else kv_head
        kv_rows = (batch, pl.ds(k_start, bk), kv_in)
        # This CTA's dK/dV: added into its KV head's (`add_shares`), or its own slice.
        rows = kv_rows if add_shares else (batch, pl.ds(k_start, bk), kv_head)
        plgpu.copy_gmem_to_smem(k_ref.at[kv_rows], k_smem, kv_ready.at[wg, jnp.int32(0)])
        plgpu.copy_gmem_to_smem(v_ref.at[kv_rows], v_smem, kv_ready.at[wg, jnp.int32(1)])
        if segments:
            plgpu.copy_gmem_to_smem(
                kvseg_ref.at[batch, pl.ds(k_start, bk)],
                k_ids2.at[wg],
                kv_ready.at[wg, jnp.int32(2)],
            )
        # A zero read from shared memory at every step (`mine` below): the step's fixed
        # shared-memory operands are indexed by it, so their 64-bit wgmma descriptors
        # are formed inside the loop instead of being hoisted out of it and held
        # (spilled) across it. H100: the split dQ spilled 412 bytes without it, the
        # two-kernel backward's dK/dV kernel at D = 128 112-136 (+3% at 16k without
        # the spill); D = 64 unchanged.
        opaque[jnp.int32(0)] = jnp.int32(0)
        # Ones: the A operand that adds the per-query terms' parts (module docstring).
        ones_smem2.at[wg][...] = jnp.ones((bk, PARTS), ones_smem2.dtype)
        plgpu.commit_smem()
        for i in range(3 if segments else 2):
            plgpu.barrier_wait(kv_ready.at[wg, jnp.int32(i)])
        k_ids = row_ids(k_ids2.at[wg]) if segments else None
        # K and V are this warpgroup's for the whole loop: at D <= 64 they sit in
        # registers (16 each per thread) as the A operands of S^T and dP^T, which takes
        # their reads off shared memory, the binding resource at D=64 (see A_IN_REGS),
        # except with the rows split, whose 128-query S^T and dP^T need those registers
        # (and whose N = 128 wgmmas read a quarter less shared memory per FLOP).
        k_a, v_a = k_smem, v_smem
        a_in_regs = A_IN_REGS["dkv"](geom.head_dim) and split != "rows"
        if a_in_regs:
            k_a = plgpu.load(k_smem, layout=plgpu.Layout.WGMMA)
            v_a = plgpu.load(v_smem, layout=plgpu.Layout.WGMMA)

        def wait_inputs(slot):
            plgpu.barrier_wait(in_ready.at[slot])  # Q, dO, LSE, delta (and ids): one barrier

        def step(qi, carry, *, g, pos, masked: bool):
            dk, dv = carry
            slot = rem(pos(qi), stages)
            with jax.named_scope("in_wait"):
                wait_inputs(slot)
            q_t, do_t = q_smem.at[slot], do_smem.at[slot]
            zero = opaque[jnp.int32(0)]
            mine, other = wg + zero, jnp.int32(COMPUTE_WGS - 1) - wg + zero
            k_dq = k_smem2.at[mine]
            k_s, v_s = (k_a, v_a) if a_in_regs else (k_dq, v_smem2.at[mine])
            q_rows = pl.ds(qi * block_q, block_q)
            head_g = kv_head * geom.group + g

            def add_dq(dq, part, cols=None, row0=None):
                """`dq` (`dS K`, not yet times `scale`) into the f32 dQ: through this
                warpgroup's SMEM tile, a TMA reduce-add (interpret: a plain store into
                slice `part`, summed after). The sum is scaled once, after the kernel.
                `cols`: the column slice it holds (if not all); `row0`: the first of its
                `WG_ROWS` rows in the step (if not all of the step's rows)."""
                rows_dq = q_rows if row0 is None else pl.ds(qi * block_q + row0, WG_ROWS)
                dq_s = dq_smem2.at[mine]
                # The previous step's reduce-add has read its SMEM long ago (a whole step
                # of matmuls ran since); wait for it before overwriting.
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                dq_s[...] = dq
                plgpu.commit_smem()
                dst = (batch, rows_dq, head_g) + (() if cols is None else (cols,))
                if interpret:
                    plgpu.copy_smem_to_gmem(dq_s, dq_ref.at[(part, *dst)])
                else:
                    plgpu.copy_smem_to_gmem(dq_s, dq_ref.at[dst], reduction_op="add")

            par = rem(pos(qi), 2)  # the split forms' dS^T buffer of this step

            def add_split_dq():
                """Once this warpgroup's dV and dK are done: the Q/dO slot released, the
                other warpgroup's dS^T awaited, and this step's dQ from both warpgroups'
                dS^T (buffer `par`), split between them by `split`, into the f32 dQ."""
                with jax.named_scope("ds_wait"):
                    plgpu.barrier_arrive(free.at[slot])
                    plgpu.barrier_wait(ds_ready.at[par])
                keys = (mine, other)
                part = lax.axis_index("kv_tiles")
                # Static halves, one warpgroup each (a dynamic slice: slower).
                for w in range(COMPUTE_WGS):

                    @pl.when(wg == w)
                    @jax.named_scope("dq")
                    def _(w=w):
                        if split == "cols":  # dQ[:, cols] = dS K over both warpgroups' keys
                            half = geom.head_dim // COMPUTE_WGS
                            cols = pl.ds(w * half, half)
                            shape = (block_q, half)
                            add = functools.partial(add_dq, part=part, cols=cols)
                            terms = [
                                (ds_smem2.at[par, j].T, k_smem2.at[j].at[:, cols]) for j in keys
                            ]
                        else:  # dQ[rows] = dS[rows] K over both warpgroups' keys
                            rows_w = pl.ds(w * WG_ROWS, WG_ROWS)
                            shape = (WG_ROWS, geom.head_dim)
                            add = functools.partial(add_dq, part=part, row0=w * WG_ROWS)
                            terms = [
                                (ds_smem2.at[par, j].at[:, rows_w].T, k_smem2.at[j]) for j in keys
                            ]
                        zeros_dq = plgpu.layout_cast(
                            jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA
                        )
                        add(wgmma_sum(zeros_dq, terms, interpret=interpret))

            ids = col_ids(q_ids.at[slot]) if masked and segments else None

            # S^T = K Q^T - LSE/scale, dP^T = V dO^T - delta: [keys, queries] f32. The
            # per-query terms come from the tensor cores too: ones [keys, 16] times the
            # term's bf16 parts [16, queries] (`_row_parts`), so no thread loads them.
            zeros = plgpu.layout_cast(jnp.zeros((bk, block_q), jnp.float32), plgpu.Layout.WGMMA)
            ones = ones_smem2.at[mine]
            init = (zeros, zeros)

            def probabilities(s):  # while dP^T is still on the tensor cores
                p = jnp.exp2(s * qk_scale)
                if masked:
                    seen = visible(geom, qi * block_q, k_start, s.shape, transposed=True)
                    if ids is not None:
                        seen = seen & same_segment(k_ids, ids, s.shape)
                    p = jnp.where(seen, p, jnp.float32(0.0))
                return p

            s_products = [(ones, s_parts.at[slot].T), (k_s, q_t.T)]
            dp_products = [(ones, dp_parts.at[slot].T), (v_s, do_t.T)]
            if split == "cols" and not interpret:
                # One wgmma scope per step: dV = P^T dO is issued as soon as P is formed,
                # before the wait for dP^T, so the exponentials run while dP^T is on the
                # tensor cores (ptxas cannot move that wait above dV's issue) and dS is
                # formed while dV runs; dS^T then goes to shared memory for the dQ and
                # dK is issued. The scope's end waits for dV and dK. (At D = 64, the rows
                # split, this order measured no faster and spilled more: not taken there.)

                def chain(refs):
                    s_acc, dp_acc, dv_acc, dk_acc = refs
                    for a, b in s_products:
                        plgpu.wgmma(s_acc, a, b)
                    for a, b in dp_products:
                        plgpu.wgmma(dp_acc, a, b)
                    with jax.named_scope("s_wait"):
                        s = plgpu.wgmma_accumulator_load(s_acc, wait_n=len(dp_products))
                    with jax.named_scope("exp"):
                        p = probabilities(s)
                        plgpu.wgmma(dv_acc, p.astype(k_smem.dtype), do_t)
                    with jax.named_scope("dp_wait"):
                        dp = plgpu.wgmma_accumulator_load(dp_acc, wait_n=1)
                    with jax.named_scope("ds"):
                        ds_b = (p * dp).astype(k_smem.dtype)
                        ds_smem2.at[par, wg][...] = ds_b
                        plgpu.commit_smem()
                        plgpu.barrier_arrive(ds_ready.at[par])
                        plgpu.wgmma(dk_acc, ds_b, q_t)

                _, _, dv, dk = pl.run_state(chain)(
                    tuple(plgpu.ACC.init(a) for a in (*init, dv, dk))
                )
                add_split_dq()
                return dk, dv

            p, ds = wgmma_pair(
                init,
                [s_products, dp_products],
                probabilities,
                lambda p, dp: p * dp,
                interpret=interpret,
            )
            # Register operands, converted where each wgmma is issued.
            p_in = lambda: p.astype(k_smem.dtype)  # noqa: E731
            ds_in = lambda: ds.astype(k_smem.dtype)  # noqa: E731

            if not fused:
                dv, dk = wgmma_into(  # dV += P^T dO, dK += dS^T Q
                    (dv, dk),
                    [(p_in, do_t), (ds_in, q_t)],
                    interpret=interpret,
                )
                plgpu.barrier_arrive(free.at[slot])
                return dk, dv

            if split is not None:
                # This warpgroup's dS^T rows go to shared memory for both warpgroups'
                # dQ; dV and dK run while the other warpgroup writes its rows.
                ds_b = ds.astype(k_smem.dtype)
                ds_smem2.at[par, wg][...] = ds_b
                plgpu.commit_smem()
                plgpu.barrier_arrive(ds_ready.at[par])
                dv, dk = wgmma_into(
                    (dv, dk), [(p_in, do_t), (lambda: ds_b, q_t)], interpret=interpret
                )
                add_split_dq()
                return dk, dv

            # dS^T [keys, queries] goes through SMEM for this step's dQ = dS K (the
            # transposed A operand); dK += dS^T Q takes it from registers (less SMEM
            # traffic, BENCHMARKS.md).
            ds_s = ds_smem2.at[mine]
            ds_s[...] = ds.astype(ds_s.dtype)
            plgpu.commit_smem()
            zeros_dq = plgpu.layout_cast(
                jnp.zeros((block_q, geom.head_dim), jnp.float32), plgpu.Layout.WGMMA
            )
            dv, dk, dq = wgmma_into(
                (dv, dk, zeros_dq),
                [(p_in, do_t), (ds_in, q_t), (ds_s.T, k_dq)],
                interpret=interpret,
            )
            plgpu.barrier_arrive(free.at[slot])
            add_dq(dq, lax.axis_index("kv_tiles") * COMPUTE_WGS + wg)  # a slice per warpgroup
            return dk, dv

        def skip(qi, carry, *, pos):
            slot = rem(pos(qi), stages)
            wait_inputs(slot)
            plgpu.barrier_arrive(free.at[slot])
            return carry

        def head(g, carry):
            reverse = backwards(g)

            def pos(qi):  # the stream index of query step qi of head g
                if reverse is None:
                    return g * per_head + qi - st.cta_lo
                return g * per_head + jnp.where(reverse, st.cta_hi - 1 - qi, qi - st.cta_lo)

            return run_steps(
                st,
                functools.partial(step, g=g, pos=pos),
                functools.partial(skip, pos=pos),
                carry,
                mask_first=True,
                mask_last=segments or split is not None,
                skip_first=split is None,
                reverse=reverse,
            )

        zeros = plgpu.layout_cast(jnp.zeros((bk, geom.head_dim), jnp.float32), plgpu.Layout.WGMMA)
        dk, dv = lax.fori_loop(jnp.int32(0), jnp.int32(geom.group), head, (zeros, zeros))
        if fused:
            # The last dQ reduce-add has read its SMEM, which may be reused.
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        if split is not None:  # the other warpgroup's last dQ has read this one's K: dK may take it
            plgpu.barrier_arrive(ds_ready.at[jnp.int32(2)])
            plgpu.barrier_wait(ds_ready.at[jnp.int32(2)])
        if split == "cols" and not grads_in_input_dtype:  # f32 through the [64, D/2] dQ tile
            half = geom.head_dim // COMPUTE_WGS
            for value, ref in ((dk * scale, dk_ref), (dv, dv_ref)):
                for c in range(COMPUTE_WGS):
                    cols = slice(c * half, (c + 1) * half)
                    dst = ref.at[(*rows, pl.ds(c * half, half))]
                    _store_tile(value[:, cols], dq_smem2.at[wg], dst, add_shares)
        else:
            if out_smem2 is not None:
                dk_smem = dv_smem = out_smem2.at[wg]
            elif grads_in_input_dtype:  # K/V's own slots are free now
                dk_smem, dv_smem = k_smem, v_smem
            else:  # f32 gradients of the fused kernel: its f32 dQ tile is free now
                dk_smem = dv_smem = dq_smem2.at[wg]
            _store_tile(dk * scale, dk_smem, dk_ref.at[rows], add_shares)
            _store_tile(dv, dv_smem, dv_ref.at[rows], add_shares)

    @pl.when(wg == COMPUTE_WGS)
    def _memory():
        plgpu.set_max_registers(
            SPLIT_REGS[1] if split is not None else MEMORY_REGS, action="decrease"
        )

        def stream(t):
            slot = rem(t, stages)
            g = lax.div(t, per_head)
            head = kv_head * geom.group + g
            r = rem(t, per_head)
            q_step, reverse = st.cta_lo + r, backwards(g)
            if reverse is not None:
                q_step = jnp.where(reverse, st.cta_hi - 1 - r, q_step)
            q_start = q_step * block_q

            @pl.when(t >= stages)
            def _():
                plgpu.barrier_wait(free.at[slot])

            rows = (batch, pl.ds(q_start, block_q), head)
            ready = in_ready.at[slot]  # one barrier for the step's copies
            plgpu.copy_gmem_to_smem(q_ref.at[rows], q_smem.at[slot], ready)
            plgpu.copy_gmem_to_smem(do_ref.at[rows], do_smem.at[slot], ready)
            cols = (batch, head, pl.ds(q_start, block_q))
            plgpu.copy_gmem_to_smem(s_parts_ref.at[cols], s_parts.at[slot], ready)
            plgpu.copy_gmem_to_smem(dp_parts_ref.at[cols], dp_parts.at[slot], ready)
            if segments:
                plgpu.copy_gmem_to_smem(
                    qseg_ref.at[batch, pl.ds(q_start, block_q)], q_ids.at[slot], ready
                )

        if not memory_warp:  # the whole warpgroup streams
            pl.loop(0, geom.group * per_head)(stream)
            if interpret:
                drain((free,), geom.group * per_head, stages)
            return

        @plgpu.warp_map  # one warp streams (`MEMORY_WARP_HEAD_DIMS`)
        def _(warp):
            @pl.when(warp == 0)
            def _():
                pl.loop(0, geom.group * per_head)(stream)


# ----------------------------------------------------------------------------- dQ


def _dq_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    *refs,
    geom: Geometry,
    block_kv: int,
    stages: int,
    qk_scale: float,
    scale: float,
    segments: bool,
    interpret: bool,
    memory_warp: bool,
):
    """`refs`: with segment ids, `q_seg`, `kv_seg` and the `query_table` first; then
    the output and the scratch (`q_ids`, `kv_ids`: None without ids). `memory_warp`:
    one warp of the memory warpgroup streams K and V."""
    qseg_ref = kvseg_ref = table_ref = None
    if segments:
        qseg_ref, kvseg_ref, table_ref, *refs = refs
    (
        dq_ref,
        q_smem2,
        do_smem2,
        lse_smem2,
        delta_smem2,
        k_smem,
        v_smem,
        out_smem2,
        q_ids2,
        kv_ids,
        row_ready,
        k_ready,
        v_ready,
        k_free,
        v_free,
    ) = refs
    bq = WG_ROWS
    batch = lax.axis_index("batch")
    head = lax.axis_index("heads")
    wg = lax.axis_index("wg")
    cta_start, st = query_tile_steps(geom, block_kv, table_ref, batch, wg)

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(COMPUTE_REGS, action="increase")
        q_start = cta_start + wg * bq
        q_t, do_t = q_smem2.at[wg], do_smem2.at[wg]
        rows = (batch, pl.ds(q_start, bq), head)
        cols = (batch, head, pl.ds(q_start, bq))
        plgpu.copy_gmem_to_smem(q_ref.at[rows], q_t, row_ready.at[wg, jnp.int32(0)])
        plgpu.copy_gmem_to_smem(do_ref.at[rows], do_t, row_ready.at[wg, jnp.int32(1)])
        plgpu.copy_gmem_to_smem(lse_ref.at[cols], lse_smem2.at[wg], row_ready.at[wg, jnp.int32(2)])
        plgpu.copy_gmem_to_smem(
            delta_ref.at[cols], delta_smem2.at[wg], row_ready.at[wg, jnp.int32(3)]
        )
        if segments:
            plgpu.copy_gmem_to_smem(
                qseg_ref.at[batch, pl.ds(q_start, bq)],
                q_ids2.at[wg],
                row_ready.at[wg, jnp.int32(4)],
            )
        for i in range(5 if segments else 4):
            plgpu.barrier_wait(row_ready.at[wg, jnp.int32(i)])
        q_ids = row_ids(q_ids2.at[wg]) if segments else None
        q_a, do_a = q_t, do_t  # Q and dO in registers where they fit (A_IN_REGS)
        if A_IN_REGS["dq"](geom.head_dim):
            q_a = plgpu.load(q_t, layout=plgpu.Layout.WGMMA)
            do_a = plgpu.load(do_t, layout=plgpu.Layout.WGMMA)
        # The per-row terms are two registers per thread here: zero accumulators and
        # the terms added after (starting at them cost this kernel 2-4%, module docstring).
        row = plgpu.Layout.WGMMA.reduce(1)
        neg_lse2 = plgpu.load(lse_smem2.at[wg], layout=row) * qk_scale  # -LSE * log2 e
        neg_delta = plgpu.load(delta_smem2.at[wg], layout=row)

        def step(j, dq, *, masked: bool):
            slot = st.slot(j, stages)
            plgpu.barrier_wait(k_ready.at[slot])
            plgpu.barrier_wait(v_ready.at[slot])
            ids = col_ids(kv_ids.at[slot]) if masked and segments else None

            def probabilities(s):  # while dP is still on the tensor cores
                p = jnp.exp2(s * qk_scale + _bcast(neg_lse2, s.shape, 0))
                if masked:
                    seen = visible(geom, q_start, j * block_kv, s.shape)
                    if ids is not None:
                        seen = seen & same_segment(q_ids, ids, s.shape)
                    p = jnp.where(seen, p, jnp.float32(0.0))
                return p

            zeros = plgpu.layout_cast(jnp.zeros((bq, block_kv), jnp.float32), plgpu.Layout.WGMMA)
            p, ds = wgmma_pair(  # S = Q K^T, dP = dO V^T: [queries, keys] f32
                (zeros, zeros),
                [(q_a, k_smem.at[slot].T), (do_a, v_smem.at[slot].T)],
                probabilities,
                lambda p, dp: p * (dp + _bcast(neg_delta, p.shape, 0)),
                interpret=interpret,
            )
            plgpu.barrier_arrive(v_free.at[slot])

            (dq,) = wgmma_into(  # dQ += dS K
                (dq,), [(lambda: ds.astype(k_smem.dtype), k_smem.at[slot])], interpret=interpret
            )
            plgpu.barrier_arrive(k_free.at[slot])
            return dq

        def skip(j, carry):
            slot = st.slot(j, stages)
            plgpu.barrier_wait(k_ready.at[slot])
            plgpu.barrier_wait(v_ready.at[slot])
            plgpu.barrier_arrive(v_free.at[slot])
            plgpu.barrier_arrive(k_free.at[slot])
            return carry

        dq = plgpu.layout_cast(jnp.zeros((bq, geom.head_dim), jnp.float32), plgpu.Layout.WGMMA)
        dq = run_steps(st, step, skip, dq, mask_first=segments, mask_last=True, skip_first=segments)
        out = q_t if out_smem2 is None else out_smem2.at[wg]
        _store_tile(dq * scale, out, dq_ref.at[rows])

    @pl.when(wg == COMPUTE_WGS)
    def _memory():
        stream_kv(
            (k_ref, v_ref),
            (k_smem, v_smem),
            (k_ready, v_ready),
            (k_free, v_free),
            batch=batch,
            head=head,
            group=geom.group,
            steps=st,
            block_kv=block_kv,
            stages=stages,
            ids=(kvseg_ref, kv_ids) if segments else None,
            interpret=interpret,
            one_warp=memory_warp,  # `MEMORY_WARP_HEAD_DIMS`
        )


# ----------------------------------------------------------------------------- wrapper


def mosaic_bwd(
    q,
    k,
    v,
    do,
    lse,
    delta,
    segs=None,
    *,
    mask,
    scale: float,
    grad_dtype,
    block_q_dkv: int,
    block_kv_dq: int,
    stages: int,
    deterministic: bool = False,
    interpret: bool = False,
    dq_into=None,
    head_shares: int = 0,
):
    """Backward of the kernel contract: `(dq, dk, dv)` in `grad_dtype`.

    `lse` is the global natural-log LSE `[B,N,T]` (-inf: the row sees nothing) and
    `delta = rowsum(dO * O_global) - dLSE` `[B,N,T]` f32. `segs`: None or
    `(q_seg [B,T], kv_seg [B,S])` int32 (tiles whose ids cannot meet are skipped).
    `deterministic=False` fuses dQ into the dK/dV kernel where that is faster (f32 TMA
    reduce-add; see the module docstring); elsewhere the two-kernel backward runs, which
    is deterministic anyway. Inside a `jax.shard_map` the gradients vary over the
    inputs' manual axes.

    `dq_into`: None, or an f32 Ref `[B, T, N, H]` (unvarying, `adds_dq_into`) that the
    fused kernel's dQ reduce-adds go into, *not* multiplied by `scale` (the caller
    scales the sum once, as the kernel does its own accumulator); dQ is then returned as
    None (the ring's steps share one accumulator instead of a zeroed buffer and a sum
    per step).

    `head_shares`: the dK/dV launch's CTAs per KV head (`jflash.BlockSizes.head_shares_dkv`,
    a divisor of the group); 0: `head_split` chooses.
    """
    segments = segs is not None
    q_seg, kv_seg = segs if segments else (None, None)
    q, k, v, do, lse, delta, q_seg, kv_seg = match(q, k, v, do, lse, delta, q_seg, kv_seg)
    b, t, n, h = q.shape
    s_len, kh = k.shape[1], k.shape[2]
    rows = COMPUTE_WGS * WG_ROWS
    geom = Geometry(
        mask=mask,
        kv_len=s_len,
        q_pad=round_up(t, max(rows, block_q_dkv)),
        kv_pad=round_up(s_len, max(rows, block_kv_dq)),
        group=n // kh,
        head_dim=h,
        q_len=t,
    )
    # The accumulators' starting values (module docstring): -LSE/scale (-inf for rows
    # that see nothing, and padding) and -delta.
    s_start = jnp.where(lse == -jnp.inf, -jnp.inf, lse.astype(jnp.float32) / -scale)
    s_start = pad_to(s_start, 2, geom.q_pad, -jnp.inf)
    dp_start = pad_to(-delta.astype(jnp.float32), 2, geom.q_pad)
    q = pad_to(q, 1, geom.q_pad)
    do = pad_to(do.astype(q.dtype), 1, geom.q_pad)
    k = pad_to(k, 1, geom.kv_pad)
    v = pad_to(v, 1, geom.kv_pad)
    dkv_ids = dq_ids = ()
    if segments:
        q_seg, kv_seg = q_seg.astype(jnp.int32), kv_seg.astype(jnp.int32)
        ids = (pad_to(q_seg, 1, geom.q_pad), pad_to(kv_seg, 1, geom.kv_pad))
        dkv_ids = (*ids, key_table(q_seg, kv_seg, block_q_dkv, WG_ROWS, geom.kv_pad // WG_ROWS))
        dq_ids = (*ids, query_table(q_seg, kv_seg, WG_ROWS, block_kv_dq, geom.q_pad // WG_ROWS))
    kv_tiles = geom.kv_pad // rows
    # `shares` CTAs per KV head, each over group / shares query heads, their dK and dV in
    # f32: as asked, else by the rule (causal launches of few CTAs, or of long rows,
    # `head_split`; two shares' f32 dK/dV keep dQ fused, `fuses_dq`).
    if head_shares:
        check_head_shares(head_shares, geom.group)
        shares = head_shares
    else:
        ctas, sms = b * kh * kv_tiles, sm_count()
        long_rows = long_rows_split(h, geom.q_len, segments, fuses_dq(h, deterministic), ctas, sms)
        shares = head_split(ctas, geom.group, geom.mask.causal, sms, long_rows=long_rows)
    dkv_dtype = jnp.float32 if shares > 1 else grad_dtype
    same = jnp.dtype(dkv_dtype) == q.dtype
    storable = same or jnp.dtype(dkv_dtype) == jnp.float32
    # block_q_dkv checked by `check_mosaic_block_sizes`
    fused = fuses_dq(h, deterministic, storable)
    split = splits_dq(h, deterministic, block_q_dkv, storable)
    size = jnp.dtype(q.dtype).itemsize
    # f32 gradients of the fused kernel are stored through its f32 dQ tiles.
    separate_out = not same and not (fused and jnp.dtype(dkv_dtype) == jnp.float32)
    out_tile = rows * h * jnp.dtype(dkv_dtype).itemsize if separate_out else 0
    ds_buffers = 2 if split is not None else 1  # split: by step parity
    # Each warpgroup's f32 dQ tile: its step's queries and all columns, half of them
    # ("cols"), or 64 of the step's queries ("rows").
    if split == "rows":
        dq_tile = (WG_ROWS, h)
    else:
        dq_tile = (block_q_dkv, h // COMPUTE_WGS if split == "cols" else h)
    fused_tiles = COMPUTE_WGS * (
        ds_buffers * WG_ROWS * block_q_dkv * size + dq_tile[0] * dq_tile[1] * 4
    )
    ids_tile = rows * 4 if segments else 0
    common = dict(
        geom=geom,
        qk_scale=scale * LOG2E,
        scale=scale,
        segments=segments,
        interpret=interpret,
        memory_warp=one_warp_streams(q, MEMORY_WARP_HEAD_DIMS, interpret),
    )
    dkv_stages = fit_stages(
        "jflash_mosaic_dkv",
        stages,
        fixed=2 * rows * h * size
        + out_tile
        + (fused_tiles if fused else 0)
        + ids_tile
        + COMPUTE_WGS * WG_ROWS * 2 * PARTS,  # the ones
        per_stage=2 * block_q_dkv * (h * size + 2 * PARTS) + (block_q_dkv * 4 if segments else 0),
    )
    # Shares add into f32 accumulators of their KV heads (TMA reduce-add), in the order
    # the CTAs finish. The deterministic backward keeps one f32 slice per share, summed
    # below in a fixed order, as the interpreter does (it has no reduce-add).
    add_shares = shares > 1 and not interpret and not deterministic
    kv_type = struct((b, geom.kv_pad, kh * (1 if add_shares else shares), h), dkv_dtype)
    dkv_body = functools.partial(
        _dkv_kernel,
        block_q=block_q_dkv,
        stages=dkv_stages,
        grads_in_input_dtype=same,
        fused=fused,
        split=split,
        shares=shares,
        add_shares=add_shares,
        **dict(common, geom=dataclasses.replace(geom, group=geom.group // shares)),
    )
    # Query head j's KV head is j // group either way: KV head i's share r is grid head
    # i * shares + r, which reads K and V of head i in place.
    inputs = (q, k, v, do, _row_parts(s_start), _row_parts(dp_start), *dkv_ids)
    if fused:
        # The interpreter has no TMA reduce-add: one f32 slice per (key tile,
        # warpgroup), each written once per query tile it sees, summed below.
        parts = (kv_tiles * (1 if split is not None else COMPUTE_WGS),) if interpret else ()
        if dq_into is None:
            zeros = jnp.zeros((*parts, b, geom.q_pad, n, h), jnp.float32)
            # Pallas refuses a Ref that varies over a shard_map's manual axes: the
            # accumulator is made unvarying (each device's kernel adds into its own) and
            # its value marked varying like the inputs once read.
            dq_acc = jax.new_ref(zeros)
        else:
            dq_acc = dq_into
        inputs = (*inputs, dq_acc)
    if add_shares:
        # Unvarying accumulators inside a shard_map, as dQ's above.
        dkv_acc = [jax.new_ref(jnp.zeros(kv_type.shape, jnp.float32)) for _ in range(2)]
        inputs = (*inputs, *dkv_acc)
    outputs = launch(
        dkv_body,
        out_type=[] if add_shares else [kv_type, kv_type],
        scratch_types=[
            smem_tile((COMPUTE_WGS, WG_ROWS, h), k.dtype),
            smem_tile((COMPUTE_WGS, WG_ROWS, h), v.dtype),
            smem_tile((dkv_stages, block_q_dkv, h), q.dtype),
            smem_tile((dkv_stages, block_q_dkv, h), q.dtype),
            _parts_tile((dkv_stages, block_q_dkv, PARTS)),
            _parts_tile((dkv_stages, block_q_dkv, PARTS)),
            smem_tile((COMPUTE_WGS, WG_ROWS, h), dkv_dtype) if separate_out else None,
            (
                smem_tile((*(2,) * (split is not None), COMPUTE_WGS, WG_ROWS, block_q_dkv), q.dtype)
                if fused
                else None
            ),
            smem_tile((COMPUTE_WGS, *dq_tile), jnp.float32) if fused else None,
            plgpu.SMEM((COMPUTE_WGS, WG_ROWS), jnp.int32) if segments else None,
            plgpu.SMEM((dkv_stages, block_q_dkv), jnp.int32) if segments else None,
            plgpu.Barrier(num_barriers=(COMPUTE_WGS, 3 if segments else 2)),
            plgpu.Barrier(num_arrivals=5 if segments else 4, num_barriers=dkv_stages),
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=dkv_stages),
            # split: dS^T written, by step parity; [2]: the loop is over (K may be reused)
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=3) if split is not None else None,
            plgpu.SMEM((1,), jnp.int32),  # the per-step zero (`opaque`)
            _parts_tile((COMPUTE_WGS, WG_ROWS, PARTS)),  # ones: the terms' A operand
        ],
        **tile_grid(
            kv_tiles,
            kh * shares,
            b,
            "kv_tiles",
            causal=geom.mask.causal,
            packed=segments,
            rows_outer="dkv" in BWD_ROWS_OUTER,
            dkv=True,
        ),
        kernel_name="jflash_mosaic_dkv",
        interpret=interpret,
    )(*inputs)
    if add_shares:
        dk, dv = (vary(acc[...], varying_axes(k)).astype(grad_dtype) for acc in dkv_acc)
    elif shares > 1:
        dk, dv = (
            x.reshape(b, geom.kv_pad, kh, shares, h).sum(3).astype(grad_dtype) for x in outputs
        )
    else:
        dk, dv = outputs
    if fused and dq_into is not None:
        return None, dk[:, :s_len], dv[:, :s_len]
    if fused:
        dq = vary(dq_acc[...], varying_axes(q))
        dq = ((dq.sum(0) if interpret else dq) * scale).astype(grad_dtype)
        return dq[:, :t], dk[:, :s_len], dv[:, :s_len]

    # The dQ kernel writes in grad_dtype itself (the dK/dV kernel's may be f32 shares).
    dq_same = jnp.dtype(grad_dtype) == q.dtype
    dq_out_tile = 0 if dq_same else rows * h * jnp.dtype(grad_dtype).itemsize
    dq_stages = fit_stages(
        "jflash_mosaic_dq",
        stages,
        fixed=2 * rows * h * size + 2 * rows * 4 + dq_out_tile + ids_tile,
        per_stage=2 * block_kv_dq * h * size + (block_kv_dq * 4 if segments else 0),
    )
    with_ids = 2 if segments else 1  # TMA arrivals on the K barrier
    dq = launch(
        functools.partial(_dq_kernel, block_kv=block_kv_dq, stages=dq_stages, **common),
        out_type=struct((b, geom.q_pad, n, h), grad_dtype),
        scratch_types=[
            smem_tile((COMPUTE_WGS, WG_ROWS, h), q.dtype),
            smem_tile((COMPUTE_WGS, WG_ROWS, h), q.dtype),
            plgpu.SMEM((COMPUTE_WGS, WG_ROWS), jnp.float32),
            plgpu.SMEM((COMPUTE_WGS, WG_ROWS), jnp.float32),
            smem_tile((dq_stages, block_kv_dq, h), k.dtype),
            smem_tile((dq_stages, block_kv_dq, h), v.dtype),
            None if dq_same else smem_tile((COMPUTE_WGS, WG_ROWS, h), grad_dtype),
            plgpu.SMEM((COMPUTE_WGS, WG_ROWS), jnp.int32) if segments else None,
            plgpu.SMEM((dq_stages, block_kv_dq), jnp.int32) if segments else None,
            plgpu.Barrier(num_barriers=(COMPUTE_WGS, 5 if segments else 4)),
            plgpu.Barrier(num_arrivals=with_ids, num_barriers=dq_stages),
            plgpu.Barrier(num_barriers=dq_stages),
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=dq_stages),
            plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=dq_stages),
        ],
        **tile_grid(
            geom.q_pad // rows,
            n,
            b,
            "q_tiles",
            causal=geom.mask.causal,
            packed=segments,
            rows_outer="dq" in BWD_ROWS_OUTER,
        ),
        kernel_name="jflash_mosaic_dq",
        interpret=interpret,
    )(q, k, v, do, s_start, dp_start, *dq_ids)
    return dq[:, :t], dk[:, :s_len], dv[:, :s_len]
