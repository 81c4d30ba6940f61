"""`python -m train.tools.capacity`: the trainer's step compiled on abstract state, longest fit."""

from __future__ import annotations

import json

import jax
import pytest
from conftest import ON_GPU

import models
from train.tools import capacity


@pytest.mark.multi_device(2)
@pytest.mark.slow
def test_two_devices_hold_a_longer_context(tmp_path):
    """On 2 simulated devices with a tight limit, seq=2 fits a longer context than seq=1:
    the trainer's real step (ring attention, remat, sharded state) is what is compiled.
    The limit (0.03 GiB: seq=1 needs 0.020 at 512 and 0.035 at 1,024; seq=2 0.021 at
    1,024 and 0.038 at 2,048) keeps it to five compilations."""
    out = tmp_path / "capacity.json"
    result = capacity.main(
        [
            "--models", "tiny", "--mesh", "seq=1", "--mesh", "seq=2", "--limit-gib", "0.03",
            "--start", "512", "--refine", "0", "--out", str(out),
        ]
    )  # fmt: skip
    one, two = result["rows"]
    assert (one["mesh"], two["mesh"]) == ("seq=1", "seq=2")
    assert one["longest"] >= 512 and two["longest"] >= 2 * one["longest"]
    assert two["vs_first_mesh"] == two["longest"] / one["longest"]
    for row in result["rows"]:  # the probe past the answer is the one that did not fit
        assert row["probes"][-1]["fits"] is False and row["probes"][-1]["gib"] > 0.03
    saved = json.loads(out.read_text())
    assert saved["method"].startswith("compiled memory analysis")
    assert saved["settings"]["shard_over_seq"] is False
    assert saved["settings"]["remat"] == "save_attn"


def test_each_flag_reaches_the_trainer_settings_of_a_probe():
    """The probe's trainer flags are the tool's: the defaults are the trainer's own, and
    --unroll-layers plans the unrolled step (`scan_layers: false`, as the 32k config)."""
    from train.config import parse_args

    args = capacity.build_parser().parse_args([])
    cfg, trainer = capacity._trainer_config("tiny", 1024, "seq=1", args), parse_args([])
    for name in ("attention", "ring_strategy", "remat_policy", "scan_layers"):
        assert getattr(cfg.model, name) == getattr(trainer.model, name), name
    unrolled = capacity.build_parser().parse_args(["--unroll-layers", "--remat", "full"])
    cfg = capacity._trainer_config("tiny", 1024, "seq=1", unrolled)
    assert cfg.model.scan_layers is False and cfg.model.remat_policy == "full"


def test_context_parsing_and_search():
    assert capacity._tokens("64k") == 65536 and capacity._tokens("1m") == 1 << 20
    best, probes = capacity.search_longest(lambda n: {"fits": n <= 5000}, 1024, 1 << 20, 3, 512)
    assert best == 4608 and [p["seq"] for p in probes][:4] == [1024, 2048, 4096, 8192]


def test_bad_models_and_meshes_are_refused_before_probing(capsys):
    for argv, match in (
        (["--models", "nope"], "--models='nope' is neither"),
        (["--models", "tiny", "--mesh", "seq=x"], "size of 'seq' is not an int: 'x'"),
        (["--models", "tiny", "--mesh", "seq=64"], "needs 64 devices"),
        *[  # the hint where devices can be simulated
            (["--models", "tiny", "--mesh", "seq=64"], "device_count=64 simulates 64)")
            for _ in range(not ON_GPU)
        ],
        (["--models", "tiny", "--gather-once"], "--gather-once needs --shard-over-seq"),
    ):
        with pytest.raises(SystemExit):
            capacity.main([*argv, "--limit-gib", "1"])
        err = capsys.readouterr().err
        assert match in err and "Traceback" not in err, err


