"""`python -m train.tools.capacity plot`: capacity probes' GiB against the context, per remat
policy, from the JSON that `python -m train.tools.capacity --out` writes (or a list of them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from train.tools import capacity

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _result(model: str, remat: str, probes: list[tuple[int, float, float, bool]]) -> dict:
    """A capacity result as `capacity.main` writes it, with the given probes."""
    rows = [{"seq": s, "fits": ok, "gib": g, "host_gib": h} for s, g, h, ok in probes]
    rows.append({"seq": 2 * probes[-1][0], "fits": False, "gib": None, "host_gib": None})
    return {
        "device": "NVIDIA H200",
        "devices": 1,
        "limit_gib": 130.0,
        "host_limit_gib": 112.0,
        "settings": {"remat": remat, "mlp_tile": -1, "optimizer_offload": True},
        "rows": [{"model": model, "mesh": "seq=1", "longest": None, "probes": rows}],
    }


K = 1024
SAVE = _result(
    "llama3.2-1b", "save_attn", [(128 * K, 60.0, 9.0, True), (256 * K, 150.0, 9.0, False)]
)
OFFLOAD = _result(
    "llama3.2-1b",
    "offload_attn",
    [(128 * K, 20.0, 25.0, True), (256 * K, 30.0, 41.0, True), (512 * K, 50.0, 73.0, True)],
)


def _png_ok(path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_of_one_result_per_file_and_of_a_gathered_list(tmp_path):
    """Two policies (one probe that does not fit, one that did not compile), as two
    result files and as benchmarks/long_context.sh's gathered list."""
    one, two, both = tmp_path / "save.json", tmp_path / "offload.json", tmp_path / "all.json"
    one.write_text(json.dumps(SAVE))
    two.write_text(json.dumps(OFFLOAD))
    both.write_text(json.dumps([SAVE, OFFLOAD, _result("tiny", "full", [(512, 0.1, 0.0, True)])]))
    for paths, name in (([one, two], "two.png"), ([both], "list.png")):
        out = tmp_path / "plots" / name
        assert capacity.main_plot([*map(str, paths), "--out", str(out)]) == str(out)
        _png_ok(out)


def test_measured_peaks_from_run_directories(tmp_path, capsys):
    """A run's peak (log.jsonl) at its context and policy (train_config.yaml); a run
    whose device reported no peak is named and left out."""
    result = tmp_path / "capacity.json"
    result.write_text(json.dumps([SAVE, OFFLOAD]))
    runs = []
    for name, peak in (("gpu-run", 45.0), ("cpu-run", None)):
        run = tmp_path / name
        run.mkdir()
        (run / "train_config.yaml").write_text(
            "model:\n  model_name_or_path: llama3.2-1b\n  remat_policy: offload_attn\n"
            "data:\n  model_max_length: 524288\n"
        )
        record = {"step": 1, "loss": 10.0} | ({"peak_memory_gib": peak} if peak else {})
        (run / "log.jsonl").write_text(json.dumps(record) + "\n")
        runs.append(run)
    assert capacity.load_measured(str(runs[0] / "log.jsonl"))["seq"] == 512 * K
    out = tmp_path / "measured.png"
    capacity.main_plot([str(result), "--measured", *map(str, runs), "--out", str(out)])
    _png_ok(out)
    printed = capsys.readouterr().out
    assert "cpu-run/log.jsonl: no peak_memory_gib" in printed and "gpu-run" not in printed


def test_bad_inputs_are_refused_in_one_line_naming_the_file(tmp_path):
    missing = tmp_path / "missing.json"
    not_json = tmp_path / "garbage.json"
    not_json.write_text("{not json")
    no_probes = tmp_path / "no_probes.json"
    no_probes.write_text(json.dumps({"device": "x", "rows": [{"model": "tiny"}]}))
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    nothing_compiled = tmp_path / "failed.json"
    failed = _result("tiny", "save_attn", [(512, 0.1, 0.0, True)])
    failed["rows"][0]["probes"] = failed["rows"][0]["probes"][1:]  # only the failed compile
    nothing_compiled.write_text(json.dumps(failed))
    out = str(tmp_path / "never.png")
    for argv, match in (
        ([str(missing)], f"{missing}: no such file"),
        ([str(not_json)], f"{not_json}: not a capacity result JSON"),
        ([str(no_probes)], f"{no_probes}: not a capacity result (no rows with probes"),
        ([str(empty)], f"{empty}: not a capacity result"),
        ([str(nothing_compiled)], f"{nothing_compiled}: no probe compiled"),
        ([str(missing), "--measured", str(tmp_path)], f"{missing}: no such file"),
    ):
        with pytest.raises(SystemExit) as e:
            capacity.main_plot([*argv, "--out", out])
        message = str(e.value.code)
        assert message.startswith(f"error: {match}") and "\n" not in message, message
    ok = tmp_path / "ok.json"
    ok.write_text(json.dumps(SAVE))
    with pytest.raises(SystemExit, match=f"^error: --measured {tmp_path}: no {tmp_path}/log"):
        capacity.main_plot([str(ok), "--measured", str(tmp_path), "--out", out])
    assert not (tmp_path / "never.png").exists()


