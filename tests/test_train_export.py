"""`python -m train.tools.export`: any saved checkpoint of a run as an HF directory, the
one the run's own end-of-run export (`hf/`) is for the same step; refusals in one line
that write nothing."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
from conftest import ON_GPU

import models
from models.safetensors_io import SafetensorsFile
from train import data as data_lib
from train.config import parse_args
from train.loop import run
from train.tools import export

REPO = Path(__file__).resolve().parent.parent


def _argv(out: Path, tokenizer: Path, max_steps: int) -> list[str]:
    return [
        "--model_name_or_path",
        "tiny",
        "--data_path",
        "sample",
        "--tokenizer_name_or_path",
        str(tokenizer),
        "--model_max_length",
        "64",
        "--sample_num_examples",
        "24",
        "--mesh",
        "data=1,fsdp=-1,seq=1",  # parameters sharded over 8 devices; the export has one
        "--attention",
        "xla",
        "--max_steps",
        str(max_steps),
        "--save_steps",
        "2",
        # A schedule that does not depend on the run's length: steps 1-2 of a 4-step run
        # are those of a 2-step run.
        "--lr_scheduler_type",
        "constant",
        "--learning_rate",
        "1e-3",
        "--report_to",
        "none",
        "--progress",
        "false",
        "--output_dir",
        str(out),
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A 4-step run saving steps 2 and 4 and a 2-step run, alike but for their length,
    with a BPE tokenizer whose EOS (0) is not the preset's (2)."""
    pytest.importorskip("tokenizers")
    root = tmp_path_factory.mktemp("export")
    corpus = root / "corpus.txt"
    corpus.write_text((REPO / "docs" / "trainer.md").read_text())
    data_lib.train_tokenizer([corpus], root / "tok", vocab_size=300)
    run(parse_args(_argv(root / "long", root / "tok", 4)))
    run(parse_args(_argv(root / "short", root / "tok", 2)))
    return {"long": root / "long", "short": root / "short", "root": root}


def _tensors(directory: Path) -> dict[str, np.ndarray]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update({k: np.array(v) for k, v in SafetensorsFile(str(file)).items()})
    return tensors


def _same_hf(a: Path, b: Path, exact: bool = True) -> None:
    """The two HF directories hold the same files, configs and tokenizer byte for byte,
    tensors bitwise (`exact`) or, two runs' weights on a GPU (whose reductions are not
    deterministic), within a tenth of one update at the runs' rate (1e-3): a gradient
    near 0 that differs in its last bits moves Adam's step most (7.5e-6 seen on an H100)."""
    assert sorted(os.listdir(a)) == sorted(os.listdir(b))
    for name in os.listdir(a):
        if not name.endswith(".safetensors"):
            assert (a / name).read_bytes() == (b / name).read_bytes(), name
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys() and ta
    for key in ta:
        assert ta[key].dtype == tb[key].dtype, key
        if exact:
            assert np.array_equal(ta[key].view(np.uint8), tb[key].view(np.uint8)), key
        else:
            np.testing.assert_allclose(ta[key], tb[key], rtol=0, atol=1e-4, err_msg=key)


def _snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    """Every file under `directory` with its size and modification time."""
    return {
        str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in directory.rglob("*")
    }


def test_latest_is_the_runs_own_hf(runs, tmp_path, capsys):
    long = runs["long"]
    before = _snapshot(long)
    assert export.main([str(long), "--out", str(tmp_path / "hf")]) == 0
    assert capsys.readouterr().out.startswith(f"exported checkpoint 4 of {long} -> ")
    _same_hf(tmp_path / "hf", long / "hf")
    # The run's EOS (the tokenizer's), not the preset's; the tokenizer goes along.
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["eos_token_id"] == 0 != models.preset("tiny").eos_token_id
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    assert _snapshot(long) == before  # the run is only read
    # --step 4 is the same checkpoint.
    assert export.main([str(long), "--out", str(tmp_path / "four"), "--step", "4"]) == 0
    _same_hf(tmp_path / "four", long / "hf")


