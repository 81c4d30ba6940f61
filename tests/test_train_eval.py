"""Evaluation: the validation loss is the mean token loss over every evaluation row,
computed under the training mesh and attention, logged beside the training metrics."""

from __future__ import annotations

import json
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from train import data as data_lib
from train.build import end_of_text
from train.config import parse_args
from train.errors import TrainingError
from train.loop import run
from train.tensorboard import read_scalars

SEQ_LEN = 64
# With an EOS after each: row 1 holds the first three, row 2 the next two, and the last
# one (10 tokens) a third row, filled up with ignored tokens; 3 rows under a global batch
# of 4 (fsdp=4), so the evaluation's one batch has a row of filler.
EVAL_LENGTHS = (20, 30, 11, 40, 22, 9)


def _hand_loss(config, params, docs, eos: int) -> float:
    """Mean next-token loss of the documents one by one (each followed by EOS), dense
    attention, float64 sums on the host."""
    total, count = 0.0, 0
    for doc in docs:
        ids = jnp.asarray(np.append(doc, eos))[None]
        logits = models.logits(config, params, ids, attention="xla")[0, :-1]
        logp = np.asarray(jax.nn.log_softmax(logits, axis=-1), np.float64)
        total -= logp[np.arange(len(doc)), np.asarray(ids[0, 1:])].sum()
        count += len(doc)
    return total / count


@pytest.mark.multi_device(8)
@pytest.mark.slow
def test_eval_loss_equals_a_hand_computation(tmp_path, capsys):
    eos = end_of_text(models.TINY)
    rng = np.random.default_rng(1)
    docs = [rng.integers(3, 256, size=n).astype(np.int32) for n in EVAL_LENGTHS]
    eval_path = tmp_path / "eval.jsonl"
    data_lib.save_dataset(eval_path, docs)
    out = tmp_path / "run"
    argv = ["--model_name_or_path", "tiny", "--data_path", "sample", "--bf16", "false"]
    argv += ["--model_max_length", str(SEQ_LEN), "--sample_num_examples", "32"]
    argv += ["--mesh", "data=1,fsdp=-1,seq=2", "--attention", "ring"]
    argv += ["--max_steps", "3", "--eval_steps", "2", "--logging_steps", "1"]
    argv += ["--save_strategy", "no", "--output_dir", str(out), "--learning_rate", "1e-3"]
    summary = run(parse_args([*argv, "--eval_data_path", str(eval_path)]))

    # Every --eval_steps and at the end; in the log, TensorBoard and the progress output.
    assert [e["step"] for e in summary["eval"]] == [2, 3]
    last = summary["eval"][-1]
    assert last["eval_tokens"] == sum(EVAL_LENGTHS)
    assert last["eval_perplexity"] == pytest.approx(np.exp(last["eval_loss"]))
    with open(out / "log.jsonl") as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records if "eval_loss" in r] == [2, 3]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
    scalars = read_scalars(out / "tensorboard")
    assert [s for s, _ in scalars["eval/loss"]] == [2, 3]
    assert {"eval/perplexity", "eval/runtime"} <= scalars.keys()
    assert scalars["eval/tokens"] == [(2, sum(EVAL_LENGTHS)), (3, sum(EVAL_LENGTHS))]
    assert f"eval at step 3: loss {last['eval_loss']:.4f}" in capsys.readouterr().out
    assert len(summary["losses"]) == 3

    config, params = models.load_hf(out / "hf")  # the trained parameters, exported
    assert last["eval_loss"] == pytest.approx(_hand_loss(config, params, docs, eos), rel=2e-5)
    assert summary["eval"][0]["eval_loss"] != last["eval_loss"]  # it trained in between


def test_eval_data_is_checked_before_anything_is_written(tmp_path):
    out = tmp_path / "run"
    argv = ["--model_name_or_path", "tiny", "--data_path", "sample", "--max_steps", "1"]
    argv += ["--model_max_length", "64", "--output_dir", str(out)]
    with pytest.raises(TrainingError, match=r"--eval_data_path='.*typo.jsonl': no such data file"):
        run(parse_args([*argv, "--eval_data_path", str(tmp_path / "typo.jsonl")]))
    assert not out.exists()
    with pytest.raises(ValueError, match="--eval_strategy='never' must be one of"):
        parse_args(["--eval_strategy", "never"])
    with pytest.raises(ValueError, match="--eval_steps=-1 must be >= 0"):
        parse_args(["--eval_steps", "-1"])


