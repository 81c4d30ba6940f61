"""Whether a change to jflash builds other Mosaic GPU kernels, read on any machine.

    python benchmarks/kernel_modules.py --rev main                  # the tree against main
    python benchmarks/kernel_modules.py --rev HEAD~1 --shapes causal:4096:64,full:1000:128
    python benchmarks/kernel_modules.py --rev main --documents --diff /tmp/kernel-diff

Each shape's forward and backward (`jax.grad` of a sum) are lowered for an abstract H100,
as `tests/test_lowering.py` lowers them: no GPU is needed, since Mosaic GPU builds its
kernels' modules while lowering. That is done once with the working tree's jflash and
once with `--rev`'s (exported as `ab.py` exports it, under another name, in the same
process). Each Mosaic kernel's module is taken before it is serialised and printed
without debug information (source locations move with any edit), and the two are
compared kernel by kernel: `same` where the texts are equal, or how many lines the
change adds or removes, counted with the values' names taken out (one new operation
renumbers every value after it); `--diff DIR` writes both texts,
`<shape>-<kernel>.{tree,rev}.mlir` (`-2`, `-3` after the kernel where a shape builds it
again).

A change that reads `same` everywhere builds the kernels the revision built: what a GPU
measured for the revision (the compiled tests, `ab.py`'s times) holds for it, since the
rest of the way to the GPU (Mosaic's passes, LLVM, ptxas) is the same for both. A change
that differs needs the GPU. Shapes are `mask:S:D` (`ab.py`'s; any length, whole tiles
or not), batch 1, `--heads`/`--kv-heads`, bf16; `--documents` adds each shape with
segment ids (the kernels for packed documents and for any ids); `--deterministic`
lowers the deterministic backward (its own dQ kernel) instead of the default. Kernels the
two sides build in a different number or order are reported as such. The table goes to
stdout and the rows to `--out` (JSON).
"""

from __future__ import annotations

import argparse
import collections
import difflib
import os
import re
import sys
import tempfile

import jax
import jax.numpy as jnp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks import ab  # noqa: E402
from benchmarks.common import as_hopper, check_out, table, write_json  # noqa: E402

# An H100 as jax describes it, for lowering without one (tests/test_lowering.py's).
H100 = ("NVIDIA H100 80GB HBM3", 132, "gpu")
# The module's attribute naming its dump file: a counter of the kernels built so far in
# the process, which differs between the two sides.
_DUMP_NAME = re.compile(r'mosaic_gpu\.dump_basename = "[^"]*"')
_MODULE_NAME = re.compile(r"module @([\w.$-]+)")
_VALUE = re.compile(r"%[\w.$-]+(#\d+)?")  # an SSA value's name (and result number)


def modules_of(fn, *args) -> list[tuple[str, str]]:
    """`(kernel name, module text)` of every Mosaic GPU kernel built while `fn` is
    lowered for CUDA on `args` (shape structs), in the order they are built."""
    from jax._src import mesh as mesh_lib
    from jax.experimental.mosaic.gpu import core

    built = []
    serde = core._run_serde_pass

    def capture(module, **kwargs):
        text = _DUMP_NAME.sub("", module.operation.get_asm(enable_debug_info=False))
        name = _MODULE_NAME.search(text)
        built.append((name.group(1) if name else f"kernel{len(built)}", text))
        return serde(module, **kwargs)

    core._run_serde_pass = capture
    try:
        mesh = jax.sharding.AbstractMesh(
            (1,), ("x",), abstract_device=mesh_lib.AbstractDevice(*H100)
        )
        with jax.sharding.use_abstract_mesh(mesh):
            jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        core._run_serde_pass = serde
    return built


