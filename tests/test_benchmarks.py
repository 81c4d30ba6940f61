"""The benchmark scripts' table, JSON and optional-peer paths on CPU, with fake timings
(`benchmarks/kernel.py`'s main table, `benchmarks/hf_baseline.py`'s stacks), and
`benchmarks/ring.py`'s documents, strategies and cp_model rows on tiny shapes (XLA).
The GPU benchmarks run here with `--interpret`: without it and without a GPU they stop
at once, saying so."""

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import INTERPRET, cpu_devices
from jax import lax

import jflash
import models
from benchmarks import head_split, hf_baseline, kernel


def fake_row(impl, seq, hd, causal, fwd, fwdbwd):
    return dict(
        impl=impl,
        mask="causal" if causal else "full",
        seq_len=seq,
        head_dim=hd,
        fwd_tflops=fwd,
        fwdbwd_tflops=fwdbwd,
    )


def test_add_ratios_per_baseline_shape_and_mask():
    rows = [
        fake_row("jflash_mosaic", 4096, 128, True, 300.0, 330.0),
        fake_row("cudnn", 4096, 128, True, 200.0, 300.0),
        fake_row("fa3", 4096, 128, True, 400.0, 440.0),
        fake_row("jflash_mosaic", 4096, 128, False, 500.0, 100.0),
        fake_row("cudnn", 4096, 128, False, 250.0, 50.0),
        {**fake_row("fa3", 4096, 128, False, 0, 0), "fwd_error": "not installed"},
    ]
    del rows[-1]["fwd_tflops"], rows[-1]["fwdbwd_tflops"]
    kernel.add_ratios(rows)
    causal, full = rows[0], rows[3]
    assert causal["fwd_vs_cudnn"] == pytest.approx(1.5)
    assert causal["fwdbwd_vs_cudnn"] == pytest.approx(1.1)
    assert causal["fwd_vs_fa3"] == pytest.approx(0.75)
    assert causal["fwdbwd_vs_fa3"] == pytest.approx(0.75)
    # Full rows are compared with full rows only; a peer that did not run gives no ratio.
    assert full["fwd_vs_cudnn"] == pytest.approx(2.0)
    assert full["fwdbwd_vs_cudnn"] == pytest.approx(2.0)
    assert "fwd_vs_fa3" not in full
    assert rows[2]["fwd_vs_fa3"] == pytest.approx(1.0)


def test_attention_flops_full_is_twice_causal():
    causal = kernel.attention_flops(1, 32, 4096, 128, causal=True)
    assert causal == 4 * 32 * 4096 * 4096 * 128 / 2
    assert kernel.attention_flops(1, 32, 4096, 128, causal=False) == 2 * causal


def test_main_table_with_fake_timings(monkeypatch, tmp_path, capsys):
    """Every shape × mask × impl is measured (xla skipped past 8k), ratios to cuDNN and
    FA3 land in the printed table and the JSON, and --seqs filters the shapes."""
    calls = []

    def measure(impl, *, seq, head_dim, causal, reference, **_):
        calls.append((impl, seq, head_dim, causal))
        assert isinstance(reference, dict)
        speed = {"jflash_mosaic": 2.0, "cudnn": 1.0, "fa3": 4.0, "xla": 0.5}[impl]
        return fake_row(impl, seq, head_dim, causal, 100 * speed, 50 * speed)

    monkeypatch.setattr(kernel, "measure", measure)
    monkeypatch.setattr(kernel, "SHAPES", [(4096, 128), (16384, 128)])
    monkeypatch.setattr(kernel, "peer_notes", lambda impls: [])
    argv = ["--impls", "jflash_mosaic,cudnn,fa3,xla", "--heat", "0", "--interpret"]
    kernel.main([*argv, "--out", str(tmp_path)])
    assert len(calls) == 2 * 2 * 3 + 2  # shapes × masks × impls, xla at 4k only
    assert {c[3] for c in calls} == {True, False}
    out = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(out) if line.startswith("| impl"))
    for column in ("mask", "fwd_vs_cudnn", "fwdbwd_vs_cudnn", "fwd_vs_fa3", "fwdbwd_vs_fa3"):
        assert f" {column} " in out[at]
    # Without a GPU the line above the table says the run was interpreted, as the JSON does.
    assert out[at - 1].startswith("interpreted: no GPU") == INTERPRET
    (path,) = tmp_path.glob("kernel-*.json")
    payload = json.loads(path.read_text())
    assert payload.get("interpreted", False) == INTERPRET
    assert ("not GPU kernel times" in payload.get("interpreted_note", "")) == INTERPRET
    rows = payload["rows"]
    mosaic = [r for r in rows if r["impl"] == "jflash_mosaic"]
    assert len(mosaic) == 4
    assert all(r["fwd_vs_cudnn"] == pytest.approx(2.0) for r in mosaic)
    assert all(r["fwdbwd_vs_fa3"] == pytest.approx(0.5) for r in mosaic)
    xla = [r for r in rows if r["impl"] == "xla"]
    assert [r["seq_len"] for r in xla if "fwd_error" in r] == [16384, 16384]
    assert [r["fwd_vs_cudnn"] for r in xla if "fwd_error" not in r] == [0.5, 0.5]

    calls.clear()
    argv = ["--impls", "cudnn", "--masks", "full", "--seqs", "16384", "--out", str(tmp_path)]
    kernel.main([*argv, "--heat", "0", "--interpret"])
    assert calls == [("cudnn", 16384, 128, False)]
    assert (tmp_path / f"{path.stem}-full.json").exists()  # one mask: its own file

    calls.clear()  # --head-dims filters them too
    monkeypatch.setattr(kernel, "SHAPES", [(4096, 128), (4096, 64), (16384, 64)])
    argv = ["--impls", "cudnn", "--masks", "causal", "--head-dims", "64", "--out", str(tmp_path)]
    kernel.main([*argv, "--heat", "0", "--interpret"])
    assert calls == [("cudnn", 4096, 64, True), ("cudnn", 16384, 64, True)]


def test_tune_times_candidates_at_the_tables_batch_in_rounds(monkeypatch, tmp_path):
    """`kernel.py --tune`: every block-size candidate and the cuDNN baseline are measured
    at the main table's batch (`--tokens // --seq`) and then timed together in `--rounds`
    interleaved rounds, not one after the other."""
    calls, retimed = [], []

    def measure(impl, *, batch, seq, heads, kv_heads, head_dim, timers, block_sizes=None, **_):
        calls.append((impl, batch, seq, heads, kv_heads, head_dim, block_sizes))
        timers["fwd"] = None
        return fake_row(impl, seq, head_dim, True, 1.0, 1.0)

    monkeypatch.setattr(kernel, "measure", measure)
    monkeypatch.setattr(
        kernel, "retime_rows", lambda entries, rounds, **kw: retimed.append((entries, rounds, kw))
    )
    argv = ["--tune", "--tune-impl", "jflash_mosaic", "--which", "fwd", "--seq", "4096"]
    argv += ["--head-dim", "64", "--tokens", "65536", "--rounds", "5", "--heat", "0"]
    kernel.main([*argv, "--interpret", "--out", str(tmp_path)])
    labels = [label for *_, label in kernel.mosaic_candidates(kernel.argparse.Namespace(
        head_dim=64, which="fwd"), 4096)]  # fmt: skip
    assert [c[0] for c in calls] == ["jflash_mosaic"] * len(labels) + ["cudnn"]
    assert {c[1:6] for c in calls} == {(16, 4096, 32, 8, 64)}
    assert all(c[6] is not None for c in calls[:-1]) and calls[-1][6] is None
    ((entries, rounds, kw),) = retimed
    assert rounds == 5 and kw["heat_s"] == 0
    assert [row["block_sizes"] for row, _ in entries] == [*labels, "cudnn"]
    assert all(timers == {"fwd": None} for _, timers in entries)
    (path,) = tmp_path.glob("kernel-tune-mosaic-*-4096-64.json")
    rows = json.loads(path.read_text())["rows"]
    assert len(rows) == len(labels) + 1
    assert all(row["fwd_vs_cudnn"] == pytest.approx(1.0) for row in rows)


def test_rounds_keep_each_rows_best_in_a_balanced_order(monkeypatch):
    """retime_rows: after the heat, R rounds time every row's passes, forwards first,
    each round in another order, and a row keeps its best time and TFLOP/s from them;
    the reading taken right after compiling is dropped, even where it was faster."""
    calls = []

    def fake_time(fn, *a, **kw):
        calls.append(fn)
        return {"slow": 2.0, "fast": 0.5}[fn.__name__.split("_")[0]] / 1e3

    def timer(kind, label):
        fn = lambda *a: None  # noqa: E731
        fn.__name__ = f"{kind}_{label}"
        return fn

    monkeypatch.setattr(kernel, "time_pipelined", fake_time)
    monkeypatch.setattr(kernel, "heat", lambda calls, seconds: None)
    entries = []
    for label in ("a", "b", "c"):
        row = {"impl": label, "fwd_ms": 1.0, "fwd_tflops": 1.0, "fwdbwd_ms": 1.0}
        kinds = {"fwd": "fast", "fwdbwd": "slow"}
        timers = {p: (timer(kinds[p], label), (), 1e12) for p in ("fwd", "fwdbwd")}
        entries.append((row, timers))
    kernel.retime_rows(entries, 3)
    assert len(calls) == 3 * 2 * 3  # 3 rounds x 2 passes x 3 rows
    rounds = [calls[0:6], calls[6:12], calls[12:18]]
    for r in rounds:
        assert all(fn.__name__.startswith("fast") for fn in r[:3])  # forwards first
    assert [fn.__name__ for fn in rounds[0][:3]] != [fn.__name__ for fn in rounds[1][:3]]
    for row, _ in entries:
        assert row["rounds"] == 3 and row["fwd_ms"] == 0.5 and row["fwd_tflops"] == 2000.0
        assert row["fwdbwd_ms"] == 2.0  # the 1.0 after compiling is not kept


def test_main_table_names_every_peer_by_default(monkeypatch, tmp_path):
    calls = []

    def measure(impl, *, seq, head_dim, causal, **_):
        calls.append(impl)
        return fake_row(impl, seq, head_dim, causal, 1.0, 1.0)

    monkeypatch.setattr(kernel, "measure", measure)
    monkeypatch.setattr(kernel, "peer_notes", lambda impls: [])
    argv = ["--seqs", "4096", "--head-dims", "128", "--masks", "causal", "--heat", "0"]
    kernel.main([*argv, "--interpret", "--out", str(tmp_path)])
    assert calls == kernel.MAIN_IMPLS.split(",")
    assert {"fa3", "tokamax", "jax_triton", "jflash_mosaic_det"} <= set(calls)


def test_launch_order_without_kernel_times_says_so(monkeypatch, tmp_path, capsys):
    """On a CPU (interpreted) the traces hold no kernel: a line says so, the JSON holds no
    rows, and nothing fails."""
    monkeypatch.setattr(kernel, "traced_kernels", lambda fn, args, iterations: {})
    argv = ["--launch-order", "--impls", "jflash", "--sweep-seqs", "128"]
    shape = ["--head-dim", "64", "--heads", "2", "--kv-heads", "1"]
    kernel.main([*argv, *shape, "--interpret", "--out", str(tmp_path)])
    assert "no jflash kernel's device time" in capsys.readouterr().out
    [path] = tmp_path.glob("kernel-launch-order-*.json")
    assert json.loads(path.read_text())["rows"] == []


@pytest.mark.parametrize(
    "argv",
    [
        ["--masks", "causal,diagonal"],
        ["--seqs", "4k"],
        ["--head-dims", "d64"],
        ["--head-dims", "96"],  # not a head dim of the main table
        ["--masks", ""],
        ["--rounds", "0"],
        ["--kernel-share", "1.5"],
        ["--kernel-share", "-0.1"],
        ["--id-orders", "sorted,shuffled"],
        ["--id-orders", "padded"],  # without --documents
        ["--impls", "jflash_mosaic,jflsh"],  # a typo: no row of errors written
        ["--seqs", "123"],  # not a length of the main table
        ["--tokens", "0"],
        ["--kv-heads", "3"],  # 32 query heads
        ["--out", __file__],  # a file where the results' folder goes
    ],
)
def test_main_rejects_bad_masks_and_seqs(argv, capsys):
    with pytest.raises(SystemExit):
        kernel.main(argv)
    assert argv[1] in capsys.readouterr().err


