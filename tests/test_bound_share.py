"""`benchmarks/bound_share.py`: its replay of the Mosaic forward's bounded row max (which
warps keep their max, step by step) on inputs whose answer is known, its refusals, and a
checkpoint's layers on text."""

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks import bound_share
from jflash import _mosaic_fwd

REPO = Path(__file__).resolve().parents[1]


def normal_head(t=512, d=64, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((t, d)).astype(np.float32)
    k = rng.standard_normal((t, d)).astype(np.float32)
    return q, k


def test_causal_counts_follow_the_warpgroups_steps():
    """Causal 512 x 512 in 128-key steps: warpgroup r0 (every 64 rows) runs its
    `(r0 + 1) // 128` whole steps unmasked (0, 0, 1, 1, 2, 2, 3, 3: 12), four warps
    each; the first of each (six warpgroups have one) takes the max, every later one
    keeps it on normal inputs (the bound, 64 below, is far under the running max)."""
    q, k = normal_head()
    unmasked, kept, firsts, whole = bound_share.head_share(
        q, k, causal=True, block_kv=128, slack=64.0
    )
    assert (unmasked, firsts, kept, whole) == (48, 24, 24, 24)


def test_one_warp_whose_bound_is_loose_takes_its_max():
    """Rows 256-271 (one warp of the warpgroup at 256, whose second step is its only
    decided one) with queries 16x: that warp takes the max there, every other keeps it,
    and its warpgroup's three other warps keep theirs alone (20 warp-steps in whole
    warpgroups). The same rows with a slack past their bound keep theirs."""
    q, k = normal_head()
    q[256:272] *= 16
    assert bound_share.head_share(q, k, causal=True, block_kv=128, slack=64.0) == (48, 23, 24, 20)
    assert bound_share.head_share(q, k, causal=True, block_kv=128, slack=1e4) == (48, 24, 24, 24)


def test_full_rows_decide_every_step_but_the_first_and_the_peeled_last():
    """Full 256 x 1024 in 256-key steps: four steps, the last peeled with the mask, the
    first taking the max: 3 unmasked steps x 16 warps, 2 x 16 kept; with every query
    16x the normal draw, none (as `ab.py --q-scale 16` times it)."""
    q, k = normal_head(t=1024)
    q = q[:256]
    assert bound_share.head_share(q, k, causal=False, block_kv=256, slack=64.0) == (48, 32, 16, 32)
    assert bound_share.head_share(16 * q, k, causal=False, block_kv=256, slack=64.0) == (
        48,
        0,
        16,
        0,
    )


def test_the_replayed_choices_are_the_kernels():
    """The script's copies of the kernel's slack, three-warpgroup rule and keys per
    step (it may import only jflash's facade)."""
    import jax.numpy as jnp

    from jflash._block_sizes import mosaic_block_sizes

    assert {jnp.dtype(k).name: v for k, v in _mosaic_fwd.BOUND_SLACK.items()} == bound_share.SLACK
    assert tuple(_mosaic_fwd.THREE_WG_HEAD_DIMS) == bound_share.THREE_WG_HEAD_DIMS
    assert _mosaic_fwd.THREE_WG_MIN_LEN == bound_share.THREE_WG_MIN_LEN
    assert _mosaic_fwd.THREE_WG_MIN_LEN_FULL == bound_share.THREE_WG_MIN_LEN_FULL
    assert _mosaic_fwd.FULL_BLOCK_KV == bound_share.FULL_BLOCK_KV
    assert {
        jnp.dtype(k).name: tuple(v) for k, v in _mosaic_fwd.BOUND_HEAD_DIMS.items()
    } == bound_share.HEAD_DIMS
    assert _mosaic_fwd.BOUNDED_MAX
    for head_dim in (64, 128):
        assert bound_share.keys_per_step(head_dim, 4096, True) == (
            mosaic_block_sizes(head_dim).block_kv
        )


def test_keys_per_step_are_the_kernels():
    assert bound_share.keys_per_step(64, 4096, True) == 256
    assert bound_share.keys_per_step(64, _mosaic_fwd.THREE_WG_MIN_LEN, True) == 128
    assert bound_share.keys_per_step(64, _mosaic_fwd.THREE_WG_MIN_LEN_FULL, False) == 128
    assert bound_share.keys_per_step(128, 4096, True) == 128
    assert bound_share.keys_per_step(128, 4096, False) == _mosaic_fwd.FULL_BLOCK_KV[128]


def test_normal_rows_table_and_json(tmp_path, capsys):
    out = tmp_path / "share.json"
    bound_share.main(["--shapes", "causal:1024:64,full:512:128", "--heads", "2", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["keys_per_step"] for r in rows] == [256, 160]
    assert [r["kept_after_first"] for r in rows] == [1.0, 1.0]
    assert [r["kept_whole_warpgroup"] for r in rows] == [r["kept"] for r in rows]
    assert rows[0]["kept"] < 1.0 and rows[0]["heads"] == 2
    assert [r["bounded"] for r in rows] == [True, True]
    assert "| normal | causal | 1024 | 64 | 256 | True |" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--q-scale", "0"], "--q-scale 0.0"),
        (["--shapes", "causal:1000:64"], "causal:1000:64"),
        (["--shapes", "sliding:512:64"], "sliding:512:64"),
        (["--heads", "3", "--kv-heads", "2"], "--heads 3"),
        (["--checkpoint", "x"], "--checkpoint and --text"),
        (["--checkpoint", "x", "--text", "/no/such/file.txt"], "/no/such/file.txt"),
        (["--checkpoint", "x", "--text", __file__, "--seq", "100"], "--seq 100"),
    ],
)
def test_bad_flags_are_refused_by_value(argv, named, capsys):
    with pytest.raises(SystemExit):
        bound_share.main(argv)
    assert named in capsys.readouterr().err


def test_a_checkpoint_gives_one_row_per_layer(tmp_path):
    """A tiny HF Llama with a BPE tokenizer, on the trainer guide's text: one row per
    layer, every query head counted, the causal steps of 1,024 tokens decided."""
    pytest.importorskip("tokenizers")
    from models.convert import init_hf
    from train import data as data_lib

    text = tmp_path / "text.txt"
    text.write_text((REPO / "docs" / "trainer.md").read_text(encoding="utf-8") * 2)
    data_lib.train_tokenizer([text], tmp_path / "tok", vocab_size=300)
    config = init_hf("tiny", tmp_path / "model", tokenizer=tmp_path / "tok")
    out = tmp_path / "share.json"
    argv = ["--checkpoint", str(tmp_path / "model"), "--text", str(text), "--seq", "1024"]
    bound_share.main([*argv, "--out", str(out)])
    written = json.loads(out.read_text())
    rows = written["rows"]
    assert len(rows) == config.num_layers and written["seq"] == 1024
    assert all(r["heads"] == config.num_heads and r["unmasked_warp_steps"] > 0 for r in rows)
    assert all(0.0 <= r["kept"] <= 1.0 for r in rows)