def test_evaluation_settings_without_evaluation_data_are_refused():
    """As HF Trainer refuses an eval strategy without an eval dataset: settings that
    would evaluate, away from their defaults, need --eval_data_path or --eval_strategy
    no (a run's saved settings, which hold every default, pass)."""
    for flag, value in (("--eval_steps", "10"), ("--eval_strategy", "epoch")):
        with pytest.raises(ValueError, match=f"{flag}={value} needs --eval_data_path"):
            parse_args([flag, value])
    assert parse_args(["--eval_strategy", "no", "--eval_steps", "10"]).run.eval_steps == 10
    # Asked for on the command line, the default strategy too needs the data.
    with pytest.raises(ValueError, match="^--eval_strategy=steps needs --eval_data_path"):
        parse_args(["--eval_steps", "0", "--eval_strategy", "steps"])
    assert parse_args(["--eval_steps", "0"]).run.eval_steps == 0


def test_steps_given_with_their_strategy_no_get_a_warning(tmp_path, capsys):
    """HF scripts pass --save_steps / --eval_steps beside a strategy of no: accepted,
    with one warning line naming both flags where the steps were given (on the command
    line, or in the YAML away from the default: a run's saved settings hold every
    setting). The evaluation's interval falls back to --logging_steps, as HF's does, so
    --save_steps never sets it."""

    def warnings(*argv: str) -> list[str]:
        parse_args(list(argv))
        return capsys.readouterr().err.splitlines()

    assert warnings("--save_strategy", "no", "--save_steps", "2") == [
        "warning: --save_steps=2 has no effect with --save_strategy no (no checkpoints are saved)"
    ]
    assert warnings("--eval_strategy", "no", "--eval_steps", "2") == [
        "warning: --eval_steps=2 has no effect with --eval_strategy no (no evaluation is run)"
    ]
    assert warnings("--save_strategy", "no", "--eval_strategy", "no") == []
    by_epoch = ["--eval_data_path", "x", "--eval_strategy", "epoch", "--eval_steps", "2"]
    assert warnings(*by_epoch) == [
        "warning: --eval_steps=2 has no effect with --eval_strategy epoch (evaluation runs "
        "at each epoch's end and at the run's)"
    ]
    assert warnings("--save_strategy", "epoch", "--save_steps", "3") == [
        "warning: --save_steps=3 has no effect with --save_strategy epoch (a checkpoint is "
        "saved at each epoch's end)"
    ]
    assert warnings("--save_steps", "2", "--eval_strategy", "steps", "--eval_data_path", "x") == []
    evaluating = ["--eval_data_path", "sample", "--save_strategy", "no", "--save_steps", "2"]
    assert warnings(*evaluating) == [
        "warning: --save_steps=2 has no effect with --save_strategy no (no checkpoints are saved)"
    ]

    yaml = tmp_path / "run.yaml"
    yaml.write_text("run:\n  save_strategy: 'no'\n  save_steps: 7\n  eval_steps: 0\n")
    assert warnings("--config", str(yaml)) == [
        "warning: --save_steps=7 has no effect with --save_strategy no (no checkpoints are saved)"
    ]
    yaml.write_text("run:\n  save_strategy: 'no'\n  save_steps: 500\n  eval_strategy: 'no'\n")
    assert warnings("--config", str(yaml)) == []
    # No saves to limit; a warmup ratio that --warmup_steps overrides; sample-data flags
    # with other data.
    assert warnings("--save_strategy", "no", "--save_total_limit", "2") == [
        "warning: --save_total_limit=2 has no effect with --save_strategy no (no "
        "checkpoints are saved)"
    ]
    assert warnings("--warmup_steps", "2", "--warmup_ratio", "0.5") == [
        "warning: --warmup_ratio=0.5 has no effect beside --warmup_steps=2, which sets the "
        "warmup (as in HF)"
    ]
    assert warnings("--warmup_ratio", "0.5") == []
    assert warnings("--data_path", "d.jsonl", "--sample_num_examples", "5") == [
        "warning: --sample_num_examples=5 has no effect: it shapes --data_path sample, and "
        "the data is 'd.jsonl'"
    ]
    assert warnings("--data_path", "sample", "--sample_vocab_size", "100") == []
    # FSDP on a mesh whose fsdp axis is 1 shards nothing (over seq it does: no line).
    assert warnings("--fsdp", "full_shard", "--mesh", "data=-1,fsdp=1") == [
        "warning: --fsdp='full_shard' has no effect with --mesh 'data=-1,fsdp=1', whose fsdp "
        "axis is 1: parameters, gradients and optimizer state are not sharded (fsdp=-1 or a "
        "size above 1 shards them)"
    ]
    assert warnings("--fsdp", "full_shard", "--mesh", "data=1,fsdp=-1") == []
    assert warnings("--fsdp", "full_shard", "--mesh", "fsdp=1,seq=-1", "--shard_over_seq") == []
    assert warnings("--mesh", "data=-1,fsdp=1") == []  # --fsdp not given
    # A trace folder without a window traces nothing.
    assert warnings("--profile_dir", "traces") == [
        "warning: --profile_dir='traces' has no effect without --profile_steps (nothing is traced)"
    ]
    assert warnings("--profile_dir", "traces", "--profile_steps", "2,3") == []
    # --fp16 runs as bf16: said; both given true is refused, as HF refuses it.
    fp16 = "note: --fp16 runs the model in bfloat16: half precision with float32's range, "
    fp16 += "so no loss scaling"
    assert warnings("--fp16") == warnings("--fp16", "--bf16", "false") == [fp16]
    assert warnings("--bf16", "true") == warnings("--fp16", "false") == []
    with pytest.raises(ValueError, match="^--bf16 and --fp16 are both true: give one"):
        parse_args(["--fp16", "--bf16", "true"])
    yaml = tmp_path / "both.yaml"
    yaml.write_text("model:\n  bf16: true\n  fp16: true\n")  # bf16's default, named
    with pytest.raises(ValueError, match="^--bf16 and --fp16 are both true: give one"):
        parse_args(["--config", str(yaml)])