def hide(monkeypatch, *names):
    """Makes `import name` fail as if the package were not installed."""
    for name in names:
        monkeypatch.setitem(sys.modules, name, None)


def test_missing_peers_are_rows_and_a_printed_note(monkeypatch):
    hide(monkeypatch, "flash_attn3_jax", "jax_triton", "triton", "tokamax")
    monkeypatch.delitem(sys.modules, "benchmarks.triton_attention", raising=False)
    notes = kernel.peer_notes(["jflash_mosaic", "fa3", "cudnn", "jax_triton", "tokamax"])
    assert len(notes) == 3
    assert notes[0].startswith("note: fa3 ") and "not installed" in notes[0]
    assert notes[1].startswith("note: jax_triton ") and "not installed" in notes[1]
    assert notes[2].startswith("note: tokamax ") and "not installed" in notes[2]
    for impl in ("fa3", "jax_triton", "tokamax"):
        row = kernel.measure(impl, batch=1, seq=256, heads=4, kv_heads=1, head_dim=128)
        assert row["fwd_error"].startswith("not installed")
        assert row["fwdbwd_error"] == row["fwd_error"]
        assert "fwd_tflops" not in row


def test_tokamax_row_runs_its_mosaic_implementation(monkeypatch):
    """The tokamax peer calls `tokamax.dot_product_attention` with its Mosaic GPU
    implementation (a stand-in module here: CPU, no tokamax) and its row is checked and
    timed like the others."""
    asked = []

    def dot_product_attention(q, k, v, *, is_causal, implementation):
        asked.append((is_causal, implementation))
        return jax.nn.dot_product_attention(q, k, v, is_causal=is_causal)

    fake = types.ModuleType("tokamax")
    fake.dot_product_attention = dot_product_attention
    monkeypatch.setitem(sys.modules, "tokamax", fake)
    row = kernel.measure("tokamax", batch=1, seq=128, heads=2, kv_heads=1, head_dim=64)
    assert row["fwd_tflops"] > 0 and row["fwdbwd_tflops"] > 0, row
    assert set(asked) == {(True, "mosaic")}


def test_fa3_head_dim_96_cell_says_why_without_importing(monkeypatch):
    hide(monkeypatch, "flash_attn3_jax")  # the D check comes first: no import tried
    row = kernel.measure("fa3", batch=1, seq=256, heads=4, kv_heads=1, head_dim=96)
    assert "D=96 not timed" in row["fwd_error"] and "D=96 not timed" in row["fwdbwd_error"]
    with pytest.raises(ValueError, match="unknown peer"):
        kernel.peer_fn("fa2", True, 128)


def test_check_outputs_keeps_the_first_and_flags_wrong_ones():
    reference = {}
    ones = jnp.ones((2, 3), jnp.bfloat16)
    assert kernel.check_outputs({"impl": "a"}, "fwd", ones, reference)
    close = {"impl": "b"}
    assert kernel.check_outputs(close, "fwd", ones + 0.015625, reference)
    assert close["max_abs_diff"] == 0.015625  # exact in bf16
    wrong = {"impl": "c"}
    assert not kernel.check_outputs(wrong, "fwd", ones * 2, reference)
    assert "wrong output" in wrong["fwd_error"] and "vs a" in wrong["fwd_error"]
    nan = {"impl": "d"}
    assert not kernel.check_outputs(nan, "fwd", ones * jnp.nan, reference)
    # forward+backward: each array relative to its own largest value.
    grads = (ones, (ones * 100, ones))
    assert kernel.check_outputs({"impl": "a"}, "fwdbwd", grads, reference)
    scaled = {"impl": "e"}
    assert kernel.check_outputs(scaled, "fwdbwd", (ones, (ones * 101, ones)), reference)
    assert scaled["grad_rel_diff"] == pytest.approx(0.01, abs=2e-3)
    off = {"impl": "f"}
    assert not kernel.check_outputs(off, "fwdbwd", (ones, (ones * 100, ones * 1.5)), reference)
    assert "grad_rel_diff" in off["fwdbwd_error"]


def test_measure_checks_rows_against_the_first(monkeypatch):
    """A row whose output differs from the shape's first row is an error, not a time."""
    monkeypatch.setattr(kernel, "time_pipelined", lambda fn, *args, **kw: 1e-3)
    shape = dict(batch=1, seq=128, heads=2, kv_heads=1, head_dim=64)
    reference = {}
    first = kernel.measure("xla", reference=reference, **shape)
    assert first["fwd_ms"] == pytest.approx(1.0) and "max_abs_diff" not in first
    same = kernel.measure("xla", reference=reference, **shape)  # same problem, same answer
    assert same["max_abs_diff"] < kernel.FWD_TOLERANCE and "fwd_error" not in same
    assert same["grad_rel_diff"] < kernel.FWDBWD_TOLERANCE and "fwdbwd_ms" in same
    full = kernel.measure("xla", reference=reference, causal=False, **shape)
    assert full["fwd_error"].startswith("wrong output") and "fwd_ms" not in full


def test_parse_stacks_orders_and_rejects():
    assert hf_baseline.parse_stacks("liger,hf") == ["hf", "liger"]
    assert hf_baseline.parse_stacks("liger") == ["liger"]
    for bad in ("hf,torchtitan", "", "hf,hf"):
        with pytest.raises(ValueError, match="--stack"):
            hf_baseline.parse_stacks(bad)


def test_hf_baseline_rejects_unknown_stack_before_torch(capsys):
    with pytest.raises(SystemExit):
        hf_baseline.main(["--stack", "hf,megatron"])
    assert "megatron" in capsys.readouterr().err


def test_hf_baseline_without_torch_is_one_line(monkeypatch, capsys):
    """The PyTorch baselines' stack is not a jflash dependency: without torch the script
    says so in one line, not with an import traceback."""
    hide(monkeypatch, "torch")
    with pytest.raises(SystemExit) as exit_:
        hf_baseline.main(["--stack", "hf"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "need torch and transformers installed" in err
    assert "Traceback" not in err


def test_liger_missing_is_a_note(monkeypatch):
    torch = types.ModuleType("torch")
    torch.__version__ = "9.9"
    transformers = types.ModuleType("transformers")
    transformers.__version__ = "8.8"
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "transformers", transformers)
    hide(monkeypatch, "liger_kernel", "liger_kernel.transformers")
    assert hf_baseline.stack_unavailable("hf") is None
    assert hf_baseline.stack_version("hf") == "transformers 8.8 + torch 9.9"
    assert hf_baseline.stack_unavailable("liger").startswith("not installed")


def test_hf_baseline_rejects_an_unknown_remat_before_torch(capsys):
    with pytest.raises(SystemExit):
        hf_baseline.main(["--remat", "selective"])
    assert "'selective'" in capsys.readouterr().err


def test_a_failing_stack_is_a_row_and_the_next_runs(monkeypatch, tmp_path, capsys):
    """An out-of-memory (or a compile error) in one stack: its row carries the error's
    first line, the next stack still runs and both rows are written."""
    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(is_available=lambda: False)
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setattr(hf_baseline, "stack_unavailable", lambda stack: None)
    monkeypatch.setattr(hf_baseline, "release", lambda device: None)

    def time_stack(stack, config, device, args):
        if stack == "hf":
            raise MemoryError("CUDA out of memory. Tried to allocate 16 GiB\nmore")
        return {"stack": stack, "tokens_per_s": 1.0, "remat": args.remat}

    monkeypatch.setattr(hf_baseline, "time_stack", time_stack)
    out = tmp_path / "hf.json"
    argv = ["--stack", "hf,liger", "--remat", "none", "--model", "tiny", "--out", str(out)]
    assert hf_baseline.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["error"] == "MemoryError: CUDA out of memory. Tried to allocate 16 GiB"
    assert (rows[0]["remat"], rows[0]["compile"]) == ("none", False)
    assert rows[1] == {"stack": "liger", "tokens_per_s": 1.0, "remat": "none"}
    assert "Traceback" in capsys.readouterr().err  # where it failed, for the reader


def test_result_row_uses_the_trainers_flop_formula():
    config = models.preset("tiny")
    args = types.SimpleNamespace(model="tiny", context=1024, remat="dots", compile=True)
    row = hf_baseline.result_row("liger", "x", config, args, 0.5, 1.5, 2.0, on_gpu=True)
    assert (row["remat"], row["compile"]) == ("dots", True)
    assert row["tokens_per_s"] == 2048
    flops = models.training_flops_per_token(config, 1024) * 2048
    assert row["tflops"] == pytest.approx(flops / 1e12)
    assert row["mfu"] == pytest.approx(flops / 989e12)
    assert row["stack"] == "liger" and row["peak_memory_gib"] == 1.5
    assert hf_baseline.result_row("hf", "x", config, args, 0.5, None, 2.0, False)["mfu"] is None


# ----------------------------------------------------------------------------------
# benchmarks/ring.py: packed documents, strategies and cp_model's prediction (CPU, XLA)

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY_RING = [
    "--heads", "4", "--kv-heads", "2", "--head-dim", "32", "--implementation", "xla",
    "--passes", "fwdbwd", "--iters", "1", "--warmup", "0", "--interpret",
]  # fmt: skip


def run_ring(tmp_path, *argv) -> dict:
    from benchmarks import ring

    out = tmp_path / "ring.json"
    ring.main([*TINY_RING, *argv, "--out", str(out)])
    return json.loads(out.read_text())


@pytest.fixture
def ring_calls(monkeypatch):
    """The segment ids each `jflash.ring_attention` call of ring.py received."""
    import jflash

    calls, real = [], jflash.ring_attention

    def spy(q, k, v, **kw):
        calls.append(kw.get("segment_ids"))
        return real(q, k, v, **kw)

    monkeypatch.setattr(jflash, "ring_attention", spy)
    return calls


@pytest.mark.multi_device(4)
def test_ring_documents_rows(tmp_path, ring_calls):
    """--documents: per-token ids reach every ring call; each row holds the mask area
    (below the dense causal one), TFLOP/s on it, efficiency against one device on the
    same documents, balance.py's predicted imbalance per layout, and an output that
    matches the one device's; the measured imbalance only where a GPU trace gives it."""
    result = run_ring(
        tmp_path, "--documents", "16", "--devices", "4", "--tokens-per-device", "64",
        "--layouts", "zigzag,striped,contiguous", "--strategies", "ring",
        "--profile", "--profile-iters", "1",
    )  # fmt: skip
    rows = result["rows"]
    assert [r["layout"] for r in rows] == ["zigzag", "striped", "contiguous"]
    assert ring_calls and all(ids is not None and ids.shape == (1, 256) for ids in ring_calls)
    for r in rows:
        lengths = r["document_lengths"]
        assert sum(lengths) == 256 and r["documents"] == len(lengths) > 4
        assert r["mask_pairs"] == sum(n * (n + 1) // 2 for n in lengths)
        assert r["mask_pairs"] < r["dense_pairs"] == 256 * 257 // 2  # one causal document
        assert r["mask_fraction"] == pytest.approx(r["mask_pairs"] / r["dense_pairs"])
        ideal = r["ideal_fwdbwd_pipe_ms"]  # one device on the same documents, / P
        assert r["eff_fwdbwd_pipe"] == pytest.approx(ideal / r["fwdbwd_pipe_ms"])
        flops = 3.5 * 4 * 4 * 32 * r["mask_pairs"]
        assert r["tflops_fwdbwd_pipe"] == pytest.approx(flops / (4 * r["fwdbwd_pipe_ms"] * 1e9))
        assert r["max_abs_diff"] <= 0.05 and "error" not in r
        measured = "fwdbwd_attention_imbalance" in r  # CPU: no GPU trace to read it from
        assert measured == (jax.default_backend() == "gpu")
        assert "fwd_ms" not in r  # --passes fwdbwd
    by = {r["layout"]: r for r in rows}
    assert by["striped"]["predicted_area_imbalance"] < 1.05
    assert by["contiguous"]["predicted_area_imbalance"] > by["striped"]["predicted_area_imbalance"]
    assert "fwdbwd_attention_imbalance" in result["config"]["notes"]


@pytest.mark.multi_device(2)
def test_ring_documents_ignored_is_a_wrong_output(tmp_path, monkeypatch):
    """A ring that dropped the segment ids would attend across documents: its row says
    so instead of timing a different problem."""
    import jflash

    real = jflash.ring_attention
    monkeypatch.setattr(
        jflash, "ring_attention", lambda q, k, v, segment_ids=None, **kw: real(q, k, v, **kw)
    )
    (row,) = run_ring(
        tmp_path, "--documents", "32", "--devices", "2", "--tokens-per-device", "128",
        "--layouts", "striped", "--strategies", "ring",
    )["rows"]  # fmt: skip
    assert row["max_abs_diff"] > 0.05 and row["error"].startswith("wrong output")


@pytest.mark.multi_device(4)
@pytest.mark.slow
def test_ring_strategies_with_cp_model(tmp_path, ring_calls):
    """Ring, Ulysses, the 2x2 hybrid and allgather at P = 4 beside cp_model's
    prediction (links measured in the process); the hybrid at P = 2 is a row error."""
    result = run_ring(
        tmp_path, "--devices", "2,4", "--tokens-per-device", "64", "--layouts", "zigzag",
        "--strategies", "ring,ulysses,hybrid,allgather", "--cp-model",
    )  # fmt: skip
    assert result["config"]["links"]["from"].startswith("ppermute")
    assert all(ids is None for ids in ring_calls)
    rows = {(r["devices"], r["strategy"]): r for r in result["rows"]}
    assert "needs an even P >= 4" in rows[2, "hybrid"]["error"]
    for (p, strategy), r in rows.items():
        if (p, strategy) == (2, "hybrid"):
            continue
        assert r["max_abs_diff"] <= 0.05 and "error" not in r, r
        assert 0 < r["model_eff_fwdbwd"] <= 1 and r["model_exposed_ms"] >= 0
        assert r["tflops_fwdbwd_pipe"] > 0 and r["eff_fwdbwd_pipe"] > 0
    assert rows[4, "hybrid"]["model_note"] == "2 a2a x 2 ring"


@pytest.mark.multi_device(2)
def test_ring_rounds_keep_each_rows_best_of_interleaved_timings(tmp_path, monkeypatch):
    """--rounds 3: the one-device ideal and every row are timed twice more, in a balanced
    order, each keeping its best time of those (the first timing, right after compiling,
    is dropped even where it read faster); efficiencies are recomputed from the best."""
    from benchmarks import ring

    calls = []  # (compiled, seconds) of every single-call timing, in order

    def fake_time(fn, *a, **kw):
        calls.append(fn)
        if len(calls) <= 3:  # the timings right after compiling: fast, and dropped
            return 0.1
        return 1.0 - 0.01 * len(calls)  # later timings read faster

    monkeypatch.setattr(ring, "time_fn", fake_time)
    monkeypatch.setattr(ring, "time_pipelined", lambda fn, *a, **kw: 0.5)
    result = run_ring(
        tmp_path, "--devices", "2", "--tokens-per-device", "64", "--layouts", "zigzag",
        "--strategies", "ring,allgather", "--rounds", "3", "--heat", "0",
    )  # fmt: skip
    assert result.get("interpreted", False) == INTERPRET  # --interpret, without a GPU
    rows = result["rows"]
    assert len(calls) == 3 * 3  # ideal + 2 rows, 3 rounds, one pass (fwdbwd)
    first, later = calls[:3], [calls[3:6], calls[6:9]]
    assert all(sorted(map(id, r)) == sorted(map(id, first)) for r in later)
    assert later[0][0] is not later[1][0]  # the turns move
    seconds = {id(fn): 1.0 - 0.01 * (i + 1) for i, fn in enumerate(calls)}  # the last
    ideal_ms = seconds[id(first[0])] * 1e3
    for r, fn in zip(rows, first[1:], strict=True):
        assert r["rounds"] == 3 and r["fwdbwd_ms"] == pytest.approx(seconds[id(fn)] * 1e3)
        assert r["ideal_fwdbwd_ms"] == pytest.approx(ideal_ms / 2)
        assert r["eff_fwdbwd"] == pytest.approx(ideal_ms / 2 / r["fwdbwd_ms"])
        assert r["max_abs_diff"] <= 0.05 and "error" not in r


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--layouts", "zigzag,diagonal"], "'diagonal'"),
        (["--strategies", "ring,tree"], "'tree'"),
        (["--passes", "bwd"], "'bwd'"),
        (["--documents", "0"], "--documents 0"),
        (["--documents", "4k"], "'4k'"),
        (["--tokens-per-device", "0,128"], "0,128"),
        (["--rounds", "0"], "--rounds 0"),
        (["--implementation", "mosiac"], "'mosiac'"),
        (["--kv-heads", "0"], "--kv-heads 0"),
        (["--heads", "4", "--kv-heads", "3"], "--heads 4"),
        # The zigzag layout halves each device's tokens (refused before anything runs).
        (["--devices", "1,2", "--tokens-per-device", "128,101"], "--tokens-per-device 101"),
        (["--out", f"{__file__}/ring.json"], "is a file, not a directory"),
    ],
)
def test_ring_rejects_bad_flags_by_value(argv, named, capsys):
    from benchmarks import ring

    with pytest.raises(SystemExit):
        ring.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert named in err[-1], err


