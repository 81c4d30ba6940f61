"""The dK/dV head split of short causal launches: each shape's Mosaic forward+backward
with a fixed number of dK/dV CTAs per KV head (`jflash.BlockSizes.head_shares_dkv`; 1:
one CTA per (128-key tile, KV head)) and as jflash runs it (its own choice), beside
FlashAttention-3 (where installed) and cuDNN, in one process.

    python benchmarks/head_split.py
    python benchmarks/head_split.py --shapes 1024:32:8:128:causal,8192:8:2:64:causal
    python benchmarks/head_split.py --shares 1,2,4
    python benchmarks/head_split.py --shapes 65536:32:8:128:causal --shares 1,2,4 --rounds 3

A shape is `S:heads:kv_heads:D:mask[:batch]`; a share that does not divide a shape's
query heads per KV head is left out of its rows. The fixed shares pass their tiles
(`jflash.default_block_sizes`), so their forward is two warpgroups' with those tiles
where jflash's own may take another form: `bwd_ms` (forward+backward less forward)
compares the backward alone. `--rounds N` times each shape's rows again in N interleaved
rounds after a heat of load (`kernel.retime_rows`, as the kernel table does), each row
keeping its best, so the GPU's drift reaches every row alike; without it each row is
timed once, one after the other. `fwdbwd_vs_fa3` / `fwdbwd_vs_cudnn`: the peer's time ÷
the row's. Prints a table, writes
`ab-head-split-<gpu>.json` once every row has run, and the rows so far beside it after
every row (`.partial`, `"complete": false`: a run cut short keeps the rows it timed).
GPU only: on a CPU it stops with one line (exit status 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jflash  # noqa: E402
from benchmarks.common import check_out, device_name, table, write_json  # noqa: E402
from benchmarks.kernel import add_ratios, measure, retime_rows  # noqa: E402

SHAPES = (
    "1024:32:8:128:causal,2048:32:8:128:causal,2560:32:8:128:causal,3072:32:8:128:causal,"
    "4096:32:8:128:causal,8192:8:2:128:causal,2048:32:8:128:causal:2,2048:32:8:128:full,"
    "1024:32:8:64:causal,2048:32:8:64:causal,3072:32:8:64:causal,8192:8:2:64:causal"
)


def parse_shapes(text: str) -> list[dict]:
    """`S:heads:kv_heads:D:mask[:batch]` items, comma separated."""
    shapes = []
    for item in text.split(","):
        parts = item.split(":")
        try:
            seq, heads, kv, d = map(int, parts[:4])
            mask, batch = parts[4], int(parts[5]) if len(parts) > 5 else 1
        except (ValueError, IndexError):
            want = "S:heads:kv_heads:D:mask[:batch]"
            raise ValueError(f"--shapes item {item!r}: want {want}") from None
        if mask not in ("causal", "full") or len(parts) > 6 or heads % kv:
            raise ValueError(f"--shapes item {item!r}: mask causal|full, heads % kv_heads == 0")
        shapes.append(dict(seq=seq, heads=heads, kv_heads=kv, head_dim=d, mask=mask, batch=batch))
    return shapes


def parse_shares(text: str) -> list[int]:
    """Positive ints, comma separated."""
    try:
        shares = [int(item) for item in text.split(",")]
    except ValueError:
        shares = []
    if not shares or min(shares) < 1:
        raise ValueError(f"--shares {text!r}: want positive ints, comma separated (1,2,4)")
    return shares


def settings_of(shape: dict, shares: list[int]) -> list[tuple[str, int]]:
    """`(setting, head_shares_dkv)` per Mosaic row of `shape`: each of `shares` that
    divides its group, then jflash's own choice (0)."""
    group = shape["heads"] // shape["kv_heads"]
    fixed = [(f"shares={n}", n) for n in dict.fromkeys(shares) if group % n == 0]
    return [*fixed, ("jflash", 0)]


def backward_ms(row: dict) -> float | None:
    """Forward+backward less forward, where the row timed both."""
    fwd, both = row.get("fwd_ms"), row.get("fwdbwd_ms")
    return None if fwd is None or both is None else round(both - fwd, 4)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=SHAPES, help="S:heads:kv_heads:D:mask[:batch], ...")
    p.add_argument("--shares", default="1", help="dK/dV CTAs per KV head to time, e.g. 1,2,4")
    p.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="time each shape's rows again in this many interleaved rounds (0: once each)",
    )
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    if args.rounds < 0:
        p.error(f"--rounds {args.rounds}: want 0 or more")
    check_out(p, "--out", args.out, directory=True)
    try:
        shapes, shares = parse_shapes(args.shapes), parse_shares(args.shares)
    except ValueError as e:
        p.error(str(e))
    if jax.default_backend() != "gpu":
        print(f"head_split.py times GPU kernels: no GPU (jax backend {jax.default_backend()!r})")
        return 2
    out = os.path.join(args.out, f"ab-head-split-{device_name()}.json")
    rows = []
    for shape in shapes:
        reference = {}
        sizes = dict(
            batch=shape["batch"],
            seq=shape["seq"],
            heads=shape["heads"],
            kv_heads=shape["kv_heads"],
            head_dim=shape["head_dim"],
            causal=shape["mask"] == "causal",
        )
        tiles = jflash.default_block_sizes(
            shape["seq"], shape["head_dim"], jnp.bfloat16, implementation="pallas_mosaic"
        )
        runs = [(name, "jflash_mosaic", n) for name, n in settings_of(shape, shares)]
        entries = []  # (row, timers): what --rounds times again
        for name, impl, n in [*runs, ("fa3", "fa3", None), ("cudnn", "cudnn", None)]:
            jax.clear_caches()
            # A fixed share passes its tiles (two warpgroups' forward); jflash's row none.
            block_sizes = dataclasses.replace(tiles, head_shares_dkv=n) if n else None
            timers = {}
            row = measure(
                impl,
                **sizes,
                block_sizes=block_sizes,
                reference=reference if impl == "jflash_mosaic" else None,
                timers=timers,
            )
            row.update(setting=name, bwd_ms=backward_ms(row))
            rows.append(row)
            entries.append((row, timers))
            print(row, flush=True)
            write_json(out, {"complete": False, "rows": rows}, partial=True)
        if args.rounds:
            retime_rows(entries, args.rounds)
        shape_rows = [row for row, _ in entries]
        for row in shape_rows:
            row["bwd_ms"] = backward_ms(row)
        add_ratios(shape_rows, ("fa3", "cudnn"))
        write_json(out, {"complete": False, "rows": rows}, partial=True)
    columns = ["setting", "mask", "seq_len", "batch", "heads", "kv_heads", "head_dim"]
    timed = ["fwd_ms", "fwdbwd_ms", "bwd_ms", "fwdbwd_vs_fa3", "fwdbwd_vs_cudnn"]
    print(table(rows, [*columns, *timed, "grad_rel_diff"]))
    write_json(out, {"complete": True, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
