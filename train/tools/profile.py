"""`python -m train.tools.profile`: forward, backward, recompute and communication time,
bandwidth and memory per model and context, measured from traces.

    XLA_FLAGS=--xla_gpu_enable_command_buffer= python -m train.tools.profile \\
        --models llama2-7b,llama3.2-3b,llama3.2-1b --context 8k,16k,32k,64k \\
        --mesh seq=2 [--mesh fsdp=2] [--steps 3 --warmup 2 --layers N] --out runs/profile
    python -m train.tools.profile --models llama2-7b --context 8k,16k --mesh seq=2 \\
        --shard-over-seq --append --reuse-ceilings --out runs/profile  # 7B: ZeRO-3 over seq
    python -m train.tools.profile --models llama3.2-1b --context 32k --mesh seq=2 \\
        --ring-strategy auto --append --reuse-ceilings --out runs/profile  # as trained
    python -m train.tools.profile --report-only runs/profile      # re-render report.json

For each model x context x mesh, one child process builds the trainer exactly as
`python -m train` does (`train.build.build`), compiles the step (not timed), runs
`--warmup` steps, times `--steps` steps with `block_until_ready` (latency, tokens/s,
TFLOP/s per device, MFU), then records a `jax.profiler` trace of `--trace-steps`
steps (one `StepTraceAnnotation("train")` each) into
`<out>/tensorboard/<model>-<ctx>-<mesh>/` and attributes it with `train.tools.trace`
(`<model>`: a preset's name in one spelling, `models.presets.preset_name`'s, or
`local-` and a local model directory's basename, made unique; the report's tables and
plots show it so, and say which directory each `local-` name is).
Attention over `seq` runs the trainer's `--ring_strategy ring` (the K/V ring, whose
transfers the report's ring GB/s measures) unless `--ring-strategy` names another (the
row's folder then names it after the mesh: `<model>-<ctx>-<mesh>-ulysses`); `auto`,
the trainer's default, picks Ulysses on one host where `seq` divides the query heads,
and each row records the strategy it ran.
A child per row keeps peak-memory numbers separate and turns an out-of-memory into
a "does not fit" row instead of a crash (also when the child dies of it rather than
raising); any other failure is an "error" row, and the report is still written.
`report.json` is rewritten (whole) after every row, so a run stopped from outside keeps
the rows it finished (`--report-only` then renders them); Ctrl-C, SIGTERM or SIGHUP ends
the running child's process group and exits with one line naming it (a child also ends
when the parent is killed outright, and the next run removes the temporary folder that
then stays: `remove_stale_temp`). The report (`report.json`,
`report.md`, PNG plots) is written by `train.tools.report`.

Command buffers: with them on (XLA's default on GPU) a trace shows CUDA graphs, not
kernels, and nothing can be attributed. XLA_FLAGS must be set before jax starts, so
run the attribution with `XLA_FLAGS=--xla_gpu_enable_command_buffer=`; the timed
latency is then also without command buffers (time headline numbers in a separate
run with them on if that matters).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

from models.config import REMAT_POLICIES
from models.presets import PRESET_NAMES, preset_name
from train import processes
from train.config import ModelArgs
from train.errors import STOP_SIGNALS, signals_as_interrupts, stop_status, stopped_how
from train.oom import is_oom
from train.tools.files import write_json

# jax (and everything that imports it) is imported inside the functions that run in a
# child process: the parent never initialises a backend, so each child can set its own
# XLA_FLAGS (simulated device count, command buffers) before jax starts.


# Recorded in each row, and rerun by --fill-xla-cost.
JOB_SETTINGS = ("shard_over_seq", "gather_once", "remat", "scan_layers", "batch")
# What a row records of the run it came from, beside JOB_SETTINGS: runs added with
# --append can differ in these, so the report says them per row.
ROW_FACTS = ("steps", "layers_override", "xla_cost", "ring_strategy", "xla_flags", "jax")
# The trainer's --ring_strategy a row runs unless --ring-strategy names another: the K/V
# ring, whose bytes and GB/s the report measures (the trainer's `auto` picks Ulysses on
# one host where the mesh's seq divides the heads).
RING_STRATEGY = "ring"


@dataclasses.dataclass(frozen=True)
class Job:
    """One report row: a model at a context length over a mesh."""

    model: str
    context: int
    mesh: str
    out: str
    layers: int | None = None
    steps: int = 3
    warmup: int = 2
    trace_steps: int = 2
    batch: int = 1
    remat: str = "save_attn"
    xla_cost: bool = True
    shard_over_seq: bool = False  # parameters and optimizer state also over `seq`
    gather_once: bool = False  # with shard_over_seq: weights gathered once per step
    scan_layers: bool = True  # False: unrolled layers (configs/llama3_2_1b_32k.yaml)
    label: str = ""  # the model in `name` (`model_labels`); empty: `model_label(model)`
    ring_strategy: str = RING_STRATEGY  # the trainer's --ring_strategy (`auto` included)

    @property
    def name(self) -> str:
        """`label-context-mesh`, plus what differs from the defaults (`--layers`,
        `--batch` and the trainer's settings, `--ring_strategy` first): one file name,
        used under `out` (the row's traces and trainer outputs)."""
        mesh = self.mesh.replace("=", "").replace(",", "-")
        suffix = "" if self.ring_strategy == RING_STRATEGY else f"-{self.ring_strategy}"
        suffix += "" if self.layers is None else f"-layers{self.layers}"
        suffix += "" if self.batch == 1 else f"-batch{self.batch}"
        suffix += "-shard_over_seq" if self.shard_over_seq else ""
        suffix += "-gather_once" if self.gather_once else ""
        suffix += "" if self.remat == "save_attn" else f"-{self.remat}"
        suffix += "" if self.scan_layers else "-unrolled"
        label = self.label or model_label(self.model)
        return f"{label}-{context_label(self.context)}-{mesh}{suffix}"

    def settings(self) -> dict:
        """What a row records of how it ran (and what `--fill-xla-cost` reruns)."""
        return {name: getattr(self, name) for name in JOB_SETTINGS}

    def facts(self) -> dict:
        """The row's steps (warm-up, timed, traced), `--layers`, whether XLA's cost was
        analysed and the trainer's `--ring_strategy` as given (the row's run replaces
        `auto` by the strategy the trainer picked): of `ROW_FACTS`, those the job knows
        (the parent adds the rest)."""
        steps = {"timed": self.steps, "warmup": self.warmup, "traced": self.trace_steps}
        return {
            "steps": steps,
            "layers_override": self.layers,
            "xla_cost": self.xla_cost,
            "ring_strategy": self.ring_strategy,
        }


# Before a local model directory's basename in its rows' names: no preset's name starts
# with it, so `local-llama3.2-1b-8k-seq2` is never taken for the preset's row.
LOCAL_LABEL = "local-"


def model_name(model: str) -> str:
    """`model` as rows record, name and match it: a local directory as given, a preset
    in its one spelling (`models.presets.preset_name`: `llama3_2_1b` and `Llama-3.2-1B`
    are `llama3.2-1b`), anything else as given (refused later as unknown)."""
    if os.path.isdir(model):
        return model
    try:
        return preset_name(model)
    except ValueError:
        return model


def model_label(model: str) -> str:
    """`model` as one file name: a preset's name, or `LOCAL_LABEL` and a local
    directory's basename, with anything but letters, digits, `.`, `_` and `-` replaced
    by `_`."""
    if not os.path.isdir(model):
        name = re.sub(r"[^A-Za-z0-9._-]", "_", model)
        return "model" if name in ("", ".", "..") else name
    name = re.sub(r"[^A-Za-z0-9._-]", "_", os.path.basename(os.path.abspath(model)))
    return LOCAL_LABEL + (name or "model")


def model_labels(models: list[str], taken: dict[str, str | None] | None = None) -> dict[str, str]:
    """Each model's label in its rows' names: the one `taken` gives it, else its
    `model_label`, made unique with `-2`, `-3`, ... where two models share one.
    `taken`: labels already in use (label -> model; None: by no model that may have it),
    e.g. an appended report's rows."""
    used = dict(taken or {})
    given = {model: label for label, model in used.items() if model is not None}
    labels: dict[str, str] = {}
    for model in models:
        if model in given:
            labels[model] = given[model]
            continue
        base = label = model_label(model)
        count = 2
        while used.get(label, model) != model:
            label, count = f"{base}-{count}", count + 1
        used[label], labels[model] = model, label
    return labels


def labelled(jobs: list[Job], old_rows: list[dict]) -> list[Job]:
    """`jobs` with their models' labels (`model_labels`): the ones `old_rows` (an
    appended report's) give their models, else new ones; no job shares its name with a
    job or old row of another model (an old row of the same name and model is the row
    it replaces). An old row's preset is matched in any spelling (`model_name`): a
    report written with `--models llama3_2_1b` has its rows replaced by `llama3.2-1b`'s."""

    def model(row: dict) -> str | None:
        if "model" not in row:
            return None
        label = row.get("label") or model_label(row["model"])
        return row["model"] if label.startswith(LOCAL_LABEL) else model_name(row["model"])

    taken: dict[str, str | None] = {
        r.get("label") or model_label(r["model"]): model(r) for r in old_rows if "model" in r
    }
    models = list(dict.fromkeys(job.model for job in jobs))
    while True:
        labels = model_labels(models, taken)
        named = [dataclasses.replace(job, label=labels[job.model]) for job in jobs]
        owners = {r["name"]: model(r) for r in old_rows if "name" in r}
        clashes = [
            job.label for job in named if owners.setdefault(job.name, job.model) != job.model
        ]
        if not clashes:
            return named
        taken.update(dict.fromkeys(clashes))  # no model takes these labels again


def parse_context(text: str) -> int:
    """`"8k"` -> 8192, `"512"` -> 512; a ValueError naming the entry if it is not a
    positive int or <int>k."""
    text = text.strip().lower()
    try:
        tokens = int(text[:-1]) * 1024 if text.endswith("k") else int(text)
    except ValueError:
        raise ValueError(f"--context entry {text!r} is not an int or <int>k") from None
    if tokens < 1:
        raise ValueError(f"--context entry {text!r} must be >= 1 token")
    return tokens


def read_report(path: str) -> dict:
    """`path` (a report.json) as a dict with `rows`; a ValueError naming the file if it
    is missing, not JSON, or not a profile report."""
    try:
        with open(path) as f:
            report = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path!r} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path!r} is not readable JSON ({e})") from None
    if not isinstance(report, dict) or not isinstance(report.get("rows"), list):
        raise ValueError(f"{path!r} is not a profile report (no list of 'rows')")
    for i, row in enumerate(report["rows"]):
        if not isinstance(row, dict):
            raise ValueError(f"{path!r}: row {i} is not an object")
        for key, kinds in ROW_FIELD_TYPES.items():
            value = row.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, kinds)):
                kind = "text" if kinds is str else "a number"
                raise ValueError(f"{path!r}: row {i}'s {key} {json.dumps(value)} is not {kind}")
        if isinstance(row.get("context"), int) and row["context"] < 1:
            raise ValueError(f"{path!r}: row {i}'s context {row['context']} is not a length")
    return report