def test_ring_profile_reads_per_rank_attention(monkeypatch):
    """--profile on a GPU: each device's attention-kernel time and their max / mean
    (read here from a 2x H200 trace in place of the one the benchmark takes)."""
    import os

    from benchmarks import ring
    from train.tools import trace

    path = os.path.join(os.path.dirname(__file__), "data", "tiny.xplane.pb.gz")
    report = trace.parse(path)
    monkeypatch.setattr(ring, "gpu_trace", lambda trace_dir: report)
    compiled = jax.jit(lambda x: x + 1).lower(jnp.ones(4)).compile()
    row: dict = {}
    assert ring.profile_passes({"fwdbwd": (compiled, (jnp.ones(4),))}, 2, row)
    ranks = row["fwdbwd_rank_attention_ms"]
    assert len(ranks) == len(report.devices) == 2
    assert ranks[0] == pytest.approx(report.devices["gpu:0"].attention_ms / 2)
    assert row["fwdbwd_attention_imbalance"] == pytest.approx(max(ranks) / (sum(ranks) / 2))
    assert set(ring.BREAKDOWN) <= {k.removeprefix("fwdbwd_") for k in row}


def test_ab_runs_the_tree_against_a_revision(tmp_path, monkeypatch, capsys):
    """`benchmarks/ab.py` on CPU: HEAD's jflash exported and imported beside the working
    tree's under its own name, both run (XLA path, tiny shape), outputs agree; the cuDNN
    peer (XLA's attention here: CPUs have no cuDNN) gets its own columns."""
    import subprocess

    from benchmarks import ab

    try:
        subprocess.run(["git", "-C", ab.ROOT, "rev-parse", "HEAD"], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    peer = []
    monkeypatch.setattr(
        ab,
        "cudnn_candidate",
        lambda causal: (
            peer.append(causal)
            or ab._passes(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal))
        ),
    )
    out = tmp_path / "ab.json"
    argv = ["--rev", "HEAD", "--implementation", "xla", "--shapes", "causal:128:64"]
    argv += ["--tokens", "128", "--heads", "2", "--kv-heads", "1", "--rounds", "1"]
    argv += ["--peers", "cudnn", "--document-shapes", "128:64", "--interpret", "--deterministic"]
    ab.main([*argv, "--min-time", "0", "--heat", "0", "--out", str(out)])
    written = json.loads(out.read_text())
    assert written.get("interpreted", False) == INTERPRET
    assert written["deterministic"] is True and written["complete"] is True
    row, documents = written["rows"]
    assert row["shape"] == "causal S=128 D=64 B=1"
    assert documents["shape"].startswith("documents S=128 (") and documents["shape"].endswith(
        "D=64 B=1"
    )
    assert documents["rev_max_abs_diff"] == documents["rev_grad_max_abs_diff"] == 0.0
    assert ab.parse_document_shapes("8192:64,65536:128") == [(8192, 64), (65536, 128)]
    with pytest.raises(ValueError, match="'8192:x'"):
        ab.parse_document_shapes("8192:x")
    assert row["rev_max_abs_diff"] == 0.0  # the same kernels on the same inputs
    assert row["rev_grad_max_abs_diff"] == 0.0
    assert row["new_fwd_ms"] > 0 and row["rev_fwdbwd_ms"] > 0 and row["new/rev_fwd"] > 0
    assert peer == [True] and row["new/cudnn_fwdbwd"] > 0
    assert row["cudnn_grad_max_abs_diff"] < 1e-2
    rev = sys.modules[ab.BASELINE]  # a second package, from the exported revision
    assert (
        not rev.__file__.startswith(ab.ROOT) and rev.flash_attention is not jflash.flash_attention
    )
    out = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(out) if line.startswith("| shape"))
    assert "new/rev_fwd" in out[at] and out[at - 1].startswith("interpreted: no GPU") == INTERPRET
    # The rows went beside the JSON after each row (a run cut short keeps them, and the
    # last whole run's results stay), then the JSON once, whole.
    assert out.count(f"wrote {tmp_path / 'ab.json'}.partial") == 2
    assert out.count(f"wrote {tmp_path / 'ab.json'}") == 1
    assert not (tmp_path / "ab.json.partial").exists()


