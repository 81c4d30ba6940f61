"""The dK/dV head split of short causal launches (`jflash._mosaic_bwd.head_split`): each
shape's Mosaic forward+backward with one CTA per (128-key tile, KV head) ("unsplit")
and as jflash runs it, beside FlashAttention-3 (where installed) and cuDNN, in one
process. Rows the rule does not split are timed once.

    python benchmarks/head_split.py
    python benchmarks/head_split.py --shapes 1024:32:8:128:causal,8192:8:2:64:causal

A shape is `S:heads:kv_heads:D:mask[:batch]`. Prints a table, writes
`ab-head-split-<gpu>.json`. GPU only: on a CPU it stops with one line (exit status 2).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import device_name, table, write_json  # noqa: E402
from benchmarks.kernel import measure  # noqa: E402
from jflash import _mosaic_bwd  # noqa: E402

SHAPES = (
    "1024:32:8:128:causal,2048:32:8:128:causal,3072:32:8:128:causal,4096:32:8:128:causal,"
    "8192:8:2:128:causal,2048:32:8:128:causal:2,2048:32:8:128:full,"
    "1024:32:8:64:causal,2048:32:8:64:causal,8192:8:2:64:causal"
)
ROWS = 128  # keys per dK/dV CTA


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


def shares_of(shape: dict) -> int:
    """The rule's shares for `shape`'s dK/dV launch."""
    ctas = shape["batch"] * shape["kv_heads"] * -(-shape["seq"] // ROWS)
    group = shape["heads"] // shape["kv_heads"]
    return _mosaic_bwd.head_split(ctas, group, shape["mask"] == "causal")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=SHAPES, help="S:heads:kv_heads:D:mask[:batch], ...")
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    try:
        shapes = parse_shapes(args.shapes)
    except ValueError as e:
        p.error(str(e))
    if jax.default_backend() != "gpu":
        print(f"head_split.py times GPU kernels: no GPU (jax backend {jax.default_backend()!r})")
        return 2
    rule = _mosaic_bwd.head_split
    rows = []
    for shape in shapes:
        shares, reference = shares_of(shape), {}
        settings = ["unsplit", "jflash"] if shares > 1 else ["jflash"]
        for name in [*settings, "fa3", "cudnn"]:
            jax.clear_caches()
            _mosaic_bwd.head_split = (lambda c, g, causal: 1) if name == "unsplit" else rule
            impl = "jflash_mosaic" if name in ("unsplit", "jflash") else name
            row = measure(
                impl,
                batch=shape["batch"],
                seq=shape["seq"],
                heads=shape["heads"],
                kv_heads=shape["kv_heads"],
                head_dim=shape["head_dim"],
                causal=shape["mask"] == "causal",
                reference=reference if impl == "jflash_mosaic" else None,
            )
            row.update(setting=name, shares=shares)
            rows.append(row)
            print(row, flush=True)
    _mosaic_bwd.head_split = rule
    columns = ["setting", "mask", "seq_len", "batch", "heads", "kv_heads", "head_dim"]
    print(table(rows, [*columns, "shares", "fwd_ms", "fwdbwd_ms", "grad_rel_diff"]))
    write_json(os.path.join(args.out, f"ab-head-split-{device_name()}.json"), {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