def test_bad_sizes_are_refused_before_probing(capsys):
    """A context range, bisection count or memory limit that cannot be searched is
    refused in one line naming the value, not probed into "none from --start"."""
    for argv, match in (
        (["--start", "0", "--max", "1k"], "need 1 <= --start=0 <= --max=1024 tokens"),
        (["--start", "512", "--max", "256"], "need 1 <= --start=512 <= --max=256 tokens"),
        (["--refine", "-1"], "--refine=-1 must be >= 0"),
        (["--start", "abc"], "argument --start: 'abc' is not a number of tokens (e.g. 8192"),
        (["--max", "1.5"], "argument --max: '1.5' is not a whole number of tokens"),
        (["--limit-gib", "-1"], "--limit-gib=-1.0 must be > 0"),
        (["--limit-gib", "1", "--host-limit-gib", "0"], "--host-limit-gib=0.0 must be > 0"),
    ):
        with pytest.raises(SystemExit):
            capacity.main(["--models", "tiny", *argv])
        err = capsys.readouterr().err
        assert match in err and "Traceback" not in err, err


@pytest.mark.slow
def test_long_context_knobs_report_device_and_host_memory(capsys):
    """`--optimizer-offload` moves the optimizer state off the device (host GiB > 0, the
    device GiB lower by as much); the knobs reach the trainer's step and the settings;
    the table has the GiB per 1k tokens columns."""
    common = ["--models", "tiny", "--mesh", "seq=1", "--limit-gib", "1", "--start", "512"]
    common += ["--max", "1024", "--refine", "0", "--host-limit-gib", "1"]
    plain = capacity.main(common)["rows"][0]
    offload = capacity.main([*common, "--optimizer-offload", "--remat", "offload_full"])
    row = offload["rows"][0]
    assert offload["settings"]["optimizer_offload"] is True
    assert offload["settings"]["remat"] == "offload_full"
    moments = 2 * 4 * models.param_count(models.TINY) / 2**30  # two f32 moments
    assert plain["host_gib"] == 0 and row["host_gib"] >= moments
    assert row["gib"] < plain["gib"]
    assert plain["longest"] == 1024 and plain["gib_per_1k"] > 0
    if not ON_GPU:  # offload_full's layer inputs stay where they are
        assert row["host_gib_per_1k"] == 0  # the state does not grow with the context
    else:  # they go to the host, and grow with the context there
        assert row["host_gib_per_1k"] > 0
    table = capsys.readouterr().out
    warning = (
        "warning: --remat offload_full on the cpu backend: its one memory space keeps the "
        "residuals the policy offloads on the device in XLA's plan, so the device GiB below "
        "are full's and the host GiB leave them out; plan offload on a GPU"
    )
    assert (warning in table) == (not ON_GPU)  # said once, not silently planned as offloaded
    assert "| GiB/1k tokens device | GiB/1k tokens host |" in table
    with pytest.raises(SystemExit):  # a tile that does not divide --start's: before probing
        capacity.main([*common, "--mlp-tile", "300"])
    assert capsys.readouterr().err.startswith(
        "error: --mlp-tile=300 does not divide the 512 tokens a device holds of --start=512"
    )


def test_per_1k_tokens_is_the_slope_between_fitting_probes():
    probes = [
        {"seq": 1024, "fits": True, "gib": 3.0},
        {"seq": 4096, "fits": True, "gib": 9.0},
        {"seq": 8192, "fits": False, "gib": 20.0},
    ]
    assert capacity.per_1k_tokens(probes, "gib") == 2.0
    assert capacity.per_1k_tokens(probes[:1], "gib") is None


def test_host_limit_on_gpus_is_xla_pinned_pool(monkeypatch):
    """On GPUs offloaded buffers live in XLA's pinned host pool (64 GiB unless
    XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB says otherwise), shared by the local devices: a
    plan against the machine's whole RAM said a step fits that ran out of the pool."""
    import jax

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "local_device_count", lambda: 2)
    monkeypatch.setattr(capacity.os, "sysconf", lambda name: 1 << 20)  # 1 TiB of RAM
    monkeypatch.delenv(capacity.HOST_POOL_ENV, raising=False)
    assert capacity.host_limit_gib(None) == 32.0
    monkeypatch.setenv(capacity.HOST_POOL_ENV, "112")
    assert capacity.host_limit_gib(None) == 56.0
    assert capacity.host_limit_gib(7.0) == 7.0
    monkeypatch.setenv(capacity.HOST_POOL_ENV, "lots")
    with pytest.raises(SystemExit, match="XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB='lots'"):
        capacity.host_limit_gib(None)


