"""Causal work per rank with packed documents, for each sequence layout (CPU, numpy).

A ring step waits for its slowest rank, so what matters is the max over ranks of the
work, over its mean. Work is counted two ways on the same packed rows:

* mask area: the visible (query, key) pairs each rank's queries have (causal, same
  document), what a kernel that skips perfectly would compute;
* tiles: the `tile x tile` blocks a rank's kernels visit over the P ring steps,
  skipping a block when its query and key document-id ranges do not overlap or when
  it lies wholly above the causal diagonal (the kernels' rule).

Documents: log-normal lengths (mean `--mean-doc`, sigma 1), capped at `--max-doc`,
packed into rows of P x `--tokens-per-gpu` tokens, fixed seeds.

    python benchmarks/balance.py --out benchmarks/results/balance-cpu.json

`--kernel-tiles`: one GPU instead, `benchmarks/kernel.py --documents`' packed row (64k
tokens, 22 documents): the area a kernel computes, tile by tile, over the mask area,
and the share of its tiles that need the mask, for jflash's tiles (aligned to the
packed row) and FlashAttention-3's variable-length tiles (aligned to each document's
first token).

    python benchmarks/balance.py --kernel-tiles
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import check_out, check_positive  # noqa: E402


def document_lengths(total: int, rng, mean: int, cap: int) -> list[int]:
    sigma = 1.0
    mu = np.log(mean) - sigma**2 / 2
    lengths: list[int] = []
    while sum(lengths) < total:
        lengths.append(int(np.clip(rng.lognormal(mu, sigma), 1, cap)))
    lengths[-1] -= sum(lengths) - total
    return lengths


def packed_row_lengths(tokens: int, seed: int = 0) -> list[int]:
    """The packed row of `benchmarks/kernel.py --documents`: document lengths that pack
    `tokens` exactly, log-normal (sigma 1) with mean `tokens / 16` (4k at 64k), each
    capped at `tokens / 4`, the last one cut to fit."""
    return document_lengths(tokens, np.random.default_rng(seed), tokens // 16, tokens // 4)


def order(layout: str, seq_len: int, p: int) -> np.ndarray:
    """Natural index of the token at each slot of `layout` (jflash.to_layout's order)."""
    t = np.arange(seq_len)
    if layout == "striped":
        return t.reshape(seq_len // p, p).T.reshape(-1)
    if layout == "zigzag":
        chunks = t.reshape(2 * p, -1)
        slots = np.stack([np.arange(p), 2 * p - 1 - np.arange(p)], axis=1).reshape(-1)
        return chunks[slots].reshape(-1)
    return t


def tile_bounds(x: np.ndarray, tile: int):
    tiles = x.reshape(-1, tile)
    return tiles.min(axis=1), tiles.max(axis=1)


def rank_work(lengths: list[int], p: int, layout: str, tile: int):
    """`(area [P], tiles [P])` for one packed row."""
    seq_len = sum(lengths)
    seg = np.repeat(np.arange(len(lengths)), lengths)
    start = np.repeat(np.cumsum([0, *lengths[:-1]]), lengths)
    visible_keys = np.arange(seq_len) - start + 1  # causal, same document
    slots = order(layout, seq_len, p).reshape(p, -1)  # [P, T/P] natural indices
    area = visible_keys[slots].sum(axis=1)
    tiles = np.zeros(p, np.int64)
    bounds = [(tile_bounds(seg[s], tile), tile_bounds(s, tile)) for s in slots]
    for r in range(p):
        (q_lo, q_hi), (qp_lo, qp_hi) = bounds[r]
        for s in range(p):
            (k_lo, k_hi), (kp_lo, kp_hi) = bounds[s]
            meet = (k_lo[None] <= q_hi[:, None]) & (k_hi[None] >= q_lo[:, None])
            causal = kp_lo[None] <= qp_hi[:, None]
            tiles[r] += int((meet & causal).sum())
    return area, tiles


def kernel_tiles(lengths: list[int], side: str, tile: int, step: int, aligned: str):
    """`(computed area / mask area, share of computed steps that need the mask)` of
    causal attention over the packed `lengths`, computed as a kernel tiles it.

    `side="query"`: each program holds `tile` queries and streams keys in `step`-token
    steps (the forward); `"key"`: `tile` keys streaming queries (the dK/dV kernel). A
    program computes one contiguous run of steps, from the one holding its rows' first
    partner to the one holding their last (what the kernels' tile tables give), each
    step a full `tile x step` block. `aligned="global"`: programs and steps at
    multiples of `tile` and `step` of the packed row (jflash); `"document"`: from each
    document's first token, its last program cut short (FlashAttention-3's
    variable-length kernels). A step needs the mask unless every row of the program
    sees all of it."""
    if side not in ("query", "key") or aligned not in ("global", "document"):
        raise ValueError(
            f"side={side!r} must be query or key, aligned={aligned!r} global or document"
        )
    seq_len = sum(lengths)
    starts = np.cumsum([0, *lengths[:-1]])
    first = np.repeat(starts, lengths)
    last = first + np.repeat(lengths, lengths) - 1
    x = np.arange(seq_len)
    # The partners of each row: keys [first, x] of a query, queries [x, last] of a key.
    lo, hi = (first, x) if side == "query" else (x, last)
    if aligned == "global":
        spans = [(r, min(r + tile, seq_len), 0) for r in range(0, seq_len, tile)]
    else:
        spans = [
            (r, min(r + tile, d + n), d)
            for d, n in zip(starts, lengths, strict=True)
            for r in range(d, d + n, tile)
        ]
    area = masked = steps = 0
    for r0, r1, base in spans:
        s_lo = (lo[r0:r1].min() - base) // step
        s_hi = (hi[r0:r1].max() - base) // step
        s0 = base + step * np.arange(s_lo, s_hi + 1)
        clear = (s0 >= lo[r0:r1].max()) & (s0 + step - 1 <= hi[r0:r1].min())
        steps += len(s0)
        masked += int((~clear).sum())
        area += tile * step * len(s0)
    mask_area = sum(n * (n + 1) // 2 for n in lengths)
    return area / mask_area, masked / steps


KERNEL_TILES = (  # (who, pass, side, tile, step, aligned)
    ("jflash, per warpgroup", "forward", "query", 64, 128, "global"),
    ("jflash, per CTA (2 warpgroups)", "forward", "query", 128, 128, "global"),
    ("FlashAttention-3 varlen", "forward", "query", 128, 128, "document"),
    ("jflash, per warpgroup", "dK/dV", "key", 64, 64, "global"),
    ("jflash, per CTA (2 warpgroups)", "dK/dV", "key", 128, 64, "global"),
    ("FlashAttention-3 varlen", "dK/dV", "key", 128, 64, "document"),
)


def kernel_tiles_table(lengths: list[int]) -> list[dict]:
    rows = []
    for who, which, side, tile, step, aligned in KERNEL_TILES:
        area, masked = kernel_tiles(lengths, side, tile, step, aligned)
        rows.append(
            {
                "kernel": who,
                "pass": which,
                "tile": f"{tile} x {step}",
                "aligned": aligned,
                "area_over_mask": area,
                "masked_share": masked,
            }
        )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shards", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--tokens-per-gpu", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--mean-doc", type=int, default=4096)
    ap.add_argument("--max-doc", type=int, default=65536)
    ap.add_argument("--tile", type=int, default=128)
    ap.add_argument("--rows", type=int, default=8, help="packed rows (seeds) per setting")
    ap.add_argument("--out", default=None, help="JSON file to write")
    ap.add_argument(
        "--kernel-tiles", action="store_true", help="one GPU's tiles on kernel.py's packed row"
    )
    args = ap.parse_args(argv)
    if args.out:
        check_out(ap, "--out", args.out)
    check_positive(ap, args, "shards", "tokens_per_gpu", "mean_doc", "max_doc", "tile", "rows")
    for tokens in args.tokens_per_gpu:
        if tokens % args.tile:
            ap.error(f"--tokens-per-gpu {tokens}: not a multiple of --tile {args.tile}")
    if args.kernel_tiles:
        lengths = packed_row_lengths(65536)
        rows = kernel_tiles_table(lengths)
        print(
            f"{len(lengths)} documents in {sum(lengths)} tokens, causal; area / mask area, "
            "share of steps masked"
        )
        for r in rows:
            print(
                f"{r['pass']:>8} {r['kernel']:<32} {r['tile']:>9} {r['aligned']:>9} "
                f"{r['area_over_mask']:7.3f} {r['masked_share']:7.3f}"
            )
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"documents": lengths, "rows": rows}, f, indent=1)
            print(f"wrote {args.out}")
        return 0
    layouts = ("contiguous", "zigzag", "striped")
    rows = []
    print(
        f"documents: log-normal, mean {args.mean_doc}, cap {args.max_doc}; "
        f"{args.rows} rows each; imbalance = max over ranks / mean (worst row)"
    )
    print(f"{'tokens/GPU':>10} {'P':>3} " + " ".join(f"{x + ' area/tiles':>24}" for x in layouts))
    for per_gpu in args.tokens_per_gpu:
        for p in args.shards:
            worst = {x: [1.0, 1.0] for x in layouts}
            docs = []
            for seed in range(args.rows):
                rng = np.random.default_rng(seed)
                lengths = document_lengths(per_gpu * p, rng, args.mean_doc, args.max_doc)
                docs.append(len(lengths))
                for layout in layouts:
                    area, tiles = rank_work(lengths, p, layout, args.tile)
                    w = worst[layout]
                    w[0] = max(w[0], float(area.max() / area.mean()))
                    w[1] = max(w[1], float(tiles.max() / tiles.mean()))
            print(
                f"{per_gpu:>10} {p:>3} "
                + " ".join(f"{worst[x][0]:>15.3f} / {worst[x][1]:<6.3f}" for x in layouts)
            )
            rows.append(
                {
                    "tokens_per_gpu": per_gpu,
                    "shards": p,
                    "documents_per_row": docs,
                    **{f"{x}_area": worst[x][0] for x in layouts},
                    **{f"{x}_tiles": worst[x][1] for x in layouts},
                }
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
