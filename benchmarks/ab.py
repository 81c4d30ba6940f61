"""A kernel change against a git revision of jflash, in one process.

    python benchmarks/ab.py --rev HEAD~1                        # causal 4k/16k/64k, D=128
    python benchmarks/ab.py --rev main --shapes causal:4096:128,full:65536:128 --documents
    python benchmarks/ab.py --rev HEAD~1 --peers fa3            # FlashAttention-3 beside them
    python benchmarks/ab.py --rev HEAD~1 --deterministic        # the deterministic backward
    python benchmarks/ab.py --rev main --peers cudnn --shapes causal:16384:64  # and cuDNN
    python benchmarks/ab.py --rev branch-a --rev branch-b       # several: rev1, rev2

Without a GPU it stops at once with one line saying so (exit status 2); `--interpret`
runs the same code on the CPU, Pallas kernels in interpret mode as the tests run them,
and its tables and JSON say so (`"interpreted": true`): the times are not kernel times.

Absolute times move by a few percent between GPUs of the same kind and between runs, so a
change is measured against its baseline in the same process: each revision's `jflash`
package is exported (`git archive`) into a temporary folder under another name, and the
working tree's is copied there the same way, so that every candidate is imported alike
(with the tree imported in place and its outputs held while timing, its forward read
1-3% faster than identical revisions). Each shape builds all of them (and the peers),
reports how far each one's forward output and gradients are from the tree's
(`*_max_abs_diff`, `*_grad_max_abs_diff`: a backward change shows only in the second;
`*_grad_rel_diff`, the same relative to the tree's largest entry, warned about past
`kernel.py`'s tolerance, 0.02), then times the forward and the forward+backward of
every candidate in `--rounds` interleaved rounds and keeps each one's best round. The
candidates take turns, so a drift of the GPU's clocks reaches all of them. Each round
times every forward, then every forward+backward, in an order from a balanced Latin
square: over the rounds each candidate takes every turn and follows every other one
equally often, since the turn and what ran just before moved a time by 1-4%.
`--rounds` defaults to twice the candidates (one whole square or two). `--rev HEAD` on
a clean tree times identical code: its `new/rev` is the run's noise floor. A reading
(`--min-time` seconds) is three batches of calls dispatched back to back, each
synchronised once (`common.time_pipelined`): the time per call carries no host launch
and sync latency.

Shapes are `mask:S:D` with mask `causal` or `full`; each call holds `--tokens` tokens
(batch = tokens // S), GQA `--heads`/`--kv-heads`, bf16. `--documents` adds causal
attention over 64k tokens packed from log-normal documents (`kernel.py --documents`);
`--document-shapes S:D,...` adds such rows of S tokens (the same documents scaled to
S, every batch row alike; batch = tokens // S) at head dim D. `--id-orders
sorted,padded,permuted,pair,hashed` times those rows with the documents labelled each
way (`kernel.document_ids`: the same mask, labels that are not sorted along the row;
`pair` gives the permuted labels as query and key ids, `hashed` labels wider than the
row).
After every row the rows so far go to `<out>.partial` (`"complete": false`), so a run
cut short keeps the rows it finished and leaves the last whole run's JSON as it was.
`--q-scale X` multiplies the normal queries by X (rows named `, q x X`): at 16 the
forward's key-norm bound (`BOUNDED_MAX` in `jflash/_mosaic_fwd.py`) is loose for every
row (at D = 64 and 128), so the row max it skips on normal inputs runs throughout: the
kernel's worst case.
`--deterministic` times jflash's deterministic backward (its separate dQ kernel) instead
of the default.
Columns: ms per candidate and `new/rev` (the revision's time ÷ the tree's: above 1, the
tree is faster; `new/rev1`, ... with several), and `new/<peer>` where a peer runs.

`--clocks` samples the SM clock and power with `nvidia-smi` (`benchmarks/power.py`)
and adds, per candidate, its best reading's mean clock and power, and
`new/<label>_<pass>_cycles`: the candidate's clock cycles per call ÷ the tree's. At
the GPU's power limit (Hopper running attention) the clock follows each kernel's
power, so time measures cycles and energy together; cycles separate the two. Use
`--min-time 2` or more with it: the first 0.3 s of a reading are left out.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import io
import itertools
import math
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

import jax.numpy as jnp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import jflash  # noqa: E402
from benchmarks import power  # noqa: E402
from benchmarks.common import (  # noqa: E402
    HEAT_S,
    add_interpret_flag,
    check_out,
    device_name,
    gpu_or_interpret,
    heat,
    interleaved,
    jit_passes,
    parse_specs,
    table,
    time_pipelined,
    write_json,
)
from benchmarks.kernel import (  # noqa: E402
    FA3_HEAD_DIMS,
    FWDBWD_TOLERANCE,
    attention_fn,
    document_attention_fn,
    document_flops,
    document_ids,
    document_lengths,
    draw_inputs,
    parse_id_orders,
    relative_gap,
)

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
BASELINE = "jflash_rev"  # the revision's package name inside this process
TREE = "jflash_tree"  # the working tree's copy
DEFAULT_SHAPES = "causal:4096:128,causal:16384:128,causal:65536:128"


def _rename(pkg: str, name: str) -> None:
    """Every `jflash` import inside the package folder `pkg` now names `name`."""
    word = re.compile(r"\bjflash\b")
    for folder, _, files in os.walk(pkg):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                with open(path) as fh:
                    text = fh.read()
                with open(path, "w") as fh:
                    fh.write(word.sub(name, text))


def commit_of(rev: str) -> str:
    """The commit `rev` names, resolved once before anything is timed: that commit is
    exported and recorded (a branch may move). ValueError naming `rev` if git does not
    know it."""
    try:
        return subprocess.run(
            ["git", "-C", ROOT, "rev-parse", "--verify", f"{rev}^{{commit}}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except subprocess.CalledProcessError as e:
        msg = e.stderr.strip().splitlines()
        raise ValueError(f"--rev {rev!r}: {msg[-1] if msg else 'not a commit'}") from None


def export_revision(rev: str, dest: str, name: str = BASELINE) -> str:
    """`git archive` of `rev`'s `jflash/` into `dest/name`, its imports renamed: the
    folder to put on `sys.path`. ValueError naming `rev` if git does not know it."""
    try:
        blob = subprocess.run(
            ["git", "-C", ROOT, "archive", "--format=tar", rev, "jflash"],
            check=True,
            capture_output=True,
        ).stdout
    except subprocess.CalledProcessError as e:
        msg = e.stderr.decode(errors="replace").strip().splitlines()
        raise ValueError(f"--rev {rev!r}: {msg[-1] if msg else 'git archive failed'}") from None
    pkg = os.path.join(dest, name)
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(dest, filter="data")
    os.rename(os.path.join(dest, "jflash"), pkg)
    _rename(pkg, name)
    return dest


def export_tree(dest: str, name: str = TREE) -> str:
    """The working tree's `jflash/` (uncommitted edits included) copied into
    `dest/name` the same way, so that the tree and the revisions are all packages
    imported from a temporary folder, none of them the `jflash` the script started
    with."""
    pkg = os.path.join(dest, name)
    shutil.copytree(os.path.join(ROOT, "jflash"), pkg, ignore=shutil.ignore_patterns("__pycache__"))
    _rename(pkg, name)
    return dest


def import_revision(rev: str, dest: str, name: str = BASELINE):
    """The revision's jflash as a module named `name`."""
    sys.path.insert(0, export_revision(rev, dest, name))
    return importlib.import_module(name)


