"""Where a training step's device time goes, read from a `jax.profiler` trace.

    python -m train.tools.trace runs/x/tensorboard [--hlo step.hlo.txt] [--json]

Input: the `.xplane.pb` that `jax.profiler` writes (TensorBoard's
`plugins/profile/<run>/<host>.xplane.pb`), read with `jax.profiler.ProfileData`.

* GPU: planes `/device:GPU:N`, lines `Stream #..`; every event is a kernel, memcpy or
  memset, with stats `name` (the jax name stack), `hlo_op`, `hlo_module` and
  `correlation_id` (matching the host-side launch, which says when it was issued).
* CPU: thunk events on `/host:CPU` threads with stats `hlo_op`, `hlo_module`,
  `device_ordinal` and `run_id` (matching the host's `Execute`). They carry no name
  stack; pass the compiled module's text (`train.tools.hlo.parse_hlo`) to attribute phases.
  Nothing links a run to the host call that dispatched it: the run's start (its first
  thunk, or the host's `Execute` wait, whichever is first) stands for its launch. The
  host dispatches ahead, so a step must have started before the next step's annotation
  begins, or it is counted in a later step's window: `train.tools.profile` waits for
  each traced step on CPU, the trainer for the step before the one it dispatched.

Steps are cut at the trainer's `jax.profiler.StepTraceAnnotation("train",
step_num=...)`: each kernel belongs to the step during which the host launched it;
on each device a step's window runs from its first kernel of the step's program to
the next step's first kernel (the last step: to its last kernel). Without
annotations the whole device span is one window (`windows == "whole trace"`). What the
host launched inside the trainer's `TraceAnnotation("eval")` (an evaluation inside a
`--profile_steps` window) belongs to no step: a step's window ends where the device
begins such work.

Two partitions of each window, both exact by construction (a sweep over time):

* phase: forward + backward + recompute + update + idle = step time. Backward is
  `transpose(` in the name stack, recompute (remat) `rematted_computation`, forward
  `jvp(`; update is everything else the step runs (gradient accumulation, clipping,
  the optimizer, other programs between steps). A kernel without a name stack
  inherits the phase of the previous kernel on its stream.
* kernel class of busy time: attention + matmul + exposed communication + other.

While kernels overlap, compute kernels own the instant (split evenly between the
distinct phases / classes running), then communication, then copies. Communication
(`comm_ms`) is the union of NCCL kernels and collective HLO ops; exposed
communication is the part of it during which no compute kernel runs. Fields that a
trace cannot give are `None`, never a guess (`TraceReport.not_measured` says why).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import glob
import gzip
import os
import re
import signal
import sys
import warnings
from typing import Any

from jax.profiler import ProfileData

from train.errors import signal_status
from train.tools.hlo import COLLECTIVE_PERMUTES, HloOps
from train.xla_flags import NO_COMMAND_BUFFERS

PHASES = ("forward", "backward", "recompute", "update")
CLASSES = ("attention", "matmul", "other")  # + exposed communication

_NCCL = re.compile(r"^nccl", re.IGNORECASE)
_COLLECTIVE_OP = re.compile(
    r"^(all[-_]gather|all[-_]reduce|reduce[-_]scatter|collective[-_]permute|ppermute|psum"
    r"|all[-_]to[-_]all|ragged[-_]all[-_]to[-_]all|collective[-_]broadcast|send|recv)\b"
)
_PERMUTE_OP = re.compile(r"^(collective[-_]permute|ppermute)\b")
_ATTENTION = re.compile(r"jflash_|cudnn|fmha|flash", re.IGNORECASE)
_MATMUL = re.compile(r"nvjet|gemm|cublas|cutlass|xmma|dot", re.IGNORECASE)
_GPU_PLANE = re.compile(r"^/device:GPU:(\d+)$")


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One device activity interval (a GPU kernel/copy or a CPU thunk), in ns."""

    start: float
    end: float
    name: str
    stack: str  # jax name stack; "" when unknown
    hlo_op: str
    module: str
    stream: str
    launch: float | None  # host time of the launch (step assignment); None if unknown
    program: int | None = None  # the compiled module's id (XLA's unique id); None if unknown


@dataclasses.dataclass(frozen=True)
class Breakdown:
    """One device's time in one window (or a mean), in ms; None: not measured.

    `forward + backward + recompute + update + idle == step`;
    `attention + matmul + exposed_comm + other == step - idle`.
    """

    step_ms: float
    forward_ms: float | None
    backward_ms: float | None
    recompute_ms: float | None
    update_ms: float | None
    idle_ms: float
    attention_ms: float | None
    matmul_ms: float | None
    exposed_comm_ms: float
    other_ms: float | None
    comm_ms: float  # union of communication (overlapped or not)
    memcpy_ms: float | None  # union of memcpy/memset (GPU copy engines)
    permute_ms: float  # union of collective-permute (ring K/V transfers)
    permute_bytes: float | None  # bytes sent by collective-permutes (needs the HLO)

    @property
    def busy_ms(self) -> float:
        return self.step_ms - self.idle_ms


