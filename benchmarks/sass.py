"""A Mosaic GPU kernel's machine code, read per loop on any machine: where its spills
sit, and what one pass of each loop issues.

    # on a Hopper GPU: dump the kernels a call compiles
    MOSAIC_GPU_DUMP_TO=dump MOSAIC_GPU_DUMP_PTXAS=1 python my_call.py
    # anywhere with ptxas and nvdisasm (pip install nvidia-cuda-nvdisasm)
    python benchmarks/sass.py dump/jflash_mosaic_fwd_0.ptx dump/jflash_mosaic_dkv_1.ptx

ptxas reports a kernel's registers and spill bytes, not where the spills are. Each
`.ptx` given is assembled again (`ptxas -arch=sm_90a -O3 -v`: the same counts as on the
GPU, the same ptxas major version aside) and the cubin disassembled into its basic-block
graph (`nvdisasm -bbcfg`); a `.cubin` is disassembled as it is. Loops are the graph's
natural loops (a back edge to a block that dominates it, with every block that reaches
the edge without passing the header); blocks shared by nested loops count in each. Per
loop the table gives its header, nesting depth, blocks and instructions, and per pass:
wgmmas (`HGMMA`), SFU ops (`MUFU`), local-memory loads and stores (`LDL`/`STL`: the
spills' reloads and stores), mbarrier and named-barrier ops (`SYNCS`, `BAR`), and
`WARPGROUP` syncs (waits on wgmmas and `wgmma.fence`). Only loops with wgmmas, SFU ops or
local memory are shown unless `--all`. `--out` writes the rows as JSON.

A cubin of several kernels, or one whose block graph nvdisasm will not draw (cubins of
other toolchains, such as FlashAttention-3's from its wheel: "Old format", no dataflow
analysis), is read from the plain disassembly instead (`nvdisasm -c`): blocks from its
labels and branches, one graph per function. `--function TEXT` keeps the functions whose
mangled name contains TEXT; `--opcodes` adds each loop's opcode counts.

    # FlashAttention-3's backward kernels from the flash-attn3-jax wheel
    cuobjdump -lelf flash_attn3_jax_lib/flash_api*.so          # lists the cubins
    cuobjdump -xelf flash_bwd_hdim128_bf16_sm90.sm_90a.cubin flash_attn3_jax_lib/flash_api*.so
    python benchmarks/sass.py flash_bwd_hdim128_bf16_sm90.sm_90a.cubin --function Bwd --opcodes

`--ptxas` / `--nvdisasm` name the tools; by default each is looked up on PATH and then,
for nvdisasm, in the `nvidia-cuda-nvdisasm` wheel's `nvidia/cu*/bin`.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.common import check_out, table, write_json  # noqa: E402

ARCH = "sm_90a"
# Opcode prefixes counted per loop pass: column name -> prefixes.
KINDS = {
    "hgmma": ("HGMMA",),
    "mufu": ("MUFU",),
    "ldl": ("LDL",),
    "stl": ("STL",),
    "barriers": ("SYNCS", "BAR"),
    "warpgroup": ("WARPGROUP",),
}
COLUMNS = ["kernel", "loop", "depth", "blocks", "instructions", *KINDS]
_NODE = re.compile(r'^"([^"]+)"\s*$')
_LABEL = re.compile(r'^\[label="\{(.*)\}"\]\s*$')
_EDGE = re.compile(r'^"([^"]+)"(?::\w+)?(?::\w)?\s*->\s*"([^"]+)"')


def parse_cfg(dot: str) -> tuple[str, dict[str, list[str]], dict[str, list[str]]]:
    """`(entry, instructions per block, successors per block)` of nvdisasm's
    `-bbcfg` output for one function (its first block is the entry)."""
    blocks: dict[str, list[str]] = {}
    succ: dict[str, list[str]] = {}
    name = None
    for line in dot.splitlines():
        if m := _NODE.match(line):
            name = m.group(1)
            blocks.setdefault(name, [])
            succ.setdefault(name, [])
        elif (m := _LABEL.match(line)) and name is not None:
            blocks[name] = _instructions(m.group(1))
        elif m := _EDGE.match(line):
            succ.setdefault(m.group(1), []).append(m.group(2))
            succ.setdefault(m.group(2), [])
            blocks.setdefault(m.group(1), [])
            blocks.setdefault(m.group(2), [])
    if not blocks:
        raise ValueError("no basic blocks in the disassembly (not nvdisasm -bbcfg output?)")
    return next(iter(blocks)), blocks, succ


def _instructions(label: str) -> list[str]:
    """The opcodes of one DOT node label (`\\l`-separated lines, `\\ ` for spaces), each
    without its predicate (`@P0`, `@!P1`)."""
    ops = []
    for raw in label.split("\\l"):
        text = re.sub(r"\\(.)", r"\1", raw).strip()
        if not text.endswith(";") or text.startswith("."):
            continue
        words = text.rstrip(";").split()
        if words and words[0].startswith("@"):
            words = words[1:]
        if words:
            ops.append(words[0])
    return ops


def _predecessors(nodes, succ: dict[str, list[str]]) -> dict[str, list[str]]:
    """Each of `nodes` (closed under `succ`): the blocks that branch to it."""
    preds: dict[str, list[str]] = {n: [] for n in nodes}
    for node in nodes:
        for nxt in succ.get(node, ()):
            preds[nxt].append(node)
    return preds


def dominators(entry: str, succ: dict[str, list[str]]) -> dict[str, set[str]]:
    """Each block reachable from `entry`: the blocks that dominate it (itself included)."""
    order, seen, stack = [], {entry}, [entry]
    while stack:
        node = stack.pop()
        order.append(node)
        for nxt in succ.get(node, ()):
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    preds = _predecessors(order, succ)
    dom = {n: set(order) for n in order}
    dom[entry] = {entry}
    changed = True
    while changed:
        changed = False
        for node in order[1:]:
            new = set.intersection(*(dom[p] for p in preds[node])) | {node}
            if new != dom[node]:
                dom[node], changed = new, True
    return dom


def natural_loops(entry: str, succ: dict[str, list[str]]) -> dict[str, set[str]]:
    """Header -> the blocks of its natural loop (the loops of back edges to one header
    merged)."""
    dom = dominators(entry, succ)
    preds = _predecessors(dom, succ)
    loops: dict[str, set[str]] = {}
    for node in dom:
        for header in succ.get(node, ()):
            if header in dom[node]:  # a back edge node -> header
                body, stack = {header, node}, [] if node == header else [node]
                while stack:
                    for p in preds[stack.pop()]:
                        if p not in body:
                            body.add(p)
                            stack.append(p)
                loops.setdefault(header, set()).update(body)
    return loops


_SECTION = re.compile(r"^\s*\.section\s+\.text\.(\S+?)(?:,|\s|$)")
_TEXT_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_TEXT_INST = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


_JUMPS = ("BRA", "BRX", "JMP", "EXIT", "RET")


def text_cfgs(text: str) -> dict[str, tuple[str, dict[str, list[str]], dict[str, list[str]]]]:
    """Per function of nvdisasm's plain disassembly (`-c`), by mangled name: `(entry,
    instructions per block, successors per block)`, as `parse_cfg` gives for one. A
    block starts at a label and after a jump or an exit; a jump's target is an edge,
    and so is the next block unless the jump or exit is unconditional."""
    out = {}
    for chunk in re.split(r"(?m)^(?=\s*\.section\s+\.text\.)", text):
        if (m := _SECTION.match(chunk)) and (cfg := _text_cfg(m.group(1), chunk.splitlines())):
            out[m.group(1)] = cfg
    return out


def _text_cfg(name: str, lines: list[str]):
    """`text_cfgs`' graph of one function's lines (None: no instructions)."""
    blocks: dict[str, list[str]] = {}
    succ: dict[str, list[str]] = {}
    order: list[str] = []
    current, ended, falls = None, True, False
    for line in lines:
        label = lm.group(1) if (lm := _TEXT_LABEL.match(line)) else None
        im = None if label else _TEXT_INST.search(line)
        if label is None and im is None:
            continue
        if label is not None or ended:  # a new block
            new = label or f"{name}+{len(order)}"
            if current is not None and falls:
                succ[current].append(new)
            current, ended, falls = new, False, True
            order.append(new)
            blocks.setdefault(new, [])
            succ.setdefault(new, [])
        if im is None:
            continue
        words = im.group(1).split()
        predicated = words[0].startswith("@")
        op = words[1] if predicated else words[0]
        blocks[current].append(op)
        if op.startswith(_JUMPS):
            if tm := _TARGET.search(im.group(1)):
                succ[current].append(tm.group(1))
            ended, falls = True, predicated  # a predicated jump may fall through
    for targets in list(succ.values()):
        for target in targets:
            blocks.setdefault(target, [])
            succ.setdefault(target, [])
    return (order[0], blocks, succ) if order else None


def loop_rows(kernel: str, dot, *, everything: bool = False, opcodes: bool = False) -> list[dict]:
    """One row per natural loop of the function in `dot` (nvdisasm's `-bbcfg` output,
    or a `(entry, blocks, successors)` graph from `text_cfgs`), outermost first; with
    `opcodes`, each row's opcode counts too (the opcode's first word part, `FSEL`
    for `FSEL`, `HGMMA` for `HGMMA.64x64x16.F32.BF16`)."""
    entry, blocks, succ = parse_cfg(dot) if isinstance(dot, str) else dot
    loops = natural_loops(entry, succ)
    rows = []
    for header, body in loops.items():
        depth = sum(1 for other in loops.values() if body < other) + 1
        ops = [op for b in body for op in blocks.get(b, [])]
        row = dict(kernel=kernel, loop=header, depth=depth, blocks=len(body), instructions=len(ops))
        for col, prefixes in KINDS.items():
            row[col] = sum(op.startswith(prefixes) for op in ops)
        if opcodes:
            counts = collections.Counter(op.split(".")[0] for op in ops)
            row["opcodes"] = dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
        if everything or row["hgmma"] or row["mufu"] or row["ldl"] or row["stl"]:
            rows.append(row)
    return sorted(rows, key=lambda r: (r["depth"], -r["instructions"]))


def find_tool(name: str, given: str | None) -> str:
    if given:
        if not os.path.isfile(given):
            raise SystemExit(f"--{name}={given!r}: no such file")
        return given
    found = shutil.which(name)
    if found is None:  # the nvidia-cuda-nvdisasm wheel
        site = sysconfig.get_paths()["purelib"]
        wheels = sorted(glob.glob(os.path.join(site, "nvidia", "cu*", "bin", name)))
        found = wheels[-1] if wheels else None
    if found is None:
        hint = " (pip install nvidia-cuda-nvdisasm)" if name == "nvdisasm" else ""
        raise SystemExit(f"{name} not found on PATH{hint}; name it with --{name}")
    return found


def assemble(ptx: str, ptxas: str, out_dir: str) -> tuple[str, dict]:
    """`(cubin path, ptxas's report)`: registers, spill store/load bytes and any
    wgmma serialisation messages (C7510-C7519)."""
    cubin = os.path.join(out_dir, os.path.basename(ptx) + ".cubin")
    run = subprocess.run(
        [ptxas, f"-arch={ARCH}", "-O3", "-v", ptx, "-o", cubin], capture_output=True, text=True
    )
    if run.returncode:
        raise SystemExit(f"ptxas failed on {ptx}: {run.stderr.strip().splitlines()[-1:]}")
    text = run.stdout + run.stderr
    regs = re.search(r"Used (\d+) registers", text)
    stores = re.search(r"(\d+) bytes spill stores", text)
    loads = re.search(r"(\d+) bytes spill loads", text)
    report = dict(
        registers=int(regs.group(1)) if regs else None,
        spill_stores=int(stores.group(1)) if stores else 0,
        spill_loads=int(loads.group(1)) if loads else 0,
        serialised=sorted(set(re.findall(r"C75\d\d", text))),
    )
    return cubin, report


def cubin_rows(kernel: str, cubin: str, nvdisasm: str, args) -> list[dict]:
    """The loop rows of one cubin: from its block graph where nvdisasm draws one for a
    single function and no `--function` is given, else from its plain disassembly, one
    kernel label per function (`kernel:index`, the index among the cubin's functions)."""
    kw = dict(everything=args.all, opcodes=args.opcodes)
    if args.function is None:
        run = subprocess.run([nvdisasm, "-bbcfg", cubin], capture_output=True, text=True)
        if run.returncode == 0 and run.stdout.count("digraph") == 1:
            return loop_rows(kernel, run.stdout, **kw)
    run = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"nvdisasm failed on {cubin}: {run.stderr.strip()[-300:]}")
    cfgs = text_cfgs(run.stdout)
    rows = []
    for i, (name, cfg) in enumerate(cfgs.items()):
        if args.function is None or args.function in name:
            rows += loop_rows(f"{kernel}:{i}" if len(cfgs) > 1 else kernel, cfg, **kw)
    if not rows and args.function is not None:
        raise SystemExit(f"--function {args.function!r}: no function of {cubin} has loops")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help=".ptx (assembled here) or .cubin files")
    parser.add_argument("--ptxas", default=None)
    parser.add_argument("--nvdisasm", default=None)
    parser.add_argument("--all", action="store_true", help="every loop, not only busy ones")
    parser.add_argument(
        "--function", default=None, help="only functions whose mangled name holds this text"
    )
    parser.add_argument("--opcodes", action="store_true", help="each loop's opcode counts")
    parser.add_argument("--out", default=None, help="JSON path")
    args = parser.parse_args(argv)
    if args.out:
        check_out(parser, "--out", args.out)
    for path in args.files:
        if not os.path.isfile(path):
            parser.error(f"{path!r}: no such file")
        if not path.endswith((".ptx", ".cubin")):
            parser.error(f"{path!r}: give a .ptx or a .cubin")
    nvdisasm = find_tool("nvdisasm", args.nvdisasm)
    ptxas = find_tool("ptxas", args.ptxas) if any(p.endswith(".ptx") for p in args.files) else None
    rows, kernels = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for path in args.files:
            kernel = os.path.basename(path).rsplit(".", 1)[0]
            report: dict = {}
            cubin = path
            if path.endswith(".ptx"):
                cubin, report = assemble(path, ptxas, tmp)
                kernels.append(dict(kernel=kernel, **report))
            rows += cubin_rows(kernel, cubin, nvdisasm, args)
    for k in kernels:
        serialised = ", ".join(k["serialised"]) or "none"
        print(
            f"{k['kernel']}: {k['registers']} registers, spill stores / loads "
            f"{k['spill_stores']} / {k['spill_loads']} bytes, serialised wgmmas: {serialised}"
        )
    print(table(rows, COLUMNS))
    if args.opcodes:
        for row in rows:
            ops = ", ".join(f"{op} {n}" for op, n in row["opcodes"].items())
            print(f"{row['kernel']} {row['loop']}: {ops}")
    if args.out:
        write_json(args.out, {"arch": ARCH, "kernels": kernels, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
