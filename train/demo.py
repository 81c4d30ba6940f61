"""`make demo`: the main job end to end on whatever devices are here.

1. makes a tiny Llama-3-style model (tied embeddings, llama3 RoPE scaling) and writes it
   as a HuggingFace directory with `models.export_hf` (nothing is downloaded);
2. makes learnable sample documents of different lengths (Markov chains, as
   `python -m train.data sample` writes);
3. trains it through the HF conversion path with `configs/demo.yaml`: the documents
   packed into rows (attention and RoPE positions per document, EOS between them),
   sequence over 2 devices (ring attention, zigzag) x FSDP over 2, checkpoints,
   TensorBoard scalars, a JSONL log, one `jax.profiler` trace; on a CPU machine 4
   simulated devices;
4. writes the metrics report (`python -m train.tools.profile`) for the same mesh.

Everything lands under `runs/demo/`, which the demo owns: a rerun makes the model and
data again (`--keep` reuses them) and replaces its training run once the new one's step
has compiled. Other trainer flags pass through (`--max_steps 60`); the model, data,
config and output directory are the demo's own and refused.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys

from train.xla_flags import NO_COMMAND_BUFFERS, command_buffers_on  # imports no jax

if "jax" not in sys.modules and "--xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""
):
    # Only affects the CPU backend: a GPU machine uses its real GPUs.
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()
if "jax" not in sys.modules and command_buffers_on():
    # Only affects GPUs: the demo's trace and its metrics report attribute kernels to
    # phases and name scopes, which kernels run as CUDA graphs do not carry.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + NO_COMMAND_BUFFERS).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402

import models  # noqa: E402
from train import data as data_lib  # noqa: E402
from train import outputs  # noqa: E402
from train.build import profile_window  # noqa: E402
from train.config import parse_args, shipped_config  # noqa: E402
from train.errors import Preempted, signal_status  # noqa: E402
from train.loop import TrainingError, run  # noqa: E402

RUN_DIR = os.path.join("runs", "demo")
CONFIG = shipped_config("demo.yaml")
DOCUMENTS = 512  # the sample documents the demo writes and trains on


def tiny_llama3() -> models.LlamaConfig:
    rope = models.RopeConfig(
        theta=500000.0,
        type="llama3",
        factor=32.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=128,
    )
    return models.TINY.replace(tie_word_embeddings=True, rope=rope, vocab_size=512)


def documents(cfg, config: models.LlamaConfig) -> list[np.ndarray]:
    """Sample documents of 1/4 to all of `model_max_length` tokens: several share a
    packed row, and some cross from one row into the next."""
    seq_len = cfg.data.model_max_length
    samples = data_lib.markov_samples(DOCUMENTS, seq_len, config.vocab_size, seed=0)
    lengths = np.random.default_rng(0).integers(seq_len // 4, seq_len + 1, size=len(samples))
    return [sample[:n] for sample, n in zip(samples, lengths, strict=True)]


def _write_model(config: models.LlamaConfig, hf_dir: str) -> None:
    """The demo's HF model, written beside and then moved over an earlier one."""
    fresh = hf_dir + ".new"
    if os.path.isdir(fresh):
        shutil.rmtree(fresh)
    params = models.init_params(config, jax.random.key(0))
    models.export_hf(jax.tree.map(jax.device_get, params), config, fresh)
    if os.path.isdir(hf_dir):
        shutil.rmtree(hf_dir)
    os.rename(fresh, hf_dir)


