"""What a run leaves and prints: its settings as `--config` YAML, step lines on a stdout
that is not a terminal, and the scalars of `--report_to` (tensorboard, wandb, none)."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import sys
import time
import types

import jax
import numpy as np
import pytest
from conftest import ON_GPU

import models
from train import data as data_lib
from train import loop, outputs
from train.__main__ import main
from train.config import parse_args
from train.loop import TrainingError, run
from train.tensorboard import read_scalars

TINY = [
    "--model_name_or_path",
    "tiny",
    "--data_path",
    "sample",
    "--model_max_length",
    "64",
    "--sample_num_examples",
    "24",
    "--mesh",
    "data=1,fsdp=-1,seq=1",
    "--attention",
    "xla",
    "--max_steps",
    "3",
    "--logging_steps",
    "1",
    "--export_hf",
    "false",
]


def _args(out, *extra):
    return [*TINY, "--output_dir", str(out), *extra]


@pytest.mark.slow
def test_settings_yaml_step_lines_and_resume_line(tmp_path, capsys):
    out = tmp_path / "run"
    cfg = parse_args(
        _args(
            out,
            "--report_to",
            "none",
            "--save_steps",
            "1",
            "--lr_scheduler_type",
            "wsd",
            "--decay_ratio",
            "0.5",
        )
    )
    run(cfg)
    # Every setting, defaults included, and `--config` reads it back as the same config.
    settings = out / outputs.SETTINGS_FILE
    assert parse_args(["--config", str(settings)]) == cfg
    assert "decay_ratio: 0.5" in settings.read_text()
    assert not (out / "tensorboard").exists()  # --report_to none
    # capsys's stdout is no terminal: one line per logging step; speed and ETA once a
    # timed step (after the compilation's) is in the window.
    lines = capsys.readouterr().out.splitlines()
    assert "--mask_documents: every row holds one document, nothing to mask" in lines  # sample
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split(":")[0] for line in steps] == ["step 1/3", "step 2/3", "step 3/3"]
    assert re.fullmatch(r"step 1/3: loss \d+\.\d{4}, lr \S+", steps[0])
    assert re.fullmatch(
        r"step 2/3: loss \d+\.\d{4}, lr \S+, [\d,]+ tokens/s, ETA \d+:\d\d:\d\d", steps[1]
    )

    again = tmp_path / "again"
    ckpt = str(out / "checkpoints" / "2")
    run(
        parse_args(
            _args(
                again,
                "--report_to",
                "none",
                "--resume_from_checkpoint",
                ckpt,
                "--lr_scheduler_type",
                "wsd",
                "--decay_ratio",
                "0.5",
            )
        )
    )
    printed = capsys.readouterr().out.splitlines()
    # Another optimizer's state cannot continue this one's: refused by name, unread.
    other = _args(tmp_path / "other", "--resume_from_checkpoint", ckpt, "--optim", "lion")
    with pytest.raises(TrainingError, match="holds the state of --optim adamw; this run asks"):
        run(parse_args(other + ["--lr_scheduler_type", "wsd", "--decay_ratio", "0.5"]))
    assert f"resumed from step 2 of {out}" in printed
    assert [line.split(":")[0] for line in printed if line.startswith("step ")] == ["step 3/3"]


@pytest.mark.slow
def test_settings_describe_the_job_not_what_this_run_did_to_its_directory(tmp_path):
    """`--overwrite_output_dir` and `--resume_from_checkpoint` stay out of the saved
    settings: running a run's `train_config.yaml` again into its own directory is then
    refused like any rerun, not allowed to delete the run, and a resumed run's file
    starts the same job in a new directory instead of asking for a checkpoint there."""
    out = tmp_path / "run"
    run(parse_args(_args(out, "--report_to", "none", "--save_steps", "2")))
    resumed = tmp_path / "resumed"
    run(
        parse_args(
            _args(
                resumed,
                "--report_to",
                "none",
                "--save_steps",
                "2",
                "--overwrite_output_dir",
                "true",
                "--resume_from_checkpoint",
                str(out / "checkpoints" / "2"),
            )
        )
    )
    settings = resumed / outputs.SETTINGS_FILE
    text = settings.read_text()
    assert "overwrite_output_dir: false" in text and "resume_from_checkpoint: null" in text
    kept = {p.name: p.stat().st_mtime_ns for p in (resumed / "checkpoints").iterdir()}
    with pytest.raises(TrainingError, match="holds a previous run"):
        run(parse_args(["--config", str(settings)]))
    assert {p.name: p.stat().st_mtime_ns for p in (resumed / "checkpoints").iterdir()} == kept
    again = tmp_path / "again"
    run(parse_args(["--config", str(settings), "--output_dir", str(again)]))
    assert (again / "checkpoints" / "3").is_dir()


@pytest.mark.slow
def test_packed_rows_say_what_the_mask_does(tmp_path, capsys):
    """Rows that pack several documents get one line saying so (the mask and the
    positions); one-document rows get the "nothing to mask" line instead; rows packed
    with no mask and no EOS between documents, a note that nothing marks the ends."""
    docs = tmp_path / "docs.pkl"
    data_lib.save_dataset(docs, [np.arange(3, 3 + n, dtype=np.int32) for n in (9, 20, 5) * 20])
    argv = _args(tmp_path / "run", "--report_to", "none", "--max_steps", "1")
    run(parse_args([*argv, "--data_path", str(docs)]))
    lines = capsys.readouterr().out.splitlines()
    assert (
        "--mask_documents: rows pack several documents; attention stays inside each, and "
        "positions restart at each (--packing_positions)"
    ) in lines
    assert not [line for line in lines if "nothing marks where" in line]
    # Neither a mask nor a token between the documents: a note says so.
    loose = ("--mask_documents", "false", "--packing_positions", "running")
    run(parse_args([*argv, "--data_path", str(docs), *loose, "--eos_token_id", "none",
                    "--output_dir", str(tmp_path / "loose")]))  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if line.startswith("note: --mask_documents false with")]


def test_refused_run_writes_no_settings(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="needs 64 devices"):
        run(parse_args(_args(out, "--mesh", "data=1,fsdp=1,seq=64")))
    assert not out.exists()


def test_missing_tokenizer_is_refused_whatever_the_data(tmp_path):
    """The export carries `--tokenizer_name_or_path`: a mistyped one is refused even
    where the data needs no tokenizer (token ids), before anything is written."""
    out = tmp_path / "run"
    missing = tmp_path / "nope"
    with pytest.raises(TrainingError, match=r"--tokenizer_name_or_path=.*nope.*does not exist"):
        run(parse_args(_args(out, "--tokenizer_name_or_path", str(missing))))
    assert not out.exists()


def test_report_to_values_are_checked():
    with pytest.raises(ValueError, match="--report_to='tensorboard,mlflow' must be none or"):
        parse_args(["--report_to", "tensorboard,mlflow"])
    with pytest.raises(ValueError, match="each once"):  # two writers of the same scalars
        parse_args(["--report_to", "tensorboard,tensorboard"])


def test_wandb_not_installed_is_one_line_with_the_install_command(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    out = tmp_path / "run"
    assert main(_args(out, "--report_to", "wandb")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --report_to wandb needs the wandb")
    assert "pip install 'jflash[wandb]'" in err
    assert not out.exists()


class _FakeWandb(types.ModuleType):
    """Records what the trainer hands wandb: `init`'s arguments, `log`'s, `finish`."""

    def __init__(self):
        super().__init__("wandb")
        self.inits, self.logged, self.finished = [], [], 0

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return self

    def log(self, values, step):
        self.logged.append((step, values))

    def finish(self):
        self.finished += 1


def test_report_to_takes_hf_s_list_of_words_or_commas():
    """transformers 4 scripts pass `--report_to tensorboard wandb`, which was refused
    as an unrecognized `wandb`."""
    for argv in (["tensorboard", "wandb"], ["tensorboard,wandb"]):
        assert parse_args(["--report_to", *argv]).run.report_to == "tensorboard,wandb"
    with pytest.raises(ValueError, match="each once"):
        parse_args(["--report_to", "wandb", "wandb"])


def test_a_resume_logs_into_the_same_wandb_run(tmp_path, monkeypatch):
    """One wandb run per output directory, as TensorBoard's files are: a resume (or a
    requeued job) continues the run it started, where each used to make a new run of
    the same name, whose curves then overlapped; WANDB_RUN_ID, where set, picks it."""
    from train.reporters import WANDB_ID_FILE, WandbWriter

    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    out = tmp_path / "run"
    cfg = parse_args(_args(out))
    WandbWriter(str(out), cfg).close()
    WandbWriter(str(out), cfg).close()
    first, again = fake.inits
    assert len(first["id"]) == 12 and "resume" not in first
    assert (again["id"], again["resume"]) == (first["id"], "allow")
    assert (out / WANDB_ID_FILE).read_text() == first["id"] + "\n"
    other = tmp_path / "other"
    WandbWriter(str(other), parse_args(_args(other))).close()
    assert fake.inits[-1]["id"] != first["id"]  # another directory, another run
    monkeypatch.setenv("WANDB_RUN_ID", "mine")  # wandb reads it; nothing is passed
    WandbWriter(str(out), cfg).close()
    assert "id" not in fake.inits[-1] and "resume" not in fake.inits[-1]
    assert [i["name"] for i in fake.inits] == ["run", "run", "other", "run"]
    WandbWriter(str(out), parse_args(_args(out, "--run_name", "llama-32k"))).close()
    assert fake.inits[-1]["name"] == "llama-32k"  # HF's --run_name


@pytest.mark.slow
def test_wandb_and_tensorboard_get_the_same_scalars(tmp_path, monkeypatch):
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    out = tmp_path / "run"
    cfg = parse_args(_args(out, "--report_to", "tensorboard,wandb", "--optim", "lion"))
    summary = run(cfg)
    (init,) = fake.inits
    assert init["dir"] == str(out) and init["config"]["optim"]["optim"] == "lion"
    assert fake.finished == 1
    wandb_loss = [(step, v["train/loss"]) for step, v in fake.logged]
    tb_loss = read_scalars(os.path.join(out, "tensorboard"))["train/loss"]
    assert [s for s, _ in wandb_loss] == [1, 2, 3] == [s for s, _ in tb_loss]
    assert [v for _, v in wandb_loss] == pytest.approx(summary["losses"], rel=1e-6)
    assert [v for _, v in tb_loss] == pytest.approx(summary["losses"], rel=1e-6)
    # HF Trainer's tag for the rate, in both; the log keeps its `lr`.
    lrs = [(step, v["train/learning_rate"]) for step, v in fake.logged]
    tb_lr = read_scalars(os.path.join(out, "tensorboard"))["train/learning_rate"]
    assert [v for _, v in lrs] == pytest.approx([v for _, v in tb_lr], rel=1e-6)
    assert not any("train/lr" in v for _, v in fake.logged)


def test_export_takes_the_runs_tokenizer(tmp_path):
    """The export carries `--tokenizer_name_or_path` (a tokenizer.json or its
    directory) when given, else the model directory's tokenizer files; a preset has none."""
    hf = tmp_path / "hf"
    hf.mkdir()
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    (tok_dir / "tokenizer.json").write_text('{"from": "dir"}')
    (tok_dir / "tokenizer_config.json").write_text('{"eos_token": "<e>"}')
    (tok_dir / "chat_template.jinja").write_text("{{ messages }}")  # a chat model's template
    (tok_dir / "additional_chat_templates").mkdir()  # its other named templates
    (tok_dir / "additional_chat_templates" / "tool_use.jinja").write_text("{{ tools }}")
    loose = tmp_path / "my-bpe.json"
    loose.write_text('{"from": "file"}')

    outputs.copy_tokenizer("llama3.2-1b", str(hf))
    assert list(hf.iterdir()) == []
    outputs.copy_tokenizer(str(tok_dir), str(hf))
    names = sorted(p.relative_to(hf).as_posix() for p in hf.rglob("*") if p.is_file())
    assert names == [
        "additional_chat_templates/tool_use.jinja",
        "chat_template.jinja",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert outputs.tokenizer_files(str(tok_dir)) == [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "additional_chat_templates/tool_use.jinja",
    ]
    outputs.copy_tokenizer(str(loose), str(hf))
    assert (hf / "tokenizer.json").read_text() == '{"from": "file"}'


@pytest.mark.slow
def test_export_writes_the_eos_the_run_packed_with(tmp_path):
    """A run whose documents end in another EOS than the model's (`--eos_token_id`, or a
    `--tokenizer_name_or_path` BPE's) exports that EOS, first among a list of stop ids,
    so the exported model continues training on the same packing; otherwise the model's
    EOS stays as it was."""
    import json

    from train.build import export_config, model_config

    out = tmp_path / "run"
    run(parse_args(_args(out, "--eos_token_id", "5", "--export_hf", "true")))
    with open(out / "hf" / "config.json") as f:
        assert json.load(f)["eos_token_id"] == 5

    cfg = parse_args(_args(out, "--eos_token_id", "9"))
    llama3 = model_config(cfg).replace(eos_token_id=(7, 8, 9))
    assert export_config(cfg, llama3).eos_token_id == (9, 7, 8)
    cfg = parse_args(_args(out, "--eos_token_id", "7"))
    assert export_config(cfg, llama3) is llama3
    cfg = parse_args(_args(out))
    assert export_config(cfg, model_config(cfg)) == model_config(cfg)
    # Trained past its context: the export says how far.
    short = model_config(cfg).replace(max_position_embeddings=16)
    longest = cfg.data.model_max_length
    assert longest > 16
    assert export_config(cfg, short) == short.replace(max_position_embeddings=longest)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM"])
def test_ctrl_c_ends_the_run_in_one_line_naming_its_last_checkpoint(tmp_path, how):
    """Ctrl-C (SIGINT) mid-run: exit status 130 and one line naming the last checkpoint,
    no traceback and no abort from XLA's threads. SIGTERM (a scheduler's preemption)
    alike, with status 143, once the step it reached is saved
    (`tests/test_train_preemption.py`)."""
    import signal
    import subprocess
    import time

    out = tmp_path / "run"
    argv = _args(out, "--max_steps", "100000", "--save_steps", "2")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    # `python -m train` as a terminal starts it: a shell running these tests in the
    # background (nohup, `&`) hands its children SIGINT ignored, and Python keeps that.
    start = (
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        f"sys.argv = ['train', *{argv!r}]; runpy.run_module('train', run_name='__main__')"
    )
    with open(tmp_path / "stdout", "w") as stdout, open(tmp_path / "stderr", "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-c", start], stdout=stdout, stderr=stderr, env=env
        )
        try:
            deadline = time.monotonic() + 180
            while not (out / "checkpoints" / "4").is_dir() and proc.poll() is None:
                assert time.monotonic() < deadline, "no checkpoint 4 in 180 s"
                time.sleep(0.2)
            proc.send_signal(getattr(signal, how))
            proc.wait(timeout=120)
        finally:
            proc.kill()
    err = (tmp_path / "stderr").read_text()
    assert proc.returncode == (130 if how == "SIGINT" else 143), err
    assert "Traceback" not in err and "terminate called" not in err, err
    if how == "SIGINT":
        said = r"interrupted: the last checkpoint is step (\d+) in (\S+);"
    else:
        said = r"SIGTERM: saved a checkpoint at step (\d+) in (\S+);"
    (last,) = re.findall(said, err)
    assert last[1] == str(out / "checkpoints") and int(last[0]) >= 4
    assert (out / "checkpoints" / last[0]).is_dir()


