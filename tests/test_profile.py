"""The trace parser (a GPU trace checked in, a CPU trace recorded here) and the
profiling CLI end to end on simulated CPU devices."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from train import trace
from train.config import parse_args
from train.hlo import parse_hlo
from train.loop import run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 2x H200, tiny model, seq=2 ring, trainer steps 3 and 4 (`--profile_steps 3,5`).
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


def test_mean_and_none_fields():
    b = trace.parse(GPU_TRACE).mean
    assert trace.mean([b, b]) == b
    none = dataclasses.replace(b, attention_ms=None)
    assert trace.mean([b, none]).attention_ms is None
    with pytest.raises(ValueError, match="no Breakdowns"):
        trace.mean([])


def test_ring_benchmark_reads_exposed_communication():
    sys.path.insert(0, ROOT)
    from benchmarks.ring import exposed_communication

    result = exposed_communication(os.path.dirname(GPU_TRACE), iterations=2)
    assert result is not None
    assert 0 <= result["exposed_comm_ms"] <= result["comm_ms"]


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


@pytest.mark.multi_device
def test_cpu_trace_from_the_trainer(tmp_path):
    run(
        parse_args(
            [
                "--model_name_or_path", "tiny",
                "--model_max_length", "64",
                "--sample_num_examples", "16",
                "--mesh", "data=1,fsdp=-1,seq=2",
                "--max_steps", "3",
                "--profile_steps", "1,3",
                "--save_strategy", "no",
                "--export_hf", "false",
                "--progress", "false",
                "--output_dir", str(tmp_path),
            ]
        )
    )  # fmt: skip
    report = trace.parse(os.path.join(tmp_path, "tensorboard"))
    assert report.platform == "cpu"
    assert report.windows == "steps" and report.steps == [1, 2]
    assert len(report.devices) == 8
    b = report.mean
    assert b.step_ms > 0 and 0 <= b.idle_ms <= b.step_ms
    assert b.comm_ms > 0 and b.exposed_comm_ms <= b.comm_ms + 1e-9
    # CPU thunks carry no name stack or kernel class: None, and said why.
    for field in ("forward_ms", "attention_ms", "matmul_ms", "other_ms"):
        assert getattr(b, field) is None and field in report.not_measured


@pytest.mark.multi_device
@pytest.mark.slow
def test_profile_cli_on_cpu(tmp_path):
    out = tmp_path / "profile"
    env = dict(os.environ, PYTHONPATH=ROOT, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    cmd = [sys.executable, "-m", "train.profile", "--models", "tiny", "--context", "256,512"]
    cmd += ["--mesh", "seq=2", "--mesh", "seq=4", "--steps", "2", "--warmup", "1"]
    cmd += ["--out", str(out)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    rows = report["rows"]
    assert [(r["context"], r["mesh"]) for r in rows] == [
        (256, "seq=2"),
        (512, "seq=2"),
        (256, "seq=4"),
        (512, "seq=4"),
    ]
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
    assert "| tiny | 512 | seq=4 |" in md and "ms per device" in md and "| 132.6 |" in md

    (out / "report.md").unlink()
    (out / "scaling.png").unlink()
    subprocess.run(
        [sys.executable, "-m", "train.profile", "--report-only", str(out)],
        env=env,
        cwd=ROOT,
        check=True,
        timeout=120,
    )
    assert (out / "report.md").read_text() == md
    assert (out / "scaling.png").stat().st_size > 5000