def import_tree(dest: str, name: str = TREE):
    """The working tree's jflash as a module named `name` (`export_tree`)."""
    sys.path.insert(0, export_tree(dest, name))
    return importlib.import_module(name)


def rev_labels(revs: list[str]) -> list[str]:
    """Candidate labels of the revisions: `rev` for one, `rev1`, `rev2`, ... for more."""
    return ["rev"] if len(revs) == 1 else [f"rev{i + 1}" for i in range(len(revs))]


def parse_shapes(text: str) -> list[tuple[bool, int, int]]:
    """`mask:S:D,...` -> `[(causal, S, D)]`; ValueError naming the bad item."""
    specs = parse_specs(text, "--shapes", "mask", ("causal", "full"))
    return [(mask == "causal", seq, hd) for mask, seq, hd in specs]


def parse_document_shapes(text: str) -> list[tuple[int, int]]:
    """`S:D,...` -> `[(S, D)]`; ValueError naming the bad item."""
    shapes = []
    for item in filter(None, text.split(",")):
        parts = item.split(":")
        if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--document-shapes item {item!r}: expected S:D (positive ints)")
        shapes.append((int(parts[0]), int(parts[1])))
    return shapes


def _passes(attn):
    """Jitted `(fwd, fwdbwd)` of `attn(q, k, v)`."""
    passes = jit_passes(attn)
    return passes["fwd"][0], passes["fwdbwd"][0]