def test_each_probe_is_written_before_the_next(tmp_path, monkeypatch):
    """A run stopped by a timeout mid-search keeps what it probed: `--out.partial` is
    rewritten after every probe, the row marked incomplete with the longest fit so far,
    while a result already at `--out` (replaced with --overwrite) stays whole until the
    search ends; then `--out` holds the new result and the partial file is gone."""
    out = tmp_path / "capacity.json"
    out.write_text('{"rows": "an earlier whole result"}')
    partial = tmp_path / "capacity.json.partial"
    seen = []

    def fake_memory(model, context, mesh, args):
        if seen:  # the previous probe is on disk before this one compiles
            row = json.loads(partial.read_text())["rows"][-1]
            assert row["incomplete"] and [p["seq"] for p in row["probes"]] == seen
            assert row["longest"] == (max(seen) if max(seen) <= 2048 else 2048)
            assert json.loads(out.read_text()) == {"rows": "an earlier whole result"}
        seen.append(context)
        return {"device": context / 1024, "host": 0.0}

    monkeypatch.setattr(capacity, "step_memory_gib", fake_memory)
    argv = ["--models", "tiny", "--mesh", "seq=1", "--limit-gib", "2.5", "--start", "512"]
    result = capacity.main([*argv, "--refine", "0", "--out", str(out), "--overwrite"])
    assert seen == [512, 1024, 2048, 4096]
    final = json.loads(out.read_text())["rows"]
    assert final == result["rows"] and final[0]["longest"] == 2048
    assert "incomplete" not in final[0] and not partial.exists()


def test_out_is_never_a_file_of_a_model_it_reads(tmp_path, monkeypatch, capsys):
    """`--out` naming a file of a model directory given in --models (its config.json)
    is refused before probing, even with --overwrite: the next probe would read the
    result as the model's config. No --models, --attention outside the trainer's: one
    line each."""
    monkeypatch.setattr(capacity, "step_memory_gib", _never_compiled)
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    base = ["--mesh", "seq=1", "--limit-gib", "1", "--start", "512"]
    for argv, match in (
        (
            ["--models", str(model), "--out", str(model / "config.json"), "--overwrite"],
            f"--out {model}/config.json is one of the inputs; give another file for the report",
        ),
        (["--models", ","], "--models=',' names no model"),
        (["--models", "tiny", "--attention", "bogus"], "--attention: invalid choice: 'bogus'"),
    ):
        with pytest.raises(SystemExit) as e:
            capacity.main([*base, *argv])
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert e.value.code == 2 and match in last, last
    assert (model / "config.json").read_text() == "{}"


def _never_compiled(model, context, mesh, args):
    raise AssertionError(f"compiled {model} at {context} on {mesh}")