def test_the_exports_carry_the_tokenizer_the_run_read(runs, tmp_path):
    """The run keeps its tokenizer as it read it (tokenizer/ in its directory), and
    train.tools.export carries that copy, EOS included: the tokenizer edited, then moved
    away since the run, changes nothing in the export."""
    long, tok = runs["long"], runs["root"] / "tok"
    read = {p.name: p.read_bytes() for p in tok.iterdir() if p.is_file()}
    assert "tokenizer.json" in read
    copy = long / "tokenizer"
    assert {p.name: p.read_bytes() for p in copy.iterdir()} == read
    moved = tok.with_name("tok.moved")
    edited = tok / "tokenizer.json"
    edited.write_bytes(read["tokenizer.json"] + b"\n")
    try:
        assert export.main([str(long), "--out", str(tmp_path / "edited")]) == 0
        os.rename(tok, moved)
        assert export.main([str(long), "--out", str(tmp_path / "moved")]) == 0
    finally:
        if moved.exists():
            os.rename(moved, tok)
        edited.write_bytes(read["tokenizer.json"])
    for out in ("edited", "moved"):
        _same_hf(tmp_path / out, long / "hf")
        assert (tmp_path / out / "tokenizer.json").read_bytes() == read["tokenizer.json"]
        config = json.loads((tmp_path / out / "config.json").read_text())
        assert config["eos_token_id"] == 0, out


def test_the_export_reads_the_model_config_the_run_built(runs, tmp_path):
    """A run from an HF directory keeps its model's config.json as it built the model
    (model_config.json in its directory), and train.tools.export reads that copy: the
    input model's config.json edited (another rope_theta), then the model moved away
    since the run, changes nothing in the export."""
    import jax

    root = runs["root"]
    model = tmp_path / "model"
    config = models.preset("tiny")
    params = models.init_params(config, jax.random.key(0))
    models.export_hf(jax.tree.map(np.asarray, params), config, str(model))
    argv = _argv(tmp_path / "run", root / "tok", 2)
    argv[argv.index("tiny")] = str(model)
    run(parse_args(argv))
    built = tmp_path / "run" / "model_config.json"
    assert models.from_hf_config(json.loads(built.read_text())) == config
    source = model / "config.json"
    original = source.read_text()
    edited = json.loads(original)
    edited["rope_theta"] = 2 * edited["rope_theta"]
    source.write_text(json.dumps(edited))
    assert export.main([str(tmp_path / "run"), "--out", str(tmp_path / "edited")]) == 0
    os.rename(model, tmp_path / "moved")
    assert export.main([str(tmp_path / "run"), "--out", str(tmp_path / "gone")]) == 0
    for out in ("edited", "gone"):
        _same_hf(tmp_path / out, tmp_path / "run" / "hf")


def test_an_earlier_step_is_the_hf_of_a_run_stopped_there(runs, tmp_path):
    """Step 2 of the 4-step run exported is the 2-step run's export: bitwise on a CPU;
    on a GPU, whose reductions are not deterministic without XLA's flag, two runs'
    weights differ in their last bits (`_same_hf`)."""
    out = tmp_path / "two"
    assert export.main([str(runs["long"]), "--out", str(out), "--step", "2"]) == 0
    _same_hf(out, runs["short"] / "hf", exact=not ON_GPU)
    two, four = _tensors(out), _tensors(runs["long"] / "hf")
    assert any(not np.array_equal(two[k], four[k]) for k in two)  # it trained on
    config, params = models.load_hf(str(out))
    assert config.eos_token_id == 0
    np.testing.assert_array_equal(params["embed"]["embedding"], two["model.embed_tokens.weight"])


def test_dtype_and_shards(runs, tmp_path):
    out = tmp_path / "bf16"
    argv = [str(runs["long"]), "--out", str(out), "--dtype", "bfloat16", "--max-shard-gb", "1e-4"]
    assert export.main(argv) == 0
    assert (out / "model.safetensors.index.json").is_file()
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    ref = _tensors(runs["long"] / "hf")
    got = _tensors(out)
    for key in ref:
        np.testing.assert_array_equal(got[key], ref[key].astype(got[key].dtype))
        assert got[key].dtype.name == "bfloat16"


def test_overwrite_replaces_the_model_in_out(runs, tmp_path):
    out = tmp_path / "out"
    assert export.main([str(runs["long"]), "--out", str(out), "--step", "2"]) == 0
    (out / "tokenizer.model").write_text("another model's")  # not the run's: dropped
    (out / "additional_chat_templates").mkdir()  # nor its named chat template
    (out / "additional_chat_templates" / "tool_use.jinja").write_text("another model's")
    (out / "notes.txt").write_text("mine")  # not a model's file: kept
    assert export.main([str(runs["long"]), "--out", str(out), "--overwrite"]) == 0
    assert (out / "notes.txt").read_text() == "mine"
    (out / "notes.txt").unlink()
    _same_hf(out, runs["long"] / "hf")


