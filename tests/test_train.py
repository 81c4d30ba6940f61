"""The trainer end to end on simulated CPU devices: training, resume, failures, multi-host."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import types

import jax
import numpy as np
import pytest
from conftest import cpu_devices

import models
import models.files
from train import data as data_lib
from train.config import HF_ONLY_FLAGS, TrainConfig, build_parser, parse_args
from train.loop import TrainingError, run
from train.mesh import parse_mesh
from train.tensorboard import read_scalars

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EIGHT = pytest.mark.multi_device(8)
SMALL = [
    "--model_name_or_path",
    "tiny",
    "--data_path",
    "sample",
    "--model_max_length",
    "64",
    "--sample_num_examples",
    "96",
    "--learning_rate",
    "3e-3",
    "--warmup_ratio",
    "0.1",
    "--logging_steps",
    "1",
    "--progress",
    "false",
]


def _args(tmp_path, *extra, mesh="data=-1,fsdp=2,seq=2"):
    return [*SMALL, "--mesh", mesh, "--output_dir", str(tmp_path), *extra]


def _log(path) -> dict[int, float]:
    with open(os.path.join(path, "log.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def _env(num_devices: int) -> dict[str, str]:
    """A child process on `num_devices` simulated CPU devices (on a GPU machine too)."""
    return dict(os.environ, PYTHONPATH=ROOT, **cpu_devices(num_devices))


@pytest.mark.multi_device(8)
@pytest.mark.slow
def test_trains_with_ring_and_fsdp(tmp_path):
    summary = run(
        parse_args(
            _args(
                tmp_path,
                "--max_steps",
                "12",
                "--save_steps",
                "4",
                "--save_total_limit",
                "2",
                "--profile_steps",
                "4,6",
            )
        )
    )
    losses = summary["losses"]
    assert len(losses) == 12 and all(np.isfinite(losses))
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.3, losses
    assert summary["mesh"] == {"data": 2, "fsdp": 2, "seq": 2, "seq_a2a": 1}
    # save_total_limit=2 keeps the newest two checkpoints.
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["12", "8"]
    scalars = read_scalars(tmp_path / "tensorboard")
    for tag in ("train/loss", "train/learning_rate", "train/grad_norm", "train/tokens_per_s"):
        assert tag in scalars, sorted(scalars)
    assert [s for s, _ in scalars["train/loss"]] == list(range(1, 13))
    assert os.listdir(tmp_path / "tensorboard" / "plugins" / "profile")
    # The HF export loads back and matches the trained parameters' shapes.
    config, params = models.load_hf(tmp_path / "hf")
    assert config.num_layers == models.TINY.num_layers
    models.check_params(config, params)


@pytest.mark.multi_device(4)
@pytest.mark.slow
def test_resume_after_kill_matches_uninterrupted(tmp_path):
    steps = ["--max_steps", "30", "--save_steps", "4"]
    killed = tmp_path / "killed"
    cmd = [sys.executable, "-m", "train", *_args(killed, *steps, mesh="data=1,fsdp=2,seq=2")]
    # The uninterrupted reference: a child process on the same 4-device mesh (another
    # data split would change the batch).
    whole4 = tmp_path / "whole4"
    subprocess.run(
        [sys.executable, "-m", "train", *_args(whole4, *steps, mesh="data=1,fsdp=2,seq=2")],
        env=_env(4),
        check=True,
        capture_output=True,
    )
    proc = subprocess.Popen(cmd, env=_env(4), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while not (killed / "checkpoints" / "8").is_dir():
        assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
        assert time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = _log(killed)
    assert max(done) < 30, "the run finished before it was killed; the test proved nothing"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "train",
            *_args(killed, *steps, mesh="data=1,fsdp=2,seq=2"),
            "--resume_from_checkpoint",
            "latest",
        ],
        env=_env(4),
        check=True,
        capture_output=True,
    )
    resumed, reference = _log(killed), _log(whole4)
    with open(killed / "log.jsonl") as f:  # the killed run's steps after 8 were dropped
        assert [json.loads(line)["step"] for line in f] == list(range(1, 31))
    for step in range(9, 31):
        assert resumed[step] == reference[step], (step, resumed[step], reference[step])
    # TensorBoard too: the killed run's scalars after step 8 were dropped, not doubled.
    assert [s for s, _ in read_scalars(killed / "tensorboard")["train/loss"]] == list(range(1, 31))


@pytest.mark.multi_device(4)
@pytest.mark.slow
def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    cfg = parse_args(
        _args(
            tmp_path,
            "--max_steps",
            "20",
            "--save_steps",
            "1",
            "--learning_rate",
            "1e12",
            "--max_grad_norm",
            "0",
        )
    )
    with pytest.raises(TrainingError, match="^non-finite (loss|gradient norm)"):
        run(cfg)
    saved = sorted(int(s) for s in os.listdir(tmp_path / "checkpoints"))
    logged = _log(tmp_path)
    assert saved and max(saved) <= max(logged), (saved, logged)
    assert all(np.isfinite(logged[s]) for s in saved)


@pytest.mark.multi_device(4)
@pytest.mark.slow
def test_out_of_memory_found_when_metrics_arrive_names_the_knobs(tmp_path, monkeypatch):
    """Steps run asynchronously: an OOM raised while a step ran surfaces when its
    metrics are fetched (seen on an H200 with --remat_policy none) and must get the
    same advice as one raised at dispatch, not a bare XLA traceback."""
    real = jax.device_get

    def device_get(x):
        if isinstance(x, dict) and "loss" in x:
            raise RuntimeError(
                "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 86.52GiB with "
                "allocator GPU_0_bfc on device 0. [executable_name='jit_train_step']"
            )
        return real(x)

    monkeypatch.setattr(jax, "device_get", device_get)
    cfg = parse_args(_args(tmp_path, "--max_steps", "2", "--remat_policy", "none"))
    with pytest.raises(TrainingError, match="out of device memory") as info:
        run(cfg)
    message = str(info.value)
    for knob in ("--model_max_length (now 64)", "--remat_policy", "'none'", "MEM_FRACTION"):
        assert knob in message, (knob, message)


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--mesh", "data=1,fsdp=1,seq=64"], "needs 64 devices"),
        (["--mesh", "seq=-1,fsdp=-1"], "only one axis may be -1"),
        (["--max_steps", "-1", "--num_train_epochs", "0"], "--num_train_epochs=0.0 must be > 0"),
        (["--profile_steps", "2,7"], "starts after the run's 1 step: nothing would be traced"),
        (["--profile_steps", "0,2"], r"needs 1 <= start < stop \(steps count from 1"),
        *[
            pytest.param(["--mesh", "data=2,fsdp=2,seq=2", *more], match, marks=EIGHT)
            for more, match in [
                (["--model_max_length", "34"], "model_max_length=34 must be divisible by 4"),
                (["--attention", "jflash"], "only 'ring'"),
                (["--model_name_or_path", "nope"], "neither a local"),
                (["--sample_num_examples", "2"], "one step needs"),
                (["--gather_once", "true"], "--gather_once true needs --shard_over_seq true"),
            ]
        ],
    ],
)
def test_refused_before_compiling(tmp_path, extra, match):
    with pytest.raises((TrainingError, ValueError), match=match):
        run(parse_args([*SMALL, "--output_dir", str(tmp_path), "--max_steps", "1", *extra]))


@pytest.mark.multi_device(4)
@pytest.mark.slow
def test_output_dir_of_a_previous_run_and_resume_refusals(tmp_path):
    """A second run into a used --output_dir is refused (Orbax would silently skip its
    saves at or below the old run's latest step) or replaces the old outputs with
    --overwrite_output_dir; resuming from an earlier step into the same directory, or
    with settings that change the data order, is refused by name."""
    out = tmp_path / "run"
    run(parse_args(_args(out, "--max_steps", "4", "--save_steps", "2")))
    assert sorted(os.listdir(out / "checkpoints")) == ["2", "4"]
    with pytest.raises(TrainingError, match="holds a previous run .*checkpoints, log.jsonl"):
        run(parse_args(_args(out, "--max_steps", "3")))
    step2 = str(out / "checkpoints" / "2")
    with pytest.raises(TrainingError, match=r"later checkpoints \[4\]"):
        run(parse_args(_args(out, "--max_steps", "4", "--resume_from_checkpoint", step2)))
    with pytest.raises(TrainingError, match="seed 42 -> 7"):
        run(parse_args(_args(tmp_path / "b", "--seed", "7", "--resume_from_checkpoint", step2)))
    typo = str(tmp_path / "typo" / "checkpoints" / "3")
    with pytest.raises(ValueError, match="does not exist"):
        run(parse_args(_args(tmp_path / "c", "--resume_from_checkpoint", typo)))
    assert not (tmp_path / "typo").exists()
    with pytest.raises(TrainingError, match="would delete the checkpoints"):
        run(parse_args(_args(out, "--resume_from_checkpoint", "latest", "--overwrite_output_dir")))

    # --overwrite_output_dir: only the new run's outputs remain; the last step is logged
    # off the logging_steps grid; the model directory's tokenizer goes with the export.
    model_dir = tmp_path / "model"
    params = models.init_params(models.TINY, jax.random.key(0))
    models.export_hf(jax.device_get(params), models.TINY, model_dir)
    (model_dir / "tokenizer.json").write_text('{"made": "here"}')
    new = ["--max_steps", "3", "--save_steps", "3", "--logging_steps", "2"]
    new += ["--overwrite_output_dir", "--model_name_or_path", str(model_dir)]
    run(parse_args(_args(out, *new)))
    assert sorted(os.listdir(out / "checkpoints")) == ["3"]
    assert sorted(_log(out)) == [2, 3]
    assert (out / "hf" / "tokenizer.json").read_text() == '{"made": "here"}'


def test_non_finite_gradient_stops_before_anything_is_saved():
    """A finite loss with a non-finite gradient norm: the update already made the
    parameters non-finite, so the run must stop before that step is saved."""
    from train.loop import _finish, _Timer

    metrics = {"loss": np.float32(2.0), "grad_norm": np.float32(np.nan), "tokens": 64, "lr": 0.0}
    cfg = parse_args([])
    with pytest.raises(TrainingError, match="^non-finite gradient norm nan at step 3; "):
        _finish((2, metrics), cfg, _Timer(), 1.0, None, None, None, False, 10)
    # At the first step no update has acted: the advice is not the learning rate's.
    with pytest.raises(TrainingError) as e:
        _finish((0, metrics), cfg, _Timer(), 1.0, None, None, None, False, 10)
    assert "at step 1;" in str(e.value) and "--learning_rate" not in str(e.value)
    assert "before any update" in str(e.value) and "--attention_implementation xla" in str(e.value)


def test_every_flag_says_what_it_does_in_help():
    """Each flag's --help has words, not only its default: from the comment after its
    field, or from the comment lines above a field that has none after it."""
    from train.config import build_parser

    bare = [
        a.option_strings[0]
        for a in build_parser()._actions
        if a.option_strings and a.help and a.help.startswith("default:")
    ]
    assert bare == [], bare
    helps = {a.option_strings[0]: a.help for a in build_parser()._actions if a.option_strings}
    assert helps["--warmup_steps"].startswith("Steps, or below 1 a fraction of the run's steps")
    assert helps["--gather_once"].startswith("With shard_over_seq: gather the weights over seq")


def test_config_flags_yaml_and_errors(tmp_path):
    yaml_path = tmp_path / "c.yaml"
    yaml_path.write_text("optim:\n  learning_rate: 0.5\nrun:\n  max_steps: 7\n")
    cfg = parse_args(["--config", str(yaml_path), "--max_steps", "9", "--fp16"])
    assert cfg.optim.learning_rate == 0.5 and cfg.run.max_steps == 9 and cfg.model.fp16
    assert cfg.remat == "save_attn"
    assert (
        parse_args(["--gradient_checkpointing", "True", "--remat_policy", "none"]).remat == "full"
    )
    # A JSON-valued flag's setting as a YAML mapping, or as the flag's JSON text.
    for text in ("{enable_thinking: false}", "'{\"enable_thinking\": false}'"):
        yaml_path.write_text(f"data:\n  chat_template_kwargs: {text}\n")
        cfg = parse_args(["--config", str(yaml_path)])
        assert json.loads(cfg.data.chat_template_kwargs) == {"enable_thinking": False}
    yaml_path.write_text("data:\n  chat_template_kwargs: [1]\n")
    with pytest.raises(ValueError, match="chat_template_kwargs=\\[1\\] is not a string"):
        parse_args(["--config", str(yaml_path)])
    yaml_path.write_text("optim:\n  learning_rat: 0.5\n")
    with pytest.raises(ValueError, match="unknown keys \\['learning_rat'\\]"):
        parse_args(["--config", str(yaml_path)])
    # A setting outside its section (HF's YAML files are flat) is told where it goes.
    for text, keys in (
        ("learning_rate: 0.5\nmax_steps: 3\n", "learning_rate under optim:, max_steps under run:"),
        ("run:\n  learning_rate: 0.5\n", "learning_rate under optim:"),
    ):
        yaml_path.write_text(text)
        with pytest.raises(ValueError) as error:
            parse_args(["--config", str(yaml_path)])
        assert str(error.value).endswith(f" (settings go under their section: {keys})")
    # HF's former name is the setting, in a YAML file as on the command line.
    yaml_path.write_text("run:\n  evaluation_strategy: 'no'\n")
    assert parse_args(["--config", str(yaml_path)]).run.eval_strategy == "no"
    # HF-only keys and other trainers' names are explained as their flags are.
    for text, told in (
        (
            "run:\n  deepspeed: ds.json\n  lr: 3\n",
            "; deepspeed: sharding is --mesh with --fsdp full_shard (docs/trainer.md); "
            "lr: did you mean learning_rate (under optim:)?",
        ),
        (
            "deepspeed: ds.json\nlearning_rate: 0.5\n",
            " (settings go under their section: learning_rate under optim:); deepspeed: "
            "sharding is --mesh with --fsdp full_shard (docs/trainer.md)",
        ),
    ):
        yaml_path.write_text(text)
        with pytest.raises(ValueError) as error:
            parse_args(["--config", str(yaml_path)])
        assert str(error.value).endswith(told)
    with pytest.raises(ValueError, match="lr_scheduler_type='step'"):
        parse_args(["--lr_scheduler_type", "step"])
    for fsdp in ("full_shard", "auto_wrap full_shard", ""):
        assert parse_args(["--fsdp", fsdp]).parallel.fsdp == fsdp
    for flags, match in (
        (["--fsdp", "foo"], "--fsdp='foo': supported"),
        # HF's other words are refused, not dropped: this one would not offload
        (["--fsdp", "full_shard offload"], "fsdp\\); offload: parameters stay on the device"),
        (["--fsdp", "full_shard auto_wrap foobar"], "'full_shard auto_wrap foobar': supported"),
        (["--warmup_steps", "-5"], "--warmup_steps=-5"),
        (["--max_grad_norm", "-1"], "--max_grad_norm=-1.0"),
    ):
        with pytest.raises(ValueError, match=match):
            parse_args(flags)
    # YAML 1.1 reads 1e-8 as a string and "false" is truthy: values take their field's type.
    yaml_path.write_text(
        "optim:\n  adam_epsilon: 1e-8\n  learning_rate: 2e-5\n  warmup_steps: 3.0\n"
        "model:\n  bf16: 'false'\nrun:\n  save_total_limit: '2'\n"
    )
    cfg = parse_args(["--config", str(yaml_path)])
    assert cfg.optim.adam_epsilon == 1e-8 and cfg.optim.learning_rate == 2e-5
    assert cfg.optim.warmup_steps == 3 and cfg.model.bf16 is False
    assert cfg.run.save_total_limit == 2
    for text, match in (
        ("optim:\n  learning_rate: fast\n", "learning_rate='fast' is not a number"),
        ("optim:\n  warmup_steps: 2.5\n", "warmup_steps=2.5 must be a whole number of steps"),
        ("model:\n  bf16: maybe\n", "bf16='maybe' is not a boolean"),
        ("run:\n  max_steps: null\n", "max_steps=None is not allowed"),
        ("run: [1\n", "is not valid YAML"),
        # A key given twice (PyYAML would keep the last silently), in one line.
        ("optim:\n  learning_rate: 1.0\nrun: {}\noptim:\n  optim: lion\n", "'optim' given twice"),
        (
            "optim:\n  learning_rate: 1.0\n  learning_rate: 2.0\n",
            r"given twice .*line 3\S* column 3$",
        ),
        ("run:\n  num_train_epochs: .inf\n", "--num_train_epochs=inf must be a finite"),
    ):
        yaml_path.write_text(text)
        with pytest.raises(ValueError, match=match):
            parse_args(["--config", str(yaml_path)])
    with pytest.raises(ValueError, match="--config='nope.yaml': No such file"):
        parse_args(["--config", "nope.yaml"])
    with pytest.raises(ValueError) as error:  # one file: a second is refused by name
        parse_args(["--config", str(yaml_path), "--config", "b.yaml", "--max_steps", "3"])
    assert str(error.value) == (
        f"--config={str(yaml_path)!r} and --config='b.yaml': pass one --config file "
        "(flags override it)"
    )
    one = {"seq_a2a": 1}
    assert parse_mesh("data=1,fsdp=-1,seq=4", 8) == {"data": 1, "fsdp": 2, "seq": 4, **one}
    assert parse_mesh("data=1,fsdp=-1,seq=2", 8, fsdp=False) == {
        "data": 4,
        "fsdp": 1,
        "seq": 2,
        **one,
    }
    assert parse_mesh("seq=2,seq_a2a=-1", 8)["seq_a2a"] == 4
    with pytest.raises(ValueError, match="uses 4 of the 8 devices .* put -1 on one axis") as e:
        parse_mesh("data=1,fsdp=1,seq=4", 8)
    assert "XLA_FLAGS=--xla_force_host_platform_device_count" in str(e.value)  # the CPU's way
    with pytest.raises(ValueError, match="axis 'data' is given twice"):
        parse_mesh("data=2,data=2", 4)


@pytest.mark.parametrize(
    "flag, value, rule",
    [
        ("--learning_rate", "-1e-3", ">= 0"),
        ("--warmup_ratio", "1.5", r"in \[0, 1\]"),
        ("--max_grad_norm", "-1", ">= 0"),
        ("--weight_decay", "-0.1", ">= 0"),
        ("--adam_beta1", "-0.5", r"in \[0, 1\)"),
        ("--adam_beta2", "1.5", r"in \[0, 1\)"),
        ("--adam_epsilon", "0", "> 0"),
        ("--seed", "-1", r"in \[0, 2\*\*63\)"),
        ("--seed", "99999999999999999999", r"in \[0, 2\*\*63\)"),
        ("--learning_rate", "inf", "a finite number >= 0"),
        ("--learning_rate", "nan", "a finite number >= 0"),
        ("--weight_decay", "inf", "a finite number >= 0"),
        ("--max_grad_norm", "inf", r"a finite number >= 0 \(0: no clipping\)"),
        ("--warmup_ratio", "nan", r"a finite number in \[0, 1\]"),
        ("--adam_beta1", "nan", r"a finite number in \[0, 1\)"),
        ("--adam_beta2", "-inf", r"a finite number in \[0, 1\)"),
        ("--adam_epsilon", "inf", "a finite number > 0"),
        ("--num_train_epochs", "inf", "a finite number > 0"),
        ("--num_train_epochs", "nan", "a finite number > 0"),
        ("--num_train_epochs", "0", "> 0"),
        ("--num_train_epochs", "-2", "> 0"),
        ("--max_steps", "-5", "a positive int, or -1 to train for --num_train_epochs"),
        ("--max_steps", "0", "a positive int, or -1 to train for --num_train_epochs"),
    ],
)
def test_each_out_of_range_flag_is_named_alone(flag, value, rule):
    """One line naming the flag that is wrong, and only it (the others are fine)."""
    with pytest.raises(ValueError) as error:
        parse_args([flag, value])
    assert re.fullmatch(rf"{flag}=\S+ must be {rule}.*", str(error.value)), str(error.value)


def test_param_spec_keeps_the_minor_dimension_whole_when_asked():
    from jax.sharding import PartitionSpec as P

    from train.mesh import param_spec

    mlp = (16, 2048, 8192)  # a stacked [layers, D, F] kernel: F is the largest and minor
    assert param_spec(mlp, 2, stacked=True) == P(None, None, "fsdp")
    assert param_spec(mlp, 2, stacked=True, minor_last=True) == P(None, "fsdp", None)
    # The minor dimension still splits when nothing else divides; unstacked leaves
    # (the embedding, the head) keep the largest dimension either way.
    assert param_spec((16, 3, 8192), 2, stacked=True, minor_last=True) == P(None, None, "fsdp")
    assert param_spec((16, 2048), 2, stacked=True, minor_last=True) == P(None, "fsdp")
    assert param_spec((2048, 128256), 2, minor_last=True) == P(None, "fsdp")


@pytest.mark.multi_device(4)
def test_gather_once_state_splits_no_minor_dimension(tmp_path):
    """With --gather_once (fsdp=1) the stored layer stacks (and their Adam moments) are
    split along a major dimension (no transposes around the gather, the reduce-scatter
    and the update); per-layer FSDP, also of a gathered-once copy, keeps the largest."""
    from train.build import plan_step

    def mlp_specs(*extra, mesh="data=1,fsdp=1,seq=2"):
        cfg = parse_args(_args(tmp_path, *extra, mesh=mesh))
        n = 4 if "fsdp=2" in mesh else 2
        plan = plan_step(cfg, models.TINY, devices=jax.devices()[:n])
        params = plan.state_shardings["params"]["layers"]["mlp"]
        moments = [
            leaf.spec
            for path, leaf in jax.tree_util.tree_flatten_with_path(
                plan.state_shardings["opt_state"]
            )[0]
            if "up_proj" in jax.tree_util.keystr(path)
        ]
        return params["up_proj"]["kernel"].spec, params["down_proj"]["kernel"].spec, moments

    up, down, moments = mlp_specs("--shard_over_seq", "--gather_once", "true")
    assert up[-1] is None and down[-1] is None, (up, down)
    assert moments and all(m[-1] is None and "seq" in str(m) for m in moments), moments
    up, _, _ = mlp_specs("--shard_over_seq")
    assert "seq" in str(up[-1]), up
    up, _, _ = mlp_specs("--shard_over_seq", "--gather_once", "true", mesh="data=1,fsdp=2,seq=2")
    assert "fsdp" in str(up[-1]), up


def test_a_layout_that_would_fit_and_settings_the_mesh_leaves_unused(capsys):
    """A length zigzag cannot split but striped or contiguous can is refused with them
    named; --ring_strategy hybrid without a seq_a2a axis and --shard_over_seq without a
    split sequence run (the ring alone; fsdp alone), each said in a line, as are a
    strategy or layout without a split sequence, a kernel choice XLA's attention
    ignores and an offloading remat policy on the CPU backend."""
    from train.build import check_layout
    from train.loop import _say_what_the_mesh_leaves_unused

    cfg = parse_args(["--model_max_length", "124", "--ring_strategy", "ulysses"])
    sizes = {"data": 1, "fsdp": 1, "seq": 4, "seq_a2a": 1}
    with pytest.raises(TrainingError, match="^--model_max_length=124 must be divisible by 8 "):
        check_layout(cfg, sizes)
    with pytest.raises(TrainingError, match="striped or contiguous needs a multiple of 4$"):
        check_layout(cfg, sizes)
    check_layout(parse_args(["--model_max_length", "124", "--ring_layout", "striped"]), sizes)
    with pytest.raises(TrainingError, match=r"layout=zigzag\)$"):  # none would: no hint
        check_layout(parse_args(["--model_max_length", "126"]), sizes)
    # A pair jflash refuses for causal attention, in the trainer's flags' words.
    gathered = ["--ring_strategy", "allgather", "--ring_layout", "striped"]
    with pytest.raises(
        TrainingError, match="^--ring_strategy allgather with --ring_layout striped"
    ):
        check_layout(parse_args(gathered), sizes)
    with pytest.raises(
        TrainingError, match="^--ring_strategy allgather with --ring_layout striped"
    ):
        check_layout(parse_args(gathered), {**sizes, "seq": 1})  # as jflash refuses it there

    def said(*argv, platform="gpu", **mesh):
        cfg = parse_args(list(argv))
        devices = np.array([types.SimpleNamespace(platform=platform)])
        t = types.SimpleNamespace(cfg=cfg, sizes=mesh, mesh=types.SimpleNamespace(devices=devices))
        _say_what_the_mesh_leaves_unused(t)
        return capsys.readouterr().out

    assert said("--ring_strategy", "hybrid", seq=2, seq_a2a=1).startswith(
        "--ring_strategy hybrid: the mesh has no seq_a2a axis (seq_a2a=1), so it runs the "
        "ring alone over seq=2"
    )
    assert said("--ring_strategy", "hybrid", seq=2, seq_a2a=2) == ""
    assert said("--shard_over_seq", "true", seq=1, seq_a2a=1).startswith(
        "--shard_over_seq: the mesh does not split the sequence"
    )
    assert said("--shard_over_seq", "true", seq=2, seq_a2a=1) == ""
    # Strategies and layouts without a split sequence; a kernel choice XLA ignores.
    assert said("--ring_strategy", "ulysses", "--ring_layout", "striped", seq=1, seq_a2a=1) == (
        "--ring_strategy ulysses and --ring_layout striped: the mesh does not split the "
        "sequence (seq=1, seq_a2a=1), so they have no effect; give seq=2 or more to split it\n"
    )
    assert said("--ring_strategy", "hybrid", seq=1, seq_a2a=1).startswith(
        "--ring_strategy hybrid: the mesh does not split the sequence"
    )
    assert said(seq=1, seq_a2a=1) == ""  # the defaults say nothing
    assert said("--ring_layout", "striped", seq=2, seq_a2a=1) == ""
    xla = ["--attention", "xla", "--attention_implementation", "pallas_mosaic"]
    assert said(*xla, seq=1, seq_a2a=1) == (
        "--attention_implementation pallas_mosaic: --attention xla runs XLA's own attention, "
        "not jflash's kernels, so it has no effect (--attention ring or jflash take it)\n"
    )
    assert said("--attention_implementation", "xla", seq=1, seq_a2a=1) == ""
    # An offloading remat policy on the CPU backend's one memory space moves nothing.
    offload = ["--remat_policy", "offload_full"]
    assert said(*offload, platform="cpu", seq=1, seq_a2a=1) == (
        "--remat_policy offload_full: the cpu backend has one memory space, so XLA keeps the "
        "residuals it would offload on the device: it runs as full here (offload on a GPU)\n"
    )
    assert said(*offload, seq=1, seq_a2a=1) == ""


def test_hf_flags_without_a_place_here_say_what_does_their_work(capsys):
    """An HF command line's TrainingArguments flags that the trainer has no use for are
    refused in the one line with what to do instead; a misspelt flag keeps its "did
    you mean"."""
    from train.__main__ import main

    argv = ["--do_train", "--per_device_eval_batch_size", "4", "--leraning_rate", "3"]
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    assert capsys.readouterr().err == (
        "error: unrecognized arguments: --do_train --per_device_eval_batch_size 4 "
        "--leraning_rate 3; --do_train: the trainer always trains; leave it out; "
        "--per_device_eval_batch_size: evaluation runs the training's global batch; "
        "--leraning_rate: did you mean --learning_rate? (`python -m train --help` lists "
        "the flags)\n"
    )
    flags = {o for a in build_parser()._actions for o in a.option_strings}
    assert not set(HF_ONLY_FLAGS) & flags  # none of them is a flag after all
    # HF's evaluation and logging flags too, and its --report_to all.
    with pytest.raises(SystemExit):
        main(["--eval_delay", "2", "--include_tokens_per_second"])
    err = capsys.readouterr().err
    assert "--eval_delay: the first evaluation is at --eval_steps" in err, err
    assert "--include_tokens_per_second: tokens_per_s is always logged" in err, err
    assert main(["--optim", "sgd", "--max_steps", "1"]) == 2
    assert "(or HF's adamw_torch, adamw_torch_fused, adamw_hf, which are adamw)" in (
        capsys.readouterr().err
    )
    assert main(["--sample_num_examples", "0", "--max_steps", "1"]) == 2
    assert "--sample_num_examples=0 must be positive" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--assistant_only_loss", "true"])
    assert "--assistant_only_loss: conversations are learned on the assistant turns" in (
        capsys.readouterr().err
    )
    assert main(["--report_to", "all", "--max_steps", "1"]) == 2
    assert "HF's all, every integration installed, is not taken" in capsys.readouterr().err
    # FSDP's wrapping flags of Alpaca/FastChat command lines, run_clm's --block_size.
    with pytest.raises(SystemExit):
        main(["--fsdp_transformer_layer_cls_to_wrap", "LlamaDecoderLayer", "--block_size", "8"])
    err = capsys.readouterr().err
    assert "--fsdp_transformer_layer_cls_to_wrap: every decoder layer is sharded" in err, err
    assert "--block_size: did you mean --model_max_length?" in err, err
    # HF's former name of --eval_strategy is that flag; --run_name and
    # --logging_first_step are honoured (wandb's run name; step 1's metrics logged).
    cfg = parse_args(["--evaluation_strategy", "no", "--run_name", "x", "--logging_first_step"])
    assert (cfg.run.eval_strategy, cfg.run.run_name, cfg.run.logging_first_step) == (
        "no",
        "x",
        True,
    )


def test_yaml_values_as_their_writers_mean_them(tmp_path):
    """YAML 1.1 reads an unquoted `no` as false, `1e-7` as text: `save_strategy: no`
    is "no", a scheduler's numbers are numbers, a YAML list of reporters is HF's list,
    `None` (as --help lists it) is none; an unquoted yes/no where text belongs is
    refused with the hint to quote it, not read as the folder "True"."""
    path = tmp_path / "c.yaml"

    def read(text: str, *flags: str):
        path.write_text(text)
        return parse_args(["--config", str(path), *flags])

    cfg = read("run:\n  save_strategy: no\n  eval_strategy: no\n")
    assert (cfg.run.save_strategy, cfg.run.eval_strategy) == ("no", "no")
    cfg = read("optim:\n  lr_scheduler_type: polynomial\n  lr_scheduler_kwargs: {lr_end: 1e-7}\n")
    assert json.loads(cfg.optim.lr_scheduler_kwargs) == {"lr_end": 1e-7}
    cfg = read("run:\n  report_to: [tensorboard, wandb]\n")
    assert cfg.run.report_to == "tensorboard,wandb"
    assert read("model:\n  attention_implementation: None\n").model.attention_implementation is None
    assert parse_args(["--attention_implementation", "None"]).model.attention_implementation is None
    with pytest.raises(ValueError) as e:
        read("run:\n  output_dir: yes\n")
    assert str(e.value) == (
        f"{path}: output_dir=True: YAML reads an unquoted yes/no/on/off/true/false as a "
        'boolean; quote the text (output_dir: "...")'
    )
    sixty = 'base 60 (a colon); quote it ("{}") where it is text, else write the number'
    for text, read_as, what in (
        ("010", 8, "octal (a leading zero); write 10, or 8 where octal was meant"),
        ("1:30", 90, sixty.format("1:30")),
        ("1:30.5", 90.5, sixty.format("1:30.5")),
    ):
        with pytest.raises(ValueError) as e:
            read(f"run:\n  seed: {text}\n")
        assert str(e.value) == (
            f"--config={str(path)!r}, line 2: {text} reads as the number {read_as} in YAML "
            f"1.1, {what}"
        )
    for text, seed in (("07", 7), ("0", 0), ("0x10", 16), ("1_000", 1000), ("08", 8)):
        assert read(f"run:\n  seed: {text}\n").run.seed == seed, text
    with pytest.raises(ValueError, match="^--config='' names no file$"):
        parse_args(["--config", ""])
    path.write_bytes("run:\n  output_dir: caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ValueError) as e:
        parse_args(["--config", str(path)])
    assert str(e.value) == (
        f"--config={str(path)!r}: byte 22 is not UTF-8 (invalid continuation byte); save "
        "it as UTF-8"
    )


def test_paths_expand_home_and_variables(tmp_path, monkeypatch):
    """`~` and `$VAR` in a path setting are expanded as a shell expands them on a
    command line (a YAML file's are not): no folder named `~` or `$HOME` is made under
    the working directory. A variable that is not set is refused by name."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RUNS", str(tmp_path / "runs"))
    monkeypatch.delenv("NOT_SET_ANYWHERE", raising=False)
    path = tmp_path / "c.yaml"
    path.write_text("run:\n  output_dir: ~/out\n  compilation_cache_dir: $RUNS/xla\n")
    cfg = parse_args(["--config", str(path), "--data_path", "${RUNS}/d.jsonl"])
    assert cfg.run.output_dir == str(tmp_path / "home" / "out")
    assert cfg.run.compilation_cache_dir == str(tmp_path / "runs" / "xla")
    assert cfg.data.data_path == str(tmp_path / "runs" / "d.jsonl")
    with pytest.raises(ValueError) as e:
        parse_args(["--data_cache_dir", "$NOT_SET_ANYWHERE/c"])
    assert str(e.value) == (
        "--data_cache_dir='$NOT_SET_ANYWHERE/c': $NOT_SET_ANYWHERE is not set in the environment"
    )


def test_a_relative_pattern_is_written_absolute(tmp_path, monkeypatch):
    """A run's train_config.yaml runs the same job from any directory: a relative data
    pattern is written from its folder, as other paths are."""
    from train import outputs

    monkeypatch.chdir(tmp_path)
    cfg = parse_args(["--data_path", "data/*.jsonl", "--output_dir", "runs/x"])
    import yaml

    with open(outputs.write_settings(str(tmp_path / "out"), cfg)) as f:
        written = yaml.safe_load(f)
    assert written["data"]["data_path"] == str(tmp_path / "data" / "*.jsonl")
    assert written["run"]["output_dir"] == str(tmp_path / "runs" / "x")


def test_cli_config_errors_are_one_line(tmp_path, capsys):
    from train.__main__ import main

    assert main(["--output_dir=", "--max_steps", "1"]) == 2  # not the working directory
    assert capsys.readouterr().err == (
        "error: --output_dir='' is empty: give the run's directory (. for the working directory)\n"
    )
    assert main(["--lr_scheduler_type", "step", "--max_steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --lr_scheduler_type='step'") and "Traceback" not in err
    # A kernel the model cannot use (Mosaic needs head dim 64/128; the tiny model has 32).
    args = ["--attention_implementation", "pallas_mosaic", "--max_steps", "1"]
    assert main(_args(tmp_path, *args, mesh="data=-1,fsdp=1,seq=1")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: implementation='pallas_mosaic' head_dim=32"), err


def test_every_config_file_loads():
    configs = os.path.join(ROOT, "configs")
    files = sorted(f for f in os.listdir(configs) if f.endswith(".yaml"))
    assert files
    for name in files:
        cfg = parse_args(["--config", os.path.join(configs, name)])
        assert isinstance(cfg, TrainConfig)


def test_hf_schedule_matches_transformers_formula():
    from train.config import OptimArgs
    from train.optim import schedule

    args = OptimArgs(learning_rate=1.0, warmup_ratio=0.1, lr_scheduler_type="cosine")
    lr = schedule(args, 100)
    # transformers.get_cosine_schedule_with_warmup with 10 warmup steps of 100.
    assert float(lr(0)) == 0.0 and abs(float(lr(5)) - 0.5) < 1e-7
    assert abs(float(lr(10)) - 1.0) < 1e-7
    assert abs(float(lr(55)) - 0.5 * (1 + np.cos(np.pi * 45 / 90))) < 1e-6
    lin = schedule(OptimArgs(learning_rate=1.0, warmup_steps=10, lr_scheduler_type="linear"), 100)
    assert abs(float(lin(55)) - 45 / 90) < 1e-6


@pytest.mark.multi_device(4)
def test_the_logged_learning_rate_is_the_steps_own(tmp_path):
    """Each step returns the learning rate its update used, a metric read one step late
    with the loss (an eager lookup on the device waited for the step just dispatched,
    every step), and the log holds it."""
    from train.build import build
    from train.optim import schedule

    cfg = parse_args(_args(tmp_path, "--max_steps", "6", "--lr_scheduler_type", "cosine"))
    lr = schedule(cfg.optim, 6)
    t = build(cfg)
    state = t.state
    with jax.set_mesh(t.mesh):
        for i in range(3):
            state, metrics = t.step_fn(state, t.batch(i))
            assert float(metrics["lr"]) == pytest.approx(float(lr(i)), rel=1e-6, abs=1e-12)
    run(cfg)
    with open(tmp_path / "log.jsonl") as f:
        logged = {r["step"]: r["lr"] for r in map(json.loads, f) if "lr" in r}
    assert sorted(logged) == [1, 2, 3, 4, 5, 6]
    for step, value in logged.items():
        assert value == pytest.approx(float(lr(step - 1)), rel=1e-6, abs=1e-12)


@pytest.mark.multi_device(4)
def test_a_resume_reads_no_weights_and_builds_no_state_before_the_checkpoint(tmp_path, monkeypatch):
    """A resume restores into the state's abstract form: no weights are read or
    initialised and thrown away (time at every restart, and device memory that held
    both states: a model that trained in memory could fail to resume), and it continues
    as the uninterrupted run."""
    from train import build as build_lib
    from train import loop

    argv = ["--max_steps", "4", "--save_steps", "2", "--report_to", "none"]
    whole = run(parse_args(_args(tmp_path / "whole", *argv)))["losses"]
    argv = _args(tmp_path / "cut", *argv)
    run(parse_args(argv))
    shutil.rmtree(tmp_path / "cut" / "checkpoints" / "4")
    shutil.rmtree(tmp_path / "cut" / "hf")
    real_build, states = loop.build, []

    def build(cfg, **kwargs):
        t = real_build(cfg, **kwargs)
        states.append(t.state)
        return t

    def no_weights(*args, **kwargs):
        raise AssertionError("a resume made an initial state")

    monkeypatch.setattr(loop, "build", build)
    monkeypatch.setattr(build_lib, "initial_state", no_weights)
    summary = run(parse_args([*argv, "--resume_from_checkpoint", "latest"]))
    (state,) = states
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state))
    assert summary["start_step"] == 2
    np.testing.assert_allclose(summary["losses"], whole[2:], rtol=1e-6)


@pytest.mark.slow
def test_a_restart_loads_the_compiled_step_from_the_compilation_cache(tmp_path):
    """--compilation_cache_dir: the first run writes its compiled training step there,
    and a second start with the same settings loads it (no second entry)."""
    cache = tmp_path / "cache"
    argv = [*SMALL, "--mesh", "data=2", "--max_steps", "2", "--report_to", "none"]
    argv += ["--sample_num_examples", "16", "--compilation_cache_dir", str(cache)]

    def steps():
        return sorted(p.name for p in cache.iterdir() if p.name.startswith("jit_train_step-"))

    for out in ("a", "b"):
        done = subprocess.run(
            [sys.executable, "-m", "train", *argv, "--output_dir", str(tmp_path / out)],
            env=_env(2),
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert len(steps()) == 1
    with pytest.raises(TrainingError, match="--compilation_cache_dir=./proc/c. cannot be created"):
        run(parse_args([*argv[:-1], "/proc/c", "--output_dir", str(tmp_path / "c")]))


def _two_processes(
    *argv: str, second: tuple[str, ...] = (), cwds: tuple[str, str] | None = None
) -> list[tuple[int, str]]:
    """`python -m train *argv` as the two processes of one run (2 CPU devices each, gloo,
    a free localhost port), process 1 with `second` last, each in its working directory
    of `cwds` (as two hosts' own disks): `(exit status, output)` each."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = _env(2)
    env["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] = "gloo"
    common = [*argv, "--coordinator_address", f"localhost:{port}", "--num_processes", "2"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "train", *common, "--process_id", str(i)]
            + list(second if i else ()),
            env=env,
            cwd=cwds[i] if cwds else None,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=600)[0].decode() for p in procs]
    return [(p.returncode, out) for p, out in zip(procs, outs, strict=True)]


@pytest.mark.slow
def test_two_processes_train_together(tmp_path):
    ran = _two_processes(
        *SMALL,
        *("--mesh", "data=1,fsdp=2,seq=2", "--output_dir", str(tmp_path)),
        *("--max_steps", "4", "--save_steps", "4"),
    )
    for code, out in ran:
        assert code == 0, out[-3000:]
    assert "done: 4 steps" in ran[0][1]
    assert sorted(_log(tmp_path)) == [1, 2, 3, 4]
    assert os.path.isdir(tmp_path / "checkpoints" / "4")
    assert not list(tmp_path.glob(".jflash-shared-*"))  # the shared-directory probe went


@pytest.mark.slow
@pytest.mark.parametrize(
    "flag, extra",
    [
        ("--output_dir", ()),
        ("--resume_from_checkpoint", ("--save_strategy", "no")),
    ],
)
def test_a_directory_the_processes_do_not_share_is_refused_at_start(tmp_path, flag, extra):
    """Two hosts each with its own disk at the same path (here: a relative path in each
    process's own working directory) trained to the first checkpoint and then waited
    forever in it, each host holding half of every save. Now every process refuses at
    start, in one line naming the flag and each process's path, and nothing is left."""
    hosts = (tmp_path / "host0", tmp_path / "host1")
    for host in hosts:
        host.mkdir()
    if flag == "--resume_from_checkpoint":
        (hosts[0] / "previous" / "checkpoints").mkdir(parents=True)
    if flag == "--output_dir":
        paths = ("--output_dir", "run")
    else:  # an output directory the processes share, a checkpoint to start from they do not
        paths = ("--output_dir", str(tmp_path / "run"), flag, "previous")
    ran = _two_processes(
        *SMALL,
        *("--mesh", "data=1,fsdp=2,seq=2", "--max_steps", "2", *paths, *extra),
        cwds=tuple(map(str, hosts)),
    )
    for code, out in ran:
        assert code == 2, out[-3000:]
        name, where, why = (
            ("run", "", "saves its part of every checkpoint there")
            if flag == "--output_dir"
            else ("previous", "previous", "reads its part of the checkpoint")
        )
        assert (
            f"error: {flag}={name!r} is not one directory shared by the run's processes: "
            f"process 1 cannot see a file process 0 wrote in {hosts[0] / where} (process 0: "
            f"{hosts[0] / name}; process 1: {hosts[1] / name}). Each process {why}: give a "
            "path on a filesystem every host mounts"
        ) in out, out[-3000:]
    assert sorted(p.name for p in hosts[0].iterdir()) == (
        ["previous"] if flag != "--output_dir" else []
    )
    assert not list(hosts[1].iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["host0", "host1"]


@pytest.mark.slow
def test_a_shared_token_cache_is_built_once_by_process_0(tmp_path):
    """Every process of a run tokenized the data into the same --data_cache_dir at once
    (one process per GPU on a host: the same corpus tokenized 8 times over on its
    CPUs), all but one build then thrown away. Process 0 now builds a cache directory
    the processes share and the others read it; on each host's own disk each builds
    its own; a build that fails on process 0 stops every process in one line."""
    data = tmp_path / "d.npy"
    np.save(data, data_lib.markov_samples(96, 63, 256, seed=0))
    common = (*SMALL, "--data_path", str(data), "--mesh", "data=1,fsdp=2,seq=2")
    common += ("--max_steps", "2", "--save_strategy", "no")
    shared = (*common, "--output_dir", str(tmp_path / "run"))
    ran = _two_processes(*shared, "--data_cache_dir", str(tmp_path / "cache"))
    for code, out in ran:
        assert code == 0, out[-3000:]
    assert "token cache: wrote" in ran[0][1] and "token cache: wrote" not in ran[1][1]
    assert len(list((tmp_path / "cache").iterdir())) == 1  # no other build left beside it
    hosts = (tmp_path / "host0", tmp_path / "host1")
    for host in hosts:
        host.mkdir()
    ran = _two_processes(
        *common,
        *("--output_dir", "run", "--data_cache_dir", "cache"),
        cwds=tuple(map(str, hosts)),
    )
    for (code, out), host in zip(ran, hosts, strict=True):
        assert code == 0, out[-3000:]
        assert "token cache: wrote" in out
        assert len(list((host / "cache").iterdir())) == 1
    ran = _two_processes(
        *common,
        *("--output_dir", str(tmp_path / "run2"), "--data_cache_dir", str(tmp_path / "cache2")),
        *("--model_max_length", "8192"),
    )
    assert ran[0][0] == 2 and "do not fill one row" in ran[0][1], ran[0][1][-3000:]
    assert ran[1][0] == 2, ran[1][1][-3000:]
    assert (
        f"error: --data_cache_dir: caching {data} failed on process 0 (its output says why)"
    ) in ran[1][1]


def test_processes_that_do_not_meet_end_in_one_line(tmp_path):
    """A process whose peers never come (a wrong --process_id, --num_processes or
    coordinator address) waited jax's 300 s and ended in a C++ abort and stack; it now
    ends after --ddp_timeout seconds with one line saying what it waited for."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    argv = ["--coordinator_address", f"localhost:{port}", "--num_processes", "2"]
    argv += ["--process_id", "1", "--ddp_timeout", "3", "--output_dir", str(tmp_path / "run")]
    done = subprocess.run(
        [sys.executable, "-m", "train", *SMALL, *argv],
        env=_env(1),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: process 1 of 2 waited --ddp_timeout=3 s at localhost:{port} and the run's "
        "processes did not all meet: is every process started, with the same "
        "--coordinator_address (process 0's host:port, reachable from this host) and "
        "--num_processes, and each its own --process_id?"
    )
    assert "Check failure" not in done.stderr
    assert not (tmp_path / "run").exists()


def test_multi_host_flags_that_do_not_fit_are_named_and_the_meeting_flags_not_compared():
    """The three flags that place a process are checked together, in one line naming
    them (jax's words named none); the processes compare every setting but those, since
    having met they reached the same coordinator (by host name or by address)."""
    from train.hosts import initialize_distributed
    from train.loop import _settings_of

    for argv, said in (
        (["--num_processes", "2"], "--num_processes=2 needs --coordinator_address"),
        (["--coordinator_address", "h:1"], "needs --num_processes and --process_id"),
        (["--coordinator_address", "h:1", "--num_processes", "2"], "needs --process_id ("),
        (
            ["--coordinator_address", "h:1", "--num_processes", "2", "--process_id", "2"],
            "--process_id=2 must be in [0, --num_processes=2)",
        ),
    ):
        with pytest.raises(TrainingError, match=re.escape(said)):
            initialize_distributed(parse_args(argv))
    one = ["--coordinator_address", "localhost:1", "--process_id", "0", "--ddp_timeout", "9"]
    other = ["--coordinator_address", "127.0.0.1:1", "--process_id", "1"]
    assert _settings_of(parse_args(one)) == _settings_of(parse_args(other))
    assert _settings_of(parse_args(["--seed", "1"])) != _settings_of(parse_args([]))


@pytest.mark.slow
def test_a_process_killed_mid_run_ends_the_others_at_once_in_a_line(tmp_path):
    """kill -9 to one process of a two-process run: the other's next collective fails;
    it ends (exit 1) with the traceback and one line naming the stop and the last
    checkpoint, instead of waiting in jax's shutdown for the dead process and aborting
    with a C++ stack 100 s later. A save in flight then gets `SAVE_WAIT_AFTER_ERROR_S`
    (its commit waits for every process), and the next save's collective fails before
    it waits for the one before (`train.checkpoint._every_process_here`)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = _env(2)
    argv = [*SMALL, "--coordinator_address", f"localhost:{port}", "--num_processes", "2"]
    argv += ["--mesh", "data=1,fsdp=2,seq=2", "--output_dir", str(tmp_path), "--max_steps"]
    argv += ["100000", "--save_steps", "2", "--logging_steps", "1", "--progress", "true"]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "train", *argv, "--process_id", str(i)],
            env=env,
            stdout=subprocess.PIPE if i == 0 else subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    try:
        seen = []
        for line in procs[0].stdout:  # process 0's step lines: the run is training
            seen.append(line)
            if line.startswith("step 4/"):
                break
        procs[1].kill()
        procs[1].wait()
        start = time.monotonic()
        out = "".join(seen) + procs[0].communicate(timeout=90)[0]
        waited = time.monotonic() - start
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode == 1, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith(
        "error on process 0 of 2: where another process of the run stopped, this is the "
        "collective it left; the last checkpoint is step "
    ), out[-3000:]
    assert last.endswith("continue with --resume_from_checkpoint latest")
    assert "Check failure" not in out and waited < 60, (waited, out[-3000:])


@pytest.mark.slow
def test_processes_given_other_flags_are_refused_by_every_one(tmp_path):
    """A process of a multi-host run given another --learning_rate (or seed, data,
    steps, mesh, output directory) trained a mix of the two under process 0's record,
    or hung in a collective: every process now refuses at start, naming the flag and
    each process's value, and nothing is written."""
    ran = _two_processes(
        *SMALL,
        *("--mesh", "data=1,fsdp=2,seq=2", "--output_dir", str(tmp_path / "run")),
        *("--max_steps", "2"),
        second=("--learning_rate", "1e-2"),
    )
    for code, out in ran:
        assert code == 2, out[-3000:]
        assert (
            "error: the processes were given different settings (--learning_rate: process 0 "
            "has 0.003, process 1 has 0.01): every process of a run takes the same flags"
        ) in out, out[-3000:]
    assert not (tmp_path / "run").exists()


def test_sample_data_is_learnable_and_shaped():
    samples = data_lib.markov_samples(8, 64, 512, seed=0)
    assert samples.shape == (8, 64) and samples.max() < 512


@pytest.mark.multi_device(2)
@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.slow
def test_tied_embeddings_every_parameter_layout(tmp_path, bf16):
    """Llama-3.2's tied embedding (the loss takes the table as stored, [V, D]) through
    one step on 1 device and on seq=2 with replicated, sharded and gathered-once
    parameters: the same loss and gradient norm (f32: to rounding; bf16: it runs, and
    stays within bf16 noise; XLA:CPU used to refuse a transposed bf16 dot here). bf16
    leaves out the replicated layout, whose device runs the one device's dots on half
    the rows."""
    from train.build import build, model_config

    layouts = {
        "one": ("data=1,fsdp=1,seq=1", []),
        "replicated": ("data=1,fsdp=1,seq=2", ["--ring_strategy", "ring"]),  # others: auto
        "sharded": ("data=1,fsdp=1,seq=2", ["--shard_over_seq"]),
        "gathered": ("data=1,fsdp=1,seq=2", ["--shard_over_seq", "--gather_once", "true"]),
    }
    if bf16:
        del layouts["replicated"]
    got = {}
    for name, (mesh, extra) in layouts.items():
        args = ["--max_steps", "1", "--bf16", str(bf16).lower(), *extra]
        cfg = parse_args(_args(tmp_path / name, *args, mesh=mesh))
        config = dataclasses.replace(model_config(cfg), tie_word_embeddings=True)
        trainer = build(cfg, config=config, devices=jax.devices()[: 1 if name == "one" else 2])
        assert "lm_head" not in trainer.state["params"]
        _, metrics = trainer.step_fn(trainer.state, trainer.batch(0))
        got[name] = (float(metrics["loss"]), float(metrics["grad_norm"]))
    rtol = 2e-3 if bf16 else 1e-5
    for name, (loss, norm) in got.items():
        np.testing.assert_allclose([loss, norm], got["one"], rtol=rtol, err_msg=name)


def test_auto_strategy_picks_ulysses_on_one_host_where_the_heads_divide():
    """`--ring_strategy auto` (the default): Ulysses where seq splits the sequence, divides
    the query heads and stays on one host; the ring otherwise; hybrid with seq_a2a; an
    explicit strategy as given."""
    from train.build import model_config, resolve_strategy

    def picked(mesh, *extra, hosts=1, devices=8):
        cfg = parse_args(["--model_name_or_path", "tiny", "--mesh", mesh, *extra])
        sizes = parse_mesh(mesh, devices)
        fake = [types.SimpleNamespace(process_index=i % hosts) for i in range(devices)]
        resolved = resolve_strategy(cfg, model_config(cfg), sizes, fake)
        return resolved.model.ring_strategy

    assert parse_args([]).model.ring_strategy == "auto"
    # The tiny model has 4 query heads.
    assert picked("data=4,fsdp=1,seq=2") == "ulysses"
    assert picked("data=2,fsdp=1,seq=4") == "ulysses"
    assert picked("data=1,fsdp=1,seq=8") == "ring"  # 8 does not divide 4 heads
    assert picked("data=4,fsdp=1,seq=2", hosts=2) == "ring"  # across hosts
    assert picked("data=8,fsdp=1,seq=1") == "ring"  # nothing split
    assert picked("data=2,fsdp=1,seq=2,seq_a2a=2") == "hybrid"
    assert picked("data=4,fsdp=1,seq=2", "--ring_strategy", "ring") == "ring"
    assert picked("data=1,fsdp=1,seq=8", "--ring_strategy", "allgather") == "allgather"


@pytest.mark.multi_device(8)
@pytest.mark.slow
def test_shard_over_seq_matches_replicated_parameters(tmp_path):
    """The 4-GPU PyTorch + LightSeq setup: FSDP over the GPUs that also split the
    sequence (mesh seq=8)."""
    from train.build import build

    # f32 compute: the two layouts then agree to f32 rounding (bf16 would differ at 1e-4).
    common = [
        "--max_steps",
        "2",
        "--save_strategy",
        "no",
        "--export_hf",
        "false",
        "--bf16",
        "false",
    ]
    mesh = "data=1,fsdp=1,seq=8"
    sharded_cfg = parse_args(_args(tmp_path / "a", *common, "--shard_over_seq", mesh=mesh))
    trainer = build(sharded_cfg)
    embed = trainer.state["params"]["embed"]["embedding"]
    assert "seq" in str(embed.sharding.spec), embed.sharding
    assert embed.addressable_shards[0].data.size * 8 == embed.size
    sharded = run(sharded_cfg)["losses"]
    replicated = run(parse_args(_args(tmp_path / "b", *common, mesh=mesh)))["losses"]
    np.testing.assert_allclose(sharded, replicated, rtol=1e-5)
    # Stored sharded and gathered once per step (`--gather_once`) is checked against one
    # device per parameter by test_gradcheck_compares_layouts_per_parameter, and with
    # tied embeddings by test_tied_embeddings_every_parameter_layout (seq=2 both).


def test_gradcheck_out_that_cannot_be_written_is_one_line(tmp_path, monkeypatch, capsys):
    """`gradcheck --out` under a file: one line naming --out and the path (the
    layouts' gradients stubbed: only the writing is under test)."""
    from train.tools import gradcheck

    grads = {"a": np.ones(3, np.float32)}
    got = {"loss": 1.0, "tokens": 64, "rows": 1, "grads": grads}
    monkeypatch.setattr(gradcheck, "layout_gradients", lambda flags: dict(got))
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "gradcheck.json"
    layouts = ["--layout", "--mesh data=1", "--layout", "--mesh data=1", "--out"]
    with pytest.raises(SystemExit) as e:
        gradcheck.main([*layouts, str(out)])
    assert e.value.code == 2
    assert (
        capsys.readouterr().err == f"error: --out {out}: {out.parent} is a file, not a directory\n"
    )
    good = tmp_path / "gradcheck.json"
    rows = gradcheck.main([*layouts, str(good)])
    assert json.loads(good.read_text()) == json.loads(json.dumps(rows))
    # A file already there (a run's, another comparison) is kept unless --overwrite.
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        gradcheck.main([*layouts, str(good)])
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        f"error: --out {good} exists: pass --overwrite to replace it (nothing was written)\n"
    )
    gradcheck.main([*layouts, str(good), "--overwrite"])


def test_gradcheck_reads_every_layout_before_running_one(monkeypatch, capsys):
    """A layout that cannot run (an unbalanced quote, a mesh of more devices than the
    machine has, a bad value) is one line naming it before any layout's gradients are
    computed, not a traceback or a failure after the reference's run; `--top` below 0
    is refused."""
    from train.tools import gradcheck

    def computed(flags):
        raise AssertionError("a layout was computed before every layout was read")

    monkeypatch.setattr(gradcheck, "layout_gradients", computed)
    first = ["--data_path", "sample", "--layout", "--mesh data=1"]
    many = jax.device_count() + 1
    for layout, why in [
        ("--mesh 'seq=2", "No closing quotation"),
        (f"--mesh data={many}", f"needs {many} devices; this machine has {jax.device_count()}"),
        ("--ring_layout foo", "--ring_layout='foo' must be one of"),
        ("--mesh data=1 --seed 7", "--seed 7, the reference's 42: every layout starts"),
        ("--sample_num_examples 64", "--sample_num_examples 64, the reference's 256"),
        ("--model_name_or_path tiny --rope_theta 100", "--rope_theta 100.0, the reference's None"),
        (
            "--mesh data=1 --per_device_train_batch_size 2",
            "takes 2 rows per step, the reference's 1",
        ),
    ]:
        with pytest.raises(SystemExit) as e:
            gradcheck.main([*first, "--layout", layout])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith(f"error: layout {layout!r}: "), err
        assert why in err and err.endswith("(nothing was run)\n")
    with pytest.raises(SystemExit) as e:
        gradcheck.main([*first, "--layout", "--mesh data=1", "--top", "-1"])
    assert e.value.code == 2
    assert capsys.readouterr().err == "error: --top=-1 must be >= 0\n"


def test_gradcheck_out_is_never_a_file_of_the_model_it_reads(tmp_path, monkeypatch, capsys):
    """--out naming the model directory's config.json is refused before any layout,
    even with --overwrite (the file stays the model's)."""
    from train.tools import gradcheck

    monkeypatch.setattr(gradcheck, "layout_gradients", _never_computed)
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    argv = ["--model_name_or_path", str(model), "--data_path", "sample", "--overwrite"]
    with pytest.raises(SystemExit) as e:
        gradcheck.main([*argv, "--layout", "", "--layout", "", "--out", str(model / "config.json")])
    assert e.value.code == 2 and (model / "config.json").read_text() == "{}"
    assert capsys.readouterr().err == (
        f"error: --out {model}/config.json is one of the inputs; give another file for the output\n"
    )


def test_gradcheck_stopped_is_one_line(monkeypatch, capsys):
    """Ctrl-C during a layout ends gradcheck with one line and exit status 130."""
    from train.tools import gradcheck

    def stopped(flags):
        raise KeyboardInterrupt

    monkeypatch.setattr(gradcheck, "layout_gradients", stopped)
    with pytest.raises(SystemExit) as e:
        gradcheck.main(["--data_path", "sample", "--layout", "", "--layout", ""])
    assert e.value.code == 130
    assert capsys.readouterr().err == "interrupted: no comparison was written\n"


def _never_computed(flags):
    raise AssertionError("a layout was computed")


@pytest.mark.parametrize(
    "where, reason",
    [
        ("missing/gradcheck.json", "{out}: no such directory {tmp}/missing"),
        ("file/gradcheck.json", "{out}: {tmp}/file is a file, not a directory"),
        ("folder", "{out} is a directory; give a file path for the output"),
        ("locked/gradcheck.json", "{out}: {tmp}/locked is not writable (Permission denied)"),
        ("/proc/gradcheck.json", "{out}: /proc is not writable (No such file or directory)"),
    ],
)
def test_gradcheck_refuses_an_out_it_cannot_write_before_any_layout(
    tmp_path, monkeypatch, capsys, where, reason
):
    """An --out that cannot be written is one line naming --out and the path, before
    any layout's gradients are computed: a folder is writable where a file can be
    created in it, which the permission bits do not tell (/proc passes them)."""
    from train.tools import gradcheck

    def computed(flags):
        raise AssertionError("a layout was computed before --out was checked")

    monkeypatch.setattr(gradcheck, "layout_gradients", computed)
    (tmp_path / "file").write_text("")
    (tmp_path / "folder").mkdir()
    (tmp_path / "locked").mkdir()
    probe = models.files.cannot_write_in  # the tests may run as root, whom every mode lets write
    monkeypatch.setattr(
        models.files,
        "cannot_write_in",
        lambda folder: "Permission denied" if "locked" in folder else probe(folder),
    )
    out = tmp_path / where
    with pytest.raises(SystemExit) as e:
        gradcheck.main(
            ["--layout", "--mesh data=1", "--layout", "--mesh data=1", "--out", str(out)]
        )
    assert e.value.code == 2
    assert capsys.readouterr().err == f"error: --out {reason.format(out=out, tmp=tmp_path)}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "folder", "locked"]
    assert not list((tmp_path / "locked").iterdir())


@pytest.mark.multi_device(2)
@pytest.mark.slow
def test_gradcheck_compares_layouts_per_parameter(tmp_path, capsys):
    """`python -m train.tools.gradcheck`: the same step's gradients on one device and on
    seq=2 (replicated, and sharded + gathered once) agree to f32 rounding, per
    parameter; a layout with another global batch is refused; a gradient counted twice
    tops the list."""
    from train.tools import gradcheck

    common = [*SMALL[:8], "--bf16", "false"]
    out = tmp_path / "gradcheck.json"
    rows = gradcheck.main(
        [
            *common,
            "--layout",
            "--mesh data=1,fsdp=1,seq=1",
            "--layout",
            "--mesh data=1,fsdp=1,seq=2",
            "--layout",
            "--mesh data=1,fsdp=1,seq=2 --shard_over_seq true --gather_once true",
            "--out",
            str(out),
        ]
    )
    assert [r["layout"] for r in json.loads(out.read_text())] == [r["layout"] for r in rows]
    for row in rows[1:]:
        assert row["max_rel_diff"] < 1e-5, row["params"][:3]
        assert abs(row["grad_norm"] / rows[0]["grad_norm"] - 1) < 1e-6
        assert len(row["params"]) == len(
            gradcheck._tree_paths(models.init_params(models.TINY, jax.random.key(0)))
        ), "one row per parameter"
    assert "(reference)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        gradcheck.main([*common, "--layout", "--ring_layout foo", "--layout", "--mesh data=1"])
    assert "layout '--ring_layout foo': --ring_layout='foo'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gradcheck.main([*common, "--layout", "--mesh data=1", "--layout", "--mesh data=2"])
    assert "give every layout the same global batch" in capsys.readouterr().err
    ref = {"a": np.ones(3, np.float32), "b": np.ones(2, np.float32)}
    doubled = gradcheck.compare(ref, {"a": ref["a"], "b": 2 * ref["b"]})
    assert doubled[0]["param"] == "b" and doubled[0]["rel_diff"] == pytest.approx(1.0)
    with pytest.raises(SystemExit):
        gradcheck.main([*common, "--layout", "--mesh data=1"])  # one layout: nothing to compare


def test_ddp_timeout_must_be_positive():
    with pytest.raises(ValueError, match=r"^--ddp_timeout=0 must be positive$"):
        parse_args(["--ddp_timeout", "0"])


def test_step_lines_where_no_bar_is_drawn(monkeypatch):
    """Step lines go to stdout where it is not a terminal, and where it is but stderr,
    which the bar draws on, is not (`2>file`): some progress shows either way."""
    from train.loop import _progress, _step_lines

    class Stream(io.StringIO):
        def __init__(self, tty):
            super().__init__()
            self.tty = tty

        def isatty(self):
            return self.tty

    cfg = parse_args([])
    for out_tty, err_tty, want in ((True, True, False), (True, False, True), (False, True, True)):
        monkeypatch.setattr(sys, "stdout", Stream(out_tty))
        monkeypatch.setattr(sys, "stderr", Stream(err_tty))
        bar = _progress(cfg, True, 0, 10)
        assert _step_lines(bar) is want, (out_tty, err_tty)
        bar.close()
    assert _step_lines(_progress(cfg, False, 0, 10)) is False  # not the main process
    assert _step_lines(_progress(parse_args(["--progress", "false"]), True, 0, 10)) is False


def test_an_eos_no_one_chose_gets_a_warning(tmp_path):
    """The token between packed documents: a line where there is none at all, or where
    it is the model's id beside a tokenizer that names no eos_token (whichever token
    that id is there); none where --eos_token_id, the tokenizer or (for token ids, no
    tokenizer) the model chose it."""
    from train.build import _eos_warning
    from train.config import parse_args

    cfg = parse_args(["--data_path", "d.jsonl"])
    assert "no EOS between packed documents" in _eos_warning(cfg, None, None)
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 1}}}))
    said = _eos_warning(cfg, 1, str(tok))
    assert f"the tokenizer {str(tok)!r} names no eos_token: documents end with the " in said
    assert "model's eos_token_id 1, whichever token" in said
    (tok / "tokenizer_config.json").write_text(json.dumps({"eos_token": "a"}))
    assert _eos_warning(cfg, 0, str(tok)) is None
    assert _eos_warning(cfg, 1, None) is None
    chosen = parse_args(["--data_path", "d.jsonl", "--eos_token_id", "1"])
    assert _eos_warning(chosen, 1, None) is None


def test_a_ctrl_c_while_the_trainer_imports_is_one_line():
    """Ctrl-C during the seconds `python -m train` spends importing jax and the model
    ends it in one line, exit status 130, not a traceback from inside an import."""
    code = (
        "import runpy, sys\n"
        "class Stop:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'train.loop':\n"
        "            raise KeyboardInterrupt\n"
        "sys.meta_path.insert(0, Stop())\n"
        "sys.argv = ['train']\n"
        "runpy.run_module('train', run_name='__main__')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 130 and done.stderr == "interrupted while starting: nothing was run\n"
