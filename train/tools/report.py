"""The profiling report: `report.json` -> `report.md` and PNG plots.

`render(report, out_dir)` writes, beside `report.json`, as one set (all new files or
none; `train.tools.files.write_set`):

* `report.md`: tables with units (per-phase time, throughput and memory, kernel
  classes, arithmetic intensity), the measured ceilings, PyTorch + LightSeq's published numbers for
  reference, and every field that could not be measured, with the reason.
* `latency_throughput.png`, `memory.png`, `phases.png`, `kernels.png`,
  `roofline.png` and, with a model and context on several device counts,
  `scaling.png`: one entry each in `PLOTS` (file, which rows, panels, title), so a
  new plot is one more entry.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
from collections.abc import Callable
from typing import IO

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from train.tools.files import json_writer, write_set, write_whole  # noqa: E402
from train.tools.trace import kernel_label  # noqa: E402
from train.words import plural  # noqa: E402

# PyTorch + LightSeq's published numbers: 4 GPUs, PyTorch + LightSeq, fp16, 512 tokens.
SEED_REFERENCE = [
    {"model": "llama2-7b", "forward_ms": 132.6, "backward_ms": 538.3, "comm_ms": 68.4},
    {"model": "llama3.2-3b", "forward_ms": 93.6, "backward_ms": 261.2, "comm_ms": 35.0},
    {"model": "llama3.2-1b", "forward_ms": 53.3, "backward_ms": 157.8, "comm_ms": 21.2},
]
DPI = 110  # the plots' resolution
PHASES = ("forward", "backward", "recompute", "update", "idle")
# Traced step / timed step beyond 1 +- this: the per-phase times (traced) do not
# describe the timed step (profiling overhead, or a noisy timing).
TRACE_TIMED_TOLERANCE = 0.25
CLASSES = ("attention", "matmul", "exposed_comm", "other")
COLORS = {
    "forward": "#4c72b0",
    "backward": "#dd8452",
    "recompute": "#8172b3",
    "update": "#937860",
    "idle": "#cccccc",
    "attention": "#c44e52",
    "matmul": "#55a868",
    "exposed_comm": "#da8bc3",
    "other": "#8c8c8c",
}


def _ok(report: dict) -> list[dict]:
    return [r for r in report["rows"] if r.get("status") == "ok"]


def significant(value: float, digits: int = 3) -> str:
    """`value` with `digits` significant digits, never rounded to zero (a CPU's 0.004
    TFLOP/s is `0.004`, not `0.0`); thousands grouped."""
    if value == 0 or abs(value) >= 10 ** (digits - 1):
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


# The throughput table's columns that a device may not report, and why where a row does
# not say (report.json rows record it in `not_measured`).
UNREPORTED = {"mfu": "MFU", "peak_memory_gib": "peak memory"}


# The trace's fields that `train.tools.trace.TraceReport.not_measured` names, by the
# report's column that shows each (its `–` says why in the notes).
TRACE_COLUMNS = {
    **{f"{phase}_ms": phase for phase in PHASES},
    "attention_ms": "attention",
    "matmul_ms": "matmul",
    "other_ms": "other",
    "memcpy_ms": "memcpy (union)",
    "permute_bytes": "ring GB/s",
}


def trace_notes(not_measured: dict[str, str]) -> list[str]:
    """The trace's unmeasured fields as notes, `` `–` column, column: why ``, one per
    reason, in the columns' words."""
    by_why: dict[str, list[str]] = {}
    for field, why in not_measured.items():
        by_why.setdefault(why, []).append(TRACE_COLUMNS.get(field, field))
    return [f"`–` {', '.join(columns)}: {why}" for why, columns in by_why.items()]


def unreported_reason(
    field: str, device_kind: str | None = None, platform: str | None = None, memory_stats=None
) -> str:
    """Why `field` of UNREPORTED has no value: what the device does not report.
    `memory_stats`: whether the device reports memory statistics (None: not known)."""
    if field == "mfu":
        device = f"device {device_kind}" if device_kind else "the device"
        return f"no peak FLOP/s known for {device} in train.metrics.PEAK_BF16_FLOPS"
    if memory_stats:
        return f"device {device_kind} reports no peak_bytes_in_use"
    if memory_stats is False or platform == "cpu":
        return f"the {platform.upper()} backend reports no memory stats"
    return "the device reports no peak memory"


def _unreported_why(row: dict, field: str) -> str:
    """The reason the row recorded (`train.tools.profile`), else one from its platform."""
    why = (row.get("not_measured") or {}).get(field)
    return why or unreported_reason(field, row.get("device_kind"), row.get("platform"))


def dash_notes(reasons) -> list[str]:
    """`- `–` reason (rows)`, one line per reason: `reasons` are `(text, row name)`
    pairs, in the order the lines come."""
    notes: dict[str, list[str]] = {}
    for text, name in reasons:
        notes.setdefault(text, []).append(name)
    return [f"- `–` {text} ({', '.join(names)})" for text, names in notes.items()]


def unreported_notes(ok: list[dict]) -> list[str]:
    """One line per reason a throughput-table value is `–` (MFU, peak memory), naming
    the rows; none where every row has its values."""
    return dash_notes(
        (f"{label}: {_unreported_why(r, field)}", r["name"])
        for r in ok
        for field, label in UNREPORTED.items()
        if r.get(field) is None
    )


def xla_cost_reason(row: dict) -> str | None:
    """Why the row has no XLA cost (its HBM GB/s and step intensity are `–`), or None
    where it has one."""
    if row.get("xla"):
        return None
    if row.get("xla_cost") is False:
        return (
            "XLA cost analysis not run (--no-xla-cost; `python -m train.tools.profile "
            "--fill-xla-cost DIR` computes it)"
        )
    if row.get("xla_cost"):
        return "XLA's cost analysis reported no bytes accessed"
    return "no XLA cost recorded (timed with --no-xla-cost, or the analysis had no bytes)"


XLA_COLUMNS = "HBM GB/s, HBM % of copy and step FLOP/B"  # the columns of XLA's bytes


