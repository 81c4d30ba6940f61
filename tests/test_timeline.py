"""`benchmarks/timeline.py` on CPU: the trace analysis on a made-up trace, its flags, and
the profiler switch the Mosaic kernels are built with (the profile itself needs a GPU)."""

import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jflash
from benchmarks import timeline
from jflash import _mosaic_common, _mosaic_fwd
from jflash._timeline import DEFAULT_SPACE, TIMELINE_KERNELS


def scope(events, tid, name, start, cycles):
    """A "B"/"E" pair of `name`, `cycles` long from `start` (cycles), in the profiler's
    units (`ts` = cycles / 1000)."""
    events.append({"name": name, "ph": "B", "ts": start / 1000, "tid": tid, "pid": 1})
    events.append({"name": name, "ph": "E", "ts": (start + cycles) / 1000, "tid": tid, "pid": 1})
    return start + cycles


def warpgroup(events, tid, items, steps, gap_extra=0):
    """`items` work items of `steps` steps each, in cycles: q_wait 10; per step s_wait 5,
    softmax 100, turn 20 and 75 to issue the matmuls (200 in all); then ticket 30 (+
    `gap_extra` cycles of unscoped epilogue) before the next item's q_wait."""
    t = 0
    for _ in range(items):
        t = scope(events, tid, "q_wait", t, 10)
        for _ in range(steps):
            for name, cycles in (("s_wait", 5), ("softmax", 100), ("turn", 20), ("issue", 75)):
                t = scope(events, tid, name, t, cycles)
        t = scope(events, tid, "ticket", t, 30) + gap_extra
    scope(events, tid, "q_wait", t, 10)  # the next item, cut off by the profiler's space


def test_analyse_counts_steps_gaps_and_shares():
    events = []
    warpgroup(events, 1, items=3, steps=4)
    warpgroup(events, 2, items=3, steps=4, gap_extra=60)
    r = timeline.analyse(events, **jflash.KERNEL_SCOPES["fwd"])
    assert r["warpgroup_items"] == 6  # the cut-off item is left out
    assert r["steps"] == 24 and r["steps_per_item"] == 4
    assert r["step_cycles"] == pytest.approx(200)
    assert r["cycles_per_step"]["softmax"] == pytest.approx(100)
    assert r["cycles_per_item"] == {"q_wait": pytest.approx(10), "ticket": pytest.approx(30)}
    # Gap: ticket 30 (+ 60 on the second warpgroup) + the next q_wait 10; two per trace.
    assert r["item_gap_cycles"] == pytest.approx((40 + 100) / 2)
    # Spans: to the end of each trace's last kept ticket, 3 items of 840 cycles (+ 60
    # after each but the last on the second warpgroup).
    span = 3 * 840 + (3 * 840 + 2 * 60)
    assert r["in_steps"] == pytest.approx(2 * 3 * 4 * 200 / span)
    assert r["item_gap_share"] == pytest.approx(70 / (70 + 4 * 200))
    assert r["unknown_scopes"] == []


def test_analyse_reports_scopes_it_does_not_know_and_refuses_a_bad_trace():
    events = []
    scope(events, 1, "Init", -50, 7)  # before the first item
    warpgroup(events, 1, items=2, steps=1)
    r = timeline.analyse(events, _mosaic_fwd.STEP_SCOPES, _mosaic_fwd.ITEM_SCOPES)
    assert r["unknown_scopes"] == ["Init"]
    with pytest.raises(ValueError, match="no finished work item"):
        timeline.analyse(events[:4], _mosaic_fwd.STEP_SCOPES)
    bad = [
        {"name": "issue", "ph": "B", "ts": 0.0, "tid": 1},
        {"name": "softmax", "ph": "E", "ts": 0.1, "tid": 1},
    ]
    with pytest.raises(ValueError, match="unbalanced"):
        timeline.analyse([*bad, *events], _mosaic_fwd.STEP_SCOPES)