def kernels(
    pkg, causal: bool, seq: int, head_dim: int, *, heads, kv_heads, documents, deterministic
):
    """The Mosaic kernels that package `pkg` (a jflash) builds for one shape's forward
    and backward, `[(name, text)]`."""
    q = jax.ShapeDtypeStruct((1, seq, heads, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, seq, kv_heads, head_dim), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((1, seq), jnp.int32)

    def loss(q, k, v, ids):
        seg = ids if documents else None  # the kernels built do not depend on the values
        out = pkg.flash_attention(
            q,
            k,
            v,
            causal=causal,
            segment_ids=seg,
            implementation="pallas_mosaic",
            deterministic=deterministic,
        )
        return jnp.sum(out.astype(jnp.float32))

    with as_hopper(pkg):
        return modules_of(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv, ids)


def compare(tree: list[tuple[str, str]], rev: list[tuple[str, str]]) -> list[dict]:
    """One row per kernel: `same`, the number of lines that differ, or `only in the
    tree` / `only in the revision` where the two build different kernels."""
    rows = []
    for i in range(max(len(tree), len(rev))):
        t = tree[i] if i < len(tree) else None
        r = rev[i] if i < len(rev) else None
        name = (t or r)[0]
        if t is None or r is None or t[0] != r[0]:
            what = "only in the revision" if t is None else "only in the tree"
            if t is not None and r is not None:
                what = f"the tree builds {t[0]} where the revision builds {r[0]}"
            rows.append({"kernel": name, "result": what})
            continue
        if t[1] == r[1]:
            rows.append({"kernel": name, "result": "same"})
            continue
        # Counted with the values' names taken out: one new operation renumbers every
        # value after it, which is not a change of the lines that use them.
        lines = [_VALUE.sub("%", line) for line in r[1].splitlines()]
        changed = sum(
            1
            for line in difflib.unified_diff(
                lines, [_VALUE.sub("%", line) for line in t[1].splitlines()], n=0
            )
            if line[:1] in "+-" and not line.startswith(("+++", "---"))
        )
        rows.append(
            {"kernel": name, "result": f"differs: {changed} lines of {len(lines)} added or removed"}
        )
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", required=True, help="git revision to compare the tree with")
    parser.add_argument(
        "--shapes",
        default="causal:4096:64,causal:16384:64,causal:4096:128,full:1000:64,full:1000:128",
        help="mask:S:D,... (ab.py's)",
    )
    parser.add_argument("--documents", action="store_true", help="each shape with segment ids too")
    parser.add_argument(
        "--deterministic", action="store_true", help="the deterministic backward (its dQ kernel)"
    )
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--diff", default=None, help="folder for the texts of kernels that differ")
    parser.add_argument("--out", default=None, help="JSON path")
    args = parser.parse_args(argv)
    if args.out:
        check_out(parser, "--out", args.out)
    try:
        shapes = ab.parse_shapes(args.shapes)
        commit = ab.commit_of(args.rev)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        rev_pkg = ab.import_revision(commit, tmp)
        tree_pkg = ab.import_tree(tmp)
        rows = []
        for causal, seq, head_dim in shapes:
            for documents in (False, True) if args.documents else (False,):
                label = f"{'causal' if causal else 'full'}:{seq}:{head_dim}"
                label += " documents" if documents else ""
                kw = dict(
                    heads=args.heads,
                    kv_heads=args.kv_heads,
                    documents=documents,
                    deterministic=args.deterministic,
                )
                built = {
                    side: kernels(pkg, causal, seq, head_dim, **kw)
                    for side, pkg in (("tree", tree_pkg), ("rev", rev_pkg))
                }
                seen = collections.Counter()
                for i, row in enumerate(compare(built["tree"], built["rev"])):
                    rows.append({"shape": label, **row})
                    seen[row["kernel"]] += 1
                    if args.diff and row["result"] != "same":
                        # The i-th kernel of each side; a name built again gets its count.
                        stem = f"{label.replace(':', '-').replace(' ', '-')}-{row['kernel']}"
                        stem += f"-{seen[row['kernel']]}" if seen[row["kernel"]] > 1 else ""
                        os.makedirs(args.diff, exist_ok=True)
                        for side, texts in built.items():
                            if i < len(texts):
                                with open(os.path.join(args.diff, f"{stem}.{side}.mlir"), "w") as f:
                                    f.write(texts[i][1])
    print(f"the tree against {args.rev} ({commit[:12]}):")
    print(table(rows, ["shape", "kernel", "result"]))
    if args.out:
        write_json(args.out, {"rev": args.rev, "rev_commit": commit, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
