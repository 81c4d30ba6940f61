"""Hardware counters of the attention kernels (Nsight Compute), jflash beside
FlashAttention-3: where a kernel's time goes when the clock alone cannot say.

    python benchmarks/counters.py                        # Hopper GPU, `ncu` on PATH
    python benchmarks/counters.py --cases jflash:16384:64
    python benchmarks/counters.py --cases jflash:65536:128,fa3:65536:128 --mask full
    python benchmarks/counters.py --cases jflash:65536:128,fa3:65536:128 --mask documents --pass fwd
    python benchmarks/counters.py --parse out/ncu-*.txt  # summarise saved ncu output

Each case `impl:S:D` (impl `jflash` or `fa3`) runs one forward+backward call (`--pass
fwdbwd`) or one forward (`--pass fwd`) of `--tokens` tokens (batch = tokens // S),
`--mask` causal, full or documents (causal over `kernel.py --documents`' packed row
of S tokens, batch 1, FA3 as its variable-length kernel), 32 query heads and
`--kv-heads` (8), bf16, in a child process under `ncu --clock-control none` (clocks
left as they are), which profiles the first launch of the pass's kernels (a regular
expression on demangled names, `KERNELS`: jflash's dK/dV kernel and FA3's three
backward kernels, or the forward kernels). The raw output goes to `--out-dir` (a mask,
KV heads or pass other than the defaults tag its names:
`ncu-jflash-65536-128-full-kv8.txt`, `ncu-fa3-65536-128-documents-kv8-fwd.txt`); the table gives
per kernel: time, tensor-pipe activity, issue activity, instructions, shared memory
wavefronts (LSU and wgmma operand reads together), L2 hit rate, DRAM bytes read and
written, and the stall reasons per issued instruction that dominate (a warp waiting on
a wgmma shows as `barrier` on its `WARPGROUP.DEPBAR`, on an mbarrier poll as
`long_sb`; waiting on a shared load as `short_sb`; waiting for its next instructions to
reach the instruction cache as `no_instruction`). The memory warpgroup's idle
polling counts in the averages too.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.common import check_out, device_name, jit_passes, parse_specs, table, write_json  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")
DEFAULT_CASES = "jflash:16384:128,fa3:16384:128,jflash:16384:64"
# The kernels profiled per pass (`--pass`): the backward's, or the forward's.
KERNELS = {
    "fwdbwd": r"regex:jflash_mosaic_dkv|FlashAttnBwd",
    "fwd": r"regex:jflash_mosaic_fwd|FlashAttnFwd",
}
STALLS = (
    "barrier",
    "long_scoreboard",
    "short_scoreboard",
    "wait",
    "gmma",
    "mio_throttle",
    "no_instruction",
    "math_pipe_throttle",
)
METRICS = (
    "gpu__time_duration.sum",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "smsp__inst_executed.sum",
    "smsp__inst_executed_pipe_xu.sum",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum",
    "launch__registers_per_thread",
    "lts__t_sector_hit_rate.pct",
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    *(f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio" for s in STALLS),
)
COLUMNS = [
    "case",
    "kernel",
    "ms",
    "tensor_active_pct",
    "issue_active_pct",
    "instructions_g",
    "shared_wavefronts_g",
    "l2_hit_pct",
    "dram_read_gb",
    "dram_write_gb",
    *(f"stall_{s}" for s in STALLS),
]

# `  name (grid)x(block), Context ...` opens a kernel's block in ncu's details page;
# `    metric.name   unit   1,234.5` is one of its metrics (unit may be empty).
_KERNEL = re.compile(r"^  (\S.*?) \(\d+, \d+, \d+\)x\(\d+, \d+, \d+\)")
_METRIC = re.compile(r"^\s+([a-z][\w.]+)\s+(?:\S+\s+)?([\d,]+(?:\.\d+)?)\s*$")


def parse_cases(text: str) -> list[tuple[str, int, int]]:
    """`impl:S:D,...` -> `[(impl, S, D)]`; ValueError naming the bad item."""
    return parse_specs(text, "--cases", "impl", ("jflash", "fa3"))


def short_name(kernel: str) -> str:
    """jflash's kernel name, or the FA3 class inside `device_kernel<...>`."""
    m = re.search(r"(FlashAttn(?:Fwd|Bwd)\w*)", kernel)
    return m.group(1) if m else kernel.split()[0].removesuffix("_mosaic_gpu_kernel")