def candidate(module, *, causal: bool, implementation, segment_ids=None, deterministic=None):
    """Jitted `(fwd, fwdbwd)` of `module.flash_attention`."""

    def attn(q, k, v):
        return module.flash_attention(
            q,
            k,
            v,
            causal=causal,
            implementation=implementation,
            segment_ids=segment_ids,
            deterministic=deterministic,
        )

    return _passes(attn)


def fa3_candidate(causal: bool):
    from flash_attn3_jax import flash_mha

    return _passes(lambda q, k, v: flash_mha(q, k, v, is_causal=causal))


def cudnn_candidate(causal: bool):
    return _passes(attention_fn("cudnn", causal=causal))


def compare(
    name: str,
    flops: float,
    cands: dict,
    args,
    *,
    rounds: int | None,
    min_time: float,
    sampler=None,
    heat_s: float = HEAT_S,
) -> dict:
    """One row: every candidate's best-of-`rounds` forward and forward+backward
    (None: twice the candidates). With a `power.Sampler`, each best reading's mean SM
    clock and power too, and the clock cycles per call against the tree's."""
    rounds = rounds or 2 * len(cands)
    base = cands["new"][0](*args[:3])
    _, base_grads = cands["new"][1](*args)
    row = {"shape": name}

    def gap(x, y):
        return float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))))

    for label, (fwd, fwdbwd) in cands.items():
        row[f"{label}_max_abs_diff"] = gap(fwd(*args[:3]), base)
        # dQ, dK, dV too: a backward change shows in them, not in the forward's output.
        # Of a second call: a peer that keeps state between calls can be right on the
        # first alone (`peer_repeat.py`).
        fwdbwd(*args)
        _, grads = fwdbwd(*args)
        row[f"{label}_grad_max_abs_diff"] = max(map(gap, grads, base_grads))
        row[f"{label}_grad_rel_diff"] = max(map(relative_gap, grads, base_grads))
        if not row[f"{label}_grad_rel_diff"] <= FWDBWD_TOLERANCE:  # NaN too
            print(
                f"ab.py: {name}: {label}'s gradients are {row[f'{label}_grad_rel_diff']:.3g} of"
                f" their largest entry from the tree's (more than {FWDBWD_TOLERANCE}: one of"
                " them is wrong, or less exact)",
                file=sys.stderr,
            )
    # The tree's outputs are not kept alive while the candidates are timed.
    del base, base_grads, grads
    heat([functools.partial(fwdbwd, *args) for _, fwdbwd in cands.values()], heat_s)
    best = {(c, p): float("inf") for c in cands for p in ("fwd", "fwdbwd")}
    clocks = {}  # (label, pass) -> the power summary of the best reading
    labels, passes = list(cands), {"fwd": (0, args[:3]), "fwdbwd": (1, args)}
    for _, p, i in interleaved(len(labels), range(rounds), passes):
        slot, a = passes[p]
        label = labels[i]
        t0 = time.perf_counter()
        t = time_pipelined(cands[label][slot], *a, iters=None, round_s=min_time / 3)
        if t < best[label, p]:
            best[label, p] = t
            if sampler is not None:
                clocks[label, p] = power.summarise(sampler.samples, t0, time.perf_counter())
    for (label, p), t in best.items():
        row[f"{label}_{p}_ms"] = t * 1e3
        row[f"{label}_{p}_tflops"] = (1.0 if p == "fwd" else 3.5) * flops / t / 1e12
        summary = clocks.get((label, p), {})
        if summary.get("samples"):
            row[f"{label}_{p}_mhz"] = summary["sm_mhz"]
            row[f"{label}_{p}_watts"] = summary["watts"]
    for label in cands:
        if label != "new":
            for p in ("fwd", "fwdbwd"):
                row[f"new/{label}_{p}"] = best[label, p] / best["new", p]
                if f"{label}_{p}_mhz" in row and f"new_{p}_mhz" in row:
                    cycles = best[label, p] * row[f"{label}_{p}_mhz"]
                    row[f"new/{label}_{p}_cycles"] = cycles / (best["new", p] * row[f"new_{p}_mhz"])
    return row


