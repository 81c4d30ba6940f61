"""The trace parser (a GPU trace checked in, a CPU trace recorded here) and the
profiling CLI end to end on simulated CPU devices."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import ON_GPU, cpu_devices
from matplotlib.text import Text

from train import data as data_lib
from train import processes, xla_flags
from train.config import parse_args
from train.loop import run
from train.tools import report as report_lib
from train.tools import trace
from train.tools.hlo import parse_hlo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 2x H200, tiny model, seq=2 ring, two traced trainer steps annotated 3 and 4.
GPU_TRACE = os.path.join(ROOT, "tests", "data", "tiny.xplane.pb.gz")
PHASE_FIELDS = ("forward_ms", "backward_ms", "recompute_ms", "update_ms", "idle_ms")
CLASS_FIELDS = ("attention_ms", "matmul_ms", "exposed_comm_ms", "other_ms")


def _close(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * abs(b)


def test_gpu_trace_partitions_and_attribution():
    report = trace.parse(GPU_TRACE)
    assert report.platform == "gpu"
    assert report.windows == "steps" and report.steps == [3, 4]
    assert report.module == "jit_train_step"
    assert sorted(report.devices) == ["gpu:0", "gpu:1"]
    assert report.named_fraction > 0.9
    for device, rows in report.per_step.items():
        assert len(rows) == 2, device
        for b in rows:
            assert b.step_ms > 0 and b.idle_ms >= 0
            assert _close(sum(getattr(b, f) for f in PHASE_FIELDS), b.step_ms, 0.01), b
            assert _close(sum(getattr(b, f) for f in CLASS_FIELDS), b.busy_ms, 0.01), b
            assert b.comm_ms > 0 and b.attention_ms > 0 and b.matmul_ms > 0
            assert b.exposed_comm_ms <= b.comm_ms + 1e-9
            assert b.permute_ms > 0 and b.permute_ms <= b.comm_ms + 1e-9
            assert b.backward_ms > b.forward_ms > 0
            assert b.recompute_ms > 0
            assert b.permute_bytes is None  # needs the compiled HLO
    assert set(report.not_measured) == {"permute_bytes"}
    json.dumps(report.to_dict())


def test_trace_cli_says_its_usage_and_reads_a_trace(tmp_path, capsys):
    """`python -m train.tools.trace` with no trace: one line naming what is missing,
    exit status 2 (not a silent 0); `--help` lists the flags; given a trace, the mean
    per field, `–` and its reason where one is not measured; a path that holds no
    trace: one line naming it."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "train.tools.trace"]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert proc.stderr.startswith("error: the following arguments are required: TRACE")
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    with pytest.raises(SystemExit) as e:
        trace.main(["--help"])
    assert e.value.code == 0
    assert "usage: python -m train.tools.trace" in capsys.readouterr().out
    report = trace.main([GPU_TRACE])
    out = capsys.readouterr().out
    assert out.startswith("gpu, 2 device(s), steps 3, 4, program jit_train_step;")
    assert f"  step (ms): {report.mean.step_ms:.4g}\n" in out
    assert "  permute_bytes: –\n" in out
    assert "– permute_bytes: needs the compiled HLO (collective-permute sizes)" in out
    trace.main([GPU_TRACE, "--json"])
    assert json.loads(capsys.readouterr().out)["steps"] == [3, 4]
    # A folder of traces: the newest is read, and a line on stderr says which.
    import shutil

    for k, run_dir in enumerate(("a", "b")):
        (tmp_path / "runs" / run_dir).mkdir(parents=True)
        copy = shutil.copy(GPU_TRACE, tmp_path / "runs" / run_dir / "h.xplane.pb.gz")
        os.utime(copy, (1e9 + k, 1e9 + k))
    trace.main([str(tmp_path / "runs")])
    said = capsys.readouterr()
    assert said.out.startswith("gpu, 2 device(s), steps 3, 4")
    newest = tmp_path / "runs" / "b" / "h.xplane.pb.gz"
    assert said.err == f"{tmp_path / 'runs'}: reading {newest} (the newest of 2 traces under it)\n"
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit) as e:
        trace.main([str(empty)])
    assert e.value.code == 2
    assert (
        capsys.readouterr().err
        == f"error: TRACE={str(empty)!r}: no *.xplane.pb under {str(empty)!r}\n"
    )
    with pytest.raises(SystemExit) as e:
        trace.main([str(tmp_path / "typo")])
    assert e.value.code == 2
    missing = str(tmp_path / "typo")
    assert capsys.readouterr().err == f"error: TRACE={missing!r}: {missing!r} does not exist\n"