def test_bad_out_is_refused_before_probing(tmp_path, monkeypatch, capsys):
    """An --out that is a directory or lies under a file is refused in one line naming
    it before anything compiles; a missing parent directory is created."""
    monkeypatch.setattr(capacity, "step_memory_gib", _never_compiled)
    (tmp_path / "afile").write_text("")
    argv = ["--models", "tiny", "--mesh", "seq=1", "--limit-gib", "1", "--start", "512"]
    for out, match in (
        (tmp_path, f"--out {tmp_path} is a directory; give a file path for the report"),
        (tmp_path / "afile" / "c.json", f"{tmp_path}/afile is a file, not a directory"),
    ):
        with pytest.raises(SystemExit) as e:
            capacity.main([*argv, "--out", str(out)])
        last = capsys.readouterr().err.strip().splitlines()[-1]  # after the usage line
        assert e.value.code == 2 and last.endswith(match), last
        assert last.startswith(f"error: --out {out}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]

    monkeypatch.setattr(capacity, "step_memory_gib", lambda *a: {"device": 0.1, "host": 0.0})
    out = tmp_path / "new" / "deep" / "c.json"
    capacity.main([*argv, "--max", "1k", "--refine", "0", "--out", str(out)])
    assert json.loads(out.read_text())["rows"][0]["longest"] == 1024
    assert [p.name for p in out.parent.iterdir()] == ["c.json"]


def test_a_failed_write_keeps_the_earlier_file_and_no_tmp(tmp_path, monkeypatch):
    """Writing --out goes through a .tmp file: when it cannot be written the earlier
    file stays as it was, the .tmp is removed, and the error is one line naming --out."""
    out = tmp_path / "capacity.json"
    out.write_text('{"earlier": true}')
    monkeypatch.setattr(capacity, "step_memory_gib", lambda *a: {"device": 0.1, "host": 0.0})

    def no_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(capacity.os, "replace", no_replace)
    argv = ["--models", "tiny", "--mesh", "seq=1", "--limit-gib", "1", "--start", "512"]
    with pytest.raises(SystemExit) as e:
        capacity.main([*argv, "--max", "1k", "--out", str(out), "--overwrite"])
    assert e.value.code == f"error: --out: cannot write {out}.partial (No space left on device)"
    assert out.read_text() == '{"earlier": true}'
    assert [p.name for p in tmp_path.iterdir()] == ["capacity.json"]


@pytest.mark.multi_device(3)
def test_a_start_the_mesh_cannot_split_is_refused_before_probing(monkeypatch, capsys):
    """seq=3 splits a zigzag ring into 6 chunks: --start=1024 is refused by name, with
    the divisor, instead of a row of "none from --start"."""
    monkeypatch.setattr(capacity, "step_memory_gib", _never_compiled)
    argv = ["--models", "tiny", "--mesh", "seq=1", "--mesh", "seq=3", "--limit-gib", "1"]
    with pytest.raises(SystemExit) as e:
        capacity.main([*argv, "--start", "1k"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    assert (
        "--mesh seq=3: the trainer refuses it at --start=1024: --model_max_length=1024 must be "
        "divisible by 6" in err
    )


@pytest.mark.multi_device(2)
def test_a_mesh_of_fewer_devices_says_how_to_train_it(monkeypatch, capsys):
    """A row planned on some of the devices records how many, and a line under the table
    says that the trainer, whose mesh takes every visible device, trains it where only
    those are visible; a mesh of every device gets no line."""
    monkeypatch.setattr(capacity, "step_memory_gib", lambda *a: {"device": 0.1, "host": 0.0})
    n = jax.device_count()
    argv = ["--models", "tiny", "--mesh", "seq=1", "--mesh", f"seq={n}", "--limit-gib", "1"]
    result = capacity.main([*argv, "--start", "512", "--max", "512"])
    assert [r["devices"] for r in result["rows"]] == [1, n]
    lines = [line for line in capsys.readouterr().out.splitlines() if "visible" in line]
    assert lines == [
        f"--mesh seq=1 plans 1 of the {n} devices (the first ones): `python -m train` takes "
        "every visible device, so make only 1 visible to train it (CUDA_VISIBLE_DEVICES=0 "
        "on GPUs)"
    ]


def test_a_search_that_reaches_max_is_a_lower_bound(monkeypatch, capsys):
    """Every probe up to --max fits: the row is marked (`capped_by_max`, `≥ ... (reached
    --max)` in the table); a search that found a probe too long is not. A row where the
    first probe failed to compile for another reason than memory says why."""
    monkeypatch.setattr(
        capacity, "step_memory_gib", lambda m, n, *a: {"device": n / 1024, "host": 0}
    )
    argv = ["--models", "tiny", "--mesh", "seq=1", "--start", "512", "--max", "2k"]
    capped = capacity.main([*argv, "--limit-gib", "9", "--refine", "0"])["rows"][0]
    assert capped["longest"] == 2048 and capped["capped_by_max"] is True
    assert "| tiny | seq=1 | ring | ≥ 2,048 (reached --max) |" in capsys.readouterr().out
    found = capacity.main([*argv, "--limit-gib", "1.5", "--refine", "0"])["rows"][0]
    assert found["longest"] == 1024 and found["capped_by_max"] is False
    assert "| tiny | seq=1 | ring | 1,024 |" in capsys.readouterr().out
    # A row without the field: read from its probes.
    assert capacity.reached_max({k: v for k, v in capped.items() if k != "capped_by_max"})
    assert not capacity.reached_max({k: v for k, v in found.items() if k != "capped_by_max"})
    error = "mlp_tile=300 must divide the 512 tokens each device holds"
    failed = {"longest": None, "probes": [{"seq": 512, "fits": False, "error": error}]}
    assert capacity.longest_text(failed) == f"none: {error}"
    failed["probes"][0]["error"] = "out of memory at compile time"
    assert capacity.longest_text(failed) == "none from --start"


def test_nothing_is_written_over_and_the_strategy_is_recorded(tmp_path, monkeypatch, capsys):
    """An --out that exists (another result, a run's file, the plot's own input) is
    refused unless --overwrite; a model named twice and a negative --layers are refused;
    the strategy each row ran (--ring-strategy, auto resolved) is in the table and JSON."""
    monkeypatch.setattr(capacity, "step_memory_gib", lambda *a: {"device": 0.1, "host": 0.0})
    out = tmp_path / "capacity.json"
    out.write_text('{"earlier": true}')
    argv = ["--models", "tiny", "--mesh", "seq=1", "--limit-gib", "1", "--start", "512"]
    argv += ["--max", "1k", "--out", str(out)]
    for extra, error in (
        ([], f"--out {out} exists: pass --overwrite to replace it (nothing was written)"),
        (["--models", "tiny,tiny", "--overwrite"], "--models='tiny,tiny' names a model twice"),
        (["--layers", "-1", "--overwrite"], "--layers=-1 must be >= 1"),
    ):
        with pytest.raises(SystemExit):
            capacity.main([*argv, *extra])
        assert capsys.readouterr().err.startswith(f"error: {error}")
        assert out.read_text() == '{"earlier": true}'
    result = capacity.main([*argv, "--overwrite", "--ring-strategy", "allgather"])
    assert result["settings"]["ring_strategy"] == "allgather"
    assert result["rows"][0]["ring_strategy"] == "allgather"
    assert "| tiny | seq=1 | allgather | " in capsys.readouterr().out
    auto = capacity.main([*argv, "--overwrite"])  # seq=1: auto is the ring
    assert (auto["settings"]["ring_strategy"], auto["rows"][0]["ring_strategy"]) == ("auto", "ring")
    for plot_out, error in (
        (out, f"--out {out} is one of the inputs"),
        (tmp_path / "memory.svg", "the plot is a PNG"),
    ):
        with pytest.raises(SystemExit):
            capacity.main_plot([str(out), "--out", str(plot_out), "--overwrite"])
        assert error in capsys.readouterr().err
    assert json.loads(out.read_text())["rows"][0]["model"] == "tiny"


def test_a_stop_mid_search_is_one_line_and_keeps_out(tmp_path, monkeypatch, capsys):
    """Ctrl-C (or SIGTERM) during a probe ends the search with one line saying what it
    left, and the signal's exit status: --out as it was, the rows so far beside it."""
    out = tmp_path / "capacity.json"
    out.write_text('{"rows": "an earlier whole result"}')
    seen = []

    def fake_memory(model, context, mesh, args):
        if seen:
            raise KeyboardInterrupt
        seen.append(context)
        return {"device": context / 1024, "host": 0.0}

    monkeypatch.setattr(capacity, "step_memory_gib", fake_memory)
    argv = ["--models", "tiny", "--mesh", "seq=1", "--limit-gib", "2.5", "--start", "512"]
    with pytest.raises(SystemExit) as e:
        capacity.main([*argv, "--out", str(out), "--overwrite"])
    assert e.value.code == 130
    assert capsys.readouterr().err == (
        f"interrupted: the search was not finished; {out} is as it was, the rows so far "
        f"are in {out}.partial\n"
    )
    assert json.loads(out.read_text()) == {"rows": "an earlier whole result"}
    assert [
        p["seq"]
        for p in json.loads((tmp_path / "capacity.json.partial").read_text())["rows"][0]["probes"]
    ] == [512]


def test_a_row_without_ring_attention_names_no_strategy(monkeypatch, capsys):
    """Only the ring's attention splits by a strategy: with --attention xla a row
    records none, and the table and header say which attention ran."""
    monkeypatch.setattr(capacity, "step_memory_gib", lambda *a: {"device": 0.1, "host": 0.0})
    argv = ["--models", "tiny", "--mesh", "seq=1", "--limit-gib", "1", "--start", "512"]
    result = capacity.main([*argv, "--max", "512", "--attention", "xla"])
    assert result["rows"][0]["ring_strategy"] is None
    out = capsys.readouterr().out
    assert "attention=xla, " in out.splitlines()[0] and "| tiny | seq=1 | – (xla) | " in out
