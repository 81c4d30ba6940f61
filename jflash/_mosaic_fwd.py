"""FlashAttention forward as a Pallas Mosaic GPU kernel (Hopper: TMA, wgmma).

A work item = 128 query rows of one head: two compute warpgroups of 64 rows each and a
memory warpgroup that streams the K and V tiles of the head's KV head (`h // group`:
GQA without copies) into `stages` shared-memory slots. At D=128 the two compute
warpgroups take turns on the tensor cores (FA-3's ping-pong): while one runs its
softmax the other's matmuls run, ordered by a two-arrival "turn" barrier that each
passes twice per key step, warpgroup 1 starting one turn late; a warpgroup's turn
issues its step's P V and its next step's Q K^T back to back, without waiting for P V
in between (`overlapped`; `OVERLAP_HEAD_DIMS`). There a warpgroup
hands the turn over right after its work item's last P V and takes it back before its
next item's first Q K^T, so its epilogue does not hold up the other's last step; and,
without segment ids, it loads the next item's Q from its last step on (both: forward
1.026x at causal 4k, 1.018x at 16k; the turn alone 1.010x on packed documents;
BENCHMARKS.md). The two-warpgroup loop without overlap (D = 64 under the lengths that
take three warpgroups, below) takes no turns: each warpgroup issues its matmuls as its
own steps allow, waiting only for its K and V slots (against ping-pong turns there,
forward 1.01-1.02x at 4k and 8k, outputs bitwise equal). It loads its next Q from its
last step on too (forward 1.04x at causal 4k), and a warpgroup whose rows see none of
its last step's second 128 keys computes only the first 128 (`HALF_LAST`: causal, every
other tile's diagonal step; forward 1.01-1.03x at causal 4k, outputs bitwise equal).

Without segment ids, every loop skips an unmasked step's row max where a bound shows it
cannot matter (`BOUNDED_MAX`, `_mosaic_common.bounded_rowmax`). A row's scaled scores are
at most |scale| x its query's norm x its KV head's largest key norm (one reduce over K
before the launch, `[B * KV heads]` f32, read per item after its Q arrives). Where that
bound, less a slack (`BOUND_SLACK`: 64 in base 2 for bf16, 14 for fp16), is at most the
running max of every row of a warp (one `vote.sync.all`), the warp keeps its max: P is
then at most 2^slack, exact in floating point (the max only keeps exp2 in range), and the
row max, a serial chain between S and the first exponential, is skipped. Elsewhere (an
item's first step, loose bounds, NaN) the max is taken as before. Forward 1.02-1.06x at
D = 64 (causal 4k-16k, full 4k) and 1.04-1.07x at D = 128 (causal 16k and 64k, full 16k)
on an H100, on normal inputs, where every warp keeps its max after its first step. Where
no warp keeps it (queries 16x a normal draw), the path that takes the max costs the D = 64
two-warpgroup loop (under 16k causal, 8k full queries) 9%: forward 0.91x the exact loop's
at causal and full 4k; the overlapped loops hide it (1.00-1.01x at causal 16k, D = 64 three
warpgroups and D = 128; BENCHMARKS.md). `benchmarks/bound_share.py` replays the decision
on a model's q and k.
fp16 calls at D = 128 keep the exact loop (`BOUND_HEAD_DIMS`: there a slack that keeps P
under fp16's largest value is too narrow for the bound). With the slack, a bf16 call's
`o` accumulates P V in f32 up to 2^64 x keys x max|V|: values of V beyond about 1e13 at
a million keys may overflow where the exact path would not. Segment ids keep the exact
max (the bound there lost 5% on packed 8k rows at D = 64).

Non-causal calls at D=128 stream 160 keys per step where two stages of them fit shared
memory (2-byte outputs, no segment ids; `FULL_BLOCK_KV`): forward 1.05x at full 16k and
64k. V's tile then takes a 64-byte swizzle, since P V contracts over the step's keys.

Without segment ids every loop masks a step (the causal diagonal, keys past the real
length) by each row's count of keys it sees (`hide_keys`): a compare against an
immediate and a select per value where a 64-key chunk holds a row's limit, nothing
where a chunk is all seen or all hidden. `visible`'s mask from Mosaic's iotas had cost
about four integer operations per value (forward 1.01x at causal 2k and 4k, outputs
bitwise equal).

The launch is persistent (`WorkItems`): one CTA per SM runs work items until none are
left, heaviest first (causal rows near the end see the most keys; packed documents by
the key steps a tile streams). The memory warpgroup takes the CTA's next item from an
atomic counter when it starts streaming one, and hands it to the compute warpgroups
through two shared-memory slots; so the next item's first K/V blocks stream, and its Q
loads (the output has its own slot), while the last item's output is normalised and
stored. Where two Q slots per compute warpgroup fit shared memory (`MEMORY_Q`: D = 128,
and three warpgroups on packed documents or from 64k queries), the memory warpgroup
loads each item's Q into the second, before the item's first K; elsewhere each compute
warpgroup loads its own into one. Against one CTA per item: forward 1.01-1.03x at causal
4k and 16k, 1.00x at 64k, 1.02-1.03x on packed documents (two H200 runs, BENCHMARKS.md).
A static deal of the items instead (every CTA the same share, no counter) lost 1-6% on an
H200, whose SMs finish equal shares at different times. The tickets are the whole
memory warpgroup's; each item's K and V stream from one warp of it
(`MEMORY_WARP_HEAD_DIMS`).

At D=64, causal calls of 16k queries or more and non-causal ones of 8k or more
(`THREE_WG_MIN_LEN`, `THREE_WG_MIN_LEN_FULL`) run three compute warpgroups (192 query rows,
`THREE_WG_HEAD_DIMS`): the overlapped loop, with a token passed round the three
(`turn.at[w]`, one arrival each) instead of the two-arrival turn barrier. With segment
ids they run where the key ids are sorted, masking by the rows' spans only (the id
compare does not fit in their registers); other ids take two warpgroups. Both kernels
launch: the id compare first, returning at once where the ids are sorted, then the span
kernel, which runs there and elsewhere copies the first one's outputs into its own. No
launch relies on an output aliased to an input: XLA's dynamic-slice fusion writes a
custom call's result straight into a `dynamic_update_slice` target (a `lax.scan`'s
stacked outputs, such as remat's saved residuals), which drops what an aliased input
held.

Packed documents at D=64 under those lengths: the span kernel runs three compute
warpgroups in the loop without overlap (128-key steps, no turns) where dense calls run
two with 256-key steps. A document of a few hundred tokens fills less of a 256-key step
than of two 128-key ones: forward 1.37-1.40x on rows of 22 documents at 4k and 8k, where
two warpgroups with 128-key steps reached 1.13-1.15x; dense calls on three warpgroups
without overlap were 1-2% slower (BENCHMARKS.md).

Segment ids (packed documents): a query tile streams only the key tiles whose ids may
meet its own (`jflash._segments`, intersected with the causal bounds), and masks only
the tiles that hold more than one id or sit on the causal diagonal. The key ids ride
with K into shared memory. Where the key ids are sorted (packed documents; a flag at
the table's end says so), each query row's visible keys are one span `[lo, hi)`
(`jflash._segments.key_spans`, computed before the launch), and a masked tile compares
key positions with it instead of comparing ids: one unsigned comparison per entry.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jflash._mosaic_common import (
    COMPUTE_REGS,
    COMPUTE_WGS,
    MEMORY_REGS,
    WG_ROWS,
    Geometry,
    bounded_rowmax,
    col_ids,
    drain,
    exp_rows,
    fit_stages,
    fits_smem,
    hide_keys,
    kv_range,
    launch,
    one_warp_streams,
    profile_bytes,
    query_table,
    query_tile_steps,
    rem,
    row_ids,
    run_steps,
    same_segment,
    smem_tile,
    stream_kv,
    visible,
    wgmma_into,
)
from jflash._segments import ids_sorted, key_spans
from jflash._triton_common import LN2, LOG2E, pad_to, round_up
from jflash._vma import match, struct
from jflash._work_items import WorkItems, heaviest_first, take_ticket

# Head dims whose forward issues each step's P V and the next step's Q K^T together
# (`overlapped`): at D=128 the forward kernel is 2.6% faster (H100, 16k and 64k); at
# D=64 (256-key steps, S in 128 registers) 38% slower (BENCHMARKS.md). The GPU
# interpreter runs it too, with its accumulators in shared memory (`Accumulators`).
OVERLAP_HEAD_DIMS = (128,)
# Head dims whose compiled forward runs three compute warpgroups from THREE_WG_MIN_LEN
# queries on, causal, and THREE_WG_MIN_LEN_FULL non-causal (192-row query tiles, 128-key
# steps in 4 stages, each step's P V and the next Q K^T issued together),
# FlashAttention-3's D = 64 forward: the tensor cores pass round the three in turn, so
# each warpgroup has two others' turns for its softmax instead of one. Registers: 3 x
# 160 + 24. H200, forward against two warpgroups: 1.03x at 16k, 1.07x at 32k, 1.05x at
# 64k causal, 1.06x full 16k; 0.95x at 4k and 1.01x at 8k causal, so shorter causal calls
# keep two. Non-causal: 1.023x at 8k, 1.045x at 12k (whole 192-row tiles), 1.007x at 4k,
# where the last tile's 128 rows past the length are 3% of the work (BENCHMARKS.md).
# Under those lengths the span kernel for packed documents runs three as well, in the
# loop without overlap (`mosaic_fwd`).
THREE_WG_HEAD_DIMS = (64,)
THREE_WG_MIN_LEN = 16384
THREE_WG_MIN_LEN_FULL = 8192
# Head dims whose forward streams K and V from one warp of the memory warpgroup
# (`plgpu.warp_map`) instead of all four, where each copy first synchronised the
# warpgroup and 128 threads polled every barrier (as the dK/dV kernel's
# `MEMORY_WARP_HEAD_DIMS`). H200, forward against the whole warpgroup, two runs:
# 0.995-1.012x at causal and full 4k, 1.016x at causal 16k (three warpgroups), 1.011x
# on packed 16k (D = 64); 1.014-1.030x at causal 16k and 64k D = 128, where identical
# code read 1.024x the same day; outputs bitwise equal (BENCHMARKS.md). Inside
# `shard_map` too: `launch` hands the kernel operands that vary over no manual axis.
MEMORY_WARP_HEAD_DIMS = (64, 128)
# The two-warpgroup loop without overlap (D = 64 under the three-warpgroup lengths) emits
# its softmax's FMA, exponential, row-sum add and conversion value by value
# (`exp_rows`) instead of as one pass each: forward 1.01-1.03x at causal and full 4k
# and 8k in two runs; the overlapped loops were level with it (BENCHMARKS.md).
INTERLEAVE = True
# The same loop (two warpgroups, no segment ids) cuts a warpgroup's last step to its
# first half where its rows see none of the second: with 128 query rows per tile and
# 256 keys per step, every other causal tile's diagonal step is half hidden from both
# warpgroups. Its K and V still arrive whole. Forward 1.01-1.03x at causal 4k, 1.02x at
# 8k, full 4k unchanged (BENCHMARKS.md).
HALF_LAST = True
# Masked steps without segment ids hide the keys past each row's limit (`hide_keys`):
# a compare and a select per value in the 64-key chunk that holds the limit, none in
# chunks all seen or all hidden. Against `visible`'s mask, forward 0.996-1.02x at
# causal 2k-8k in three runs (1.01x at 2k and 4k in the longest), outputs bitwise
# equal; a compare per value everywhere (no chunks) read 1-2% slower than the chunks
# at causal 4k and 8k (BENCHMARKS.md).
HIDE_KEYS = True
# Without segment ids, every loop skips an unmasked step's row max where it cannot
# matter (`bounded_rowmax`): each row's scores are at most its query's norm times the
# largest key norm of its KV head (times the scale), and where that bound is within
# BOUND_SLACK (base 2) of the row's running max for every row of a warp, the warp keeps
# its running max; P is then at most 2^slack, exact in floating point. The key norms:
# one pass over K before the launch. Forward 1.02-1.07x on an H100 on normal inputs;
# 0.91x in the D = 64 two-warpgroup loop where no warp keeps its max (BENCHMARKS.md).
BOUNDED_MAX = True
BOUND_SLACK = {jnp.dtype(jnp.bfloat16): 64.0, jnp.dtype(jnp.float16): 14.0}
# The head dims that take the bound, per input dtype. fp16's P must stay under 2^16, and
# at D = 128 the bound less so narrow a slack stays above the running max: a replay of
# the kernel's decision on normal inputs (`benchmarks/bound_share.py --dtype float16`)
# kept no warp's max at causal or full 4k and 16k, with a slack of up to 15.5, so those
# calls keep the exact loop rather than pay for the key norms and the vote.
BOUND_HEAD_DIMS = {jnp.dtype(jnp.bfloat16): (64, 128), jnp.dtype(jnp.float16): (64,)}
# Non-causal calls at these head dims (without `jflash.BlockSizes`) stream this many keys
# per step where two stages fit shared memory: 2-byte outputs, no segment ids (else 128).
# Fewer steps per key: barriers, turns and rescales. FlashAttention-3 takes 176 there;
# 176 or 192 keys do not fit beside jflash's Q and output slots. P V contracts over the
# 160 keys, so V's tile takes a 64-byte swizzle (a wgmma's B rows go by the swizzle's
# width). H200, forward against 128-key steps: 1.05x at full 16k and 64k, 1.00x at 4k
# (26 steps, the last 96 keys, against 32); forward+backward 1.01x (BENCHMARKS.md).
FULL_BLOCK_KV = {128: 160}
# Head dims whose work items go one batch row after another (`WorkItems.rows_outer`,
# where the heads are outermost) instead of the rows side by side: with 16 rows at 4k,
# the items in flight read one K/V stream instead of 16. H200, forward against the rows
# side by side, outputs bitwise equal: 1.043x at full 4k, 1.01x at full 16k and causal
# 4k (D = 128); 0.991-0.997x at causal and full 4k at D = 64, which keeps them side by
# side (BENCHMARKS.md).
ROWS_OUTER_HEAD_DIMS = (128,)
# The memory warpgroup loads each work item's Q (and its ids) into the second of two Q
# slots per compute warpgroup, before the item's first K, where the second slot fits
# shared memory beside the stages (not at D = 128 with f32 outputs), instead of each
# compute warpgroup loading it from its last step of the item before, behind the next
# item's first K and V copies (its Q waited 830-900 cycles per item at causal 4k:
# BENCHMARKS.md, "Inside the forward kernel"). At D = 128 and on three warpgroups only:
# forward 1.01-1.03x at causal 16k (D = 128) and 1.03x on packed documents at 16k
# (D = 64); the D = 64 two-warpgroup loop read 0.99 / 0.94x at causal / full 4k. The
# D = 64 three-warpgroup loop on rows without segment ids takes it from
# THREE_WG_MEMORY_Q_MIN_LEN queries on: H100, forward against one slot, 1.02x at 64k
# causal and 1.01x full, 1.00x at 32k, 0.96-0.97x at 16k causal and full 8k / 16k; 0.98x
# at one row of 16k as at four, so the length decides, not the batch.
MEMORY_Q = True
THREE_WG_MEMORY_Q_MIN_LEN = 65536
THREE_WG_REGS = (160, 24)
THREE_WG_STAGES = 4
# The compute warpgroups' named scopes, which Mosaic GPU's on-device profiler records
# (`_mosaic_common.profiling`, `benchmarks/timeline.py`); outside the profiler they
# change no instruction. Per key step, in the overlapped loop (two warpgroups at D=128,
# three at D=64 from the three-warpgroup lengths): s_wait, softmax, turn, issue; in the
# loop without overlap (D=64 under those lengths: two warpgroups, three for
# packed documents): s_wait,
# qk, s_read, softmax, turn, issue, where s_wait is the wait for the step's K, turn for
# its V and issue is P V, issued and waited for:
STEP_SCOPES = {
    "s_wait": "wait for this step's Q K^T and the last P V (no overlap: for its K)",
    "softmax": "online softmax of an unmasked step",
    "softmax_m": "online softmax of a masked step",
    "turn": "wait for the V slot and the tensor cores' turn (no overlap: the V slot)",
    "issue": "issue P V and the next Q K^T, hand the turn over and wait for it back "
    "(no overlap: issue P V and wait for it)",
    "qk": "no overlap: issue Q K^T",
    "s_read": "no overlap: wait for S",
}
# Per work item (a warpgroup's 64 query rows of one head), "q_wait" first:
ITEM_SCOPES = {
    "locate": "the CTA's first item's coordinates and key steps (the others': in ticket)",
    "q_wait": "wait for its Q tile",
    "first": "issue its first Q K^T and take a turn",
    "last_pv": "wait for its last P V",
    "ticket": "take the next item's ticket, find its coordinates and steps, start its Q load "
    "(where the last step did not)",
    "store_wait": "wait until the last output copy has read shared memory",
}


class Accumulators:
    """The overlapped loop's S and O accumulators. Compiled: wgmma accumulators in
    registers, each product issued asynchronously and waited for where it is read. The
    GPU interpreter can neither store into an accumulator nor take a register operand,
    so there they are f32 shared memory per warpgroup (`scratch`, the kernel's last
    scratch refs) and each product is a dot added at once: the same numbers, and the
    same barriers and turns around them."""

    def __init__(self, scratch, interpret: bool):
        self.scratch = scratch
        self.interpret = interpret

    def scoped(self, body, s_shape, o_shape):
        """`body(s_acc, o_acc)`, both zero at first."""
        if not self.interpret:
            return pl.run_scoped(
                body, plgpu.ACC(s_shape, jnp.float32), plgpu.ACC(o_shape, jnp.float32)
            )
        wg = lax.axis_index("wg")
        s_acc, o_acc = (ref.at[wg] for ref in self.scratch)
        s_acc[...] = jnp.zeros(s_shape, jnp.float32)
        o_acc[...] = jnp.zeros(o_shape, jnp.float32)
        return body(s_acc, o_acc)

    def mma(self, acc, a, b, *, a_ref: bool, transpose_b: bool = False):
        """`acc += a @ b` (`b.T` with `transpose_b`); `a` a shared-memory ref
        (`a_ref`) or registers, `b` a shared-memory ref."""
        if not self.interpret:
            plgpu.wgmma(acc, a, b.T if transpose_b else b)
            return
        a = a[...] if a_ref else a
        b = b[...].T if transpose_b else b[...]
        acc[...] = acc[...] + jnp.dot(a, b, preferred_element_type=jnp.float32)

    def wait_load(self, acc):
        """The accumulator's value once every product issued so far is done."""
        if not self.interpret:
            return plgpu.wgmma_accumulator_load(acc, wait_n=0)
        return acc[...]