def test_ctrl_c_during_a_checkpoint_save_ends_in_the_same_line(tmp_path, monkeypatch, capsys):
    """Ctrl-C inside Orbax's save surfaces as a RuntimeError raised while the
    KeyboardInterrupt was handled: still exit status 130 and the one line, no traceback.
    A RuntimeError of its own still propagates."""
    import train.__main__ as entry

    def interrupted_save(cfg):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise RuntimeError("Event loop stopped before Future completed.") from None

    def exit_(code):
        raise SystemExit(code)

    monkeypatch.setattr(entry.os, "_exit", exit_)
    monkeypatch.setattr(entry, "run", interrupted_save)
    with pytest.raises(SystemExit) as ended:
        entry.main(_args(tmp_path / "run"))
    assert ended.value.code == 130
    err = capsys.readouterr().err
    assert err.startswith("interrupted: no checkpoint was written to ") and "Traceback" not in err

    def broken(cfg):
        raise RuntimeError("a bug, not an interrupt")

    monkeypatch.setattr(entry, "run", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        entry.main(_args(tmp_path / "run"))


def test_a_full_disk_ends_the_run_in_one_line(tmp_path, monkeypatch, capsys):
    """A full disk (or quota, a read-only file system) wherever the run writes, and
    under whatever error it surfaces: one line naming the file where the error does,
    the output directory where not, and the last checkpoint; exit status 1 (the
    machine's fault, not the settings'), not a traceback; Orbax's threads' records of it
    dropped. Other OSErrors stay tracebacks."""
    import errno

    import train.__main__ as entry

    out = tmp_path / "run"
    argv = ["--model_name_or_path", "tiny", "--data_path", "sample", "--output_dir", str(out)]
    full = OSError(errno.ENOSPC, "No space left on device")
    for error, named in (
        (OSError(errno.ENOSPC, "No space left on device", "/x/log.jsonl"), "/x/log.jsonl: "),
        (RuntimeError("closing failed"), f"(writing under {out})"),  # raised while handling
        # An Orbax save's: tensorstore's error, not an OSError, says the disk is full.
        (ValueError('RESOURCE_EXHAUSTED: Failed writing: "/x/d/0c": No space left on device'), ""),
    ):

        def failing(cfg, error=error):
            try:
                raise full
            finally:
                if error is not full:
                    raise error

        monkeypatch.setattr(entry, "run", failing)
        assert entry.main(argv) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), err
        assert named in err[0] and "No space left on device" in err[0], err
        assert err[0].endswith(f"no checkpoint was written to {out / 'checkpoints'}"), err

    import logging

    from train.checkpoint import DISK_FULL

    try:
        raise ValueError("Failed to write 402939 bytes to file 9: No space left on device")
    except ValueError as e:
        thread_log = logging.LogRecord(
            "absl", logging.ERROR, "", 0, "save failed", (), (None, e, None)
        )
    assert not DISK_FULL.filter(thread_log)
    assert DISK_FULL.filter(logging.LogRecord("absl", logging.ERROR, "", 0, "other", (), None))

    def unrelated(cfg):
        raise OSError(errno.ECONNRESET, "Connection reset by peer")

    monkeypatch.setattr(entry, "run", unrelated)
    with pytest.raises(OSError, match="Connection reset"):
        entry.main(argv)