def parse_details(text: str) -> list[dict]:
    """Kernels and their metrics (floats) from `ncu --page details --print-units base`."""
    kernels, current = [], None
    for line in text.splitlines():
        if m := _KERNEL.match(line):
            current = {"kernel": short_name(m.group(1)), "metrics": {}}
            kernels.append(current)
        elif current is not None and (m := _METRIC.match(line)):
            current["metrics"][m.group(1)] = float(m.group(2).replace(",", ""))
    return kernels


def summarise(case: str, kernels: list[dict]) -> list[dict]:
    """One table row per kernel that has the counters (not just a time)."""
    rows = []
    for k in kernels:
        m = k["metrics"]
        row = {"case": case, "kernel": k["kernel"]}
        if "gpu__time_duration.sum" in m:
            row["ms"] = m["gpu__time_duration.sum"] / 1e6
        pairs = {
            "tensor_active_pct": METRICS[1],
            "issue_active_pct": METRICS[2],
            "registers": "launch__registers_per_thread",
            "l2_hit_pct": "lts__t_sector_hit_rate.pct",
        }
        row.update({col: m[name] for col, name in pairs.items() if name in m})
        for col, name in (
            ("instructions_g", "smsp__inst_executed.sum"),
            ("xu_instructions_g", "smsp__inst_executed_pipe_xu.sum"),
            ("shared_wavefronts_g", "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum"),
            ("dram_read_gb", "dram__bytes_read.sum"),
            ("dram_write_gb", "dram__bytes_write.sum"),
        ):
            if name in m:
                row[col] = m[name] / 1e9
        for s in STALLS:
            name = f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio"
            if name in m:
                row[f"stall_{s}"] = m[name]
        for op in ("ld", "st"):
            name = f"l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_{op}.sum"
            if name in m:
                row[f"bank_conflicts_{op}_m"] = m[name] / 1e6
        rows.append(row)
    return rows


