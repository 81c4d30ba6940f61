"""Where the Mosaic forward (or dK/dV) kernel's compute warpgroups spend their cycles (GPU).

    python benchmarks/timeline.py                                  # causal and full 4k, D=128
    python benchmarks/timeline.py --shapes causal:4096:128,documents:16384:128
    python benchmarks/timeline.py --shapes causal:16384:64 --heads 8 --kv-heads 2
    python benchmarks/timeline.py --kernel dkv --shapes causal:16384:128   # the backward

Mosaic GPU's on-device profiler (`jflash.kernel_timeline`) makes the kernel record the
named scopes of its compute warpgroups (`jflash.KERNEL_SCOPES["fwd"]`: per key step,
waiting for S, the softmax, waiting for the turn, issuing the matmuls; per work item,
locating it, waiting for its Q, the first Q K^T, the last P V, taking the next ticket)
with the SM's clock, one trace per warpgroup, into a Perfetto trace (open it at
ui.perfetto.dev). `--kernel dkv` profiles the backward's dK/dV kernel
instead (`KERNEL_SCOPES["dkv"]`, in a forward+backward call): one key
tile per CTA, so no item gap; its scopes split the fused D = 128 step. The times within
a warpgroup's trace are clock cycles (the profiler reads `%clock`; the trace shows them
as nanoseconds). A shape runs `--heat` seconds of calls first, then one profiled call.

Per shape the table gives the work items and key steps the warpgroups ran, the share of
their time inside the step scopes, cycles per step, and the item gap: cycles from a
warpgroup's last step of one work item ("issue" ends) to the first step of its next
("s_wait" starts), during which that warpgroup gives the tensor cores nothing to do,
also as a share of an item's cycles (its steps' and the gap's). The JSON holds every
scope's share and cycles per step or per item; `--traces DIR` keeps each shape's trace
(the first `--keep` warpgroups).

Shapes are `kind:S:D` with kind `causal`, `full` or `documents` (causal over S tokens
packed from the log-normal documents of `kernel.py --documents`, scaled to S); batch
`--batch`, GQA `--heads`/`--kv-heads`, bf16. Each warpgroup keeps `--space` ranges
(later ones are dropped, and the analysis ignores a trace's unfinished item; by default
what fits beside the kernel's shared memory: 480 for the forward, 240 for dK/dV): keep
calls small, a few work items per SM.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.common import HEAT_S, check_out, heat, parse_specs, table, write_json  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DEFAULT_SHAPES = "causal:4096:128,full:4096:128"
KINDS = ("causal", "full", "documents")


def parse_shapes(text: str) -> list[tuple[str, int, int]]:
    """`kind:S:D,...` -> `[(kind, S, D)]`; ValueError naming the bad item."""
    specs = parse_specs(text, "--shapes", "kind", KINDS)
    for kind, seq, hd in specs:
        if seq < 1 or hd < 1:
            raise ValueError(f"--shapes item {kind}:{seq}:{hd}: S and D must be positive")
    return specs


def _warpgroup_traces(events: list[dict]) -> dict[int, list[dict]]:
    """Trace events by warpgroup (`tid`), in time order. Only compute warpgroups record
    scopes, so every trace here is one."""
    by = {}
    for e in events:
        by.setdefault(e["tid"], []).append(e)
    for es in by.values():
        es.sort(key=lambda e: e["ts"])
    return by


def analyse(
    events: list[dict],
    step,
    item=(),
    *,
    step_begins="s_wait",
    item_begins="q_wait",
    gap_from="issue",
) -> dict:
    """Cycles by scope from a Mosaic profiler trace's events (`traceEvents`: "B"/"E"
    pairs per warpgroup, `ts` in the profiler's units: cycles / 1000).

    The arguments are a kernel's `jflash.KERNEL_SCOPES` entry: its scopes per step
    (`step`) and per work item (`item`), the scope that begins each step and the one
    that begins each item (`item_begins=None`: a warpgroup's whole trace is one item, as
    in the dK/dV kernel's one key tile per CTA), and the scope whose end starts the item
    gap (`gap_from`: the last matmul issue; None: no gap). Returns items and steps run,
    each scope's share of the warpgroups' time and its cycles per step (step scopes) or
    per item (the rest), and the item gap: the median from the end of a warpgroup's last
    `gap_from` before an item to that item's first step, also as a share of an item's
    cycles (its steps' and the gap's). A trace cut short by the profiler's space keeps
    its finished items only (with `item_begins=None`, what it has).
    """
    step_scopes, item_scopes = set(step), set(item)
    step, item = step_begins, item_begins
    span = 0.0
    spent: dict[str, float] = {}
    items = steps = 0
    gaps = []
    for es in _warpgroup_traces(events).values():
        if item is None:
            items += 1
        else:
            # The trace up to its last finished item (a new one begins after it).
            starts = [i for i, e in enumerate(es) if e["name"] == item and e["ph"] == "B"]
            if len(starts) < 2:
                continue
            es = es[: starts[-1]]
        span += (es[-1]["ts"] - es[0]["ts"]) * 1000
        stack = []
        last_issue_end = None
        waiting_first = False
        for e in es:
            if e["ph"] == "B":
                stack.append(e)
                if e["name"] == item:
                    items += 1
                    waiting_first = True
                continue
            if not stack or stack[-1]["name"] != e["name"]:
                raise ValueError(f"unbalanced trace: {e['name']!r} ends inside another scope")
            begin = stack.pop()
            cycles = (e["ts"] - begin["ts"]) * 1000
            spent[begin["name"]] = spent.get(begin["name"], 0.0) + cycles
            if begin["name"] == step:
                steps += 1
                if waiting_first and last_issue_end is not None:
                    gaps.append((begin["ts"] - last_issue_end) * 1000)
                waiting_first = False
            elif begin["name"] == gap_from:
                last_issue_end = e["ts"]
    if not items or not span:
        raise ValueError("no finished work item in the trace (too little --space?)")
    in_steps = sum(v for k, v in spent.items() if k in step_scopes)
    gap = statistics.median(gaps) if gaps else None
    per_step = {k: v / max(steps, 1) for k, v in spent.items() if k in step_scopes}
    per_item = {k: v / items for k, v in spent.items() if k not in step_scopes}
    return {
        "warpgroup_items": items,
        "steps": steps,
        "steps_per_item": steps / items,
        "in_steps": in_steps / span,
        "step_cycles": in_steps / max(steps, 1),
        "item_gap_cycles": gap,
        # Of a work item's cycles where an SM runs many (the call's calls run thousands):
        # its steps and the gap before the next.
        "item_gap_share": None if gap is None else gap / (gap + in_steps / items),
        "share": {k: v / span for k, v in sorted(spent.items(), key=lambda kv: -kv[1])},
        "cycles_per_step": per_step,
        "cycles_per_item": per_item,
        "unknown_scopes": sorted(set(spent) - step_scopes - item_scopes),
    }


def newest_trace(directory: str) -> str:
    files = glob.glob(os.path.join(directory, "*.json"))
    if not files:
        raise RuntimeError(f"the profiler wrote no trace into {directory}")
    return max(files, key=os.path.getmtime)


def profile_shape(kind: str, seq: int, hd: int, args, directory: str) -> list[dict]:
    """One profiled call of the shape (the forward, or with `--kernel dkv` the forward
    and backward) after `args.heat` seconds of calls; the trace's events."""
    import jax

    import jflash
    from benchmarks.common import jit_passes
    from benchmarks.kernel import document_ids, document_lengths, draw_inputs

    q, k, v, do = draw_inputs(args.batch, seq, args.heads, args.kv_heads, hd)
    seg = None
    if kind == "documents":
        seg = document_ids(document_lengths(seq), args.batch)

    def attn(q, k, v):
        return jflash.flash_attention(
            q, k, v, causal=kind != "full", implementation="pallas_mosaic", segment_ids=seg
        )

    with jflash.kernel_timeline(directory, kernels=args.kernel, space=args.space):
        fn, nargs = jit_passes(attn)["fwd" if args.kernel == "fwd" else "fwdbwd"]
        inputs = (q, k, v, do)[:nargs]
        jax.block_until_ready(fn(*inputs))
    heat([lambda: fn(*inputs)], args.heat)
    # The profiler writes a call's trace only where none of that name exists yet.
    for f in glob.glob(os.path.join(directory, "*.json")):
        os.remove(f)
    jax.block_until_ready(fn(*inputs))
    with open(newest_trace(directory)) as f:
        return json.load(f)["traceEvents"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="kind:S:D,... (see above)")
    parser.add_argument(
        "--kernel",
        default="fwd",
        choices=("fwd", "dkv"),
        help="the forward, or the backward's dK/dV kernel (profiled in forward+backward)",
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument(
        "--space",
        type=int,
        default=None,
        help="ranges kept per warpgroup (default: what fits beside the kernel, 480 fwd / 240 dkv)",
    )
    parser.add_argument(
        "--heat", type=float, default=HEAT_S, help="seconds of calls before the profiled one"
    )
    parser.add_argument("--traces", default=None, help="folder to keep each shape's trace in")
    parser.add_argument("--keep", type=int, default=8, help="warpgroups kept per trace")
    parser.add_argument(
        "--out", default=None, help="JSON path (default: results/timeline-<gpu>.json)"
    )
    args = parser.parse_args(argv)
    if args.out:
        check_out(parser, "--out", args.out)
    try:
        shapes = parse_shapes(args.shapes)
    except ValueError as e:
        parser.error(str(e))
    for flag in ("batch", "heads", "kv_heads", "space", "keep"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: at least 1")
    if args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")

    import jax

    import jflash
    from benchmarks.common import device_name

    scopes = jflash.KERNEL_SCOPES[args.kernel]

    if jax.devices()[0].platform != "gpu":
        parser.error("the Mosaic profiler needs a Hopper GPU (this machine has none)")
    rows = []
    for kind, seq, hd in shapes:
        with tempfile.TemporaryDirectory() as directory:
            try:
                events = profile_shape(kind, seq, hd, args, directory)
            except ValueError as e:
                if "exceeds available shared memory" not in str(e):
                    raise
                space = "default" if args.space is None else args.space
                parser.error(
                    f"{kind}:{seq}:{hd}: the profiler's ranges per warpgroup (--space {space}) "
                    f"do not fit beside the {args.kernel} kernel's shared memory; lower --space"
                )
        row = {"shape": f"{kind} S={seq} D={hd} B={args.batch}", "kernel": args.kernel}
        row.update(analyse(events, **scopes))
        rows.append(row)
        if args.traces:
            os.makedirs(args.traces, exist_ok=True)
            keep = sorted({e["tid"] for e in events})[: args.keep]
            path = os.path.join(args.traces, f"timeline-{args.kernel}-{kind}-{seq}-{hd}.json")
            with open(path, "w") as f:
                json.dump({"traceEvents": [e for e in events if e["tid"] in keep]}, f)
        print(json.dumps(row), flush=True)
    columns = [
        "shape",
        "warpgroup_items",
        "steps_per_item",
        "in_steps",
        "step_cycles",
        "item_gap_cycles",
        "item_gap_share",
    ]
    print(table(rows, columns))
    name = f"timeline-{device_name()}" + ("" if args.kernel == "fwd" else f"-{args.kernel}")
    out = args.out or os.path.join(RESULTS, f"{name}.json")
    write_json(out, {"args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