def test_a_preemption_that_saved_nothing_names_the_last_checkpoint(tmp_path, monkeypatch, capsys):
    """A SIGTERM the loop stopped at without saving (`--save_on_preemption false` where
    jax's preemption service runs) ends in `train.errors.Preempted`'s line, then where
    the last whole checkpoint is, with SIGTERM's exit status."""
    import train.__main__ as entry
    from train.errors import Preempted

    out = tmp_path / "run"

    def preempted(cfg):
        raise Preempted(4, str(out / "checkpoints"), False, "--save_on_preemption false")

    def exit_(code):
        raise SystemExit(code)

    monkeypatch.setattr(entry.os, "_exit", exit_)
    monkeypatch.setattr(entry, "run", preempted)
    for saved, last in (
        ([], f"no checkpoint was written to {out / 'checkpoints'}"),
        (
            ["2"],
            f"the last checkpoint is step 2 in {out / 'checkpoints'}; continue with "
            "--resume_from_checkpoint latest",
        ),
    ):
        for step in saved:
            (out / "checkpoints" / step).mkdir(parents=True)
        with pytest.raises(SystemExit) as ended:
            entry.main(_args(out))
        assert ended.value.code == 143
        line = "terminated (SIGTERM) after step 4, nothing saved (--save_on_preemption false)"
        assert capsys.readouterr().err == f"{line}: {last}\n"
        assert Preempted(4, "", False, "--save_on_preemption false").line(last=last) == (
            f"{line}: {last}"
        )


def test_save_strategy_no_leaves_no_checkpoints_directory(tmp_path):
    out = tmp_path / "run"
    run(parse_args(_args(out, "--save_strategy", "no", "--report_to", "none")))
    assert sorted(os.listdir(out)) == ["log.jsonl", outputs.RUN_MODEL_CONFIG, outputs.SETTINGS_FILE]


@pytest.mark.slow
def test_profile_window_before_a_resumed_runs_steps_is_named(tmp_path, capsys):
    """A resume starts at its checkpoint's step: a --profile_steps window before it
    traces nothing and says so, one that it cuts traces the rest and says which."""
    first = tmp_path / "first"
    run(parse_args(_args(first, "--save_steps", "2", "--report_to", "none")))
    resume = ["--resume_from_checkpoint", str(first / "checkpoints" / "2"), "--report_to", "none"]
    capsys.readouterr()
    run(parse_args(_args(tmp_path / "a", *resume, "--profile_steps", "1,3")))
    err = capsys.readouterr().err
    assert "--profile_steps='1,3' lies outside this run's steps 3..3" in err
    assert "nothing will be traced" in err
    assert not (tmp_path / "a" / "tensorboard").exists()
    run(parse_args(_args(tmp_path / "b", *resume, "--profile_steps", "2,4")))
    captured = capsys.readouterr()
    assert "this run's steps are 3..3; tracing steps 3..3 of the window" in captured.err
    assert "--profile_steps: traced steps 3..3" in captured.out
    assert os.listdir(tmp_path / "b" / "tensorboard" / "plugins" / "profile")


def test_profile_window_past_the_runs_last_step_is_cut_there(tmp_path, capsys):
    """A --profile_steps window that ends after the run's last step traces the steps it
    holds and says which (one that starts after it is refused before compiling)."""
    extra = ["--max_steps", "3", "--profile_steps", "3,5", "--save_strategy", "no"]
    run(parse_args(_args(tmp_path / "run", "--report_to", "none", *extra)))
    captured = capsys.readouterr()
    assert "this run's steps are 1..3; tracing steps 3..3 of the window" in captured.err
    assert "--profile_steps: traced steps 3..3" in captured.out
    assert os.listdir(tmp_path / "run" / "tensorboard" / "plugins" / "profile")


def test_logging_first_step_logs_step_one(tmp_path):
    """HF's --logging_first_step: step 1's metrics are logged beside every
    --logging_steps step's (without it the first record is step 2's here)."""
    for flag, steps in (("true", [1, 2, 4]), ("false", [2, 4])):
        out = tmp_path / flag
        extra = ["--max_steps", "4", "--logging_steps", "2", "--save_strategy", "no"]
        run(parse_args(_args(out, "--report_to", "none", "--logging_first_step", flag, *extra)))
        records = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == steps, records


def test_step_line_of_a_traced_window_says_so(tmp_path, capsys):
    """The tokens/s of a logging window that holds `--profile_steps` are the profiler's
    too: its step line says so; the other windows' lines do not."""
    extra = ["--max_steps", "6", "--logging_steps", "2", "--profile_steps", "3,4"]
    run(parse_args(_args(tmp_path / "run", "--report_to", "none", "--save_strategy", "no", *extra)))
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("step ")]
    note = "tokens/s (traced steps in this window: slower under the profiler)"
    assert [note in x for x in lines] == [False, True, False], lines
    assert all("tokens/s" in x for x in lines[1:]), lines


def _ticking_clock(monkeypatch) -> list[float]:
    """`train.loop`'s clock advances one second per reading; the returned cell moves it
    on by hand."""
    now = [0.0]

    def perf_counter():
        now[0] += 1.0
        return now[0]

    clock = types.SimpleNamespace(perf_counter=perf_counter, monotonic=time.monotonic)
    monkeypatch.setattr(loop, "time", clock)  # the preemption's clock as it is
    return now