def test_analyse_takes_a_dkv_trace_as_one_item_per_warpgroup():
    events = []
    for tid in (1, 2):
        t = 0
        for _ in range(3):  # three steps, one key tile
            for name, cycles in (("in_wait", 10), ("s_wait", 40), ("exp", 150), ("dq", 100)):
                t = scope(events, tid, name, t, cycles)
    r = timeline.analyse(events, **jflash.KERNEL_SCOPES["dkv"])
    assert r["warpgroup_items"] == 2 and r["steps"] == 6 and r["steps_per_item"] == 3
    assert r["step_cycles"] == pytest.approx(300)
    assert r["cycles_per_step"]["exp"] == pytest.approx(150)
    assert r["item_gap_cycles"] is None and r["item_gap_share"] is None
    assert r["in_steps"] == pytest.approx(1.0)


def test_shapes_and_flags(tmp_path):
    assert timeline.parse_shapes("causal:4096:128,documents:16384:64") == [
        ("causal", 4096, 128),
        ("documents", 16384, 64),
    ]
    with pytest.raises(ValueError, match="'sliding:4096:128'"):
        timeline.parse_shapes("sliding:4096:128")
    with pytest.raises(ValueError, match="must be positive"):
        timeline.parse_shapes("full:0:128")
    bad = (
        ["--heads", "12", "--kv-heads", "5"],
        ["--space", "0"],
        ["--shapes", "x"],
        ["--kernel", "dq"],
    )
    for argv in bad:
        with pytest.raises(SystemExit):
            timeline.main(argv)
    # On a machine without a GPU it says so instead of failing inside the profiler.
    if jax.devices()[0].platform != "gpu":
        with pytest.raises(SystemExit):
            timeline.main(["--shapes", "causal:256:64", "--out", str(tmp_path / "t.json")])


@pytest.mark.parametrize(
    "space, shown", [([], "--space default"), (["--space", "900"], "--space 900")]
)
def test_a_profiler_buffer_that_does_not_fit_is_a_flag_error(monkeypatch, capsys, space, shown):
    """Mosaic's shared-memory error while the kernel lowers becomes a one-line flag error
    naming --space (here on a stand-in GPU: the profiled call raises it)."""

    def too_big(*args, **kwargs):
        raise ValueError("Mosaic GPU kernel exceeds available shared memory: smem_bytes=1")

    monkeypatch.setattr(jax, "devices", lambda: [types.SimpleNamespace(platform="gpu")])
    monkeypatch.setattr(timeline, "profile_shape", too_big)
    with pytest.raises(SystemExit):
        timeline.main(["--kernel", "dkv", "--shapes", "causal:4096:64", *space])
    err = capsys.readouterr().err
    assert f"causal:4096:64: the profiler's ranges per warpgroup ({shown})" in err
    assert "do not fit beside the dkv kernel's shared memory; lower --space" in err


def test_profiling_switch_reaches_only_the_named_kernels(tmp_path):
    plain = _mosaic_common._compiler_params("jflash_mosaic_fwd")
    assert not plain.profile_space and not plain.profile_dir and plain.approx_math
    with _mosaic_common.profiling(str(tmp_path), {"jflash_mosaic_fwd": 64}):
        on = _mosaic_common._compiler_params("jflash_mosaic_fwd")
        assert (on.profile_space, on.profile_dir) == (64, str(tmp_path))
        assert on.approx_math and on.reduction_scratch_bytes == 0
        assert not _mosaic_common._compiler_params("jflash_mosaic_dkv").profile_space
        with _mosaic_common.profiling(str(tmp_path / "inner"), {"jflash_mosaic_dkv": 32}):
            assert _mosaic_common._compiler_params("jflash_mosaic_dkv").profile_space == 32
            assert not _mosaic_common._compiler_params("jflash_mosaic_fwd").profile_space
        assert _mosaic_common._compiler_params("jflash_mosaic_fwd").profile_space == 64
    assert _mosaic_common._compiler_params("jflash_mosaic_fwd") == plain
    # The GPU interpreter records no timeline: it says so, and gets no profiler buffer.
    with _mosaic_common.profiling(str(tmp_path), {"jflash_mosaic_fwd": 64}):
        with pytest.warns(UserWarning, match="GPU interpreter here, which records no timeline"):
            interpreted = _mosaic_common._compiler_params("jflash_mosaic_fwd", interpret=True)
    assert interpreted == plain