def test_ab_several_revisions_and_a_wrong_backward(tmp_path, monkeypatch, capsys):
    """Two revisions: each its own package and label; a revision whose backward is
    wrong shows in its gradient gap, not in its forward's."""
    import subprocess

    from benchmarks import ab

    try:
        subprocess.run(["git", "-C", ab.ROOT, "rev-parse", "HEAD"], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    real_import = ab.import_revision

    def import_revision(rev, dest, name=ab.BASELINE):
        module = real_import(rev, dest, name)
        if name != ab.BASELINE:  # the second revision: gradients doubled, forward kept
            flash = module.flash_attention

            @jax.custom_vjp
            def wrong(q, k, v):
                return flash(q, k, v, causal=True, implementation="xla")

            def fwd(q, k, v):
                out, vjp = jax.vjp(wrong.__wrapped__, q, k, v)
                return out, vjp

            wrong.defvjp(fwd, lambda vjp, g: tuple(2 * x for x in vjp(g)))
            module = types.SimpleNamespace(flash_attention=lambda q, k, v, **kw: wrong(q, k, v))
        return module

    monkeypatch.setattr(ab, "import_revision", import_revision)
    out = tmp_path / "ab.json"
    argv = ["--rev", "HEAD", "--rev", "HEAD", "--implementation", "xla", "--interpret"]
    argv += ["--shapes", "causal:128:64", "--tokens", "128", "--heads", "2", "--kv-heads", "1"]
    argv += ["--q-scale", "8"]
    ab.main([*argv, "--rounds", "1", "--min-time", "0", "--heat", "0", "--out", str(out)])
    written = json.loads(out.read_text())
    assert written["revs"] == {"rev1": "HEAD", "rev2": "HEAD"}
    assert written["q_scale"] == 8.0 and written["rows"][0]["shape"].endswith(", q x 8")
    head = subprocess.run(
        ["git", "-C", ab.ROOT, "rev-parse", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()
    assert written["rev_commits"] == {"rev1": head, "rev2": head}  # what a branch named then
    (row,) = written["rows"]
    assert row["rev1_max_abs_diff"] == row["rev1_grad_max_abs_diff"] == 0.0
    assert row["rev2_max_abs_diff"] == 0.0 and row["rev2_grad_max_abs_diff"] > 0.1
    assert row["rev1_grad_rel_diff"] == 0.0 and row["rev2_grad_rel_diff"] > 0.5  # doubled
    assert row["new/rev1_fwdbwd"] > 0 and row["new/rev2_fwd"] > 0
    captured = capsys.readouterr()
    assert "revisions: rev1 = HEAD, rev2 = HEAD" in captured.out
    (warning,) = [line for line in captured.err.splitlines() if line.startswith("ab.py:")]
    assert "rev2's gradients are" in warning and "of their largest entry" in warning


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--rev", "no-such-revision-anywhere"], "no-such-revision-anywhere"),
        (["--rev", "HEAD", "--shapes", "causal:4096"], "causal:4096"),
        (["--rev", "HEAD", "--shapes", "sliding:4096:128"], "sliding:4096:128"),
        (["--rev", "HEAD", "--shapes", "full:4k:128"], "full:4k:128"),
        (["--rev", "HEAD", "--peers", "fa2"], "fa2"),
        (["--rev", "HEAD", "--rounds", "0"], "--rounds 0"),
        (["--rev", "HEAD", "--id-orders", "shuffled"], "shuffled"),
        (["--rev", "HEAD", "--id-orders", "padded"], "--documents"),
        (["--rev", "HEAD", "--shapes", "causal:0:64"], "causal:0:64"),
        (["--rev", "HEAD", "--implementation", "mosiac"], "'mosiac'"),
        (["--rev", "HEAD", "--q-scale", "0"], "--q-scale 0.0"),
        (["--rev", "HEAD", "--q-scale", "nan"], "--q-scale nan"),
    ],
)
def test_ab_rejects_bad_flags_by_value(argv, named, capsys):
    from benchmarks import ab

    with pytest.raises(SystemExit):
        ab.main(argv)
    assert named in capsys.readouterr().err


def test_draw_inputs_q_scale_multiplies_only_the_queries():
    """`--q-scale`'s inputs: the same draw with q times the factor (exact in bf16 for a
    power of two), k, v and dO as they were."""
    from benchmarks.kernel import draw_inputs

    plain = draw_inputs(1, 64, 2, 1, 64)
    scaled = draw_inputs(1, 64, 2, 1, 64, q_scale=8.0)
    assert scaled[0].dtype == plain[0].dtype
    np.testing.assert_array_equal(
        np.asarray(scaled[0], np.float32), 8 * np.asarray(plain[0], np.float32)
    )
    for a, b in zip(plain[1:], scaled[1:], strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_ab_order_balances_turns_and_predecessors(n):
    """Over the default rounds (2n) every candidate takes every turn equally often and
    follows every other candidate equally often."""
    from collections import Counter

    from benchmarks.common import balanced_order

    labels = ["new"] + [f"rev{i}" for i in range(1, n)]
    orders = [balanced_order(labels, r) for r in range(2 * n)]
    assert all(sorted(o) == sorted(labels) for o in orders)
    turns = Counter((o[i], i) for o in orders for i in range(n))
    assert set(turns.values()) == {2} and len(turns) == n * n
    follows = Counter((o[i], o[i + 1]) for o in orders for i in range(n - 1))
    assert set(follows.values()) == {2} and len(follows) == n * (n - 1)


COUNTERS_TEXT = """==WARNING== Note: Running with unmodified GPU clocks.
ran jflash 16384 128 True
  jflash_mosaic_dkv_mosaic_gpu_kernel (4, 128, 8)x(384, 1, 1), Context 1, Stream 14
    Section: Command line profiler metrics
    gpu__time_duration.sum                                                    ns    33,987,552
    l1tex__data_pipe_lsu_wavefronts_mem_shared.sum                                5,948,175,296
    launch__registers_per_thread                                  register/thread           168
    dram__bytes_read.sum                                                byte 27,032,616,960
    lts__t_sector_hit_rate.pct                                                 %         93.71
    smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio        inst          2.24
    sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active     %         70.40
    Section: GPU Speed Of Light Throughput
    Duration                         ns       33,987,552
  void device_kernel<FlashAttnBwdPostprocessConvertdQ<C<64>>>(Params) (256, 32, 4)x(256, 1, 1)
    gpu__time_duration.sum                                                    ns       379,200
"""


def test_counters_parse_ncu_details(tmp_path, capsys):
    from benchmarks import counters

    kernels = counters.parse_details(COUNTERS_TEXT)
    post_name = "FlashAttnBwdPostprocessConvertdQ"
    assert [k["kernel"] for k in kernels] == ["jflash_mosaic_dkv", post_name]
    (dkv, post) = counters.summarise("jflash:16384:128", kernels)
    assert dkv["ms"] == pytest.approx(33.987552)
    assert dkv["tensor_active_pct"] == 70.4 and dkv["registers"] == 168
    assert dkv["shared_wavefronts_g"] == pytest.approx(5.948175296)
    assert dkv["stall_barrier"] == 2.24 and "stall_gmma" not in dkv
    assert dkv["l2_hit_pct"] == 93.71 and dkv["dram_read_gb"] == pytest.approx(27.03261696)
    assert "dram_write_gb" not in dkv
    assert post == {"case": "jflash:16384:128", "kernel": post_name, "ms": 0.3792}

    saved = tmp_path / "ncu-jflash-16384-128.txt"
    saved.write_text(COUNTERS_TEXT)
    out = tmp_path / "c.json"
    argv = ["--parse", str(saved), "--device", "NVIDIA H200", "--out", str(out)]
    assert counters.main(argv) == 0
    written = json.loads(out.read_text())
    assert written["device"] == "NVIDIA H200"
    assert [r["case"] for r in written["rows"]] == ["jflash:16384:128"] * 2
    assert "| jflash:16384:128 | jflash_mosaic_dkv | 34 | 70.4 |" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--cases", "fa2:16384:128"], "fa2:16384:128"),
        (["--cases", "jflash:16k:64"], "jflash:16k:64"),
        (["--parse", "x.txt"], "--device"),
        (["--parse", "/no/such/file.txt", "--device", "H200"], "/no/such/file.txt"),
    ],
)
def test_counters_rejects_bad_flags_by_value(argv, named, capsys):
    from benchmarks import counters

    with pytest.raises(SystemExit):
        counters.main(argv)
    assert named in capsys.readouterr().err


def test_counters_without_ncu_says_so(monkeypatch, capsys):
    from benchmarks import counters

    monkeypatch.setattr(counters.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit):
        counters.main([])
    assert "ncu (Nsight Compute) is not on PATH" in capsys.readouterr().err


def test_counters_goes_on_past_a_failing_case(monkeypatch, tmp_path, capsys):
    """A case whose ncu run fails is named in one line (exit status, last output line,
    saved file); the other cases are still tabulated and the status is 1."""
    import subprocess

    from benchmarks import counters

    def fake_run(cmd, **kw):
        fails = "fa3:16384:128" in cmd
        out = "==ERROR== The application returned an error code (1).\n" if fails else COUNTERS_TEXT
        return subprocess.CompletedProcess(cmd, 1 if fails else 0, stdout=out, stderr="")

    monkeypatch.setattr(counters.shutil, "which", lambda name: "/usr/bin/ncu")
    monkeypatch.setattr(counters.subprocess, "run", fake_run)
    monkeypatch.setattr(counters, "device_name", lambda: "H200")
    out = tmp_path / "c.json"
    base = ["--out-dir", str(tmp_path), "--out", str(out)]
    assert counters.main(["--cases", "jflash:16384:128,fa3:16384:128", *base]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ncu on fa3:16384:128 exited 1" in err[0]
    assert "returned an error code" in err[0] and "ncu-fa3-16384-128.txt" in err[0]
    written = json.loads(out.read_text())
    assert written["failed"] == ["fa3:16384:128"]
    assert {r["case"] for r in written["rows"]} == {"jflash:16384:128"}

    assert counters.main(["--cases", "fa3:16384:128", *base]) == 1
    assert "no case ran under ncu (fa3:16384:128)" in capsys.readouterr().err


def _fake_ncu(monkeypatch):
    """`counters.py` with an `ncu` that prints `COUNTERS_TEXT`: the commands it was
    given, in a list that fills as they run."""
    import subprocess

    from benchmarks import counters

    cmds = []

    def fake_run(cmd, **kw):
        cmds.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout=COUNTERS_TEXT, stderr="")

    monkeypatch.setattr(counters.shutil, "which", lambda name: "/usr/bin/ncu")
    monkeypatch.setattr(counters.subprocess, "run", fake_run)
    monkeypatch.setattr(counters, "device_name", lambda: "H200")
    return cmds


def test_counters_mask_and_kv_heads_reach_the_child_and_the_names(monkeypatch, tmp_path):
    """`--mask full --kv-heads 32` go to the profiled child, tag the saved file and the
    case, are written to the JSON, and a tagged saved file parses under its tag."""
    from benchmarks import counters

    cmds = _fake_ncu(monkeypatch)
    out = tmp_path / "c.json"
    argv = ["--cases", "jflash:16384:128", "--mask", "full", "--kv-heads", "32"]
    assert counters.main([*argv, "--out-dir", str(tmp_path), "--out", str(out)]) == 0
    (cmd,) = cmds
    assert cmd[cmd.index("--mask") + 1] == "full" and cmd[cmd.index("--kv-heads") + 1] == "32"
    saved = tmp_path / "ncu-jflash-16384-128-full-kv32.txt"
    assert saved.exists()
    written = json.loads(out.read_text())
    assert (written["mask"], written["kv_heads"]) == ("full", 32)
    assert {r["case"] for r in written["rows"]} == {"jflash:16384:128:full-kv32"}

    parsed = tmp_path / "p.json"
    argv = ["--parse", str(saved), "--device", "NVIDIA H200", "--out", str(parsed)]
    assert counters.main(argv) == 0
    assert {r["case"] for r in json.loads(parsed.read_text())["rows"]} == {
        "jflash:16384:128:full-kv32"
    }


def test_counters_profile_the_packed_forward(monkeypatch, tmp_path):
    """`--mask documents --pass fwd`: the child runs the forward of the packed row
    (which it can, here on CPU at a small S), ncu is asked for the forward kernels,
    both of jflash's packed launches, and the names carry the pass."""
    from benchmarks import counters

    cmds = _fake_ncu(monkeypatch)
    out = tmp_path / "c.json"
    argv = ["--cases", "jflash:65536:128", "--mask", "documents", "--pass", "fwd"]
    assert counters.main([*argv, "--out-dir", str(tmp_path), "--out", str(out)]) == 0
    (cmd,) = cmds
    assert cmd[cmd.index("--kernel-name") + 1] == counters.KERNELS["fwd"]
    assert cmd[cmd.index("--launch-count") + 1] == "2"
    assert cmd[cmd.index("--pass") + 1] == "fwd" and cmd[cmd.index("--mask") + 1] == "documents"
    assert (tmp_path / "ncu-jflash-65536-128-documents-kv8-fwd.txt").exists()
    assert json.loads(out.read_text())["pass"] == "fwd"
    assert counters.short_name("void device_kernel<FlashAttnFwdSm90<X>>(...)") == "FlashAttnFwdSm90"
    counters.call("jflash", 512, 64, 512, "documents", 2, "fwd")  # the child's work runs


@pytest.mark.parametrize(
    "lengths, side, aligned, area, masked",
    [
        ([4, 4], "query", "global", 32 / 20, 1.0),  # two diagonal steps
        # the second program's rows start in the first document's step: 3 masked steps
        ([2, 6], "query", "global", 48 / 24, 1.0),
        # aligned to the second document: its last program's first step is clear
        ([2, 6], "query", "document", 64 / 24, 3 / 4),
        ([8], "key", "global", 48 / 36, 2 / 3),  # keys 0-3 see queries 0-7: one clear step
    ],
)
def test_kernel_tiles_counts_by_hand(lengths, side, aligned, area, masked):
    from benchmarks import balance

    got = balance.kernel_tiles(lengths, side, 4, 4, aligned)
    assert got == pytest.approx((area, masked))


def test_kernel_tiles_refuses_by_value_and_prints_the_table(capsys):
    from benchmarks import balance

    with pytest.raises(ValueError, match="'rows'"):
        balance.kernel_tiles([4], "rows", 4, 4, "global")
    assert balance.main(["--kernel-tiles"]) == 0
    out = capsys.readouterr().out
    assert "22 documents in 65536 tokens" in out and "FlashAttention-3 varlen" in out