def test_throughput_counts_every_token_a_step_computes(tmp_path, monkeypatch):
    """tokens/s, TFLOP/s and MFU count the step's rows x their length: the tokens the
    model computes, labelled or not (records whose labels are mostly -100 take as long);
    `labelled_tokens` counts those the loss averages over."""
    _ticking_clock(monkeypatch)
    data = tmp_path / "masked.jsonl"
    with open(data, "w") as f:
        for i in range(24):
            ids = [3 + (i + j) % 200 for j in range(40)]
            f.write(json.dumps({"input_ids": ids, "labels": [-100] * 35 + ids[35:]}) + "\n")
    out = tmp_path / "run"
    # Attention across the packed records: each row's model FLOPs are one causal row's.
    argv = ["--data_path", str(data), "--save_strategy", "no", "--mask_documents", "false"]
    argv += ["--packing_positions", "running"]
    run(parse_args(_args(out, *argv)))
    records = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    step_tokens = jax.device_count() * 64  # a row per device of --model_max_length 64
    flops = models.training_flops_per_token(models.TINY, 64)
    for r in records[1:]:  # each window is one step, one second on the clock
        assert r["tokens_per_s"] == step_tokens and r["step_s"] == 1.0, r
        # The loss's own count: 6 of every 41 tokens (5 labels and the EOS) are labelled.
        assert 0 < r["labelled_tokens"] < step_tokens // 4, r
        assert r["tflops_per_device"] == pytest.approx(
            step_tokens * flops / jax.device_count() / 1e12
        )


def test_tflops_count_the_attention_inside_each_packed_document(tmp_path, monkeypatch):
    """With attention kept inside packed documents, TFLOP/s and MFU count each
    document's causal attention (half its length per token), not a whole row's: rows of
    two 32-token documents count 16 keys per token, not 32."""
    _ticking_clock(monkeypatch)
    data = tmp_path / "docs.jsonl"
    with open(data, "w") as f:  # 31 tokens and the EOS: two documents fill a row of 64
        for i in range(48):
            f.write(json.dumps({"input_ids": [3 + (i + j) % 200 for j in range(31)]}) + "\n")
    out = tmp_path / "run"
    run(parse_args(_args(out, "--data_path", str(data), "--save_strategy", "no")))
    records = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    step_tokens = jax.device_count() * 64
    flops = models.training_flops_per_token(models.TINY, 64, keys=16)
    assert flops < models.training_flops_per_token(models.TINY, 64)
    for r in records[1:]:
        assert r["tflops_per_device"] == pytest.approx(
            step_tokens * flops / jax.device_count() / 1e12
        )
    rows = np.array([[0] * 32 + [1] * 32, [0] * 10 + [1] * 54])
    assert models.document_keys(rows) == pytest.approx((2 * 32**2 + 10**2 + 54**2) / 2 / 128)


@pytest.mark.parametrize("slow", ["evaluation", "save", "trace"])
def test_evaluation_and_save_time_is_not_in_the_training_speed(tmp_path, monkeypatch, slow):
    """A logging window that holds an evaluation, a checkpoint save or the writing of a
    --profile_steps trace reports the speed of its training steps: their time is left
    out of its tokens/s and ETA."""
    now = _ticking_clock(monkeypatch)
    owner, name = {
        "evaluation": (loop, "_evaluate"),
        "save": (loop.Checkpoints, "save"),
        "trace": (jax.profiler, "stop_trace"),
    }[slow]
    fast = getattr(owner, name)

    def slowly(*args, **kwargs):
        now[0] += 1000.0  # one that takes long
        return fast(*args, **kwargs)

    monkeypatch.setattr(owner, name, slowly)
    out = tmp_path / "run"
    extra = ["--eval_data_path", "sample", "--eval_steps", "2", "--max_steps", "4"]
    if slow == "save":
        extra = ["--save_steps", "2", "--max_steps", "4"]
    if slow == "trace":
        extra = ["--profile_steps", "2,3", "--max_steps", "4", "--save_strategy", "no"]
    run(parse_args(_args(out, "--logging_steps", "2", *extra)))
    records = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    speeds = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    step_tokens = jax.device_count() * 64
    assert len(speeds) == 2 and min(speeds) > step_tokens / 10, records


def test_first_window_starts_before_the_next_step_is_queued(tmp_path, monkeypatch):
    """Queueing a step can take the host longer than the device takes to finish the step
    before (XLA's command buffers off: thousands of kernel launches). The first window
    starts where the run's first step is done, before the second is queued, so it holds
    the second's queueing as every later window holds its steps': all windows read
    alike."""
    now = _ticking_clock(monkeypatch)
    train = loop._train

    def slow_queue(t, state, start_step, step_fn, *rest):
        def queued(*args):
            now[0] += 100.0  # the host's time to queue a step
            return step_fn(*args)

        return train(t, state, start_step, queued, *rest)

    monkeypatch.setattr(loop, "_train", slow_queue)
    out = tmp_path / "run"
    run(parse_args(_args(out, "--logging_steps", "2", "--max_steps", "6")))
    records = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    speeds = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    assert len(speeds) == 3 and max(speeds) < 1.2 * min(speeds), speeds


def test_last_line_says_what_the_run_left_where(tmp_path, capsys):
    """The run ends with its final loss, its last checkpoint and its export, by path."""
    out = tmp_path / "run"
    assert main(_args(out, "--report_to", "none", "--max_steps", "2", "--export_hf", "true")) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert re.fullmatch(
        rf"done: 2 steps, final loss \d+\.\d{{4}}; checkpoint 2 in {out / 'checkpoints'}, the "
        rf"HF model in {out / 'hf'}",
        last,
    ), last
    again = _args(tmp_path / "b", "--report_to", "none", "--save_strategy", "no")
    assert main(again) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    nothing = "; no weights kept \\(--save_strategy no, --export_hf false\\)"
    assert re.fullmatch(rf"done: 3 steps, final loss \d+\.\d{{4}}{nothing}", last), last


def test_a_resume_that_finds_its_run_done_writes_nothing(tmp_path, capsys):
    """Resuming a finished run trains nothing and leaves the directory as it was: its
    settings file keeps the run's own learning rate, and no TensorBoard file is added."""
    out = tmp_path / "run"
    assert main(_args(out, "--save_steps", "3", "--learning_rate", "3e-3")) == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    again = _args(out, "--learning_rate", "1e-3", "--resume_from_checkpoint", "latest")
    assert main(again) == 0
    said = capsys.readouterr().err
    assert "nothing to train: checkpoint 3 is already at the run's 3 steps" in said
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert "learning_rate: 0.003" in (out / outputs.SETTINGS_FILE).read_text()
    # Into another directory as well: that directory gets nothing (it got an HF export,
    # said to be that of a run stopped after its last save).
    other = tmp_path / "other"
    elsewhere = ["--resume_from_checkpoint", str(out), "--export_hf", "true"]
    assert main(_args(other, *elsewhere)) == 0
    said = capsys.readouterr().err
    assert f"already at the run's 3 steps; nothing is written into {other}" in said
    assert not other.exists()


def _files(out) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}


def _stopping_save(monkeypatch, at: dict):
    """Checkpoints.save that records the directory's entries and raises KeyboardInterrupt
    (Ctrl-C) at step `at["step"]`, before writing it."""
    import train.loop as loop

    real = loop.Checkpoints.save
    at["seen"] = []

    def save(self, step, state, meta, **kwargs):
        at["seen"].append((step, sorted(os.listdir(os.path.dirname(self.directory)))))
        if step == at["step"]:
            raise KeyboardInterrupt
        return real(self, step, state, meta, **kwargs)

    monkeypatch.setattr(loop.Checkpoints, "save", save)