def test_kernel_timeline_warns_when_no_kernel_of_it_was_built(tmp_path):
    """A block inside which none of its kernels was built for the GPU (here: CPU, where
    flash_attention runs another implementation) says it will write nothing."""
    q = jnp.ones((1, 64, 2, 64), jnp.float32)
    with pytest.warns(UserWarning, match=r"no kernel of kernels=\('fwd', 'dkv'\) was built"):
        with jflash.kernel_timeline(tmp_path, kernels=("fwd", "dkv")):
            jax.block_until_ready(
                jflash.flash_attention(q, q, q, causal=True, implementation="xla")
            )
    assert not list(tmp_path.iterdir())
    # A block that built one of them does not warn, and an error inside it is not masked.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with jflash.kernel_timeline(tmp_path, kernels="dkv"):
            _mosaic_common._compiler_params("jflash_mosaic_dkv")
        with pytest.raises(KeyError):
            with jflash.kernel_timeline(tmp_path):
                raise KeyError("inside")


def test_kernel_timeline_names_kernels_by_their_short_names(tmp_path):
    with jflash.kernel_timeline(tmp_path, kernels="dkv", space=32):
        assert _mosaic_common._compiler_params("jflash_mosaic_dkv").profile_space == 32
        assert not _mosaic_common._compiler_params("jflash_mosaic_fwd").profile_space
    with jflash.kernel_timeline(tmp_path, kernels=("fwd", "dkv")):
        for name in ("jflash_mosaic_fwd", "jflash_mosaic_dkv"):
            assert _mosaic_common._compiler_params(name).profile_dir == str(tmp_path)
    assert not _mosaic_common._compiler_params("jflash_mosaic_dkv").profile_space
    # By default each kernel keeps what fits beside its shared memory
    # (tests/test_lowering.py lowers them with it).
    with jflash.kernel_timeline(tmp_path, kernels=("fwd", "dkv"), space=None):
        for short, name in TIMELINE_KERNELS.items():
            space = _mosaic_common._compiler_params(name).profile_space
            assert space == DEFAULT_SPACE[short], short
    assert DEFAULT_SPACE["dkv"] < DEFAULT_SPACE["fwd"]
    with jflash.kernel_timeline(tmp_path, kernels="fwd", space=np.int64(96)):
        assert _mosaic_common._compiler_params("jflash_mosaic_fwd").profile_space == 96
    for bad in (0, -3, 2.5, True, "480"):
        with pytest.raises(ValueError, match="must be a positive int"):
            with jflash.kernel_timeline(tmp_path, space=bad):
                pass
    for bad in ("dq", (), ("fwd", "bwd")):
        with pytest.raises(ValueError, match="name one or more of fwd, dkv"):
            with jflash.kernel_timeline(tmp_path, kernels=bad):
                pass
    for kernel, scopes in jflash.KERNEL_SCOPES.items():
        assert scopes["step_begins"] in scopes["step"], kernel
        assert scopes["item_begins"] is None or scopes["item_begins"] in scopes["item"]
        assert scopes["gap_from"] is None or scopes["gap_from"] in scopes["step"]


def test_kernel_timeline_says_its_default_space():
    """The docstring names the ranges each kernel keeps by default (it once named a
    private constant)."""
    doc = " ".join(jflash.kernel_timeline.__doc__.split())
    assert f'None: {DEFAULT_SPACE["fwd"]} for "fwd" and {DEFAULT_SPACE["dkv"]} for "dkv"' in doc