def test_trace_cli_refuses_an_hlo_file_without_instructions(tmp_path, capsys):
    """`--hlo` given a file that holds no HLO (a report, a log): one line naming it, exit
    status 2, not an attribution that silently ignored it."""
    notes = tmp_path / "report.md"
    notes.write_text("# Training profile\n\nno HLO here\n")
    with pytest.raises(SystemExit) as e:
        trace.main([GPU_TRACE, "--hlo", str(notes)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --hlo={str(notes)!r} holds no HLO instructions")
    assert len(err.splitlines()) == 1, err


def test_trace_cli_refuses_the_hlo_of_another_program_or_compile(tmp_path, capsys):
    """`--hlo` must be the compile whose run the trace holds: its name stacks decide
    the phases. Another module's text is refused by name; an XLA dump's file (named
    `module_NNNN.<name>.*` by the module's id, which the trace's events carry as their
    program id) of another compile is refused by its id. The trace's own passes."""
    ops = sorted(
        {
            k.hlo_op
            for ks in trace._gpu_kernels(trace.load(GPU_TRACE)).values()
            for k in ks
            if k.hlo_op
        }
    )
    lines = "".join(f"  %{op} = f32[4]{{0}} fusion(f32[4]{{0}} %p), kind=kLoop\n" for op in ops)
    text = "HloModule MODULE, is_scheduled=true\n\nENTRY %main {\n" + lines + "}\n"

    def refused(name: str, module: str) -> str:
        path = tmp_path / name
        path.write_text(text.replace("MODULE", module))
        with pytest.raises(SystemExit) as e:
            trace.main([GPU_TRACE, "--hlo", str(path)])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1, err
        return err

    err = refused("eval.hlo.txt", "jit_eval_step")
    assert "holds module jit_eval_step, not the trace's program jit_train_step" in err
    err = refused("module_0028.jit_train_step.sm_9.0_gpu_after_optimizations.txt", "jit_train_step")
    assert "is XLA's dump of program 28, but the trace's jit_train_step ran program 3331" in err
    assert "pass module_3331.jit_train_step.*after_optimizations.txt" in err
    # Dumps of two processes share ids (module_0026 in each): the ops must be there too.
    other = text.replace(lines, lines.splitlines()[0] + "\n")
    (tmp_path / "other").mkdir()
    path = tmp_path / "other" / "module_3331.jit_train_step.sm_9.0_gpu_after_optimizations.txt"
    path.write_text(other.replace("MODULE", "jit_train_step"))
    with pytest.raises(SystemExit):
        trace.main([GPU_TRACE, "--hlo", str(path)])
    err = capsys.readouterr().err
    assert re.match(r"error: the HLO \(--hlo\) lacks \d+ of the ops that ran \d+% of", err), err
    assert "it is not the compile this trace ran" in err and len(err.splitlines()) == 1
    path.write_text(text.replace("MODULE", "jit_train_step")[:-3])  # cut short
    with pytest.raises(SystemExit):
        trace.main([GPU_TRACE, "--hlo", str(path)])
    assert "holds no whole ENTRY computation (cut short?)" in capsys.readouterr().err
    own = tmp_path / "module_3331.jit_train_step.sm_9.0_gpu_after_optimizations.txt"
    own.write_text(text.replace("MODULE", "jit_train_step"))
    report = trace.main([GPU_TRACE, "--hlo", str(own)])
    assert report.module == "jit_train_step"
    # The ring's permutes are not in this stand-in's text: no bytes, and why.
    assert report.mean.permute_bytes is None
    assert "– permute_bytes: a collective-permute the trace ran has no size in the HLO" in (
        capsys.readouterr().out
    )


def test_trace_cli_refuses_a_step_name_the_trace_lacks(capsys):
    """`--step-name` naming no annotation in the trace: one line naming it and the trace,
    exit status 2, not the whole trace read as one step; the trainer's name is taken."""
    with pytest.raises(SystemExit) as e:
        trace.main([GPU_TRACE, "--step-name", "step"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: --step-name='step': no such step annotation (with a step_num) in {GPU_TRACE!r}\n"
    )
    assert trace.main([GPU_TRACE, "--step-name", "train"]).steps == [3, 4]


def test_trace_cli_ends_quietly_on_a_closed_pipe():
    """`python -m train.tools.trace TRACE | head -1`: a reader that closed the pipe
    before the summary is written ends the tool quietly, exit status 141 (128 +
    SIGPIPE), no BrokenPipeError traceback."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "train.tools.trace", GPU_TRACE]
    proc = subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    proc.stdout.close()  # closed before the tool has read the trace, let alone printed
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141, err
    assert err == ""


def test_mean_and_none_fields():
    b = trace.parse(GPU_TRACE).mean
    assert trace.mean([b, b]) == b
    none = dataclasses.replace(b, attention_ms=None)
    assert trace.mean([b, none]).attention_ms is None
    with pytest.raises(ValueError, match="no Breakdowns"):
        trace.mean([])


def test_ring_benchmark_reads_device_breakdown():
    sys.path.insert(0, ROOT)
    from benchmarks.ring import BREAKDOWN, device_breakdown

    whole = trace.parse(os.path.dirname(GPU_TRACE)).mean
    result = device_breakdown(os.path.dirname(GPU_TRACE), iterations=2)
    assert result is not None and set(result) == set(BREAKDOWN)
    assert 0 <= result["exposed_comm_ms"] <= result["comm_ms"]
    # Per iteration, and busy time is attention + other compute + exposed comm.
    assert _close(result["busy_ms"] * 2, whole.busy_ms, 1e-9)
    parts = result["attention_ms"] + result["other_ms"] + result["exposed_comm_ms"]
    assert _close(parts, result["busy_ms"], 0.01), result


# Kernel names as the profiler reports FlashAttention-3's (flash-attn3-jax 0.2.3), shortened.
FA3_FWD = (
    "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<"
    "flash::CollectiveMainloopFwdSm90<2, cute::tuple<cute::C<1>, cute::C<1>, cute::C<1> >, "
    "cute::tuple<cute::C<128>, cute::C<128>, cute::C<128> >, 128, cutlass::bfloat16_t> > > >"
    "(flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<int> >::Params)"
)
FA3_BWD = FA3_FWD.replace("FwdSm90", "BwdSm90")


def _convert(tile: int) -> str:
    return (
        "void cutlass::device_kernel<flash::FlashAttnBwdPostprocessConvertdQ<cute::tuple<"
        f"cute::C<{tile}>, cute::C<128> >, cutlass::bfloat16_t> >(Params)"
    )


def test_kernel_labels_tell_templated_kernels_apart():
    """`benchmarks/kernel.py --kernels` and the profile report label kernels by
    `kernel_label`: cutting the raw names made FlashAttention-3's forward and backward
    one label (`void cutlass::device_kernel<flash::enable_sm90_or_later<flas`)."""
    labels = [trace.kernel_label(n) for n in (FA3_FWD, FA3_BWD, _convert(64), _convert(128))]
    assert labels[0].startswith("FlashAttnFwdSm90<CollectiveMainloopFwdSm90<2,")
    assert labels[1].startswith("FlashAttnBwdSm90<")
    assert labels[2].startswith("FlashAttnBwdPostprocessConvertdQ<tuple<C<64>, C<128")
    assert len(set(labels)) == 4 and all(len(x) <= 60 for x in labels)
    assert labels[0].endswith("...") and "::" not in labels[0]
    # Whole when they fit; launchers' brackets and the parameter list go.
    short = "void cutlass::device_kernel<flash::FlashAttnBwdPreprocess<int> >(Params)"
    assert trace.kernel_label(short) == "FlashAttnBwdPreprocess<int>"
    for plain in ("jflash_mosaic_dkv_mosaic_gpu_kernel", "loop_convert_fusion", "nccl_AllGather"):
        assert trace.kernel_label(plain) == plain
    assert trace.kernel_label("x" * 80, width=20) == "x" * 17 + "..."


def test_kernel_durations_sum_the_first_gpu():
    """`benchmarks/kernel.py --kernels` reads this: device time per kernel name on GPU 0."""
    spent = trace.kernel_durations(GPU_TRACE)
    assert spent and list(spent.values()) == sorted(spent.values(), reverse=True)
    data = trace.load(GPU_TRACE)
    gpu0 = trace._gpu_kernels(data)["gpu:0"]
    assert _close(sum(spent.values()), sum(k.end - k.start for k in gpu0), 1e-9)
    assert set(spent) == {k.name for k in gpu0}
    assert trace.kernel_durations(data) == spent

    # The report's top-kernels table: the same numbers per traced step, with a class
    # and the name stack that spent most of each.
    top = trace.top_kernels(data, n=5, steps=2)
    assert [k["name"] for k in top] == list(spent)[:5]
    for k in top:
        assert _close(k["ms"], spent[k["name"]] / 1e6 / 2, 1e-9)
        assert _close(k["share"], spent[k["name"]] / sum(spent.values()), 1e-9)
        assert k["kind"] in ("attention", "matmul", "comm", "memcpy", "other")
    assert any(k["where"] for k in top)
    assert all(k["phase"] in trace.PHASES for k in top)

    # Per phase (the report's update-phase table): each kernel's time in that phase
    # only; over the phases, every kernel's time exactly once.
    per_phase = {p: trace.top_kernels(data, n=10**6, steps=2, phase=p) for p in trace.PHASES}
    assert per_phase["forward"] and per_phase["backward"]
    summed = collections.Counter()
    for ks in per_phase.values():
        for k in ks:
            summed[k["name"]] += k["ms"]
            assert k["ms"] <= spent[k["name"]] / 1e6 / 2 * (1 + 1e-9)
    assert set(summed) == set(spent)
    for name, ns in spent.items():
        assert _close(summed[name], ns / 1e6 / 2, 1e-9)
    with pytest.raises(ValueError, match="phase='loss'"):
        trace.top_kernels(data, phase="loss")

    # By model scope: the class's time on GPU 0, every layer's kernels in one scope.
    for kind in ("other", "matmul"):
        scopes = trace.top_scopes(data, n=10**6, steps=2, kind=kind)
        of_kind = [k for k in gpu0 if trace.kind_of(k, "gpu") == kind]
        assert scopes and _close(
            sum(s["ms"] for s in scopes), sum(k.end - k.start for k in of_kind) / 1e6 / 2, 1e-9
        )
        assert sum(s["launches"] for s in scopes) == len(of_kind) / 2
        assert all(
            s["phase"] in trace.PHASES and "layer_" not in s["scope"].replace("layer_*", "")
            for s in scopes
        )
    assert (
        trace.scope_of("jit(train_step)/transpose(jvp(layer_12))/mlp/mul")
        == "transpose(jvp(layer_*))/mlp"
    )
    assert trace.scope_of("jit(train_step)/add") == "add"
    long = "transpose(jvp(layer_*))/jvp(layer_*)/checkpoint/attention/attention_ring/jit(x)"
    assert report_lib._tail(long, 50) == "…/checkpoint/attention/attention_ring/jit(x)"
    assert report_lib._tail("a/b", 60) == "a/b"

    # Per-device comparison: each kernel's time on every GPU, largest spread first.
    spread = trace.kernel_spread(data, n=4, steps=2)
    per_device = {d: trace._time_per_name(ks) for d, ks in trace._gpu_kernels(data).items()}
    assert len(spread) == 4 and list(spread[0]["ms"]) == ["gpu:0", "gpu:1"]
    assert [r["spread_ms"] for r in spread] == sorted(
        (r["spread_ms"] for r in spread), reverse=True
    )
    for r in spread:
        for d, ms in r["ms"].items():
            assert _close(ms, per_device[d].get(r["name"], 0.0) / 1e6 / 2, 1e-9)
        assert _close(r["spread_ms"], max(r["ms"].values()) - min(r["ms"].values()), 1e-12)
    widest = max(
        (abs(per_device["gpu:0"].get(n, 0) - per_device["gpu:1"].get(n, 0)), n)
        for n in set(per_device["gpu:0"]) | set(per_device["gpu:1"])
    )
    assert spread[0]["name"] == widest[1]


def test_command_buffers_flag():
    """GPU traces name their kernels only with XLA's command buffers off: the check both
    the trainer's and train.tools.profile's warnings use."""
    assert xla_flags.command_buffers_on("")
    assert xla_flags.command_buffers_on("--xla_gpu_autotune_level=0")
    off = "--xla_gpu_autotune_level=0 " + xla_flags.NO_COMMAND_BUFFERS
    assert not xla_flags.command_buffers_on(off)


def test_hlo_facts():
    text = "\n".join(
        [
            "  %ppermute.3 = bf16[2,1,128,2,32]{4,3,2,1,0} collective-permute(%x), "
            'channel_id=1, source_target_pairs={{0,1},{1,0}}, metadata={op_name="jit(f)/'
            'transpose(jvp())/ppermute" stack_frame_id=3}',
            "  %cp-start = (f32[4,8]{1,0}, f32[4,8]{1,0}, u32[], u32[]) "
            "collective-permute-start(%y), channel_id=2",
            '  ROOT %fusion.1 = f32[4]{0} fusion(%a), kind=kLoop, metadata={op_name="jit(f)/'
            'jvp()/add"}',
        ]
    )
    hlo = parse_hlo(text)
    assert hlo.permute_bytes == {"ppermute.3": 2 * 128 * 2 * 32 * 2, "cp-start": 4 * 8 * 4}
    assert hlo.opcodes["fusion.1"] == "fusion"
    assert trace.phase_of(hlo.name_stack("ppermute.3")) == "backward"
    assert trace.phase_of(hlo.name_stack("fusion.1")) == "forward"
    assert hlo.name_stack("missing") == "" and trace.phase_of("") is None

    # A deduplicated fusion's launch carries the jit's root scope in the trace; its HLO
    # op knows the layer and the pass. Without the HLO the trace's stack is used.
    kernel = trace.Kernel(0, 1, "loop_add_fusion_2", "jit(f)", "ppermute.3", "m", "s", 0)
    assert trace._phases([kernel], hlo)[0] == ["backward"]
    assert trace._phases([kernel], None)[0] == ["update"]
    orphan = dataclasses.replace(kernel, hlo_op="missing")
    assert trace._phases([orphan], hlo)[0] == ["update"]


def test_gpu_permutes_are_sized_by_their_name_stack():
    """A GPU trace names a ring transfer as it was before XLA made it asynchronous
    (`ppermute.10.1`); the compiled text calls it `collective-permute-start.N` (as a
    2-GPU H200 step's HLO does). Such events are sized by their jax name stack; where
    one stack sends several transfers (the backward's K/V and f32 dK/dV), by their
    mean, which the step's total keeps."""
    fwd = "jit(train_step)/jvp()/while/body/layer/attention/attention_ring/shard_map/ppermute"
    bwd = "jit(train_step)/transpose(jvp())/while/body/layer/attention_ring/shard_map/ppermute"

    def start(name, dtype, stack):
        return (
            f"  %{name} = (({dtype}[2,1,4096,8,64]{{4,3,2,1,0}}), {dtype}[2,1,4096,8,64]"
            f"{{4,3,2,1,0}}) collective-permute-start(%x), channel_id=1, "
            f'source_target_pairs={{{{0,1}},{{1,0}}}}, metadata={{op_name="{stack}"}}'
        )

    def done(name, dtype, stack):
        return (
            f"  %{name.replace('start', 'done')} = {dtype}[2,1,4096,8,64]{{4,3,2,1,0}} "
            f'collective-permute-done(%{name}), metadata={{op_name="{stack}"}}'
        )

    lines = []
    for name, dtype, stack in (
        ("collective-permute-start.2", "bf16", fwd),
        ("collective-permute-start", "bf16", bwd),
        ("collective-permute-start.1", "f32", bwd),
    ):
        lines += [start(name, dtype, stack), done(name, dtype, stack)]
    hlo = parse_hlo("\n".join(lines))
    kv = 2 * 4096 * 8 * 64 * 2
    assert hlo.permute_size("collective-permute-start.1") == 2 * kv
    assert hlo.permute_size("ppermute.14.1", fwd) == kv
    backward = [hlo.permute_size(op, bwd) for op in ("ppermute.10.1", "ppermute.11.1")]
    assert sum(backward) == kv + 2 * kv
    assert hlo.permute_size("ppermute.3", "jit(train_step)/elsewhere") is None
    assert hlo.permute_size("ppermute.3") is None


@pytest.mark.multi_device(8)
@pytest.mark.skipif(ON_GPU, reason="reads a CPU trace; GPU traces: test_gpu_trace_*")
@pytest.mark.slow
def test_cpu_trace_from_the_trainer(tmp_path):
    run(
        parse_args(
            [
                "--model_name_or_path", "tiny",
                "--data_path", "sample",
                "--model_max_length", "64",
                "--sample_num_examples", "16",
                "--mesh", "data=1,fsdp=-1,seq=2",
                "--max_steps", "3",
                "--profile_steps", "2,4",
                "--save_strategy", "no",
                "--export_hf", "false",
                "--progress", "false",
                "--output_dir", str(tmp_path),
            ]
        )
    )  # fmt: skip
    report = trace.parse(os.path.join(tmp_path, "tensorboard"))
    assert report.platform == "cpu"
    assert report.windows == "steps" and report.steps == [2, 3]  # as the step lines count
    assert len(report.devices) == 8
    b = report.mean
    assert b.step_ms > 0 and 0 <= b.idle_ms <= b.step_ms
    assert b.comm_ms > 0 and b.exposed_comm_ms <= b.comm_ms + 1e-9
    # CPU thunks carry no name stack or kernel class: None, and said why.
    for field in ("forward_ms", "attention_ms", "matmul_ms", "other_ms"):
        assert getattr(b, field) is None and field in report.not_measured


@pytest.mark.skipif(ON_GPU, reason="reads a CPU trace; GPU traces: test_gpu_trace_*")
def test_trainer_trace_off_logging_steps_gives_each_step_its_own_window(tmp_path):
    """A window whose steps are not logging steps (the step's metrics are fetched one
    step late there): on CPU each traced step's runs still begin inside its own step,
    so the trace tool finds steps 3, 4 and 5, not their work counted under later ones."""
    argv = ["--model_name_or_path", "tiny", "--data_path", "sample", "--max_steps", "10"]
    argv += ["--profile_steps", "5,8", "--save_strategy", "no", "--export_hf", "false"]
    argv += ["--progress", "false", "--output_dir", str(tmp_path)]
    env = dict(os.environ, PYTHONPATH=ROOT, **cpu_devices(1))  # one device, as users run it
    done = subprocess.run(
        [sys.executable, "-m", "train", *argv], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = trace.parse(os.path.join(tmp_path, "tensorboard"))
    assert report.windows == "steps" and report.steps == [5, 6, 7], report.steps


@pytest.mark.skipif(ON_GPU, reason="reads a CPU trace; GPU traces: test_gpu_trace_*")
def test_trainer_trace_leaves_an_evaluation_out_of_the_steps(tmp_path):
    """An evaluation inside the --profile_steps window (step 3's, evaluating every
    3 steps) is traced too: the trace tool still reads the training program's steps
    3 and 4, each window ending where the evaluation's work begins, where it read the
    evaluation (the program with the most time) as "the step" and lost step 4."""
    data, held_out = tmp_path / "d.npy", tmp_path / "e.npy"
    np.save(data, data_lib.markov_samples(64, 65, 256, seed=0))
    np.save(held_out, data_lib.markov_samples(256, 65, 256, seed=1))  # longer than 2 steps
    argv = ["--model_name_or_path", "tiny", "--data_path", str(data), "--max_steps", "5"]
    argv += ["--eval_data_path", str(held_out), "--eval_steps", "3", "--logging_steps", "3"]
    argv += ["--profile_steps", "3,5", "--save_strategy", "no", "--export_hf", "false"]
    argv += ["--progress", "false", "--output_dir", str(tmp_path / "run")]
    env = dict(os.environ, PYTHONPATH=ROOT, **cpu_devices(1))
    done = subprocess.run(
        [sys.executable, "-m", "train", *argv], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = trace.parse(os.path.join(tmp_path, "run", "tensorboard"))
    assert report.module == "jit_train_step" and report.steps == [3, 4], (
        report.module,
        report.steps,
    )
    spans = trace._spans(trace.load(os.path.join(tmp_path, "run", "tensorboard")), "eval")
    (device,) = report.per_step
    evaluated = spans[0][1] - spans[0][0]
    assert len(spans) == 1 and report.per_step[device][0].step_ms * 1e6 < evaluated


def _fake_cpu_trace(events: list[tuple[str, str, float, float, dict]]):
    """A `ProfileData` stand-in: one `/host:CPU` plane of (thread, name, start, duration,
    stats) events, as `trace._cpu_kernels` and `trace._step_annotations` read them."""
    from types import SimpleNamespace

    lines = collections.defaultdict(list)
    for thread, name, start, duration, stats in events:
        event = SimpleNamespace(
            name=name, start_ns=start, duration_ns=duration, stats=list(stats.items())
        )
        lines[thread].append(event)
    plane = SimpleNamespace(
        name="/host:CPU",
        lines=[SimpleNamespace(name=k, events=v) for k, v in lines.items()],
    )
    return SimpleNamespace(planes=[plane])


def test_cpu_run_is_launched_when_its_first_thunk_starts():
    """A CPU run's launch (which step it belongs to) is when it began: its first thunk,
    which runs before the host's `Execute (wait for completion)` begins. A step that
    began inside its own annotation stays in that step, although the wait for it
    starts after the next step's annotation."""
    wait = "ThunkExecutor::Execute (wait for completion)"
    thunk = {"hlo_module": "jit_step", "device_ordinal": 0}
    events = [
        ("python", "train", 0, 5, {"step_num": 1}),
        ("python", "train", 10, 5, {"step_num": 2}),
        ("client", wait, 12, 8, {"run_id": 7, "device_ordinal": 0}),
        ("eigen", "fusion", 6, 3, {**thunk, "hlo_op": "fusion", "run_id": 7}),
        ("eigen", "fusion.1", 13, 5, {**thunk, "hlo_op": "fusion.1", "run_id": 7}),
        ("client", wait, 21, 8, {"run_id": 8, "device_ordinal": 0}),
        ("eigen", "fusion", 21, 3, {**thunk, "hlo_op": "fusion", "run_id": 8}),
        ("eigen", "fusion.1", 24, 5, {**thunk, "hlo_op": "fusion.1", "run_id": 8}),
    ]
    data = _fake_cpu_trace(events)
    kernels = trace._cpu_kernels(data)["cpu:0"]
    assert [k.launch for k in kernels] == [6, 6, 21, 21]
    marks = trace._step_annotations(data, "train")
    windows = trace._windows(kernels, [t for t, _ in marks], "jit_step")
    assert [(marks[i][1], s, e) for i, s, e in windows] == [(1, 6, 21), (2, 21, 29)]


def _worker_row(tmp_path, job, devices: int) -> dict:
    """The row `python -m train.tools.profile --worker row` writes for `job`, run in a
    child process on `devices` simulated CPU devices."""
    (tmp_path / "job.json").write_text(json.dumps(dataclasses.asdict(job)))
    cmd = [sys.executable, "-m", "train.tools.profile", "--worker", "row"]
    cmd += [str(tmp_path / "job.json"), str(tmp_path / "row.json")]
    env = dict(os.environ, PYTHONPATH=ROOT, **cpu_devices(devices))
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp_path / "row.json").read_text())


def test_profile_one_device_cpu_row_traces_each_step_in_its_own_window(tmp_path):
    """One device on CPU: the host dispatches the traced steps ahead of the device, and
    each still gets its own window (steps 4, 5 and 6 here, not one window holding
    them all: the trace's step would then be about 3x the timed one). In a worker, as
    the tool runs a row: this process's CPU client runs steps inline."""
    from train.tools.profile import Job

    job = Job(model="tiny", context=256, mesh="seq=1", out=str(tmp_path), steps=2, warmup=1)
    job = dataclasses.replace(job, trace_steps=3, xla_cost=False)
    row = _worker_row(tmp_path, job, devices=1)
    assert row["status"] == "ok", row
    assert row["trace"]["steps"] == [4, 5, 6]
    # Three windows, one per step (above). Their mean against the timed step reads about
    # 1 (one window holding all three would read about 3), up to 2.26 seen under the
    # profiler with the other test worker busy on a 2-core machine: a loose bound.
    assert 0.5 < row["trace_vs_timed"] < 2.7, row["trace_vs_timed"]
    # No ring on one device, and the reason says so (not another --ring_strategy).
    assert "ring" not in row
    assert row["not_measured"]["ring"] == (
        "one device on `seq`: no ring transfers (`--ring_strategy ring` passes K/V blocks "
        "between the devices on `seq`)"
    )


def test_profile_refuses_an_existing_report_and_unknown_models(tmp_path, capsys):
    """Nothing runs, and the earlier report stays, for an --out that holds one (unless
    --append) or a model that is neither a preset nor a directory."""
    from train.tools.profile import main

    (tmp_path / "report.json").write_text('{"rows": [{"name": "kept"}]}')
    for argv, match in (
        (["--models", "tiny", "--out", str(tmp_path)], "holds a report: pass --append"),
        (["--models", "nosuch", "--out", str(tmp_path / "new")], "'nosuch' is neither a preset"),
    ):
        with pytest.raises(SystemExit):
            main(argv)
        assert match in capsys.readouterr().err
    assert json.loads((tmp_path / "report.json").read_text())["rows"] == [{"name": "kept"}]
    assert not (tmp_path / "new").exists()


@pytest.mark.slow
def test_profile_cli_on_cpu(tmp_path):
    out = tmp_path / "profile"
    env = dict(os.environ, PYTHONPATH=ROOT, **cpu_devices(4))
    cmd = [sys.executable, "-m", "train.tools.profile", "--models", "tiny", "--context", "256"]
    cmd += ["--mesh", "seq=2", "--mesh", "seq=4", "--steps", "2", "--warmup", "1"]
    cmd += ["--out", str(out)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    rows = report["rows"]
    assert [(r["context"], r["mesh"]) for r in rows] == [(256, "seq=2"), (256, "seq=4")]
    assert report["ceilings"]["matmul_tflops"] > 0 and report["ceilings"]["copy_gbps"] > 0
    for r in rows:
        assert r["status"] == "ok", r
        assert r["devices"] == int(r["mesh"].split("=")[1])
        assert r["step_ms"] > 0 and r["tokens_per_s"] > 0 and r["tflops_per_device"] > 0
        assert r["compiler_memory_gib"] > 0 and r["peak_memory_gib"] is None  # CPU: no stats
        assert r["hbm_gbps"] > 0 and r["ring"]["bytes_per_step"] > 0 and r["ring"]["gbps"] > 0
        assert r["intensity"]["step"]["intensity"] > 0
        assert r["intensity"]["attention"]["tflops"] is None  # no kernel classes on CPU
        t = r["trace"]
        assert t["platform"] == "cpu" and t["windows"] == "steps"
        assert len(t["devices"]) == r["devices"]
        m = t["mean"]
        assert _close(sum(m[f] for f in PHASE_FIELDS), m["step_ms"], 0.05), m
        assert m["backward_ms"] > 0 and m["forward_ms"] > 0
        assert r["trace_vs_timed"] > 0
        assert (out / r["trace_dir"] / "plugins" / "profile").is_dir()
    names = ["latency_throughput", "memory", "phases", "roofline", "scaling"]
    for name in names:
        assert (out / f"{name}.png").stat().st_size > 5000, name
    md = (out / "report.md").read_text()
    assert "| tiny | 256 | seq=4 |" in md and "ms per device" in md
    # PyTorch + LightSeq's published 4-GPU table stands beside GPU rows only.
    assert "LightSeq" not in md
    on_gpu = {**report, "rows": [{**r, "platform": "gpu"} for r in rows]}
    assert "| 132.6 |" in report_lib.markdown(on_gpu)
    assert "Batch (sequences per data-parallel rank): 1. Attention split over `seq`: " in md
    assert "step lines count: warm-up 1, timed 2..3, traced 4..5." in md
    assert [r["trace"]["steps"] for r in rows] == [[4, 5], [4, 5]]
    assert "- `–` peak memory: the CPU backend reports no memory stats (tiny-256-seq2" in md
    assert "- `–` MFU: no peak FLOP/s known for device cpu in train.metrics." in md
    first_step_intensity = rows[0]["intensity"]["step"]["intensity"]

    (out / "report.md").unlink()
    (out / "scaling.png").unlink()

    def profile_cli(*args, timeout):
        cmd = [sys.executable, "-m", "train.tools.profile", *args]
        subprocess.run(cmd, env=env, cwd=ROOT, check=True, timeout=timeout)

    profile_cli("--report-only", str(out), timeout=120)
    assert (out / "report.md").read_text() == md
    # The GPU-only sections: absent from a CPU trace's report (no GPU kernels), present
    # with the GPU trace's rows filled in.
    sections = [
        ("top_kernels", trace.top_kernels(GPU_TRACE, n=3), "## Top kernels", None),
        (
            "top_update_kernels",
            trace.top_kernels(GPU_TRACE, n=3, phase="update"),
            "## Top kernels of the update phase",
            None,
        ),
        (
            "kernel_spread",
            trace.kernel_spread(GPU_TRACE, n=3),
            "## Kernels that differ between devices",
            "| kernel | class | gpu:0 | gpu:1 | spread |",
        ),
        (
            "top_other_scopes",
            trace.top_scopes(GPU_TRACE, n=3),
            "## Where the other kernels run",
            "| scope | phase | ms | share | launches | largest kernel |",
        ),
    ]
    for key, gpu_rows, heading, header in sections:
        assert all(r[key] == [] for r in rows), key
        assert heading + " " not in md and heading + "\n" not in md, key
        assert gpu_rows, key
        rows[0][key] = gpu_rows
        section_md = report_lib.markdown(report)
        assert heading in section_md, key
        assert header is None or header in section_md, key
        rows[0][key] = []
    assert (out / "scaling.png").stat().st_size > 5000

    # A row timed with --no-xla-cost gets the same XLA bytes from --fill-xla-cost (the
    # trainer's abstract plan, compiled and never run).
    first = dict(rows[0])
    rows[0].update(xla=None, hbm_gbps=None)
    rows[0]["intensity"]["step"] = None
    (out / "report.json").write_text(json.dumps(report))
    profile_cli("--fill-xla-cost", str(out), timeout=300)
    filled = json.loads((out / "report.json").read_text())["rows"][0]
    assert filled["xla"]["bytes"] == first["xla"]["bytes"] > 0
    assert _close(filled["hbm_gbps"], first["hbm_gbps"], 1e-9)
    assert _close(filled["intensity"]["step"]["intensity"], first_step_intensity, 1e-9)


# ----------------------------------------------------------------------------------
# Rows that fail: "does not fit" or "error", and the report is still written


def test_profile_failed_child_classification():
    from train.tools.profile import failed_child

    # XLA raises, then dumps its buffer assignment: the OOM line is far from the end.
    dump = "\n".join(f"  allocation {i}: size 1.0GiB" for i in range(60))
    stderr = (
        "Traceback (most recent call last):\n"
        "jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to "
        "allocate 12.50GiB.\n" + dump
    )
    row = failed_child(1, "", stderr)
    assert row["status"] == "does not fit", row
    assert "Out of memory while trying to allocate 12.50GiB" in row["error"]
    assert "exited with code 1" in row["error"]
    # A CUDA abort with a stack trace after the message.
    frames = "\n".join(f"    @ 0x{i:x} xla::something()" for i in range(30))
    abort = "F0101 cuda_driver.cc:42] Check failed: CUDA_ERROR_OUT_OF_MEMORY\n" + frames
    assert failed_child(-6, "", abort)["status"] == "does not fit"
    # Killed with no output (e.g. the host's OOM killer): an error that says so.
    row = failed_child(-9, "", "")
    assert row == {"status": "error", "error": "killed by signal 9"}
    # The allocator's retry warning is not an out-of-memory failure.
    stderr = (
        "W bfc_allocator.cc] Allocator (GPU_0_bfc) ran out of memory trying to allocate "
        "2.5GiB. The caller indicates that this is not a failure, but this may mean ...\n"
        "ValueError: something else broke"
    )
    row = failed_child(1, "", stderr)
    assert row["status"] == "error" and "something else broke" in row["error"]


def test_profile_job_names_and_passes_its_settings():
    """A row says how it ran (remat, unrolled layers, sharding), in its name, its trainer
    flags, what it records for `--fill-xla-cost`, and the report's label."""
    from train.tools.profile import Job, _trainer_args

    job = Job(model="tiny", context=32768, mesh="seq=2", out="x", remat="save_dots")
    job = dataclasses.replace(job, shard_over_seq=True, scan_layers=False)
    assert job.name == "tiny-32k-seq2-shard_over_seq-save_dots-unrolled"
    cfg = parse_args(_trainer_args(job))
    assert cfg.model.remat_policy == "save_dots" and cfg.model.scan_layers is False
    assert cfg.parallel.shard_over_seq is True
    row = {"mesh": "seq=2", **job.settings()}
    assert report_lib._mesh(row) == "seq=2 +shard_over_seq +save_dots +unrolled"
    assert Job(model="tiny", context=512, mesh="seq=1", out="x").name == "tiny-512-seq1"
    # --layers and --batch: rows that differ only by them have different names.
    small = Job(model="tiny", context=512, mesh="seq=1", out="x", layers=1, batch=2)
    assert small.name == "tiny-512-seq1-layers1-batch2"
    assert parse_args(_trainer_args(small)).run.per_device_train_batch_size == 2
    # Sample data of at least one step's rows: 16 x fsdp over every device (8 rows
    # before, so --batch 16 failed every row).
    wide = dataclasses.replace(small, batch=16, mesh="fsdp=-1")
    assert parse_args(_trainer_args(wide)).data.sample_num_examples == 16 * jax.device_count()
    assert parse_args(_trainer_args(small)).data.sample_num_examples == 8
    row = {"mesh": "seq=1", **small.settings(), **small.facts()}
    assert report_lib._mesh(row) == "seq=1 +layers=1 +batch=2"
    assert small.facts()["steps"] == {"timed": 3, "warmup": 2, "traced": 2}
    once = dataclasses.replace(job, gather_once=True)
    assert once.name == "tiny-32k-seq2-shard_over_seq-gather_once-save_dots-unrolled"
    assert parse_args(_trainer_args(once)).parallel.gather_once is True
    row = {"mesh": "seq=2", "mesh_sizes": {"seq": 2}, **once.settings()}
    assert report_lib._mesh(row) == "seq=2 +shard_over_seq +gather_once +save_dots +unrolled"
    # On one sequence shard there is nothing to shard or gather: the label says so.
    row = {"mesh": "seq=1", "mesh_sizes": {"seq": 1}, **once.settings()}
    assert report_lib._mesh(row) == "seq=1 +save_dots +unrolled"


def test_profile_row_replaces_its_earlier_trace_once_it_succeeded(tmp_path, monkeypatch):
    """A row run again (`--append` replacing a same-name row) leaves one trace session
    in its folder, its own, once it has succeeded; a row that failed or was stopped
    keeps the earlier trace (removed only after the new row succeeded, never before)
    and leaves none of its own, which `trace` would read as the newest."""
    import train.tools.profile as profile

    job = profile.Job(model="tiny", context=256, mesh="seq=1", out=str(tmp_path), steps=1)
    sessions = tmp_path / "tensorboard" / job.name / "plugins" / "profile"
    (sessions / "2020_01_01_00_00_00").mkdir(parents=True)
    (sessions / "2020_01_01_00_00_00" / "host.xplane.pb").write_bytes(b"old")
    seen = []

    def child(kind, payload, timeout, what, status="ok"):
        seen.append(profile.trace_sessions(str(tmp_path), job.name))
        (sessions / f"2030_01_01_00_00_0{len(seen)}").mkdir()
        return {"status": status, "step_ms": 1.0, "tokens_per_s": 1.0, "error": "failed"}

    monkeypatch.setattr(profile, "_child", lambda *args: child(*args, status="error"))
    assert profile._run_row(job, 1.0, {})["status"] == "error"
    assert [p.name for p in sessions.iterdir()] == ["2020_01_01_00_00_00"]

    def stopped(*args):
        child(*args)
        raise KeyboardInterrupt

    monkeypatch.setattr(profile, "_child", stopped)
    with pytest.raises(KeyboardInterrupt):
        profile._run_row(job, 1.0, {})
    assert [p.name for p in sessions.iterdir()] == ["2020_01_01_00_00_00"]
    monkeypatch.setattr(profile, "_child", child)
    assert profile._run_row(job, 1.0, {})["status"] == "ok"
    assert [p.name for p in sessions.iterdir()] == ["2030_01_01_00_00_03"]
    # Nothing was removed before the row ran.
    assert [len(s) for s in seen] == [1, 1, 1]


def test_profile_rows_record_the_ring_strategy(monkeypatch):
    """Every row records the trainer's `--ring_strategy` the tool runs it with (a fact
    of the row, as its steps are: appended runs could differ), also a row that failed."""
    import train.tools.profile as profile

    job = profile.Job(model="tiny", context=256, mesh="seq=2", out="x")
    assert "ring_strategy" in profile.ROW_FACTS
    assert job.facts()["ring_strategy"] == "ring"
    assert parse_args(profile._trainer_args(job)).model.ring_strategy == "ring"
    monkeypatch.setattr(profile, "_child", lambda *args: {"status": "error", "error": "x"})
    assert profile._run_row(job, 1.0, {})["ring_strategy"] == "ring"


def test_profile_ring_strategy_flag_reaches_the_trainer():
    """`--ring-strategy` takes the trainer's `--ring_strategy` values, `auto` included,
    defaults to `ring` (the K/V ring the report measures), and every row's trainer
    flags carry it."""
    from train.config import CHOICES
    from train.tools.profile import _jobs, _trainer_args, build_parser

    parser = build_parser()
    [action] = [a for a in parser._actions if a.dest == "ring_strategy"]
    assert tuple(action.choices) == CHOICES[("model", "ring_strategy")]
    assert "auto" in action.choices and parser.get_default("ring_strategy") == "ring"
    base = ["--models", "tiny", "--context", "256,512", "--mesh", "seq=2"]
    for argv, strategy in ((base, "ring"), (base + ["--ring-strategy", "ulysses"], "ulysses")):
        jobs = _jobs(parser, parser.parse_args(argv))
        assert [job.ring_strategy for job in jobs] == [strategy, strategy]
        for job in jobs:
            assert parse_args(_trainer_args(job)).model.ring_strategy == strategy
    [job] = _jobs(parser, parser.parse_args([*base[:2], "--ring-strategy", "auto"]))
    assert parse_args(_trainer_args(job)).model.ring_strategy == "auto"


def test_profile_row_names_differ_by_ring_strategy():
    """Rows of one model, context and mesh run with different strategies have different
    names (their folders under --out) and mesh labels; the ring, the default, adds
    nothing."""
    from train.tools.profile import Job

    names, labels = [], []
    for strategy in ("ring", "auto", "ulysses", "allgather", "hybrid"):
        job = Job(model="tiny", context=256, mesh="seq=2", out="x", ring_strategy=strategy)
        names.append(job.name)
        labels.append(report_lib._mesh({"mesh": job.mesh, **job.settings(), **job.facts()}))
    assert names == [
        "tiny-256-seq2",
        "tiny-256-seq2-auto",
        "tiny-256-seq2-ulysses",
        "tiny-256-seq2-allgather",
        "tiny-256-seq2-hybrid",
    ]
    assert labels == [
        "seq=2",
        "seq=2 +auto",
        "seq=2 +ulysses",
        "seq=2 +allgather",
        "seq=2 +hybrid",
    ]
    job = Job(model="tiny", context=256, mesh="seq=2", out="x", layers=1, ring_strategy="ulysses")
    assert job.name == "tiny-256-seq2-ulysses-layers1"


def test_profile_rows_record_the_ring_strategy_they_ran(tmp_path, monkeypatch):
    """Each row records the strategy it ran: the one given, or, for `auto`, the one the
    trainer picked in the row's run (`auto` where the row failed before); runs appended
    with other strategies keep their own, and the report says them per row."""
    import train.tools.profile as profile

    payloads = []

    def child(kind, payload, timeout, what):
        if kind == "devices":
            return {"device_count": 2, "platform": "cpu", "device_kind": "cpu"}
        if kind == "ceilings":
            return {}
        payloads.append(payload)
        if payload["context"] == 512:
            return {"status": "error", "error": "failed"}
        row = {k: v for k, v in _report_row(256).items() if k != "name"}
        # the child's row says what the trainer ran: `auto` picked Ulysses at seq=2
        picked = "ulysses" if payload["ring_strategy"] == "auto" else payload["ring_strategy"]
        return {**row, "ring_strategy": picked}

    monkeypatch.setattr(profile, "_child", child)
    out = str(tmp_path / "profile")
    base = ["--models", "tiny", "--mesh", "seq=2", "--out", out, "--no-xla-cost"]
    profile.main([*base, "--context", "256", "--ring-strategy", "ulysses"])
    profile.main([*base, "--context", "256,512", "--ring-strategy", "auto", "--append"])
    profile.main([*base, "--context", "256", "--append"])
    assert [p["ring_strategy"] for p in payloads] == ["ulysses", "auto", "auto", "ring"]
    rows = json.loads((tmp_path / "profile" / "report.json").read_text())["rows"]
    assert {r["name"]: r["ring_strategy"] for r in rows} == {
        "tiny-256-seq2-ulysses": "ulysses",
        "tiny-256-seq2-auto": "ulysses",
        "tiny-512-seq2-auto": "auto",
        "tiny-256-seq2": "ring",
    }
    md = (tmp_path / "profile" / "report.md").read_text()
    assert (
        "Attention split over `seq`: mixed: `--ring_strategy ulysses`, an all-to-all over "
        "the heads, no K/V ring (tiny-256-seq2-ulysses, tiny-256-seq2-auto); "
        "`--ring_strategy ring`, the K/V ring (tiny-256-seq2). Ring GB/s measures the K/V "
        "ring's transfers;"
    ) in md
    assert "| tiny | 256 | seq=2 +ulysses |" in md and "| tiny | 256 | seq=2 |" in md
    one = report_lib.markdown(_report([rows[-1]]))
    assert "Attention split over `seq`: `--ring_strategy ring`, the K/V ring. " in one


def test_an_appended_row_that_fails_keeps_the_rows_earlier_success(tmp_path, monkeypatch, capsys):
    """`--append` re-running a row that succeeded before: where the new run fails (a
    timeout, an error), report.json keeps the earlier row and its trace, and a line
    says so; a row that had failed before is replaced by the new failure."""
    import train.tools.profile as profile

    fail = set()

    def child(kind, payload, timeout, what):
        if kind == "devices":
            return {"device_count": 2, "platform": "cpu", "device_kind": "cpu"}
        if kind == "ceilings":
            return {}
        if payload["context"] in fail:
            return {"status": "error", "error": f"failed at {len(fail)}"}
        return {k: v for k, v in _report_row(payload["context"]).items() if k != "name"}

    monkeypatch.setattr(profile, "_child", child)
    out = tmp_path / "profile"
    base = ["--models", "tiny", "--mesh", "seq=2", "--out", str(out), "--no-xla-cost"]
    fail.add(512)
    profile.main([*base, "--context", "256,512"])
    trace = out / "tensorboard" / "tiny-256-seq2" / "kept.txt"
    trace.parent.mkdir(parents=True, exist_ok=True)
    trace.write_text("the earlier row's trace")
    capsys.readouterr()
    fail.add(256)
    with pytest.raises(SystemExit, match="every row failed"):
        profile.main([*base, "--context", "256,512", "--append"])
    said = capsys.readouterr().out
    assert "row tiny-256-seq2: error this time; report.json keeps its earlier row" in said
    assert "row tiny-512-seq2" not in said
    rows = json.loads((out / "report.json").read_text())["rows"]
    status = {r["name"]: (r["status"], r.get("error")) for r in rows}
    assert status == {"tiny-256-seq2": ("ok", None), "tiny-512-seq2": ("error", "failed at 2")}
    assert trace.read_text() == "the earlier row's trace"


def test_profile_names_a_preset_in_one_spelling(tmp_path, monkeypatch, capsys):
    """A preset given in any spelling `models.preset` takes (`llama3_2_1b`,
    `Llama-3.2-1B`) is the preset as the docs spell it (`llama3.2-1b`): its rows are
    named and recorded so, replace an appended report's rows of the preset (also rows a
    report recorded in another spelling), and the preset given twice in two spellings
    is refused as a row asked for twice; an unknown model's error lists the presets as
    they are typed."""
    import train.tools.profile as profile

    def child(kind, payload, timeout, what):
        if kind == "devices":
            return {"device_count": 2, "platform": "cpu", "device_kind": "cpu"}
        if kind == "ceilings":
            return {}
        return {k: v for k, v in _report_row(256).items() if k not in ("name", "model")}

    def rows(out) -> list[tuple[str, str]]:
        report = json.loads((out / "report.json").read_text())
        return [(r["name"], r["model"]) for r in report["rows"]]

    monkeypatch.setattr(profile, "_child", child)
    out = tmp_path / "profile"
    base = ["--context", "256", "--mesh", "seq=2", "--no-xla-cost", "--out", str(out)]
    profile.main(["--models", "llama3_2_1b", *base])
    assert rows(out) == [("llama3.2-1b-256-seq2", "llama3.2-1b")]
    profile.main(["--models", "Llama-3.2-1B", *base, "--append"])
    assert rows(out) == [("llama3.2-1b-256-seq2", "llama3.2-1b")]
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        profile.main(["--models", "llama3.2-1b,llama3_2_1b", *base, "--append"])
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        "error: row 'llama3.2-1b-256-seq2' is asked for more than once (the same model, "
        "context and --mesh): give each once (nothing was run)\n"
    )
    # A report whose rows recorded the preset in another spelling: replaced, not kept
    # beside the new row.
    old = tmp_path / "old"
    old.mkdir()
    row = _report_row(256, name="llama3_2_1b-256-seq2", model="llama3_2_1b", label="llama3_2_1b")
    (old / "report.json").write_text(json.dumps(_report([row])))
    profile.main(["--models", "llama3.2-1b", *base[:-1], str(old), "--append"])
    assert rows(old) == [("llama3_2_1b-256-seq2", "llama3.2-1b")]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        profile.main(["--models", "llama9", *base[:-1], str(tmp_path / "new")])
    assert capsys.readouterr().err == (
        "error: --models: 'llama9' is neither a preset nor a local HF directory (with a "
        "config.json); presets: llama2-7b, llama2-13b, llama2-3b, llama3-8b, llama3.1-8b, "
        "llama3.2-1b, llama3.2-3b, tiny (nothing was run)\n"
    )
    # A directory that holds no model (a profile's own output, say) is no HF directory.
    with pytest.raises(SystemExit):
        profile.main(["--models", str(old), *base[:-1], str(tmp_path / "new")])
    assert f"--models: {str(old)!r} is neither a preset" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_profile_timeout_is_named_where_a_worker_runs_out_of_it(tmp_path, monkeypatch, capsys):
    """`--timeout` caps every worker: the device count and the ceilings before the rows
    too. Where one runs out, its line names the flag with its value and says to raise
    it: the device count's refuses the run in one line (nothing was run), the ceilings'
    is a warning, a row's is its error."""
    import train.tools.profile as profile

    out = tmp_path / "profile"
    argv = ["--models", "tiny", "--context", "256", "--timeout", "0.01", "--out", str(out)]
    with pytest.raises(SystemExit) as e:
        profile.main(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        "error: counting the devices timed out after 0.01 s (--timeout 0.01; raise it) "
        "(nothing was run)\n"
    )
    assert not out.exists()
    # inf: no limit (the wait takes None; Python's waits refuse an infinite timeout).
    assert profile.this_machine(float("inf"))["device_count"] >= 1
    child = profile._child

    def devices_counted(kind, payload, timeout, what):
        if kind == "devices":
            return {"device_count": 2, "platform": "cpu", "device_kind": "cpu"}
        return child(kind, payload, timeout, what)  # a worker run, out of time at once

    monkeypatch.setattr(profile, "_child", devices_counted)
    with pytest.raises(SystemExit, match="every row failed"):
        profile.main(argv)
    said = capsys.readouterr()
    limit = "timed out after 0.01 s (--timeout 0.01; raise it)"
    assert f"warning: measuring the ceilings {limit}\n" in said.err
    assert f"  error: {limit}\n" in said.out
    assert json.loads((out / "report.json").read_text())["rows"][0]["error"] == limit
    help_text = " ".join(profile.build_parser().format_help().split())
    assert (
        "--timeout TIMEOUT seconds each worker process may run: each row (each row's compile "
        "with --fill-xla-cost), and the device count and ceilings measured before the rows; "
        "inf: no limit (default: 1800)"
    ) in help_text


def test_profile_ulysses_row_says_why_it_has_no_ring_bandwidth(tmp_path):
    """A row whose strategy passes no K/V blocks (Ulysses, all-gather) has no ring
    GB/s, and its reason, one line, names the strategy: here `auto` on 2 CPU devices
    of one host, where the trainer picks Ulysses (the row records the pick). A
    hybrid row without permutes is told apart from one with one device on `seq`."""
    from train.tools.profile import Job, ring_unmeasured

    job = Job(model="tiny", context=256, mesh="seq=2", out=str(tmp_path), steps=1, warmup=1)
    job = dataclasses.replace(job, trace_steps=1, xla_cost=False, ring_strategy="auto")
    row = _worker_row(tmp_path, job, devices=2)
    assert row["status"] == "ok" and row["ring_strategy"] == "ulysses", row
    assert "ring" not in row and row["trace"]["mean"]["permute_ms"] == 0
    ulysses = (
        "`--ring_strategy ulysses` passes no K/V blocks between the devices on `seq` (it "
        "splits attention by an all-to-all over the heads): no ring transfers"
    )
    assert row["not_measured"]["ring"] == ulysses
    md = report_lib.markdown(_report([{**_report_row(256), **row, "name": "tiny-256"}]))
    assert f"- `–` ring GB/s: {ulysses} (tiny-256)" in md.splitlines()
    # Ulysses and all-gather: no ring, even were some collective-permute in the step.
    assert ring_unmeasured("allgather", 2, 3.0, 1e6) == (
        "`--ring_strategy allgather` passes no K/V blocks between the devices on `seq` (it "
        "splits attention by an all-gather of K/V): no ring transfers"
    )
    assert ring_unmeasured("hybrid", 2, 3.0, 1e6) is None  # its ring on `seq`: measured
    assert ring_unmeasured("hybrid", 2, 0.0, None) == (
        "no collective-permute in the traced steps, with 2 devices on `seq` and "
        "`--ring_strategy hybrid`"
    )


def test_report_header_and_ring_reason_split_attention_in_the_same_words():
    """How a strategy splits attention reads alike in the report's header and in the
    reason a row has no ring GB/s."""
    from train.tools.profile import ring_unmeasured

    assert report_lib.strategy_text("allgather") == (
        "`--ring_strategy allgather`, an all-gather of K/V, no K/V ring"
    )
    assert report_lib.strategy_text(None) == "`--ring_strategy ring`, the K/V ring"
    assert report_lib.strategy_text("hybrid") == (
        "`--ring_strategy hybrid`, an all-to-all over the heads on `seq_a2a`, the K/V ring on `seq`"
    )
    for strategy in report_lib.NO_KV_RING:
        how = report_lib.strategy_text(strategy).split(", ")[1]
        assert f"(it splits attention by {how}): " in ring_unmeasured(strategy, 2, 0.0, None)


def test_profile_row_names_of_local_models_are_file_names(tmp_path):
    """A local model's row is named `local-` and its directory's basename (the name is a
    path under --out), made unique where two directories share one; a directory named
    as a preset is never named as the preset's rows are."""
    from models.presets import PRESETS
    from train.tools.profile import Job, labelled, model_labels

    for sub in ("a/llama", "b/llama", "c/my model", "d/llama3.2-1b", "e/tiny"):
        (tmp_path / sub).mkdir(parents=True)
    a, b, spaced, preset_named, tiny = (
        str(tmp_path / sub)
        for sub in ("a/llama", "b/llama", "c/my model", "d/llama3.2-1b", "e/tiny")
    )
    assert model_labels(["tiny", a, b, spaced, a, tiny]) == {
        "tiny": "tiny",
        a: "local-llama",
        b: "local-llama-2",
        spaced: "local-my_model",
        tiny: "local-tiny",
    }
    # No preset's name starts as a local directory's label does.
    assert not any("".join(filter(str.isalnum, key)).startswith("local") for key in PRESETS)
    local = Job(model=preset_named, context=8192, mesh="seq=2", out="x")
    assert local.name == "local-llama3.2-1b-8k-seq2"
    assert Job(model="llama3.2-1b", context=8192, mesh="seq=2", out="x").name == (
        "llama3.2-1b-8k-seq2"
    )
    # --append: a label the report's rows give another model is taken; the one they give
    # this model is kept (its rows replace theirs).
    assert model_labels([b], {"local-llama": a}) == {b: "local-llama-2"}
    assert model_labels([a], {"local-llama": a}) == {a: "local-llama"}
    assert model_labels([a], {"llama": a}) == {a: "llama"}
    assert Job(model=a + "/", context=256, mesh="seq=2", out="x").name == "local-llama-256-seq2"

    # No two rows of different models share a name: an appended report's row of another
    # model (a report whose rows recorded no label, its directory since gone) keeps its
    # name, and the new row takes another.
    jobs = [Job(model=m, context=256, mesh="seq=2", out="x") for m in (a, "tiny")]
    old = [
        {"name": "local-llama-256-seq2", "model": "/gone/llama"},
        {"name": "tiny-256-seq2", "model": "tiny", "label": "tiny"},
    ]
    assert [job.name for job in labelled(jobs, old)] == [
        "local-llama-2-256-seq2",
        "tiny-256-seq2",  # the same model's row: replaced
    ]


@pytest.mark.slow
def test_profile_cli_keeps_a_local_model_row_under_out(tmp_path):
    """`--models /abs/path/to/model`: the row's traces and trainer outputs stay under
    --out (not beside the model directory); the report shows it as its row's name
    begins and names the model's path."""
    import models

    model_dir = tmp_path / "models" / "mine"
    params = models.init_params(models.TINY, jax.random.key(0))
    models.export_hf(jax.device_get(params), models.TINY, model_dir)
    before = sorted(p for p in tmp_path.rglob("*"))
    out = tmp_path / "prof"
    env = dict(os.environ, PYTHONPATH=ROOT, **cpu_devices(2))
    cmd = [sys.executable, "-m", "train.tools.profile", "--models", str(model_dir)]
    cmd += ["--context", "256", "--mesh", "seq=2", "--steps", "1", "--warmup", "0"]
    cmd += ["--trace-steps", "1", "--no-xla-cost", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    new = [p for p in tmp_path.rglob("*") if p not in before and p != out]
    assert new and all(out in p.parents for p in new), [p for p in new if out not in p.parents]
    [row] = json.loads((out / "report.json").read_text())["rows"]
    assert row["status"] == "ok", row
    assert row["name"] == "local-mine-256-seq2" and row["model"] == str(model_dir)
    assert row["trace_dir"] == os.path.join("tensorboard", "local-mine-256-seq2")
    assert (out / row["trace_dir"] / "plugins" / "profile").is_dir()
    # Steps count from 1: step 1 is timed, step 2 traced (the trace's step number).
    assert row["trace"]["steps"] == [2]
    line = "ok: {:.1f} ms/step, {:.0f} tokens/s (timed step 1; traced step 2: slower under "
    assert line.format(row["step_ms"], row["tokens_per_s"]) in proc.stdout, proc.stdout
    md = (out / "report.md").read_text()
    assert "| local-mine | 256 | seq=2 |" in md and f"`local-mine` is `{model_dir}`" in md
    assert row["xla_cost"] is False and "XLA cost analysis not run (--no-xla-cost;" in md


@pytest.mark.multi_device(2)
def test_profile_oom_inside_a_row_is_does_not_fit(tmp_path, monkeypatch):
    import train.build
    from train.tools.profile import Job, _trainer_args, run_row

    def out_of_memory(*args, **kwargs):
        raise RuntimeError(
            "INTERNAL: something first\nRESOURCE_EXHAUSTED: Out of memory while trying to "
            "allocate 99.0GiB."
        )

    monkeypatch.setattr(train.build, "build", out_of_memory)
    job = Job(model="tiny", context=256, mesh="seq=2", out=str(tmp_path), shard_over_seq=True)
    assert job.name == "tiny-256-seq2-shard_over_seq"
    assert parse_args(_trainer_args(job)).parallel.shard_over_seq is True
    row = run_row(job)
    assert row["status"] == "does not fit", row
    assert row["error"].startswith("RESOURCE_EXHAUSTED: Out of memory")
    assert row["shard_over_seq"] is True and row["devices"] == 2


@pytest.mark.slow
def test_profile_cli_failing_rows_keep_the_report(tmp_path):
    """A row whose child fails is an "error" row; --append adds to the report; a run
    whose every row failed exits non-zero (the report is still written)."""
    out = tmp_path / "profile"
    env = dict(os.environ, PYTHONPATH=ROOT, **cpu_devices(2))
    # A local model directory whose config.json the child cannot read: it fails the row.
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    base = [sys.executable, "-m", "train.tools.profile", "--context", "256", "--out", str(out)]
    base += ["--models", str(broken), "--no-xla-cost"]
    second = ["--append", "--reuse-ceilings", "--shard-over-seq", "--steps", "1"]
    for extra in ([], second):
        proc = subprocess.run(
            base + extra, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 1, proc.stderr[-3000:]
        assert "error: every row failed (see report.md)" in proc.stderr
        assert "  error: exited with code 1" in proc.stdout, proc.stdout
        assert ("ceilings: reused" in proc.stdout) == ("--reuse-ceilings" in extra)
    report = json.loads((out / "report.json").read_text())
    assert [r["name"] for r in report["rows"]] == [
        "local-broken-256-seq2",
        "local-broken-256-seq2-shard_over_seq",
    ]
    assert all(r["status"] == "error" for r in report["rows"])
    assert "config.json is missing required keys" in report["rows"][0]["error"]
    assert len(report["commands"]) == 2 and "--append" in report["commands"][1]
    # Each row keeps the steps it was run with, and the report says both.
    assert [r["steps"]["timed"] for r in report["rows"]] == [3, 1]
    assert all(r["xla_flags"] == env["XLA_FLAGS"] for r in report["rows"])
    md = (out / "report.md").read_text()
    assert "mixed: warm-up 1..2, timed 3..5, traced 6..7 (local-broken-256-seq2); " in md
    assert "## Rows that did not run" in md
    assert "| local-broken | 256 | seq=2 +shard_over_seq | error |" in md
    assert "Commands (rows added with `--append`, in order)" in md


def test_profile_refuses_a_row_the_trainer_would_refuse_before_anything_runs(
    tmp_path, monkeypatch, capsys
):
    """A context the sequence axes cannot split, `seq_a2a` without the hybrid strategy
    and a `--mesh` naming no axis: one line naming the row (in the tool's flags), exit
    status 2, before the ceilings run or `--out` is made; not an error row after."""
    import train.tools.profile as profile

    def child(kind, payload, timeout, what):
        if kind == "devices":
            return {"device_count": 2, "platform": "cpu", "device_kind": "cpu"}
        raise AssertionError(f"a {kind} child ran before the rows were checked")

    monkeypatch.setattr(profile, "_child", child)
    out = tmp_path / "profile"
    for argv, said in [
        (["--context", "255", "--mesh", "seq=2"], "row tiny-255-seq2: --context=255 must be "),
        (["--context", "256", "--mesh", "seq_a2a=2"], "but --ring-strategy='ring': the seq_a2a"),
        (["--context", "256", "--mesh="], "--mesh '' names no axis"),
    ]:
        with pytest.raises(SystemExit) as e:
            profile.main(["--models", "tiny", "--no-xla-cost", "--out", str(out), *argv])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert said in err and err.endswith("(nothing was run)\n") and err.count("\n") == 1, err
    assert not out.exists()
    # With the hybrid strategy the seq_a2a row is taken (here the fake child stops it).
    with pytest.raises(AssertionError, match="a ceilings child ran"):
        profile.main(
            ["--models", "tiny", "--no-xla-cost", "--out", str(out), "--context", "256"]
            + ["--mesh", "seq_a2a=2", "--ring-strategy", "hybrid"]
        )


def test_profile_cli_refuses_a_mesh_larger_than_the_machine(tmp_path):
    """`--mesh seq=4` on 2 devices: one line naming the mesh and the machine's device
    count (on CPU, how to simulate more), exit status 2, before the ceilings or any row
    run and before `--out` is made; `--fill-xla-cost` alike for a row whose mesh needs
    more devices than there are."""
    out = tmp_path / "profile"
    env = dict(os.environ, PYTHONPATH=ROOT, **cpu_devices(2))
    cmd = [sys.executable, "-m", "train.tools.profile", "--models", "tiny", "--context", "256"]
    cmd += ["--mesh", "seq=2", "--mesh", "seq=4", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr[-3000:]
    assert proc.stderr == (
        "error: --mesh 'seq=4' needs 4 devices; this machine has 2 (on CPU, "
        "XLA_FLAGS=--xla_force_host_platform_device_count=4 simulates 4) (nothing was run)\n"
    )
    assert "Traceback" not in proc.stderr and proc.stdout == "" and not out.exists()

    timed = tmp_path / "timed"
    timed.mkdir()
    row = _report_row(256, name="tiny-256-seq4", mesh="seq=4", xla=None)
    (timed / "report.json").write_text(json.dumps(_report([row])))
    before = (timed / "report.json").read_text()
    cmd = [sys.executable, "-m", "train.tools.profile", "--fill-xla-cost", str(timed)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr[-3000:]
    assert proc.stderr == (
        "error: --fill-xla-cost: row 'tiny-256-seq4': --mesh 'seq=4' needs 4 devices; this "
        "machine has 2 (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=4 simulates "
        "4) (nothing was run)\n"
    )
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert (timed / "report.json").read_text() == before
    assert sorted(p.name for p in timed.iterdir()) == ["report.json"]


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except (OSError, ValueError):
            continue
        if entry.isdigit() and int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _stop_the_tool_in_a_row(tmp_path, how: str) -> tuple[subprocess.Popen, list[int]]:
    """Starts the tool on a row that runs for long, sends `how` (a signal's name) to it
    while the row's worker runs, and waits for the workers to end (10 s at most): the
    finished tool and the workers still running then (killed before this returns). Its
    temporary folders go to `tmp_path / "tmp"`."""
    import signal
    import time

    out = tmp_path / "profile"
    (tmp_path / "tmp").mkdir()
    env = dict(os.environ, PYTHONPATH=ROOT, TMPDIR=str(tmp_path / "tmp"), **cpu_devices(2))
    argv = ["--models", "tiny", "--context", "256", "--mesh", "seq=2", "--steps", "100000"]
    argv += ["--no-xla-cost", "--out", str(out)]
    # As a terminal starts it: a shell running these tests in the background hands its
    # children SIGINT ignored, and `nohup` SIGHUP, and Python keeps both.
    start = (
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "signal.signal(signal.SIGHUP, signal.SIG_DFL); "
        f"sys.argv = ['profile', *{argv!r}]; runpy.run_module('train.tools.profile', "
        "run_name='__main__')"
    )
    with open(tmp_path / "stdout", "w") as stdout, open(tmp_path / "stderr", "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-c", start], stdout=stdout, stderr=stderr, env=env, cwd=ROOT
        )
    workers = []
    try:
        deadline = time.monotonic() + 120
        while not workers:
            assert proc.poll() is None and time.monotonic() < deadline, (
                tmp_path / "stderr"
            ).read_text()
            if "tiny-256-seq2 ..." in (tmp_path / "stdout").read_text():
                workers = _children(proc.pid)
            time.sleep(0.1)
        time.sleep(1)  # the worker under way (importing jax, compiling)
        proc.send_signal(getattr(signal, how))
        proc.wait(timeout=60)
        gone = time.monotonic() + 10
        while any(map(_alive, workers)) and time.monotonic() < gone:
            time.sleep(0.1)
        return proc, [pid for pid in workers if _alive(pid)]
    finally:
        proc.kill()
        for pid in workers:  # an orphaned worker: not left running after the test
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "SIGHUP"])
def test_profile_stopped_ends_its_running_worker(tmp_path, how):
    """SIGTERM, Ctrl-C or SIGHUP (a closed terminal) to the tool while a row's worker
    runs: the worker and its process group are ended, not orphaned, its temporary
    folder is removed, and the tool exits with one line naming the row (status 143,
    130 for Ctrl-C, 129 for SIGHUP)."""
    proc, running = _stop_the_tool_in_a_row(tmp_path, how)
    assert running == []
    err = (tmp_path / "stderr").read_text()
    status, said = {
        "SIGTERM": (143, "terminated (SIGTERM)"),
        "SIGINT": (130, "interrupted"),
        "SIGHUP": (129, "hung up (SIGHUP)"),
    }[how]
    assert proc.returncode == status, err
    assert err.strip().splitlines()[-1] == (
        f"{said}: the worker (row tiny-256-seq2) was ended; no row had finished"
    ), err
    assert "Traceback" not in err
    assert list((tmp_path / "tmp").glob("*/job.json")) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG: Linux")
def test_profile_killed_outright_takes_its_worker_along(tmp_path):
    """SIGKILL to the tool (nothing it can handle) while a row's worker runs: the
    worker, in its own process group, still ends within seconds."""
    proc, running = _stop_the_tool_in_a_row(tmp_path, "SIGKILL")
    assert proc.returncode == -9
    assert running == []
    # Its worker's temporary folder stays, and names both processes; the tool's next
    # run (here one refused at once) removes it, both having ended.
    [left] = (tmp_path / "tmp").glob("jflash-profile-*")
    owner = json.loads((left / "owner.json").read_text())
    assert owner["tool"] == "train.tools.profile"
    assert [p["pid"] for p in owner["processes"]][0] == proc.pid
    assert len(owner["processes"]) == 2
    env = dict(os.environ, PYTHONPATH=ROOT, TMPDIR=str(tmp_path / "tmp"))
    cmd = [sys.executable, "-m", "train.tools.profile", "--models", "nosuch"]
    cmd += ["--out", str(tmp_path / "again")]
    again = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "'nosuch' is neither a preset" in again.stderr
    assert list((tmp_path / "tmp").iterdir()) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="process start times: /proc")
def test_profile_removes_only_its_own_stale_temporary_folders(tmp_path):
    """`remove_stale_temp` removes a `jflash-profile-*` folder only where its owner
    record is this tool's and every process it names has ended (or its id now belongs
    to a process started later); a folder of a running process, without a record, with
    another tool's or a malformed record, a link, a file or another name stays."""
    from train.tools import profile

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    me = processes.record(os.getpid())
    gone = {"pid": ended.pid, "started": "1"}
    records = {
        "ended": {"tool": "train.tools.profile", "processes": [gone]},
        "ended-worker-too": {"tool": "train.tools.profile", "processes": [gone, gone]},
        "reused-id": {"tool": "train.tools.profile", "processes": [{**me, "started": "1"}]},
        "running": {"tool": "train.tools.profile", "processes": [me]},
        "worker-running": {"tool": "train.tools.profile", "processes": [gone, me]},
        "another-tool": {"tool": "something else", "processes": [gone]},
        "no-processes": {"tool": "train.tools.profile", "processes": []},
        "pid-zero": {"tool": "train.tools.profile", "processes": [{"pid": 0}]},
        "pid-negative": {"tool": "train.tools.profile", "processes": [{"pid": -1}]},
        "pid-text": {"tool": "train.tools.profile", "processes": [{"pid": "1"}]},
        "not-a-dict": ["train.tools.profile"],
    }
    for name, record in records.items():
        (tmp_path / f"jflash-profile-{name}").mkdir()
        (tmp_path / f"jflash-profile-{name}" / "owner.json").write_text(json.dumps(record))
        (tmp_path / f"jflash-profile-{name}" / "job.json").write_text("{}")
    (tmp_path / "jflash-profile-no-record").mkdir()
    (tmp_path / "jflash-profile-malformed").mkdir()
    (tmp_path / "jflash-profile-malformed" / "owner.json").write_text("{not json")
    (tmp_path / "jflash-profile-file").write_text(json.dumps(records["ended"]))
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "owner.json").write_text(json.dumps(records["ended"]))
    (tmp_path / "jflash-profile-link").symlink_to(target)
    (tmp_path / "other-ended").mkdir()
    (tmp_path / "other-ended" / "owner.json").write_text(json.dumps(records["ended"]))
    before = {p.name for p in tmp_path.iterdir()}

    removed = profile.remove_stale_temp(str(tmp_path))
    stale = ["ended", "ended-worker-too", "reused-id"]
    assert sorted(removed) == sorted(str(tmp_path / f"jflash-profile-{n}") for n in stale)
    assert {p.name for p in tmp_path.iterdir()} == before - {f"jflash-profile-{n}" for n in stale}
    assert (target / "owner.json").exists()
    assert profile.remove_stale_temp(str(tmp_path / "missing")) == []


def test_ring_bench_longest_search():
    sys.path.insert(0, ROOT)
    from train.tools.capacity import search_longest

    limit = 5000  # "bytes" per token = 1: the longest that fits is 5000
    calls = []

    def fits_at(seq):
        calls.append(seq)
        return {"fits": seq <= limit, "gib": seq / 1e3}

    best, probes = search_longest(fits_at, 256, 1 << 20, refine=0, granule=256)
    assert best == 4096 and calls == [256, 512, 1024, 2048, 4096, 8192]
    calls.clear()
    best, probes = search_longest(fits_at, 256, 1 << 20, refine=4, granule=256)
    assert calls[:6] == [256, 512, 1024, 2048, 4096, 8192]
    assert calls[6:] == [6144, 5120, 4608, 4864]  # bisection on multiples of 256
    assert best == 4864 and [p["seq"] for p in probes] == calls
    assert all(p["fits"] == (p["seq"] <= limit) for p in probes)
    # Nothing fits, or everything up to the maximum does: no bisection.
    assert search_longest(fits_at, 8192, 1 << 20, refine=4)[0] is None
    assert search_longest(fits_at, 256, 1024, refine=4)[0] == 1024


@pytest.mark.multi_device(2)
@pytest.mark.slow
def test_ring_bench_longest_on_cpu_with_a_limit(tmp_path):
    """`--longest` end to end on simulated devices, with a memory limit given."""
    sys.path.insert(0, ROOT)
    from benchmarks import ring

    out = tmp_path / "ring.json"
    ring.main(
        [
            "--tokens-per-device", "64",
            "--devices", "2",
            "--layouts", "zigzag",
            "--strategies", "ring",
            "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
            "--implementation", "xla",
            "--iters", "1", "--warmup", "0",
            "--longest", "--longest-start", "256", "--longest-max", "65536",
            "--longest-refine", "0", "--longest-limit-gib", "0.002",
            "--interpret", "--out", str(out),
        ]
    )  # fmt: skip
    result = json.loads(out.read_text())["longest"]
    n = len(jax.devices())
    assert result["limit_from"] == "--longest-limit-gib"
    for p in (1, n):
        best = result[f"P{p}_longest"]
        probes = result[f"P{p}_probes"]
        assert best is not None and any(not x["fits"] for x in probes)
        assert max(x["seq"] for x in probes if x["fits"]) == best
        assert all(x["gib"] <= 0.002 for x in probes if x["fits"])
    assert result["ratio"] == result[f"P{n}_longest"] / result["P1_longest"]


# `benchmarks/ring_blocks.py` on CPU: XLA attention, a tiny shape, one timed pass.
_RING_BLOCKS_TINY = [
    "--heads", "2", "--kv-heads", "1", "--head-dim", "16", "--implementation", "xla",
    "--iters", "2", "--warmup", "0", "--trace-iters", "1", "--warm-s", "0", "--interpret",
]  # fmt: skip


@pytest.mark.slow
def test_ring_blocks_bench_on_cpu(tmp_path, capsys):
    """`benchmarks/ring_blocks.py` end to end (XLA attention, tiny shape): every row,
    its time and the ideal's ratio; odd tokens per device are refused by name."""
    sys.path.insert(0, ROOT)
    from benchmarks import ring_blocks

    out = tmp_path / "blocks.json"
    ring_blocks.main(
        [
            "--tokens-per-device", "64", "--devices", "2",
            *_RING_BLOCKS_TINY, "--out", str(out),
        ]
    )  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert not (tmp_path / "blocks.json.partial").exists()  # removed once the run is whole
    names = [r["row"] for r in rows]
    assert names[:3] == ["ideal", "ring_rank0", "ring_rank1"]
    assert {"diag_f32", "block_f32", "diag_bf16", "block_bf16", "block_pair_f32"} <= set(names)
    assert all(r["ms"] > 0 and r["tokens_per_device"] == 64 for r in rows)
    for r in rows:  # device time split in two (a GPU trace), or not at all (CPU)
        if r["device_ms"] is None:
            assert r["attention_ms"] is None and r["other_ms"] is None
        else:
            assert r["attention_ms"] + r["other_ms"] == pytest.approx(r["device_ms"])
    with pytest.raises(SystemExit):
        ring_blocks.main(["--tokens-per-device", "63"])
    assert "tokens per device 63 must be even" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ring_blocks.main(["--documents", "-3"])
    assert "--documents -3: must be a mean length" in capsys.readouterr().err


def test_ring_blocks_keeps_finished_lengths_of_a_stopped_run(tmp_path, monkeypatch):
    """A run stopped during its second length: the first length's rows are in
    `<out>.partial`, and a previous result at `out` is left as it was."""
    sys.path.insert(0, ROOT)
    from benchmarks import ring_blocks

    def stopped(args, done):
        done([{"row": "ideal", "tokens_per_device": args.tokens_per_device[0]}])
        raise KeyboardInterrupt  # killed while timing the next length

    monkeypatch.setattr(ring_blocks, "benchmark", stopped)
    out = tmp_path / "blocks.json"
    out.write_text('{"rows": "the previous run"}')
    with pytest.raises(KeyboardInterrupt):
        ring_blocks.main(["--tokens-per-device", "8192,16384", "--out", str(out), "--interpret"])
    kept = json.loads((tmp_path / "blocks.json.partial").read_text())
    assert kept["partial"] is True and kept["rows"] == [{"row": "ideal", "tokens_per_device": 8192}]
    assert kept.get("interpreted", False) == (not ON_GPU)  # --interpret, without a GPU
    assert json.loads(out.read_text()) == {"rows": "the previous run"}


def test_ring_blocks_rev_times_the_tree_against_a_revision(tmp_path, monkeypatch, capsys):
    """`ring_blocks.py --rev`: the ideal, both ranks and the diagonal block with the
    tree's jflash and a revision's in one process, their time ratio, each one's
    efficiency and how far the revision's results are from the tree's (a revision
    whose rank doubles dQ shows there); flags it cannot take are refused by name."""
    sys.path.insert(0, ROOT)
    from benchmarks import ab, ring_blocks

    try:
        subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    real_import = ab.import_revision

    def import_revision(rev, dest, name=ab.BASELINE):  # the rank's dQ doubled
        module = real_import(rev, dest, name)
        rank = module.ring_attention_rank

        def doubled(*a, **kw):
            o, lse, dq, dkv = rank(*a, **kw)
            return o, lse, 2 * dq, dkv

        return types.SimpleNamespace(
            ring_attention_rank=doubled, flash_attention=module.flash_attention
        )

    monkeypatch.setattr(ab, "import_revision", import_revision)
    out = tmp_path / "ab.json"
    argv = ["--tokens-per-device", "64", "--rev", "HEAD", "--rounds", "1", "--min-time", "0"]
    ring_blocks.main([*argv, "--heat", "0", *_RING_BLOCKS_TINY, "--out", str(out)])
    written = json.loads(out.read_text())
    rows = {r["row"]: r for r in written["rows"]}
    assert list(rows) == ["ideal", "ring_rank0", "ring_rank1", "diag_f32"]
    assert len(written["args"]["rev_commit"]) == 40
    for name, r in rows.items():
        assert r["new_ms"] > 0 and r["rev_ms"] > 0
        assert r["new/rev"] == pytest.approx(r["rev_ms"] / r["new_ms"])
        # Every rank and block result but the ideal's passes through the doubled dQ.
        assert (r["rev_grad_rel_diff"] > 0.1) == (name != "ideal"), name
    for name in ("ring_rank0", "ring_rank1"):
        r = rows[name]
        assert r["new_eff"] == pytest.approx(rows["ideal"]["new_ms"] / r["new_ms"])
        assert r["rev_eff"] == pytest.approx(rows["ideal"]["rev_ms"] / r["rev_ms"])
    assert "new/rev" in capsys.readouterr().out
    for extra, said in (
        (["--documents", "20"], "--rev times the dense rank's rows"),
        (["--variants"], "--rev times the dense rank's rows"),
    ):
        with pytest.raises(SystemExit):
            ring_blocks.main(["--rev", "HEAD", *extra, "--interpret"])
        assert said in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ring_blocks.main(["--rev", "no-such-rev", "--interpret"])
    assert "--rev 'no-such-rev'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ring_blocks.main(["--rev", "HEAD", "--rounds", "0", "--interpret"])
    assert "--rounds 0: at least 1" in capsys.readouterr().err


@pytest.mark.slow
def test_ring_blocks_documents_on_cpu(tmp_path):
    """`ring_blocks.py --documents`: the ideal and every rank of a striped ring over one
    packed row, TFLOP/s on the mask area (the rank's share of it)."""
    sys.path.insert(0, ROOT)
    from benchmarks import ring_blocks

    out = tmp_path / "docs.json"
    ring_blocks.main(
        [
            "--tokens-per-device", "64", "--devices", "3", "--documents", "20",
            "--layout", "striped",
            *_RING_BLOCKS_TINY, "--out", str(out),
        ]
    )  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [r["row"] for r in rows] == ["ideal", "ring_rank0", "ring_rank1", "ring_rank2"]
    assert all(r["layout"] == "striped" and r["documents"] > 3 for r in rows)
    ideal = rows[0]
    for r in rows[1:]:  # the same FLOPs: the whole row's ÷ 3 per rank
        assert r["tflops"] * r["ms"] == pytest.approx(ideal["tflops"] * ideal["ms"], rel=1e-6)
        assert r["eff_vs_ideal"] == pytest.approx(ideal["ms"] / r["ms"])
        assert r["max_abs_diff"] < 0.02  # bf16 outputs: the rank's rows of the whole output


def _report_row(context: int, **changes) -> dict:
    """A measured row as `train.tools.profile` writes it, small numbers as on a CPU."""
    fields = ("forward", "backward", "recompute", "update", "idle", "attention", "matmul")
    mean = {f"{f}_ms": 1.0 for f in fields}
    mean.update(step_ms=5.0, comm_ms=0.0, exposed_comm_ms=0.0, other_ms=1.0, memcpy_ms=0.0)
    row = {
        "name": f"tiny-{context}",
        "status": "ok",
        "model": "tiny",
        "context": context,
        "mesh": "seq=2",
        "layers": 2,
        "devices": 2,
        "step_ms": 5.0,
        "tokens_per_s": 51.2,
        "tflops_per_device": 0.00042,
        "mfu": None,
        "trace_vs_timed": 1.0,
        "trace": {"mean": mean, "not_measured": {}, "named_fraction": 1.0},
        "top_kernels": {},
        "kernel_spread": [],
        "intensity": {"step": {"intensity": 3.0, "tflops": 0.00042}},
        "xla": {"flops": 2.1e9, "bytes": 7e8, "method": "XLA cost analysis"},
        "hbm_gbps": 140.0,
    }
    return {**row, **changes}


def test_report_names_unmeasured_trace_fields_by_their_columns():
    """What the trace could not measure is noted in the tables' words, one line per
    reason: `attention, matmul, other, memcpy (union)`, not `attention_ms`, ...."""
    from train.tools import report as report_lib

    cpu = "CPU thunks do not say which kernel class they are"
    not_measured = {f"{k}_ms": cpu for k in ("attention", "matmul", "other", "memcpy")}
    not_measured["permute_bytes"] = "needs the compiled HLO (collective-permute sizes)"
    row = _report_row(256)
    row["trace"] = {**row["trace"], "not_measured": not_measured}
    md = report_lib.markdown(
        {
            "date": "today",
            "jax": jax.__version__,
            "command": "python -m train.tools.profile",
            "steps": {"timed": 2, "warmup": 1, "traced": 2},
            "rows": [row],
        }
    )
    notes = md.split("## Not measured, and warnings")[1].split("##")[0]
    assert f"- `–` attention, matmul, other, memcpy (union): {cpu} (tiny-256)" in notes
    assert "- `–` ring GB/s: needs the compiled HLO" in notes
    assert "_ms" not in notes and "permute_bytes" not in notes


def test_report_small_ceilings_warnings_and_single_points(tmp_path):
    """A CPU's ceilings keep their significant digits (not `0.0 TFLOP/s`); a row whose
    traced step is far from its timed step is warned about; plots of one context say
    they hold single points."""
    from train.tools import report as report_lib

    report = {
        "date": "today",
        "jax": jax.__version__,
        "command": "python -m train.tools.profile",
        "steps": {"timed": 2, "warmup": 1, "traced": 2},
        "ceilings": {
            "matmul_tflops": 0.0123,
            "copy_gbps": 0.04567,
            "matmul_label": "f32 matmul 512^3 (cpu)",
            "copy_label": "copy of 64 MiB (cpu)",
        },
        "rows": [_report_row(256, trace_vs_timed=1.6)],
    }
    md = report_lib.markdown(report)
    assert "0.0123 TFLOP/s" in md and "0.0457 GB/s" in md and "0.0 TFLOP/s" not in md
    assert "traced/timed = 1.6" in md and "(tiny-256)" in md
    assert "one point per series, not a trend" in md
    written = report_lib.render(report, str(tmp_path))
    assert (tmp_path / "latency_throughput.png").stat().st_size > 5000 and written
    report["rows"] = [_report_row(256), _report_row(512)]
    md = report_lib.markdown(report)
    assert "traced/timed =" not in md and "not a trend" not in md
    assert report_lib.significant(123456.0) == "123,456" and report_lib.significant(0) == "0"


def _report(rows: list[dict]) -> dict:
    """A report.json of `rows` with no ceilings, as `render` takes it."""
    return {
        "date": "today",
        "jax": jax.__version__,
        "command": "python -m train.tools.profile",
        "steps": {"timed": 2, "warmup": 1, "traced": 2},
        "ceilings": {},
        "rows": rows,
    }


def test_report_plots_are_one_table(tmp_path, monkeypatch):
    """Every plot is an entry of `report.PLOTS`, drawn when its rows exist: several
    device counts add `scaling`, an unmeasured kernel split drops `kernels`, and one
    more entry is one more figure, linked from report.md."""
    from train.tools import report as report_lib

    report = _report([_report_row(256), _report_row(512), _report_row(512, devices=4)])
    written = report_lib.render(report, str(tmp_path))
    names = [p.name for p in report_lib.PLOTS]
    assert names[-1] == "scaling" and report_lib.plots_written(report) == names
    assert [os.path.basename(w) for w in written] == ["report.md"] + [f"{n}.png" for n in names]
    assert all(os.path.getsize(w) > 5000 for w in written[1:])

    unmeasured = _report_row(256)
    unmeasured["trace"] = {**unmeasured["trace"], "mean": {**unmeasured["trace"]["mean"]}}
    unmeasured["trace"]["mean"]["attention_ms"] = None
    assert report_lib.plots_written({"rows": [unmeasured]}) == [
        "latency_throughput",
        "memory",
        "phases",
        "roofline",
    ]
    # Several device counts, but never one model and context on two: no scaling plot.
    apart = _report([_report_row(256), _report_row(512, devices=4)])
    assert "scaling" not in report_lib.plots_written(apart)
    assert report_lib._scaling_rows(report["rows"]) == report["rows"][1:]

    extra = report_lib.Plot(
        "flops",
        "Model TFLOP/s per device vs context",
        report_lib._lines(report_lib.Line("tflops_per_device", "TFLOP/s")),
    )
    monkeypatch.setattr(report_lib, "PLOTS", (*report_lib.PLOTS, extra))
    (tmp_path / "more").mkdir()
    written = report_lib.render(report, str(tmp_path / "more"))
    assert written[-1].endswith("flops.png") and os.path.getsize(written[-1]) > 5000
    assert "![flops](flops.png)" in (tmp_path / "more" / "report.md").read_text()


def test_profile_cli_bad_input_is_one_line_error(tmp_path, capsys):
    """A bad flag value or a missing, empty or malformed report.json is refused with
    one line naming the value (`error: ...`, as the trainer's, never argparse's usage
    block or a traceback), exit status 2, before any row runs."""
    from train.tools.profile import main

    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "report.json").write_text("")
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "report.json").write_text('{"rows": [')
    (tmp_path / "list").mkdir()
    (tmp_path / "list" / "report.json").write_text("[]")
    (tmp_path / "afile").write_text("")
    (tmp_path / "one").mkdir()
    (tmp_path / "partial").mkdir()  # a row without its fields: report.md stays as it was
    (tmp_path / "partial" / "report.json").write_text('{"rows": [{"name": "x"}]}')
    (tmp_path / "partial" / "report.md").write_text("the last good report")
    ceilings = {"matmul_tflops": 1.0, "copy_gbps": 1.0, "device": "cpu", "device_count": 1}
    (tmp_path / "one" / "report.json").write_text(json.dumps({"rows": [], "ceilings": ceilings}))
    here = jax.devices()[0].device_kind
    other = "NVIDIA H200" if here != "NVIDIA H200" else "NVIDIA H100 80GB HBM3"  # not this one
    (tmp_path / "h200").mkdir()
    elsewhere = {**ceilings, "device": other, "device_count": 2}
    (tmp_path / "h200" / "report.json").write_text(json.dumps({"rows": [], "ceilings": elsewhere}))
    out = ["--out", str(tmp_path / "new")]
    cases = [
        (["--report-only", str(tmp_path / "empty")], "empty/report.json' is not readable JSON"),
        (["--report-only", str(tmp_path / "cut")], "cut/report.json' is not readable JSON"),
        (["--report-only", str(tmp_path / "list")], "is not a profile report"),
        (["--fill-xla-cost", str(tmp_path / "nowhere")], "nowhere/report.json' does not exist"),
        (["--fill-xla-cost", str(tmp_path / "cut")], "cut/report.json' is not readable JSON"),
        (["--append", "--out", str(tmp_path / "cut")], "--append: '"),
        (["--context", "8k,abc", *out], "--context entry 'abc' is not an int or <int>k"),
        (["--context", "0", *out], "--context entry '0' must be >= 1 token"),
        (["--timeout", "-5", *out], "--timeout=-5.0 must be > 0 and at most 1e+09 seconds, or"),
        (["--timeout", "nan", *out], "--timeout=nan must be > 0 and at most 1e+09 seconds"),
        (["--timeout", "1e300", *out], "--timeout=1e+300 must be > 0 and at most 1e+09 "),
        (["--batch", "0", *out], "--batch=0 must be >= 1"),
        (["--out", str(tmp_path / "afile")], "afile' is a file, not a directory"),
        (["--out", str(tmp_path / "afile" / "sub")], "sub' cannot be created: "),
        (["--models", ",", *out], "--models=',' names no model"),
        (
            ["--mesh", "seq=2", "--mesh", "foo=2", *out],
            "--mesh 'foo=2': unknown axis 'foo'; axes are data, fsdp, seq, seq_a2a "
            "(nothing was run)",
        ),
        (["--mesh", "seq=two", *out], "--mesh 'seq=two': size of 'seq' is not an int: 'two'"),
        (
            ["--report-only", str(tmp_path / "partial")],
            "report.json' is not a whole profile report",
        ),
        (
            ["--append", "--reuse-ceilings", "--mesh", "seq=64", "--out", str(tmp_path / "one")],
            f"--mesh 'seq=64' needs 64 devices; this machine has {jax.device_count()} "
            + (
                "(on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=64 simulates 64) "
                if not ON_GPU
                else ""
            )
            + "(nothing",
        ),
        (["--reuse-ceilings", *out], "--reuse-ceilings needs --append: it reuses the ceilings"),
        (
            ["--models", "tiny,tiny", "--context", "256", *out],
            "row 'tiny-256-seq2' is asked for more than once (the same model, context and "
            "--mesh): give each once (nothing was run)",
        ),
        (["--context", "1k,1024", *out], "row 'llama3.2-1b-1k-seq2' is asked for more than"),
        (["--context", "1k", "--mesh", "seq=1", "--mesh", "seq=1", *out], "-1k-seq1' is asked"),
        (
            ["--context", "1k", "--mesh", "seq=2", "--mesh", "data=1,seq=2", *out],
            "-1k-seq2' is asked for more than once",
        ),
        (["--context", "1k", "--mesh", "data=1", "--mesh", "seq=1", *out], "-1k-seq1' is asked"),
        (
            ["--append", "--reuse-ceilings", "--mesh", "seq=1", "--out", str(tmp_path / "h200")],
            f"--reuse-ceilings: the ceilings in {tmp_path / 'h200' / 'report.json'} were "
            f"measured on {other}, this machine's devices are {here}: drop "
            "--reuse-ceilings to measure them here (nothing was run)",
        ),
        (
            ["--report-only", str(tmp_path / "one"), "--models", "tiny", "--steps", "3"],
            "--report-only takes no other flag (it makes no rows): --models, --steps given",
        ),
        (
            ["--fill-xla-cost", str(tmp_path / "one"), "--timeout", "9", "--append", *out],
            "--fill-xla-cost takes no other flag but --timeout (it makes no rows): --out, "
            "--append given",
        ),
        (["--steps", "x"], "error: argument --steps: invalid int value: 'x' (`python -m "),
        (["--stesp", "3"], "--stesp: did you mean --steps? (`python -m train.tools.profile"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and message in err, (argv, err)
        assert err.startswith("error: ") and err.count("\n") == 1, (argv, err)
    assert not (tmp_path / "new").exists()
    assert (tmp_path / "partial" / "report.md").read_text() == "the last good report"


def _no_space_for_reports(monkeypatch, name: str = "report.json"):
    """`os.replace` onto a file called `name` fails as a full disk does (other files
    move)."""
    replace = os.replace

    def no_space(src, dst):
        if os.path.basename(dst) == name:
            raise OSError(28, "No space left on device")
        replace(src, dst)

    monkeypatch.setattr(os, "replace", no_space)


def test_profile_write_errors_are_one_line_naming_the_flag(tmp_path, monkeypatch, capsys):
    """A report.json that cannot be written (a full disk) ends the tool with one line
    naming the flag that chose the place and the file, not a traceback: `--out` for a
    run's rows, `--fill-xla-cost` for the rows it fills; the earlier report.json stays
    and no `.tmp` is left."""
    import train.tools.profile as profile

    def child(kind, payload, timeout, what):
        if kind == "devices":
            return {"device_count": 2, "platform": "cpu", "device_kind": "cpu"}
        if kind == "xla_cost":
            return {"xla": {"flops": 1e9, "bytes": 1e8, "method": "test"}}
        return {} if kind == "ceilings" else {"status": "error", "error": "failed"}

    monkeypatch.setattr(profile, "_child", child)
    _no_space_for_reports(monkeypatch)
    out = tmp_path / "profile"
    with pytest.raises(SystemExit) as e:
        profile.main(["--models", "tiny", "--context", "256", "--out", str(out)])
    path = out / "report.json"
    assert e.value.code == f"error: --out: cannot write {path} (No space left on device)"
    assert list(out.iterdir()) == []

    timed = tmp_path / "timed"
    timed.mkdir()
    row = _report_row(256, xla=None, hbm_gbps=None, xla_cost=False, device_kind="cpu")
    (timed / "report.json").write_text(json.dumps(_report([row])))
    before = (timed / "report.json").read_text()
    with pytest.raises(SystemExit) as e:
        profile.main(["--fill-xla-cost", str(timed)])
    path = timed / "report.json"
    assert e.value.code == f"error: --fill-xla-cost: cannot write {path} (No space left on device)"
    assert path.read_text() == before
    assert [p.name for p in timed.iterdir()] == ["report.json"]
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("name", ["report.md", "roofline.png"])
def test_report_files_that_cannot_be_written_are_one_line(tmp_path, monkeypatch, capsys, name):
    """report.md or a plot that cannot be written (a full disk) ends the tool with one
    line naming the flag that chose the folder and the file, exit status 1, not a
    traceback: the earlier file stays and no `.tmp` is left."""
    import train.tools.profile as profile

    (tmp_path / "report.json").write_text(json.dumps(_report([_report_row(256)])))
    (tmp_path / name).write_bytes(b"the earlier file")
    _no_space_for_reports(monkeypatch, name)
    with pytest.raises(SystemExit) as e:
        profile.main(["--report-only", str(tmp_path)])
    path = tmp_path / name
    assert e.value.code == f"error: --report-only: cannot write {path} (No space left on device)"
    assert path.read_bytes() == b"the earlier file"
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    with pytest.raises(SystemExit) as e:
        report_lib.render(_report([_report_row(256)]), str(tmp_path), "--fill-xla-cost")
    assert e.value.code.startswith(f"error: --fill-xla-cost: cannot write {path} (")
    assert "Traceback" not in capsys.readouterr().err


def test_a_report_file_that_cannot_be_written_replaces_none_of_the_set(tmp_path, monkeypatch):
    """A plot that cannot be written (the disk full while the third one is saved) leaves
    every earlier file of the set (report.json, report.md, the plots before and after
    it) as it was, and no `.tmp`; a whole set written replaces them all."""
    from matplotlib.figure import Figure

    report = _report([_report_row(256), _report_row(512)])
    written = report_lib.render(report, str(tmp_path), with_json=True)
    assert json.loads((tmp_path / "report.json").read_text()) == report
    files = [tmp_path / "report.json", *map(Path, written)]
    assert len(files) > 4
    for file in files:
        file.write_bytes(b"the earlier " + file.name.encode())
    save, saved = Figure.savefig, []

    def no_space_at_the_third(self, *args, **kwargs):
        saved.append(1)
        if len(saved) == 3:
            raise OSError(28, "No space left on device")
        return save(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", no_space_at_the_third)
    third = Path(written[3])
    with pytest.raises(SystemExit) as e:
        report_lib.render({**report, "date": "later"}, str(tmp_path), with_json=True)
    assert e.value.code == f"error: --out: cannot write {third} (No space left on device)"
    assert {f.name: f.read_bytes() for f in files} == {
        f.name: b"the earlier " + f.name.encode() for f in files
    }
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    monkeypatch.setattr(Figure, "savefig", save)
    report_lib.render({**report, "date": "later"}, str(tmp_path), with_json=True)
    assert json.loads((tmp_path / "report.json").read_text())["date"] == "later"
    assert all(not f.read_bytes().startswith(b"the earlier") for f in files)


def test_out_that_cannot_be_created_is_one_line(tmp_path, monkeypatch, capsys):
    """An --out that passes the up-front checks but cannot be made (a read-only file
    system, /proc; root passes every permission check): one line naming it, exit
    status 2, no traceback and no row run."""
    import errno

    import train.tools.profile as profile

    def child(kind, payload, timeout, what):
        if kind == "devices":
            return {"device_count": 2, "platform": "cpu", "device_kind": "cpu"}
        assert kind == "ceilings", kind  # no row
        return {"matmul_tflops": 1.0, "copy_gbps": 1.0, "device": "cpu", "device_count": 2}

    out = str(tmp_path / "ro" / "profile")
    makedirs = os.makedirs

    def read_only(path, *args, **kwargs):
        if os.fspath(path) == out:
            raise OSError(errno.EROFS, "Read-only file system", path)
        return makedirs(path, *args, **kwargs)

    monkeypatch.setattr(profile, "_child", child)
    monkeypatch.setattr(profile.os, "makedirs", read_only)
    with pytest.raises(SystemExit) as e:
        profile.main(["--models", "tiny", "--context", "256", "--out", out])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: --out={out!r} cannot be created (Read-only file system) (nothing was run)\n"
    )


def test_fill_xla_cost_says_in_the_report_what_it_filled_in(tmp_path, monkeypatch, capsys):
    """`--fill-xla-cost DIR` records in each row it fills (`xla.filled` in report.json)
    the command, the date and the device it compiled on, and the report says in its
    header, and where the columns are defined, which rows' XLA columns were filled in
    afterwards; a row timed with its XLA cost is not named."""
    import train.tools.profile as profile

    def child(kind, payload, timeout, what):
        if kind == "devices":
            return {"device_count": 2, "platform": "cpu", "device_kind": "TPU v9"}
        assert kind == "xla_cost", kind
        return {"xla": {"flops": 2e9, "bytes": 5e8, "method": "test"}}

    monkeypatch.setattr(profile, "_child", child)
    rows = [
        _report_row(256, name="tiny-256", xla=None, hbm_gbps=None, xla_cost=False),
        _report_row(512, name="tiny-512"),
    ]
    rows = [{**r, "device_kind": "TPU v9"} for r in rows]
    (tmp_path / "report.json").write_text(json.dumps(_report(rows)))
    before = report_lib.markdown(_report(rows))
    assert "filled in afterwards" not in before
    profile.main(["--fill-xla-cost", str(tmp_path)])
    report = json.loads((tmp_path / "report.json").read_text())
    filled = report["rows"][0]["xla"]["filled"]
    command = f"python -m train.tools.profile --fill-xla-cost {tmp_path}"
    assert filled["command"] == command and filled["device"] == "TPU v9"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d", filled["date"]), filled
    assert "filled" not in report["rows"][1]["xla"]
    out = capsys.readouterr().out
    assert "tiny-256: XLA cost ..." in out and "nothing to fill" not in out
    profile.main(["--fill-xla-cost", str(tmp_path)])  # again: every row has its cost
    path = tmp_path / "report.json"
    assert capsys.readouterr().out == (
        f"--fill-xla-cost: every row of {path} has XLA's cost already: nothing to fill\n"
        f"wrote {tmp_path / 'report.md'}\n"
    )
    assert json.loads(path.read_text())["rows"][0]["xla"]["filled"] == filled
    md = (tmp_path / "report.md").read_text()
    header = md.split("\n\n")[1]
    assert header.endswith(
        f"HBM GB/s, HBM % of copy and step FLOP/B filled in afterwards, on {filled['date']} "
        f"by `{command}` (compiled on TPU v9, not run), for row tiny-256."
    ), header
    assert "in rows filled in afterwards, as the header says, the bytes of a later" in md
    assert "Step: model FLOPs ÷ XLA's bytes (filled in afterwards in the rows the" in md
    capsys.readouterr()


def test_fill_xla_cost_compiles_each_row_with_its_ring_strategy(tmp_path, monkeypatch, capsys):
    """`--fill-xla-cost` compiles each row's step with the strategy the row ran (a row
    run with `auto` recorded the trainer's pick), not the tool's default; a row that
    recorded none ran the ring."""
    import train.tools.profile as profile

    payloads = []

    def child(kind, payload, timeout, what):
        if kind == "devices":
            return {"device_count": 2, "platform": "cpu", "device_kind": "cpu"}
        payloads.append(payload)
        return {"xla": {"flops": 2e9, "bytes": 5e8, "method": "test"}}

    monkeypatch.setattr(profile, "_child", child)
    unfilled = {"xla": None, "hbm_gbps": None, "xla_cost": False, "device_kind": "cpu"}
    rows = [
        _report_row(256, name="tiny-256-seq2-ulysses", ring_strategy="ulysses", **unfilled),
        _report_row(512, name="tiny-512-seq2-auto", ring_strategy="ulysses", **unfilled),
        _report_row(1024, name="tiny-1024-seq2-hybrid", ring_strategy="hybrid", **unfilled),
        _report_row(2048, name="tiny-2048-seq2", **unfilled),
    ]
    (tmp_path / "report.json").write_text(json.dumps(_report(rows)))
    profile.main(["--fill-xla-cost", str(tmp_path)])
    assert [p["ring_strategy"] for p in payloads] == ["ulysses", "ulysses", "hybrid", "ring"]
    for payload in payloads:
        cfg = parse_args(profile._trainer_args(profile.Job(**payload)))
        assert cfg.model.ring_strategy == payload["ring_strategy"]
    filled = json.loads((tmp_path / "report.json").read_text())["rows"]
    assert [r["ring_strategy"] for r in filled[:3]] == ["ulysses", "ulysses", "hybrid"]
    assert all(r["hbm_gbps"] for r in filled)
    capsys.readouterr()


def test_profile_refuses_an_unknown_ring_strategy_in_one_line(tmp_path, capsys):
    """A `--ring-strategy` that is not one of the trainer's is refused by the parser in
    one line naming the value and the choices, exit status 2, before anything runs."""
    from train.tools.profile import main

    out = tmp_path / "new"
    with pytest.raises(SystemExit) as exit_:
        main(["--models", "tiny", "--ring-strategy", "zigzag", "--out", str(out)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(
        "error: argument --ring-strategy: invalid choice: 'zigzag' (choose from "
    ), err
    assert "auto" in err and "ulysses" in err and not out.exists()


def test_fill_xla_cost_refuses_rows_timed_on_another_device(tmp_path, monkeypatch, capsys):
    """`--fill-xla-cost DIR` on a machine whose devices are of another kind than the one
    a row was timed on (`device_kind` in report.json): bytes compiled here would be
    divided by a step timed there, so it is refused in one line naming both devices,
    exit status 2, before anything is compiled; report.json stays as it was."""
    import train.tools.profile as profile

    ran = []

    def child(kind, payload, timeout, what):
        ran.append(kind)
        if kind == "devices":
            return {"device_count": 2, "platform": "cpu", "device_kind": "cpu"}
        return {"xla": {"flops": 2e9, "bytes": 5e8, "method": "test"}}

    monkeypatch.setattr(profile, "_child", child)
    path = tmp_path / "report.json"
    for device, named in (("NVIDIA H200", "NVIDIA H200"), (None, "an unrecorded device")):
        row = _report_row(256, xla=None, hbm_gbps=None, xla_cost=False, device_kind=device)
        path.write_text(json.dumps(_report([row])))
        before = path.read_text()
        with pytest.raises(SystemExit) as e:
            profile.main(["--fill-xla-cost", str(tmp_path)])
        assert e.value.code == 2 and ran == ["devices"], ran
        assert capsys.readouterr().err == (
            f"error: --fill-xla-cost: row 'tiny-256' in {path} was timed on {named}, this "
            "machine's devices are cpu: fill it in on the kind of device it was timed on "
            "(nothing was run)\n"
        )
        assert path.read_text() == before and sorted(os.listdir(tmp_path)) == ["report.json"]
        ran.clear()


def test_profile_report_only_says_where_it_wrote(tmp_path, capsys):
    """`--report-only DIR` re-renders DIR/report.json and says where, in one line."""
    from train.tools.profile import main

    (tmp_path / "report.json").write_text(json.dumps(_report([_report_row(256)])))
    main(["--report-only", str(tmp_path)])
    assert capsys.readouterr().out == f"wrote {tmp_path / 'report.md'}\n"
    assert (tmp_path / "report.md").is_file()


def test_profile_report_only_names_a_field_of_the_wrong_type(tmp_path, capsys):
    """A hand-edited report.json whose row holds text where a number belongs (or the
    reverse, or a context below 1) is refused in one line naming the row and field,
    not printed into the tables or failing inside the string formatting."""
    from train.tools.profile import main

    path = tmp_path / "report.json"
    for key, value, said in (
        ("step_ms", "fast", 'row 0\'s step_ms "fast" is not a number'),
        ("context", "8k", 'row 0\'s context "8k" is not a number'),
        ("model", 7, "row 0's model 7 is not text"),
        ("context", -256, "row 0's context -256 is not a length"),
    ):
        path.write_text(json.dumps(_report([{**_report_row(256), key: value}])))
        with pytest.raises(SystemExit) as e:
            main(["--report-only", str(tmp_path)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.endswith(f"{str(path)!r}: {said}\n"), err
        assert not (tmp_path / "report.md").exists()


def test_profile_error_row_names_the_exception_first():
    """A child that dies of an exception: the row's error (and the report's one-line
    detail) starts with the exception's line, not with a stack frame."""
    from train.tools.profile import failed_child

    stderr = (
        "Traceback (most recent call last):\n"
        + "".join(f'  File "/x/train/build.py", line {i}, in f\n    g()\n' for i in range(9))
        + "train.errors.TrainingError: --model_name_or_path='nope' is neither a local HF "
        "directory nor a preset (['tiny'])\n"
    )
    row = failed_child(1, "some stdout", stderr)
    assert row["status"] == "error"
    first = row["error"].split("\n")[0]
    assert first.startswith("exited with code 1: train.errors.TrainingError: ")
    assert "'nope' is neither a local HF directory" in first
    failed = {"model": "nope", "context": 256, "mesh": "seq=2", "name": "nope-256-seq2", **row}
    report = _report([failed])
    md = report_lib.markdown(report)
    assert "| error | exited with code 1: train.errors.TrainingError: --model_name_or_path" in md


class _Device:
    """What `train.tools.profile` reads of a jax device."""

    def __init__(self, platform: str, kind: str, stats: dict | None):
        self.platform, self.device_kind, self._stats = platform, kind, stats

    def memory_stats(self):
        return self._stats


def test_report_names_local_models_as_their_rows_do(tmp_path, capsys):
    """A local directory named after a preset (`--models llama3.2-1b` where such a
    folder exists) is shown in the tables and plots as its rows' names begin,
    `local-llama3.2-1b`, never as the preset, and one line says which directory it is;
    a report.json whose rows recorded no label still renders, its models as given."""
    from train.tools.profile import main

    local = _report_row(256, name="local-llama3.2-1b-256", model="llama3.2-1b")
    local["label"] = "local-llama3.2-1b"
    preset = _report_row(256, name="llama3.2-1b-256", model="llama3.2-1b", label="llama3.2-1b")
    failed = {**local, "status": "error", "error": "x", "name": "local-llama3.2-1b-512"}
    report = _report([local, preset, {**failed, "context": 512}])
    md = report_lib.markdown(report)
    tables = [line for line in md.splitlines() if line.startswith("| ")]
    assert sum(line.startswith("| local-llama3.2-1b | 256 | seq=2 |") for line in tables) == 4
    assert sum(line.startswith("| llama3.2-1b | 256 | seq=2 |") for line in tables) == 4
    assert "| local-llama3.2-1b | 512 | seq=2 | error |" in md
    assert (
        "Column `model` names each model as its rows' names begin (a local directory: "
        "`local-` and its basename): `local-llama3.2-1b` is `llama3.2-1b`." in md
    )
    assert list(report_lib._series(_report([local, preset])["rows"])) == [
        "local-llama3.2-1b (seq=2)",
        "llama3.2-1b (seq=2)",
    ]

    old = _report([_report_row(256)])  # rows without `label`
    assert "label" not in old["rows"][0]
    (tmp_path / "report.json").write_text(json.dumps(old))
    main(["--report-only", str(tmp_path)])
    md = (tmp_path / "report.md").read_text()
    assert "| tiny | 256 | seq=2 |" in md and "Column `model` names" not in md
    capsys.readouterr()


def test_report_says_why_mfu_and_peak_memory_are_missing():
    """A `–` for MFU or peak memory has its reason under the throughput table (what the
    device does not report, as the row recorded it, else from its platform); a row with
    both values has none."""
    from train.tools.profile import _not_measured

    cpu = _Device("cpu", "cpu", None)
    assert _not_measured({"mfu": None, "peak_memory_gib": None}, [cpu]) == {
        "mfu": "no peak FLOP/s known for device cpu in train.metrics.PEAK_BF16_FLOPS",
        "peak_memory_gib": "the CPU backend reports no memory stats",
    }
    gpu = _Device("gpu", "NVIDIA H200", {"bytes_in_use": 1})
    assert _not_measured({"mfu": 0.4, "peak_memory_gib": None}, [gpu]) == {
        "peak_memory_gib": "device NVIDIA H200 reports no peak_bytes_in_use"
    }
    assert _not_measured({"mfu": 0.4, "peak_memory_gib": 3.0}, [gpu]) == {}

    recorded = _report_row(256, not_measured=_not_measured({"mfu": None}, [cpu]))
    derived = _report_row(512, platform="cpu", device_kind="cpu")
    measured = _report_row(1024, name="gpu-1k", mfu=0.4, peak_memory_gib=3.0)
    report = {**_report([recorded, derived, measured]), "ceilings": {"copy_gbps": 200.0}}
    md = report_lib.markdown(report)
    throughput = md.split("## Throughput and memory")[1].split("## Kernel classes")[0]
    table_end = throughput.rindex("|")
    lines = throughput[table_end + 1 :].strip().splitlines()
    notes = [x for x in lines if not x.startswith("- `–` ring GB/s")]  # its own test
    assert notes == [
        "- `–` MFU: no peak FLOP/s known for device cpu in train.metrics.PEAK_BF16_FLOPS "
        "(tiny-256, tiny-512)",
        "- `–` peak memory: the CPU backend reports no memory stats (tiny-256, tiny-512)",
    ], throughput
    ring = {"bytes_per_step": 2e9, "permute_ms": 10.0, "gbps": 200.0}
    md = report_lib.markdown({**report, "rows": [{**measured, "ring": ring}]})
    assert "- `–`" not in md


def test_report_says_why_xla_cost_columns_are_missing():
    """HBM GB/s and the step's intensity are `–` without XLA's cost: the report says why
    under each table, naming the rows, and only where that is the reason (a row timed
    with --no-xla-cost, a cost analysis without bytes); `HBM % of copy` is `–` also
    without a measured copy bandwidth, said as such."""
    skipped = _report_row(256, xla_cost=False, xla=None, hbm_gbps=None)
    skipped["intensity"] = {"step": None}
    empty = _report_row(512, xla_cost=True, xla=None, hbm_gbps=None)
    empty["intensity"] = {"step": None}
    analysed = _report_row(1024, xla_cost=True)
    report = {**_report([skipped, empty, analysed]), "ceilings": {"copy_gbps": 200.0}}
    md = report_lib.markdown(report)
    throughput = md.split("## Throughput and memory")[1].split("## Kernel classes")[0]
    intensity = md.split("## Arithmetic intensity")[1].split("\n## ")[0]
    not_run = (
        "XLA cost analysis not run (--no-xla-cost; `python -m train.tools.profile "
        "--fill-xla-cost DIR` computes it) (tiny-256)"
    )
    no_bytes = "XLA's cost analysis reported no bytes accessed (tiny-512)"
    assert [x for x in throughput.splitlines() if x.startswith("- `–` HBM")] == [
        f"- `–` HBM GB/s, HBM % of copy: {not_run}",
        f"- `–` HBM GB/s, HBM % of copy: {no_bytes}",
    ], throughput
    assert intensity.strip().splitlines()[-2:] == [
        f"- `–` step FLOP/B: {not_run}",
        f"- `–` step FLOP/B: {no_bytes}",
    ], intensity
    # The step's TFLOP/s is model FLOPs ÷ step time: known without XLA's bytes.
    assert "| tiny | 256 | seq=2 | – | 0.00042 |" in intensity, intensity
    assert "| tiny | 1k | seq=2 | 5 | 51.2 | 0.00042 | – | 140.0 | 70% |" in throughput
    md = report_lib.markdown({**report, "rows": [analysed]})
    assert "- `–` HBM" not in md and "- `–` step" not in md and "XLA cost" not in md
    md = report_lib.markdown({**report, "rows": [analysed], "ceilings": {}})
    assert "- `–` HBM % of copy: no copy bandwidth measured (tiny-1024)" in md


def test_report_says_where_a_point_is_above_its_measured_roof(tmp_path):
    """A roofline point above the measured roof at its intensity (a matmul at 619.9
    TFLOP/s under a 615.9 TFLOP/s matmul ceiling, a step above the copy bandwidth's line)
    is said under the intensity table, with the rows and why a measured point can be
    there, and ringed in the plot; points under their roof are not named. The roof is
    written alike in that note, the Ceilings section and the plot's legend."""
    import matplotlib.pyplot as plt

    def row(context, matmul_tflops, step=None):
        point = {"flops": 1e12, "bytes": 1e9, "intensity": 1000.0, "tflops": matmul_tflops}
        return _report_row(
            context,
            name=f"tiny-{context}",
            intensity={"step": step, "attention": None, "matmul": point},
        )

    ceilings = {
        "matmul_tflops": 615.86,
        "copy_gbps": 3000.0,
        "matmul_label": "bfloat16 matmul 8192^3 (gpu: NVIDIA H200)",
        "copy_label": "copy of 1024 MiB, read + write (gpu: NVIDIA H200)",
    }
    below = _report([row(256, 575.0), row(512, 606.9)])
    below["ceilings"] = ceilings
    assert "Above the measured" not in report_lib.markdown(below)
    assert report_lib.above_roof(below["rows"], ceilings) == []

    # 30 FLOP/B under 3000 GB/s: a roof of 90 TFLOP/s.
    step = {"flops": 3e12, "bytes": 1e11, "intensity": 30.0, "tflops": 95.0}
    report = _report([row(256, 575.0), row(1024, 619.9), row(2048, 620.5, step=step)])
    report["ceilings"] = ceilings
    md = report_lib.markdown(report)
    intensity = md.split("## Arithmetic intensity")[1].split("## Ceilings")[0]
    assert (
        "- Above the measured matmul roof: matmul TFLOP/s 619.9 > 615.9 (tiny-1024); "
        "620.5 > 615.9 (tiny-2048). That roof is the median rate of one matmul timed at "
        "startup (bfloat16 matmul 8192^3 (gpu: NVIDIA H200)), not the device's limit, and "
        "each point is a measurement too (analytic FLOPs over the traced matmul kernels' "
        "time)"
    ) in intensity
    assert (
        "- Above the measured copy roof: step TFLOP/s 95 > 90 (tiny-2048). That roof is the "
        "point's intensity × the copy bandwidth measured at startup"
    ) in intensity
    assert "(tiny-256)" not in intensity
    ceilings_section = md.split("## Ceilings")[1].split("##")[0]
    assert "- bfloat16 matmul 8192^3 (gpu: NVIDIA H200): 615.9 TFLOP/s" in ceilings_section
    assert "- copy of 1024 MiB, read + write (gpu: NVIDIA H200): 3,000 GB/s" in ceilings_section

    fig, ax = plt.subplots()
    rows = report_lib._ok(report)
    report_lib._roofline()([ax], rows, report)
    [ring] = [line for line in ax.get_lines() if line.get_label() == report_lib.ABOVE_ROOF]
    assert sorted(ring.get_ydata()) == [95.0, 619.9, 620.5]
    labels = [line.get_label() for line in ax.get_lines()]
    assert "ceilings: 615.9 TFLOP/s, 3,000 GB/s (ridge 205.3 FLOP/B)" in labels, labels
    plt.close(fig)


def test_report_says_why_ring_bandwidth_is_missing():
    """`ring GB/s` is `–` where no ring ran (one device on `seq`, Ulysses, all-gather) or
    its bytes are unknown: the report says which, naming the rows, and nothing where
    every row has it."""
    ring = _report_row(256, ring={"bytes_per_step": 2e9, "permute_ms": 10.0, "gbps": 200.0})
    no_ring = _report_row(512, not_measured={"ring": "no collective-permute in the traced steps"})
    unknown = _report_row(1024)
    md = report_lib.markdown(_report([ring, no_ring, unknown]))
    throughput = md.split("## Throughput and memory")[1].split("## Kernel classes")[0]
    assert [x for x in throughput.splitlines() if x.startswith("- `–` ring")] == [
        "- `–` ring GB/s: no collective-permute in the traced steps (tiny-512)",
        "- `–` ring GB/s: no ring transfer recorded (tiny-1024)",
    ], throughput
    assert "| 200.0 |" in throughput
    assert "- `–` ring" not in report_lib.markdown(_report([ring]))


def test_steps_are_numbered_from_one_everywhere():
    """Warm-up, timed and traced steps count from 1 in each row's run, as the trainer's
    step lines do: in the report, the CLI's help (its defaults) and the row's line;
    the tokens/s are said to come from the timed steps, not the traced ones."""
    from train.tools.profile import build_parser

    for steps, text in (
        ({"timed": 1, "warmup": 1, "traced": 1}, "warm-up 1, timed 2, traced 3."),
        ({"timed": 3, "warmup": 2, "traced": 2}, "warm-up 1..2, timed 3..5, traced 6..7."),
        ({"timed": 2, "warmup": 0, "traced": 1}, "warm-up none, timed 1..2, traced 3."),
    ):
        md = report_lib.markdown({**_report([_report_row(256)]), "steps": steps})
        assert f"step lines count: {text}" in md, md
    assert "the traced steps, slower under the profiler, are not timed" in md
    throughput = md.split("## Throughput and memory")[1].split("|")[0]
    assert "tokens/s, TFLOP/s and MFU: the timed steps" in throughput
    assert "none of the traced steps (slower under the profiler: not timed" in throughput
    parser = build_parser()
    defaults = {
        "warmup": parser.get_default("warmup"),
        "timed": parser.get_default("steps"),
        "traced": parser.get_default("trace_steps"),
    }
    spans = report_lib.step_spans(defaults)
    help_text = " ".join(parser.format_help().split())
    assert "steps count from 1 in each row, as the trainer's step lines do" in help_text
    for part, flag in (("warmup", "--warmup"), ("timed", "--steps"), ("traced", "--trace-steps")):
        metavar = flag[2:].upper().replace("-", "_")
        said = re.search(rf"{flag} {metavar} ([^\[\]]*?) --[a-z]", help_text).group(1)
        default = parser.get_default(flag[2:].replace("-", "_"))
        assert f"with the defaults, steps {spans[part]}; default: {default})" in said, (flag, said)
    assert report_lib.timing_text(defaults) == (
        "timed steps 3..5; traced steps 6..7: slower under the profiler, not timed"
    )
    assert report_lib.timing_text({"warmup": 0, "timed": 1, "traced": 1}) == (
        "timed step 1; traced step 2: slower under the profiler, not timed"
    )
    md = report_lib.markdown({**_report([_report_row(256)]), "layers_override": 1})
    assert "every model runs 1 layer**" in md


def test_profile_help_says_the_defaults_and_what_models_are():
    """`--help`: a whole sentence for what the tool does, the defaults of `--models`,
    `--context` and `--out`, and that a model is a preset or a local HF model folder."""
    from train.tools.profile import build_parser

    text = " ".join(build_parser().format_help().split())
    assert (
        "communication time, bandwidth and memory per model and context, measured from "
        "traces. options:"
    ) in text
    for flag, default in (
        ("--models", "llama3.2-1b"),
        ("--context", "8k"),
        ("--out", "runs/profile"),
    ):
        said = re.search(rf"{flag} {flag[2:].upper()} (.*?) --[a-z]", text).group(1)
        assert said.endswith(f"(default: {default})"), (flag, said)
    assert "presets (llama3.2-1b, llama2-7b, tiny" in text
    assert "or local HF model folders" in text


def test_report_says_how_each_row_ran_where_appended_runs_differ():
    """Rows added with --append keep their own steps, --layers, XLA_FLAGS and jax: the
    report states a fact once where the rows agree and per row where they differ, never
    the newest run's value for all (a report.json that recorded them once for all rows
    still renders, and appending to it keeps them for its rows)."""
    from train.tools.profile import with_row_facts

    old = {
        **_report([_report_row(256)]),
        "xla_flags": "--old",
        "layers_override": None,
        "jax": "0.10.0",
    }
    appended = with_row_facts(old)
    assert "steps" not in appended and "xla_flags" not in appended
    assert appended["rows"][0]["steps"] == {"timed": 2, "warmup": 1, "traced": 2}
    assert appended["rows"][0]["xla_flags"] == "--old"
    assert report_lib.markdown(appended) == report_lib.markdown(old)
    new = _report_row(
        512,
        name="tiny-512-layers1",
        steps={"timed": 3, "warmup": 2, "traced": 2},
        layers_override=1,
        layers=1,
        xla_flags="",
        jax="0.11.2",
    )
    appended["rows"].append(new)
    md = report_lib.markdown(appended)
    assert (
        "step lines count: mixed: warm-up 1, timed 2..3, traced 4..5 (tiny-256); "
        "warm-up 1..2, timed 3..5, traced 6..7 (tiny-512-layers1)."
    ) in md
    assert "XLA_FLAGS: mixed: `--old` (tiny-256); `(none)` (tiny-512-layers1)." in md
    assert "mixed: jax 0.10.0 (tiny-256); jax 0.11.2 (tiny-512-layers1)" in md
    assert (
        "**Layers overridden in some rows** (column `layers`): mixed: the preset's layers "
        "(tiny-256); 1 layer (tiny-512-layers1)."
    ) in md
    assert "every model runs" not in md
    assert "| tiny | 512 | seq=2 +layers=1 |" in md
    md = report_lib.markdown(_report([new]))
    assert "mixed" not in md and "step lines count: warm-up 1..2, timed 3..5, traced 6..7." in md
    assert "every model runs 1 layer**" in md and "XLA_FLAGS: `(none)`." in md


def test_single_point_note_covers_no_point(tmp_path, monkeypatch):
    """With one context per series, the plots say so where no data point is: the note
    never overlaps a drawn marker (the memory plot's two series sit at the bottom and
    top of the axes)."""
    from matplotlib.text import Text

    figures = []
    monkeypatch.setattr(report_lib.plt, "close", figures.append)
    row = _report_row(256, peak_memory_gib=1.0, compiler_memory_gib=2.0)
    report = _report([row, _report_row(256, name="tiny-256-b", mesh="seq=1", step_ms=9.0)])
    assert report_lib.single_point(report_lib._ok(report))
    report_lib.render(report, str(tmp_path))
    assert len(figures) == len(report_lib.plots_written(report))
    checked = 0
    for fig in figures:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        notes = [t for t in fig.findobj(Text) if "single points" in t.get_text()]
        for ax in fig.axes:
            points = []
            for line in ax.get_lines():
                if line.get_marker() in (None, "None", "", " "):
                    continue
                radius = line.get_markersize() / 72 * fig.dpi / 2
                xy = line.get_transform().transform(line.get_xydata())
                points += [(x, y, radius) for x, y in xy]
            for note in notes:
                box = note.get_window_extent(renderer)
                for x, y, r in points:
                    inside = box.x0 - r <= x <= box.x1 + r and box.y0 - r <= y <= box.y1 + r
                    assert not inside, (fig.texts, note.get_text(), (x, y), box)
                    checked += 1
    assert checked > 0


def _many_rows() -> list[dict]:
    """A report's rows as a three-mesh, four-context run of two models gives them: long
    mesh labels, and roofline points of one kind close together."""
    rows = []
    for m, model in enumerate(("llama2-7b", "llama3.2-1b")):
        for s, mesh in enumerate(("seq=1", "seq=2", "seq=4")):
            for c, context in enumerate((8192, 16384, 32768, 65536)):
                i = 1 + 0.04 * (c + 4 * s + 12 * m)
                row = _report_row(context, name=f"{model}-{context}-{mesh}", mesh=mesh)
                row.update(model=model, devices=int(mesh[-1]), mesh_sizes={"seq": int(mesh[-1])})
                row.update(shard_over_seq=m == 0, gather_once=m == 0, step_ms=5.0 * i)
                row["intensity"] = {
                    kind: {"intensity": x * i, "tflops": y * i}
                    for kind, x, y in (
                        ("step", 30, 100),
                        ("attention", 300, 300),
                        ("matmul", 250, 500),
                    )
                }
                rows.append(row)
    return rows


def _boxes_overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_plot_labels_do_not_overlap(tmp_path, monkeypatch):
    """Many rows: the bar plots grow wider with their bars and name each mesh once under
    its bars, and the roofline's context labels sit apart (leader lines where moved):
    no two labels' boxes, as the renderer draws them, overlap, and no roofline label
    covers a marker."""
    figures = []
    monkeypatch.setattr(report_lib.plt, "close", figures.append)
    ceilings = {"matmul_tflops": 800.0, "copy_gbps": 4000.0, "matmul_label": "m", "copy_label": "c"}
    report = {**_report(_many_rows()), "ceilings": ceilings}
    report_lib.render(report, str(tmp_path))
    drawn = dict(zip(report_lib.plots_written(report), figures, strict=True))
    for name in ("phases", "kernels"):
        fig = drawn[name]
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        texts = [t for ax in fig.axes for t in [*ax.get_xticklabels(), *ax.texts, ax.title]]
        boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts if t.get_text()]
        assert len(boxes) > 2 * 12, name
        for i, (text, box) in enumerate(boxes):
            inside = box.x0 >= 0 and box.x1 <= fig.bbox.x1 and box.y0 >= 0
            assert inside, (name, text, box, fig.bbox)
            for other, box2 in boxes[i + 1 :]:
                assert not _boxes_overlap(box, box2), (name, text, other)
    fig = drawn["roofline"]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (ax,) = fig.axes
    labels = [Text.get_window_extent(t, renderer) for t in ax.texts]  # without leader lines
    assert len(labels) == 3 * len(report["rows"])
    markers = []
    for line in ax.get_lines():
        if line.get_marker() not in (None, "None", "", " ") and len(line.get_xydata()):
            r = line.get_markersize() / 72 * fig.dpi / 2
            markers += [(x, y, r) for x, y in line.get_transform().transform(line.get_xydata())]
    frame = ax.get_window_extent(renderer)
    for i, box in enumerate(labels):
        assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0
        assert box.y1 <= frame.y1, (box, frame)
        assert not any(_boxes_overlap(box, other) for other in labels[i + 1 :]), i
        for x, y, r in markers:
            assert not (box.x0 - r < x < box.x1 + r and box.y0 - r < y < box.y1 + r), (i, x, y)

    # Wider with more bars: a model of four rows keeps the panel's least width.
    few = {**report, "rows": report["rows"][:4]}
    widths = {}
    for name, rows in (("few", few), ("many", report)):
        figures.clear()
        report_lib.draw_plot(report_lib.PLOTS[2], rows, str(tmp_path / f"{name}.png"))
        widths[name] = figures[0].get_size_inches()[0]
    assert report_lib.PLOTS[2].name == "phases"
    assert widths["few"] == report_lib.PLOTS[2].panel_size[0]
    assert widths["many"] / 2 > 1.5 * widths["few"]  # per panel: three meshes' bars


def test_unreadable_traces_are_named(tmp_path):
    """An empty or corrupt .xplane.pb is a ValueError naming the file, not a bare
    parser error or a claim that the trace has no kernels."""
    empty = tmp_path / "a" / "host.xplane.pb"
    empty.parent.mkdir()
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"host.xplane.pb' is empty"):
        trace.parse(str(tmp_path / "a"))
    corrupt = tmp_path / "b.xplane.pb"
    corrupt.write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match=r"b.xplane.pb' is not a readable jax.profiler trace"):
        trace.parse(str(corrupt))


def test_profile_dir_that_cannot_be_created_is_refused_before_training(tmp_path):
    (tmp_path / "afile").write_text("")
    argv = ["--model_name_or_path", "tiny", "--data_path", "sample", "--max_steps", "2"]
    argv += ["--output_dir", str(tmp_path / "run"), "--profile_steps", "1,2"]
    with pytest.raises(Exception, match=r"--profile_dir='.*afile/sub' cannot be created"):
        run(parse_args([*argv, "--profile_dir", str(tmp_path / "afile" / "sub")]))
    assert not (tmp_path / "run").exists()


def test_peak_flops_tells_the_pcie_and_nvl_cards_from_the_sxm_parts():
    """MFU's peak by device kind: an H100 PCIe or NVL is not an SXM H100 (a part of its
    name), nor an H200 NVL an H200 or a GB200 a B200; a GH200 is an H200; an unknown
    device has none."""
    from types import SimpleNamespace

    from train.metrics import peak_flops

    kinds = {
        "NVIDIA H100 80GB HBM3": 989e12,
        "NVIDIA H100 PCIe": 756e12,
        "NVIDIA H100 NVL": 835e12,
        "NVIDIA H200": 989e12,
        "NVIDIA H200 NVL": 835e12,
        "NVIDIA GH200 480GB": 989e12,
        "NVIDIA B200": 2250e12,
        "NVIDIA GB200": 2500e12,
        "NVIDIA A100-SXM4-80GB": 312e12,
        "NVIDIA H20": None,
        "cpu": None,
    }
    for kind, peak in kinds.items():
        assert peak_flops(SimpleNamespace(device_kind=kind)) == peak, kind


def test_profile_mesh_has_one_spelling():
    """`--mesh` specs naming the same sizes are one mesh, written in the mesh's axis
    order with axes of size 1 left out; a -1 is kept."""
    from train.tools.profile import canonical_mesh

    for spec, one in (
        ("seq=2", "seq=2"),
        ("data=1,seq=2", "seq=2"),
        ("seq=2, fsdp=2", "fsdp=2,seq=2"),
        ("seq_a2a=2,seq=2,data=1", "seq=2,seq_a2a=2"),
        ("fsdp=-1", "fsdp=-1"),
        ("data=1", "seq=1"),
    ):
        assert canonical_mesh(spec) == one, spec