def _fwd_kernel(
    *refs,
    geom: Geometry,
    block_kv: int,
    stages: int,
    qk_scale: float,
    segments: bool,
    interpret: bool,
    wgs: int,
    items: WorkItems,
    spans_only: bool = False,
    run_if: bool | None = None,
    copies: bool = False,
    overlap: bool | None = None,
    memory_warp: bool = False,
    memory_q: bool = False,
    bounded: bool = False,
):
    """`refs`: q, k, v; with `bounded`, the largest key norm per batch row and KV head
    (`[B * KV heads]` f32); with segment ids, the rows' `(id, lo, hi)` `[B, 3, T]`
    (`key_spans`), `kv_seg [B, S]` (not with `spans_only`), the `query_table` (the
    sorted-ids flag last) and, with more than one query tile per row, the tiles' order
    (`heaviest_first`); with `copies`, another launch's `o` and `lse`; then the outputs
    and the scratch (`q_ids`, `kv_ids`: None without ids; `kv_ids` None with
    `spans_only`; interpreted, the overlapped loop's f32 S and O per warpgroup last:
    `Accumulators`).

    `spans_only`: the key ids are known to be sorted; masked tiles use the rows' spans
    and the key ids are not streamed. `run_if`: None, or whether the kernel runs where
    the sorted-ids flag is set (otherwise it returns at once, writing nothing, or with
    `copies` copies the other launch's outputs into its own). `overlap`: whether the
    steps run the overlapped loop (None: at `OVERLAP_HEAD_DIMS` and on three
    warpgroups); three warpgroups without it take no turns. `memory_warp`: one warp of
    the memory warpgroup streams each item's K and V (the tickets stay the whole
    warpgroup's). `memory_q`: two Q slots (and ids) per warpgroup, item `k`'s in slot
    `k % 2`, loaded by the memory warpgroup before the item's first K (`MEMORY_Q`);
    otherwise one, loaded by each compute warpgroup."""
    q_ref, k_ref, v_ref, *refs = refs
    kn_ref = None
    if bounded:
        kn_ref, *refs = refs
    # The work items' counter: a global semaphore, one int32 in HBM for the whole launch,
    # which Pallas zeroes before every launch (compiled only: `WorkItems`).
    counter_ref = None if interpret else pl.get_global(plgpu.SemaphoreType.REGULAR((1,)))
    qseg_ref = kvseg_ref = table_ref = order_ref = None
    if segments and spans_only:
        qseg_ref, table_ref, *refs = refs
    elif segments:
        qseg_ref, kvseg_ref, table_ref, *refs = refs
    if segments and items.needs_order:
        order_ref, *refs = refs
    o_src = lse_src = None
    if copies:
        o_src, lse_src, *refs = refs
    (
        o_ref,
        lse_ref,
        q_smem2,
        k_smem,
        v_smem,
        o_smem2,
        lse_smem2,
        q_ids2,
        kv_ids,
        tickets,
        q_ready,
        k_ready,
        v_ready,
        k_free,
        v_free,
        turn,
        *accs,
    ) = refs
    # The next two work items' tickets (`tickets[0:2]`, `tickets[2]`: the counter's last
    # value) and their barriers share the allocations of the V slots' (one arrival) and
    # the K slots' (one per compute warpgroup): every small buffer costs its alignment,
    # and the f32-output forward at D = 128 fills shared memory to within 120 bytes.

    runs = True
    if run_if is not None:
        flag = table_ref[jnp.int32(table_ref.shape[0] - 1)] != 0  # key ids sorted
        runs = flag if run_if else jnp.logical_not(flag)

    acc_ops = Accumulators(accs, interpret)

    def ticket_ready(slot):  # ticket slot `slot` holds the next item
        return v_ready.at[jnp.int32(stages) + slot]

    def ticket_free(slot):  # and every compute warpgroup read it
        return k_free.at[jnp.int32(stages) + slot]

    bq = WG_ROWS
    wg = lax.axis_index("wg")
    cta = lax.axis_index("cta")
    total = jnp.int32(items.total)
    # Two warpgroups meet at one two-arrival barrier; three pass a token round a ring of
    # one-arrival barriers (`turn.at[w]`: warpgroup w may issue its matmuls).
    if overlap is None:
        overlap = wgs > COMPUTE_WGS or geom.head_dim in OVERLAP_HEAD_DIMS
    token = wgs > COMPUTE_WGS and overlap
    # The loop with each step's P V and the next Q K^T issued together (interpreted
    # with its accumulators in shared memory: `Accumulators`). With two warpgroups it
    # hands the turn over right after an item's last P V and takes it back before the
    # next item's first Q K^T (`split`, as FA-3 does): each warpgroup's epilogue then
    # runs beside the other's last step, not in its way.
    split = overlap and not token

    def take_turn():
        plgpu.barrier_arrive(turn)
        plgpu.barrier_wait(turn)

    def hold():  # token ring: wait until the tensor cores are this warpgroup's
        plgpu.barrier_wait(turn.at[wg])

    def hand():  # token ring: the next warpgroup's turn
        plgpu.barrier_arrive(turn.at[rem(wg + 1, jnp.int32(wgs))])

    def locate(ticket, done):
        """Work item `ticket`: `(batch, head, tile, Steps)`, `done` steps streamed
        before it (`ticket == total`, none left: the last item's, never run)."""
        batch, head, tile = items.coords(jnp.minimum(ticket, total - 1), order_ref)
        _, st = query_tile_steps(geom, block_kv, table_ref, batch, wg, wgs, tile=tile, base=done)
        return batch, head, tile, st

    def first_row(tile, w=None):
        """Warpgroup `w`'s (this one's) first query row in query tile `tile`: a multiple
        of its rows that Mosaic can see (its TMA copies' tiling), also where `tile` is a
        loop carry."""
        return tile * (wgs * bq) + (wg if w is None else w) * bq

    def read_ticket(k):
        """Compute warpgroups: the CTA's `k`-th work item (`total`: none left)."""
        peek_ticket(k)
        return release_ticket(k)

    def peek_ticket(k):
        """The `k`-th item's ticket, which stays in its slot until `release_ticket(k)`."""
        slot = rem(k, 2)
        plgpu.barrier_wait(ticket_ready(slot))
        return tickets[slot]

    def release_ticket(k):
        """The `k`-th item's ticket (`peek_ticket(k)` done); its slot may be reused."""
        slot = rem(k, 2)
        ticket = tickets[slot]
        plgpu.barrier_arrive(ticket_free(slot))
        return ticket

    def q_slot(k):
        """The Q slot of the CTA's `k`-th work item."""
        return rem(k, 2) if memory_q else jnp.int32(0)

    def load_q(batch, head, tile, *, w=None, slot=None):
        """A work item's query rows of warpgroup `w` (this one) and their ids, into
        Q slot `slot` (0)."""
        w = wg if w is None else w
        slot = jnp.int32(0) if slot is None else slot
        q_start = first_row(tile, w)
        ready = q_ready.at[slot * wgs + w]
        plgpu.copy_gmem_to_smem(
            q_ref.at[batch, pl.ds(q_start, bq), head], q_smem2.at[slot, w], ready
        )
        if segments:
            plgpu.copy_gmem_to_smem(
                qseg_ref.at[batch, :, pl.ds(q_start, bq)], q_ids2.at[slot, w], ready
            )

    def compute_item(k, batch, head, tile, st):
        """The CTA's `k`-th work item; returns the next one's ticket and `locate`,
        taken (and its Q load started) before this one's epilogue."""
        q_start = first_row(tile)
        slot_q = q_slot(k)
        q_smem = q_smem2.at[slot_q, wg]
        # Without segment ids (whose tile order and table are reads from HBM), the next
        # item's Q loads from the last step on: its S wait is the last wgmma that reads Q.
        # (Three warpgroups load it after their last P V.) With `memory_q` the memory
        # warpgroup has loaded it before.
        early = (split or not overlap) and not segments and not memory_q

        def prefetch_q():
            ticket = peek_ticket(k + 1)
            coords = items.coords(jnp.minimum(ticket, total - 1), order_ref)
            pl.when(ticket < total)(lambda: load_q(*coords))

        with jax.named_scope("q_wait"):
            plgpu.barrier_wait(q_ready.at[slot_q * wgs + wg])
        lim = None
        if bounded:  # each row's bound of its scaled scores, less the slack
            qa = plgpu.load(q_smem, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
            q_norm = jnp.sqrt((qa * qa).sum(axis=1))
            kv_heads = jnp.int32(k_ref.shape[2])
            k_norm = kn_ref[batch * kv_heads + head // jnp.int32(geom.group)]
            slack = jnp.float32(BOUND_SLACK[jnp.dtype(q_smem.dtype)])
            lim = q_norm * (k_norm * jnp.float32(abs(qk_scale))) - slack
        q_ids = lo = hi = None
        if segments and spans_only:
            lo, hi = (row_ids(q_ids2.at[slot_q, wg, jnp.int32(i)]) for i in (1, 2))
        elif segments:
            q_ids = row_ids(q_ids2.at[slot_q, wg, jnp.int32(0)])
        # Each span's length (0 where it is empty), for `by_spans`.
        width = None if lo is None else jnp.maximum(hi - lo, jnp.int32(0)).astype(jnp.uint32)

        def step_ids(slot, masked: bool):
            """The step's key ids, read before its K slot is released."""
            if not (masked and segments) or spans_only:
                return None
            return col_ids(kv_ids.at[slot])

        def by_spans(j, s):
            """`s` with the keys outside each row's span hidden (its document's keys,
            cut at the diagonal and the real length): `lo <= k < hi` as one unsigned
            comparison per entry, `k - lo < hi - lo` (a key before `lo` wraps round to a
            large unsigned number)."""
            shape = (bq, block_kv)
            col = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
            rel = col + lax.broadcast_in_dim(j * block_kv - lo, shape, [0])  # k - lo
            seen = rel.astype(jnp.uint32) < lax.broadcast_in_dim(width, shape, [0])
            return jnp.where(seen, s, jnp.float32(-jnp.inf))

        def by_ids(j, s, ids):
            if ids is None and not interpret and HIDE_KEYS:
                return by_limits(j, s)
            seen = visible(geom, q_start, j * block_kv, s.shape)
            if ids is not None:
                seen = seen & same_segment(q_ids, ids, s.shape)
            return jnp.where(seen, s, jnp.float32(-jnp.inf))

        def by_limits(j, s):
            """`visible`'s mask as each row's count of keys it sees in the step
            (`hide_keys`): the real length, and the diagonal where causal."""
            k_start = j * block_kv
            row = plgpu.Layout.WGMMA.reduce(1)
            # In the rows' layout even where it is one value (no causal mask).
            limit = plgpu.layout_cast(jnp.full((s.shape[0],), geom.kv_len, jnp.int32), row)
            limit = limit - k_start
            if geom.mask.causal:
                rows = plgpu.broadcasted_iota(jnp.int32, (s.shape[0],), 0, layout=row)
                limit = jnp.minimum(limit, rows + (q_start + geom.diag + 1 - k_start))
            return hide_keys(s, limit)

        def softmax(j, s, o, m, l, *, masked: bool, ids):
            """One step's online softmax: `(o * alpha, l, m, P)`, P in the input dtype;
            fenced, so all of it is done before the turn is handed over."""
            if masked and segments and spans_only:
                s = by_spans(j, s)
            elif masked:
                s = by_ids(j, s, ids)
            # Running max in scaled base-2 units: `s * qk_scale - m` is one FMA.
            if bounded and not masked:
                m_new = bounded_rowmax(s, m, lim, qk_scale, interpret=interpret)
            else:
                m_new = jnp.maximum(m, s.max(axis=1) * qk_scale)
            m_use = jnp.where(m_new == -jnp.inf, jnp.float32(0.0), m_new) if masked else m_new
            alpha = jnp.exp2(m - m_use)
            o = o * lax.broadcast_in_dim(alpha, o.shape, [0])
            if interpret or overlap or not INTERLEAVE:
                p = jnp.exp2(s * qk_scale - lax.broadcast_in_dim(m_use, s.shape, [0]))
                p16, p_sum = p.astype(q_smem.dtype), p.sum(axis=1)
            else:
                p16, p_sum = exp_rows(s, m_use, qk_scale, q_smem.dtype)
            l = l * alpha + p_sum
            return lax.optimization_barrier((o, l, m_new, p16))

        def take_tensor_cores(slot):
            plgpu.barrier_arrive(turn)  # softmax done
            plgpu.barrier_wait(v_ready.at[slot])
            plgpu.barrier_wait(turn)  # tensor cores are ours

        def step(j, carry, *, masked: bool, width: int = block_kv):
            """Step j; `width` < block_kv: only its first `width` keys (the step's others
            are hidden from every row of the warpgroup)."""
            acc, m, l = carry
            slot = st.slot(j, stages)
            keys = (slot,) if width == block_kv else (slot, pl.ds(0, width))

            def qk(acc):
                with jax.named_scope("qk"):
                    plgpu.wgmma(acc, q_smem, k_smem.at[keys].T)
                with jax.named_scope("s_read"):
                    return acc[...]  # [64, width] f32

            with jax.named_scope("s_wait"):
                plgpu.barrier_wait(k_ready.at[slot])
            s = pl.run_scoped(qk, plgpu.ACC((bq, width), jnp.float32))
            if early:  # this warpgroup's last read of Q is done
                pl.when(j == st.hi - 1)(prefetch_q)
            ids = step_ids(slot, masked)
            plgpu.barrier_arrive(k_free.at[slot])
            with jax.named_scope("softmax_m" if masked else "softmax"):
                acc, l, m, p16 = softmax(j, s, acc, m, l, masked=masked, ids=ids)
            with jax.named_scope("turn"):
                plgpu.barrier_wait(v_ready.at[slot])
            with jax.named_scope("issue"):
                (acc,) = wgmma_into((acc,), [(p16, v_smem.at[keys])], interpret=interpret)
            plgpu.barrier_arrive(v_free.at[slot])
            return acc, m, l

        def skip(j, carry):
            # Steps the other warpgroup needs: acknowledge them, keep the turns (where
            # the warpgroups take them) paired.
            slot = st.slot(j, stages)
            plgpu.barrier_wait(k_ready.at[slot])
            plgpu.barrier_arrive(k_free.at[slot])
            if token:  # one turn per step, taken after the slot is released
                plgpu.barrier_wait(v_ready.at[slot])
                plgpu.barrier_arrive(v_free.at[slot])
                hold()
                hand()
                return carry
            if split:
                take_turn()
            plgpu.barrier_wait(v_ready.at[slot])
            plgpu.barrier_arrive(v_free.at[slot])
            if split:
                take_turn()
            return carry

        def overlapped(s_acc, o_acc, stats):
            """The steps with each step's P V and the next step's Q K^T issued back to
            back. `s_acc` holds S of the step about to run; reading it also waits for
            the previous P V, whose V slot is released then."""
            zeros_s = plgpu.layout_cast(jnp.zeros((bq, block_kv), jnp.float32), plgpu.Layout.WGMMA)

            def issue_qk(j):
                slot = st.slot(j, stages)
                plgpu.barrier_wait(k_ready.at[slot])
                s_acc[...] = zeros_s
                acc_ops.mma(s_acc, q_smem, k_smem.at[slot], a_ref=True, transpose_b=True)

            def step_(j, carry, *, masked: bool, last: bool):
                m, l = carry
                slot = st.slot(j, stages)
                with jax.named_scope("s_wait"):
                    s = acc_ops.wait_load(s_acc)

                @pl.when(j > st.lo)
                def _():
                    plgpu.barrier_arrive(v_free.at[st.slot(j - 1, stages)])

                ids = step_ids(slot, masked)
                plgpu.barrier_arrive(k_free.at[slot])
                if last and early:
                    prefetch_q()
                with jax.named_scope("softmax_m" if masked else "softmax"):
                    o, l, m, p16 = softmax(j, s, o_acc[...], m, l, masked=masked, ids=ids)
                    o_acc[...] = o
                with jax.named_scope("turn"):
                    if token:
                        plgpu.barrier_wait(v_ready.at[slot])
                        hold()
                    else:
                        take_tensor_cores(slot)
                with jax.named_scope("issue"):
                    # += P V, waited for in the next step
                    acc_ops.mma(o_acc, p16, v_smem.at[slot], a_ref=False)
                    if not last:
                        issue_qk(j + 1)
                    if token:
                        hand()  # while these run, the others do their softmax
                    elif not last:
                        take_turn()  # while these run, the other warpgroup does softmax
                    else:  # `split`: taken back at the next item's start
                        pl.when(st.hi == st.cta_hi)(lambda: plgpu.barrier_arrive(turn))
                return m, l

            def first(j, carry):  # once, if this warpgroup has a step at all
                with jax.named_scope("first"):
                    if token:
                        hold()
                    issue_qk(j)
                    hand() if token else take_turn()
                return carry

            lax.fori_loop(st.lo, st.lo + jnp.minimum(st.hi - st.lo, 1), first, None)
            # All steps but the last: masked, unmasked, masked runs (`Steps`).
            end = jnp.maximum(st.hi - 1, st.lo)
            clear_lo = jnp.minimum(st.clear_lo, end)
            clear_hi = jnp.minimum(st.clear_hi, end)
            middle = functools.partial(step_, last=False)
            carry = stats
            if segments:
                masked = functools.partial(middle, masked=True)
                carry = lax.fori_loop(st.lo, clear_lo, masked, carry)
            carry = lax.fori_loop(
                clear_lo, clear_hi, functools.partial(middle, masked=False), carry
            )
            carry = lax.fori_loop(clear_hi, end, functools.partial(middle, masked=True), carry)
            # The last step, peeled (no next Q K^T); masked, since the mask is all true
            # where nothing is hidden.
            last = functools.partial(step_, masked=True, last=True)
            m, l = lax.fori_loop(end, st.hi, last, carry)
            with jax.named_scope("last_pv"):
                acc = o_acc[...]  # waits for the last P V

            @pl.when(st.hi > st.lo)
            def _():
                plgpu.barrier_arrive(v_free.at[st.slot(st.hi - 1, stages)])

            return acc, m, l

        def half_last(carry):
            """`run_steps` without segment ids, the last step cut to its first half
            where the warpgroup's rows see none of its second (causal: every other
            query tile's diagonal step at 128 rows per tile and 256 keys per step)."""
            half = block_kv // 2
            _, n_halves = kv_range(geom, q_start, bq, half)
            hi = st.hi - ((n_halves == 2 * st.hi - 1) & (st.hi > st.lo)).astype(jnp.int32)
            whole = dataclasses.replace(
                st, hi=hi, cta_hi=hi, clear_hi=jnp.minimum(st.clear_hi, hi)
            )  # the steps before the cut one, none acknowledged after them
            carry = run_steps(
                whole, step, skip, carry, mask_first=False, mask_last=True, skip_first=False
            )
            cut = functools.partial(step, masked=True, width=half)
            carry = lax.fori_loop(hi, st.hi, cut, carry)
            lax.fori_loop(st.hi, st.cta_hi, skip, None)
            return carry

        row = plgpu.Layout.WGMMA.reduce(1)
        stats = (
            plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), row),
            plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), row),
        )
        if overlap:
            if split:  # the turn handed over after the last item's last P V
                plgpu.barrier_wait(turn)
            if segments:
                lax.fori_loop(st.cta_lo, st.lo, skip, None)
            acc, m, l = acc_ops.scoped(
                lambda s_acc, o_acc: overlapped(s_acc, o_acc, stats),
                (bq, block_kv),
                (bq, geom.head_dim),
            )
            lax.fori_loop(st.hi, st.cta_hi, skip, None)
            if split:  # without a last step, or after the steps only acknowledged
                handed = (st.hi > st.lo) & (st.hi == st.cta_hi)
                pl.when(jnp.logical_not(handed))(lambda: plgpu.barrier_arrive(turn))
        else:
            zeros = jnp.zeros((bq, geom.head_dim), jnp.float32)
            carry = (plgpu.layout_cast(zeros, plgpu.Layout.WGMMA), *stats)
            # Halves of whole 64-key tiles only: a caller's 192-key steps stay whole.
            if HALF_LAST and not segments and wgs == COMPUTE_WGS and block_kv % (2 * WG_ROWS) == 0:
                acc, m, l = half_last(carry)
            else:
                acc, m, l = run_steps(
                    st, step, skip, carry, mask_first=segments, mask_last=True, skip_first=segments
                )
        if token:
            # A warpgroup with steps took one turn more than its skips (the first Q K^T):
            # one without takes it here, so every warpgroup takes as many.
            @pl.when(st.hi == st.lo)
            def _():
                hold()
                hand()

        # Every wgmma that reads Q is done (`acc` waited for the last P V): the next
        # item's Q loads (from the last step on where `early`) while this one's output
        # is normalised and stored. Its coordinates and steps are found here: on packed
        # rows they are reads of the tile order and table in HBM, whose wait the
        # epilogue hides.
        with jax.named_scope("ticket"):
            if early:
                pl.when(st.hi == st.lo)(prefetch_q)  # no last step
                ticket = release_ticket(k + 1)
                following = locate(ticket, st.base + st.count)
            else:
                ticket = read_ticket(k + 1)
                following = locate(ticket, st.base + st.count)
                if not memory_q:
                    pl.when(ticket < total)(lambda: load_q(*following[:3]))
        empty = l == 0.0
        l_safe = jnp.where(empty, jnp.float32(1.0), l)
        o_smem = o_smem2.at[wg]
        # The last item's output copies must have read the slots before they are rewritten.
        with jax.named_scope("store_wait"):
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        o_smem[...] = (acc * lax.broadcast_in_dim(1.0 / l_safe, acc.shape, [0])).astype(
            o_smem.dtype
        )
        lse_smem = lse_smem2.at[wg]
        lse_smem[...] = jnp.where(empty, jnp.float32(-jnp.inf), (m + jnp.log2(l_safe)) * LN2)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(
            o_smem, o_ref.at[batch, pl.ds(q_start, bq), head], commit_group=False
        )
        plgpu.copy_smem_to_gmem(
            lse_smem, lse_ref.at[batch, head, pl.ds(q_start, bq)], commit_group=False
        )
        plgpu.commit_smem_to_gmem_group()
        return ticket, following

    @pl.when((wg < wgs) & runs)
    def _compute():
        regs = THREE_WG_REGS[0] if wgs > COMPUTE_WGS else COMPUTE_REGS
        plgpu.set_max_registers(regs, action="increase")
        first = read_ticket(jnp.int32(0))
        with jax.named_scope("locate"):
            located = locate(first, jnp.int32(0))
        if not memory_q:
            pl.when(first < total)(lambda: load_q(*located[:3]))
        # Turns run on across the items: each warpgroup takes as many per item.
        if token:  # warpgroup 0 goes first
            pl.when(wg == wgs - 1)(hand)
        elif split:
            pl.when(wg == 1)(take_turn)
            plgpu.barrier_arrive(turn)  # the turn each item takes back at its start

        def item(carry):  # the carry holds the item's `locate`
            k, ticket, located = carry
            ticket, following = compute_item(k, *located)
            return k + 1, ticket, following

        lax.while_loop(lambda c: c[1] < total, item, (jnp.int32(0), first, located))
        # Every warpgroup observes the turns' last phases, compiled as interpreted (the
        # GPU interpreter checks this sequence). With `split`, warpgroup 1 arrived once
        # more: warpgroup 0 waits for the phase that completed (the next one lacks its
        # own arrival, so no wait here can find the barrier two phases on, at the
        # parity it waits for), arrives, and both wait for that last phase.
        if split:

            @pl.when(wg == 0)
            def _():
                plgpu.barrier_wait(turn)
                plgpu.barrier_arrive(turn)

            plgpu.barrier_wait(turn)
        elif token:  # the last warpgroup's last hand-over
            pl.when(wg == 0)(hold)
        # The CTA may end once the copies have read SMEM; their writes complete by the
        # kernel's end.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    if copies:

        @pl.when((wg < wgs) & jnp.logical_not(runs))
        def _copy():
            """The other launch ran: its output and LSE become this one's, each warpgroup
            copying its rows of the CTA's share of the work items through its slots."""
            ctas = jnp.int32(items.ctas)

            def copy_item(j, _):
                batch, head, tile = items.coords(cta + j * ctas)
                q_start = first_row(tile)
                o_smem, lse_smem = o_smem2.at[wg], lse_smem2.at[wg]
                o_rows = o_ref.at[batch, pl.ds(q_start, bq), head]
                lse_rows = lse_ref.at[batch, head, pl.ds(q_start, bq)]
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last copy read them
                # Two arrivals, as a work item's Q and its ids.
                plgpu.copy_gmem_to_smem(
                    o_src.at[batch, pl.ds(q_start, bq), head], o_smem, q_ready.at[wg]
                )
                plgpu.copy_gmem_to_smem(
                    lse_src.at[batch, head, pl.ds(q_start, bq)], lse_smem, q_ready.at[wg]
                )
                plgpu.barrier_wait(q_ready.at[wg])
                plgpu.copy_smem_to_gmem(o_smem, o_rows, commit_group=False)
                plgpu.copy_smem_to_gmem(lse_smem, lse_rows, commit_group=False)
                plgpu.commit_smem_to_gmem_group()

            lax.fori_loop(jnp.int32(0), lax.div(total - cta + ctas - 1, ctas), copy_item, None)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    @pl.when((wg == wgs) & runs)
    def _memory():
        plgpu.set_max_registers(
            THREE_WG_REGS[1] if wgs > COMPUTE_WGS else MEMORY_REGS, action="decrease"
        )

        def fetch(k):
            """The CTA's `k`-th work item, for all warpgroups (slot `k % 2`), taken when
            its `k - 1`-th starts streaming."""
            slot = rem(k, 2)

            @pl.when(k >= 2)
            def _():
                plgpu.barrier_wait(ticket_free(slot))

            if interpret:
                ticket = items.dealt(cta, k)
            else:
                take_ticket(counter_ref, tickets.at[pl.ds(2, 1)])
                ticket = jnp.minimum(tickets[jnp.int32(2)], total)
            tickets[slot] = ticket
            plgpu.barrier_arrive(ticket_ready(slot))
            return ticket

        def item(carry):
            k, ticket, done = carry
            # Taking item k + 1 waits until every compute warpgroup read item k - 1's
            # ticket, after its last step of item k - 2: Q slot `k % 2` is free.
            following = fetch(k + 1)
            batch, head, tile, st = locate(ticket, done)

            def load_qs():  # each compute warpgroup's rows of item k
                for w in range(wgs):
                    load_q(batch, head, tile, w=jnp.int32(w), slot=q_slot(k))

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
                ids=(kvseg_ref, kv_ids) if segments and not spans_only else None,
                regs=None,
                one_warp=memory_warp,  # `MEMORY_WARP_HEAD_DIMS`
                before=load_qs if memory_q else None,
            )
            return k + 1, following, done + st.count

        start = (jnp.int32(0), fetch(jnp.int32(0)), jnp.int32(0))
        k, _, done = lax.while_loop(lambda c: c[1] < total, item, start)
        if interpret:  # the GPU interpreter: observe every phase waited on
            drain((k_free, v_free), done, stages)

            @pl.loop(jnp.maximum(k - 1, 0), k + 1)
            def _(j):
                plgpu.barrier_wait(ticket_free(rem(j, 2)))