def test_eval_strategy_no_reads_no_evaluation_data(tmp_path):
    """HF's --eval_strategy no: evaluation off, even where --eval_data_path names data (it
    is not read: a missing file is not an error)."""
    out = tmp_path / "run"
    argv = ["--model_name_or_path", "tiny", "--data_path", "sample", "--max_steps", "2"]
    argv += ["--model_max_length", "64", "--mesh", "data=1,fsdp=-1,seq=1", "--attention", "xla"]
    argv += ["--eval_data_path", str(tmp_path / "absent.jsonl"), "--eval_strategy", "no"]
    argv += ["--save_strategy", "no", "--export_hf", "false", "--report_to", "none"]
    summary = run(parse_args([*argv, "--output_dir", str(out), "--eval_steps", "1"]))
    assert summary["eval"] == [] and len(summary["losses"]) == 2


def test_eval_steps_fall_back_to_logging_steps_as_hf(tmp_path):
    """HF evaluates every --logging_steps where --eval_steps is not given; jflash took
    --save_steps (500 by default): an HF command line with --logging_steps 2 evaluated
    250 times less often, silently. The default number of epochs is HF's 3."""
    argv = ["--model_name_or_path", "tiny", "--data_path", "sample", "--max_steps", "4"]
    argv += ["--model_max_length", "64", "--mesh", "data=1,fsdp=-1,seq=1", "--attention", "xla"]
    argv += ["--eval_data_path", "sample", "--logging_steps", "2", "--save_strategy", "no"]
    argv += ["--export_hf", "false", "--report_to", "none", "--progress", "false"]
    summary = run(parse_args([*argv, "--output_dir", str(tmp_path / "run")]))
    assert [e["step"] for e in summary["eval"]] == [2, 4]
    assert parse_args([]).run.num_train_epochs == 3.0


def test_eval_on_start_gives_the_untrained_loss_once(tmp_path):
    """HF's --eval_on_start: an evaluation before the first step, logged at step 0, the
    initial parameters' loss (the same as a run that trains nothing); a resume does not
    repeat it. Without evaluation it is refused."""
    argv = ["--model_name_or_path", "tiny", "--data_path", "sample", "--max_steps", "4"]
    argv += ["--model_max_length", "64", "--mesh", "data=1,fsdp=-1,seq=1", "--attention", "xla"]
    argv += ["--eval_data_path", "sample", "--logging_steps", "2", "--export_hf", "false"]
    argv += ["--report_to", "none", "--progress", "false", "--save_steps", "2"]
    out = str(tmp_path / "run")
    summary = run(parse_args([*argv, "--output_dir", out, "--eval_on_start", "true"]))
    assert [e["step"] for e in summary["eval"]] == [0, 2, 4]
    with open(tmp_path / "run" / "log.jsonl") as f:
        assert [r["step"] for r in map(json.loads, f) if "eval_loss" in r] == [0, 2, 4]
    # A run whose steps change nothing (learning rate 0) evaluates the same loss later.
    frozen = ["--learning_rate", "0", "--save_strategy", "no", "--weight_decay", "0"]
    untrained = run(parse_args([*argv, *frozen, "--output_dir", str(tmp_path / "frozen")]))
    assert summary["eval"][0]["eval_loss"] == pytest.approx(untrained["eval"][0]["eval_loss"])
    assert summary["eval"][1]["eval_loss"] != summary["eval"][0]["eval_loss"]
    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["2", "4"]
    shutil.rmtree(checkpoints / "4")
    resumed = [*argv, "--output_dir", out, "--eval_on_start", "true"]
    again = run(parse_args([*resumed, "--resume_from_checkpoint", "latest"]))
    assert [e["step"] for e in again["eval"]] == [4]
    with pytest.raises(ValueError, match=r"^--eval_on_start needs --eval_data_path"):
        parse_args(["--eval_on_start", "true"])
    with pytest.raises(ValueError, match=r"--eval_on_start evaluates, which --eval_strategy no"):
        parse_args(["--eval_on_start", "true", "--eval_data_path", "x", "--eval_strategy", "no"])