def measure_all(
    args, shapes, doc_shapes, peers, impl, commits, sampler, parser, on_row
) -> list[dict]:
    """Every shape's row (`compare`), the tree and the revisions (`commits`: label ->
    commit) imported once; `on_row(rows)` after each row."""
    labels = list(commits)
    det = True if args.deterministic else None
    q_note = f", q x {args.q_scale:g}" if args.q_scale != 1.0 else ""
    with tempfile.TemporaryDirectory() as tmp:
        modules = {"new": import_tree(os.path.join(tmp, "tree"))}
        for i, (label, commit) in enumerate(commits.items()):
            name = BASELINE if i == 0 else f"{BASELINE}{i + 1}"
            try:
                modules[label] = import_revision(commit, os.path.join(tmp, str(i)), name)
            except ValueError as e:
                parser.error(str(e))
        if len(labels) > 1:
            pairs = zip(labels, args.rev, strict=True)
            print("revisions:", ", ".join(f"{k} = {r}" for k, r in pairs))
        timed = functools.partial(
            compare, rounds=args.rounds, min_time=args.min_time, sampler=sampler, heat_s=args.heat
        )
        rows = []
        for causal, seq, hd in shapes:
            batch = max(1, args.tokens // seq)
            cands = {
                label: candidate(m, causal=causal, implementation=impl, deterministic=det)
                for label, m in modules.items()
            }
            if "fa3" in peers and hd in FA3_HEAD_DIMS:
                cands["fa3"] = fa3_candidate(causal)
            if "cudnn" in peers:
                cands["cudnn"] = cudnn_candidate(causal)
            flops = 4.0 * batch * args.heads * seq * seq * hd / (2 if causal else 1)
            name = f"{'causal' if causal else 'full'} S={seq} D={hd} B={batch}" + q_note
            a = draw_inputs(batch, seq, args.heads, args.kv_heads, hd, q_scale=args.q_scale)
            rows.append(timed(name, flops, cands, a))
            print(rows[-1], flush=True)
            on_row(rows)
        for (seq, hd), order in itertools.product(doc_shapes, args.id_orders):
            batch = max(1, args.tokens // seq)
            lengths = document_lengths(seq)
            seg = document_ids(lengths, batch, order)
            cands = {
                label: candidate(
                    m, causal=True, implementation=impl, segment_ids=seg, deterministic=det
                )
                for label, m in modules.items()
            }
            if "fa3" in peers and batch == 1 and hd in FA3_HEAD_DIMS:  # its varlen form
                cands["fa3"] = _passes(document_attention_fn("fa3", lengths))
            a = draw_inputs(batch, seq, args.heads, args.kv_heads, hd, q_scale=args.q_scale)
            flops = batch * document_flops(lengths, args.heads, hd)
            name = f"documents S={seq} ({len(lengths)} documents) D={hd} B={batch}" + q_note
            if order != "sorted":
                name += f", {order} ids"
            rows.append(timed(name, flops, cands, a))
            print(rows[-1], flush=True)
            on_row(rows)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rev",
        required=True,
        action="append",
        help="git revision to measure against (repeat for several: rev1, rev2, ...)",
    )
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="mask:S:D,... (see above)")
    parser.add_argument("--documents", action="store_true", help="add 64k packed documents")
    parser.add_argument(
        "--document-shapes", default="", help="S:D,...: packed-document rows (see above)"
    )
    parser.add_argument(
        "--id-orders",
        default="sorted",
        help="packed-document rows: label the documents in each of these orders "
        "(kernel.py's ID_ORDERS: sorted, padded, permuted, pair, hashed; the same mask)",
    )
    parser.add_argument("--peers", default="", help="comma list: fa3 (where installed), cudnn")
    parser.add_argument(
        "--implementation",
        default="pallas_mosaic",
        choices=(*jflash.IMPLEMENTATIONS, "default"),
        help="jflash implementation to compare (`default`: what implementation=None picks)",
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="time jflash's deterministic backward (`deterministic=True`: the separate dQ "
        "kernel) instead of the default",
    )
    parser.add_argument("--tokens", type=int, default=65536, help="tokens per call")
    parser.add_argument(
        "--q-scale",
        type=float,
        default=1.0,
        help="multiply the normal queries by this (16: the forward's key-norm bound is "
        "loose for every row, so its exact row max runs throughout)",
    )
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=None, help="default: 2 x candidates")
    parser.add_argument(
        "--min-time",
        type=float,
        default=0.5,
        help="seconds per reading (calls back to back, `common.time_pipelined`)",
    )
    parser.add_argument(
        "--heat", type=float, default=HEAT_S, help="seconds of load before a shape's rounds"
    )
    parser.add_argument(
        "--clocks",
        action="store_true",
        help="sample the SM clock and power (nvidia-smi) and add clock cycles per call",
    )
    parser.add_argument("--out", default=None, help="JSON path (default: results/ab-<gpu>.json)")
    add_interpret_flag(parser)
    args = parser.parse_args(argv)
    if args.out:
        check_out(parser, "--out", args.out)
    try:
        shapes = parse_shapes(args.shapes)
    except ValueError as e:
        parser.error(str(e))
    try:
        doc_shapes = parse_document_shapes(args.document_shapes)
    except ValueError as e:
        parser.error(str(e))
    if args.documents:
        doc_shapes.append((65536, 128))
    try:
        args.id_orders = parse_id_orders(args.id_orders)
    except ValueError as e:
        parser.error(str(e))
    if args.id_orders != ["sorted"] and not doc_shapes:
        parser.error(
            "--id-orders labels packed-document rows: add --documents or --document-shapes"
        )
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: at least 1")
    if not (math.isfinite(args.q_scale) and args.q_scale > 0):
        parser.error(f"--q-scale {args.q_scale}: a positive finite number")
    peers = [p for p in args.peers.split(",") if p]
    if any(p not in ("fa3", "cudnn") for p in peers):
        parser.error(f"--peers {args.peers!r}: fa3 and/or cudnn")
    if args.clocks and shutil.which("nvidia-smi") is None:
        parser.error("--clocks: nvidia-smi is not on PATH (an NVIDIA GPU machine is needed)")
    impl = None if args.implementation == "default" else args.implementation
    labels = rev_labels(args.rev)
    try:
        commits = {label: commit_of(rev) for label, rev in zip(labels, args.rev, strict=True)}
    except ValueError as e:
        parser.error(str(e))
    note = gpu_or_interpret("benchmarks/ab.py", args.interpret)
    sampler = None
    if args.clocks:
        sampler = power.Sampler(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0")
    out = args.out or os.path.join(RESULTS, f"ab-{device_name()}.json")
    revs = dict(zip(labels, args.rev, strict=True))
    payload = {
        "revs": revs,
        "rev_commits": commits,
        "implementation": args.implementation,
        "deterministic": args.deterministic,
        "q_scale": args.q_scale,
    }

    def save(rows, complete):  # after each row too (beside `out`): a run cut short keeps them
        payload_ = {**payload, "complete": complete, "rows": rows}
        write_json(out, payload_, note=note, partial=not complete)

    try:
        rows = measure_all(
            args,
            shapes,
            doc_shapes,
            peers,
            impl,
            commits,
            sampler,
            parser,
            lambda r: save(r, False),
        )
    finally:
        if sampler is not None:
            sampler.close()
    diffs = [f"{label}_{d}" for label in labels for d in ("max_abs_diff", "grad_rel_diff")]
    columns = ["shape", *diffs] + [k for k in rows[0] if k.endswith("_ms") or k.startswith("new/")]
    print(table(rows, columns, note))
    save(rows, True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