def forms() -> str:
    """Which forward kernel runs for which call, in one line (for `jflash.describe`)."""
    dims = ", ".join(map(str, THREE_WG_HEAD_DIMS))
    wide = ", ".join(f"{keys} keys per step at head_dim {d}" for d, keys in FULL_BLOCK_KV.items())
    return (
        f"the Mosaic forward: three compute warpgroups at head_dim {dims} from "
        f"{THREE_WG_MIN_LEN} queries causal, {THREE_WG_MIN_LEN_FULL} non-causal (without "
        "block_sizes), two otherwise; non-causal "
        f"calls without segment_ids stream {wide} (2-byte outputs, without block_sizes); with "
        "segment_ids, sorted ids (packed documents) mask by each row's key span (on "
        f"three warpgroups at head_dim {dims} under those lengths as well, "
        "128-key steps without overlap) and other ids compare ids on two warpgroups "
        "(both kernels launch: the id compare first, returning at once where the ids are "
        "sorted, then the span kernel, which copies the compare's outputs where they are "
        "not); without segment_ids an unmasked step keeps its rows' running max where a "
        "key-norm bound allows (bf16; fp16 at head_dim 64)"
    )


def mosaic_fwd(
    q,
    k,
    v,
    segs=None,
    *,
    mask,
    scale: float,
    out_dtype,
    block_kv: int,
    stages: int,
    interpret: bool = False,
    own_tiles: bool = True,
):
    """Forward of the kernel contract: `(o [B,T,N,H] out_dtype, lse [B,N,T] f32)`.

    `segs`: None or `(q_seg [B,T], kv_seg [B,S])` int32; attention stays inside equal
    ids and key tiles whose ids cannot meet a query tile's are not streamed. Rows that
    see no key get o = 0, lse = -inf. Inside a `jax.shard_map` the outputs vary over the
    inputs' manual axes. `interpret=True` runs the kernel in the GPU interpreter on CPU
    (slow; for tests).
    """
    segments = segs is not None
    q_seg, kv_seg = segs if segments else (None, None)
    q, k, v, q_seg, kv_seg = match(q, k, v, q_seg, kv_seg)
    # `own_tiles=False`: the caller chose `block_kv` and `stages` (`jflash.BlockSizes`),
    # which the three-warpgroup form would replace: two warpgroups run them.
    min_len = THREE_WG_MIN_LEN if mask.causal else THREE_WG_MIN_LEN_FULL
    three = own_tiles and q.shape[3] in THREE_WG_HEAD_DIMS and q.shape[1] >= min_len
    common = dict(mask=mask, scale=scale, out_dtype=out_dtype, interpret=interpret)
    two_wgs = dict(common, wgs=COMPUTE_WGS, block_kv=block_kv, stages=stages)
    fast = spans = two_wgs
    wide = FULL_BLOCK_KV.get(q.shape[3]) if own_tiles and not mask.causal else None
    if wide:  # `_launch` falls back to 128 keys where two stages of these do not fit
        fast = spans = two_wgs = dict(two_wgs, block_kv=wide)
    if three:
        # At least 3 stages: a turn may wait for the slot that the step before it freed.
        # 128 keys per step: S of 64 x 128 keys is 64 registers of the 160.
        fast = spans = dict(common, wgs=3, block_kv=128, stages=THREE_WG_STAGES)
    elif own_tiles and q.shape[3] in THREE_WG_HEAD_DIMS:
        # Packed documents under those lengths: three warpgroups without overlap or
        # turns, 128-key steps: short documents fill 128-key steps better than 256-key
        # ones (the module docstring).
        spans = dict(common, wgs=3, block_kv=128, stages=THREE_WG_STAGES, overlap=False)
    if not segments:
        return _forward(q, k, v, None, None, None, forms=(fast,))
    q_seg, kv_seg = q_seg.astype(jnp.int32), kv_seg.astype(jnp.int32)
    # Sorted key ids (packed documents): a kernel that masks by the rows' spans only and
    # streams no key ids. The id compare beside the spans costs registers: at D = 64
    # a kernel with both spilled 1,096 bytes on two warpgroups (ptxas); the spans-only
    # one spills 36 on three, the id compare alone 380 on two. Other ids run the kernel
    # that compares ids, on two warpgroups.
    # Both launch, the id compare first: it returns at once where the ids are sorted,
    # and the span kernel, last, runs there and elsewhere copies the compare's outputs
    # into its own. So the last launch writes all of its outputs, and no result rests on
    # an output aliased to an input (which XLA's dynamic-slice fusion drops inside a
    # `lax.scan`: the module docstring). A `lax.cond` on the flag copies it to the host
    # and waits for it there (XLA's GPU conditional, outside a command buffer), which
    # cost a jitted packed 64k forward 2.6% on an H200 (BENCHMARKS.md).
    forms = (dict(two_wgs, run_if=False), dict(spans, spans_only=True, run_if=True))
    return _forward(q, k, v, q_seg, kv_seg, ids_sorted(kv_seg), forms=forms)