def test_overwrite_deletes_the_previous_run_only_once_the_new_one_has_a_checkpoint(
    tmp_path, monkeypatch, capsys
):
    """--overwrite_output_dir moves the previous run into previous_run/; a new run
    stopped before its first checkpoint puts it back byte for byte and says so (Ctrl-C's
    line does not offer the old checkpoints as its own); once the new run's first
    checkpoint is whole, the previous run is deleted while the run goes on."""
    import train.__main__ as entry

    out = tmp_path / "run"
    assert main(_args(out, "--save_steps", "3")) == 0
    before = _files(out)
    assert "checkpoints/3/meta/metadata" in before
    again = _args(out, "--save_steps", "1", "--learning_rate", "1e-3", "--overwrite_output_dir")

    def exit_(code):
        raise SystemExit(code)

    monkeypatch.setattr(entry.os, "_exit", exit_)
    at = {"step": 1}
    _stopping_save(monkeypatch, at)
    capsys.readouterr()
    with pytest.raises(SystemExit) as ended:
        entry.main(again)
    assert ended.value.code == 130
    assert at["seen"] == [
        (
            1,
            [
                "checkpoints",
                "log.jsonl",
                outputs.RUN_MODEL_CONFIG,
                outputs.PREVIOUS_RUN,
                "tensorboard",
                outputs.SETTINGS_FILE,
            ],
        )
    ]
    assert _files(out) == before
    captured = capsys.readouterr()
    assert f"previous run's outputs are kept in {out / outputs.PREVIOUS_RUN}" in captured.out
    assert captured.err.splitlines() == [
        f"{outputs.PUT_BACK} {out}",
        "interrupted: this run wrote no checkpoint",
    ]

    at.update(step=3, seen=[])  # checkpoints 1 and 2 are written; save 2 waits for save 1
    with pytest.raises(KeyboardInterrupt):
        run(parse_args(again))
    assert outputs.PREVIOUS_RUN in at["seen"][0][1]
    assert [step for step, _ in at["seen"]] == [1, 2, 3]
    assert outputs.PREVIOUS_RUN not in at["seen"][2][1]
    assert not (out / outputs.PREVIOUS_RUN).exists()
    assert outputs.saved_steps(out) == [1, 2]
    deleted = f"this run has a whole checkpoint (step 1): deleted the run it replaces ({out}/"
    assert deleted in capsys.readouterr().out