def call(impl: str, seq: int, hd: int, tokens: int, mask: str, kv_heads: int, pass_: str) -> None:
    """One forward+backward or forward (what ncu profiles). `mask` "documents": causal
    over `kernel.py --documents`'s packed row of `seq` tokens (batch 1), FA3 as its
    variable-length kernel."""
    import jax

    import jflash
    from benchmarks import kernel

    batch = 1 if mask == "documents" else max(1, tokens // seq)
    q, k, v, do = kernel.draw_inputs(batch, seq, 32, kv_heads, hd)
    causal, seg = mask != "full", None
    if mask == "documents":
        lengths = kernel.document_lengths(seq)
        seg = kernel.document_ids(lengths)
    if impl == "fa3" and seg is not None:
        try:
            attn = kernel.document_attention_fn("fa3", lengths)
        except kernel.PeerUnavailable as e:
            raise SystemExit(f"FA3 varlen: {e}") from e
    elif impl == "fa3":
        from flash_attn3_jax import flash_mha

        def attn(q, k, v):
            return flash_mha(q, k, v, is_causal=causal)
    else:

        def attn(q, k, v):
            return jflash.flash_attention(q, k, v, causal=causal, segment_ids=seg)

    fn, nargs = jit_passes(attn)[pass_]
    jax.block_until_ready(fn(*(q, k, v, do)[:nargs]))


def run_tag(mask: str, kv_heads: int, pass_: str = "fwdbwd") -> str:
    """What a run's mask, KV heads and pass add to its saved files' and cases' names:
    nothing for the defaults (causal, 8, fwdbwd), else `full-kv8`, `causal-kv32`,
    `documents-kv8-fwd`, ..."""
    if (mask, kv_heads, pass_) == ("causal", 8, "fwdbwd"):
        return ""
    return f"{mask}-kv{kv_heads}" + ("" if pass_ == "fwdbwd" else f"-{pass_}")


class CaseFailed(Exception):
    """One case's `ncu` run failed; the message names the case and its saved output."""


def profile(
    impl: str,
    seq: int,
    hd: int,
    tokens: int,
    out_dir: str,
    mask: str,
    kv_heads: int,
    pass_: str = "fwdbwd",
) -> str:
    """The ncu details page of one case (also saved to `out_dir`)."""
    cmd = [
        "ncu",
        "--clock-control",
        "none",
        "--kernel-name-base",
        "demangled",
        "--kernel-name",
        KERNELS[pass_],
        "--launch-count",
        # FA3's backward is three kernels; jflash's packed forward launches the other
        # ids' kernel, which returns at once, then the sorted ids' one.
        "3" if impl == "fa3" and pass_ == "fwdbwd" else "2" if mask == "documents" else "1",
        "--metrics",
        ",".join(METRICS),
        "--print-units",
        "base",
        sys.executable,
        os.path.abspath(__file__),
        "--call",
        f"{impl}:{seq}:{hd}",
        "--tokens",
        str(tokens),
        "--mask",
        mask,
        "--kv-heads",
        str(kv_heads),
        "--pass",
        pass_,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    text = done.stdout + done.stderr
    tag = run_tag(mask, kv_heads, pass_)
    saved = os.path.join(out_dir, f"ncu-{impl}-{seq}-{hd}{'-' + tag if tag else ''}.txt")
    with open(saved, "w") as f:
        f.write(text)
    if done.returncode:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        last = lines[-1] if lines else "no output"
        raise CaseFailed(
            f"ncu on {impl}:{seq}:{hd} exited {done.returncode} ({last[:200]}; all of it: {saved})"
        )
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", default=DEFAULT_CASES, help="impl:S:D,... (see above)")
    parser.add_argument("--tokens", type=int, default=65536, help="tokens per call")
    parser.add_argument(
        "--mask",
        choices=("causal", "full", "documents"),
        default="causal",
        help="documents: causal over kernel.py --documents' packed row of S tokens (batch 1)",
    )
    parser.add_argument(
        "--pass",
        dest="pass_",
        choices=("fwdbwd", "fwd"),
        default="fwdbwd",
        help="the call profiled: forward+backward (the backward kernels) or forward",
    )
    parser.add_argument("--kv-heads", type=int, default=8, help="KV heads (32 query heads)")
    parser.add_argument("--parse", nargs="+", metavar="FILE", help="saved ncu output files")
    parser.add_argument("--device", default=None, help="with --parse: the GPU they ran on")
    parser.add_argument("--call", default=None, help=argparse.SUPPRESS)  # run under ncu
    parser.add_argument("--out-dir", default=None, help="raw ncu output (default: a temp dir)")
    parser.add_argument("--out", default=None, help="JSON (default: results/counters-<gpu>.json)")
    args = parser.parse_args(argv)
    if args.out:
        check_out(parser, "--out", args.out)
    try:
        cases = parse_cases(args.call or args.cases)
    except ValueError as e:
        parser.error(str(e))
    if args.call:
        call(*cases[0], args.tokens, args.mask, args.kv_heads, args.pass_)
        return 0

    rows, meta = [], {}
    if args.parse:
        if not args.device:
            parser.error("--parse needs --device (the GPU the saved output ran on)")
        for path in args.parse:
            name = os.path.basename(path)
            m = re.fullmatch(r"ncu-(\w+)-(\d+)-(\d+)(?:-([\w-]+))?\.txt", name)  # `profile`'s names
            try:
                with open(path) as f:
                    found = summarise(
                        ":".join(g for g in m.groups() if g) if m else name, parse_details(f.read())
                    )
            except OSError as e:
                parser.error(f"--parse {path!r}: {e.strerror}")
            if not found:
                parser.error(f"--parse {path!r}: no kernel in it (ncu --page details output?)")
            rows += found
        meta = {"device": args.device, "parsed": [os.path.basename(p) for p in args.parse]}
        gpu = args.device.lower().replace("nvidia ", "").replace(" ", "-")
    else:
        if shutil.which("ncu") is None:
            parser.error("ncu (Nsight Compute) is not on PATH; --parse reads saved output")
        out_dir = args.out_dir or tempfile.mkdtemp(prefix="jflash-ncu-")
        os.makedirs(out_dir, exist_ok=True)
        failed = []
        for impl, seq, hd in cases:
            try:
                text = profile(
                    impl, seq, hd, args.tokens, out_dir, args.mask, args.kv_heads, args.pass_
                )
            except CaseFailed as e:  # the other cases still run
                print(f"counters.py: {e}", file=sys.stderr)
                failed.append(f"{impl}:{seq}:{hd}")
                continue
            tag = run_tag(args.mask, args.kv_heads, args.pass_)
            case = f"{impl}:{seq}:{hd}" + (f":{tag}" if tag else "")
            rows += summarise(case, parse_details(text))
        if failed:
            meta = {"failed": failed}
        if not rows:
            print(f"counters.py: no case ran under ncu ({', '.join(failed)})", file=sys.stderr)
            return 1
        gpu = device_name().lower().replace(" ", "-")
    print(table(rows, COLUMNS))
    out = args.out or os.path.join(RESULTS, f"counters-{gpu}.json")
    run = (
        {}
        if args.parse
        else {
            "tokens": args.tokens,
            "mask": args.mask,
            "kv_heads": args.kv_heads,
            "pass": args.pass_,
        }
    )
    write_json(out, {**run, **meta, "rows": rows})
    return 1 if meta.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