@dataclasses.dataclass(frozen=True)
class TraceReport:
    """A trace's attribution.

    Attributes:
      platform: "gpu" or "cpu".
      windows: "steps" (cut at StepTraceAnnotations) or "whole trace".
      steps: step numbers of the windows (None for the whole trace).
      module: the step's XLA program (the one with the most device time).
      devices: per device, the mean over steps.
      mean: the mean over devices.
      per_step: per device, one Breakdown per window.
      named_fraction: share of busy time whose phase came from a name stack (the rest
        inherited it from the previous kernel on the stream).
      not_measured: field -> why it is None.
    """

    platform: str
    windows: str
    steps: list[int | None]
    module: str
    devices: dict[str, Breakdown]
    mean: Breakdown
    per_step: dict[str, list[Breakdown]]
    named_fraction: float
    not_measured: dict[str, str]

    def to_dict(self) -> dict[str, Any]:
        return {
            "platform": self.platform,
            "windows": self.windows,
            "steps": self.steps,
            "module": self.module,
            "named_fraction": self.named_fraction,
            "not_measured": self.not_measured,
            "mean": dataclasses.asdict(self.mean),
            "devices": {d: dataclasses.asdict(b) for d, b in self.devices.items()},
        }


# ----------------------------------------------------------------------------------
# Reading


def find_xplane(path: str) -> str:
    """`path` itself if a file, else the newest `*.xplane.pb[.gz]` under it."""
    if os.path.isfile(path):
        return path
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path!r} does not exist")
    found = traces_under(path)
    if not found:
        raise FileNotFoundError(f"no *.xplane.pb under {path!r}")
    return max(found, key=os.path.getmtime)


def traces_under(path: str) -> list[str]:
    """The `*.xplane.pb[.gz]` files at any depth under the directory `path`."""
    found = glob.glob(os.path.join(path, "**", "*.xplane.pb"), recursive=True)
    return found + glob.glob(os.path.join(path, "**", "*.xplane.pb.gz"), recursive=True)


def load(path: str) -> ProfileData:
    """A `ProfileData` from an `.xplane.pb`, a gzipped one, or a log directory; a
    ValueError naming the file where it is empty or not a trace."""
    path = find_xplane(path)
    if os.path.getsize(path) == 0:
        raise ValueError(f"{path!r} is empty (a trace that was never written out)")
    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                return ProfileData.from_serialized_xspace(f.read())
        return ProfileData.from_file(path)
    except (RuntimeError, OSError, EOFError) as e:
        raise ValueError(f"{path!r} is not a readable jax.profiler trace ({e})") from None


def _stats(event) -> dict[str, Any]:
    with warnings.catch_warnings():  # the binding's stats iterator warns on every call
        warnings.simplefilter("ignore", DeprecationWarning)
        return dict(event.stats)


def _int(value) -> int | None:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return None


def _host_plane(data: ProfileData):
    return next((p for p in data.planes if p.name == "/host:CPU"), None)


def _gpu_kernels(data: ProfileData) -> dict[str, list[Kernel]]:
    launches: dict[tuple[int, int], float] = {}
    host = _host_plane(data)
    for line in host.lines if host is not None else ():
        for e in line.events:
            st = _stats(e)
            if "correlation_id" in st and "device_id" in st:
                launches[(_int(st["device_id"]), _int(st["correlation_id"]))] = e.start_ns
    out: dict[str, list[Kernel]] = {}
    for plane in data.planes:
        m = _GPU_PLANE.match(plane.name)
        if not m:
            continue
        ordinal, kernels = int(m.group(1)), []
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            for e in line.events:
                st = _stats(e)
                kernels.append(
                    Kernel(
                        start=e.start_ns,
                        end=e.start_ns + e.duration_ns,
                        name=e.name,
                        stack=str(st.get("name", "")),
                        hlo_op=str(st.get("hlo_op", "")),
                        module=str(st.get("hlo_module", "")),
                        stream=line.name,
                        launch=launches.get((ordinal, _int(st.get("correlation_id")))),
                        program=_int(st["program_id"]) if "program_id" in st else None,
                    )
                )
        if kernels:
            out[f"gpu:{ordinal}"] = kernels
    return out


# Templates that only launch the kernel named inside them (CUTLASS, FlashAttention-3):
# unwrapped by `kernel_label`, or every FlashAttention-3 kernel would read alike.
_LAUNCHERS = ("cutlass::device_kernel<", "flash::enable_sm90_or_later<")
_NAMESPACE = re.compile(r"\b[A-Za-z_]\w*::")