def test_an_overwrite_cut_off_leaves_the_model_that_was_there(runs, tmp_path, monkeypatch):
    """--overwrite writes the whole export into a staging folder in --out before it
    replaces anything: an export stopped while writing leaves the model that was there
    whole (its config.json, tokenizer and weights), and a staging folder that a killed
    export left behind is removed by the next one, which a fresh --out then takes
    without --overwrite (nothing of a model is in it)."""
    out = tmp_path / "out"
    assert export.main([str(runs["long"]), "--out", str(out), "--step", "2"]) == 0
    before = _snapshot(out)
    real = export.models.export_hf

    def stopped(params, config, path, **kwargs):
        real(params, config, path, **kwargs)  # written whole in the staging folder
        raise KeyboardInterrupt

    monkeypatch.setattr(export.models, "export_hf", stopped)
    with pytest.raises(SystemExit) as e:
        export.main([str(runs["long"]), "--out", str(out), "--overwrite"])
    assert e.value.code == 130
    assert _snapshot(out) == before  # no staging folder either
    monkeypatch.setattr(export.models, "export_hf", real)
    fresh = tmp_path / "fresh"
    (fresh / f"{export.STAGING}1234abcd").mkdir(parents=True)  # a SIGKILL's leftovers
    (fresh / f"{export.STAGING}1234abcd" / "tokenizer.json").write_text("partial")
    assert export.main([str(runs["long"]), "--out", str(fresh)]) == 0
    assert not [p for p in fresh.iterdir() if p.name.startswith(export.STAGING)]
    _same_hf(fresh, runs["long"] / "hf")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_ends_an_export_in_one_line_leaving_out_as_it_was(
    runs, tmp_path, monkeypatch, capsys, signum, sighup_as_a_shell_gives_it
):
    """SIGTERM (a scheduler) or SIGHUP (a closed terminal) while the export is written
    ends it as Ctrl-C does: its staging folder is removed, --out keeps what it held,
    and one line says so, with the signal's exit status (128 + its number)."""
    out = tmp_path / "out"
    real = export.models.export_hf
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)

    def killed(params, config, path, **kwargs):
        real(params, config, path, **kwargs)
        os.kill(os.getpid(), signum)  # Python runs the handler at its next bytecode
        raise AssertionError("the signal did not stop the export")

    monkeypatch.setattr(export.models, "export_hf", killed)
    with pytest.raises(SystemExit) as e:
        export.main([str(runs["long"]), "--out", str(out)])
    assert e.value.code == 128 + signum
    how = {signal.SIGTERM: "terminated (SIGTERM)", signal.SIGHUP: "hung up (SIGHUP)"}[signum]
    assert capsys.readouterr().err == (
        f"{how}: the export was not finished; nothing was exported to {out}\n"
    )
    assert list(out.iterdir()) == []
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)) == handlers
    monkeypatch.setattr(export.models, "export_hf", real)
    assert export.main([str(runs["long"]), "--out", str(out), "--step", "2"]) == 0
    before = _snapshot(out)
    monkeypatch.setattr(export.models, "export_hf", killed)
    with pytest.raises(SystemExit):
        export.main([str(runs["long"]), "--out", str(out), "--overwrite"])
    assert capsys.readouterr().err.endswith(f"; {out} holds the model it held before\n")
    assert _snapshot(out) == before


def _refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit:
        export.main(argv)
    assert exit.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    return lines[0]


def test_refusals_write_nothing(runs, tmp_path, capsys):
    long = runs["long"]
    before = _snapshot(long)
    out = tmp_path / "new"
    line = _refused([str(long), "--out", str(out), "--step", "3"], capsys)
    assert line.endswith(
        f"--step='3': no such checkpoint in {long}/checkpoints; it has 2, 4 (or latest)"
    )
    assert "not a run's --output_dir: it has no train_config.yaml" in _refused(
        [str(tmp_path), "--out", str(out)], capsys
    )
    line = _refused([str(long), "--out", str(long / "checkpoints" / "hf")], capsys)
    assert f"lies in the run's {long}/checkpoints" in line
    assert "lies in the run's" in _refused([str(long), "--out", str(long / "hf")], capsys)
    assert _refused([str(long), "--out", ""], capsys).endswith(
        "--out='' is empty: give the directory to write"
    )
    line = _refused([str(long), "--out", str(long)], capsys)
    assert line.endswith(
        f"is the run directory itself ({str(long)!r}), which the export only reads"
    )
    assert "invalid choice: 'int8'" in _refused(
        [str(long), "--out", str(out), "--dtype", "int8"], capsys
    )
    assert not out.exists()
    # An --out that holds a model: its files stay as they were.
    held = tmp_path / "held"
    held.mkdir()
    (held / "config.json").write_text("{}")
    (held / "model-00001-of-00002.safetensors").write_text("old")
    kept = _snapshot(held)
    line = _refused([str(long), "--out", str(held)], capsys)
    assert line == (
        f"error: --out={str(held)!r} already holds config.json, "
        "model-00001-of-00002.safetensors, which the export would replace: pass "
        "--overwrite to replace them, or choose another directory"
    )
    assert _snapshot(held) == kept
    # Another run's output directory: its checkpoints are no place for a model.
    other = runs["short"]
    other_before = _snapshot(other)
    for flags in ([], ["--overwrite"]):
        assert _refused([str(long), "--out", str(other), *flags], capsys).endswith(
            f"--out={str(other)!r} is another training run's output directory: give a "
            "directory of its own for the export"
        )
    assert _snapshot(other) == other_before
    assert _snapshot(long) == before