def test_command_line_plot_subcommand(tmp_path):
    """`python -m train.tools.capacity plot`: the PNG, or one line on stderr (exit 1)."""
    result = tmp_path / "capacity.json"
    result.write_text(json.dumps(SAVE))
    out = tmp_path / "memory.png"
    command = [sys.executable, "-m", "train.tools.capacity", "plot", str(result), "--out", str(out)]
    command.append("--overwrite")  # the second run's out is the first's
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    run = dict(cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    done = subprocess.run(command, **run)
    assert done.returncode == 0, done.stderr
    assert f"wrote {out}" in done.stdout
    _png_ok(out)
    command[4] = str(tmp_path / "nope.json")
    done = subprocess.run(command, **run)
    assert (
        done.returncode == 1 and done.stderr.strip() == f"error: {tmp_path}/nope.json: no such file"
    )


def test_tick_labels():
    labels = [capacity._tokens_label(n) for n in (512, 1024, 128 * K, 1 << 20, 2 << 20, 1500)]
    assert labels == ["512", "1k", "128k", "1M", "2M", "1500"]


def _spy_scatter(monkeypatch) -> list:
    """Records each `Axes.scatter` call as `(x, y, marker)` (and still draws it)."""
    import matplotlib.axes

    calls = []
    real = matplotlib.axes.Axes.scatter

    def spy(self, x, y, *args, **kwargs):
        calls.append((list(x), list(y), kwargs.get("marker")))
        return real(self, x, y, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "scatter", spy)
    return calls


def test_probe_that_did_not_compile_is_drawn_on_the_device_limit(tmp_path, monkeypatch):
    """A probe that ran out of memory while compiling has no size; the plot marks it on
    the device limit instead of leaving the series to end silently."""
    calls = _spy_scatter(monkeypatch)
    path = tmp_path / "offload.json"
    path.write_text(json.dumps(OFFLOAD))
    capacity.main_plot([str(path), "--out", str(tmp_path / "p.png")])
    assert ([1024 * K], [130.0], "x") in calls


def test_search_that_reached_max_is_marked_on_the_plot(tmp_path, monkeypatch):
    """A row whose every probe fit up to --max gets a > on its longest probe (a lower
    bound), with a legend entry: from the JSON field, or from the probes where it is absent."""
    calls = _spy_scatter(monkeypatch)
    capped = json.loads(json.dumps(OFFLOAD))
    row = capped["rows"][0]
    row["probes"] = row["probes"][:-1]  # no probe past the last that fit
    row["longest"] = 512 * K
    for field in ({"capped_by_max": True}, {}):
        path = tmp_path / "capped.json"
        path.write_text(json.dumps({**capped, "rows": [{**row, **field}]}))
        calls.clear()
        capacity.main_plot([str(path), "--out", str(tmp_path / "p.png"), "--overwrite"])
        assert [c for c in calls if c[2] == ">"] == [([512 * K], [50.0], ">")], field
    calls.clear()
    (tmp_path / "save.json").write_text(json.dumps(SAVE))
    capacity.main_plot(
        [str(tmp_path / "save.json"), "--out", str(tmp_path / "p.png"), "--overwrite"]
    )
    assert not [c for c in calls if c[2] == ">"]


def test_plot_out_that_is_a_directory_is_refused(tmp_path, capsys):
    result = tmp_path / "capacity.json"
    result.write_text(json.dumps(SAVE))
    with pytest.raises(SystemExit) as e:
        capacity.main_plot([str(result), "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"--out {tmp_path} is a directory; give a file path for" in err


def test_plot_that_cannot_be_written_is_one_line_naming_the_flag(tmp_path, monkeypatch):
    """A write that fails (a full disk) ends in one line naming --out and the file, and
    leaves neither the PNG nor its temporary file."""
    import matplotlib.figure

    def full(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    result = tmp_path / "capacity.json"
    result.write_text(json.dumps(SAVE))
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full)
    out = tmp_path / "p.png"
    with pytest.raises(SystemExit) as e:
        capacity.main_plot([str(result), "--out", str(out)])
    assert str(e.value) == f"error: --out: cannot write {out} (No space left on device)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["capacity.json"]


def test_unfinished_search_is_said_and_labelled(tmp_path, capsys, monkeypatch):
    """The `--out.partial` of a search still running (or stopped) is drawn as far as it
    got, with a line saying so and its lines labelled unfinished in the legend."""
    labels = []
    import matplotlib.axes

    plot = matplotlib.axes.Axes.plot
    monkeypatch.setattr(
        matplotlib.axes.Axes,
        "plot",
        lambda self, *a, **k: labels.append(k.get("label")) or plot(self, *a, **k),
    )
    partial = json.loads(json.dumps(OFFLOAD))
    done = json.loads(json.dumps(partial["rows"][0]))
    partial["rows"][0]["incomplete"] = True
    partial["rows"].insert(0, {**done, "model": "tiny"})  # finished before it: not labelled
    path = tmp_path / "capacity.json.partial"
    path.write_text(json.dumps(partial))
    capacity.main_plot([str(path), "--out", str(tmp_path / "p.png")])
    out = capsys.readouterr().out
    assert f"note: {path}: an unfinished search" in out
    assert "llama3.2-1b on seq=1 is drawn as far as it got" in out
    assert labels.count("offload_attn (unfinished) device") == 1
    assert labels.count("offload_attn device") == 1  # tiny's panel
    labels.clear()
    (tmp_path / "done.json").write_text(json.dumps(OFFLOAD))
    capacity.main_plot(
        [str(tmp_path / "done.json"), "--out", str(tmp_path / "p.png"), "--overwrite"]
    )
    assert "note:" not in capsys.readouterr().out and "offload_attn device" in labels
