"""A peer's forward+backward called again and again in one process: NaN counts per call
and the last call's gap to jflash, causal and full.

    python benchmarks/peer_repeat.py                      # FA3, 16k x 4, 32/8 and 32/32 heads
    python benchmarks/peer_repeat.py --calls 5 --seqs 4096,65536

`kernel.py` and `ab.py` check a peer's outputs before timing it; a peer whose later
calls differ from its first (state left between calls) passed that check while its
timed calls computed something else. This shows it call by call. FlashAttention-3 only
(`flash-attn3-jax`, D = 128); skipped with a note where it is not installed.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jflash  # noqa: E402
from benchmarks.common import check_out, device_name, jit_passes, write_json  # noqa: E402
from benchmarks.kernel import draw_inputs, relative_gap  # noqa: E402

TOKENS = 65536


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seqs", default="16384", help="comma list; batch = 65536 // S")
    p.add_argument("--kv-heads", default="8,32", help="comma list (32 query heads)")
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.out:
        check_out(p, "--out", args.out)
    try:
        seqs = [int(s) for s in args.seqs.split(",")]
        kv_heads = [int(h) for h in args.kv_heads.split(",")]
    except ValueError:
        p.error(f"--seqs {args.seqs} / --kv-heads {args.kv_heads}: comma lists of integers")
    if bad := [s for s in seqs if not 0 < s <= TOKENS or TOKENS % s]:
        p.error(f"--seqs {args.seqs}: {bad[0]} does not divide {TOKENS} tokens")
    if bad := [h for h in kv_heads if h < 1 or 32 % h]:
        p.error(f"--kv-heads {args.kv_heads}: {bad[0]} does not divide the 32 query heads")
    if args.calls < 1:
        p.error(f"--calls {args.calls}: must be positive")
    try:
        from flash_attn3_jax import flash_mha
    except Exception as e:  # noqa: BLE001 - not installed, or built for another jax
        p.error(f"needs flash-attn3-jax on a Hopper GPU, and it is not importable here ({e})")
    rows = []
    print(
        "| S | batch | heads | mask | NaN entries (out, dQ, dK, dV) per call "
        "| last call vs jflash (dQ, dK, dV) |"
    )
    print("|---|---|---|---|---|---|")
    for seq in seqs:
        for kv in kv_heads:
            q, k, v, do = draw_inputs(TOKENS // seq, seq, 32, kv, 128, jnp.bfloat16)
            for causal in (True, False):
                peer = jit_passes(lambda q, k, v, c=causal: flash_mha(q, k, v, is_causal=c))
                ours = jit_passes(
                    lambda q, k, v, c=causal: jflash.flash_attention(q, k, v, causal=c)
                )
                _, expected = ours["fwdbwd"][0](q, k, v, do)
                nans = []
                for _ in range(args.calls):
                    out, grads = peer["fwdbwd"][0](q, k, v, do)
                    nans.append([int(jnp.isnan(x).sum()) for x in (out, *grads)])
                gaps = [relative_gap(a, b) for a, b in zip(grads, expected, strict=True)]
                mask = "causal" if causal else "full"
                rows.append(
                    dict(
                        seq=seq,
                        batch=TOKENS // seq,
                        kv_heads=kv,
                        mask=mask,
                        nan_counts=nans,
                        rel_gap=gaps,
                    )
                )
                gap_text = ", ".join(f"{g:.3g}" for g in gaps)
                print(
                    f"| {seq} | {TOKENS // seq} | 32/{kv} | {mask} | {nans} | {gap_text} |",
                    flush=True,
                )
    out = args.out or os.path.join(
        os.path.dirname(__file__), "results", f"peer-repeat-fa3-{device_name()}.json"
    )
    write_json(out, {"peer": "fa3", "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