def _outputs_by_hand(out, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_auto_on_a_run_killed_before_its_first_checkpoint_names_both_flags(tmp_path, capsys):
    """A job killed hard before its first save leaves logs and no checkpoint; the
    requeue with `auto` alone is refused in one line that gives the command's second
    flag (and does not first say it trains from the start); with both, it starts over."""
    out = tmp_path / "job"
    _outputs_by_hand(
        out, {"log.jsonl": '{"step": 1, "loss": 5.0}\n', "checkpoints/2.orbax-tmp/x": ""}
    )
    before = _files(out)
    auto = ["--resume_from_checkpoint", "auto", "--report_to", "none"]
    with pytest.raises(TrainingError) as e:
        run(parse_args(_args(out, *auto)))
    assert str(e.value) == (
        f"--resume_from_checkpoint auto: no checkpoint in {out / 'checkpoints'} to continue, "
        f"and --output_dir={str(out)!r} holds a run that saved none (checkpoints, log.jsonl): "
        "--overwrite_output_dir true replaces it (a requeued job's command carries both "
        "flags), or choose another --output_dir"
    )
    assert "training from the start" not in capsys.readouterr().out
    assert _files(out) == before
    summary = run(parse_args(_args(out, *auto, "--overwrite_output_dir", "true")))
    assert summary["start_step"] == 0 and outputs.saved_steps(str(out))
    # A directory reused for another run: `auto` resumes the one there, so the
    # overwrite does not apply, and a refusal of its checkpoint says so.
    other = ["--overwrite_output_dir", "true", "--per_device_train_batch_size", "2"]
    with pytest.raises(TrainingError) as e:
        run(parse_args(_args(out, *auto, *other)))
    assert str(e.value).startswith("checkpoint 3 in ") and str(e.value).endswith(
        f"(--resume_from_checkpoint auto found checkpoint 3 in {out} and resumes it: "
        "--overwrite_output_dir applies only where there is none; to replace that run, "
        "drop auto, or choose another --output_dir)"
    )


def test_previous_run_left_by_a_killed_replacing_run(tmp_path):
    """A replacing run killed hard (no `settle`) leaves previous_run/ beside its own
    outputs: a new run is refused naming it; --overwrite_output_dir drops the killed
    run's outputs where they hold no whole checkpoint and keeps the previous run
    (`settle` then deletes or puts it back); where they hold one, it is refused, since it
    would delete the set-aside run unasked (it did, silently)."""
    old = {"checkpoints/3/meta": "old", "log.jsonl": "old log\n"}
    killed = {"log.jsonl": "killed log\n", outputs.SETTINGS_FILE: "killed"}
    record = json.dumps({"state": "aside", "names": ["checkpoints", "log.jsonl"]})
    old_aside = {f"{outputs.PREVIOUS_RUN}/{k}": v for k, v in old.items()}
    old_aside[f"{outputs.PREVIOUS_RUN}/{outputs.MOVES}"] = record

    out = tmp_path / "no_checkpoint"
    _outputs_by_hand(out, old_aside | killed)
    with pytest.raises(TrainingError, match="holds a run set aside in .* and was killed"):
        outputs.check_claim(str(out), continuing=False, overwrite=False, resume_flag=None)
    aside = outputs.set_aside(str(out), is_main=True)
    assert aside == str(out / outputs.PREVIOUS_RUN)
    assert sorted(os.listdir(out)) == [outputs.PREVIOUS_RUN]  # the killed run's are gone
    (out / "log.jsonl").write_text("new log\n")
    assert outputs.settle(aside, str(out), good=False) == f"{outputs.PUT_BACK} {out}"
    assert _files(out) == {k: v.encode() for k, v in old.items()}

    out = tmp_path / "with_checkpoint"
    became = killed | {"checkpoints/1/meta": "killed"}
    _outputs_by_hand(out, old_aside | became)
    with pytest.raises(TrainingError) as e:
        outputs.check_claim(str(out), continuing=False, overwrite=True, resume_flag=None)
    assert str(e.value) == (
        f"--output_dir={str(out)!r} holds two runs: one set aside in "
        f"{out / outputs.PREVIOUS_RUN}, kept when the run that replaced it was stopped, and "
        "that run (checkpoint 1): --overwrite_output_dir would replace the second and delete "
        f"the first; delete {out / outputs.PREVIOUS_RUN} (or move its contents back) first, "
        "or continue the second with --resume_from_checkpoint latest (without "
        "--overwrite_output_dir)"
    )
    with pytest.raises(TrainingError, match="and was killed .*: --resume_from_checkpoint latest"):
        outputs.check_claim(str(out), continuing=False, overwrite=False, resume_flag=None)
    # Were it not refused, the killed run would become the previous run.
    aside = outputs.set_aside(str(out), is_main=True)
    moved = {f"{outputs.PREVIOUS_RUN}/{k}": v.encode() for k, v in became.items()}
    record = {"state": "aside", "names": ["checkpoints", "log.jsonl", outputs.SETTINGS_FILE]}
    assert _files(out) == moved | {
        f"{outputs.PREVIOUS_RUN}/{outputs.MOVES}": json.dumps(record).encode()
    }
    assert outputs.settle(aside, str(out), good=True).startswith(
        "this run finished: deleted the run it replaces"
    )
    assert not (out / outputs.PREVIOUS_RUN).exists()
    assert outputs.settle(aside, str(out), good=False) is None  # settled once


def test_checkpoints_saved_by_another_run_while_this_one_started_are_refused(tmp_path):
    """Where a run chose to resume (or `auto` to start afresh), another run may save
    checkpoints before this one takes the directory's lock: it then resumed from a
    step that was no longer the latest, cut the log back past the other run's records
    and died on its next save, or replaced a run that had checkpoints. Under the lock
    the checkpoints are compared with those it chose from."""
    out = tmp_path / "run"
    _outputs_by_hand(out, {"checkpoints/10/meta": "x", "log.jsonl": "", "train_config.yaml": ""})
    claim = functools.partial(
        outputs.check_claim, str(out), continuing=True, overwrite=False, resume_flag="auto"
    )
    claim(seen=[10])  # as chosen
    (out / "checkpoints" / "40").mkdir()  # another run finished meanwhile
    with pytest.raises(TrainingError) as e:
        claim(seen=[10])
    assert str(e.value) == (
        f"--output_dir={str(out)!r}: another run saved checkpoints there while this one "
        "started (checkpoint 10 then, checkpoints 10, 40 now); nothing was changed: start "
        "this run again to choose where it starts from what is there now"
    )
    fresh = tmp_path / "fresh"
    with pytest.raises(TrainingError, match=r"\(no checkpoint then, checkpoint 40 now\)"):
        _outputs_by_hand(fresh, {"checkpoints/40/meta": "x"})
        outputs.check_claim(
            str(fresh), continuing=False, overwrite=True, resume_flag="auto", seen=[]
        )


def test_a_finished_run_trains_longer_where_its_rates_so_far_stay(tmp_path, capsys):
    """HF's way to train longer, a resume with more --max_steps, where the rates of the
    steps trained are the same under the new step count (a constant rate, or a
    warmup-stable-decay before its decay): it trains on as the longer run would have,
    loss for loss. A schedule whose past rates would change is refused, naming the
    export of the checkpoint as the way to a new run."""

    def losses(out):
        lines = (out / "log.jsonl").read_text().splitlines()
        return [json.loads(x)["loss"] for x in lines if '"loss"' in x]

    for kind, extra in (
        ("constant", ["--lr_scheduler_type", "constant", "--learning_rate", "1e-3"]),
        ("wsd", ["--lr_scheduler_type", "wsd", "--decay_ratio", "0.25", "--warmup_steps", "1"]),
    ):
        common = [*extra, "--save_steps", "2", "--report_to", "none"]
        straight, longer = tmp_path / f"{kind}-8", tmp_path / f"{kind}-4"
        run(parse_args(_args(straight, *common, "--max_steps", "8")))
        run(parse_args(_args(longer, *common, "--max_steps", "4")))
        if kind == "wsd":  # it decays over the last quarter: resume step 2, before that
            shutil.rmtree(longer / "checkpoints" / "4")
        capsys.readouterr()
        more = ["--max_steps", "8", "--resume_from_checkpoint", "latest"]
        run(parse_args(_args(longer, *common, *more)))
        step = 4 if kind == "constant" else 2
        assert (
            f"checkpoint {step} belongs to a run of 4 steps; this run has 8: the schedule's "
            f"rates of its first {step} steps are the same under both, so it trains on to "
            "step 8"
        ) in capsys.readouterr().out
        # all 8 steps; a GPU's reductions are not deterministic without XLA's flag
        assert losses(longer) == pytest.approx(losses(straight), rel=1e-4 if ON_GPU else 1e-6)
    out = tmp_path / "linear"
    run(parse_args(_args(out, "--save_steps", "2", "--report_to", "none")))
    with pytest.raises(TrainingError) as e:
        more = ["--max_steps", "6", "--resume_from_checkpoint", "latest", "--report_to", "none"]
        run(parse_args(_args(out, "--save_steps", "2", *more)))
    assert "under which the rates of the steps it trained differ" in str(e.value)
    assert f"python -m train.tools.export {out} --step 3 --out DIR" in str(e.value)


def test_a_resume_overtaken_by_another_run_changes_nothing(tmp_path, monkeypatch):
    """The trainer end to end: a checkpoint that another run saves while this one
    builds (before the lock) refuses this run, its log and checkpoints untouched."""
    out = tmp_path / "run"
    run(parse_args(_args(out, "--save_steps", "2", "--max_steps", "4", "--report_to", "none")))
    shutil.rmtree(out / "checkpoints" / "4")  # a run stopped at step 2
    log = (out / "log.jsonl").read_text()
    build = loop.build

    def overtaken(*args, **kwargs):
        trainer = build(*args, **kwargs)
        shutil.copytree(out / "checkpoints" / "2", out / "checkpoints" / "4")  # the other run
        return trainer

    monkeypatch.setattr(loop, "build", overtaken)
    argv = ["--save_steps", "2", "--max_steps", "4", "--report_to", "none"]
    with pytest.raises(TrainingError, match="another run saved checkpoints there while"):
        run(parse_args(_args(out, *argv, "--resume_from_checkpoint", "latest")))
    assert (out / "log.jsonl").read_text() == log
    assert outputs.saved_steps(str(out)) == [2, 4]


@pytest.mark.parametrize("state", ["moving", "returning"])
def test_a_previous_run_split_by_a_kill_between_two_moves_is_made_whole(tmp_path, state):
    """A replacing run killed between two of the renames that set the previous run aside
    (or put it back) leaves it split: the next run into the directory puts it back whole
    from previous_run/'s record, whatever it was asked to do, before it reads the
    directory; an overwrite then sets all of it aside, and a stop puts all of it back."""
    old = {
        "checkpoints/3/meta": "old",
        "log.jsonl": "old log\n",
        "hf/config.json": "{}",
        "tensorboard/events.out.tfevents.1": "e",
        outputs.SETTINGS_FILE: "old",
    }
    out = tmp_path / "run"
    _outputs_by_hand(out, old)
    names = outputs.previous_outputs(str(out))
    aside = out / outputs.PREVIOUS_RUN
    aside.mkdir()
    (aside / outputs.MOVES).write_text(json.dumps({"state": state, "names": names}))
    for name in ("checkpoints", "log.jsonl"):  # the kill came after two of five renames
        os.rename(out / name, aside / name)
    line = outputs.recover(str(out), is_main=True)
    how = "setting them aside" if state == "moving" else "putting them back"
    assert line == (
        f"--output_dir: a run that was killed while {how} had left part of the previous "
        f"run's outputs in {aside}: checkpoints, log.jsonl back in {out}"
    )
    assert _files(out) == {k: v.encode() for k, v in old.items()}
    assert outputs.recover(str(out), is_main=True) is None  # whole: nothing to do

    kept = outputs.set_aside(str(out), is_main=True)
    assert sorted(os.listdir(out)) == [outputs.PREVIOUS_RUN]
    (out / "log.jsonl").write_text("new log\n")
    assert outputs.settle(kept, str(out), good=False) == f"{outputs.PUT_BACK} {out}"
    assert _files(out) == {k: v.encode() for k, v in old.items()}


def test_a_run_through_the_trainer_makes_a_split_previous_run_whole_first(tmp_path, capsys):
    """The trainer's own path: a plain run into a directory holding a split previous run
    puts it back, says so, and then refuses to mix into it, naming all of it."""
    out = tmp_path / "run"
    old = {"checkpoints/3/meta": "old", "log.jsonl": "old log\n", "hf/config.json": "{}"}
    _outputs_by_hand(out, old)
    aside = out / outputs.PREVIOUS_RUN
    aside.mkdir()
    names = ["checkpoints", "hf", "log.jsonl"]
    (aside / outputs.MOVES).write_text(json.dumps({"state": "moving", "names": names}))
    os.rename(out / "checkpoints", aside / "checkpoints")
    with pytest.raises(TrainingError, match=r"holds a previous run \(checkpoints, log.jsonl, hf\)"):
        run(parse_args(_args(out)))
    assert "checkpoints back in" in capsys.readouterr().out
    assert _files(out) == {k: v.encode() for k, v in old.items()}


def test_a_previous_run_without_its_record_is_refused_not_sorted(tmp_path):
    """previous_run/ without the record of its moves (made by hand, or by an older
    version): which outputs are whose is not known, so every run is refused in one line
    and nothing moves or is deleted."""
    out = tmp_path / "run"
    files = {f"{outputs.PREVIOUS_RUN}/log.jsonl": "old\n", "hf/config.json": "{}"}
    _outputs_by_hand(out, files)
    assert outputs.recover(str(out), is_main=True) is None
    for continuing, overwrite in ((False, False), (False, True), (True, False)):
        with pytest.raises(TrainingError, match=r"without a record of how it was set aside"):
            outputs.check_claim(
                str(out), continuing=continuing, overwrite=overwrite, resume_flag="latest"
            )
    # The way back names the outputs beside it, which moving its contents back would meet.
    with pytest.raises(TrainingError) as e:
        outputs.check_claim(str(out), continuing=False, overwrite=True, resume_flag=None)
    assert str(e.value).endswith(
        f"(.moves.json: made by hand, or by a jflash from before that record), so which "
        f"outputs are the previous run's is not known: delete the outputs beside it (hf) and "
        f"move its contents back into {out}, or delete {out / outputs.PREVIOUS_RUN} yourself"
    )
    assert _files(out) == {k: v.encode() for k, v in files.items()}
    os.remove(out / outputs.PREVIOUS_RUN / "log.jsonl")  # empty: a kill before its record
    assert outputs.recover(str(out), is_main=True) is None
    assert sorted(os.listdir(out)) == ["hf"]


def test_a_deletion_cut_off_leaves_nothing_under_the_previous_runs_name(tmp_path, monkeypatch):
    """`settle` renames previous_run/ before deleting it: a deletion cut off leaves only
    `DELETING`, which the next run deletes."""
    out = tmp_path / "run"
    _outputs_by_hand(out, {"log.jsonl": "old\n", "hf/config.json": "{}"})
    aside = outputs.set_aside(str(out), is_main=True)
    real_rmtree = shutil.rmtree

    def cut_off(path, *args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(outputs.shutil, "rmtree", cut_off)
    with pytest.raises(KeyboardInterrupt):
        outputs.settle(aside, str(out), good=True)
    assert sorted(os.listdir(out)) == [outputs.DELETING]
    monkeypatch.setattr(outputs.shutil, "rmtree", real_rmtree)
    assert outputs.recover(str(out), is_main=True) is None
    assert os.listdir(out) == []


def test_a_resume_cut_off_while_it_trims_the_log_keeps_the_log(tmp_path, monkeypatch):
    """The log is trimmed into `<log>.part`, which then replaces it: a stop before the
    replace leaves the whole old log (and the next trim removes the `.part`)."""
    out = tmp_path / "run"
    lines = [json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 6)]
    (out / "tensorboard").mkdir(parents=True)
    (out / "log.jsonl").write_text("".join(lines))
    real_replace = os.replace

    def cut_off(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(outputs.os, "replace", cut_off)
    with pytest.raises(KeyboardInterrupt):
        outputs.drop_after(str(out), 3)
    assert (out / "log.jsonl").read_text() == "".join(lines)
    monkeypatch.setattr(outputs.os, "replace", real_replace)
    outputs.drop_after(str(out), 3)
    assert (out / "log.jsonl").read_text() == "".join(lines[:3])
    assert sorted(os.listdir(out)) == ["log.jsonl", "tensorboard"]


def test_a_damaged_log_line_is_named_not_dropped(tmp_path):
    """A resume trims the log: a torn last line goes (a kill cut it), but a line before
    it that is no step's record (broken JSON, or JSON that is not a record) is damage
    the resume refuses, naming the file and line, with the log left as it was."""
    out = tmp_path / "run"
    (out / "tensorboard").mkdir(parents=True)
    lines = [json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 6)]
    for bad in ('{"step": 3, "loss": 6.2\n', "[]\n"):
        damaged = "".join([*lines[:2], bad, *lines[3:]])
        (out / "log.jsonl").write_text(damaged)
        with pytest.raises(TrainingError, match=r"log\.jsonl, line 3: not a record of a step"):
            outputs.drop_after(str(out), 4)
        assert (out / "log.jsonl").read_text() == damaged
    (out / "log.jsonl").write_text("".join([*lines, '{"step": 6, "lo']))  # torn by a kill
    outputs.drop_after(str(out), 5)
    assert (out / "log.jsonl").read_text() == "".join(lines)


def test_settings_name_paths_absolute(tmp_path, monkeypatch):
    """`--config <output_dir>/train_config.yaml` runs the same job from any directory:
    relative paths are written absolute; a preset name and `sample` stay names."""
    import yaml

    monkeypatch.chdir(tmp_path)
    data_lib.save_dataset(tmp_path / "rows.npy", np.zeros((4, 65), np.int32))
    cfg = parse_args(
        ["--model_name_or_path", "tiny", "--data_path", "rows.npy", "--eval_data_path", "sample"]
        + ["--output_dir", "runs/a", "--data_cache_dir", "cache", "--max_steps", "1"]
    )
    path = os.path.abspath(outputs.write_settings("runs/a", cfg))
    with open(path) as f:
        saved = yaml.safe_load(f)
    assert saved["model"]["model_name_or_path"] == "tiny"
    assert saved["data"]["data_path"] == str(tmp_path / "rows.npy")
    assert saved["data"]["eval_data_path"] == "sample"
    assert saved["data"]["data_cache_dir"] == str(tmp_path / "cache")
    assert saved["data"]["tokenizer_name_or_path"] == ""
    assert saved["run"]["output_dir"] == str(tmp_path / "runs" / "a")
    assert saved["profile"]["profile_dir"] == ""
    monkeypatch.chdir(tmp_path / "runs")
    again = parse_args(["--config", str(path)])
    assert again.data.data_path == str(tmp_path / "rows.npy") and again.run.max_steps == 1


def test_overwrite_refuses_what_it_cannot_replace_cleanly(tmp_path):
    """A symlinked output (its target would stay behind), a file named previous_run,
    and an input inside the outputs being replaced are refused before anything moves."""
    out = tmp_path / "run"
    _outputs_by_hand(out, {"log.jsonl": "old\n", "hf/config.json": "{}"})
    claim = functools.partial(
        outputs.check_claim, str(out), continuing=False, overwrite=True, resume_flag=None
    )
    with pytest.raises(TrainingError, match="--model_name_or_path=.* lies in .*hf, which"):
        claim(inputs={"--model_name_or_path": str(out / "hf"), "--data_path": "sample"})
    claim(inputs={"--model_name_or_path": "tiny", "--data_path": str(tmp_path / "absent")})
    (tmp_path / "elsewhere").mkdir()
    (out / "checkpoints").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(TrainingError, match="checkpoints is a symlink"):
        claim()
    (out / "checkpoints").unlink()
    (out / outputs.PREVIOUS_RUN).write_text("a file")
    with pytest.raises(TrainingError, match="previous_run is a file"):
        claim()


def test_set_aside_and_settle_failures_are_said_not_raised_midway(tmp_path, monkeypatch):
    """A move that fails is undone and refused in one line; a deletion that fails once
    the new run is good is a warning (the run goes on), not a crash."""
    out = tmp_path / "run"
    old = {"checkpoints/3/meta": "old", "log.jsonl": "old log\n", "hf/config.json": "{}"}
    _outputs_by_hand(out, old)
    real_rename = os.rename

    def rename(src, dst):
        if str(src).endswith("log.jsonl"):
            raise PermissionError(13, "Permission denied")
        real_rename(src, dst)

    monkeypatch.setattr(outputs.os, "rename", rename)
    with pytest.raises(TrainingError, match=r"could not move .*log.jsonl .*is as it was"):
        outputs.set_aside(str(out), is_main=True)
    assert _files(out) == {k: v.encode() for k, v in old.items()}
    monkeypatch.setattr(outputs.os, "rename", real_rename)

    aside = outputs.set_aside(str(out), is_main=True)

    def rmtree(path, *args, **kwargs):
        raise PermissionError(1, "Operation not permitted", os.path.join(path, "hf"))

    monkeypatch.setattr(outputs.shutil, "rmtree", rmtree)
    line = outputs.settle(aside, str(out), good=True)
    assert line.startswith("warning: this run finished, but the run it replaces could not")
    assert "Operation not permitted; delete it yourself" in line


def test_signals_held_until_the_block_ends():
    """Ctrl-C inside the block is raised at its end (or dropped where the run is already
    stopping); outside the main thread the block holds nothing; an ignored Ctrl-C stays
    ignored."""
    import signal
    import threading

    # Python's own Ctrl-C handler, as in a terminal (a shell that starts the tests in the
    # background hands them SIGINT ignored).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        ran = []
        with pytest.raises(KeyboardInterrupt):
            with outputs.signals_held():
                signal.raise_signal(signal.SIGINT)
                ran.append("after the signal")
        assert ran == ["after the signal"]
        with outputs.signals_held(reraise=False):
            signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        seen = []
        thread = threading.Thread(target=lambda: seen.append(outputs.signals_held().__enter__()))
        thread.start()
        thread.join()
        assert seen == [None]
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with outputs.signals_held():
            signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_second_run_into_a_directory_in_use_is_refused(tmp_path, capsys):
    """While a run holds its --output_dir, another run into it is refused in one line
    (a lock the system drops however the holder ends)."""
    import subprocess

    out = tmp_path / "run"
    with outputs.claimed(str(out)):
        with pytest.raises(TrainingError, match="is in use by another run"):
            run(parse_args(_args(out, "--report_to", "none")))
        # A live run with no checkpoint yet is not "a previous run" to replace, nor one
        # to start over from: the lock is named first, before anything loads.
        (out / "log.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
        for flags in (["--resume_from_checkpoint", "auto"], []):
            with pytest.raises(TrainingError, match="is in use by another run"):
                run(parse_args(_args(out, "--report_to", "none", *flags)))
        assert "training from the start" not in capsys.readouterr().out
        holder = "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY); "
        holder += "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)"
        other = subprocess.run([sys.executable, "-c", holder, str(out)], capture_output=True)
        assert other.returncode != 0 and b"BlockingIOError" in other.stderr
    with outputs.claimed(str(out)):  # released at the end of the block
        pass


def test_overwrite_with_nothing_to_train_changes_nothing(tmp_path, capsys):
    """Resuming a finished run into another directory with --overwrite_output_dir has
    nothing to train: the directory it would replace is left as it was."""
    first, out = tmp_path / "first", tmp_path / "run"
    run(parse_args(_args(first, "--save_steps", "3", "--report_to", "none")))
    _outputs_by_hand(out, {"log.jsonl": "old\n", "checkpoints/2/meta": "old"})
    before = _files(out)
    done = str(first / "checkpoints" / "3")
    again = _args(out, "--resume_from_checkpoint", done, "--overwrite_output_dir")
    run(parse_args([*again, "--report_to", "none"]))
    assert _files(out) == before
    assert "previous_run" not in capsys.readouterr().out


def test_ctrl_c_before_an_overwrite_run_starts_leaves_the_directory(tmp_path, monkeypatch, capsys):
    """Ctrl-C while an --overwrite_output_dir run compiles: its line says the directory
    is as it was, not that the previous run's checkpoints are this run's to continue."""
    import train.__main__ as entry
    import train.loop as loop

    out = tmp_path / "run"
    _outputs_by_hand(out, {"log.jsonl": "old\n", "checkpoints/2/meta": "old"})

    def interrupted_build(cfg, **kwargs):
        raise KeyboardInterrupt

    def exit_(code):
        raise SystemExit(code)

    monkeypatch.setattr(loop, "build", interrupted_build)
    monkeypatch.setattr(entry.os, "_exit", exit_)
    with pytest.raises(SystemExit) as ended:
        entry.main(_args(out, "--overwrite_output_dir"))
    assert ended.value.code == 130
    assert capsys.readouterr().err == f"interrupted before the run started: {out} is as it was\n"
    assert _files(out) == {"log.jsonl": b"old\n", "checkpoints/2/meta": b"old"}


def test_saves_cut_off_by_a_kill_are_removed_when_the_run_resumes(tmp_path, capsys):
    """Orbax's temporary directories of saves a kill cut off are removed, in one line,
    when a run resumes in their output directory; other names there are kept."""
    import orbax.checkpoint._src.path.atomicity_types as atomicity_types

    from train.checkpoint import DELETED, PARTIAL_SAVE

    assert PARTIAL_SAVE.fullmatch("4" + atomicity_types.TMP_DIR_SUFFIX)  # orbax's own name
    out = tmp_path / "run"
    argv = _args(out, "--report_to", "none", "--max_steps", "4", "--save_steps", "2")
    assert main(argv) == 0
    checkpoints = out / "checkpoints"
    shutil.rmtree(checkpoints / "4")
    for name in ("4.orbax-checkpoint-tmp", "3.orbax-checkpoint-tmp-1712", "notes"):
        (checkpoints / name / "state").mkdir(parents=True)
    (checkpoints / DELETED / "1" / "state").mkdir(parents=True)  # a deletion cut off
    capsys.readouterr()
    assert main([*argv, "--resume_from_checkpoint", "latest"]) == 0
    said = capsys.readouterr().out
    assert (
        f"removed 2 checkpoint saves cut off before completing in {checkpoints}: "
        "3.orbax-checkpoint-tmp-1712, 4.orbax-checkpoint-tmp\n"
    ) in said
    assert sorted(p.name for p in checkpoints.iterdir()) == ["2", "4", "notes"]


def test_dropped_checkpoints_are_deleted_beside_the_training(tmp_path, monkeypatch):
    """What --save_total_limit drops is deleted in a thread (a large checkpoint takes
    seconds), one deletion at a time; close() waits for the last; what a kill leaves
    of one is removed when a run next starts there."""
    import threading

    import jax.numpy as jnp

    from train import checkpoint

    deleted_on = []
    real = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if checkpoint.EMPTYING in os.path.basename(os.fspath(path)):
            deleted_on.append(threading.current_thread() is threading.main_thread())
        return real(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.shutil, "rmtree", rmtree)
    saves = checkpoint.Checkpoints(str(tmp_path), save_total_limit=1)
    for step in (1, 2, 3):
        saves.save(step, {"w": jnp.full((4,), step, jnp.float32)}, {"step": step})
    saves.close()
    assert deleted_on == [False, False]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["3"]
    (tmp_path / "checkpoints" / f"{checkpoint.EMPTYING}1f2e" / "1").mkdir(parents=True)
    assert checkpoint.remove_partial_saves(str(tmp_path)) == []
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["3"]


def test_save_total_limit_drops_checkpoints_whole(tmp_path, monkeypatch):
    """A checkpoint that --save_total_limit drops leaves its step's name in one rename
    (into `checkpoints/.deleted/`, emptied at the next save and at the end): a kill while
    it is deleted leaves no half-deleted checkpoint that reads as a step."""
    from train.checkpoint import DELETED

    out = tmp_path / "run"
    renamed = []

    def watched(real):
        def rename(src, dst, *args, **kwargs):
            if f"{os.sep}{DELETED}{os.sep}" in os.fspath(dst):
                renamed.append(os.path.basename(os.fspath(src)))
            return real(src, dst, *args, **kwargs)

        return rename

    monkeypatch.setattr(os, "rename", watched(os.rename))
    monkeypatch.setattr(os, "replace", watched(os.replace))
    argv = ["--report_to", "none", "--save_steps", "1", "--save_total_limit", "1"]
    assert main(_args(out, *argv)) == 0
    assert renamed == ["1", "2"]
    assert sorted(os.listdir(out / "checkpoints")) == ["3"]


def test_a_relative_checkpoint_path_names_the_runs_own(tmp_path, monkeypatch):
    """`--resume_from_checkpoint checkpoints/10` is read from the working directory; where
    nothing is there but the run's --output_dir has it, the error gives that path."""
    from train.checkpoint import resolve_resume

    out = tmp_path / "run"
    (out / "checkpoints" / "10").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as refused:
        resolve_resume("checkpoints/10", str(out))
    assert str(refused.value) == (
        f"--resume_from_checkpoint='checkpoints/10': {tmp_path / 'checkpoints' / '10'} does not "
        f"exist (its --output_dir has {out / 'checkpoints' / '10'}: give that path)"
    )
    assert resolve_resume(str(out / "checkpoints" / "10"), str(out)) == (str(out), 10)


def test_the_log_stops_the_run_when_its_output_dir_goes(tmp_path):
    """The output directory deleted, or replaced by another of the same name, during the
    run: the next log write stops the run in one line naming the log, instead of
    writing on into a file no one can read (and a run that then reports success)."""
    from train.metrics import JsonlLog

    for gone in (
        shutil.rmtree,
        lambda out: (shutil.rmtree(out), out.mkdir(), (out / "log.jsonl").touch()),
    ):
        out = tmp_path / "run"
        log = JsonlLog(str(out / "log.jsonl"))
        log.write({"step": 1})
        gone(out)
        with pytest.raises(
            TrainingError, match=r"log\.jsonl was removed or replaced while the run"
        ):
            log.write({"step": 2})
        log.close()
        shutil.rmtree(out, ignore_errors=True)