def test_intervals_below_1_are_a_fraction_of_the_run_as_hf(tmp_path, capsys):
    """HF reads --logging_steps, --save_steps and --eval_steps below 1 as a fraction of
    the run's steps, rounded up: 0.25, 0.5 and 0.3 of 8 steps log every 2, save every 4
    and evaluate every 3 (and at the end), and one line says so. A fraction above 1 is
    refused by name, as is a word."""
    argv = ["--model_name_or_path", "tiny", "--data_path", "sample", "--max_steps", "8"]
    argv += ["--model_max_length", "64", "--mesh", "data=1,fsdp=-1,seq=1", "--attention", "xla"]
    argv += ["--eval_data_path", "sample", "--logging_steps", "0.25", "--save_steps", "0.5"]
    argv += ["--eval_steps", "0.3", "--export_hf", "false", "--report_to", "none"]
    argv += ["--progress", "false", "--output_dir", str(tmp_path / "run")]
    summary = run(parse_args(argv))
    assert [e["step"] for e in summary["eval"]] == [3, 6, 8]
    assert sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir()) == [4, 8]
    log = (tmp_path / "run" / "log.jsonl").read_text().splitlines()
    logged = [json.loads(line)["step"] for line in log if '"loss"' in line]
    assert logged == [2, 4, 6, 8]
    out = capsys.readouterr().out
    assert (
        "of the run's 8 steps, --logging_steps 0.25: every 2 steps; --save_steps 0.5: every "
        "4 steps; --eval_steps 0.3: every 3 steps\n" in out
    )
    assert parse_args(["--save_steps", "3.0"]).run.save_steps == 3
    for flag, value, error in (
        ("--save_steps", "2.5", "--save_steps=2.5 must be a whole number of steps, or below 1"),
        ("--logging_steps", "0", "--logging_steps=0 must be positive"),
        ("--eval_steps", "nan", "--eval_steps=nan must be a whole number of steps"),
    ):
        with pytest.raises(ValueError, match=re.escape(error)):
            parse_args([flag, value])
    with pytest.raises(SystemExit):
        parse_args(["--save_steps", "often"])
    assert "expected a number of steps (or below 1 a fraction of the run's), got 'often'" in (
        capsys.readouterr().err
    )


def test_a_resume_on_other_evaluation_data_says_so(tmp_path, capsys):
    """The eval_loss series of a resumed run continues the checkpoint's: a resume with
    another --eval_data_path (or none) gets a warning line naming the step where the
    series changes data; the same data resumes without one."""
    rng = np.random.default_rng(0)
    for name in ("a.jsonl", "b.jsonl"):
        rows = [rng.integers(3, 500, size=64).tolist() for _ in range(4)]
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["--model_name_or_path", "tiny", "--data_path", "sample", "--max_steps", "4"]
    argv += ["--model_max_length", "64", "--mesh", "data=1,fsdp=-1,seq=1", "--attention", "xla"]
    argv += ["--save_steps", "2", "--export_hf", "false", "--report_to", "none"]
    argv += ["--progress", "false"]
    first = ["--eval_data_path", str(tmp_path / "a.jsonl"), "--output_dir", str(tmp_path / "r")]
    run(parse_args([*argv, *first]))
    resume = ["--resume_from_checkpoint", str(tmp_path / "r" / "checkpoints" / "2")]
    capsys.readouterr()
    for i, (data, said) in enumerate(
        [
            ("a.jsonl", None),
            ("b.jsonl", "evaluated on its --eval_data_path, this one on other data"),
            (None, "evaluated on its --eval_data_path, this one evaluates on nothing"),
        ]
    ):
        other = ["--eval_data_path", str(tmp_path / data)] if data else []
        run(parse_args([*argv, *resume, *other, "--output_dir", str(tmp_path / f"b{i}")]))
        warned = [x for x in capsys.readouterr().out.splitlines() if x.startswith("warning:")]
        assert warned == (
            [f"warning: checkpoint 2's run {said}: the eval_loss series changes data after step 2"]
            if said
            else []
        )