NUMBER = (int, float)
# The fields of a report row the tables and figures compute with, by type (None: unknown).
ROW_FIELD_TYPES = {
    **{k: str for k in ("name", "model", "label", "mesh", "status", "remat")},
    "context": int,
    **{
        k: NUMBER
        for k in (
            "batch",
            "devices",
            "tokens_per_step",
            "compile_s",
            "step_ms",
            "tokens_per_s",
            "tflops_per_device",
            "mfu",
            "peak_memory_gib",
            "memory_limit_gib",
        )
    },
}


def with_row_facts(report: dict) -> dict:
    """`report` with `ROW_FACTS` in every row: a report.json written before rows
    recorded them has them once, for all its rows (its last run's values). Appending
    to it then leaves its rows' facts as they were."""
    shared = {key: report[key] for key in ROW_FACTS if key in report}
    rows = [{**shared, **row} for row in report["rows"]]
    return {**{k: v for k, v in report.items() if k not in ROW_FACTS}, "rows": rows}


def context_label(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


# ----------------------------------------------------------------------------------
# Child process: one row, or the ceilings


def _sample_rows(job: Job) -> int:
    """Rows of sample data a row's trainer makes: one step's (per-device batch x data x
    fsdp; a -1 axis takes the devices the others leave), and at least 8. Whether the
    mesh fits this machine is checked elsewhere (`mesh_error`)."""
    import math

    import jax

    from train.mesh import mesh_sizes

    sizes = {"data": 1, "fsdp": 1, **mesh_sizes(job.mesh)}
    fixed = math.prod(v for v in sizes.values() if v != -1)
    rest = max(jax.device_count() // fixed, 1)
    data, fsdp = (rest if sizes[a] == -1 else sizes[a] for a in ("data", "fsdp"))
    return max(8, job.batch * data * fsdp)


def _trainer_args(job: Job) -> list[str]:
    return [
        "--model_name_or_path",
        job.model,
        "--model_max_length",
        str(job.context),
        "--mesh",
        job.mesh,
        "--attention",
        "ring",
        "--ring_strategy",
        job.ring_strategy,
        "--remat_policy",
        job.remat,
        "--per_device_train_batch_size",
        str(job.batch),
        "--data_path",
        "sample",
        "--sample_num_examples",
        str(_sample_rows(job)),
        "--max_steps",
        str(job.warmup + job.steps + job.trace_steps),
        "--save_strategy",
        "no",
        "--export_hf",
        "false",
        "--progress",
        "false",
        "--output_dir",
        os.path.join(job.out, "work", job.name),
        "--shard_over_seq",
        str(job.shard_over_seq).lower(),
        "--gather_once",
        str(job.gather_once).lower(),
        "--scan_layers",
        str(job.scan_layers).lower(),
    ]


def _xla_cost(cfg, config, devices) -> dict | None:
    """XLA's FLOPs and bytes per device per step, with every layer counted.

    XLA's cost analysis counts a while-loop body once, so the scanned step
    undercounts; unrolled 1- and 2-layer variants of the trainer's step
    (`train.build.plan_step`: abstract state, compiled, never run) give the cost
    outside the layers and per layer, extrapolated to `config.num_layers`.
    """
    import jax

    from train.build import plan_step

    costs = []
    for layers in (1, 2):
        small = config.replace(num_layers=layers, scan_layers=False)
        plan = plan_step(cfg, small, devices=devices)
        global_batch = cfg.run.per_device_train_batch_size * plan.sizes["data"] * plan.sizes["fsdp"]
        batch = plan.abstract_batch(
            global_batch, cfg.run.gradient_accumulation_steps, cfg.data.model_max_length
        )
        with jax.set_mesh(plan.mesh):
            compiled = plan.step_fn.lower(plan.abstract_state, batch).compile()
        analysis = compiled.cost_analysis()
        analysis = analysis[0] if isinstance(analysis, list | tuple) else analysis
        if not analysis or "bytes accessed" not in analysis:
            return None
        costs.append((analysis.get("flops", 0.0), analysis["bytes accessed"]))
    from train.words import plural

    (f1, b1), (f2, b2) = costs
    n = config.num_layers
    return {
        "flops": f1 + (n - 1) * (f2 - f1),
        "bytes": b1 + (n - 1) * (b2 - b1),
        "method": "XLA cost analysis of unrolled 1- and 2-layer steps, extrapolated "
        f"to {plural(n, 'layer')} (Pallas kernels count only their operands)",
    }


def run_xla_cost(job: Job) -> dict:
    """XLA's cost of one row's step, compiled and never run: fills the HBM column of a
    row that was timed with `--no-xla-cost`."""
    import jax

    from train.build import load_model
    from train.config import parse_args
    from train.mesh import mesh_device_count

    cfg = parse_args(_trainer_args(job))
    config = load_model(cfg)[0]
    if job.layers:
        config = config.replace(num_layers=job.layers)
    devices = jax.devices()[: mesh_device_count(job.mesh, jax.device_count())]
    return {"xla": _xla_cost(cfg, config, devices)}


def _with_xla(row: dict, xla: dict | None) -> None:
    """Puts XLA's bytes into a timed row: HBM GB/s and the step's intensity."""
    row["xla"] = xla
    if xla is None:
        return
    step_s = row["step_ms"] / 1e3
    row["hbm_gbps"] = xla["bytes"] / step_s / 1e9
    model_flops = row["tflops_per_device"] * 1e12 * step_s  # per device per step
    row.setdefault("intensity", {})["step"] = {
        "flops": model_flops,
        "bytes": xla["bytes"],
        "intensity": model_flops / xla["bytes"],
        "tflops": row["tflops_per_device"],
    }


def _memory(devices) -> dict:
    peaks, limits = [], []
    for d in devices:
        stats = d.memory_stats() or {}
        if "peak_bytes_in_use" in stats:
            peaks.append(stats["peak_bytes_in_use"])
        if "bytes_limit" in stats:
            limits.append(stats["bytes_limit"])
    return {
        "peak_memory_gib": max(peaks) / 2**30 if peaks else None,
        "memory_limit_gib": min(limits) / 2**30 if limits else None,
    }


def _not_measured(row: dict, devices) -> dict[str, str]:
    """Why the row's MFU or peak memory is None: what the device does not report."""
    from train.tools.report import UNREPORTED, unreported_reason

    device = devices[0]
    stats = bool(device.memory_stats())
    return {
        field: unreported_reason(field, device.device_kind, device.platform, stats)
        for field in UNREPORTED
        if row.get(field) is None
    }


def ring_unmeasured(
    strategy: str, seq: int, permute_ms: float, permute_bytes: float | None
) -> str | None:
    """Why a row run with `--ring_strategy strategy` over `seq` devices on the `seq`
    axis has no ring GB/s, in one line, or None where its traced steps' collective-permutes
    (`permute_ms`, `permute_bytes`) measure the K/V ring."""
    from train.tools.report import NO_KV_RING, STRATEGY_TEXT

    if strategy in NO_KV_RING:
        return (
            f"`--ring_strategy {strategy}` passes no K/V blocks between the devices on "
            f"`seq` (it splits attention by {STRATEGY_TEXT[strategy]}): no ring transfers"
        )
    if permute_ms > 0 and permute_bytes is None:
        return "collective-permutes ran, but their bytes are unknown (no HLO for the step)"
    if permute_ms > 0:
        return None
    if seq == 1:
        return (
            f"one device on `seq`: no ring transfers (`--ring_strategy {strategy}` passes "
            "K/V blocks between the devices on `seq`)"
        )
    return (
        f"no collective-permute in the traced steps, with {seq} devices on `seq` and "
        f"`--ring_strategy {strategy}`"
    )


def run_row(job: Job) -> dict:
    """Builds, compiles, times and traces one row (in this process)."""
    import jax

    from train.build import build, load_model
    from train.config import parse_args
    from train.mesh import mesh_device_count
    from train.metrics import compiled_bytes, throughput
    from train.tools import trace as trace_lib
    from train.tools.hlo import parse_hlo
    from train.tools.roofline import attention_work, matmul_work
    from train.xla_flags import NO_COMMAND_BUFFERS, command_buffers_on

    row: dict = {"name": job.name, "model": job.model, "context": job.context, "mesh": job.mesh}
    row.update(job.settings())
    row["warnings"] = []
    cfg = parse_args(_trainer_args(job))
    config = load_model(cfg)[0]
    row["layers_preset"] = config.num_layers
    if job.layers:
        config = config.replace(num_layers=job.layers)
    row["layers"] = config.num_layers
    n = mesh_device_count(job.mesh, jax.device_count())
    devices = jax.devices()[:n]
    row["devices"] = n
    try:
        t = build(cfg, config, devices=devices)
        row["ring_strategy"] = strategy = t.cfg.model.ring_strategy  # `auto`: the pick
        row["mesh_sizes"] = t.sizes
        tokens = t.global_batch * t.accum * job.context
        row["tokens_per_step"] = tokens
        with jax.set_mesh(t.mesh):
            batches = [t.batch(i) for i in range(2)]
            start = time.perf_counter()
            compiled = t.step_fn.lower(t.state, batches[0]).compile()
            row["compile_s"] = time.perf_counter() - start
            used = compiled_bytes(compiled)
            if used is not None:
                row["compiler_memory_gib"] = used / 2**30
            state, t.state = t.state, None
            for i in range(job.warmup):
                state, metrics = compiled(state, batches[i % 2])
            jax.block_until_ready((state, metrics) if job.warmup else state)
            start = time.perf_counter()
            for i in range(job.steps):
                state, metrics = compiled(state, batches[i % 2])
            jax.block_until_ready((state, metrics))
            seconds = time.perf_counter() - start
            row["step_ms"] = seconds / job.steps * 1e3
            row.update(throughput(tokens * job.steps, seconds, t.flops_token, n))
            row.setdefault("mfu", None)
            row.update(_memory(devices))
            row["not_measured"] = _not_measured(row, devices)

            trace_dir = os.path.join(job.out, "tensorboard", job.name)
            first = job.warmup + job.steps + 1  # the step lines' numbering: from 1
            # On CPU a step's thunks are matched to the annotation during which the step
            # started running, not the one that dispatched it: each traced step waits
            # for the previous one (as the trainer's steps do), or a step dispatched
            # ahead would be counted in the next one's window. GPU kernels carry their
            # launch's time, and a wait would only add host gaps between the windows.
            sync = devices[0].platform == "cpu"
            jax.profiler.start_trace(trace_dir)
            try:
                for i in range(job.trace_steps):
                    with jax.profiler.StepTraceAnnotation("train", step_num=first + i):
                        state, metrics = compiled(state, batches[i % 2])
                    if sync:
                        jax.block_until_ready((state, metrics))
                jax.block_until_ready((state, metrics))
            finally:
                jax.profiler.stop_trace()
            xla = _xla_cost(cfg, config, devices) if job.xla_cost else None
    except Exception as e:  # noqa: BLE001 - an OOM is a row; anything else is re-raised
        if not is_oom(e):
            raise
        row.update(status="does not fit", error=_oom_line(str(e))[:300])
        return row
    row["status"] = "ok"
    data = trace_lib.load(trace_dir)  # parsed once for both readings below
    hlo = parse_hlo(compiled.as_text())
    report = trace_lib.parse(data, hlo=hlo)
    row["trace_dir"] = os.path.relpath(trace_dir, job.out)
    row["trace"] = report.to_dict()
    row["top_kernels"] = trace_lib.top_kernels(data, n=10, steps=job.trace_steps, hlo=hlo)
    row["top_update_kernels"] = trace_lib.top_kernels(
        data, n=8, steps=job.trace_steps, phase="update", hlo=hlo
    )
    row["kernel_spread"] = trace_lib.kernel_spread(data, n=8, steps=job.trace_steps)
    row["top_other_scopes"] = trace_lib.top_scopes(data, n=12, steps=job.trace_steps, hlo=hlo)
    phases = report.mean
    row["trace_vs_timed"] = phases.step_ms / row["step_ms"]
    if report.platform == "gpu" and report.named_fraction < 0.5:
        if command_buffers_on():
            row["warnings"].append(
                f"only {report.named_fraction:.0%} of kernel time has a name stack and "
                f"command buffers are on: rerun with XLA_FLAGS={NO_COMMAND_BUFFERS}"
            )
    per_device_tokens = tokens / n
    if why := ring_unmeasured(strategy, t.sizes["seq"], phases.permute_ms, phases.permute_bytes):
        row.setdefault("not_measured", {})["ring"] = why
    else:
        row["ring"] = {
            "bytes_per_step": phases.permute_bytes,
            "permute_ms": phases.permute_ms,
            "gbps": phases.permute_bytes / (phases.permute_ms / 1e3) / 1e9,
        }
    seq_shards = t.sizes["seq"] * t.sizes["seq_a2a"]
    sequences = t.global_batch * t.accum // (t.sizes["data"] * t.sizes["fsdp"])
    attn = attention_work(config, job.context, seq_shards, sequences)
    mm = matmul_work(config, per_device_tokens)

    def point(flops, moved, ms):
        rate = flops / (ms / 1e3) / 1e12 if ms else None
        return {"flops": flops, "bytes": moved, "intensity": flops / moved, "tflops": rate}

    row["intensity"] = {
        "step": None,
        "attention": point(attn.flops, attn.bytes, phases.attention_ms),
        "matmul": point(mm.flops, mm.bytes, phases.matmul_ms),
    }
    _with_xla(row, xla)
    row["platform"] = report.platform
    row["device_kind"] = devices[0].device_kind
    return row


def run_ceilings() -> dict:
    """The roofline's ceilings, measured on this machine's first device, and its device
    count (recorded in the report)."""
    import jax

    from train.tools.roofline import measure_ceilings

    return {**dataclasses.asdict(measure_ceilings()), "device_count": jax.device_count()}


def run_devices() -> dict:
    """This machine's devices, for the parent, which never starts a backend: how many
    (to refuse a mesh it cannot build before anything else runs), their platform and
    their kind (whose ceilings `--reuse-ceilings` may reuse)."""
    import jax

    return {
        "device_count": jax.device_count(),
        "platform": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
    }


# ----------------------------------------------------------------------------------
# Parent: jobs in child processes, then the report


def _oom_line(text: str) -> str:
    """The first line of `text` that says memory ran out (else its first line)."""
    lines = text.strip().splitlines() or [""]
    return next((x.strip() for x in lines if is_oom(x)), lines[0])


def failed_child(returncode: int, stdout: str, stderr: str) -> dict:
    """The row of a child that exited without a result.

    The whole output is searched for an out-of-memory message, not just its end: XLA
    follows one with a long buffer-assignment dump, and a CUDA abort with a stack
    trace. An out-of-memory is "does not fit"; anything else (a crash, a kill by the
    host's OOM killer, a bug) is "error": the last unindented line of stderr first
    (a Python traceback's exception), then the output's tail.
    """
    text = "\n".join(x for x in (stderr, stdout) if x)
    tail = "\n".join(text.strip().splitlines()[-8:])[-1500:]
    # Said first, so the report's one-line detail names the cause, not a stack frame.
    lines = (stderr or stdout or "").strip().splitlines()
    cause = next((x for x in reversed(lines) if x.strip() and not x[0].isspace()), "")
    if returncode < 0:
        how = f"killed by signal {-returncode}"
    else:
        how = f"exited with code {returncode}"
    line = _oom_line(text)
    if is_oom(line):
        return {"status": "does not fit", "error": f"{line[:300]} ({how})"}
    if not tail:
        return {"status": "error", "error": how}
    if not cause or cause == tail:
        return {"status": "error", "error": f"{how}: {tail}"}
    return {"status": "error", "error": f"{how}: {cause}\n{tail}"}


def _end(proc: subprocess.Popen) -> None:
    """Ends a worker and whatever it started (its own process group: SIGTERM, then
    SIGKILL after 5 s), and reaps it. A second Ctrl-C, SIGTERM or SIGHUP waits until it
    is done."""
    from train.outputs import signals_held

    with signals_held(reraise=False, signals=(signal.SIGINT, *STOP_SIGNALS)):
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=5)
                break
            except subprocess.TimeoutExpired:
                continue
        proc.communicate()


def _prctl():
    """libc's `prctl`, on Linux (None elsewhere, or where it cannot be loaded)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


PR_SET_PDEATHSIG = 1
PARENT_ENV = "JFLASH_PROFILE_PARENT"  # the pid of the tool that started a worker


def _die_with_parent() -> None:
    """In a worker: SIGTERM when the tool that started it dies, however it dies (SIGKILL
    included: the worker is in its own process group, so nothing else would reach it).
    Linux only. Set here rather than in a `preexec_fn`, which runs Python in the forked
    child before `exec` (unsafe in a process with threads, as jax's); a parent that died
    before this ran is caught by the check after it."""
    parent = os.environ.pop(PARENT_ENV, None)
    prctl = _prctl() if parent else None
    if prctl is None:
        return
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(parent):
        os.kill(os.getpid(), signal.SIGTERM)


# A worker's temporary folder: `<TMPDIR>/jflash-profile-*`, holding OWNER_FILE, which
# names this tool and the processes that use the folder (the tool, then its worker).
TEMP_PREFIX = "jflash-profile-"
OWNER_FILE = "owner.json"
OWNER_TOOL = "train.tools.profile"


def _write_owner(folder: str, pids: list[int]) -> None:
    """Records in `folder` (whole, through a .tmp) that this tool and `pids` use it."""
    owner = {"tool": OWNER_TOOL, "processes": [processes.record(pid) for pid in pids]}
    path = os.path.join(folder, OWNER_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(owner, f)
    os.replace(path + ".tmp", path)


def remove_stale_temp(root: str | None = None) -> list[str]:
    """Removes the temporary folders that runs of this tool left behind (a tool killed
    outright, SIGKILL, cannot remove its worker's folder); the folders removed. Only a
    folder that is provably one of them goes: under `root` (default: the temporary
    directory, `$TMPDIR`), named `TEMP_PREFIX*`, a directory (not a link) this user
    owns, holding an OWNER_FILE of this tool, every process of which has ended. Anything
    else, and a folder that cannot be read or removed, is left as it is."""
    import shutil

    root = root or tempfile.gettempdir()
    try:
        entries = list(os.scandir(root))
    except OSError:
        return []
    removed = []
    for entry in entries:
        try:
            if not (
                entry.name.startswith(TEMP_PREFIX)
                and entry.is_dir(follow_symlinks=False)
                and entry.stat(follow_symlinks=False).st_uid == os.getuid()
            ):
                continue
            with open(os.path.join(entry.path, OWNER_FILE)) as f:
                owner = json.load(f)
        except (OSError, ValueError):
            continue
        if not isinstance(owner, dict) or owner.get("tool") != OWNER_TOOL:
            continue
        owners = owner.get("processes")
        if not isinstance(owners, list) or not owners or any(map(processes.runs, owners)):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        if not os.path.lexists(entry.path):
            removed.append(entry.path)
    return removed


# How a worker's error says it ran out of time (`timed_out`).
TIMED_OUT = "timed out after"


# The longest finite --timeout (about 31 years): past it Python's waits overflow.
MAX_TIMEOUT = 1e9


def timed_out(timeout: float) -> str:
    """What a worker ended after `timeout` seconds says: the limit, the flag that set it
    (every worker runs under `--timeout`) and what to do."""
    seconds = f"{timeout:.0f}" if float(timeout).is_integer() else f"{timeout:g}"
    return f"{TIMED_OUT} {seconds} s (--timeout {seconds}; raise it)"


def failed(what: str, result: dict) -> str:
    """The line saying that `what` (`counting the devices`) failed: a worker's result
    (`_child`) without what it was run for."""
    first = str(result.get("error", "no result")).split("\n")[0]
    return f"{what} {first}" if first.startswith(TIMED_OUT) else f"{what} failed ({first})"


def _child(kind: str, payload: dict, timeout: float, what: str) -> dict:
    """Runs one worker (`--worker kind`) in its own process group; its result, or the
    row of a worker that failed. `what` names it in the line a Ctrl-C, SIGTERM or SIGHUP
    ends the parent with: the worker is ended first, never left running, and its
    temporary folder is removed (a worker whose parent is killed outright ends too:
    `_die_with_parent`; its folder, which names both in its OWNER_FILE, is removed by
    the tool's next run, `remove_stale_temp`)."""
    with tempfile.TemporaryDirectory(prefix=TEMP_PREFIX) as tmp:
        _write_owner(tmp, [os.getpid()])
        job_path, out_path = os.path.join(tmp, "job.json"), os.path.join(tmp, "out.json")
        with open(job_path, "w") as f:
            json.dump(payload, f)
        cmd = [sys.executable, "-m", "train.tools.profile", "--worker", kind, job_path, out_path]
        pipe = subprocess.PIPE
        env = {**os.environ, PARENT_ENV: str(os.getpid())}
        proc = subprocess.Popen(
            cmd, stdout=pipe, stderr=pipe, text=True, start_new_session=True, env=env
        )
        try:
            with contextlib.suppress(OSError):  # a failed write keeps the record above
                _write_owner(tmp, [os.getpid(), proc.pid])
            stdout, stderr = proc.communicate(timeout=None if timeout == math.inf else timeout)
        except subprocess.TimeoutExpired:
            _end(proc)
            return {"status": "error", "error": timed_out(timeout)}
        except KeyboardInterrupt as e:
            _end(proc)
            e.add_note(f"the worker ({what}) was ended")
            raise
        if proc.returncode != 0 or not os.path.exists(out_path):
            return failed_child(proc.returncode, stdout, stderr)
        with open(out_path) as f:
            return json.load(f)


def stop_line(error: KeyboardInterrupt, report_path: str) -> str:
    """The line a Ctrl-C, SIGTERM or SIGHUP ends the tool with: which worker was ended,
    and what report.json holds."""
    how = stopped_how(error)
    ended = "; ".join(getattr(error, "__notes__", [])) or "no worker was running"
    if os.path.exists(report_path):
        return f"{how}: {ended}; {report_path} holds the rows finished before"
    return f"{how}: {ended}; no row had finished"


def _worker(kind: str, job_path: str, out_path: str) -> None:
    with open(job_path) as f:
        payload = json.load(f)
    if kind == "ceilings":
        result = run_ceilings()
    elif kind == "devices":
        result = run_devices()
    elif kind == "xla_cost":
        result = run_xla_cost(Job(**payload))
    else:
        result = run_row(Job(**payload))
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1, default=str)


def rows_without_xla(report: dict) -> list[dict]:
    """The timed rows that have no XLA cost: what `--fill-xla-cost` compiles."""
    return [r for r in report["rows"] if r.get("status") == "ok" and not r.get("xla")]


def this_machine(timeout: float) -> dict:
    """This machine's devices (`run_devices`: `device_count`, `platform`,
    `device_kind`), from one child process (the parent never starts a backend) run under
    `--timeout` as the rows are (it starts the backend every row starts, and does less);
    a ValueError with the child's first line where it fails (`failed`)."""
    result = _child("devices", {}, timeout, "counting the devices")
    if "device_count" not in result:
        raise ValueError(failed("counting the devices", result))
    return result


def device_error(what: str, recorded: str | None, machine: dict) -> str | None:
    """Why `what` (`the ceilings in X were measured`), done on devices of kind `recorded`,
    cannot be used on this machine (`this_machine`) in one phrase naming both kinds, or
    None where they are the same kind."""
    if recorded == machine["device_kind"]:
        return None
    return (
        f"{what} on {recorded or 'an unrecorded device'}, this machine's devices are "
        f"{machine['device_kind']}"
    )


def layout_error(job: Job, available: int) -> str | None:
    """Why the trainer would refuse `job`'s context on its mesh (`train.build.check_layout`:
    a length the sequence axes cannot split, `seq_a2a` without the hybrid strategy), in
    one line, or None: checked before the ceilings run, not as an error row after. With
    `--ring-strategy auto`, the strategy the trainer would pick is as strict as `ring`
    (`hybrid` where the mesh has `seq_a2a`)."""
    from train.build import check_layout
    from train.config import DataArgs, ModelArgs, TrainConfig
    from train.errors import TrainingError
    from train.mesh import mesh_device_count, parse_mesh

    sizes = parse_mesh(job.mesh, mesh_device_count(job.mesh, available))
    strategy = job.ring_strategy
    if strategy == "auto":
        strategy = "hybrid" if sizes["seq_a2a"] > 1 else "ring"
    cfg = TrainConfig(
        model=ModelArgs(attention="ring", ring_strategy=strategy),
        data=DataArgs(model_max_length=job.context),
    )
    try:
        check_layout(cfg, sizes)
    except TrainingError as e:
        return (
            str(e)
            .replace("--ring_strategy", "--ring-strategy")
            .replace("--model_max_length", "--context")
        )
    return None


def mesh_error(mesh: str, available: int | None = None, platform: str = "") -> str | None:
    """Why `mesh` cannot run here, in one line, or None: a malformed spec or an unknown
    axis (checked without devices when `available` is None), or more devices than
    `available` (on `platform` "cpu", with how to simulate them)."""
    from train.mesh import mesh_device_count, mesh_sizes, parse_mesh

    try:
        sizes = mesh_sizes(mesh)
    except ValueError as e:
        return str(e)
    if not sizes:
        return f"--mesh {mesh!r} names no axis (data, fsdp, seq, seq_a2a): give one, e.g. seq=1"
    if available is None:
        return None
    try:
        parse_mesh(mesh, mesh_device_count(mesh, available, platform))
    except ValueError as e:
        return str(e)
    return None


def fill_xla_cost(out: str, report: dict, timeout: float, filled: dict) -> None:
    """`--fill-xla-cost`: XLA's cost for every timed row of `report` (`out`'s
    report.json) without it, one child each. `filled` (`command`, `date`, `device`: how,
    when and where the cost was computed) goes into each row's `xla` as `filled`: its
    HBM GB/s and step intensity were filled in after the row was timed."""
    from train.tools import report as report_lib

    path = os.path.join(out, "report.json")
    for row in rows_without_xla(report):
        layers = row.get("layers")
        job = Job(
            model=row["model"],
            context=row["context"],
            mesh=row["mesh"],
            out=os.path.abspath(out),
            layers=row.get(
                "layers_override", None if layers == row.get("layers_preset") else layers
            ),
            label=row.get("label", ""),
            # the strategy the row ran (`auto`: the one the trainer picked)
            ring_strategy=row.get("ring_strategy") or RING_STRATEGY,
            **{name: row[name] for name in JOB_SETTINGS if name in row},
        )
        print(f"{row['name']}: XLA cost ...", flush=True)
        result = _child("xla_cost", dataclasses.asdict(job), timeout, f"XLA cost of {row['name']}")
        if result.get("status") == "error" or "xla" not in result:
            first = str(result.get("error", result)).split("\n")[0]
            print(f"  failed: {first}", file=sys.stderr, flush=True)
            continue
        xla = result["xla"] and {**result["xla"], "filled": filled}
        _with_xla(row, xla)
        if row.get("hbm_gbps") is not None:
            print(f"  {report_lib.significant(row['hbm_gbps'])} GB/s", flush=True)
        # a run stopped from outside keeps the rows it filled
        write_json(path, report, "--fill-xla-cost")
    report_lib.render(report, out, "--fill-xla-cost")
    print(f"wrote {os.path.join(out, 'report.md')}")


def build_parser() -> argparse.ArgumentParser:
    from train.config import CHOICES, OneLineParser  # errors in one line, as the trainer's

    # The docstring's first paragraph: one sentence.
    description = " ".join(__doc__.split("\n\n")[0].split())
    p = OneLineParser(prog="python -m train.tools.profile", description=description)
    p.add_argument(
        "--models",
        default="llama3.2-1b",
        help="comma-separated models: presets (llama3.2-1b, llama2-7b, tiny, ...: "
        "models.presets) or local HF model folders (default: %(default)s)",
    )
    p.add_argument(
        "--context",
        default="8k",
        help="comma-separated context lengths in tokens: 8k,16k,32k (default: %(default)s)",
    )
    p.add_argument(
        "--mesh",
        action="append",
        help="mesh spec, repeatable (default seq=2); uses the first N devices it names",
    )
    p.add_argument("--layers", type=int, default=None, help="override every model's layers")
    p.add_argument(
        "--steps",
        type=int,
        default=3,
        help="timed steps, after the warm-up: latency, tokens/s, TFLOP/s and MFU (steps "
        "count from 1 in each row, as the trainer's step lines do: with the defaults, "
        "steps 3..5; default: %(default)s)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="untimed steps after compiling (with the defaults, steps 1..2; default: %(default)s)",
    )
    p.add_argument(
        "--trace-steps",
        type=int,
        default=2,
        help="profiled steps after the timed ones, slower under the profiler and not timed; "
        "the trace's step numbers (with the defaults, steps 6..7; default: %(default)s)",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=1,
        help="sequences per data-parallel rank (default: %(default)s)",
    )
    p.add_argument(
        "--remat",
        default=ModelArgs.remat_policy,
        choices=REMAT_POLICIES,
        help="the trainer's --remat_policy (default: %(default)s)",
    )
    p.add_argument(
        "--ring-strategy",
        default=RING_STRATEGY,
        choices=CHOICES[("model", "ring_strategy")],
        help="the trainer's --ring_strategy: how attention is split over seq; ring GB/s "
        "measures the K/V ring's transfers (ring, and hybrid on seq), which ulysses and "
        "allgather do not make; auto, the trainer's default, is recorded in each row as the "
        "strategy it picked (default: %(default)s)",
    )
    p.add_argument(
        "--no-xla-cost", action="store_true", help="skip the 1-/2-layer compiles (HBM GB/s)"
    )
    p.add_argument(
        "--shard-over-seq",
        action="store_true",
        help="also shard parameters, gradients and optimizer state over the seq axis "
        "(the trainer's --shard_over_seq; a 7B on 2 GPUs needs it)",
    )
    p.add_argument(
        "--gather-once",
        action="store_true",
        help="with --shard-over-seq: gather the weights over seq once per step (the "
        "trainer's --gather_once)",
    )
    p.add_argument(
        "--unroll-layers",
        action="store_true",
        help="the trainer's --scan_layers false (as configs/llama3_2_1b_32k.yaml)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=1800,
        help="seconds each worker process may run: each row (each row's compile with "
        "--fill-xla-cost), and the device count and ceilings measured before the rows; "
        "inf: no limit (default: %(default)s)",
    )
    p.add_argument(
        "--out",
        default="runs/profile",
        help="the report, its plots, the rows' traces and the trainer's outputs go here "
        "(default: %(default)s)",
    )
    p.add_argument("--report-only", metavar="DIR", help="re-render DIR/report.json")
    p.add_argument(
        "--fill-xla-cost",
        metavar="DIR",
        help="compute XLA's bytes (HBM GB/s) for the rows of DIR/report.json timed with "
        "--no-xla-cost (compiles only; refused on another kind of device than the rows' "
        "own), then re-render",
    )
    p.add_argument(
        "--append",
        action="store_true",
        help="keep the rows of an existing <out>/report.json (a same-name row is replaced, "
        "and its trace once the new row has succeeded)",
    )
    p.add_argument(
        "--reuse-ceilings",
        action="store_true",
        help="with --append: keep the existing report's measured ceilings instead of "
        "measuring them again (same machine, measured earlier the same day; refused where "
        "they were measured on another kind of device)",
    )
    p.add_argument("--worker", nargs=3, metavar=("KIND", "JOB", "OUT"), help=argparse.SUPPRESS)
    return p


def _known(model: str) -> bool:
    """Whether a row's model exists: a local HF directory (one holding a config.json)
    or a preset's name."""
    if os.path.isdir(model):
        return os.path.isfile(os.path.join(model, "config.json"))
    try:
        preset_name(model)
    except ValueError:
        return False
    return True


# The modes that make no rows, and the flags each reads besides its own: any other flag
# given with one is refused (it would be ignored).
MODE_FLAGS = {"report_only": (), "fill_xla_cost": ("timeout",)}


def _given(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """The flags on the command line (by their `dest`), in the parser's order."""
    probe = build_parser()
    for action in probe._actions:
        action.default = argparse.SUPPRESS
    given = vars(probe.parse_args(argv))
    return [a.dest for a in parser._actions if a.dest in given]


def _flag(parser: argparse.ArgumentParser, dest: str) -> str:
    return next(a.option_strings[-1] for a in parser._actions if a.dest == dest)


def _check_modes(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """Refuses, in one line, a flag given with a mode that does not read it
    (`--report-only DIR --models x`)."""
    given = _given(parser, argv)
    for mode, reads in MODE_FLAGS.items():
        if mode in given:
            other = [_flag(parser, d) for d in given if d != mode and d not in reads]
            if other:
                but = f" but {', '.join(_flag(parser, d) for d in reads)}" if reads else ""
                parser.error(
                    f"{_flag(parser, mode)} takes no other flag{but} (it makes no rows): "
                    f"{', '.join(other)} given"
                )


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses a bad flag value in one line naming it."""
    if args.steps < 1 or args.trace_steps < 1 or args.warmup < 0:
        parser.error(
            f"need --steps={args.steps} >= 1, --trace-steps={args.trace_steps} >= 1 "
            f"and --warmup={args.warmup} >= 0"
        )
    if args.layers is not None and args.layers < 1:
        parser.error(f"--layers={args.layers} must be >= 1")
    if args.batch < 1:
        parser.error(f"--batch={args.batch} must be >= 1")
    if not (0 < args.timeout <= MAX_TIMEOUT or args.timeout == math.inf):
        parser.error(
            f"--timeout={args.timeout} must be > 0 and at most {MAX_TIMEOUT:.0e} seconds, "
            "or inf for no limit"
        )
    from train.config import gather_once_error

    if error := gather_once_error(args.shard_over_seq, args.gather_once, dashes=True):
        parser.error(error)
    if args.reuse_ceilings and not args.append:
        parser.error(
            "--reuse-ceilings needs --append: it reuses the ceilings of the report the rows "
            "are appended to"
        )


def _report_only(parser: argparse.ArgumentParser, directory: str) -> None:
    """`--report-only DIR`: re-renders DIR/report.json."""
    from train.tools import report as report_lib

    path = os.path.join(directory, "report.json")
    if not os.path.isfile(path):
        parser.error(f"--report-only={directory!r}: no report.json there")
    try:
        report = read_report(path)
    except ValueError as e:
        parser.error(f"--report-only: {e}")
    try:
        report_lib.render(report, directory, "--report-only")
    except (KeyError, TypeError, ValueError) as e:
        what = f"field {e.args[0]!r} missing" if isinstance(e, KeyError) else str(e)
        parser.error(f"--report-only: {path!r} is not a whole profile report ({what})")
    print(f"wrote {os.path.join(directory, 'report.md')}")


def _fill(parser: argparse.ArgumentParser, directory: str, timeout: float, command: str) -> None:
    """`--fill-xla-cost DIR`, after refusing a row whose mesh this machine cannot build
    or that was timed on another kind of device than this machine's (its bytes, compiled
    here, would be divided by a step timed there). `command`: the command line, recorded
    in the rows it fills."""
    path = os.path.join(directory, "report.json")
    try:
        report = read_report(path)
        todo = rows_without_xla(report)
        machine = this_machine(timeout) if todo else {}
    except ValueError as e:
        parser.error(f"--fill-xla-cost: {e}")
    for row in todo:
        if error := mesh_error(row["mesh"], machine["device_count"], machine["platform"]):
            parser.error(f"--fill-xla-cost: row {row['name']!r}: {error} (nothing was run)")
        timed = f"row {row['name']!r} in {path} was timed"
        if error := device_error(timed, row.get("device_kind"), machine):
            parser.error(
                f"--fill-xla-cost: {error}: fill it in on the kind of device it was timed on "
                "(nothing was run)"
            )
    if not todo:
        print(f"--fill-xla-cost: every row of {path} has XLA's cost already: nothing to fill")
    filled = {
        "command": command,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "device": machine.get("device_kind"),
    }
    fill_xla_cost(directory, report, timeout, filled)


def canonical_mesh(spec: str) -> str:
    """A well-formed `--mesh` spec in one spelling: its axes in the mesh's order, those
    of size 1 left out (an axis not named has size 1), `seq=1` where all are."""
    from train.mesh import AXES, mesh_sizes

    sizes = mesh_sizes(spec)
    return ",".join(f"{a}={sizes[a]}" for a in AXES if sizes.get(a, 1) != 1) or "seq=1"


def _jobs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[Job]:
    """The rows to run, model x mesh x context; a bad value refused by name."""
    meshes = args.mesh or ["seq=2"]
    for mesh in meshes:  # the spec's form and axes need no devices: refused first
        if error := mesh_error(mesh):
            parser.error(f"{error} (nothing was run)")
    # One spelling per mesh (`data=1,seq=2` is `seq=2`): a mesh given twice in two
    # spellings is one row, refused as given twice, and its row replaces a report's.
    meshes = [canonical_mesh(mesh) for mesh in meshes]
    try:
        contexts = [parse_context(c) for c in args.context.split(",") if c.strip()]
    except ValueError as e:
        parser.error(str(e))
    if not contexts:
        parser.error(f"--context={args.context!r} names no context")
    # A preset in one spelling (`llama3_2_1b` is `llama3.2-1b`): a model given twice in
    # two spellings is one model, refused as given twice, and its rows replace a report's.
    names = [model_name(m) for m in (x.strip() for x in args.models.split(",")) if m]
    if not names:
        parser.error(f"--models={args.models!r} names no model")
    return [
        Job(
            model=m,
            context=c,
            mesh=mesh,
            out=os.path.abspath(args.out),
            layers=args.layers,
            steps=args.steps,
            warmup=args.warmup,
            trace_steps=args.trace_steps,
            batch=args.batch,
            remat=args.remat,
            xla_cost=not args.no_xla_cost,
            shard_over_seq=args.shard_over_seq,
            gather_once=args.gather_once,
            scan_layers=not args.unroll_layers,
            ring_strategy=args.ring_strategy,
        )
        for m in names
        for mesh in meshes
        for c in contexts
    ]


def _old_report(parser: argparse.ArgumentParser, args: argparse.Namespace, jobs) -> dict:
    """The report the rows are added to (`--append`; empty otherwise), after refusing an
    --out that cannot be written or holds a report, and models that do not exist."""
    from train.errors import TrainingError
    from train.outputs import check_writable

    try:
        check_writable(args.out, "--out")
    except TrainingError as e:
        parser.error(str(e))
    path = os.path.join(args.out, "report.json")
    if os.path.exists(path) and not args.append:
        parser.error(
            f"--out={args.out!r} holds a report: pass --append to add these rows to it, or "
            "choose another --out (nothing was run)"
        )
    unknown = [m for m in dict.fromkeys(j.model for j in jobs) if not _known(m)]
    if unknown:
        parser.error(
            f"--models: {', '.join(map(repr, unknown))} is neither a preset nor a local HF "
            "directory (with a config.json); presets: "
            f"{', '.join(PRESET_NAMES.values())} (nothing was run)"
        )
    if not (args.append and os.path.exists(path)):
        return {"rows": []}
    try:
        return with_row_facts(read_report(path))
    except ValueError as e:
        parser.error(f"--append: {e}")


def _reused_ceilings(parser, args: argparse.Namespace, old: dict, machine: dict) -> dict:
    """The appended report's ceilings where `--reuse-ceilings` asks for them and it has
    some (empty otherwise), after refusing ceilings measured on another kind of device
    than this machine's (`this_machine`)."""
    ceilings = old.get("ceilings") or {}
    if not (args.reuse_ceilings and ceilings.get("matmul_tflops")):
        return {}
    measured = f"the ceilings in {os.path.join(args.out, 'report.json')} were measured"
    if error := device_error(measured, ceilings.get("device"), machine):
        parser.error(
            f"--reuse-ceilings: {error}: drop --reuse-ceilings to measure them here "
            "(nothing was run)"
        )
    return ceilings


def _ceilings(args: argparse.Namespace, reused: dict) -> dict:
    """The roofline's ceilings: `reused` (`_reused_ceilings`) where there are some,
    else measured in a child."""
    if reused:
        where = os.path.join(args.out, "report.json")
        print(f"ceilings: reused from {where} ({reused.get('device')})", flush=True)
        return reused
    print("ceilings ...", flush=True)
    ceilings = _child("ceilings", {}, args.timeout, "measuring the ceilings")
    if "error" in ceilings:
        print(f"warning: {failed('measuring the ceilings', ceilings)}", file=sys.stderr, flush=True)
    return ceilings


def trace_sessions(out: str, name: str) -> list[str]:
    """The trace sessions in row `name`'s trace folder under `out`: the folders
    `jax.profiler` writes one trace into each (`plugins/profile/<date>/`)."""
    profile = os.path.join(out, "tensorboard", name, "plugins", "profile")
    try:
        return sorted(os.path.join(profile, d) for d in os.listdir(profile))
    except OSError:  # none yet
        return []


def _run_row(job: Job, timeout: float, run_facts: dict) -> dict:
    """One row in its child, with what it records of how it ran; its line printed. The
    row's earlier traces (a row it replaces) are removed once it has succeeded, never
    before; a row that fails or is stopped removes its own trace instead, so the one
    the report describes stays the newest in the row's folder."""
    import shutil

    from train.outputs import signals_held
    from train.tools import report as report_lib

    print(f"{job.name} ...", flush=True)
    earlier = trace_sessions(job.out, job.name)

    def remove(sessions) -> None:
        with signals_held():  # a Ctrl-C waits until they are gone
            for session in sessions:
                shutil.rmtree(session, ignore_errors=True)

    try:
        row = _child("row", dataclasses.asdict(job), timeout, f"row {job.name}")
    except KeyboardInterrupt:  # a stopped row's trace is no row's: `trace` would read it
        remove(set(trace_sessions(job.out, job.name)) - set(earlier))
        raise
    if row.get("status") == "ok":
        remove(earlier)
    else:  # the published row's trace stays the newest in its folder
        remove(set(trace_sessions(job.out, job.name)) - set(earlier))
    row = {
        "name": job.name,
        "model": job.model,
        "label": job.label,
        "context": job.context,
        "mesh": job.mesh,
        **job.settings(),
        **job.facts(),
        **run_facts,
        **row,
    }
    summary = (
        row.get("error", "").split("\n")[0]
        if row.get("status") != "ok"
        else f"{row['step_ms']:.1f} ms/step, {row['tokens_per_s']:.0f} tokens/s "
        f"({report_lib.timing_text(row['steps'])})"
    )
    print(f"  {row.get('status')}: {summary}", flush=True)
    for w in row.get("warnings", []):
        print(f"  warning: {w}", file=sys.stderr, flush=True)
    return row


def command_line(argv: list[str] | None) -> str:
    """The tool's command line, as report.json records it."""
    return " ".join(["python -m train.tools.profile", *(sys.argv[1:] if argv is None else argv)])


def _profile(parser: argparse.ArgumentParser, args: argparse.Namespace, argv) -> None:
    """The rows, one child each, then the report."""
    from train.tools import report as report_lib

    jobs = _jobs(parser, args)
    old = _old_report(parser, args, jobs)
    # The rows' file names under --out: one label per model (a preset's name, or
    # `local-` and a local directory's basename), distinct from the appended report's
    # other models'.
    jobs = labelled(jobs, old["rows"])
    # A row asked for twice would run twice into one name (its trace folder, its row).
    names = [job.name for job in jobs]
    if twice := next((name for name in names if names.count(name) > 1), None):
        parser.error(
            f"row {twice!r} is asked for more than once (the same model, context and "
            "--mesh): give each once (nothing was run)"
        )
    try:
        machine = this_machine(args.timeout)
    except ValueError as e:
        parser.error(f"{e} (nothing was run)")
    for mesh in dict.fromkeys(j.mesh for j in jobs):
        if error := mesh_error(mesh, machine["device_count"], machine["platform"]):
            parser.error(f"{error} (nothing was run)")
    for job in jobs:
        if error := layout_error(job, machine["device_count"]):
            parser.error(f"row {job.name}: {error} (nothing was run)")
    reused = _reused_ceilings(parser, args, old, machine)
    ceilings = _ceilings(args, reused)
    try:
        os.makedirs(args.out, exist_ok=True)  # only now: a refused command leaves no --out
    except OSError as e:  # what check_writable cannot see: a read-only or special file system
        parser.error(f"--out={args.out!r} cannot be created ({e.strerror or e}) (nothing was run)")
    from train.xla_flags import NO_COMMAND_BUFFERS, command_buffers_on  # no jax import

    if machine["platform"] == "gpu" and command_buffers_on():
        print(
            f"warning: command buffers are on (XLA_FLAGS lacks {NO_COMMAND_BUFFERS}): "
            "the traces will show CUDA graphs and the per-phase attribution will be empty",
            file=sys.stderr,
            flush=True,
        )
    command = command_line(argv)
    import jax  # only its version: the parent never starts a backend

    import jflash

    run_facts = {
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "jax": jax.__version__,
        "jflash": jflash.__version__,
    }
    path = os.path.join(args.out, "report.json")

    good = {r["name"] for r in old["rows"] if r.get("status") == "ok"}

    def report_of(rows: list[dict]) -> dict:
        """report.json with the rows so far (and, with --append, the old ones). How the
        rows ran (ROW_FACTS) is in each row: appended runs may differ. A new row that
        failed does not replace an old row of its name that succeeded."""
        rows = [r for r in rows if r.get("status") == "ok" or r["name"] not in good]
        fresh = {r["name"] for r in rows}
        kept = [r for r in old["rows"] if r["name"] not in fresh]
        return {
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "command": command,
            "commands": (old.get("commands") or ([old["command"]] if "command" in old else []))
            + [command],
            "ceilings": ceilings,
            "rows": kept + rows,
        }

    rows: list[dict] = []
    for job in jobs:
        rows.append(_run_row(job, args.timeout, run_facts))
        if rows[-1].get("status") != "ok" and job.name in good:
            print(
                f"row {job.name}: {rows[-1].get('status')} this time; report.json keeps its "
                "earlier row, which succeeded",
                flush=True,
            )
        # a run stopped from outside keeps the rows it finished
        write_json(path, report_of(rows), "--out")
    # The final report.json, report.md and plots: one set.
    report_lib.render(report_of(rows), args.out, "--out", with_json=True)
    print(f"wrote {os.path.join(args.out, 'report.md')}")
    if rows and all(r.get("status") != "ok" for r in rows):
        sys.exit("error: every row failed (see report.md)")


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_modes(parser, sys.argv[1:] if argv is None else argv)
    _check_args(parser, args)
    if args.worker:
        _die_with_parent()
        _worker(*args.worker)
        return
    if args.report_only:
        _report_only(parser, args.report_only)
        return
    # SIGTERM and SIGHUP (a closed terminal) end the run as Ctrl-C does: the running
    # worker (its process group) is ended, never left behind, its temporary folder is
    # removed, and one line says what report.json keeps. A signal ignored (`nohup`)
    # stays so. Signal handlers belong to the main thread only.
    try:
        with signals_as_interrupts():
            remove_stale_temp()  # what runs of this tool killed outright left behind
            if args.fill_xla_cost:
                _fill(parser, args.fill_xla_cost, args.timeout, command_line(argv))
            else:
                _profile(parser, args, argv)
    except KeyboardInterrupt as e:
        report_path = os.path.join(args.fill_xla_cost or args.out, "report.json")
        status = stop_status(e)
        try:
            print(stop_line(e, report_path), file=sys.stderr, flush=True)
            sys.stdout.flush()
        except OSError:  # a closed terminal: nowhere to say it
            os._exit(status)
        sys.exit(status)


if __name__ == "__main__":
    main()