def filled_text(ok: list[dict]) -> str:
    """The sentences saying which rows' XLA bytes (`XLA_COLUMNS`) were filled in after
    they were timed (`--fill-xla-cost`: `xla.filled` in report.json), by which command,
    when and on which device; empty where none were."""
    fills: dict[tuple, list[str]] = {}
    for r in ok:
        filled = (r.get("xla") or {}).get("filled")
        if filled:
            key = (filled.get("command"), filled.get("date"), filled.get("device"))
            fills.setdefault(key, []).append(r["name"])
    return " ".join(
        f"{XLA_COLUMNS} filled in afterwards, on {date or '?'} by `{command or '?'}` "
        f"(compiled on {device or 'an unrecorded device'}, not run), for "
        f"{'row' if len(names) == 1 else 'rows'} {', '.join(names)}."
        for (command, date, device), names in fills.items()
    )


def xla_cost_notes(ok: list[dict], columns: str) -> list[str]:
    """One line per reason the `columns` that need XLA's bytes are `–`, naming the
    rows; none where every row has them."""
    return dash_notes(
        (f"{columns}: {reason}", r["name"]) for r in ok if (reason := xla_cost_reason(r))
    )


def roof(intensity: float, ceil: dict) -> tuple[float, str] | None:
    """The measured roof at `intensity` FLOP/byte, in TFLOP/s, and which ceiling it is
    (`matmul`, or `copy`: `intensity` × the copy bandwidth), the lower of the two; None
    where no ceiling was measured."""
    roofs = []
    if ceil.get("matmul_tflops"):
        roofs.append((ceil["matmul_tflops"], "matmul"))
    if ceil.get("copy_gbps"):
        roofs.append((intensity * ceil["copy_gbps"] / 1e3, "copy"))
    return min(roofs) if roofs else None


def above_roof(ok: list[dict], ceil: dict) -> list[tuple[dict, str, dict, float, str]]:
    """The roofline's points (row, kind, point) that lie above the measured roof at their
    intensity, each with that roof (`roof`)."""
    found = []
    for r in ok:
        for kind, p in (r.get("intensity") or {}).items():
            if not (p and p.get("tflops") and p.get("intensity")):
                continue
            top = roof(p["intensity"], ceil)
            if top and p["tflops"] > top[0]:
                found.append((r, kind, p, *top))
    return found


# What each roofline point's two coordinates are measured from.
POINT_RATE = {
    "step": "model FLOPs over the timed step",
    "attention": "analytic FLOPs over the traced attention kernels' time",
    "matmul": "analytic FLOPs over the traced matmul kernels' time",
}
POINT_BYTES = {
    "step": "XLA's bytes accessed, some of which caches can serve",
    "attention": "compulsory bytes, each operand read once",
    "matmul": "compulsory bytes, each operand read once",
}


def roof_notes(ok: list[dict], ceil: dict) -> list[str]:
    """One line per kind of point and roof where points lie above the measured roof,
    with their rates and rows, and why a measured point can: none where none does."""
    groups: dict[tuple[str, str], list[str]] = {}
    for r, kind, p, top, which in above_roof(ok, ceil):
        text = f"{_fmt(p['tflops'])} > {_fmt(top)} ({r['name']})"
        groups.setdefault((kind, which), []).append(text)
    lines = []
    for (kind, which), points in groups.items():
        if which == "matmul":
            why = (
                f"That roof is the median rate of one matmul timed at startup "
                f"({ceil.get('matmul_label', 'the matmul ceiling')}), not the device's "
                f"limit, and each point is a measurement too ({POINT_RATE[kind]}): a point "
                "a few percent above it ran about as fast as that matmul."
            )
        else:
            why = (
                "That roof is the point's intensity × the copy bandwidth measured at "
                f"startup ({ceil.get('copy_label', 'the copy ceiling')}), not the memory's "
                f"limit, and the bytes behind the intensity are counted ({POINT_BYTES[kind]}), "
                "not measured traffic."
            )
        lines.append(
            f"- Above the measured {which} roof: {kind} TFLOP/s {'; '.join(points)}. {why}"
        )
    return lines


def ring_notes(ok: list[dict]) -> list[str]:
    """One line per reason `ring GB/s` is `–`, naming the rows; none where every row
    has it."""

    def why(r: dict) -> str:
        return (r.get("not_measured") or {}).get("ring") or "no ring transfer recorded"

    return dash_notes((f"ring GB/s: {why(r)}", r["name"]) for r in ok if not r.get("ring"))


def copy_note(ok: list[dict], copy_gbps: float | None) -> list[str]:
    """The line for `HBM % of copy` cells that are `–` for want of a measured copy
    bandwidth (rows that have HBM GB/s), or none."""
    rows = [r["name"] for r in ok if r.get("hbm_gbps") and not copy_gbps]
    return [f"- `–` HBM % of copy: no copy bandwidth measured ({', '.join(rows)})"] if rows else []


def trace_timed_warning(row: dict) -> str | None:
    """The warning for a row whose traced step is far from its timed step, or None."""
    ratio = row.get("trace_vs_timed")
    if ratio is None or abs(ratio - 1) <= TRACE_TIMED_TOLERANCE:
        return None
    return (
        f"traced/timed = {significant(ratio)}: the traced step differs from the timed one by more "
        f"than {TRACE_TIMED_TOLERANCE:.0%} (profiling overhead or a noisy timing), so the "
        "per-phase and kernel times describe the traced steps, not the timed ones"
    )


def single_point(ok: list[dict]) -> bool:
    """Every series of the context plots has one point (one context per model and
    mesh): those plots show dots, not curves."""
    return bool(ok) and all(len(rs) == 1 for rs in _series(ok).values())


def _fmt(value, digits: int = 3) -> str:
    """A value as the report writes every number it measured (tables, notes, ceilings,
    the roofline's legend): `–` for None; a float with `digits` significant digits,
    one decimal from 100 and thousands grouped from 1000 (`0.0123`, `61.6`, `615.9`,
    `4,812`), so a point just above a roof reads above it (`619.9 > 615.9`)."""
    if value is None:
        return "–"
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) >= 100:
            return f"{value:.1f}"
        return f"{value:.{digits}g}"
    return str(value)


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return lines + [""]