def test_measure_checks_a_later_call_not_only_the_first(monkeypatch):
    """A peer right on its first call and wrong on later ones (state kept between calls)
    is an error, not a time: the outputs checked are of a second call."""
    from jax.experimental import io_callback

    monkeypatch.setattr(kernel, "time_pipelined", lambda fn, *args, **kw: 1e-3)
    shape = dict(batch=1, seq=128, heads=2, kv_heads=1, head_dim=64)
    reference = {}
    kernel.measure("xla", reference=reference, **shape)
    calls = []

    def factor():  # 1 on the very first call, 2 on every later one
        calls.append(None)
        return np.float32(1.0 if len(calls) == 1 else 2.0)

    def stateful(q, k, v):
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        scale = io_callback(factor, jax.ShapeDtypeStruct((), jnp.float32))
        return out * lax.stop_gradient(scale).astype(out.dtype)

    monkeypatch.setattr(kernel, "attention_fn", lambda *a, **kw: stateful)
    row = kernel.measure("peer", reference=reference, **shape)
    assert row["fwd_error"].startswith("wrong output") and "fwd_ms" not in row


def test_power_parses_samples_and_names_throttle_reasons():
    from benchmarks import power

    assert power.parse_sample("1568, 611.80, 58, 0x0000000000000004") == {
        "sm_mhz": 1568.0,
        "watts": 611.8,
        "temp_c": 58.0,
        "throttle": 4,
    }
    assert power.parse_sample("1568, [N/A], 58, 0x4") is None
    assert power.parse_sample("No devices were found") is None
    assert power.throttle_names(0x4) == ["power cap"]
    assert power.throttle_names(0x24) == ["power cap", "thermal (software)"]
    assert power.throttle_names(0x1000) == ["0x1000"]


def test_power_summarises_a_window_and_derives_rates():
    from benchmarks import power

    def s(mhz, w, thr):
        return {"sm_mhz": mhz, "watts": w, "temp_c": 60.0, "throttle": thr}

    samples = [(0.1, s(1980, 300, 0)), (1.0, s(1600, 700, 4)), (1.5, s(1500, 690, 0x24))]
    samples.append((9.0, s(1980, 100, 1)))  # after the window
    got = power.summarise(samples, 0.0, 2.0)  # the first 0.3 s are left out
    assert got["samples"] == 2 and got["sm_mhz"] == 1550 and got["watts"] == 695
    assert got["throttle"] == {"power cap": 1.0, "thermal (software)": 0.5}
    assert power.summarise(samples, 5.0, 6.0) == {"samples": 0}
    row = power.reading(3.5e12, 10.0, got)  # 3.5 TFLOP in 10 ms
    assert row["tflops"] == pytest.approx(350)
    assert row["joules_per_call"] == pytest.approx(6.95)
    assert row["tflops_per_ghz"] == pytest.approx(350 / 1.55)
    assert row["tflops_per_kw"] == pytest.approx(350 / 0.695)
    assert "joules_per_call" not in power.reading(1e12, 1.0, {"samples": 0})


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--shapes", "causal:4096"], "causal:4096"),
        (["--passes", "bwd"], "bwd"),
        (["--shapes", "causal:3000:128"], "S=3000"),
        (["--rounds", "0"], "--rounds 0"),
        (["--shapes", ""], "nothing to time"),
    ],
)
def test_power_rejects_bad_flags_by_value(argv, named, capsys):
    from benchmarks import power

    with pytest.raises(SystemExit):
        power.main(argv)
    assert named in capsys.readouterr().err


def test_power_without_nvidia_smi_says_so(monkeypatch, capsys):
    from benchmarks import power

    monkeypatch.setattr(power.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit, match="nvidia-smi is not on PATH"):
        power.main([])


def test_power_tabulates_the_median_round():
    from benchmarks import power

    rows = [
        {"shape": "s", "impl": "a", "pass": "fwd", "ms": ms, "round": r}
        for r, ms in enumerate([1.0, 3.0, 2.0])
    ]
    rows.append({"shape": "s", "impl": "b", "pass": "fwd", "ms": 5.0, "round": 0})
    assert [(r["impl"], r["round"]) for r in power.median_rounds(rows)] == [("a", 2), ("b", 0)]


def test_document_id_orders_label_the_same_documents():
    """Every id order masks alike (equal ids exactly within one document); padded ends
    the row with id 0 after larger ids, permuted is neither sorted nor padded, pair is
    the permuted ids as query and key ids, hashed labels span more values than the row
    has tokens and are not sorted."""
    lengths = kernel.document_lengths(4096)
    pair = kernel.document_ids(lengths, 2, "pair")
    assert isinstance(pair, tuple) and len(pair) == 2
    np.testing.assert_array_equal(pair[0], pair[1])
    np.testing.assert_array_equal(pair[0], kernel.document_ids(lengths, 2, "permuted"))
    orders = [o for o in kernel.ID_ORDERS if o != "pair"]
    rows = {o: np.asarray(kernel.document_ids(lengths, 2, o)) for o in orders}
    same = rows["sorted"][0][:, None] == rows["sorted"][0][None, :]
    for order, ids in rows.items():
        assert ids.shape == (2, 4096) and ids.dtype == np.int32
        np.testing.assert_array_equal(ids[0], ids[1])
        np.testing.assert_array_equal(ids[0][:, None] == ids[0][None, :], same, err_msg=order)
    assert np.all(np.diff(rows["sorted"][0]) >= 0)
    padded = rows["padded"][0]
    assert padded[-1] == 0 and np.all(np.diff(padded[: -lengths[-1]]) >= 0)
    assert np.any(np.diff(rows["permuted"][0][: -lengths[-1]]) < 0)
    hashed = rows["hashed"][0].astype(np.int64)
    assert np.ptp(hashed) >= hashed.size and np.any(np.diff(hashed) < 0)
    with pytest.raises(ValueError, match="shuffled"):
        kernel.document_ids(lengths, 1, "shuffled")


def test_power_cases_build_the_packed_row(monkeypatch):
    """`--documents` adds kernel.py's packed row: jflash with the segment ids, FA3 as
    its varlen kernel (or a PeerUnavailable naming why not), others refused."""
    import argparse

    from benchmarks import kernel, power

    args = argparse.Namespace(tokens=4096, heads=4, kv_heads=2, documents=True)
    ((label, inputs, flops, build),) = list(power.cases(args, []))
    lengths = kernel.document_lengths(4096)
    assert label == f"documents S=4096 ({len(lengths)} documents) D=128 B=1"
    assert inputs[0].shape == (1, 4096, 4, 128) and inputs[1].shape == (1, 4096, 2, 128)
    assert flops == kernel.document_flops(lengths, 4, 128)
    attn = build("jflash_mosaic")
    assert attn.keywords["segment_ids"].shape == (1, 4096) and attn.keywords["causal"]
    with pytest.raises(kernel.PeerUnavailable, match="packed-documents"):
        build("cudnn")
    monkeypatch.setitem(sys.modules, "flash_attn3_jax", None)  # the wheel missing
    with pytest.raises(kernel.PeerUnavailable, match="not installed"):
        build("fa3")


def test_ab_clocks_add_cycles_per_call(monkeypatch):
    """With a sampler, each best reading's clock and power are kept and the clock cycles
    per call compared with the tree's: time ratio times clock ratio."""
    import itertools

    import jax.numpy as jnp

    from benchmarks import ab

    clocks = itertools.cycle([1500.0, 1800.0])  # the candidates' readings alternate

    def summarise(samples, start, end):
        return {"samples": 5, "sm_mhz": next(clocks), "watts": 690.0}

    monkeypatch.setattr(ab.power, "summarise", summarise)

    def cand(scale):
        def fwd(q, k, v):
            return q * scale

        def fwdbwd(q, k, v, do):
            return q * scale, (q, k, v)

        return fwd, fwdbwd

    x = jnp.ones((1, 8, 1, 4))
    sampler = types.SimpleNamespace(samples=[])
    row = ab.compare(
        "s",
        1e9,
        {"new": cand(1.0), "rev": cand(1.0)},
        (x, x, x, x),
        rounds=1,
        min_time=0.0,
        sampler=sampler,
        heat_s=0,
    )
    for p in ("fwd", "fwdbwd"):
        assert {row[f"new_{p}_mhz"], row[f"rev_{p}_mhz"]} <= {1500.0, 1800.0}
        assert row[f"new_{p}_watts"] == 690.0
        ratio = row[f"new/rev_{p}"] * row[f"rev_{p}_mhz"] / row[f"new_{p}_mhz"]
        assert row[f"new/rev_{p}_cycles"] == pytest.approx(ratio)
    plain = ab.compare(
        "s", 1e9, {"new": cand(1.0), "rev": cand(1.0)}, (x,) * 4, rounds=1, min_time=0.0
    )
    assert not any(k.endswith(("_mhz", "_cycles")) for k in plain)


def test_ab_clocks_without_nvidia_smi_says_so(monkeypatch, capsys):
    from benchmarks import ab

    monkeypatch.setattr(ab.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit):
        ab.main(["--rev", "HEAD", "--clocks"])
    assert "nvidia-smi is not on PATH" in capsys.readouterr().err


def test_heat_runs_every_call_for_the_time_given():
    from benchmarks.common import heat

    calls = {"a": 0, "b": 0}

    def call(name):
        calls[name] += 1
        return jnp.zeros(())

    heat([lambda: call("a"), lambda: call("b")], 0)
    assert calls == {"a": 0, "b": 0}
    t0 = time.perf_counter()
    heat([lambda: call("a"), lambda: call("b")], 0.05)
    assert time.perf_counter() - t0 >= 0.05 and calls["a"] >= 1 and calls["b"] >= 1


def test_retime_rows_heats_then_drops_the_reading_after_compiling(monkeypatch):
    """The rows' passes run under load first; the times kept are the rounds' best, even
    where `measure`'s reading right after compiling was faster."""
    heated, readings = [], iter([3.0, 2.0, 4.0, 5.0, 2.5, 6.0])
    monkeypatch.setattr(kernel, "heat", lambda calls, s: heated.append((len(calls), s)))
    monkeypatch.setattr(
        kernel, "time_pipelined", lambda fn, *a, iters, round_s: next(readings) * 1e-3
    )
    rows = [{"fwd_ms": 1.0, "fwdbwd_ms": 1.0}, {"fwd_ms": 1.0}]
    entries = [
        (rows[0], {"fwd": (len, ("x",), 1e9), "fwdbwd": (len, ("x",), 3.5e9)}),
        (rows[1], {"fwd": (len, ("x",), 1e9)}),
    ]
    kernel.retime_rows(entries, 2, heat_s=7.0)
    assert heated == [(3, 7.0)]
    # Round 0 times fwd of rows 0, 1, then fwdbwd of row 0; round 1 the other order.
    assert rows[0]["fwd_ms"] == pytest.approx(2.5) and rows[1]["fwd_ms"] == pytest.approx(2.0)
    assert rows[0]["fwdbwd_ms"] == pytest.approx(4.0)
    assert rows[0]["fwd_tflops"] == pytest.approx(1e9 / 2.5e-3 / 1e12)
    assert rows[0]["rounds"] == rows[1]["rounds"] == 2


def test_pipelined_timing_sizes_its_batches_and_waits_once_per_batch(monkeypatch):
    """time_pipelined: `iters=None` sizes each batch from one synchronised call (at least
    3 calls), every batch's calls are dispatched back to back and only the last call's
    output is waited for; the time is per call, the median of the batches."""
    from benchmarks import common

    waited, calls = [], []

    def fn(x):
        calls.append(x)
        return jnp.asarray(len(calls))

    def block(out):
        waited.append(int(out))
        return out

    monkeypatch.setattr(common.jax, "block_until_ready", block)
    t = common.time_pipelined(fn, 1, warmup=1, iters=None, rounds=2, round_s=0.0)
    # warmup, the sizing call, then two batches of 3 (round_s=0: the minimum)
    assert len(calls) == 1 + 1 + 2 * 3
    assert waited == [1, 2, 5, 8]  # each batch waits for its last call only
    assert 0 <= t < 1
    calls.clear(), waited.clear()
    common.time_pipelined(fn, 1, warmup=0, iters=4, rounds=1)
    assert len(calls) == 4 and waited == [4]