def test_a_run_without_checkpoints_or_a_damaged_one(runs, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(runs["long"] / "train_config.yaml", bare)
    line = _refused([str(bare), "--out", str(tmp_path / "x")], capsys)
    assert line == f"error: RUN_DIR={str(bare)!r} has no checkpoints/ (the run saved none)"
    damaged = tmp_path / "damaged"
    shutil.copytree(runs["long"], damaged)
    state = damaged / "checkpoints" / "4" / "state"
    for part in state.iterdir():
        if part.is_dir() and part.name != "array_metadatas":
            shutil.rmtree(part)
    line = _refused([str(damaged), "--out", str(tmp_path / "x")], capsys)
    assert line.startswith(f"error: checkpoint {damaged}/checkpoints/4 could not be restored")
    assert line.endswith("; an earlier one: --step 2")
    assert not (tmp_path / "x").exists()


def test_a_write_that_fails_names_the_flag_and_the_file(runs, tmp_path, monkeypatch, capsys):
    """An OSError while writing (a file size limit, a full disk) is one line naming
    --out and the file, exit status 1, not the bare `[Errno 27] File too large`."""
    out = tmp_path / "big"

    def too_large(*args, **kwargs):
        raise OSError(27, "File too large")

    monkeypatch.setattr(export.models, "export_hf", too_large)
    with pytest.raises(SystemExit) as e:
        export.main([str(runs["long"]), "--out", str(out)])
    assert e.value.code == 1
    assert capsys.readouterr().err == f"error: --out: cannot write {out} (File too large)\n"


def test_the_shared_modules_say_they_are_no_command():
    """`python -m train.tools.hlo` (or roofline, report, files) exits 1 with one line
    naming the commands, not 0 with nothing done."""
    import subprocess
    import sys

    from train.tools import COMMANDS

    done = subprocess.run(
        [sys.executable, "-m", "train.tools.roofline", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("error: train.tools.roofline is a module the tools share")
    assert all(f"train.tools.{c}" in done.stderr for c in COMMANDS)


def test_the_exports_generation_config_stops_on_the_trained_eos(tmp_path):
    """A model directory's generation_config.json (what transformers' `generate` stops
    on) goes with the export holding the export's EOS ids, the one trained with first,
    and the stop tokens it listed after them (a base model's config.json naming one EOS
    beside an Instruct tokenizer's list: `<|eom_id|>` and `<|end_of_text|>` still stop
    it); its other settings are kept."""
    from train.outputs import copy_tokenizer

    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")
    (tokenizer / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [128001, 128008, 128009], "top_p": 0.9})
    )
    for eos, expected in (
        (128009, [128009, 128001, 128008]),
        ((128001, 7), [128001, 7, 128008, 128009]),
    ):
        (tmp_path / "hf").mkdir(exist_ok=True)
        copy_tokenizer(str(tokenizer), str(tmp_path / "hf"), eos_token_id=eos)
        written = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
        assert written == {"eos_token_id": expected, "top_p": 0.9}
    from models.convert import main as convert_main

    model = tmp_path / "model"
    convert_main(["--init", "tiny", "--out", str(model)])
    settings = {"eos_token_id": 2, "temperature": 0.6, "do_sample": True}
    (model / "generation_config.json").write_text(json.dumps(settings))
    out = tmp_path / "run"
    argv = ["--model_name_or_path", str(model), "--data_path", "sample", "--max_steps", "1"]
    argv += ["--model_max_length", "32", "--eos_token_id", "5", "--save_strategy", "no"]
    run(parse_args([*argv, "--report_to", "none", "--output_dir", str(out)]))
    config = json.loads((out / "hf" / "config.json").read_text())
    generation = json.loads((out / "hf" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [5, 2]  # the trained one first, the file's kept
    assert config["eos_token_id"] in (5, [5, 2]), config["eos_token_id"]
    assert {k: generation[k] for k in ("temperature", "do_sample")} == {
        "temperature": 0.6,
        "do_sample": True,
    }
    assert json.loads((model / "generation_config.json").read_text()) == settings  # untouched