def _ctx(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def _mean(row: dict) -> dict:
    return row["trace"]["mean"]


def _mesh(row: dict) -> str:
    """The row's mesh; its `--ring_strategy` (`+ulysses`) where it is not the ring,
    `+layers=N` and `+batch=N` where `--layers` and `--batch` were given,
    `+shard_over_seq` (`+gather_once`) when parameters are also sharded over a
    `seq` axis of more than one device (and gathered once per step), and the remat
    policy and unrolled layers where they differ from the defaults."""
    over_seq = row.get("mesh_sizes", {}).get("seq", 2) > 1  # unknown (error rows): say it
    label = row["mesh"]
    strategy = row.get("ring_strategy") or "ring"
    label += "" if strategy == "ring" else f" +{strategy}"
    label += f" +layers={row['layers_override']}" if row.get("layers_override") else ""
    label += f" +batch={row['batch']}" if row.get("batch", 1) != 1 else ""
    label += " +shard_over_seq" if over_seq and row.get("shard_over_seq") else ""
    label += " +gather_once" if over_seq and row.get("gather_once") else ""
    if row.get("remat", "save_attn") != "save_attn":
        label += f" +{row['remat']}"
    return label + ("" if row.get("scan_layers", True) else " +unrolled")


def _model(row: dict) -> str:
    """The row's model as its name begins (`label` in report.json: a preset's name, or
    `local-` and a local directory's basename, made unique), so a local directory is
    never shown as the preset it may be named after; the model as given where the row
    recorded no label (a report.json written before rows did)."""
    return row.get("label") or row["model"]


def models_note(rows: list[dict]) -> list[str]:
    """The lines saying which model each `model` column entry that differs from the
    model as given stands for (`local-mine` for `/data/mine`); none where none does."""
    given = dict.fromkeys((_model(r), r["model"]) for r in rows if _model(r) != r["model"])
    if not given:
        return []
    said = "; ".join(f"`{label}` is `{model}`" for label, model in given)
    return [
        "Column `model` names each model as its rows' names begin (a local directory: "
        f"`local-` and its basename): {said}.",
        "",
    ]


def _label(row: dict) -> str:
    return f"{_model(row)} ({_mesh(row)})"


def row_fact(report: dict, row: dict, key: str):
    """How `row` ran (`train.tools.profile.ROW_FACTS`: steps, `--layers`, XLA_FLAGS,
    jax): its own record, else the report's (a report.json written before rows
    recorded them)."""
    return row[key] if key in row else report.get(key)


# How each `--ring_strategy` splits attention over `seq`: as the report's header says it,
# and `train.tools.profile` why a row has no ring GB/s.
STRATEGY_TEXT = {
    "ring": "the K/V ring",
    "allgather": "an all-gather of K/V",
    "ulysses": "an all-to-all over the heads",
    "hybrid": "an all-to-all over the heads on `seq_a2a`, the K/V ring on `seq`",
    "auto": "the strategy the trainer picks, unknown where the row ended before it picked",
}
# The strategies that pass no K/V blocks between the devices on `seq` (no ring GB/s);
# `ring` and `hybrid` (on `seq`) pass them.
NO_KV_RING = ("allgather", "ulysses")


def strategy_text(strategy: str | None) -> str:
    """A row's `--ring_strategy` and how it splits attention: `--ring_strategy ring`,
    the K/V ring (a row that recorded none ran the ring)."""
    strategy = strategy or "ring"
    how = STRATEGY_TEXT.get(strategy)
    no_ring = ", no K/V ring" if strategy in NO_KV_RING else ""
    return f"`--ring_strategy {strategy}`" + (f", {how}{no_ring}" if how else "")


def per_row(report: dict, rows: list[dict], key: str, text: Callable) -> str:
    """`text` of the rows' `key`: said once where they agree, else `mixed:` and each
    value with the rows it holds for (rows added with `--append` can differ)."""
    groups: dict[str, list[str]] = {}
    for r in rows:
        groups.setdefault(text(row_fact(report, r, key)), []).append(r["name"])
    if len(groups) > 1:
        return "mixed: " + "; ".join(f"{t} ({', '.join(names)})" for t, names in groups.items())
    return next(iter(groups), None) or text(report.get(key))


def step_spans(steps: dict) -> dict[str, str]:
    """A row's warm-up, timed and traced steps as the step numbers they ran as, counted
    from 1 as the trainer's step lines count (the traced ones are the trace's step
    numbers): `{"warmup": "1..2", "timed": "3..5", "traced": "6..7"}`, `none` for none."""
    spans, first = {}, 1
    for part in ("warmup", "timed", "traced"):
        n = steps[part]
        spans[part] = "none" if n == 0 else str(first) if n == 1 else f"{first}..{first + n - 1}"
        first += n
    return spans


def steps_text(steps: dict) -> str:
    """A row's steps: `warm-up 1..2, timed 3..5, traced 6..7`."""
    spans = step_spans(steps)
    return f"warm-up {spans['warmup']}, timed {spans['timed']}, traced {spans['traced']}"


def timing_text(steps: dict) -> str:
    """Which steps a row's latency and tokens/s come from, and which were traced."""
    spans = step_spans(steps)
    timed = "step" if steps["timed"] == 1 else "steps"
    traced = "step" if steps["traced"] == 1 else "steps"
    return (
        f"timed {timed} {spans['timed']}; traced {traced} {spans['traced']}: slower under "
        "the profiler, not timed"
    )


def _layers_text(layers: int | None) -> str:
    return plural(layers, "layer") if layers else "the preset's layers"


def layers_note(report: dict, ok: list[dict]) -> list[str]:
    """The lines saying which rows ran with `--layers` (none where no row did)."""
    said = per_row(report, ok, "layers_override", _layers_text)
    if said == _layers_text(None):
        return []
    if said.startswith("mixed: "):
        return [f"**Layers overridden in some rows** (column `layers`): {said}.", ""]
    return [
        f"**Layers overridden: every model runs {said}** (column `layers`; the preset's "
        "count is in report.json).",
        "",
    ]


def _commands(report: dict) -> str:
    commands = report.get("commands") or [report["command"]]
    if len(commands) == 1:
        return f"Command: `{commands[0]}`."
    return (
        "Commands (rows added with `--append`, in order): "
        + "; ".join(f"`{c}`" for c in commands)
        + "."
    )


KERNEL_COLUMNS = ["kernel", "class", "phase", "ms", "share", "where (name stack)"]


def _tail(stack: str, width: int) -> str:
    """The last whole scopes of a name stack that fit `width` characters ("…/" where
    scopes were left out; the last one whole however long)."""
    parts = stack.split("/")
    kept = [parts.pop()]
    while parts and len("/".join([parts[-1], *kept])) + 2 <= width:
        kept.insert(0, parts.pop())
    return ("…/" if parts else "") + "/".join(kept)


def _kernel_cells(k) -> list:
    return [
        f"`{kernel_label(k['name'], 70)}`",
        k["kind"],
        k.get("phase", ""),
        k["ms"],
        f"{k['share']:.1%}",
        f"`{_tail(k['where'], 80)}`" if k["where"] else "",
    ]


def _per_row_tables(rows, key: str, title: str, intro: str, header, cells) -> list[str]:
    """A section with one table per row that has `row[key]` (a list of kernel dicts):
    `header(row)` names the columns, `cells(item)` fills one line."""
    rows = [r for r in rows if r.get(key)]
    if not rows:
        return []
    lines = [title, "", intro, ""]
    for r in rows:
        lines += [f"**{_model(r)}, {_ctx(r['context'])}, {_mesh(r)}**", ""]
        lines += _table(header(r), [cells(k) for k in r[key]])
    return lines


def _seed_reference() -> list[str]:
    """The PyTorch + LightSeq table (4 GPUs, published), as a section."""
    lines = ["## PyTorch + LightSeq's numbers, for reference", ""]
    lines += [
        "4 GPUs, PyTorch + LightSeq, fp16, **512 tokens** (the original PyTorch project's "
        "published table); its latency was "
        "CUDA + CPU time and its 'bandwidth' memory ÷ time, so only the phase times compare.",
        "",
    ]
    return lines + _table(
        ["model", "forward (ms)", "backward (ms)", "communication (ms)"],
        [[s["model"], s["forward_ms"], s["backward_ms"], s["comm_ms"]] for s in SEED_REFERENCE],
    )


def markdown(report: dict) -> str:
    """The Markdown report."""
    rows, ok = report["rows"], _ok(report)
    ceil = report.get("ceilings") or {}
    measured = [r for r in ok if r.get("device_kind")]
    device = per_row(report, measured, "device_kind", lambda d: d or ceil.get("device", "?"))
    jax_version = per_row(report, rows, "jax", lambda v: f"jax {v}")
    flags = per_row(report, rows, "xla_flags", lambda v: f"`{v or '(none)'}`")
    steps = per_row(report, ok or rows, "steps", steps_text)
    batch = per_row(report, ok or rows, "batch", lambda b: str(b or 1))
    strategy = per_row(report, ok or rows, "ring_strategy", strategy_text)
    filled = filled_text(ok)
    lines = [
        "# Training profile",
        "",
        f"{report['date']}, {jax_version}, device: {device}. {_commands(report)} "
        f"XLA_FLAGS: {flags}." + (f" {filled}" if filled else ""),
        "",
        f"Steps, counted from 1 in each row's run as the trainer's step lines count: "
        f"{steps}. Compile excluded, "
        "`block_until_ready` around the timed steps. Latency, tokens/s, TFLOP/s and MFU come "
        "from the timed steps only; the traced steps, slower under the profiler, are not "
        "timed. Per-device phase and kernel times are the mean over devices and traced "
        "steps. Model FLOPs (`models.training_flops_per_token`, recompute not counted) give "
        "TFLOP/s and MFU.",
        "",
        f"Batch (sequences per data-parallel rank): {batch}. Attention split over `seq`: "
        f"{strategy}. Ring GB/s measures the K/V ring's transfers; the tool runs the ring "
        "unless its `--ring-strategy` names another strategy (a row run with the trainer's "
        "default, `auto`, which picks Ulysses on one host where `seq` divides the query "
        "heads, says the strategy it picked).",
        "",
    ]
    lines += models_note(rows)
    lines += layers_note(report, ok)
    lines += ["## Time per step (ms per device)", ""]
    lines += [
        "Phases partition the traced step: forward + backward + recompute + update "
        "(gradient accumulation, optimizer, anything outside the differentiated loss) + "
        "idle = traced step. `traced/timed` compares the traced step with the timed "
        "latency (profiling overhead).",
        "",
    ]
    lines += _table(
        [
            "model",
            "context",
            "mesh",
            "layers",
            "forward",
            "backward",
            "recompute",
            "update",
            "idle",
            "traced step",
            "timed step",
            "traced/timed",
            "communication",
            "exposed comm.",
        ],
        [
            [_model(r), _ctx(r["context"]), _mesh(r), r["layers"]]
            + [_mean(r)[f"{p}_ms"] for p in PHASES]
            + [
                _mean(r)["step_ms"],
                r["step_ms"],
                r["trace_vs_timed"],
                _mean(r)["comm_ms"],
                _mean(r)["exposed_comm_ms"],
            ]
            for r in ok
        ],
    )
    lines += ["## Throughput and memory", ""]
    lines += [
        "Latency, tokens/s, TFLOP/s and MFU: the timed steps (`block_until_ready` around "
        "them), none of the traced steps (slower under the profiler: not timed; their time "
        "is the `traced step` above). HBM GB/s: bytes per XLA's cost analysis ÷ timed "
        "step (see `xla.method` in report.json"
        + (
            "; in rows filled in afterwards, as the header says, the bytes of a later "
            "compile (`xla.filled`) ÷ the step timed in the row's own run"
            if filled
            else ""
        )
        + "); HBM % of copy: that ÷ the measured copy "
        "bandwidth, over 100% where caches serve some of the counted bytes (small steps, "
        "CPU). Ring GB/s: bytes of "
        "the collective-permutes (K/V and dK/dV transfers) ÷ the time they run, per "
        "device (includes waiting for the peer, so a lower bound on the link). Memory "
        "per device: peak measured by the allocator, and the compiler's estimate "
        "(arguments + outputs + temporaries − aliased).",
        "",
    ]
    copy = ceil.get("copy_gbps")
    lines += _table(
        [
            "model",
            "context",
            "mesh",
            "latency (ms)",
            "tokens/s",
            "TFLOP/s per device",
            "MFU",
            "HBM GB/s",
            "HBM % of copy",
            "ring GB/s",
            "peak memory (GiB)",
            "compiler estimate (GiB)",
        ],
        [
            [
                _model(r),
                _ctx(r["context"]),
                _mesh(r),
                r["step_ms"],
                r["tokens_per_s"],
                r["tflops_per_device"],
                f"{r['mfu']:.1%}" if r.get("mfu") is not None else None,
                r.get("hbm_gbps"),
                f"{r['hbm_gbps'] / copy:.0%}" if r.get("hbm_gbps") and copy else None,
                (r.get("ring") or {}).get("gbps"),
                r.get("peak_memory_gib"),
                r.get("compiler_memory_gib"),
            ]
            for r in ok
        ],
    )
    notes = xla_cost_notes(ok, "HBM GB/s, HBM % of copy") + copy_note(ok, copy)
    notes += ring_notes(ok)
    if notes := notes + unreported_notes(ok):  # under the table, where its `–` are
        lines += [*notes, ""]
    lines += ["## Kernel classes (ms per device)", ""]
    lines += [
        "A second partition of busy time (traced step − idle): attention kernels + "
        "matmuls + exposed communication + other. `phase share named`: the share of "
        "busy time whose phase came from a name stack (the rest takes the phase of the "
        "kernel before it on its stream).",
        "",
    ]
    lines += _table(
        [
            "model",
            "context",
            "mesh",
            "attention",
            "matmul",
            "exposed comm.",
            "other",
            "busy",
            "memcpy (union)",
            "phase share named",
        ],
        [
            [_model(r), _ctx(r["context"]), _mesh(r)]
            + [_mean(r)[f"{c}_ms"] for c in CLASSES]
            + [
                _mean(r)["step_ms"] - _mean(r)["idle_ms"],
                _mean(r)["memcpy_ms"],
                f"{r['trace']['named_fraction']:.0%}",
            ]
            for r in ok
        ],
    )
    for key, title, intro in (
        (
            "top_kernels",
            "## Top kernels (first device, ms per traced step)",
            "The ten kernels with the most device time and the name stack that spent most "
            "of it: what the class totals above hide (a kernel slower than its peers, f32 "
            "matmuls in a bf16 model). `share`: of the summed time of all the device's "
            "kernels in the traced steps (overlapping kernels count each).",
        ),
        (
            "top_update_kernels",
            "## Top kernels of the update phase (first device, ms per traced step)",
            "What runs outside the differentiated loss (the optimizer, the gradients' "
            "normalisation, norm and sums): these kernels carry no model scope, so the "
            "phase and class totals above do not name them.",
        ),
    ):
        lines += _per_row_tables(ok, key, title, intro, lambda r: KERNEL_COLUMNS, _kernel_cells)
    lines += _per_row_tables(
        ok,
        "kernel_spread",
        "## Kernels that differ between devices (ms per traced step)",
        "The kernels whose time differs most between the GPUs of a row. A compute kernel "
        "slower on one GPU points at that device (or at uneven work); a communication "
        "kernel's time includes waiting for a slower peer.",
        lambda r: ["kernel", "class", *r["kernel_spread"][0]["ms"], "spread"],
        lambda k: [
            f"`{kernel_label(k['name'], 70)}`",
            k["kind"],
            *k["ms"].values(),
            k["spread_ms"],
        ],
    )
    lines += _per_row_tables(
        ok,
        "top_other_scopes",
        "## Where the other kernels run (first device, ms per traced step)",
        "The class `other` (elementwise and reduction fusions, copies XLA writes) by model "
        "scope, every layer's kernels added up: norms, RoPE, SwiGLU, the loss. `share`: of "
        "the summed time of all the device's kernels; `launches`: per traced step.",
        lambda r: ["scope", "phase", "ms", "share", "launches", "largest kernel"],
        lambda k: [
            f"`{_tail(k['scope'], 90)}`",
            k["phase"],
            k["ms"],
            f"{k['share']:.1%}",
            f"{k['launches']:.3g}" if isinstance(k["launches"], float) else k["launches"],
            f"`{kernel_label(k['name'], 50)}`",
        ],
    )
    lines += ["## Arithmetic intensity (FLOP/byte) and achieved TFLOP/s per device", ""]
    lines += [
        "Step: model FLOPs ÷ XLA's bytes"
        + (" (filled in afterwards in the rows the header names)" if filled else "")
        + ". Attention and matmuls: analytic FLOPs ÷ "
        "compulsory bytes (`train.tools.roofline`), achieved rate over the traced kernel time.",
        "",
    ]

    def point(r, key, field):
        p = (r.get("intensity") or {}).get(key)
        if p is None and (key, field) == ("step", "tflops"):
            return r.get("tflops_per_device")  # model FLOPs ÷ step: no XLA bytes needed
        return None if p is None else p[field]

    lines += _table(
        [
            "model",
            "context",
            "mesh",
            "step FLOP/B",
            "step TFLOP/s",
            "attention FLOP/B",
            "attention TFLOP/s",
            "matmul FLOP/B",
            "matmul TFLOP/s",
        ],
        [
            [_model(r), _ctx(r["context"]), _mesh(r)]
            + [
                point(r, k, f)
                for k in ("step", "attention", "matmul")
                for f in ("intensity", "tflops")
            ]
            for r in ok
        ],
    )
    if notes := xla_cost_notes(ok, "step FLOP/B") + roof_notes(ok, ceil):
        lines += [*notes, ""]
    if ceil.get("matmul_tflops"):
        lines += [
            "## Ceilings (measured on this machine at startup)",
            "",
            f"- {ceil['matmul_label']}: {_fmt(ceil['matmul_tflops'])} TFLOP/s",
            f"- {ceil['copy_label']}: {_fmt(ceil['copy_gbps'])} GB/s",
            "",
        ]
    if any(r.get("platform") == "gpu" for r in ok):  # a GPU reference, beside GPU rows
        lines += _seed_reference()
    failed = [r for r in rows if r.get("status") != "ok"]
    if failed:
        lines += ["## Rows that did not run", ""]
        lines += _table(
            ["model", "context", "mesh", "status", "detail"],
            [
                [
                    _model(r),
                    _ctx(r["context"]),
                    _mesh(r),
                    r.get("status"),
                    (r.get("error") or "").replace("\n", " ")[:200],
                ]
                for r in failed
            ],
        )
    notes = {}
    for r in ok:
        for note in trace_notes(r["trace"]["not_measured"]):
            notes.setdefault(note, []).append(r["name"])
        for w in r.get("warnings", []):
            notes.setdefault(f"warning: {w}", []).append(r["name"])
        trace_warning = trace_timed_warning(r)
        if trace_warning:
            notes.setdefault(f"warning: {trace_warning}", []).append(r["name"])
    if notes:
        lines += ["## Not measured, and warnings", ""]
        lines += [f"- {text} ({', '.join(names)})" for text, names in notes.items()] + [""]
    lines += ["## Plots", ""]
    if single_point(ok):
        lines += [
            "One context per model and mesh: the latency, throughput and memory plots "
            "show one point per series, not a trend (pass several `--context` values).",
            "",
        ]
    lines += [f"![{name}]({name}.png)" for name in plots_written(report)] + [""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------
# Plots


def _series(ok: list[dict]) -> dict[str, list[dict]]:
    series: dict[str, list[dict]] = {}
    for r in ok:
        series.setdefault(_label(r), []).append(r)
    return {k: sorted(v, key=lambda r: r["context"]) for k, v in series.items()}


def _context_axis(ax, rows):
    ticks = sorted({r["context"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [_ctx(t) for t in ticks])
    ax.set_xlabel("context (tokens per sequence)")


def _one_point_note(ax):
    """Says under the x axis, where it covers no point, that the panel holds one
    context per series."""
    ax.set_xlabel(f"{ax.get_xlabel()}\n(one context per series: single points, no trend)")


# One plot is one entry of PLOTS: its file, which rows it draws (none: not drawn), its
# panels and its title. Each `_lines` / `_memory` / `_stacked` / `_roofline` returns
# the function that fills the figure's panels from those rows.


@dataclasses.dataclass(frozen=True)
class Plot:
    """One figure of the report, `<name>.png`."""

    name: str
    title: str
    draw: Callable[[list, list[dict], dict], None]  # (panels, rows, report) fills the panels
    rows: Callable[[list[dict]], list[dict]] = lambda ok: ok  # [] when the plot has nothing
    panels: Callable[[list[dict]], int] = lambda rows: 1  # side by side
    panel_size: tuple[float, float] = (7.0, 4.2)  # inches (the width at least)
    # Inches a panel needs for its labels, from the rows (more rows: wider); None: fixed.
    width: Callable[[list[dict]], float] | None = None
    # Run on the figure once its layout is final (labels placed where they fit).
    place: Callable[[plt.Figure], None] | None = None


@dataclasses.dataclass(frozen=True)
class Line:
    """One quantity on a `_lines` panel: a row field, drawn per series."""

    field: str
    ylabel: str
    title: str = ""


def _by_shape(ok: list[dict]) -> dict[str, list[dict]]:
    """Rows of one model and context, over device counts."""
    groups: dict[str, list[dict]] = {}
    for r in ok:
        groups.setdefault(f"{_model(r)} {_ctx(r['context'])}", []).append(r)
    return {k: sorted(v, key=lambda r: r["devices"]) for k, v in groups.items()}


def _devices_axis(ax, rows):
    counts = sorted({r["devices"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(counts, [str(c) for c in counts])
    ax.set_xlabel("devices")


def _lines(*lines: Line, x: str = "context"):
    """One panel per `Line`: its field against `x` ("context" or "devices"), a line
    per series (per model and mesh against context; per model and context against
    devices)."""
    series, axis = (_series, _context_axis) if x == "context" else (_by_shape, _devices_axis)

    def draw(axes, rows, report):
        for ax, line in zip(axes, lines, strict=True):
            for label, rs in series(rows).items():
                ax.plot([r[x] for r in rs], [r[line.field] for r in rs], "o-", label=label)
            axis(ax, rows)
            ax.set_title(line.title)
            ax.set_ylabel(line.ylabel)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
            if x == "context" and single_point(rows):
                _one_point_note(ax)

    return draw


def _memory():
    """Peak measured and compiler-estimated memory per series, and the device limit."""

    def draw(axes, rows, report):
        (ax,) = axes
        for i, (label, rs) in enumerate(_series(rows).items()):
            color = f"C{i}"
            x = [r["context"] for r in rs]
            measured = [r.get("peak_memory_gib") for r in rs]
            if any(v is not None for v in measured):
                ax.plot(x, measured, "o-", color=color, label=f"{label}: peak measured")
            ax.plot(
                x,
                [r.get("compiler_memory_gib") for r in rs],
                "s--",
                color=color,
                label=f"{label}: compiler estimate",
            )
        limit = min(
            (r["memory_limit_gib"] for r in rows if r.get("memory_limit_gib")), default=None
        )
        if limit:
            ax.axhline(limit, color="k", lw=1, ls=":", label=f"allocator limit {limit:.0f} GiB")
        _context_axis(ax, rows)
        ax.set_ylabel("GiB per device")
        if single_point(rows):
            _one_point_note(ax)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)

    return draw


def _models(rows: list[dict]) -> int:
    return len(dict.fromkeys(_model(r) for r in rows))


# Text sizes for sizing a figure before it is drawn: inches per character of a label
# (DejaVu Sans, with room to spare) at a font size of 1 pt, and a bar's least width.
CHAR_IN_PER_PT = 0.65 / 72
BAR_IN = 0.5
GROUP_FONT = 8  # the mesh under each group of bars


def _mesh_groups(rows: list[dict]) -> list[tuple[str, list[dict]]]:
    """A model's rows by mesh label (in order of appearance), each group by context."""
    groups: dict[str, list[dict]] = {}
    for r in sorted(rows, key=lambda r: (_mesh(r), r["context"])):
        groups.setdefault(_mesh(r), []).append(r)
    return list(groups.items())


def _mesh_lines(mesh: str) -> str:
    return mesh.replace(" +", "\n+")


def _stacked_width(rows: list[dict]) -> float:
    """Inches a `_stacked` panel needs: each mesh's group as wide as its bars or its
    longest label line, whichever is wider, and the axis' own margin."""
    widths = []
    for model in dict.fromkeys(_model(r) for r in rows):
        groups = _mesh_groups([r for r in rows if _model(r) == model])
        width = 1.4  # the y label, ticks and the panel's padding
        for mesh, rs in groups:
            line = max(len(x) for x in _mesh_lines(mesh).split("\n"))
            text = line * GROUP_FONT * CHAR_IN_PER_PT if len(groups) > 1 else 0.0
            width += max(len(rs) * BAR_IN, text) + BAR_IN / 2
        widths.append(width)
    return max(widths)


def _stacked(parts: tuple[str, ...]):
    """One panel per model: bars of `parts` (`<part>_ms` of the traced mean) per context,
    grouped by mesh (named once under its group), with the timed step as a mark."""

    def draw(axes, rows, report):
        models = list(dict.fromkeys(_model(r) for r in rows))
        for ax, model in zip(axes, models, strict=True):
            groups = _mesh_groups([r for r in rows if _model(r) == model])
            xs, rs, centers, x = [], [], [], 0.0
            for mesh, group in groups:
                line = max(len(t) for t in _mesh_lines(mesh).split("\n"))
                slots = max(len(group), line * GROUP_FONT * CHAR_IN_PER_PT / BAR_IN)
                first = x + (slots - len(group)) / 2  # the bars centred in their group
                xs += [first + i for i in range(len(group))]
                rs += group
                centers.append((first + (len(group) - 1) / 2, mesh))
                x += slots + 0.5
            bottom = [0.0] * len(rs)
            for part in parts:
                values = [_mean(r)[f"{part}_ms"] or 0.0 for r in rs]
                ax.bar(xs, values, bottom=bottom, color=COLORS[part], label=part.replace("_", " "))
                bottom = [b + v for b, v in zip(bottom, values, strict=True)]
            ax.plot(xs, [r["step_ms"] for r in rs], "k_", ms=30, mew=2, label="timed step")
            ax.set_xticks(xs, [_ctx(r["context"]) for r in rs])
            ax.set_xlim(-0.75, x - 0.75)
            if len(groups) == 1:  # one mesh: said once, in the title
                ax.set_title(f"{model} ({groups[0][0]})")
            else:
                ax.set_title(model)
                for center, mesh in centers:
                    ax.annotate(
                        _mesh_lines(mesh),
                        (center, 0),
                        xycoords=("data", "axes fraction"),
                        xytext=(0, -20),
                        textcoords="offset points",
                        ha="center",
                        va="top",
                        fontsize=GROUP_FONT,
                    )
            ax.set_ylabel("ms per step, per device")
            ax.grid(axis="y", alpha=0.3)
        axes[-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), markerscale=0.4)

    return draw


POINT_LABEL = "point-label"  # the gid of a roofline point's context label
ABOVE_ROOF = "above the measured roof (report.md says why)"  # the ring's legend entry
LABEL_FONT = 7


def _roofline():
    """Step, attention kernels and matmuls at their arithmetic intensity, under the
    measured matmul and copy ceilings; each point's context beside it (`_place_labels`
    moves the labels apart once the layout is final) and the legend outside the axes."""

    def draw(axes, rows, report):
        (ax,) = axes
        ceil = report.get("ceilings") or {}
        points = [
            (r, k, p)
            for r in rows
            for k, p in (r.get("intensity") or {}).items()
            if p and p.get("tflops")
        ]
        xs = [p["intensity"] for _, _, p in points] or [1.0]
        peak, bw = ceil.get("matmul_tflops"), ceil.get("copy_gbps")
        ridge = peak * 1e12 / (bw * 1e9) if peak and bw else None
        # From a decade left of the leftmost point or the ridge, to right of both.
        lo, hi = min(xs + [ridge or xs[0]]) / 10, max(xs + [ridge or xs[0]]) * 4
        if ridge:
            grid = [lo * (hi / lo) ** (i / 100) for i in range(101)]
            ax.plot(
                grid,
                [min(peak, x * bw * 1e9 / 1e12) for x in grid],
                "k-",
                lw=1.5,
                label=f"ceilings: {_fmt(peak)} TFLOP/s, {_fmt(bw)} GB/s "
                f"(ridge {_fmt(ridge)} FLOP/B)",
            )
        markers = {"step": "o", "attention": "^", "matmul": "s"}
        for i, label in enumerate(_series(rows)):
            for r, kind, p in points:
                if _label(r) == label:
                    ax.plot(p["intensity"], p["tflops"], markers[kind], color=f"C{i}", ms=7)
                    ax.annotate(
                        _ctx(r["context"]),
                        (p["intensity"], p["tflops"]),
                        fontsize=LABEL_FONT,
                        xytext=(6, 6),
                        textcoords="offset points",
                        ha="center",
                        va="center",
                        gid=POINT_LABEL,
                        arrowprops={"arrowstyle": "-", "lw": 0.5, "color": "0.4", "shrinkB": 4},
                    )
            ax.plot([], [], "o", color=f"C{i}", label=label)
        if above := above_roof(rows, ceil):  # ringed, and report.md says why
            ax.plot(
                [p["intensity"] for _, _, p, _, _ in above],
                [p["tflops"] for _, _, p, _, _ in above],
                "o",
                ms=13,
                mfc="none",
                mec="red",
                mew=1.2,
                label=ABOVE_ROOF,
            )
        drawn = {kind for _, kind, _ in points}
        for kind, m in markers.items():
            if kind in drawn:  # no legend entry for a kind without points (the step
                ax.plot([], [], m, color="gray", label=kind)  # without XLA's bytes)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ys = [p["tflops"] for _, _, p in points]
        if ys:  # a decade below the lowest point: the points spread over the height
            ax.set_ylim(min(ys) / 10, max(ys + [peak or 0.0]) * 2)
        ax.set_xlabel("arithmetic intensity (FLOP/byte)")
        ax.set_ylabel("achieved TFLOP/s per device")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=LABEL_FONT, loc="upper left", bbox_to_anchor=(1.02, 1.0))

    return draw


def _roofline_width(rows: list[dict]) -> float:
    """Inches the roofline needs: its axes and, beside them, the legend's longest entry."""
    ceilings = len("ceilings: 999.9 TFLOP/s, 4,800 GB/s (ridge 999.9 FLOP/B)")
    longest = max([ceilings, len(ABOVE_ROOF), *(len(label) for label in _series(rows))])
    return 6.5 + longest * LABEL_FONT * CHAR_IN_PER_PT + 0.6


# Where a point's label may go, in points from the point: rings of offsets, nearest first.
LABEL_OFFSETS = [
    (round(r * math.cos(a * math.pi / 8), 1), round(r * math.sin(a * math.pi / 8), 1))
    for r in (7, 11, 16, 22, 29, 37, 46, 56, 67, 79, 92)
    for a in (2, 0, 4, 6, 1, 3, 5, 7, 15, 9, 14, 10, 13, 11, 12, 8)
]


def _overlap(a: tuple, b: tuple) -> float:
    """The area two boxes `(x0, y0, x1, y1)` share."""
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    return w * h if w > 0 and h > 0 else 0.0


def _marker_boxes(ax, dpi: float) -> list[tuple]:
    """The display boxes of the markers drawn on `ax`."""
    boxes = []
    for line in ax.get_lines():
        if line.get_marker() in (None, "None", "", " ") or not len(line.get_xydata()):
            continue
        half = line.get_markersize() / 72 * dpi / 2
        for x, y in line.get_transform().transform(line.get_xydata()):
            boxes.append((x - half, y - half, x + half, y + half))
    return boxes


def _label_cost(box: tuple, frame, taken: list[tuple]) -> tuple[bool, float]:
    """How bad a label at display box `box` is: outside the axes' `frame` first, then
    the area it shares with the boxes `taken`."""
    inside = frame.x0 <= box[0] and box[2] <= frame.x1 and frame.y0 <= box[1] <= box[3] <= frame.y1
    return not inside, sum(_overlap(box, b) for b in taken)


def _place_label(label, renderer, frame, taken: list[tuple]) -> tuple:
    """Moves `label` to the first of `LABEL_OFFSETS` where `_label_cost` is least; its
    display box there."""
    text = Text.get_window_extent(label, renderer)  # the text alone, not its leader line
    pad = 2 * label.figure.dpi / 72  # 2 points around each label
    w, h = text.width / 2 + pad, text.height / 2 + pad
    px, py = label.axes.transData.transform(label.xy)
    scale = label.figure.dpi / 72  # display pixels per point
    boxes = []
    for dx, dy in LABEL_OFFSETS:
        cx, cy = px + dx * scale, py + dy * scale
        boxes.append((cx - w, cy - h, cx + w, cy + h))
    best = min(range(len(boxes)), key=lambda i: _label_cost(boxes[i], frame, taken))
    label.xyann = LABEL_OFFSETS[best]
    return boxes[best]


def _place_labels(fig) -> None:
    """Moves each point label (`POINT_LABEL`) to the nearest offset where it overlaps no
    other label and no marker and stays inside the axes (else to where it overlaps
    least); a leader line joins a label set apart to its point."""
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        frame = ax.get_window_extent(renderer)
        taken = _marker_boxes(ax, fig.dpi)
        for label in [t for t in ax.texts if t.get_gid() == POINT_LABEL]:
            taken.append(_place_label(label, renderer, frame, taken))


PLOTS = (
    Plot(
        "latency_throughput",
        "Latency and throughput vs context (timed steps, not the traced ones)",
        _lines(
            Line("step_ms", "ms per step", "Step latency"),
            Line("tokens_per_s", "tokens/s", "Throughput"),
        ),
        panels=lambda rows: 2,
        panel_size=(5.5, 4.2),
    ),
    Plot("memory", "Memory per device vs context", _memory()),
    Plot(
        "phases",
        "Per-phase time per step (traced)",
        _stacked(PHASES),
        panels=_models,
        panel_size=(4.5, 4.5),
        width=_stacked_width,
    ),
    Plot(
        "kernels",
        "Busy time by kernel class (traced)",
        _stacked(CLASSES),
        rows=lambda ok: ok if any(_mean(r)["attention_ms"] is not None for r in ok) else [],
        panels=_models,
        panel_size=(4.5, 4.5),
        width=_stacked_width,
    ),
    Plot(
        "roofline",
        "Roofline: step, attention kernels and matmuls",
        _roofline(),
        panel_size=(7.5, 5.0),
        width=_roofline_width,
        place=_place_labels,
    ),
    Plot(
        "scaling",
        "Scaling with devices (same model and context)",
        _lines(Line("tokens_per_s", "tokens/s"), x="devices"),
        rows=lambda ok: _scaling_rows(ok),
    ),
)


def _scaling_rows(ok: list[dict]) -> list[dict]:
    """The rows of a model and context measured on several device counts (none: no
    scaling plot, though the report holds several device counts)."""
    counts = collections.defaultdict(set)
    for r in ok:
        counts[r["model"], r["context"]].add(r["devices"])
    return [r for r in ok if len(counts[r["model"], r["context"]]) > 1]


def plots_written(report: dict) -> list[str]:
    ok = _ok(report)
    return [plot.name for plot in PLOTS if ok and plot.rows(ok)]


def draw_plot(plot: Plot, report: dict, path: str, flag: str = "--out") -> None:
    """Draws one `PLOTS` entry from the report's measured rows into `path`, written as
    `write_whole` writes (`flag`: the command-line flag that chose its folder)."""
    write_whole(path, lambda f: save_plot(plot, report, f), flag, binary=True)


def save_plot(plot: Plot, report: dict, f: IO) -> None:
    """Draws one `PLOTS` entry from the report's measured rows as PNG into `f` (open
    for bytes)."""
    rows = plot.rows(_ok(report))
    n = plot.panels(rows)
    width, height = plot.panel_size
    width = max(width, plot.width(rows)) if plot.width else width
    fig, axes = plt.subplots(1, n, figsize=(width * n, height), squeeze=False)
    try:
        plot.draw(list(axes[0]), rows, report)
        if n == 1 and not axes[0][0].get_title():
            axes[0][0].set_title(plot.title)
        else:
            fig.suptitle(plot.title)
        fig.tight_layout()
        if plot.place:
            plot.place(fig)
        fig.savefig(f, format="png", dpi=DPI)
    finally:
        plt.close(fig)


def render(
    report: dict, out_dir: str, flag: str = "--out", *, with_json: bool = False
) -> list[str]:
    """Writes report.md and the plots (and with `with_json` report.json) into `out_dir`;
    returns the files written. The markdown is formed first, so a report it cannot
    render (a field missing) changes no file. The files are written as one set
    (`train.tools.files.write_set`): every one under a `.tmp` name first, then all
    renamed into place, so a file that cannot be written ends the tool with one line
    naming `flag` (the command-line flag that chose `out_dir`) and the file, and keeps
    every earlier file of the set."""
    text = markdown(report)
    names = plots_written(report)
    plots = [plot for plot in PLOTS if plot.name in names]
    paths = [os.path.join(out_dir, f"{plot.name}.png") for plot in plots]
    md = os.path.join(out_dir, "report.md")
    files = [
        (path, lambda f, plot=plot: save_plot(plot, report, f), True)
        for plot, path in zip(plots, paths, strict=True)
    ]
    if with_json:
        files.append((os.path.join(out_dir, "report.json"), json_writer(report), False))
    write_set([*files, (md, lambda f: f.write(text), False)], flag)
    return [md, *paths]


if __name__ == "__main__":
    import sys

    from train.tools import not_a_command

    sys.exit(not_a_command("train.tools.report"))