def _ring_child(out, *, row_timeout: str, iters: str = "1"):
    """The command and environment of a tiny 2-device `benchmarks/ring.py` run (one
    zigzag ring row and its one-device ideal) writing its JSON to `out`."""
    args = [*TINY_RING, "--tokens-per-device", "64", "--devices", "2", "--layouts", "zigzag",
            "--strategies", "ring", "--row-timeout", row_timeout, "--out", str(out)]  # fmt: skip
    args[args.index("--iters") + 1] = iters
    env = dict(os.environ, **cpu_devices(2))  # 2 simulated CPU devices, on a GPU machine too
    return [sys.executable, "benchmarks/ring.py", *args], env


def test_ring_row_timeout_names_the_row_it_stopped_in(tmp_path):
    """A row past `--row-timeout` stops the run (a hung GPU kernel cannot be interrupted
    in the process) with exit code 1 and the stacks printed; the JSON written before
    the row started (beside the results file, which a run cut short leaves as it was)
    lists it as unfinished. 10 ms: no row compiles that fast."""
    out = tmp_path / "ring.json"
    out.write_text("{}")  # the last whole run's results
    cmd, env = _ring_child(out, row_timeout="0.01")
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stderr[-2000:]
    assert "Timeout" in run.stderr and "Thread" in run.stderr
    assert out.read_text() == "{}"
    (row,) = json.loads((tmp_path / "ring.json.partial").read_text())["rows"]
    assert row["strategy"] == "ideal" and row["seq_len"] == 128
    assert "did not finish" in row["error"]


def test_ring_stopped_from_outside_prints_its_stacks(tmp_path):
    """A SIGTERM (a step's `timeout` in multi_gpu.sh) during a row prints every thread's
    stack before the process ends, and the JSON names the row it stopped in."""
    out = tmp_path / "ring.json.partial"  # beside the results file: the run is cut short
    cmd, env = _ring_child(
        tmp_path / "ring.json", row_timeout="0", iters="1000000"
    )  # until stopped
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while not (out.exists() and "did not finish" in out.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, "no row started"
            time.sleep(0.1)
        time.sleep(0.5)  # inside the row
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGTERM
    assert "Current thread" in stderr or "Thread 0x" in stderr, stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["strategy"] == "ideal" and "did not finish" in row["error"]


def test_in_shard_map_times_both_calls_in_a_balanced_order(tmp_path, monkeypatch, capsys):
    """`benchmarks/in_shard_map.py`: each shape's direct call (`flash_attention`) and
    the same attention inside a one-device `shard_map`, both
    passes of each in every round (`balanced_order`), the best kept; equal outputs; the
    ratios from those bests; each call's device time per kernel; bad flags refused by
    value."""
    from benchmarks import in_shard_map

    timed = []

    def fake_time(fn, *args, **kwargs):
        timed.append(fn)
        return 0.002 if len(timed) % 2 else 0.003  # forward 2 ms, forward+backward 3 ms

    monkeypatch.setattr(in_shard_map, "time_pipelined", fake_time)
    traced = []

    def fake_device_ms(fn, args):
        traced.append(len(args))
        return {"jflash_mosaic_fwd": 1.5, "copy": 0.25}

    monkeypatch.setattr(in_shard_map, "device_ms", fake_device_ms)
    out = tmp_path / "r.json"
    argv = ["--shapes", "causal:64:16,full:64:16", "--tokens", "64", "--heads", "4"]
    argv += ["--kv-heads", "2", "--rounds", "2", "--interpret", "--out", str(out)]
    assert in_shard_map.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["shape"] for r in rows] == ["causal S=64 D=16 B=1", "full S=64 D=16 B=1"]
    assert len(timed) == 2 * 2 * 2 * 2  # shapes x rounds x calls x passes
    for row in rows:
        assert row["max_abs_diff"] == 0.0
        assert row["direct_fwd_ms"] == row["shard_map_fwd_ms"] == 2.0
        assert row["shard_map/direct_fwdbwd"] == 1.0
        assert row["shard_map_fwd_kernels"] == {"jflash_mosaic_fwd": 1.5, "copy": 0.25}
        assert row["direct_fwdbwd_device_ms"] == 1.75
    assert traced == [3, 3, 4, 4] * 2  # each call's forward, then forward+backward
    assert "shard_map/direct_fwd" in capsys.readouterr().out
    for bad, named in ((["--shapes", "causal:64"], "causal:64"), (["--rounds", "0"], "0")):
        with pytest.raises(SystemExit):
            in_shard_map.main([*bad, "--interpret"])
        assert named in capsys.readouterr().err


# ----------------------------------------------------------------------------------
# The GPU benchmarks without a GPU: one line and exit status 2 unless --interpret

GPU_BENCHMARKS = [
    ["kernel.py"],
    ["ab.py", "--rev", "HEAD"],
    ["ring.py"],
    ["ring_blocks.py"],
    ["mosaic_smoke.py", "fwd"],
    ["in_shard_map.py"],
    ["accuracy.py"],
]