def _without_parameters(name: str) -> str:
    """A demangled C++ name without its parameter list (`f<T>(Params)` -> `f<T>`)."""
    if not name.endswith(")"):
        return name
    depth = 0
    for i in range(len(name) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(name[i], 0)
        if depth == 0:
            return name[:i].rstrip() if i > 0 else name
    return name


def kernel_label(name: str, width: int = 60) -> str:
    """A GPU kernel's name short enough for a table and still telling kernels apart:
    without `void`, its parameter list, the launcher templates around it
    (`cutlass::device_kernel<...>`, `flash::enable_sm90_or_later<...>`) and namespace
    qualifiers, cut to `width` characters (ending in `...`). Names without templates
    are only cut."""
    label, wrapped = _without_parameters(name.strip()).removeprefix("void "), 0
    while (launcher := next((w for w in _LAUNCHERS if label.startswith(w)), None)) is not None:
        label, wrapped = label[len(launcher) :], wrapped + 1
    for _ in range(wrapped):  # the launchers' closing brackets
        label = label.rstrip()
        label = label[:-1] if label.endswith(">") else label
    label = " ".join(_NAMESPACE.sub("", label).split())
    return label if len(label) <= width else label[: width - 3] + "..."


def kernel_durations(source: str | ProfileData) -> dict[str, float]:
    """Device time (ns) per kernel name on the first GPU of a trace, longest first;
    empty when the trace has no GPU kernels (CPU runs)."""
    return _time_per_name(_first_gpu_kernels(source))


def _time_per_name(kernels: list[Kernel]) -> dict[str, float]:
    totals: collections.Counter = collections.Counter()
    for k in kernels:
        totals[k.name] += k.end - k.start
    return dict(totals.most_common())


def _first_gpu_kernels(source: str | ProfileData) -> list[Kernel]:
    """The kernels of the lowest-numbered GPU in a trace (none for CPU traces)."""
    data = source if isinstance(source, ProfileData) else load(source)
    devices = _gpu_kernels(data)
    if not devices:
        return []
    return devices[min(devices, key=lambda d: int(d.split(":")[1]))]


def top_kernels(
    source: str | ProfileData,
    n: int = 10,
    steps: int = 1,
    *,
    phase: str | None = None,
    hlo: HloOps | None = None,
) -> list[dict[str, Any]]:
    """The `n` kernels (by name) with the most device time on the first GPU, per traced
    step (`steps` of them in the trace): `name`, `ms`, `share` of all kernel time,
    `kind` (`kind_of`), `phase` (the training phase that spent most of its time) and
    `where`, the name stack (last three scopes) that spent most of it. Empty for CPU
    traces. Shows what the class totals hide, e.g. f32 (TF32) matmuls in a bf16 model.

    `phase` ("forward", "backward", "recompute" or "update"): only that phase's time
    of each kernel (the `update` phase's kernels carry no model scope, so the class
    totals say little about them). `hlo` (`train.tools.hlo.parse_hlo` of the step)
    names the phases of kernels whose trace events carry no name stack, as `parse`."""
    if phase is not None and phase not in PHASES:
        raise ValueError(f"{phase=} must be one of {PHASES}")
    kernels = _first_gpu_kernels(source)
    phases = _phases(kernels, hlo)[0] if kernels else []
    total = sum(k.end - k.start for k in kernels)
    spent: collections.Counter = collections.Counter()
    stacks: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    by_phase: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    sample: dict[str, Kernel] = {}
    for k, p in zip(kernels, phases, strict=True):
        by_phase[k.name][p] += k.end - k.start
        if phase is not None and p != phase:
            continue
        spent[k.name] += k.end - k.start
        stack = _stack_of(k, hlo)
        stacks[k.name]["/".join(stack.split("/")[-3:])] += k.end - k.start
        sample.setdefault(k.name, k)
    return [
        {
            "name": name,
            "ms": ns / 1e6 / steps,
            "share": ns / total,
            "kind": kind_of(sample[name], "gpu"),
            "phase": by_phase[name].most_common(1)[0][0],
            "where": stacks[name].most_common(1)[0][0],
        }
        for name, ns in spent.most_common(n)
    ]


_LAYER = re.compile(r"layer_\d+")


def scope_of(stack: str) -> str:
    """A name stack as a model scope: without the jit's root (`jit(train_step)`) and the
    primitive at the end, every `layer_N` as `layer_*` (the layers' kernels add up)."""
    parts = [p for p in _LAYER.sub("layer_*", stack).split("/") if p]
    if parts and parts[0].startswith("jit("):
        parts = parts[1:]
    return "/".join(parts[:-1] if len(parts) > 1 else parts)


def top_scopes(
    source: str | ProfileData,
    n: int = 12,
    steps: int = 1,
    *,
    kind: str = "other",
    hlo: HloOps | None = None,
) -> list[dict[str, Any]]:
    """The `n` model scopes (`scope_of` a kernel's name stack) whose `kind` kernels
    (`kind_of`: "other" by default, the elementwise and reduction fusions) spend the most
    device time on the first GPU, per traced step: `scope`, `ms`, `share` of all kernel
    time, `phase` (`phase_of` the scope), `launches` per step and `name`, the kernel that
    spent most of it. Breaks down the class totals by where in the model the time goes
    (norms, RoPE, SwiGLU, the loss). Empty for CPU traces."""
    kernels = _first_gpu_kernels(source)
    total = sum(k.end - k.start for k in kernels)
    launches: collections.Counter = collections.Counter()
    names: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for k in kernels:
        if kind_of(k, "gpu") == kind:
            scope = scope_of(_stack_of(k, hlo)) or "(no name stack)"
            launches[scope] += 1
            names[scope][k.name] += k.end - k.start
    spent = collections.Counter({scope: names[scope].total() for scope in names})
    return [
        {
            "scope": scope,
            "ms": ns / 1e6 / steps,
            "share": ns / total,
            # The scope keeps the phase's wrappers (`transpose(`, `jvp(`, ...).
            "phase": phase_of(scope),
            "launches": launches[scope] / steps,
            "name": names[scope].most_common(1)[0][0],
        }
        for scope, ns in spent.most_common(n)
    ]


def kernel_spread(source: str | ProfileData, n: int = 8, steps: int = 1) -> list[dict[str, Any]]:
    """Per kernel name, its device time per traced step on every GPU of the trace, for
    the `n` names whose time differs most between the GPUs: `name`, `kind`, `ms`
    (`{"gpu:0": ..., ...}`) and `spread_ms` (max - min). Tells a slower device from
    uneven work: compute kernels slower on one GPU in every call, while communication
    kernels include the time spent waiting for a slower peer. Empty with fewer than
    two GPUs (and for CPU traces)."""
    data = source if isinstance(source, ProfileData) else load(source)
    devices = _gpu_kernels(data)
    if len(devices) < 2:
        return []
    order = sorted(devices, key=lambda d: int(d.split(":")[1]))
    spent = {d: _time_per_name(devices[d]) for d in order}
    sample = {k.name: k for d in order for k in devices[d]}
    rows = []
    for name, kernel in sample.items():
        ms = {d: spent[d].get(name, 0.0) / 1e6 / steps for d in order}
        rows.append(
            {
                "name": name,
                "kind": kind_of(kernel, "gpu"),
                "ms": ms,
                "spread_ms": max(ms.values()) - min(ms.values()),
            }
        )
    rows.sort(key=lambda r: -r["spread_ms"])
    return rows[:n]


def _cpu_kernels(data: ProfileData) -> dict[str, list[Kernel]]:
    host = _host_plane(data)
    if host is None:
        return {}
    executes: dict[int, float] = {}  # run_id -> host Execute start
    thunks: dict[str, list[Kernel]] = collections.defaultdict(list)
    for line in host.lines:
        line_thunks = []
        for e in line.events:
            st = _stats(e)
            if "Execute" in e.name and "run_id" in st and "hlo_op" not in st:
                run = _int(st["run_id"])
                executes[run] = min(executes.get(run, e.start_ns), e.start_ns)
            elif "hlo_op" in st and "device_ordinal" in st:
                line_thunks.append((e, st))
        line_thunks.sort(key=lambda es: (es[0].start_ns, -es[0].duration_ns))
        for i, (e, st) in enumerate(line_thunks):
            end = e.start_ns + e.duration_ns
            # Nested thunks (a while loop around its body): keep the leaves only.
            if i + 1 < len(line_thunks) and line_thunks[i + 1][0].start_ns < end:
                continue
            thunks[f"cpu:{_int(st['device_ordinal'])}"].append(
                Kernel(
                    start=e.start_ns,
                    end=end,
                    name=e.name,
                    stack="",
                    hlo_op=str(st["hlo_op"]),
                    module=str(st.get("hlo_module", "")),
                    stream=line.name,
                    launch=_int(st.get("run_id")),  # resolved to a time below
                    program=_int(st["program_id"]) if "program_id" in st else None,
                )
            )
    # A run's launch: when it began, its first thunk or the host's wait for it, whichever
    # is first (the wait begins once the thunks the caller's thread runs are done).
    began = dict(executes)
    for ks in thunks.values():
        for k in ks:
            if k.launch in began:
                began[k.launch] = min(began[k.launch], k.start)
    return {
        device: [dataclasses.replace(k, launch=began.get(k.launch)) for k in ks]
        for device, ks in sorted(thunks.items())
    }


# The trainer's annotation around an evaluation (`train.loop._evaluate`).
EVAL_NAME = "eval"


def _spans(data: ProfileData, name: str) -> list[tuple[float, float]]:
    """`(start, end)` of the host's events named `name`, in order."""
    host = _host_plane(data)
    return sorted(
        (e.start_ns, e.start_ns + e.duration_ns)
        for line in (host.lines if host is not None else ())
        for e in line.events
        if e.name == name
    )


def _inside(spans: list[tuple[float, float]], t: float | None) -> bool:
    """Whether the time `t` lies in one of `spans` (sorted)."""
    if t is None or not spans:
        return False
    i = bisect.bisect_right(spans, (t, float("inf"))) - 1
    return i >= 0 and spans[i][0] <= t < spans[i][1]


def _step_annotations(data: ProfileData, step_name: str) -> list[tuple[float, int]]:
    host = _host_plane(data)
    marks = []
    for line in host.lines if host is not None else ():
        for e in line.events:
            if e.name == step_name:
                st = _stats(e)
                if "step_num" in st:
                    marks.append((e.start_ns, _int(st["step_num"])))
    return sorted(marks)


# ----------------------------------------------------------------------------------
# Classification


def phase_of(stack: str) -> str | None:
    """Training phase of a name stack; None when the stack is empty."""
    if not stack:
        return None
    if "rematted_computation" in stack:
        return "recompute"
    if "transpose(" in stack:
        return "backward"
    if "jvp(" in stack:
        return "forward"
    return "update"


def kind_of(kernel: Kernel, platform: str) -> str:
    """`comm`, `memcpy`, `attention`, `matmul` or `other` (CPU: comm or other only)."""
    if _NCCL.search(kernel.name) or _COLLECTIVE_OP.match(kernel.hlo_op):
        return "comm"
    if platform != "gpu":
        return "other"
    if kernel.name.startswith(("Memcpy", "Memset")):
        return "memcpy"
    if _ATTENTION.search(kernel.name):
        return "attention"
    if _MATMUL.search(kernel.name):
        return "matmul"
    return "other"


def _stack_of(kernel: Kernel, hlo: HloOps | None) -> str:
    """A kernel's name stack: its HLO op's, else the trace's (empty when neither).

    The compiled HLO is the authority where it is known: XLA deduplicates fusions of the
    same shape (every layer's SwiGLU, say), and the trace then names each launch with
    the jit's root scope only, which reads as the update phase."""
    return (hlo.name_stack(kernel.hlo_op) if hlo else "") or kernel.stack


def _phases(kernels: list[Kernel], hlo: HloOps | None) -> tuple[list[str], list[bool]]:
    """Phase per kernel, and whether it came from a name stack (else inherited)."""
    phases: list[str] = [""] * len(kernels)
    named = [False] * len(kernels)
    last: dict[str, str] = {}
    for i in sorted(range(len(kernels)), key=lambda i: kernels[i].start):
        k = kernels[i]
        phase = phase_of(_stack_of(k, hlo))
        named[i] = phase is not None
        phases[i] = phase or last.get(k.stream, "update")
        last[k.stream] = phases[i]
    return phases, named


# ----------------------------------------------------------------------------------
# Windows and the sweep


def _windows(
    kernels: list[Kernel], starts: list[float], module: str, cuts: list[float] = ()
) -> list[tuple[int, float, float]]:
    """`(annotation index, start, end)` per step on one device; a window ends at the
    first of `cuts` (sorted device times: where an evaluation's work begins) inside it."""
    by_step: dict[int, list[Kernel]] = collections.defaultdict(list)
    for k in kernels:
        if k.module == module and k.launch is not None and k.launch >= starts[0]:
            by_step[bisect.bisect_right(starts, k.launch) - 1].append(k)
    order = sorted(by_step)
    firsts = [min(k.start for k in by_step[i]) for i in order]
    out = []
    for j, i in enumerate(order):
        end = firsts[j + 1] if j + 1 < len(order) else max(k.end for k in by_step[i])
        cut = bisect.bisect_right(cuts, firsts[j])
        end = min(end, cuts[cut]) if cut < len(cuts) else end
        out.append((i, firsts[j], end))
    return out


def _sweep(
    kernels: list[Kernel],
    kinds: list[str],
    phases: list[str],
    named: list[bool],
    permutes: list[bool],
    permute_bytes: list[int | None],
    start: float,
    end: float,
) -> tuple[dict[str, float], float | None]:
    """Time sums (ns) over `[start, end)`, and bytes of the permutes that began in it."""
    points = []
    sent: float | None = 0.0
    for i, k in enumerate(kernels):
        s, e = max(k.start, start), min(k.end, end)
        if e <= s:
            continue
        group = "comm" if kinds[i] == "comm" else "copy" if kinds[i] == "memcpy" else "compute"
        permute = permutes[i]
        key = (group, kinds[i], phases[i], named[i], permute)
        points += [(s, 1, key), (e, -1, key)]
        if permute and start <= k.start < end:
            sent = None if sent is None or permute_bytes[i] is None else sent + permute_bytes[i]
    points.sort(key=lambda p: (p[0], p[1]))
    acc: dict[str, float] = collections.defaultdict(float)
    active: collections.Counter = collections.Counter()
    prev = start
    for t, delta, key in points:
        if t > prev and active:
            _attribute(acc, list(active), t - prev)
        prev = max(prev, t)
        active[key] += delta
        if not active[key]:
            del active[key]
    return acc, sent


def _attribute(acc: dict[str, float], keys: list[tuple], dt: float) -> None:
    compute = [k for k in keys if k[0] == "compute"]
    comm = [k for k in keys if k[0] == "comm"]
    owner = compute or comm or [k for k in keys if k[0] == "copy"]
    phases = {k[2] for k in owner}
    for p in phases:
        acc[f"phase:{p}"] += dt / len(phases)
    classes = {k[1] for k in owner}
    for c in classes:
        acc[f"class:{c}"] += dt / len(classes)
    if all(k[3] for k in owner):
        acc["named"] += dt
    acc["busy"] += dt
    if comm:
        acc["comm"] += dt
        if any(k[4] for k in comm):
            acc["permute"] += dt
    if any(k[0] == "copy" for k in keys):
        acc["memcpy"] += dt


def _breakdown(acc, sent, span_ns: float, platform: str, phased: bool) -> Breakdown:
    ms = 1e-6

    def phase(name):
        return acc[f"phase:{name}"] * ms if phased else None

    gpu = platform == "gpu"
    return Breakdown(
        step_ms=span_ns * ms,
        forward_ms=phase("forward"),
        backward_ms=phase("backward"),
        recompute_ms=phase("recompute"),
        update_ms=phase("update"),
        idle_ms=(span_ns - acc["busy"]) * ms,
        attention_ms=acc["class:attention"] * ms if gpu else None,
        matmul_ms=acc["class:matmul"] * ms if gpu else None,
        exposed_comm_ms=acc["class:comm"] * ms,
        other_ms=(acc["class:other"] + acc["class:memcpy"]) * ms if gpu else None,
        comm_ms=acc["comm"] * ms,
        memcpy_ms=acc["memcpy"] * ms if gpu else None,
        permute_ms=acc["permute"] * ms,
        permute_bytes=sent,
    )


def mean(items: list[Breakdown]) -> Breakdown:
    """Field-wise mean; a field is None if it is None in any item."""
    if not items:
        raise ValueError("mean of no Breakdowns")
    values = {}
    for field in dataclasses.fields(Breakdown):
        xs = [getattr(b, field.name) for b in items]
        values[field.name] = None if any(x is None for x in xs) else sum(xs) / len(xs)
    return Breakdown(**values)


# ----------------------------------------------------------------------------------
# Entry point


# The share of a program's busy time whose ops the HLO may lack (GPU events name some
# asynchronous collectives as they were before XLA renamed them).
MISSING_OPS_SHARE = 0.05


def _check_hlo(hlo: HloOps, module: str, kernels: list[Kernel]) -> None:
    """Raises where `hlo` is not the compile of the trace's program `module`: another
    module's name, or, for a file XLA dumped (`module_NNNN.<name>.*`: NNNN is the
    program's id, which the trace's events carry), another compile's id, or a text
    that lacks ops running more than MISSING_OPS_SHARE of the program's time. Its name
    stacks would put the ops of one compile into the phases of another."""
    if hlo.modules and module not in hlo.modules:
        raise ValueError(
            f"the HLO (--hlo) holds module {', '.join(hlo.modules)}, not the trace's "
            f"program {module}: pass that program's compiled text"
        )
    programs = {k.program for k in kernels} - {None}
    if hlo.program_id is not None and programs and hlo.program_id not in programs:
        ran = ", ".join(str(p) for p in sorted(programs))
        raise ValueError(
            f"the HLO (--hlo) is XLA's dump of program {hlo.program_id}, but the trace's "
            f"{module} ran program {ran} (another compile): pass module_"
            f"{min(programs):04d}.{module}.*after_optimizations.txt"
        )
    # XLA's dump names restart in every process (module_0026 in two runs), so the ops
    # themselves must be there: a trace op the text lacks is one its stacks cannot name.
    time = collections.Counter()
    # The ops it would name: those without a name stack of their own, bar collectives
    # (a GPU trace names some as they were before XLA renamed them) and what XLA did
    # not name (a memset).
    kernels = [k for k in kernels if k.hlo_op and not k.stack and kind_of(k, "cpu") != "comm"]
    for k in kernels:
        time[k.hlo_op in hlo.opcodes] += k.end - k.start
    if time[False] > MISSING_OPS_SHARE * (time[False] + time[True]):
        missing = sorted({k.hlo_op for k in kernels if k.hlo_op not in hlo.opcodes})
        shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        share = time[False] / (time[False] + time[True])
        raise ValueError(
            f"the HLO (--hlo) lacks {len(missing)} of the ops that ran {share:.0%} of the "
            f"trace's {module} ({shown}): it is not the compile this trace ran (another "
            "run's dump, or the text before optimizations); pass the "
            "*after_optimizations.txt this run dumped"
        )


def parse(source: str | ProfileData, hlo: HloOps | None = None, step_name: str = "train"):
    """Attributes every device's time in a trace (see the module docstring).

    Args:
      source: an `.xplane.pb` (optionally gzipped), a directory holding one (the
        newest is read), or a loaded `ProfileData`.
      hlo: the step's compiled HLO facts: name stacks for events that lack them (all
        CPU thunks) and the bytes of each collective-permute.
      step_name: the StepTraceAnnotation name that cuts steps.

    Returns:
      A `TraceReport`.

    Raises:
      ValueError: the trace holds no device activity.
    """
    data = source if isinstance(source, ProfileData) else load(source)
    devices = _gpu_kernels(data)
    platform = "gpu"
    if not devices:
        devices, platform = _cpu_kernels(data), "cpu"
    if not devices:
        where = "" if isinstance(source, ProfileData) else f" ({find_xplane(source)})"
        raise ValueError(f"the trace{where} has no GPU kernels and no CPU XLA thunks to attribute")
    marks = _step_annotations(data, step_name)
    evals = _spans(data, EVAL_NAME)
    totals: collections.Counter = collections.Counter()
    for ks in devices.values():
        for k in ks:
            if k.launch is None or _inside(evals, k.launch):
                continue
            if not marks or k.launch >= marks[0][0]:
                totals[k.module] += k.end - k.start
    if not totals:  # no launch times known: the dominant program over all kernels
        for ks in devices.values():
            for k in ks:
                totals[k.module] += k.end - k.start
    module = totals.most_common(1)[0][0]
    if hlo is not None:
        _check_hlo(hlo, module, [k for ks in devices.values() for k in ks if k.module == module])
    starts = [t for t, _ in marks]
    use_steps = (
        bool(marks) and totals and any(k.launch is not None for ks in devices.values() for k in ks)
    )

    per_step: dict[str, list[Breakdown]] = {}
    step_ids: list[int | None] = []
    named_ns = busy_ns = 0.0
    results = []
    for device, ks in devices.items():
        kinds = [kind_of(k, platform) for k in ks]
        phases, named = _phases(ks, hlo)
        permutes = [
            bool(_PERMUTE_OP.match(k.hlo_op))
            or (hlo is not None and hlo.opcodes.get(k.hlo_op) in COLLECTIVE_PERMUTES)
            for k in ks
        ]
        sizes = [hlo.permute_size(k.hlo_op, k.stack) if hlo is not None else None for k in ks]
        if use_steps:
            # (a step's own program that began inside the span is no evaluation's)
            cuts = sorted(k.start for k in ks if k.module != module and _inside(evals, k.launch))
            windows = _windows(ks, starts, module, cuts)
        else:
            windows = [(None, min(k.start for k in ks), max(k.end for k in ks))]
        results.append((device, ks, kinds, phases, named, permutes, sizes, windows))
        for _, s, e in windows:
            acc, _ = _sweep(ks, kinds, phases, named, permutes, sizes, s, e)
            named_ns += acc["named"]
            busy_ns += acc["busy"]
    named_fraction = named_ns / busy_ns if busy_ns else 0.0
    phased = named_fraction > 0
    for device, ks, kinds, phases, named, permutes, sizes, windows in results:
        rows = []
        for _, s, e in windows:
            acc, sent = _sweep(ks, kinds, phases, named, permutes, sizes, s, e)
            rows.append(_breakdown(acc, sent, e - s, platform, phased))
        per_step[device] = rows
        if len(windows) > len(step_ids):
            step_ids = [marks[i][1] if i is not None else None for i, _, _ in windows]

    not_measured = {}
    if platform != "gpu":
        for field in ("attention_ms", "matmul_ms", "other_ms", "memcpy_ms"):
            not_measured[field] = "CPU thunks do not say which kernel class they are"
    if not phased:
        reason = "no event carries a name stack (pass the compiled HLO: train.tools.hlo.parse_hlo)"
        if platform == "gpu":
            reason = (
                "no kernel carries a name stack: were command buffers on? profile with "
                f"XLA_FLAGS={NO_COMMAND_BUFFERS}"
            )
        for field in ("forward_ms", "backward_ms", "recompute_ms", "update_ms"):
            not_measured[field] = reason
    device_means = {d: mean(rows) for d, rows in per_step.items()}
    if hlo is None:
        not_measured["permute_bytes"] = "needs the compiled HLO (collective-permute sizes)"
    elif any(m.permute_bytes is None for m in device_means.values()):
        not_measured["permute_bytes"] = (
            "a collective-permute the trace ran has no size in the HLO (by its name or "
            "its name stack)"
        )
    return TraceReport(
        platform=platform,
        windows="steps" if use_steps else "whole trace",
        steps=step_ids,
        module=module,
        devices=device_means,
        mean=mean(list(device_means.values())),
        per_step=per_step,
        named_fraction=named_fraction,
        not_measured=not_measured,
    )


# ----------------------------------------------------------------------------------
# Command line


def summary(report: TraceReport) -> str:
    """`report` as text: what was read, the mean over devices and steps per field (ms,
    `–` where not measured), and why each `–` is one."""
    steps = ", ".join(str(s) for s in report.steps if s is not None)
    windows = f"steps {steps}" if report.windows == "steps" else "the whole trace"
    lines = [
        f"{report.platform}, {len(report.devices)} device(s), {windows}, program "
        f"{report.module}; per device and step (the mean over devices and steps):"
    ]
    for field in dataclasses.fields(Breakdown):
        value = getattr(report.mean, field.name)
        text = "–" if value is None else f"{value:.4g}"
        name = (
            f"{field.name.removesuffix('_ms')} (ms)" if field.name.endswith("_ms") else field.name
        )
        lines.append(f"  {name}: {text}")
    lines.append(f"  phase share named: {report.named_fraction:.0%}")
    lines += [f"– {field}: {why}" for field, why in report.not_measured.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> TraceReport:
    """`python -m train.tools.trace TRACE [--hlo FILE] [--step-name NAME] [--json]`."""
    import json

    from train.config import OneLineParser  # errors in one line, as the trainer's

    p = OneLineParser(
        prog="python -m train.tools.trace",
        description="Where a training step's device time goes, read from a jax.profiler "
        "trace: forward, backward, recompute, update and idle, kernel classes and "
        "communication, per device and step (the profile tool's attribution).",
    )
    p.add_argument(
        "trace",
        metavar="TRACE",
        help="an .xplane.pb (or .xplane.pb.gz), or a directory holding one: the newest "
        "under it is read (`python -m train --profile_steps` writes them under "
        "<output_dir>/tensorboard)",
    )
    p.add_argument(
        "--hlo",
        metavar="FILE",
        help="the step's compiled HLO text (`compiled.as_text()`): name stacks for CPU "
        "thunks (the phases) and the ring's bytes",
    )
    p.add_argument(
        "--step-name",
        help="the StepTraceAnnotation that cuts steps (default: train, the trainer's; "
        "a trace without it is one window)",
    )
    p.add_argument("--json", action="store_true", help="print the whole attribution as JSON")
    args = p.parse_args(argv)
    hlo = None
    if args.hlo:
        from train.tools.hlo import parse_hlo

        try:
            with open(args.hlo) as f:
                hlo = parse_hlo(f.read())
            # XLA_FLAGS=--xla_dump_to names each file by the module's id, its program's.
            if m := re.match(r"module_(\d+)\.", os.path.basename(args.hlo)):
                hlo = dataclasses.replace(hlo, program_id=int(m.group(1)))
        except (OSError, UnicodeDecodeError) as e:
            p.error(f"--hlo={args.hlo!r} cannot be read ({getattr(e, 'strerror', None) or e})")
        whole = (
            "pass the compiled step's text (`compiled.as_text()`, or the "
            "`*after_optimizations.txt` that XLA_FLAGS=--xla_dump_to=DIR writes)"
        )
        if not hlo.opcodes:
            p.error(f"--hlo={args.hlo!r} holds no HLO instructions: {whole}")
        if not hlo.entry:
            p.error(f"--hlo={args.hlo!r} holds no whole ENTRY computation (cut short?): {whole}")
    try:
        # A name given that cuts nothing would leave the whole trace as one "step".
        if args.step_name is not None and not _step_annotations(load(args.trace), args.step_name):
            p.error(
                f"--step-name={args.step_name!r}: no such step annotation (with a step_num) "
                f"in {find_xplane(args.trace)!r}"
            )
        if os.path.isdir(args.trace):  # which trace of a folder was read, on stderr
            read, count = find_xplane(args.trace), len(traces_under(args.trace))
            of = f"the newest of {count} traces" if count > 1 else "the one trace"
            print(f"{args.trace}: reading {read} ({of} under it)", file=sys.stderr, flush=True)
        report = parse(args.trace, hlo=hlo, step_name=args.step_name or "train")
    except FileNotFoundError as e:
        p.error(f"TRACE={args.trace!r}: {e}")
    except ValueError as e:
        p.error(str(e))
    _print(json.dumps(report.to_dict(), indent=1) if args.json else summary(report))
    return report


# The exit status of a reader's closed pipe (SIGPIPE's), as `yes | head` ends.
PIPE_CLOSED = signal_status(signal.SIGPIPE)


def _print(text: str) -> None:
    """`text` on stdout; where the reader has closed it (`... | head -1`), the tool ends
    quietly with exit status `PIPE_CLOSED`, not a BrokenPipeError traceback."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # Python flushes stdout again as it exits: into /dev/null, not a second error.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(PIPE_CLOSED) from None


if __name__ == "__main__":
    main()