def _fit_profile_window(cfg, argv: list[str]):
    """The config's traced steps moved to a run's last three where `--max_steps` ends the
    run before them (a shorter demo, `--max_steps 20`) and no `--profile_steps` was
    given, saying so; else `cfg` as it is."""
    window = profile_window(cfg)
    given = any(a.split("=")[0] == "--profile_steps" for a in argv)
    steps = cfg.run.max_steps
    if window is None or given or steps <= 0 or window[1] <= steps:
        return cfg
    fitted = f"{max(1, steps - 2)},{steps + 1}"
    print(
        f"--max_steps {steps}: the demo traces steps {fitted} (--profile_steps) instead of "
        f"{cfg.profile.profile_steps}",
        flush=True,
    )
    return dataclasses.replace(cfg, profile=dataclasses.replace(cfg.profile, profile_steps=fitted))


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    own = ("--keep: reuse the model and data of an earlier demo",)
    if (usage := outputs.demo_help(argv, __doc__, RUN_DIR, own)) is not None:
        print(usage)
        return 0
    refused = outputs.demo_flag_error(argv, RUN_DIR)
    if refused:
        print(refused, file=sys.stderr)
        return 2
    # `--keep`: reuse the model and data of an earlier demo; without it they are made
    # again. The training run replaces the earlier one once its step has compiled
    # (`--overwrite_output_dir`), and the report replaces its own rows.
    keep = "--keep" in argv
    argv = [a for a in argv if a != "--keep"]
    hf_dir = os.path.join(RUN_DIR, "hf_init")
    data_path = os.path.join(RUN_DIR, "data.pkl")
    config = tiny_llama3()
    if not (keep and os.path.isdir(hf_dir)):
        _write_model(config, hf_dir)
    # Sequence over 2 devices and FSDP over the rest (4 simulated CPUs: fsdp=2, seq=2).
    n = jax.device_count()
    seq = 2 if n >= 2 and n % 2 == 0 else 1
    mesh = ["--mesh", f"data=1,fsdp={n // seq},seq={seq}"]
    try:
        cfg = parse_args(
            [
                "--config",
                CONFIG,
                "--model_name_or_path",
                hf_dir,
                "--output_dir",
                os.path.join(RUN_DIR, "train"),
                "--data_path",
                data_path,
                *mesh,
                *([] if outputs.demo_resumes(argv) else ["--overwrite_output_dir"]),
                *argv,
            ]
        )
        cfg = _fit_profile_window(cfg, argv)
        if not (keep and os.path.exists(data_path)):
            fresh = os.path.join(RUN_DIR, "data.new.pkl")
            data_lib.save_dataset(fresh, documents(cfg, config))
            os.replace(fresh, data_path)
        print(
            f"devices: {jax.device_count()} x {jax.devices()[0].device_kind}; "
            f"mesh {cfg.parallel.mesh}; model from {hf_dir}"
        )
        summary = run(cfg)
    except (TrainingError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Preempted as e:  # SIGTERM or SIGHUP: the step reached is saved
        resume = "python -m train.demo --keep --resume_from_checkpoint latest"
        print(e.line(resume), file=sys.stderr)
        return signal_status(e.signum)
    losses = summary["losses"]
    if not losses:  # a resume of a finished run trains nothing (the run said so)
        return 0
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    start = "first 10 steps"
    if summary["start_step"] > 0:  # resumed: the run's first loss is in its log
        with open(os.path.join(RUN_DIR, "train", "log.jsonl")) as f:
            record = next(r for r in map(json.loads, f) if "loss" in r)
        first, start = record["loss"], f"step {record['step']} (before the resume)"
    print(f"loss: {start} {first:.3f} -> last 10 steps {last:.3f}")
    print(
        f"outputs under {os.path.join(RUN_DIR, 'train')}: checkpoints/, tensorboard/ "
        "(scalars + profile: `tensorboard --logdir` it), log.jsonl, hf/"
    )
    if not last < first - 0.5:
        print("error: the loss did not fall", file=sys.stderr)
        return 1
    # The metrics report (per-phase times, throughput, memory, roofline) for the same
    # mesh, a preset of the demo model's shape, on these devices.
    mesh = cfg.parallel.mesh
    report = os.path.join(RUN_DIR, "profile")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "train.tools.profile",
            "--models",
            "tiny",
            "--context",
            str(cfg.data.model_max_length),
            "--mesh",
            mesh,
            "--steps",
            "3",
            "--warmup",
            "1",
            "--trace-steps",
            "2",
            "--out",
            report,
            "--append",  # with --keep, the earlier report's rows of this name are replaced
        ],
        check=True,
    )
    print(f"metrics report: {os.path.join(report, 'report.md')} (+ PNG plots beside it)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