@pytest.mark.parametrize("command", GPU_BENCHMARKS, ids=lambda c: c[0])
def test_gpu_benchmarks_without_a_gpu_refuse_in_one_line(command):
    """Run as a user would on a machine without a GPU, a benchmark that times GPU kernels
    stops at once, before compiling anything (`JAX_LOG_COMPILES=1` would log any compile
    on stderr), in one line naming it and `--interpret`, with exit status 2: not a slow
    interpreted run ending in a table that looks like a benchmark's."""
    script, *argv = command
    if script == "ab.py" and not (ROOT / ".git").exists():
        pytest.skip("not a git checkout (ab.py --rev checks the revision first)")
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_LOG_COMPILES="1")
    run = subprocess.run(
        [sys.executable, f"benchmarks/{script}", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2, run.stderr[-2000:]
    (line,) = run.stderr.strip().splitlines()
    assert line.startswith(f"benchmarks/{script} times GPU kernels: no GPU found (jax backend")
    assert "pass --interpret to run the same code in Pallas interpret mode" in line
    assert run.stdout == ""


def test_gpu_or_interpret_on_each_kind_of_machine(monkeypatch, capsys):
    """`common.gpu_or_interpret`: on a GPU nothing to mark (with `--interpret` a line
    saying the kernels run compiled); without one, `--interpret` gives the note that
    `table` prints above the table and `write_json` keeps, and no flag exits 2."""
    from benchmarks import common

    monkeypatch.setattr(common.jax, "default_backend", lambda: "gpu")
    assert common.gpu_or_interpret("x.py", False) is None
    assert capsys.readouterr().out == ""
    assert common.gpu_or_interpret("x.py", True) is None
    assert "--interpret: this machine has a GPU" in capsys.readouterr().out

    monkeypatch.setattr(common.jax, "default_backend", lambda: "cpu")
    with pytest.raises(SystemExit) as exit_:
        common.gpu_or_interpret("x.py", False)
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert line.startswith("x.py times GPU kernels: no GPU found (jax backend 'cpu')")
    assert captured.out == ""
    note = common.gpu_or_interpret("x.py", True)
    assert capsys.readouterr().out.strip() == note
    assert note.startswith("interpreted: no GPU (jax backend 'cpu')") and "not GPU kernel" in note
    assert common.table([{"a": 1}], ["a"], note).splitlines()[0] == note
    assert common.table([{"a": 1}], ["a"]).splitlines()[0] == "| a |"


def test_sweep_replot_needs_no_gpu_and_keeps_the_mark(monkeypatch, tmp_path):
    """`kernel.py --sweep-replot` times nothing: it runs without a GPU and without
    `--interpret`, and the figure of an interpreted sweep says so."""
    drawn = []
    monkeypatch.setattr(kernel, "plot_sweep", lambda axes, device, png: drawn.append(device))
    path = tmp_path / "kernel-sweep-cpu.json"
    path.write_text(json.dumps({"device": "cpu", "interpreted": True, "seq_len": []}))
    kernel.main(["--sweep-replot", str(path)])
    assert drawn == ["cpu (interpreted, no GPU: not kernel times)"]


def test_write_json_marks_an_interpreted_run(tmp_path):
    from benchmarks import common

    common.write_json(str(tmp_path / "a.json"), {"rows": []}, note="interpreted: ...")
    marked = json.loads((tmp_path / "a.json").read_text())
    assert marked["interpreted"] is True and marked["interpreted_note"] == "interpreted: ..."
    common.write_json(str(tmp_path / "b.json"), {"rows": []})
    assert "interpreted" not in json.loads((tmp_path / "b.json").read_text())


def test_write_json_records_the_checkout_commit(tmp_path, monkeypatch):
    """Results name the commit they ran on and whether tracked files differed from it
    (`changed`: code no commit holds); outside a git checkout, neither."""
    from benchmarks import common

    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    common.write_json(str(tmp_path / "a.json"), {"rows": []})
    written = json.loads((tmp_path / "a.json").read_text())
    assert written["commit"] == head and isinstance(written["changed"], bool)

    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(common.subprocess, "Popen", no_git)
    common.write_json(str(tmp_path / "b.json"), {"rows": []})
    assert "commit" not in json.loads((tmp_path / "b.json").read_text())


# nvdisasm -bbcfg's form: a block's instructions in its DOT label, `\l` between lines and
# `\ ` for spaces; an outer loop (.L_x_1 .. .L_x_2) round an inner one (.L_x_2 alone).
SASS_DOT = (pathlib.Path(__file__).parent / "data" / "sass-bbcfg.dot").read_text()


def test_sass_loops_count_each_pass():
    """`benchmarks/sass.py` finds the natural loops of nvdisasm's block graph, nested,
    and counts one pass's wgmmas, SFU ops, spills and barriers per loop."""
    from benchmarks import sass

    entry, blocks, succ = sass.parse_cfg(SASS_DOT)
    assert entry == "k" and blocks[".L_x_1"] == ["HGMMA.64x64x16.F32.BF16", "MUFU.EX2"]
    assert sass.natural_loops(entry, succ) == {
        ".L_x_2": {".L_x_2"},
        ".L_x_1": {".L_x_1", ".L_x_2"},
    }
    outer, inner = sass.loop_rows("k", SASS_DOT)
    assert outer == dict(
        kernel="k", loop=".L_x_1", depth=1, blocks=2, instructions=6,
        hgmma=1, mufu=1, ldl=1, stl=1, barriers=1, warpgroup=0,
    )  # fmt: skip
    assert (inner["loop"], inner["depth"], inner["instructions"]) == (".L_x_2", 2, 4)
    assert (inner["hgmma"], inner["ldl"], inner["stl"]) == (0, 1, 1)
    with pytest.raises(ValueError, match="no basic blocks"):
        sass.parse_cfg("digraph f {}")


# nvdisasm -c's form, two functions: in "outer", a loop (.L_x_1, back by a predicated
# branch) holding an inner one (.L_x_2) and a forward jump over a block; "other" exits.
SASS_TEXT = """
        .section        .text.outer,"ax",@progbits
outer:
        /*0000*/                   S2R R0, SR_TID.X ;
.L_x_1:
        /*0010*/                   HGMMA.64x64x16.F32.BF16 gdesc[UR4], RZ, !UPT ;
.L_x_2:
        /*0020*/                   MUFU.EX2 R1, R1 ;
        /*0030*/               @P0 BRA `(.L_x_2) ;
        /*0040*/                   BRA `(.L_x_3) ;
        /*0050*/                   FSEL R2, R2, RZ, P1 ;
.L_x_3:
        /*0060*/                   FSEL R3, R3, RZ, P1 ;
        /*0070*/              @!P1 BRA `(.L_x_1) ;
        /*0080*/                   EXIT ;
        .section        .text.other,"ax",@progbits
other:
        /*0000*/                   EXIT ;
"""


def test_sass_loops_from_plain_disassembly():
    """Where nvdisasm draws no block graph (cubins of other toolchains), `sass.py`
    builds one per function from the plain disassembly's labels and branches: a
    predicated branch falls through, an unconditional one and an exit do not."""
    from benchmarks import sass

    cfgs = sass.text_cfgs(SASS_TEXT)
    assert list(cfgs) == ["outer", "other"]
    entry, blocks, succ = cfgs["outer"]
    assert sass.natural_loops(entry, succ) == {
        ".L_x_2": {".L_x_2"},
        ".L_x_1": {".L_x_1", ".L_x_2", "outer+3", ".L_x_3"},
    }
    assert blocks["outer+4"] == ["FSEL"] and succ["outer+4"] == [".L_x_3"]  # jumped over
    outer, inner = sass.loop_rows("k", cfgs["outer"], opcodes=True)
    assert (outer["instructions"], outer["hgmma"], outer["mufu"]) == (6, 1, 1)
    assert outer["opcodes"] == {"BRA": 3, "FSEL": 1, "HGMMA": 1, "MUFU": 1}
    assert (inner["loop"], inner["depth"], inner["instructions"]) == (".L_x_2", 2, 2)
    assert sass.loop_rows("k", cfgs["other"], everything=True) == []


def test_sass_refuses_missing_files_and_tools(tmp_path, capsys):
    from benchmarks import sass

    with pytest.raises(SystemExit):
        sass.main([str(tmp_path / "none.ptx")])
    assert "none.ptx" in capsys.readouterr().err
    ptx = tmp_path / "k.ptx"
    ptx.write_text("")
    with pytest.raises(SystemExit, match="--nvdisasm='/no/nvdisasm': no such file"):
        sass.main([str(ptx), "--nvdisasm", "/no/nvdisasm"])


TINY_PTX = """.version 8.0
.target sm_90a
.address_size 64
.visible .entry tiny(.param .u64 out, .param .u32 n)
{
    .reg .b32 %r<4>;
    .reg .b64 %rd<2>;
    .reg .f32 %f<2>;
    .reg .pred %p<2>;
    ld.param.u64 %rd1, [out];
    ld.param.u32 %r1, [n];
    mov.u32 %r2, 0;
    mov.f32 %f1, 0f3F800000;
LOOP:
    ex2.approx.ftz.f32 %f1, %f1;
    add.s32 %r2, %r2, 1;
    setp.lt.u32 %p1, %r2, %r1;
    @%p1 bra LOOP;
    st.global.f32 [%rd1], %f1;
    ret;
}
"""


def test_sass_reads_a_kernel_assembled_here(tmp_path, capsys):
    """With ptxas and nvdisasm installed: a PTX loop of exponentials assembles, and its
    loop shows its MUFU and no spill."""
    from benchmarks import sass

    try:
        tools = [sass.find_tool("ptxas", None), sass.find_tool("nvdisasm", None)]
    except SystemExit as e:
        pytest.skip(str(e))
    ptx = tmp_path / "tiny.ptx"
    ptx.write_text(TINY_PTX)
    out = tmp_path / "sass.json"
    argv = [str(ptx), "--ptxas", tools[0], "--nvdisasm", tools[1], "--out", str(out)]
    assert sass.main(argv) == 0
    written = json.loads(out.read_text())
    assert written["kernels"][0]["spill_stores"] == 0
    assert written["kernels"][0]["serialised"] == []
    assert any(r["mufu"] >= 1 and r["ldl"] == r["stl"] == 0 for r in written["rows"])
    assert "tiny: " in capsys.readouterr().out


@pytest.mark.slow
def test_kernel_modules_tell_a_kernel_change_from_a_refactor(tmp_path, monkeypatch, capsys):
    """`benchmarks/kernel_modules.py` on CPU: HEAD against HEAD (exported twice, as the
    tree may hold edits) builds the same kernels; the same tree with its masked forward
    steps back on `visible` (`HIDE_KEYS` off) builds another forward kernel and the same
    dK/dV kernel, and `--diff` writes both forward texts."""
    import importlib

    from benchmarks import ab, kernel_modules

    try:
        subprocess.run(["git", "-C", ab.ROOT, "rev-parse", "HEAD"], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")

    def forget_exports():  # each run imports both sides afresh
        for name in (ab.TREE, ab.BASELINE):
            for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                monkeypatch.delitem(sys.modules, mod)

    def committed_tree(dest, *, hide_keys=True):
        sys.path.insert(0, ab.export_revision("HEAD", dest, ab.TREE))
        pkg = importlib.import_module(ab.TREE)
        monkeypatch.setattr(sys.modules[f"{ab.TREE}._mosaic_fwd"], "HIDE_KEYS", hide_keys)
        return pkg

    argv = ["--rev", "HEAD", "--shapes", "causal:256:64", "--heads", "2", "--kv-heads", "1"]
    forget_exports()
    monkeypatch.setattr(ab, "import_tree", committed_tree)
    assert kernel_modules.main([*argv, "--out", str(tmp_path / "same.json")]) == 0
    rows = json.loads((tmp_path / "same.json").read_text())["rows"]
    assert [(r["kernel"], r["result"]) for r in rows] == [
        ("jflash_mosaic_fwd", "same"),
        ("jflash_mosaic_dkv", "same"),
    ]

    forget_exports()
    monkeypatch.setattr(ab, "import_tree", lambda dest: committed_tree(dest, hide_keys=False))
    out, diff = tmp_path / "changed.json", tmp_path / "diff"
    assert kernel_modules.main([*argv, "--out", str(out), "--diff", str(diff)]) == 0
    fwd, dkv = json.loads(out.read_text())["rows"]
    assert fwd["kernel"] == "jflash_mosaic_fwd" and fwd["result"].startswith("differs: ")
    assert dkv == {"shape": "causal:256:64", "kernel": "jflash_mosaic_dkv", "result": "same"}
    stem = diff / "causal-256-64-jflash_mosaic_fwd"
    tree_text = pathlib.Path(f"{stem}.tree.mlir").read_text()
    assert tree_text != pathlib.Path(f"{stem}.rev.mlir").read_text()
    assert "| causal:256:64 | jflash_mosaic_dkv | same |" in capsys.readouterr().out
    assert kernel_modules.compare([("a", "x")], []) == [
        {"kernel": "a", "result": "only in the tree"}
    ]
    assert kernel_modules.compare([("a", "x")], [("b", "x")])[0]["result"] == (
        "the tree builds a where the revision builds b"
    )


# ----------------------------------------------------------------------------------
# benchmarks/accuracy.py: implementations against float64 over long rows of keys


def test_accuracy_reference_is_float64_attention(tmp_path, capsys, monkeypatch):
    """`accuracy.compare`'s float64 reference, built in chunks of keys (the last one
    ragged), against jflash's f32 oracle on the same bf16 values: within f32 rounding,
    with no bias; then the CLI in interpret mode on a short row (the kernels' errors at
    bf16 rounding, their bias near zero), a missing peer as a row saying why, and bad
    flags refused by name."""
    from benchmarks import accuracy

    args = accuracy.argparse.Namespace(seed=3, queries=24, heads=4, kv_heads=2, head_dim=64)
    q, k, v, do = accuracy.draw(300, args)
    oracle = accuracy.run(
        lambda q, k, v: jflash.attention_reference(q, k, v, causal=False)[0],
        *(x.astype(jnp.float32) for x in (q, k, v, do)),
    )
    (cells,) = accuracy.compare({"f32": oracle}, q, k, v, do, chunk=128, scale=64**-0.5).values()
    for t in accuracy.TENSORS:
        assert cells[f"{t}_err"] < 2e-5 and abs(cells[f"{t}_bias"]) < 1e-6, (t, cells)
    assert "nonfinite" not in cells
    # A NaN is counted, not skipped: max() over a NaN error would have read as 0.
    broken = (oracle[0], oracle[1].at[0, 3, 1, 5].set(jnp.nan), *oracle[2:])
    (cells,) = accuracy.compare({"nan": broken}, q, k, v, do, chunk=128, scale=64**-0.5).values()
    assert cells["nonfinite"] == "dq: 1" and cells["dq_err"] is None, cells
    assert cells["o_err"] < 2e-5, cells

    out = tmp_path / "accuracy.json"
    argv = ["--interpret", "--keys", "200", "--queries", "16", "--chunk", "64"]
    hide(monkeypatch, "flash_attn3_jax")  # a peer not installed: a row saying so
    rows = accuracy.main([*argv, "--impls", "jflash,fa3", "--out", str(out)])
    written = json.loads(out.read_text())
    # With a GPU, --interpret is set aside (the kernels run compiled) and not marked.
    interpreted = written.get("interpreted", False)
    assert interpreted == (jax.default_backend() != "gpu") and written["rows"] == rows
    kernel_row, missing = rows
    assert kernel_row["impl"] == "jflash" and "error" not in kernel_row
    for t in accuracy.TENSORS:
        assert kernel_row[f"{t}_err"] < 2e-2 and abs(kernel_row[f"{t}_bias"]) < 2e-3, kernel_row
    assert missing["impl"] == "fa3" and "not installed" in missing["error"]
    bad_flags = (
        (["--keys", "8k"], "'8k'"),
        (["--heads", "3", "--kv-heads", "2"], "--heads 3"),
        (["--impls", "jflash,no_such_peer"], "no_such_peer"),  # a typo: no row of errors
    )
    for bad, named in bad_flags:
        with pytest.raises(SystemExit):
            accuracy.main([*bad, "--interpret"])
        assert named in capsys.readouterr().err


def test_head_split_bench_shapes_and_shares(capsys):
    """The default shapes (causal launches of one wave or less, 2.5k, 3k and 4k x 8 KV
    heads, two batch rows of 2k, full 2k) each time a fixed share per KV head and jflash's own
    choice; a share that does not divide a shape's group is left out; bad shapes and
    shares are refused by name; without a GPU the script stops with status 2."""
    shapes = head_split.parse_shapes(head_split.SHAPES)
    got = [(s["seq"], s["kv_heads"], s["head_dim"], s["mask"], s["batch"]) for s in shapes]
    assert got == [
        (1024, 8, 128, "causal", 1),
        (2048, 8, 128, "causal", 1),
        (2560, 8, 128, "causal", 1),
        (3072, 8, 128, "causal", 1),
        (4096, 8, 128, "causal", 1),
        (8192, 2, 128, "causal", 1),
        (2048, 8, 128, "causal", 2),
        (2048, 8, 128, "full", 1),
        (1024, 8, 64, "causal", 1),
        (2048, 8, 64, "causal", 1),
        (3072, 8, 64, "causal", 1),
        (8192, 2, 64, "causal", 1),
    ]
    assert all(head_split.settings_of(s, [1]) == [("shares=1", 1), ("jflash", 0)] for s in shapes)
    six = head_split.parse_shapes("1024:12:2:128:causal")[0]
    assert head_split.settings_of(six, head_split.parse_shares("1,2,4,2,3")) == [
        ("shares=1", 1),
        ("shares=2", 2),
        ("shares=3", 3),
        ("jflash", 0),
    ]
    for bad in ("1024:32:8:128", "1024:32:8:128:sliding", "1024:32:5:128:causal", "x:1:1:64:full"):
        with pytest.raises(ValueError, match=f"--shapes item '{bad}'"):
            head_split.parse_shapes(bad)
    assert head_split.backward_ms({"fwd_ms": 1.0, "fwdbwd_ms": 3.5}) == 2.5
    assert head_split.backward_ms({"fwd_ms": 1.0, "fwdbwd_error": "out of memory"}) is None
    for bad in ("0", "1,x", "", "-2"):
        with pytest.raises(ValueError, match=f"--shares '{bad}'"):
            head_split.parse_shares(bad)
    if jax.default_backend() != "gpu":
        assert head_split.main([]) == 2
        assert "no GPU" in capsys.readouterr().out


def test_head_split_bench_keeps_the_rows_of_a_run_cut_short(monkeypatch, tmp_path):
    """The JSON is written after every row, `"complete": false` until the last: a run
    stopped part way (here the third timing raises) leaves the rows it timed."""
    calls = []

    def fake_measure(impl, **kwargs):
        calls.append((impl, kwargs["block_sizes"]))
        if len(calls) == 3:
            raise KeyboardInterrupt  # a time limit's kill, as far as the file is concerned
        return {"impl": impl, "fwd_ms": 1.0, "fwdbwd_ms": 3.0 + len(calls)}

    monkeypatch.setattr(head_split.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(head_split, "measure", fake_measure)
    monkeypatch.setattr(head_split, "device_name", lambda: "fake")
    argv = ["--shapes", "1024:4:1:64:causal", "--shares", "2", "--out", str(tmp_path)]
    with pytest.raises(KeyboardInterrupt):
        head_split.main(argv)
    assert not (tmp_path / "ab-head-split-fake.json").exists()  # beside it, until whole
    written = json.loads((tmp_path / "ab-head-split-fake.json.partial").read_text())
    assert written["complete"] is False
    assert [(r["setting"], r["bwd_ms"]) for r in written["rows"]] == [
        ("shares=2", 3.0),
        ("jflash", 4.0),
    ]
    assert calls[0][1].head_shares_dkv == 2 and calls[1][1] is None
    monkeypatch.setattr(head_split, "measure", lambda impl, **kw: {"impl": impl, "fwd_ms": 1.0})
    assert head_split.main(argv) == 0
    written = json.loads((tmp_path / "ab-head-split-fake.json").read_text())
    assert written["complete"] is True
    assert [r["setting"] for r in written["rows"]] == ["shares=2", "jflash", "fa3", "cudnn"]


def test_head_split_bench_rounds_time_each_shapes_rows_again(monkeypatch, tmp_path):
    """`--rounds N` hands each shape's rows, with the timers `measure` left, to
    `kernel.retime_rows` once the shape's rows are measured; `bwd_ms` and the ratios to
    FA3 and cuDNN come from the times it leaves. Without it no row is timed again."""
    retimed = []

    def fake_measure(impl, timers=None, **kwargs):
        timers[impl] = ("compiled", (), 1.0)
        shape = {"seq_len": kwargs["seq"], "head_dim": kwargs["head_dim"]}
        times = {"fwd_ms": 1.0, "fwdbwd_ms": 9.0, "fwd_tflops": 1.0, "fwdbwd_tflops": 1.0}
        return {"impl": impl, **shape, **times}

    def fake_retime(entries, rounds):
        retimed.append(([row["setting"] for row, _ in entries], rounds))
        for (row, timers), ms in zip(entries, (3.0, 2.5, 2.5, 3.0, 4.0), strict=True):
            assert timers  # what measure left
            row["fwdbwd_ms"], row["fwdbwd_tflops"] = ms, 1 / ms

    monkeypatch.setattr(head_split.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(head_split, "measure", fake_measure)
    monkeypatch.setattr(head_split, "retime_rows", fake_retime)
    monkeypatch.setattr(head_split, "device_name", lambda: "fake")
    shapes = ["--shapes", "1024:4:1:128:causal,2048:4:1:128:causal", "--shares", "1,2"]
    assert head_split.main([*shapes, "--rounds", "3", "--out", str(tmp_path)]) == 0
    settings = ["shares=1", "shares=2", "jflash", "fa3", "cudnn"]
    assert retimed == [(settings, 3), (settings, 3)]
    rows = json.loads((tmp_path / "ab-head-split-fake.json").read_text())["rows"]
    assert [r["bwd_ms"] for r in rows[:5]] == [2.0, 1.5, 1.5, 2.0, 3.0]
    assert rows[1]["fwdbwd_vs_fa3"] == pytest.approx(3.0 / 2.5)
    assert rows[1]["fwdbwd_vs_cudnn"] == pytest.approx(4.0 / 2.5)
    retimed.clear()
    assert head_split.main([*shapes, "--out", str(tmp_path)]) == 0
    assert retimed == []
    with pytest.raises(SystemExit):
        head_split.main([*shapes, "--rounds", "-1", "--out", str(tmp_path)])


# benchmarks/restart.py: cold start, resumes and the compilation cache (CPU, tiny model)


@pytest.mark.slow
def test_restart_benchmark_resumes_each_run_from_the_last_ones_sigterm(tmp_path, capsys):
    """Four trainer runs, each stopped by SIGTERM after its steps: the two resumes go on
    from the checkpoint the run before saved, the new run starts at step 1; the table
    and JSON hold one row each."""
    from benchmarks import restart

    out = tmp_path / "restart.json"
    argv = ["--model", "tiny", "--context", "64", "--steps", "3", "--save-every", "2"]
    assert restart.main([*argv, "--work", str(tmp_path / "w"), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [r["run"] for r in rows] == list(restart.RUNS)
    resumed = [line for line in text.splitlines() if line.startswith("resumed from step")]
    saved = [line for line in text.splitlines() if line.startswith("SIGTERM: saved")]
    assert len(saved) == 4 and len(resumed) == 2
    for save, resume in zip(saved[:2], resumed, strict=True):  # each resume its save's step
        assert save.split()[6] == resume.split()[3]
    for row in rows:
        assert 0 < row["to_first_step_s"] < row["wall_s"] and row["sigterm_to_exit_s"] > 0
        assert row["median_step_s"] <= row["slowest_step_s"]
        assert f"| {row['run']} |" in text
        # The trainer's own account of its stop (0.1 s each), inside the SIGTERM-to-exit time.
        # (No save in flight where the stop kept the one being written.)
        parts = [row.get(k, 0.0) for k in ("step_end_s", "in_flight_save_s", "save_s", "close_s")]
        assert min(parts) >= 0 and "save_s" in row  # a tiny model's save: 0.0 s rounded
        assert sum(parts) <= row["sigterm_to_exit_s"] + 0.2  # each rounded to 0.1 s
    assert "--compilation_cache_dir" not in rows[1]["command"]
    assert "--resume_from_checkpoint latest" in rows[2]["command"]


def test_write_json_keeps_the_last_whole_results_until_a_run_finishes(tmp_path, capsys):
    """A run's rows so far go beside its results file (`partial=True`), so a run cut
    short never replaces the last whole run's results; the whole run's write replaces
    them in one rename and removes the partial file."""
    from benchmarks.common import PARTIAL, write_json

    out = tmp_path / "r.json"
    write_json(str(out), {"rows": [1, 2]})
    write_json(str(out), {"rows": [3]}, partial=True)
    assert json.loads(out.read_text())["rows"] == [1, 2]
    partial = json.loads((tmp_path / f"r.json{PARTIAL}").read_text())
    assert partial["rows"] == [3] and partial["partial"] is True
    write_json(str(out), {"rows": [3, 4]})
    assert json.loads(out.read_text())["rows"] == [3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]  # no .partial, no .tmp
    assert f"wrote {out}{PARTIAL}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "script, argv, named",
    [
        ("balance", ["--shards", "0"], "--shards 0"),
        ("balance", ["--tokens-per-gpu", "100"], "--tokens-per-gpu 100"),
        ("balance", ["--mean-doc", "0"], "--mean-doc 0"),
        ("balance", ["--out", f"{__file__}/b.json"], "is a file, not a directory"),
        ("cp_model", ["--gpus", "0"], "--gpus 0"),
        ("cp_model", ["--kernel-tflops", "0"], "--kernel-tflops 0.0"),
        ("cp_model", ["--q-heads", "32", "--kv-heads", "5"], "--q-heads 32"),
        ("cp_model", ["--latency-us", "-1"], "--latency-us -1.0: must be at least 0"),
        ("accuracy", ["--interpret", "--impls", "jflsh"], "jflsh"),
        ("in_shard_map", ["--interpret", "--heads", "4", "--kv-heads", "3"], "--heads 4"),
        ("in_shard_map", ["--interpret", "--shapes", "causal:0:64"], "causal:0:64"),
        ("peer_repeat", ["--seqs", "1000"], "--seqs 1000"),
        ("ring_blocks", ["--interpret", "--implementation", "mosiac"], "'mosiac'"),
    ],
)
def test_scripts_refuse_bad_values_in_one_line_before_any_work(script, argv, named, capsys):
    """Each script refuses a value it cannot run (exit status 2, one line naming it)
    before it computes or writes anything, instead of a traceback or an empty table."""
    module = __import__(f"benchmarks.{script}", fromlist=["main"])
    with pytest.raises(SystemExit) as stop:
        module.main(argv)
    assert stop.value.code == 2
    assert named in capsys.readouterr().err.strip().splitlines()[-1]


def test_peer_repeat_without_flash_attn3_fails_instead_of_passing(monkeypatch, capsys):
    """With nothing to check, the FA3 repeat check ends with status 2, not 0."""
    from benchmarks import peer_repeat

    hide(monkeypatch, "flash_attn3_jax")
    with pytest.raises(SystemExit) as stop:
        peer_repeat.main([])
    assert stop.value.code == 2 and "needs flash-attn3-jax" in capsys.readouterr().err


def test_benchmark_and_tool_flags_are_spelled_with_dashes():
    """One vocabulary outside `python -m train` (whose flags follow HF's Trainer): the
    benchmark scripts and trainer tools spell their flags with dashes."""
    root = pathlib.Path(__file__).resolve().parent.parent
    files = [
        *sorted((root / "benchmarks").glob("*.py")),
        *sorted((root / "train" / "tools").glob("*.py")),
    ]
    underscored = [
        f"{path.name}: {flag}"
        for path in files
        for flag in re.findall(r"add_argument\(\s*\"(--[a-z0-9-]*_[a-z0-9_-]*)\"", path.read_text())
    ]
    assert files and not underscored


def test_deviceless_refuses_bad_shapes_and_a_missing_plugin(tmp_path, capsys):
    """`benchmarks/deviceless.py` says in one line what it needs: a shape it can read,
    and the CUDA plugin's wheels (the command that installs them)."""
    from benchmarks import deviceless

    with pytest.raises(SystemExit):
        deviceless.main(["--shapes", "causal:4k:64"])
    assert "'causal:4k:64': SEQ and HEAD_DIM must be integers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        deviceless.main(["--shapes", "sliding:4096:64"])
    assert (
        "is not causal|full|documents|ring|ring-documents:SEQ:HEAD_DIM" in capsys.readouterr().err
    )
    with pytest.raises(SystemExit, match="pip install --no-deps --target .*jax-cuda13-pjrt"):
        deviceless.main(["--plugin-dir", str(tmp_path / "none")])


DEVICELESS_PLUGIN = ROOT / ".deviceless"


@pytest.mark.slow
@pytest.mark.skipif(
    not (DEVICELESS_PLUGIN / "jax_plugins").is_dir() or shutil.which("ptxas") is None,
    reason="no CUDA plugin in .deviceless (benchmarks/deviceless.py says how) or no ptxas",
)
def test_deviceless_compiles_the_kernels_for_an_h100(tmp_path):
    """Without a GPU, the forward and dK/dV kernels of a causal call compile for an H100,
    and ptxas finds that neither spills at D = 64 (the step loops' registers fit); with
    segment ids the forward's two kernels (the id compare, then the spans) compile too;
    so do a zigzag ring rank's three blocks, whose half blocks' dK/dV kernels (no mask,
    f32 gradients) spill nothing, and the same rank over packed documents, with half
    blocks of one query tile, where no launch gets the buffer it writes in place (the
    work items' counter) as another operand: XLA had merged it with the constant order
    of a single tile (the run stops on that)."""
    out = tmp_path / "deviceless.json"
    run = subprocess.run(
        [
            sys.executable,
            "benchmarks/deviceless.py",
            "--shapes",
            "causal:512:64,documents:512:64,ring:512:128,ring-documents:256:128",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    by_shape = {}
    for r in rows:
        by_shape.setdefault(r["shape"], []).append(r)
    kernels = sorted(r["kernel"].rsplit("_", 1)[0] for r in by_shape["causal:512:64"])
    assert kernels == ["jflash_mosaic_dkv", "jflash_mosaic_fwd"]
    packed = sorted(r["kernel"].rsplit("_", 1)[0] for r in by_shape["documents:512:64"])
    assert packed == ["jflash_mosaic_dkv", "jflash_mosaic_fwd", "jflash_mosaic_fwd"]
    assert all(r["registers"] for r in rows)
    dense = by_shape["causal:512:64"]
    assert [(r["kernel"], r["spill_stores"]) for r in dense if r["spill_stores"]] == []
    ring = sorted(
        (r["kernel"].rsplit("_", 1)[0], r["spill_stores"]) for r in by_shape["ring:512:128"]
    )
    assert [k for k, _ in ring] == ["jflash_mosaic_dkv"] * 3 + ["jflash_mosaic_fwd"] * 3
    assert sorted(spills for k, spills in ring if k == "jflash_mosaic_dkv")[:2] == [0, 0]
    packed_ring = sorted(r["kernel"].rsplit("_", 1)[0] for r in by_shape["ring-documents:256:128"])
    assert packed_ring == ["jflash_mosaic_dkv"] * 3 + ["jflash_mosaic_fwd"] * 6