def _forward(q, k, v, q_seg, kv_seg, ordered, *, forms):
    """The forward kernel's launches (`forms`: each one's `_launch` arguments; a second
    copies the first's outputs where it does not run). Compiled, `jax.vmap` of them folds the mapped
    axis into the batch: launches whose work items cover every mapped call. (Pallas
    would add a grid axis per mapped call, and all of them would share the one counter
    the kernel takes its items from.)"""
    run = functools.partial(_launches, forms=forms)
    if forms[0]["interpret"]:
        return run(q, k, v, q_seg, kv_seg, ordered)
    return _batch_folded(run)(q, k, v, q_seg, kv_seg, ordered)


def _launches(q, k, v, q_seg, kv_seg, ordered, *, forms):
    """`_launch` of each form in turn, each after the first taking the outputs of the one
    before, which it copies where it does not run: `(o, lse)` cut to the queries."""
    t = q.shape[1]
    rows = max(round_up(t, f["wgs"] * WG_ROWS) for f in forms)  # every form's padding
    outs = None
    for form in forms:
        outs = _launch(q, k, v, q_seg, kv_seg, ordered, out_rows=rows, copy_from=outs, **form)
    o, lse = outs
    return o[:, :t], lse[:, :, :t]


def _batch_folded(run):
    """`run(q, k, v, q_seg, kv_seg, ordered) -> (o, lse)` whose `jax.vmap` runs it once
    with the mapped axis folded into the batch (unmapped arguments broadcast; `ordered`,
    a flag, true only where every mapped call's is)."""

    @jax.custom_batching.custom_vmap
    def folded(q, k, v, q_seg, kv_seg, ordered):
        return run(q, k, v, q_seg, kv_seg, ordered)

    @folded.def_vmap
    def _(axis_size, in_batched, q, k, v, q_seg, kv_seg, ordered):
        def fold(x, mapped):
            if x is None:
                return None
            if not mapped:
                x = jnp.broadcast_to(x, (axis_size, *x.shape))
            return x.reshape(axis_size * x.shape[1], *x.shape[2:])

        *arrays, flag = zip((q, k, v, q_seg, kv_seg, ordered), in_batched, strict=True)
        args = [fold(x, mapped) for x, mapped in arrays]
        value, mapped = flag
        args.append(jnp.all(value) if mapped and value is not None else value)
        o, lse = folded(*args)
        split = lambda x: x.reshape(axis_size, x.shape[0] // axis_size, *x.shape[1:])  # noqa: E731
        return (split(o), split(lse)), (True, True)

    return folded


def _launch(
    q,
    k,
    v,
    q_seg,
    kv_seg,
    ordered,
    *,
    mask,
    scale: float,
    out_dtype,
    block_kv: int,
    stages: int,
    wgs: int,
    interpret: bool = False,
    spans_only: bool = False,
    run_if: bool | None = None,
    out_rows: int,
    copy_from=None,
    overlap: bool | None = None,
):
    """One launch of the forward kernel on `wgs` compute warpgroups: `(o, lse)` (the
    output with the queries rounded up to 8 rows compiled, `out_rows` interpreted; the
    LSE with `out_rows`: padding past the queries). `q_seg`, `kv_seg`: int32, both None
    without segment ids; `ordered`: `ids_sorted(kv_seg)`; `spans_only`: the key ids are
    sorted, and not streamed; `run_if`: the kernel runs where `ordered` is this (None:
    always); `copy_from`: another launch's `(o, lse)`, copied where this one does not run
    (with `run_if`)."""
    segments = q_seg is not None
    stream_ids = segments and not spans_only  # the key ids ride with K
    b, t, n, h = q.shape
    s_len, kh = k.shape[1], k.shape[2]
    rows = wgs * WG_ROWS
    size = jnp.dtype(q.dtype).itemsize

    q_bytes = rows * h * size + (3 * rows * 4 if segments else 0)  # a Q slot, ids

    def smem(block: int) -> tuple[int, int]:  # (fixed, per stage) bytes of tiles
        fixed = q_bytes + rows * 4
        fixed += rows * h * jnp.dtype(out_dtype).itemsize  # the output's own slot
        return fixed, 2 * block * h * size + (block * 4 if stream_ids else 0)

    # Where two stages of `block_kv` keys do not fit (D = 128 with f32 outputs and
    # segment ids: the ring over packed documents), the streamed block halves.
    # (To the power of two below it: 160 keys, `FULL_BLOCK_KV`, fall to 128.)
    while block_kv > WG_ROWS and not fits_smem(2, *smem(block_kv)):
        block_kv = 1 << ((block_kv - 1).bit_length() - 1)
    geom = Geometry(
        mask=mask,
        kv_len=s_len,
        q_pad=round_up(t, rows),
        kv_pad=round_up(s_len, block_kv),
        group=n // kh,
        head_dim=h,
        q_len=t,
    )
    fixed, per_stage = smem(block_kv)
    stages = fit_stages("jflash_mosaic_fwd", stages, fixed, per_stage)
    memory_q = (
        MEMORY_Q
        and (
            h in OVERLAP_HEAD_DIMS
            or (wgs > COMPUTE_WGS and (spans_only or t >= THREE_WG_MEMORY_Q_MIN_LEN))
        )
        and fits_smem(stages, fixed + q_bytes, per_stage)
    )
    # Under `jflash.kernel_timeline` the profiler's buffer takes shared memory too; where
    # both do not fit (D = 128), the profiled kernel keeps one Q slot, and says so.
    profiled = profile_bytes("jflash_mosaic_fwd", wgs + 1, interpret)
    if memory_q and not fits_smem(stages, fixed + profiled + q_bytes, per_stage):
        memory_q = False
        warnings.warn(
            f"jflash.kernel_timeline: the profiled forward (head_dim {h}, {wgs} compute "
            "warpgroups) keeps one Q slot, which its compute warpgroups load: the "
            "profiler's buffer leaves no room for the second slot that the memory "
            "warpgroup fills without the profiler, so its q_wait and item gap read longer "
            "than the kernel's own",
            stacklevel=2,
        )
    q_slots = 2 if memory_q else 1
    items = WorkItems.make(
        geom.q_pad // rows,
        n,
        b,
        causal=mask.causal,
        interpret=interpret,
        group=geom.group,
        rows_outer=h in ROWS_OUTER_HEAD_DIMS,
    )
    # Compiled, a TMA copy reads zeros past an array's end and drops what a store puts
    # there, so Q, K, V and the output are padded only to the 8-row tiling of shared
    # memory (which Mosaic asks of the arrays too): no copies around the kernel where
    # the lengths are multiples of 8, though the query tiles (192 rows at D = 64)
    # divide no power of two. The interpreter clamps a slice that runs past the end, so
    # it gets arrays padded to whole tiles. The LSE keeps that padding: a TMA copy needs
    # the rows of `[B, N, rows]` 16-byte aligned.
    q_rows, kv_rows = (
        (geom.q_pad, geom.kv_pad) if interpret else (round_up(t, 8), round_up(s_len, 8))
    )
    inputs = (pad_to(q, 1, q_rows), pad_to(k, 1, kv_rows), pad_to(v, 1, kv_rows))
    if segments:
        table = query_table(q_seg, kv_seg, WG_ROWS, block_kv, geom.q_pad // WG_ROWS)
        table = jnp.concatenate([table, ordered.astype(jnp.int32)[None]])  # `run_if`
        spans = key_spans(q_seg, kv_seg, causal=mask.causal, diag=geom.diag, kv_len=s_len)
        rows_ids = jnp.concatenate([q_seg[:, None], spans], axis=1)  # [B, 3, T]
        inputs += (pad_to(rows_ids, 2, geom.q_pad),)
        inputs += (pad_to(kv_seg, 1, geom.kv_pad),) if stream_ids else ()
        inputs += (table,)
        # One query tile per row has one order, and its table would be the constant
        # `[0]` at batch 1: XLA merges it with the equal zeros that Pallas gives the
        # work items' counter, whose buffer the launch writes in place, so the order
        # read would be the counter's running count (tiles that are never computed).
        if items.needs_order:
            inputs += (heaviest_first(table, items.tiles, wgs, b, block_kv, geom),)
    bounded = BOUNDED_MAX and not segments and h in BOUND_HEAD_DIMS.get(jnp.dtype(q.dtype), ())
    if bounded:  # the largest key norm per batch row and KV head
        # Each key's squared norm in f32 ([B, S, KV heads]; a dot of its bf16 or f16
        # values, whose products f32 holds exactly), with no f32 copy of K.
        norms2 = lax.dot_general(
            k, k, (((3,), (3,)), ((0, 1, 2), (0, 1, 2))), preferred_element_type=jnp.float32
        )
        inputs += (jnp.sqrt(jnp.max(norms2, axis=1)).reshape(-1),)
    kernel = functools.partial(
        _fwd_kernel,
        geom=geom,
        block_kv=block_kv,
        stages=stages,
        qk_scale=scale * LOG2E,
        segments=segments,
        interpret=interpret,
        wgs=wgs,
        items=items,
        spans_only=spans_only,
        run_if=run_if,
        copies=copy_from is not None,
        overlap=overlap,
        memory_warp=one_warp_streams(q, MEMORY_WARP_HEAD_DIMS, interpret),
        memory_q=memory_q,
        bounded=bounded,
    )
    with_ids = 2 if segments else 1  # TMA arrivals on the Q barriers
    with_kv_ids = 2 if stream_ids else 1  # and on the K barriers
    o_rows = out_rows if interpret else q_rows
    out_type = [
        struct((b, o_rows, n, h), out_dtype),
        struct((b, n, out_rows), jnp.float32),
    ]
    if copy_from is not None:
        inputs += tuple(copy_from)
    call = launch(
        kernel,
        out_type=out_type,
        scratch_types=[
            smem_tile((q_slots, wgs, WG_ROWS, h), q.dtype),
            smem_tile((stages, block_kv, h), k.dtype),
            # P V contracts over the step's keys, a multiple of the swizzle's elements.
            smem_tile((stages, block_kv, h), v.dtype, swizzle=64 if block_kv % 64 else 128),
            smem_tile((wgs, WG_ROWS, h), out_dtype),
            plgpu.SMEM((wgs, WG_ROWS), jnp.float32),
            plgpu.SMEM((q_slots, wgs, 3, WG_ROWS), jnp.int32) if segments else None,
            plgpu.SMEM((stages, block_kv), jnp.int32) if stream_ids else None,
            plgpu.SMEM((3,), jnp.int32),  # two work items' tickets, the counter's value
            plgpu.Barrier(num_arrivals=with_ids, num_barriers=q_slots * wgs),
            plgpu.Barrier(num_arrivals=with_kv_ids, num_barriers=stages),
            plgpu.Barrier(num_barriers=stages + 2),  # and 2: a ticket is in its slot
            plgpu.Barrier(num_arrivals=wgs, num_barriers=stages + 2),  # 2: tickets read
            plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
            plgpu.Barrier(num_barriers=wgs)
            if wgs > COMPUTE_WGS
            else plgpu.Barrier(num_arrivals=COMPUTE_WGS),
            # Interpreted: the overlapped loop's S and O (`Accumulators`).
            *(
                [
                    plgpu.SMEM((wgs, WG_ROWS, block_kv), jnp.float32),
                    plgpu.SMEM((wgs, WG_ROWS, h), jnp.float32),
                ]
                if interpret
                else []
            ),
        ],
        **items.grid,
        kernel_name="jflash_mosaic_fwd",
        interpret=interpret,
        wgs=wgs,
    )
    return call(*inputs)
