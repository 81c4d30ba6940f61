"""The trainer refuses bad input with one line naming the value, before it deletes or
writes anything."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import ON_GPU

import models
import models.files
from models.safetensors_io import SafetensorsFile
from train import data as data_lib
from train import outputs
from train.__main__ import main
from train.config import parse_args
from train.dataset import TokenDataset
from train.loop import TrainingError, run

BASE = ["--model_name_or_path", "tiny", "--model_max_length", "64", "--progress", "false"]


def _previous_run(out) -> dict[str, bytes]:
    """A previous run's outputs (what `--overwrite_output_dir` would delete), by hand."""
    files = {
        "checkpoints/2/meta": b"{}",
        "log.jsonl": b'{"step": 1, "loss": 5.0}\n',
        "tensorboard/events.out.tfevents.1.host": b"events",
        "hf/config.json": b"{}",
    }
    for name, data in files.items():
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return files


def _one_line_error(argv, capsys) -> str:
    """`python -m train argv` exits 2 with one `error: ...` line and no traceback."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def _tiny_model_dir(path, **config_changes):
    config = models.TINY.replace(**config_changes)
    params = models.init_params(config, jax.random.key(0))
    models.export_hf(jax.device_get(params), config, path)
    return path


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--data_path", "typo.npy"], "no such data file"),
        (["--data_path", "sample", "--mesh", "data=1,fsdp=1,seq=64"], "needs 64 devices"),
        pytest.param(
            [
                "--data_path",
                "sample",
                "--mesh",
                "data=-1,fsdp=1,seq=1,seq_a2a=2",
                "--ring_strategy",
                "ring",
            ],
            "seq_a2a axis is the all-to-all axis of --ring_strategy hybrid",
            marks=pytest.mark.multi_device(2),
        ),
        pytest.param(
            [
                "--data_path",
                "sample",
                "--mesh",
                "data=-1,fsdp=1,seq=2,seq_a2a=2",
                "--ring_strategy",
                "hybrid",
                "--model_max_length",
                "34",
            ],
            "must be divisible by 4",
            marks=pytest.mark.multi_device(4),
        ),
        pytest.param(
            # The tiny model's 4 query heads over 8 devices.
            [
                "--data_path",
                "sample",
                "--mesh",
                "data=1,fsdp=1,seq=8",
                "--ring_strategy",
                "ulysses",
            ],
            "splits the model's 4 query heads over seq=8, which does not divide them",
            marks=pytest.mark.multi_device(8),
        ),
        pytest.param(
            # auto picks hybrid on seq_a2a; the remedy is one the flags take.
            ["--data_path", "sample", "--mesh", "seq_a2a=8"],
            r"--ring_strategy auto \(picking hybrid\) splits the model's 4 query heads over "
            r"seq_a2a=8, which does not divide them: choose a seq_a2a that divides them \(the "
            r"other devices on seq\), or --mesh seq=8 without seq_a2a and --ring_strategy ring",
            marks=pytest.mark.multi_device(8),
        ),
        (["--data_path", "SMALL", "--model_max_length", "4096"], "do not fill one row"),
        (  # refused whatever the data: the export carries it
            ["--data_path", "sample", "--chat_template", "typo.jinja"],
            r"^--chat_template='.*typo\.jinja': no such file or directory",
        ),
        (
            ["--data_path", "sample", "--model_name_or_path", "nope"],
            r"neither a local HF directory nor a preset \(llama2-13b, .* llama3.2-1b, "
            r"llama3.2-3b, tiny\)",
        ),
    ],
)
def test_overwrite_keeps_the_previous_run_when_the_new_one_cannot_start(tmp_path, extra, match):
    """A typo in the data, a bad mesh or a too-long context: the previous run's
    checkpoints, log, TensorBoard files and export are all still there."""
    out = tmp_path / "run"
    files = _previous_run(out)
    small = tmp_path / "small.npy"
    data_lib.save_dataset(small, np.arange(300, dtype=np.int32).reshape(3, 100) % 500)
    extra = [
        str(small) if a == "SMALL" else str(tmp_path / a) if a.startswith("typo.") else a
        for a in extra
    ]
    argv = [*BASE, "--output_dir", str(out), "--overwrite_output_dir", "--max_steps", "1"]
    with pytest.raises((TrainingError, ValueError), match=match):
        run(parse_args([*argv, *extra]))
    for name, data in files.items():
        assert (out / name).read_bytes() == data, name


@pytest.mark.parametrize("cached", [False, True])
def test_data_shorter_than_a_row_names_model_max_length(tmp_path, capsys, cached):
    """Data of fewer tokens than one row: one line naming the flag that sets the row's
    length (the user's name for it), in memory and through a token cache alike."""
    small = tmp_path / "small.npy"
    data_lib.save_dataset(small, np.arange(300, dtype=np.int32).reshape(3, 100) % 500)
    caches = ["--data_cache_dir", str(tmp_path / "caches")] if cached else []
    argv = [*BASE, "--data_path", str(small), "--model_max_length", "4096", *caches]
    err = _one_line_error([*argv, "--output_dir", str(tmp_path / "out")], capsys)
    assert "303 tokens do not fill one row of --model_max_length=4096 tokens" in err, err
    assert "lower --model_max_length or add data" in err


def test_text_data_with_a_model_directory_without_a_tokenizer_asks_for_one(tmp_path, capsys):
    """A model directory without tokenizer.json (`models.convert --init` without
    `--tokenizer`) and prompt/completion records: the line asks for
    --tokenizer_name_or_path, rather than naming a tokenizer.json nobody gave."""
    model = _tiny_model_dir(tmp_path / "model")
    data = tmp_path / "qa.jsonl"
    data.write_text(json.dumps({"prompt": "Q: 1 + 1?\nA:", "completion": " 2"}) + "\n")
    argv = ["--model_name_or_path", str(model), "--data_path", str(data), "--max_steps", "1"]
    err = _one_line_error([*argv, "--output_dir", str(tmp_path / "out")], capsys)
    assert "line 1: has 'prompt' and 'completion' but no tokenizer was given; pass " in err
    assert "--tokenizer_name_or_path" in err and "does not exist" not in err


def test_missing_data_path_is_refused_even_with_a_model_directory(tmp_path, capsys):
    """No silent made-up data: `--data_path` is required; `sample` asks for it."""
    model = _tiny_model_dir(tmp_path / "model")
    (model / "tokenizer.json").write_text("{}")
    out = tmp_path / "out"
    err = _one_line_error(
        ["--model_name_or_path", str(model), "--output_dir", str(out), "--max_steps", "1"], capsys
    )
    assert "--data_path is required" in err and "'sample'" in err
    assert not out.exists()


@pytest.mark.parametrize("cached", [False, True])
def test_data_whose_every_label_is_ignored_is_refused(tmp_path, capsys, cached):
    """Records whose labels are all -100 (and end in the EOS, so none is added) leave
    nothing to learn or measure: refused by flag before anything is written, in memory
    and through a token cache alike, instead of training on a loss of 0."""
    eos = models.TINY.eos_token_id
    masked = tmp_path / "masked.jsonl"
    with open(masked, "w") as f:
        for i in range(8):
            f.write(json.dumps({"input_ids": [5 + i] * 63 + [eos], "labels": [-100] * 64}) + "\n")
    out = tmp_path / "out"
    argv = [*BASE, "--output_dir", str(out), "--max_steps", "1", "--mesh", "data=-1"]
    argv += ["--data_cache_dir", str(tmp_path / "caches")] if cached else []
    err = _one_line_error([*argv, "--data_path", str(masked)], capsys)
    assert err == (
        f"error: --data_path={str(masked)!r}: every label is -100, no labelled tokens to train on\n"
    )
    argv += ["--data_path", "sample", "--eval_data_path", str(masked)]
    err = _one_line_error(argv, capsys)
    assert err.endswith("every label is -100, no labelled tokens to evaluate\n"), err
    assert not out.exists()
    if not cached:  # a folder of no data files is named by its flag too
        (empty := tmp_path / "empty").mkdir()
        err = _one_line_error([*argv[:-1], str(empty)], capsys)
        assert err.startswith(f"error: --eval_data_path {empty}: a directory that is neither"), err


def test_output_dir_that_cannot_be_written(tmp_path, capsys, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    argv = [*BASE, "--data_path", "sample", "--max_steps", "1"]
    err = _one_line_error([*argv, "--output_dir", str(afile)], capsys)
    assert f"--output_dir='{afile}' is a file" in err
    err = _one_line_error([*argv, "--output_dir", str(afile / "run")], capsys)
    assert f"{afile} is a file" in err
    err = _one_line_error([*argv, "--output_dir", "/proc/run"], capsys)  # root passes os.access
    assert "--output_dir='/proc/run' cannot be created in /proc (No such file or directory)" in err
    monkeypatch.setattr(models.files, "cannot_write_in", lambda folder: "Permission denied")
    err = _one_line_error([*argv, "--output_dir", str(tmp_path / "new" / "run")], capsys)
    assert f"cannot be created in {tmp_path} (Permission denied)" in err
    assert not afile.is_dir() and afile.read_text() == "not a directory"


def test_broken_model_directories_are_named(tmp_path, capsys):
    """No config.json, no weights, a missing shard, a truncated file, broken JSON: one
    line naming the file each, never a traceback."""
    model = _tiny_model_dir(tmp_path / "model")
    out = tmp_path / "out"
    argv = ["--data_path", "sample", "--output_dir", str(out), "--progress", "false"]

    def error(directory) -> str:
        return _one_line_error([*argv, "--model_name_or_path", str(directory)], capsys)

    empty = tmp_path / "empty"
    empty.mkdir()
    assert f"{empty / 'config.json'} does not exist" in error(empty)

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"vocab_size": 512,')
    assert f"{broken / 'config.json'} is not valid JSON" in error(broken)

    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_bytes((model / "config.json").read_bytes())
    assert f"{no_weights} has no weights" in error(no_weights)

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_bytes((model / "config.json").read_bytes())
    weights = (model / "model.safetensors").read_bytes()
    (sharded / "model-00001-of-00002.safetensors").write_bytes(weights)
    names = list(SafetensorsFile(model / "model.safetensors"))
    half = len(names) // 2
    shard = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = {"weight_map": {n: shard[i >= half] for i, n in enumerate(names)}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    message = error(sharded)
    assert "lists shards that are not in" in message and shard[1] in message

    truncated = tmp_path / "truncated"
    truncated.mkdir()
    (truncated / "config.json").write_bytes((model / "config.json").read_bytes())
    (truncated / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    assert f"{truncated / 'model.safetensors'} is truncated" in error(truncated)
    (truncated / "model.safetensors").write_bytes(weights[:5])
    assert "not a valid safetensors file" in error(truncated)
    assert not out.exists()


def test_flags_negative_numbers_and_abbreviations(capsys):
    """`-1e-3` is read as a number (and refused by its rule); abbreviated flags are
    refused; argparse errors are one line, not the usage."""
    err = _one_line_error([*BASE, "--learning_rate", "-1e-3"], capsys)
    assert "--learning_rate=-0.001 must be >= 0" in err
    with pytest.raises(ValueError, match=r"--adam_beta1=-0\.5 must be in \[0, 1\)"):
        parse_args(["--adam_beta1", "-5e-1"])  # read as a number, refused by its rule
    with pytest.raises(ValueError, match=r"--seed=-3 must be in"):
        parse_args(["--adam_epsilon", "0.5e-3", "--seed", "-3"])
    assert parse_args(["--max_steps", "-1"]).run.max_steps == -1  # -1: the epochs decide
    for argv in (["--learning", "1e-3"], ["--max_steps"]):
        with pytest.raises(SystemExit) as info:
            parse_args(argv)
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err
        assert "--help` lists the flags" in err
    assert "unrecognized arguments: --learning 1e-3" in _last_error(["--learning", "1e-3"], capsys)


def _last_error(argv, capsys) -> str:
    with pytest.raises(SystemExit):
        parse_args(argv)
    return capsys.readouterr().err


def test_a_run_directory_or_checkpoint_as_the_model_says_what_to_give(tmp_path):
    """--model_name_or_path of a run's output directory or of one of its checkpoints
    (no config.json there) names the export to give instead, where it said only that
    the config did not exist; a missing checkpoint step names the steps there."""
    from train.build import model_config
    from train.checkpoint import resolve_resume

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "8").mkdir(parents=True)
    (run_dir / "checkpoints" / "4").mkdir()
    (run_dir / "train_config.yaml").write_text("run: {}\n")
    (run_dir / "log.jsonl").write_text("")

    def error(model: str) -> str:
        with pytest.raises(TrainingError) as e:
            model_config(parse_args(["--model_name_or_path", model]))
        return str(e.value)

    assert error(str(run_dir)).endswith(
        "is a training run's output directory, not an HF model: give an export of one of "
        f"its checkpoints (python -m train.tools.export {run_dir} --out DIR)"
    )
    (run_dir / "hf").mkdir()
    (run_dir / "hf" / "config.json").write_text("{}")
    assert error(str(run_dir)).endswith(f"not an HF model: give its export {run_dir / 'hf'}")
    assert error(str(run_dir / "checkpoints" / "8")).endswith(
        "is a checkpoint of a training run, not an HF model: export it with python -m "
        f"train.tools.export {run_dir} --step 8 --out DIR and give DIR "
        "(--resume_from_checkpoint resumes it, optimizer state and all)"
    )
    with pytest.raises(ValueError, match=r"7 does not exist \(the steps there: 4, 8\)$"):
        resolve_resume(str(run_dir / "checkpoints" / "7"), str(tmp_path / "out"))


def test_resume_with_another_number_of_steps_is_refused():
    """Extending a finished run would restart (or jump) its cosine schedule."""
    from train.run_record import check_resumable

    saved = {
        "model_max_length": 64,
        "rows_per_step": 8,
        "num_rows": 96,
        "seed": 42,
        "optim": "adamw",
    }
    meta = {"step": 30, "run": {**saved, "total_steps": 30}}
    check_resumable(meta, {**saved, "total_steps": 30}, "ckpts")
    with pytest.raises(TrainingError, match="belongs to a run of 30 steps; this run has 60"):
        check_resumable(meta, {**saved, "total_steps": 60}, "ckpts")
    # Checkpoints written before the step count was recorded resume as before.
    check_resumable({"step": 30, "run": saved}, {**saved, "total_steps": 60}, "ckpts")
    # --dataloader_drop_last dropped whole steps' rows before it dropped the partial
    # micro-batch: such a checkpoint whose epochs had other steps is refused by name.
    old = {**saved, "dataloader_drop_last": True, "num_rows": 90, "total_steps": 30}
    new = {**old, "steps_per_epoch": 12}  # 90 rows, micro-batches of 4, steps of 8
    with pytest.raises(TrainingError, match=r"dropped each epoch's last partial step \(11 "):
        check_resumable({"step": 2, "run": old}, new, "run/checkpoints")
    check_resumable({"step": 2, "run": old}, {**new, "steps_per_epoch": 11}, "ckpts")


def test_a_checkpoint_from_before_a_schedule_flag_trains_longer():
    """A checkpoint whose record predates a schedule flag (`--lr_scheduler_kwargs`) was
    refused a longer run for "other schedule flags" the user never changed; a flag the
    record lacks counts as its default, and a flag that did change is named."""
    from train.config import OptimArgs
    from train.run_record import SCHEDULE_FLAGS, check_resumable

    base = {"model_max_length": 64, "rows_per_step": 8, "num_rows": 96, "seed": 42}
    base["optim"] = "adamw"
    args = OptimArgs(lr_scheduler_type="constant", learning_rate=1e-3)
    flags = {k: getattr(args, k) for k in SCHEDULE_FLAGS}
    older = {k: v for k, v in flags.items() if k != "lr_scheduler_kwargs"}

    def record(flags, total):
        return {**base, "total_steps": total, "schedule": {"flags": flags, "lr": {}}}

    said = check_resumable({"step": 6, "run": record(older, 6)}, record(flags, 12), "ckpts")
    assert "the schedule's rates of its first 6 steps are the same under both" in said
    with pytest.raises(TrainingError, match=r"other schedule flags \(--learning_rate 0.001 -> "):
        check_resumable(
            {"step": 6, "run": record(older, 6)},
            record({**flags, "learning_rate": 2e-3}, 12),
            "ckpts",
        )


def test_a_requeue_on_another_mesh_is_told_the_split_that_keeps_its_rows():
    """A resume whose rows a step differ (a `-1` mesh axis on another number of
    devices) is refused naming the rows, and told the per-device batch and accumulation
    that give them on this mesh; with --dataloader_drop_last, the same rows a step split
    into other micro-batches drop other rows each epoch: refused, told the split whose
    micro-batch is the checkpoint's."""
    from train.run_record import check_resumable

    def run(per_device, shards, accum, rows_per_epoch=None, drop_last=False):
        return {
            "rows_per_step": per_device * shards * accum,
            "num_rows": 103,
            "dataloader_drop_last": drop_last,
            "rows_per_epoch": rows_per_epoch,
            "split": {
                "per_device_batch": per_device,
                "batch_shards": shards,
                "accumulation": accum,
            },
            "total_steps": 8,
            "optim": "adamw",
        }

    # Another token after each document: named by its flag, whatever the data shows.
    eos = {"step": 4, "run": {**run(2, 2, 1), "eos_id": 0}}
    with pytest.raises(
        TrainingError, match=r"\(token after each document \(--eos_token_id\) 0 -> none\)"
    ):
        check_resumable(eos, {**run(2, 2, 1), "eos_id": None}, "ckpts")
    saved = {"step": 4, "run": run(2, 2, 1)}  # 4 rows a step on 4 devices (fsdp=2, seq=2)
    with pytest.raises(TrainingError) as e:
        check_resumable(saved, run(2, 1, 1), "ckpts")  # on 2 devices: fsdp=-1 is 1
    assert "(rows a step (per-device batch x data x fsdp x accumulation) 4 -> 2)" in str(e.value)
    assert (
        "; on this mesh (data x fsdp = 1), --per_device_train_batch_size 2 "
        "--gradient_accumulation_steps 2 gives its 4 rows a step, or "
    ) in str(e.value)
    check_resumable(saved, run(2, 1, 2), "ckpts")
    with pytest.raises(TrainingError, match=r"x fsdp = 8\) no per-device batch x accumulation"):
        check_resumable(saved, run(1, 8, 1), "ckpts")
    # drop_last: 103 rows in micro-batches of 4 use 100; of 2, 102.
    saved = {"step": 12, "run": run(2, 2, 2, rows_per_epoch=100, drop_last=True)}
    check_resumable(saved, run(4, 1, 2, rows_per_epoch=100, drop_last=True), "ckpts")
    # Other data under the same split: the rows, not the split, are what changed.
    other = {**run(2, 2, 2, rows_per_epoch=88, drop_last=True), "num_rows": 90}
    with pytest.raises(TrainingError) as e:
        check_resumable(saved, other, "ckpts")
    assert "(rows of data 103 -> 90)" in str(e.value) and "on this mesh" not in str(e.value)
    with pytest.raises(TrainingError) as e:
        check_resumable(saved, run(1, 2, 4, rows_per_epoch=102, drop_last=True), "ckpts")
    assert "rows an epoch (--dataloader_drop_last drops what does not fill a micro-batch" in (
        str(e.value)
    )
    assert (
        "on this mesh (data x fsdp = 2), --per_device_train_batch_size 2 "
        "--gradient_accumulation_steps 2 gives its 8 rows a step"
    ) in str(e.value)


def test_a_drop_last_checkpoint_of_an_earlier_jflash_warns_its_rows_are_unchecked():
    """A --dataloader_drop_last checkpoint written before the rows an epoch were
    recorded: whether this run drops the same rows cannot be checked, and a line says
    so where it drops any; none where it drops none or the checkpoint records them."""
    from train.run_record import drop_last_warning

    old = {"step": 4, "run": {"dataloader_drop_last": True, "num_rows": 103}}
    drops = {"num_rows": 103, "rows_per_epoch": 100}
    assert drop_last_warning(old, drops).startswith(
        "warning: checkpoint 4 records no rows an epoch (an earlier jflash wrote it): this "
        "run drops the last 3 rows of each epoch"
    )
    assert drop_last_warning(old, {"num_rows": 103, "rows_per_epoch": 103}) is None
    recorded = {"step": 4, "run": {**old["run"], "rows_per_epoch": 100}}
    assert drop_last_warning(recorded, drops) is None
    assert drop_last_warning({"step": 4, "run": {"num_rows": 103}}, drops) is None


def test_a_checkpoint_of_an_earlier_jflash_warns_its_update_settings_are_unchecked():
    """A checkpoint written before the update settings were recorded resumed with other
    ones (--weight_decay, --max_grad_norm) without a word: a line now says they cannot
    be compared; none where the checkpoint records them or no step is left."""
    from train.run_record import update_warning

    update = {"adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8}
    update |= {"weight_decay": 0.1, "max_grad_norm": 0.5, "compute_dtype": "bfloat16"}
    now = {"optim": "adamw", "total_steps": 20, "update": update}
    old = {"step": 8, "run": {"optim": "adamw", "total_steps": 20}}
    assert update_warning(old, now) == (
        "warning: checkpoint 8 records no update settings (an earlier jflash wrote it): "
        "this run's (--adam_beta1 0.9, --adam_beta2 0.999, --adam_epsilon 1e-08, "
        "--weight_decay 0.1, --max_grad_norm 0.5) are not compared with those its first 8 "
        "steps used; its run's train_config.yaml named them"
    )
    assert update_warning({"step": 8, "run": {**old["run"], "update": update}}, now) is None
    assert update_warning({"step": 20, "run": old["run"]}, now) is None  # nothing left


def test_resume_with_another_model_is_refused_before_reading_it(tmp_path, capsys):
    """A checkpoint of another model (here another vocabulary) is refused in one line
    naming what differs, before Orbax reads it (which logs a traceback per array)."""
    out = tmp_path / "run"
    argv = [*BASE, "--data_path", "sample", "--max_steps", "1", "--report_to", "none"]
    assert main([*argv, "--output_dir", str(out), "--export_hf", "false"]) == 0
    capsys.readouterr()
    model = _tiny_model_dir(tmp_path / "model", vocab_size=1024)
    resume = ["--resume_from_checkpoint", str(out / "checkpoints" / "1")]
    other = ["--model_name_or_path", str(model), "--sample_vocab_size", "512"]
    err = _one_line_error([*argv, *other, *resume, "--output_dir", str(tmp_path / "b")], capsys)
    assert "was trained as another model (vocab_size 512 -> 1024); resume with" in err
    assert not (tmp_path / "b").exists()


def test_resume_with_another_rope_is_refused(tmp_path, capsys):
    """A model directory whose config.json changed since the checkpoint in a way no
    parameter shape shows (another rope_theta) is refused in one line naming the key:
    resuming would train the weights as another model."""
    model = _tiny_model_dir(tmp_path / "model")
    argv = [*BASE, "--data_path", "sample", "--max_steps", "1", "--report_to", "none"]
    argv[argv.index("tiny")] = str(model)
    out = tmp_path / "run"
    assert main([*argv, "--output_dir", str(out), "--export_hf", "false"]) == 0
    capsys.readouterr()
    config = json.loads((model / "config.json").read_text())
    theta = config["rope_theta"]
    config["rope_theta"] = 2 * theta
    (model / "config.json").write_text(json.dumps(config))
    resume = ["--resume_from_checkpoint", str(out / "checkpoints" / "1")]
    err = _one_line_error([*argv, *resume, "--output_dir", str(tmp_path / "b")], capsys)
    assert f"was trained as another model (rope_theta {theta} -> {2 * theta});" in err
    assert not (tmp_path / "b").exists()


def test_out_of_memory_advice_names_the_host_pool_when_host_memory_ran_out():
    from train.loop import _oom_error

    host = RuntimeError("RESOURCE_EXHAUSTED: Out of memory (xla_gpu_host_bfc) allocating 65 GiB")
    offloaded = parse_args(["--remat_policy", "offload_attn"])
    assert "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB" in str(_oom_error(offloaded, host))
    # Without offloading the host pool is not the one that ran out.
    plain = parse_args([])
    assert str(_oom_error(plain, host)).startswith("out of device memory")
    device = RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")
    assert str(_oom_error(offloaded, device)).startswith("out of device memory")


def test_attention_implementation_is_checked_against_jflash():
    with pytest.raises(ValueError, match=r"--attention_implementation='mosaic' must be one of"):
        parse_args(["--attention_implementation", "mosaic"])
    assert parse_args(["--attention_implementation", "xla"]).model.attention_implementation == "xla"


def test_out_of_memory_advice_names_the_allocator_when_the_block_fits(monkeypatch):
    """A step whose temporary block fits the device's limit but was not allocated (the
    1B at 256k: 82.3 GiB of 133 failed with the default allocator) gets the allocator
    that runs it; one that does not fit gets no such advice."""
    from train.loop import _oom_error
    from train.oom import allocator_hint, failed_allocation_bytes

    gib = 2**30
    error = RuntimeError(
        "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 88342883328 bytes."
    )
    assert failed_allocation_bytes(error) == 88342883328
    assert failed_allocation_bytes("out of memory") is None
    hint = allocator_hint(88342883328, 133 * gib, 11 * gib)
    assert "(82.3 GiB) fits the device's limit (133.0 GiB, 11.0 in use)" in hint
    assert "XLA_PYTHON_CLIENT_ALLOCATOR=cuda_async" in hint
    assert allocator_hint(88342883328, 90 * gib, 11 * gib) == ""  # really too big
    assert allocator_hint(None, 133 * gib, 0) == ""

    class Device:
        def memory_stats(self):
            return {"bytes_limit": 133 * gib, "bytes_in_use": 11 * gib}

    monkeypatch.setattr(jax, "local_devices", lambda: [Device()])
    monkeypatch.delenv("XLA_PYTHON_CLIENT_ALLOCATOR", raising=False)
    message = str(_oom_error(parse_args([]), error))
    assert message.startswith("out of device memory; the allocation it failed (82.3 GiB)")
    assert "\n" not in message
    monkeypatch.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "cuda_async")  # already the advice
    assert "cuda_async" not in str(_oom_error(parse_args([]), error)).split(". Turn")[0]


def test_resume_on_other_data_of_as_many_rows_is_refused(tmp_path, capsys):
    """A checkpoint records a fingerprint of its data: the same rows in another order
    (as many rows, so the row count cannot tell) are refused in one line, before the
    new output directory is made; the same data resumes."""
    rng = np.random.default_rng(0)
    data = rng.integers(1, 500, size=(48, 64), dtype=np.int32)
    np.save(tmp_path / "a.npy", data)
    np.save(tmp_path / "b.npy", data[rng.permutation(len(data))])
    argv = [*BASE, "--max_steps", "2", "--save_steps", "1", "--report_to", "none"]
    first = ["--data_path", str(tmp_path / "a.npy"), "--output_dir", str(tmp_path / "run")]
    assert main([*argv, *first, "--export_hf", "false"]) == 0
    capsys.readouterr()
    resume = ["--resume_from_checkpoint", str(tmp_path / "run" / "checkpoints" / "1")]
    other = ["--data_path", str(tmp_path / "b.npy"), "--output_dir", str(tmp_path / "b")]
    err = _one_line_error([*argv, *resume, *other], capsys)
    assert "was written on other data: as many rows, but their tokens differ" in err
    assert not (tmp_path / "b").exists()
    same = ["--data_path", str(tmp_path / "a.npy"), "--output_dir", str(tmp_path / "a")]
    assert main([*argv, *resume, *same, "--export_hf", "false"]) == 0


def test_data_fingerprint_follows_the_rows_tokens_and_order():
    from train.run_record import data_fingerprint

    rows = TokenDataset.from_examples("x", [np.arange(1, 700) % 97]).rows(32, eos_id=0)
    again = TokenDataset.from_examples("x", [np.arange(1, 700) % 97]).rows(32, eos_id=0)
    assert data_fingerprint(rows) == data_fingerprint(again)
    other = TokenDataset.from_examples("x", [np.arange(2, 701) % 97]).rows(32, eos_id=0)
    assert data_fingerprint(other) != data_fingerprint(rows)


def test_resume_on_the_same_tokens_with_other_labels_is_refused():
    """Prompt/completion records and the same texts as plain `text` records tokenize to
    the same ids with other labels (the loss on the completions only, or on every
    token): a checkpoint records its rows' labels too, and a resume on the other labels
    is refused; a checkpoint from before that record resumes as before."""
    from train.run_record import check_resumable, data_fingerprint, label_fingerprint

    ids = np.arange(1, 700) % 97
    prompted = np.where(np.arange(699) % 7 < 4, -100, ids)
    sft = TokenDataset.from_examples("x", [ids], [prompted]).rows(32, eos_id=0)
    text = TokenDataset.from_examples("x", [ids]).rows(32, eos_id=0)
    assert data_fingerprint(sft) == data_fingerprint(text)  # the same tokens
    assert label_fingerprint(sft) != label_fingerprint(text)
    again = TokenDataset.from_examples("x", [ids], [prompted]).rows(32, eos_id=0)
    assert label_fingerprint(again) == label_fingerprint(sft)

    def run_meta(rows):
        return {
            "num_rows": rows.num_rows,
            "data": data_fingerprint(rows),
            "labels": label_fingerprint(rows),
            "total_steps": 30,
            "optim": "adamw",
        }

    meta = {"step": 10, "run": run_meta(sft)}
    check_resumable(meta, run_meta(again), "ckpts")
    with pytest.raises(TrainingError, match="the same tokens, but other labels") as refused:
        check_resumable(meta, run_meta(text), "ckpts")
    assert "\n" not in str(refused.value)
    older = {"step": 10, "run": {k: v for k, v in run_meta(sft).items() if k != "labels"}}
    check_resumable(older, run_meta(text), "ckpts")


def test_made_up_model_and_data_are_named_and_a_path_called_sample_is_data(
    tmp_path, monkeypatch, capsys
):
    """A preset's random weights and generated data each get a line; a file or
    directory named `sample` is the user's data, never replaced by generated data."""
    out = tmp_path / "run"
    argv = [*BASE, "--max_steps", "1", "--report_to", "none", "--export_hf", "false"]
    assert main([*argv, "--data_path", "sample", "--output_dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "--model_name_or_path tiny: the preset's shape, randomly initialised" in printed
    assert "--data_path sample: generated Markov-chain data, not a dataset" in printed
    monkeypatch.chdir(tmp_path)
    np.save(tmp_path / "tokens.npy", np.ones((8, 64), np.int32))
    os.rename(tmp_path / "tokens.npy", tmp_path / "sample")
    assert main([*argv, "--data_path", "sample", "--output_dir", str(tmp_path / "b")]) == 2
    captured = capsys.readouterr()
    assert "Markov" not in captured.out and "sample" in captured.err


def test_a_previous_run_without_checkpoints_is_not_offered_a_resume(tmp_path):
    """A run stopped before its first save left a log but nothing to resume from: the
    refusal offers what works (overwrite, another directory), not a resume that fails."""

    out = tmp_path / "run"
    out.mkdir()
    (out / "log.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    claim = dict(continuing=False, overwrite=False, resume_flag=None)
    with pytest.raises(TrainingError, match="it saved no checkpoint") as refused:
        outputs.check_claim(str(out), **claim)
    assert "--resume_from_checkpoint" not in str(refused.value)
    _previous_run(out)  # with a checkpoint, continuing is offered
    with pytest.raises(TrainingError, match="continue it with --resume_from_checkpoint latest"):
        outputs.check_claim(str(out), **claim)


def test_the_demo_refuses_the_flags_it_owns_and_deletes_nothing(tmp_path, monkeypatch, capsys):
    """`python -m train.demo --output_dir X` once replaced the run in X with the demo's:
    the demo's model, data, config and output directory are its own and refused."""
    from train import demo

    monkeypatch.chdir(tmp_path)
    previous = _previous_run(tmp_path / "precious")
    for flag in (["--output_dir", "precious"], ["--output_dir=precious"], ["--data_path", "x"]):
        assert demo.main(["--max_steps", "3", *flag]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {flag[0].split('=')[0]} is the demo's own"), err
    for name, data in previous.items():
        assert (tmp_path / "precious" / name).read_bytes() == data
    assert not (tmp_path / "runs").exists()


def test_the_demos_help_writes_nothing(tmp_path, monkeypatch, capsys):
    """`--help` of either demo says what it does and which flags it owns, and writes
    nothing (it once made the model, tokenizer and caches first)."""
    from train import demo, text_demo

    monkeypatch.chdir(tmp_path)
    assert demo.main(["--help"]) == 0
    said = capsys.readouterr().out
    assert said.startswith("`make demo`") and "--keep: reuse" in said
    assert "--output_dir, --overwrite_output_dir: the demo's own" in said
    monkeypatch.setattr(sys, "argv", ["text_demo", "-h"])
    text_demo.main()
    assert capsys.readouterr().out.startswith("`make demo-text`")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "name", sorted(n for n in os.listdir(os.path.join(os.path.dirname(__file__), "..", "configs")))
)
def test_shipped_configs_warn_of_nothing(name, tmp_path, capsys):
    """`make demo` began with a warning its own config caused (`sample_num_examples` in
    `configs/demo.yaml`, unused beside the demo's data file): each shipped config, given
    a data file as its users give one, draws no warning (the reference job's `fp16: true`
    draws its note: it runs as bf16)."""
    from train.config import shipped_config

    cfg = parse_args(
        ["--config", shipped_config(name), "--model_name_or_path", "tiny", "--data_path",
         str(tmp_path / "data.pkl"), "--output_dir", str(tmp_path / "train")]
    )  # fmt: skip
    assert cfg.run.max_steps != 0
    err = capsys.readouterr().err
    assert not [line for line in err.splitlines() if not line.startswith("note: --fp16")], err


def test_the_text_demo_without_tokenizers_says_so_before_writing(tmp_path, monkeypatch):
    """A plain install has no `tokenizers`: the text demo names the extra in one line
    before it gathers or writes anything."""
    import importlib.util

    from train import text_demo

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tokenizers" else real(name)
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["text_demo"])
    with pytest.raises(SystemExit, match=r"needs the 'tokenizers' package: pip install 'jflash"):
        text_demo.main()
    assert os.listdir(tmp_path) == []


def test_a_signal_stop_exits_with_the_shells_status_for_the_signal():
    """The trainer, the demos and the profiling tools end a run a signal stopped with
    the status a shell gives a process that signal killed: 128 + its number."""
    import signal

    from train.errors import signal_status
    from train.tools.trace import PIPE_CLOSED

    assert signal_status(signal.SIGTERM) == 143
    assert signal_status(signal.SIGINT) == 130
    assert PIPE_CLOSED == signal_status(signal.SIGPIPE) == 141


def test_the_demo_ends_a_preempted_run_with_its_resume_command(tmp_path, monkeypatch, capsys):
    """SIGTERM in the demo's training (the loop saved the step reached) ends it in one
    line that names the demo's own resume command, with SIGTERM's exit status; a resume
    measures the loss's fall from the log's first loss, before the resume."""
    from train import demo
    from train.errors import Preempted

    monkeypatch.chdir(tmp_path)

    def preempted(cfg):
        raise Preempted(52, "runs/demo/train/checkpoints", saved=True)

    monkeypatch.setattr(demo, "run", preempted)
    assert demo.main(["--max_steps", "3"]) == 143
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        "SIGTERM: saved a checkpoint at step 52 in runs/demo/train/checkpoints; resume with "
        "python -m train.demo --keep --resume_from_checkpoint latest"
    ), err

    log = tmp_path / "runs" / "demo" / "train" / "log.jsonl"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text('{"step": 10, "loss": 5.348}\n{"step": 60, "loss": 1.3}\n')
    resumed = {"losses": [1.3] * 5 + [1.08] * 10, "start_step": 52}
    configs = []
    monkeypatch.setattr(demo, "run", lambda cfg: configs.append(cfg) or resumed)
    monkeypatch.setattr(demo.subprocess, "run", lambda *a, **k: None)  # the report
    for argv in (
        ["--keep", "--resume_from_checkpoint", "latest"],
        ["--keep", "--resume_from_checkpoint=latest"],
    ):
        assert demo.main(argv) == 0
        out = capsys.readouterr().out
        assert "loss: step 10 (before the resume) 5.348 -> last 10 steps 1.080" in out, out
        assert not configs[-1].run.overwrite_output_dir  # a resume keeps the run it continues
    monkeypatch.setattr(demo, "run", lambda cfg: {"losses": [], "start_step": 300})
    assert demo.main(argv) == 0  # a finished run resumed: nothing trained, nothing to check


def test_positions_past_the_models_context_get_a_line(tmp_path, capsys):
    """Training past `max_position_embeddings` extends the context: allowed, and said."""
    model = _tiny_model_dir(tmp_path / "m", max_position_embeddings=32)
    argv = [
        "--model_name_or_path",
        str(model),
        "--model_max_length",
        "64",
        "--progress",
        "false",
        "--max_steps",
        "1",
        "--report_to",
        "none",
        "--export_hf",
        "false",
        "--data_path",
        "sample",
    ]
    assert main([*argv, "--output_dir", str(tmp_path / "a")]) == 0
    printed = capsys.readouterr().out
    assert (
        "--model_max_length 64: positions up to 63 run past the model's "
        "max_position_embeddings 32 (RoPE default, theta 10000)" in printed
    )
    # Within the model's context: no line.
    argv[3] = "32"
    assert main([*argv, "--output_dir", str(tmp_path / "b")]) == 0
    assert "max_position_embeddings" not in capsys.readouterr().out


def test_rope_flags_set_the_runs_rope_and_its_export(tmp_path, capsys):
    """--rope_theta and --rope_scaling (context extension without editing config.json):
    the run's RoPE (a line says which), its export's config.json, and a resume with
    another one is refused naming the flags; malformed values are one line each."""
    import json

    import models

    model = _tiny_model_dir(tmp_path / "m", max_position_embeddings=32)
    argv = ["--model_name_or_path", str(model), "--model_max_length", "64", "--max_steps"]
    argv += ["2", "--save_steps", "1", "--progress", "false", "--report_to", "none"]
    argv += ["--data_path", "sample", "--learning_rate", "1e-2"]
    rope = ["--rope_theta", "500000", "--rope_scaling", '{"rope_type": "linear", "factor": 2}']
    assert main([*argv, *rope, "--output_dir", str(tmp_path / "a")]) == 0
    printed = capsys.readouterr().out
    assert (
        "--rope_theta and --rope_scaling: RoPE linear (factor 2), theta 500000, for this run "
        "and its export" in printed
    )
    assert "max_position_embeddings 32 (RoPE linear, theta 500000)" in printed
    exported = json.loads((tmp_path / "a" / "hf" / "config.json").read_text())
    assert exported["rope_theta"] == 500000.0
    assert exported["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    assert models.from_hf_config(tmp_path / "a" / "hf").rope == models.RopeConfig(
        theta=500000.0, type="linear", factor=2.0
    )
    # The RoPE changes what is computed: without the flags, other losses.
    assert main([*argv, "--output_dir", str(tmp_path / "b")]) == 0
    with open(tmp_path / "a" / "log.jsonl") as a, open(tmp_path / "b" / "log.jsonl") as b:
        assert json.loads(a.readline())["loss"] != json.loads(b.readline())["loss"]
    capsys.readouterr()
    resume = ["--resume_from_checkpoint", str(tmp_path / "a" / "checkpoints" / "1")]
    err = _one_line_error([*argv, *resume, "--output_dir", str(tmp_path / "c")], capsys)
    assert "rope_theta 500000.0 -> 10000.0" in err
    assert err.endswith("(the run's model_config.json) and its --rope_theta / --rope_scaling\n")
    for flag, value, words in (
        ("--rope_scaling", '{"rope_type": "yarn", "factor": 4}', "unknown rope type 'yarn'"),
        ("--rope_scaling", "[4]", "must be a JSON object"),
        ("--rope_scaling", "{linear", "not JSON"),
        ("--rope_theta", "0", "must be a finite number > 0"),
        ("--rope_scaling", '{"rope_type": "linear", "factor": NaN}', "factor=nan must be finite"),
    ):
        err = _one_line_error([*argv, flag, value, "--output_dir", str(tmp_path / "x")], capsys)
        assert words in err and flag in err, err
    # The base given twice, two ways: refused, not one silently taken.
    twice = [
        "--rope_theta",
        "500000",
        "--rope_scaling",
        '{"rope_type": "default", "rope_theta": 1e4}',
    ]
    err = _one_line_error([*argv, *twice, "--output_dir", str(tmp_path / "x")], capsys)
    assert "gives rope_theta=10000.0 and --rope_theta=500000.0: give the base once" in err
    # A YAML config gives the scaling as a mapping.
    from train.config import parse_args

    (tmp_path / "c.yaml").write_text(
        "model:\n  rope_scaling:\n    rope_type: linear\n    factor: 2\n    rope_theta: 5e5\n"
    )
    cfg = parse_args(["--config", str(tmp_path / "c.yaml")])
    assert json.loads(cfg.model.rope_scaling) == {
        "rope_type": "linear",
        "factor": 2,
        "rope_theta": 500000.0,
    }


def test_resume_with_another_learning_rate_schedule_is_refused(tmp_path, capsys):
    """A checkpoint records its learning-rate schedule (flags, and rates sampled over
    the run): a resume that would jump to another one is refused in one line, before
    the new output directory is made; the same schedule spelt otherwise resumes."""
    argv = [*BASE, "--data_path", "sample", "--max_steps", "4", "--save_steps", "2"]
    argv += ["--report_to", "none", "--export_hf", "false", "--learning_rate", "3e-3"]
    assert main([*argv, "--warmup_steps", "1", "--output_dir", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    resume = ["--resume_from_checkpoint", str(tmp_path / "run" / "checkpoints" / "2")]
    other = [*resume, "--warmup_steps", "1", "--output_dir", str(tmp_path / "b")]
    err = _one_line_error([*argv, *other, "--learning_rate", "0.3"], capsys)
    assert "was written with another learning-rate schedule (--learning_rate 0.003 -> 0.3" in err
    assert "--config <output_dir>/train_config.yaml" in err
    assert not (tmp_path / "b").exists()
    # Without its warmup the curve differs too, though no flag it had is named again.
    err = _one_line_error([*argv, *resume, "--output_dir", str(tmp_path / "b")], capsys)
    assert "--warmup_steps 1 -> 0" in err and "lr at step" in err
    # 1 warmup step of 4 as a ratio: the same rates, so the same schedule.
    same = [*resume, "--warmup_ratio", "0.25", "--output_dir", str(tmp_path / "c")]
    assert main([*argv, *same]) == 0


def test_resume_with_another_warmup_no_sample_holds_is_refused(tmp_path, capsys):
    """Another warmup length moves the rate only inside the ramp, where no sampled step
    of both runs may fall (40 steps: samples at 0, 5, 10, ...; warmup 3 -> 2): the
    phases' lengths are compared too, and the resume is refused naming them."""
    argv = [*BASE, "--data_path", "sample", "--max_steps", "40", "--save_steps", "20"]
    argv += ["--report_to", "none", "--export_hf", "false"]
    argv += ["--lr_scheduler_type", "constant_with_warmup", "--logging_steps", "20"]
    assert main([*argv, "--warmup_steps", "3", "--output_dir", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    resume = ["--resume_from_checkpoint", str(tmp_path / "run" / "checkpoints" / "20")]
    resume += ["--output_dir", str(tmp_path / "b")]
    err = _one_line_error([*argv, *resume, "--warmup_steps", "2"], capsys)
    assert "another learning-rate schedule (--warmup_steps 3 -> 2, warmup 3 -> 2 steps)" in err


def test_resume_with_other_update_settings_is_refused(tmp_path, capsys):
    """A checkpoint records the flags its optimizer's update reads and the compute
    dtype: a resume that changes them mid-run is refused in one line naming each, before
    the new output directory is made (its train_config.yaml would name settings its
    first steps did not use)."""
    argv = [*BASE, "--data_path", "sample", "--max_steps", "4", "--save_steps", "2"]
    argv += ["--report_to", "none", "--export_hf", "false"]
    assert main([*argv, "--output_dir", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    resume = ["--resume_from_checkpoint", str(tmp_path / "run" / "checkpoints" / "2")]
    other = [*resume, "--output_dir", str(tmp_path / "b"), "--weight_decay", "0.1"]
    err = _one_line_error([*argv, *other, "--bf16", "false", "--max_grad_norm", "0.5"], capsys)
    assert "was trained with other update settings (" in err
    named = ["--weight_decay 0.0 -> 0.1", "--max_grad_norm 1.0 -> 0.5"]
    named.append("compute dtype (--bf16 / --fp16) bfloat16 -> float32")
    assert all(x in err for x in named), err
    assert "--config <output_dir>/train_config.yaml" in err
    assert not (tmp_path / "b").exists()


def test_resume_with_another_document_mask_or_positions_is_refused(tmp_path, capsys):
    """Packed documents: the mask and the RoPE positions change every step's gradient, so
    a resume that changes --mask_documents or --packing_positions mid-run is refused
    naming them; on rows of one document each (nothing to mask) the flags do nothing,
    and the resume goes on."""
    docs = tmp_path / "docs.jsonl"
    rng = np.random.default_rng(0)
    with open(docs, "w") as f:
        for n in rng.integers(5, 30, size=64):
            f.write(json.dumps({"input_ids": rng.integers(3, 200, size=int(n)).tolist()}) + "\n")
    argv = [*BASE, "--max_steps", "4", "--save_steps", "2", "--report_to", "none"]
    argv += ["--export_hf", "false"]
    for data in (str(docs), "sample"):
        run_dir = tmp_path / f"run-{data == 'sample'}"
        assert main([*argv, "--data_path", data, "--output_dir", str(run_dir)]) == 0
        capsys.readouterr()
        resume = ["--resume_from_checkpoint", str(run_dir / "checkpoints" / "2")]
        other = [*resume, "--mask_documents", "false", "--packing_positions", "running"]
        out = tmp_path / f"b-{data == 'sample'}"
        if data == "sample":  # one document a row: the same steps, resumed
            assert main([*argv, "--data_path", data, *other, "--output_dir", str(out)]) == 0
            continue
        err = _one_line_error(
            [*argv, "--data_path", data, *other, "--output_dir", str(out)], capsys
        )
        assert "was trained with other update settings (" in err, err
        named = ["--mask_documents True -> False", "--packing_positions per_document -> running"]
        assert all(x in err for x in named), err
        assert not out.exists()
        positions = [*resume, "--packing_positions", "running", "--output_dir", str(out)]
        err = _one_line_error([*argv, "--data_path", data, *positions], capsys)
        assert "(--packing_positions per_document -> running)" in err, err


def test_update_settings_are_those_the_optimizer_reads():
    """Adafactor has no betas or epsilon: changing them does not refuse its resume."""
    from train.config import OptimArgs
    from train.optim import update_settings

    adamw = update_settings(OptimArgs(adam_beta2=0.95))
    assert adamw == {
        "adam_beta1": 0.9,
        "adam_beta2": 0.95,
        "adam_epsilon": 1e-8,
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
    }
    assert "adam_epsilon" not in update_settings(OptimArgs(optim="lion"))
    assert update_settings(OptimArgs(optim="adafactor", adam_beta2=0.5)) == {
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
    }


def test_a_checkpoint_holding_non_finite_values_is_named_damaged_on_restore(tmp_path):
    """The loop saves no non-finite step, so a NaN in a restored state is damage to its
    files: named at the restore with the array and an earlier checkpoint, not steps
    later as a non-finite loss with advice about the learning rate."""
    import jax.numpy as jnp

    from train.checkpoint import Checkpoints, first_non_finite

    good = {"params": {"w": jnp.ones((4, 4)), "b": jnp.zeros(4)}, "step": jnp.int32(1)}
    bad = {"params": {"w": jnp.ones((4, 4)), "b": jnp.array([0.0, jnp.inf, 0.0, 0.0])}}
    bad["step"] = jnp.int32(2)
    assert first_non_finite(good) is None and first_non_finite(bad) == "['params']['b']"
    ckpt = Checkpoints(str(tmp_path), None)
    for step, state in ((1, good), (2, bad)):
        ckpt.save(step, state, {"step": step, "data": step})
    ckpt.close()
    reader = Checkpoints(str(tmp_path), None, read_only=True)
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), good
    )
    assert reader.restore(1, abstract)[1]["step"] == 1
    with pytest.raises(ValueError) as e:
        reader.restore(2, abstract)
    assert str(e.value) == (
        f"checkpoint {tmp_path / 'checkpoints' / '2'} holds non-finite values "
        "(['params']['b']), which no step saves: its files are damaged; an earlier one: "
        f"--resume_from_checkpoint {tmp_path / 'checkpoints' / '1'} (into a new --output_dir)"
    )
    reader.close()


def test_a_damaged_checkpoint_is_one_line_naming_an_earlier_one(tmp_path, capsys, caplog):
    """A checkpoint whose arrays cannot be read (an interrupted copy, a pruned
    directory) fails its resume in one line, without the traceback asyncio logs per
    array, and names the checkpoint before it."""
    out = tmp_path / "run"
    argv = [*BASE, "--data_path", "sample", "--max_steps", "2", "--save_steps", "1"]
    argv += ["--report_to", "none", "--export_hf", "false", "--output_dir", str(out)]
    assert main(argv) == 0
    capsys.readouterr()
    state = out / "checkpoints" / "2" / "state"
    damaged = [p for p in state.rglob("*") if p.is_file() and p.parent != state]
    assert damaged, sorted(state.rglob("*"))
    for p in damaged:
        p.write_bytes(p.read_bytes()[:3])
    err = _one_line_error([*argv, "--resume_from_checkpoint", "latest"], capsys)
    assert f"checkpoint {out / 'checkpoints' / '2'} could not be restored, damaged" in err
    assert f"an earlier one: --resume_from_checkpoint {out / 'checkpoints' / '1'}" in err
    assert "Traceback" not in capsys.readouterr().err
    # An empty checkpoint directory (a copy cut off): the line alone, no orbax warning.
    shutil.rmtree(out / "checkpoints" / "2")
    (out / "checkpoints" / "3").mkdir()
    with caplog.at_level(logging.WARNING):
        err = _one_line_error([*argv, "--resume_from_checkpoint", "latest"], capsys)
    assert f"checkpoint {out / 'checkpoints' / '3'} could not be restored, damaged" in err
    assert "Metadata file does not exist" not in caplog.text


def test_the_run_is_planned_in_one_line(tmp_path, capsys):
    """What HF's "Running training" block says, in one line before the first step."""
    argv = [*BASE, "--data_path", "sample", "--max_steps", "3", "--report_to", "none"]
    argv += ["--export_hf", "false", "--gradient_accumulation_steps", "2"]
    assert main([*argv, "--output_dir", str(tmp_path / "a")]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("plan: ")]
    n = jax.device_count()  # the default mesh: fsdp over every device
    each = 256 // (2 * n)
    assert line.startswith(f"plan: 256 rows of 64 tokens; 3 steps ({3 / each:.3g} epochs, {each}")
    factors = f"(per-device batch 1 x data 1 x fsdp {n} x accumulation 2)"
    assert f"each {2 * n} rows = {128 * n:,} tokens {factors}" in line
    assert line.endswith(f"M parameters; mesh data=1,fsdp={n},seq=1,seq_a2a=1")


def test_the_plan_and_done_lines_count_one_in_the_singular(tmp_path):
    """One row, one step an epoch, one epoch: `1 row`, `1 step each`, `1 epoch`."""
    from types import SimpleNamespace

    from train.__main__ import _done_line
    from train.loop import _plan

    cfg = parse_args([*BASE, "--output_dir", str(tmp_path), "--export_hf", "false"])
    t = SimpleNamespace(
        cfg=cfg,
        rows=SimpleNamespace(num_rows=1),
        global_batch=1,
        accum=1,
        batches=SimpleNamespace(steps_per_epoch=1, rows_per_epoch=1),
        state={"params": {"w": np.zeros(3)}},
        sizes={"data": 1, "fsdp": 1, "seq": 1},
        total_steps=1,
    )
    line = _plan(t)
    assert line.startswith("plan: 1 row of 64 tokens; 1 step (1 epoch, 1 step each), ")
    assert "each 1 row = 64 tokens (" in line, line
    t.rows.num_rows, t.total_steps, t.batches.steps_per_epoch = 1200, 3, 1
    t.batches.rows_per_epoch = 1200
    assert _plan(t).startswith("plan: 1,200 rows of 64 tokens; 3 steps (3 epochs, 1 step each)")
    # Rows that do not divide into steps: the epoch's last step is filled up, or dropped.
    t.rows.num_rows, t.global_batch, t.batches.rows_per_epoch = 9, 4, 9
    assert "1 step each, the last filled up with 3 empty rows), each 4 rows" in _plan(t)
    t.batches.rows_per_epoch = 8  # --dataloader_drop_last: a partial micro-batch dropped
    assert "1 step each, the last 1 row of each epoch dropped), each 4 rows" in _plan(t)
    t.global_batch, t.accum = 2, 3  # micro-batches of 2 rows: 1 dropped, 2 filled up
    assert (
        "1 step each, the last 1 row of each epoch dropped, the last filled up with 4 empty "
        "rows), each 6 rows"
    ) in _plan(t)
    one = {"total_steps": 1, "losses": [4.0]}
    assert _done_line(cfg, one) == "done: 1 step, final loss 4.0000"
    assert _done_line(cfg, {**one, "total_steps": 2}) == "done: 2 steps, final loss 4.0000"
    bench = parse_args(
        [*BASE, "--output_dir", str(tmp_path), "--export_hf", "false", "--save_strategy", "no"]
    )
    assert _done_line(bench, one) == (
        "done: 1 step, final loss 4.0000; no weights kept (--save_strategy no, --export_hf false)"
    )


def test_a_misspelt_flag_is_answered_with_the_closest_one(capsys):
    """argparse's one line for unknown flags, with the known flag each is closest to."""

    def refused(*extra) -> str:
        with pytest.raises(SystemExit) as exit_:
            main([*BASE, *extra])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("error: unrecognized arguments") and err.count("\n") == 1
        return err

    err = refused("--learnig_rate", "3e-4", "--max_step=5")
    assert "--learnig_rate: did you mean --learning_rate?" in err
    assert "--max_step: did you mean --max_steps?" in err
    assert "did you mean" not in refused("--bogus", "1")
    # Other trainers' names for a flag, and HF's dashed spelling.
    err = refused("--lr", "3e-4", "--epochs", "2", "--batch_size", "4", "--learning-rate", "1")
    assert "--lr: did you mean --learning_rate?" in err
    assert "--epochs: did you mean --num_train_epochs?" in err
    assert "--batch_size: did you mean --per_device_train_batch_size?" in err
    assert "--learning-rate: did you mean --learning_rate?" in err
    from train.config import FLAG_ALIASES, build_parser

    known = {o for a in build_parser()._actions for o in a.option_strings}
    assert not set(FLAG_ALIASES) & known  # an alias never hides a flag
    assert {m.split()[0] for m in FLAG_ALIASES.values()} <= known


def test_the_demo_turns_command_buffers_off_before_jax_starts():
    """On a GPU the demo's trace and metrics report attribute kernels to phases, which
    kernels run as CUDA graphs (XLA's default there) do not allow: the demo sets the
    flag before jax starts, keeping the user's other flags."""
    import subprocess
    import sys

    from train.xla_flags import NO_COMMAND_BUFFERS

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = "--xla_dump_to=/nonexistent-dump"
    code = "import os, train.demo; print(os.environ['XLA_FLAGS'])"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    assert NO_COMMAND_BUFFERS in out and "--xla_dump_to=/nonexistent-dump" in out


def test_a_model_larger_than_the_hosts_memory_is_refused_on_cpu(tmp_path, capsys, monkeypatch):
    """On the CPU backend a training state larger than MemAvailable is refused in one line
    naming the model, the estimate and what is available (the kernel would kill the
    process without a word); a state that fits trains."""
    import train.build as build_lib

    if jax.default_backend() != "cpu":
        pytest.skip("the check is the CPU backend's")
    cfg = parse_args([*BASE, "--data_path", "sample", "--output_dir", str(tmp_path / "o")])
    need = build_lib.state_bytes(cfg, build_lib.model_config(cfg))
    assert need == models.param_count(models.TINY) * 16  # fp32 params, grads, two moments
    monkeypatch.setattr(build_lib, "available_host_bytes", lambda: need // 2)
    argv = [*BASE, "--data_path", "sample", "--max_steps", "1", "--output_dir"]
    err = _one_line_error([*argv, str(tmp_path / "o")], capsys)
    assert "'tiny'" in err and f"{need / 1e9:.3g} GB" in err and "available" in err, err
    assert not (tmp_path / "o").exists()
    monkeypatch.setattr(build_lib, "available_host_bytes", lambda: need)
    assert main([*argv, str(tmp_path / "o2")]) == 0


def test_packing_takes_stream_or_whole(capsys):
    err = _one_line_error([*BASE, "--data_path", "sample", "--packing", "wholes"], capsys)
    assert "--packing='wholes' must be one of ('stream', 'whole')" in err


def test_resume_with_the_other_packing_is_refused(tmp_path, capsys):
    """A checkpoint records its packing: a resume that packs the same file the other way
    (other rows) is refused in one line naming `--packing`; the same packing resumes."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(3, 500, size=int(rng.integers(5, 60))) for _ in range(80)]
    data_lib.save_dataset(tmp_path / "d.pkl", docs)
    argv = [*BASE, "--max_steps", "2", "--save_steps", "1", "--report_to", "none"]
    argv += ["--data_path", str(tmp_path / "d.pkl"), "--export_hf", "false"]
    assert main([*argv, "--output_dir", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    resume = ["--resume_from_checkpoint", str(tmp_path / "run" / "checkpoints" / "1")]
    other = ["--packing", "whole", "--output_dir", str(tmp_path / "b")]
    err = _one_line_error([*argv, *resume, *other], capsys)
    assert "was written by a run with other settings (--packing stream -> whole" in err
    assert "Use the same --model_max_length, --packing," in err
    assert not (tmp_path / "b").exists()
    same = ["--packing", "stream", "--output_dir", str(tmp_path / "a")]
    assert main([*argv, *resume, *same]) == 0


def test_a_resume_without_checkpoints_is_refused_before_the_data_loads(tmp_path):
    """`--resume_from_checkpoint latest` where `--output_dir` has no checkpoints is
    refused first, in one line (pointing at `auto`), not after loading the model and
    data: here the data file does not even exist."""
    out = tmp_path / "none"
    args = ["--model_name_or_path", "tiny", "--data_path", str(tmp_path / "missing.jsonl")]
    args += ["--output_dir", str(out), "--resume_from_checkpoint", "latest"]
    with pytest.raises(TrainingError) as refused:
        run(parse_args(args))
    assert str(refused.value) == (
        f"--resume_from_checkpoint: {out / 'checkpoints'} does not exist (`auto` starts "
        "from step 0 where there is none)"
    )


def test_a_resume_that_changes_dataloader_drop_last_is_refused_naming_it(tmp_path, capsys):
    """Where the rows do not divide into batches, --dataloader_drop_last changes every
    epoch's batches after the first: a resume that flips it is refused naming it (the
    checkpoint records it), as is one with another --seed on sample data (made from it)."""
    # 10 rows in batches of one row per device (4 or 8): the last batch of each epoch is
    # filled up.
    argv = [*BASE, "--data_path", "sample", "--sample_num_examples", "10", "--attention"]
    argv += ["xla", "--max_steps", "3", "--save_steps", "2", "--report_to", "none"]
    argv += ["--export_hf", "false"]
    assert main([*argv, "--output_dir", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    resume = ["--resume_from_checkpoint", str(tmp_path / "run" / "checkpoints" / "2")]
    err = _one_line_error(
        [*argv, *resume, "--dataloader_drop_last", "true", "--output_dir", str(tmp_path / "b")],
        capsys,
    )
    assert "(--dataloader_drop_last False -> True" in err, err
    assert "rows an epoch" not in err, err  # follows from the flag
    assert "on this mesh" not in err, err  # no split of the rows a step helps
    err = _one_line_error(
        [*argv, *resume, "--seed", "7", "--output_dir", str(tmp_path / "c")], capsys
    )
    assert "--seed 42 -> 7" in err and "(--data_path sample is made from --seed)" in err, err


def test_an_adafactor_checkpoint_of_optaxs_state_is_refused_with_the_way_on():
    """Adafactor's state changed layout (HF's, per layer): a checkpoint whose record names
    no such state (optax's, written before) is refused in one line pointing to the export,
    not failed in Orbax's restore as if damaged; AdamW's never changed."""
    from train.run_record import OPTIM_STATES, check_resumable

    now = {"optim": "adafactor", "optim_state": OPTIM_STATES["adafactor"], "total_steps": 4}
    with pytest.raises(TrainingError, match=r"holds optax's --optim adafactor state.*export"):
        check_resumable({"step": 2, "run": {"optim": "adafactor"}}, now, "ckpts")
    check_resumable({"step": 2, "run": dict(now)}, now, "ckpts")
    adamw = {"optim": "adamw", "optim_state": None, "total_steps": 4}
    check_resumable({"step": 2, "run": {"optim": "adamw"}}, adamw, "ckpts")


def test_a_models_folder_of_the_working_directory_is_named(tmp_path):
    """`python -m train` puts the working directory first on sys.path: a `models`
    package of the user's there is named in one line (its command's, `train.demo`'s too:
    once an ImportError's traceback), not failed on deep inside an import."""
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "__init__.py").write_text("")
    # jflash from its tree where it is not installed (the working directory stays first)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    for command in ("train", "train.demo"):
        done = subprocess.run(
            [sys.executable, "-m", command, "--help"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 1
        (line,) = done.stderr.strip().splitlines()
        assert line.startswith("error: jflash's trainer needs jflash's package 'models'"), line
        assert f"but 'models' is {tmp_path / 'models'}, which comes first on sys.path" in line
        assert "run the command from another directory (the trainer itself: jflash-train" in line
    shutil.rmtree(tmp_path / "models")
    (tmp_path / "models.py").write_text("")  # a module of that name, too
    done = subprocess.run(
        [sys.executable, "-m", "train", "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    last = done.stderr.strip().splitlines()[-1]
    assert f"but 'models' is {tmp_path / 'models.py'}, which comes first" in last


def test_the_usage_line_names_the_command_that_ran(monkeypatch):
    """`jflash-train --help` said `usage: python -m train`, the command that fails where
    `jflash-train` is the advice (a working directory with a `models/` of its own)."""
    from train.config import build_parser

    for argv0, usage in (("/env/bin/jflash-train", "jflash-train"), ("-m", "python -m train")):
        monkeypatch.setattr(sys, "argv", [argv0, "--help"])
        assert build_parser().format_usage().startswith(f"usage: {usage} "), argv0


def test_without_the_train_extra_the_library_imports_and_the_trainer_names_it():
    """`pip install jflash` has jax alone: `import jflash` works, `import models` and
    `import train` name the missing packages and the extra in one line."""
    blocked = "import sys\nfor m in ('flax', 'optax', 'yaml'): sys.modules[m] = None\n"

    def attempt(line):
        code = blocked + line
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)

    assert attempt("import jflash; jflash.flash_attention").returncode == 0
    last = attempt("import models").stderr.strip().splitlines()[-1]
    assert last == (
        "ImportError: jflash's models need flax, not installed: pip install 'jflash[train]'"
    )
    last = attempt("import train").stderr.strip().splitlines()[-1]
    assert last == (
        "ImportError: jflash's trainer needs flax, optax, pyyaml, not installed: "
        "pip install 'jflash[train]'"
    )
    # As a command (`python -m train`, `jflash-train`, `python -m models.convert`): the
    # line alone, no traceback.
    for argv0, module in (("-m", "train"), ("/env/bin/jflash-train", "train"), ("-m", "models")):
        done = attempt(f"sys.argv = [{argv0!r}]\nimport {module}")
        assert done.returncode == 1
        assert done.stderr.startswith("error: jflash's "), done.stderr
        assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 1


def test_a_shorter_demo_traces_its_last_steps(tmp_path, monkeypatch, capsys):
    """`python -m train.demo --max_steps 20` ends before the config's traced steps
    (20..22): the demo traces the run's last three instead, saying so; a longer run, or
    one given --profile_steps, keeps its window."""
    from train import demo

    monkeypatch.chdir(tmp_path)
    configs = []
    monkeypatch.setattr(demo, "run", lambda cfg: configs.append(cfg) or {"losses": []})
    for argv in (
        ["--max_steps", "20"],
        ["--max_steps", "60"],
        ["--max_steps", "20", "--profile_steps", "2,4"],
    ):
        assert demo.main(argv) == 0
    assert [c.profile.profile_steps for c in configs] == ["18,21", "20,23", "2,4"]
    out = capsys.readouterr().out
    assert "--max_steps 20: the demo traces steps 18,21 (--profile_steps) instead of 20,23" in out
    assert out.count("the demo traces steps") == 1


@pytest.mark.skipif(ON_GPU, reason="the refusal is for machines without NVIDIA GPUs")
def test_cudnn_attention_without_a_gpu_is_refused_by_its_flag_first(tmp_path, capsys, monkeypatch):
    """`--attention cudnn` on a CPU: one line naming the flag, before the data is read
    (a data path that does not exist is not what the error names)."""
    import train.build as build_lib

    monkeypatch.setattr(build_lib, "load_model", lambda cfg: pytest.fail("the model was read"))
    argv = [*BASE, "--attention", "cudnn", "--data_path", str(tmp_path / "none.jsonl")]
    err = _one_line_error([*argv, "--output_dir", str(tmp_path / "run")], capsys)
    said = "--attention cudnn needs NVIDIA GPUs (cuDNN), but this runs on 'cpu'"
    assert err == f"error: {said}: use ring, jflash or xla\n"


def test_a_relative_data_path_not_found_says_where_it_looked(tmp_path, monkeypatch):
    """Relative paths are the working directory's (a YAML file's too): the error says
    which absolute path was looked for."""
    monkeypatch.chdir(tmp_path)
    argv = [*BASE, "--output_dir", str(tmp_path / "run"), "--max_steps", "1"]
    with pytest.raises(TrainingError) as e:
        run(parse_args([*argv, "--data_path", "data/typo.jsonl"]))
    assert str(e.value) == (
        f"--data_path='data/typo.jsonl': no such data file (looked for {tmp_path}/data/typo.jsonl)"
    )


def test_a_bounded_close_leaves_a_save_that_does_not_commit(tmp_path):
    """`Checkpoints.close(wait_s)`: a save whose commit never comes (a multi-process save
    waits at a barrier for a process that has stopped) is left after `wait_s`, False;
    one that ends in time closes, True; an error in the wait reaches the caller."""
    import threading
    import time

    from train.checkpoint import Checkpoints

    ckpt = Checkpoints(str(tmp_path), None)
    manager = ckpt._manager
    release = threading.Event()
    manager.wait_until_finished = lambda: release.wait(60)
    began = time.monotonic()
    assert ckpt.close(wait_s=0.5) is False
    assert time.monotonic() - began < 5
    release.set()
    assert ckpt.close(wait_s=30) is True  # the wait is over: closes

    failing = Checkpoints(str(tmp_path / "other"), None)

    def broken():
        raise RuntimeError("the commit failed")

    failing._manager.wait_until_finished = broken
    with pytest.raises(RuntimeError, match="the commit failed"):
        failing.close(wait_s=30)


def test_the_save_in_flight_gets_a_bounded_wait_only_after_an_unexpected_multi_process_error(
    monkeypatch,
):
    """`train.loop._save_wait_s`: bounded where `python -m train` then ends the process
    at once (an unexpected error of a multi-process run); a stop (Ctrl-C, SIGTERM, or an
    error raised while one was handled) and the run's own errors wait for the save, as
    does every error of a one-process run."""
    from train import loop
    from train.errors import Terminated

    monkeypatch.setattr(loop.jax, "process_count", lambda: 2)
    bounded = loop.SAVE_WAIT_AFTER_ERROR_S
    assert loop._save_wait_s(RuntimeError("Gloo AllGather failed")) == bounded
    assert loop._save_wait_s(OSError(5, "I/O error")) == bounded
    assert loop._save_wait_s(None) is None
    assert loop._save_wait_s(KeyboardInterrupt()) is None
    assert loop._save_wait_s(Terminated()) is None
    try:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise RuntimeError("Event loop stopped before Future completed.")  # noqa: B904
    except RuntimeError as e:
        assert loop._save_wait_s(e) is None  # Orbax's word for a Ctrl-C during a save
    for error in (TrainingError("x"), ValueError("x"), NotImplementedError("x")):
        assert loop._save_wait_s(error) is None
    monkeypatch.setattr(loop.jax, "process_count", lambda: 1)
    assert loop._save_wait_s(RuntimeError("x")) is None
