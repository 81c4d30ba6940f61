"""The Mosaic GPU kernels with segment ids (packed documents) against the oracle.

On CPU the kernels run in the GPU interpreter; on an sm90 GPU the same tests run
compiled. The kernels are called through the kernel contract (`mosaic_fwd` /
`mosaic_bwd`), the backward with the global LSE and `delta` as `jflash.flash_attention`
gives them.
"""

from __future__ import annotations

import dataclasses
import zlib

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import INTERPRET, needs_hopper
from kernel_cases import assert_close, make_inputs, oracle, random_segments

import jflash
from jflash._dispatch import delta_from
from jflash._mask import Mask
from jflash._mosaic_bwd import mosaic_bwd
from jflash._mosaic_fwd import mosaic_fwd

pytestmark = needs_hopper


@dataclasses.dataclass(frozen=True)
class Case:
    causal: bool = True
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    q_len: int = 256
    kv_len: int | None = None
    segments: int = 4  # documents per row
    order: str = "packed"  # "packed" (sorted ids) | "shuffled" (ids in any order)
    dtype: object = jnp.bfloat16
    batch: int = 1
    deterministic: bool = False

    def __str__(self):
        kv_len = self.kv_len or self.q_len
        return "-".join(
            [
                "causal" if self.causal else "full",
                f"N{self.q_heads}K{self.kv_heads}",
                f"H{self.head_dim}",
                f"T{self.q_len}S{kv_len}",
                f"B{self.batch}",
                f"{self.segments}{self.order}",
                jnp.dtype(self.dtype).name,
            ]
            + (["deterministic"] if self.deterministic else [])
        )


def segment_ids(case: Case, seed: int):
    """`(q_seg, kv_seg)`: random document boundaries; "shuffled" permutes the ids."""
    q_seg = random_segments(seed, case.batch, case.q_len, case.segments)
    kv_seg = q_seg
    if case.kv_len is not None and case.kv_len != case.q_len:
        kv_seg = random_segments(seed + 1, case.batch, case.kv_len, case.segments)
    if case.order == "shuffled":
        perm = jnp.asarray(np.random.default_rng(seed).permutation(case.segments), jnp.int32)
        q_seg, kv_seg = perm[q_seg], perm[kv_seg]
    return q_seg, kv_seg


def kernels(q, k, v, do, dlse, segs, *, causal: bool, deterministic: bool = False):
    """`(out, lse, dq, dk, dv)` of the Mosaic kernels, the backward fed the cotangents
    `do`, `dlse` as `jflash.flash_attention`'s VJP feeds them."""
    h = q.shape[-1]
    bs = jflash.default_block_sizes(q.shape[1], h, q.dtype, implementation="pallas_mosaic")
    mask, scale = Mask(causal), h**-0.5
    o, lse = mosaic_fwd(
        q,
        k,
        v,
        segs,
        mask=mask,
        scale=scale,
        out_dtype=q.dtype,
        block_kv=bs.block_kv,
        stages=bs.num_stages,
        interpret=INTERPRET,
    )
    grads = mosaic_bwd(
        q,
        k,
        v,
        do.astype(q.dtype),
        lse,
        delta_from(o, do, dlse),
        segs,
        mask=mask,
        scale=scale,
        grad_dtype=q.dtype,
        block_q_dkv=bs.block_q_dkv,
        block_kv_dq=bs.block_kv_dq,
        stages=bs.num_stages_bwd,
        deterministic=deterministic,
        interpret=INTERPRET,
    )
    return (o, lse, *grads)


def inputs(case: Case, seed: int):
    return make_inputs(
        seed,
        batch=case.batch,
        q_len=case.q_len,
        kv_len=case.kv_len or case.q_len,
        q_heads=case.q_heads,
        kv_heads=case.kv_heads,
        head_dim=case.head_dim,
        dtype=case.dtype,
    )


CASES = [
    Case(q_len=128, segments=3),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_oracle(case):
    seed = zlib.crc32(str(case).encode()) % 1000
    q, k, v, do, dlse = inputs(case, seed)
    segs = segment_ids(case, seed)
    got = kernels(q, k, v, do, dlse, segs, causal=case.causal, deterministic=case.deterministic)
    want = oracle(q, k, v, do, dlse, causal=case.causal, segment_ids=segs)
    assert_close(got, want, case.dtype)
    np.testing.assert_array_equal(np.isneginf(got[1]), np.isneginf(want[1]))
