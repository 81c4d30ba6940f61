"""Tests of train/data_cache.py (memory-mapped token caches), the trainer's data flags
(--data_cache_dir, --tokenizer_name_or_path, --eos_token_id), the BPE tokenizer command
and `models.convert --init`."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import re
import subprocess
from pathlib import Path

import jax
import numpy as np
import pytest

import models
from models import convert
from train import data as data_lib
from train import data_cache, processes
from train.build import data_eos, load_model, load_rows
from train.config import DataArgs, ModelArgs, TrainConfig
from train.data import Batches
from train.dataset import load_dataset
from train.errors import TrainingError
from train.records import load_tokenizer

REPO = Path(__file__).resolve().parents[1]
EOS = 2
IGNORE = -100


def _records(n: int = 60, seed: int = 0) -> list:
    """Documents of 1-40 tokens: plain lists, some ending in EOS already, some with
    labels (half ignored)."""
    rng = np.random.default_rng(seed)
    records = []
    for i in range(n):
        ids = rng.integers(3, 200, size=int(rng.integers(1, 41)))
        if i % 7 == 3:
            ids[-1] = EOS
        if i % 5 == 1:
            labels = ids.copy()
            labels[: len(ids) // 2] = IGNORE
            records.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
        else:
            records.append(ids.tolist())
    return records


def _pkl(path: Path, records) -> Path:
    with open(path, "wb") as f:
        pickle.dump(records, f)
    return path


@pytest.fixture
def small_flushes(monkeypatch):
    """Writes every few tokens, so labels start after earlier tokens hit the file."""
    monkeypatch.setattr(data_cache, "_FLUSH_TOKENS", 16)


def _assert_rows_equal(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
        assert y.dtype == np.int32


# --- the cache is the in-memory path ---------------------------------------------------


@pytest.mark.parametrize("eos_id", [None, EOS])
@pytest.mark.parametrize("mask_boundaries", [True, False])
@pytest.mark.parametrize("pad_last", [False, True])
def test_cache_rows_and_batches_equal_in_memory(
    tmp_path, small_flushes, eos_id, mask_boundaries, pad_last
):
    source = _pkl(tmp_path / "d.pkl", _records())
    cache = data_cache.build_cache(source, tmp_path / "cache", eos_id=eos_id)
    assert cache.meta["labels"] and cache.eos_id == eos_id
    dataset = load_dataset(source)
    for seq_len in (1, 7, 32):
        memory = dataset.rows(
            seq_len, eos_id=eos_id, mask_boundaries=mask_boundaries, pad_last=pad_last
        )
        cached = cache.rows(seq_len, mask_boundaries=mask_boundaries, pad_last=pad_last)
        rounded = -(-cache.num_tokens // seq_len) if pad_last else cache.num_tokens // seq_len
        assert (cached.num_rows, cached.seq_len) == (memory.num_rows, seq_len) == (rounded, seq_len)
        _assert_rows_equal(memory, cached.take(np.arange(cached.num_rows)))
        assert cached.packed == memory.packed == bool(memory.segment_ids.any())
        assert memory.packed == (seq_len > 1)
    a = Batches(dataset.rows(16, eos_id=eos_id), 4, seed=3, num_epochs=2)
    b = Batches(cache.rows(16), 4, seed=3, num_epochs=2)
    for x, y in zip(a, b, strict=True):  # the trainer's batches, two epochs
        _assert_rows_equal(x, y)


def test_cache_of_jsonl_and_npy_equal_in_memory(tmp_path):
    rng = np.random.default_rng(5)
    docs = [rng.integers(3, 300, size=n) for n in (5, 17, 1, 30, 9)]
    jsonl = tmp_path / "d.jsonl"
    data_lib.save_dataset(jsonl, docs)
    npy = tmp_path / "d.npy"
    data_lib.save_dataset(npy, rng.integers(0, 300, size=(6, 11)))
    for source in (jsonl, npy):
        cache = data_cache.build_cache(source, tmp_path / f"c{source.suffix}", eos_id=EOS)
        memory = load_dataset(source).rows(8, eos_id=EOS)
        _assert_rows_equal(memory, cache.rows(8).take(np.arange(memory.num_rows)))


@pytest.mark.parametrize("eos_id", [None, EOS])
@pytest.mark.parametrize("mask_boundaries", [True, False])
@pytest.mark.parametrize("pad_last", [False, True])
def test_cache_rows_equal_in_memory_with_whole_packing(
    tmp_path, small_flushes, eos_id, mask_boundaries, pad_last
):
    """`packing="whole"` from the cache (laid out from index.npy) is the in-memory rows:
    the same padding, labels, segment ids and row count, and the same batches."""
    source = _pkl(tmp_path / "d.pkl", _records())
    cache = data_cache.build_cache(source, tmp_path / "cache", eos_id=eos_id)
    dataset = load_dataset(source)
    for seq_len in (1, 7, 32, 64):
        memory = dataset.rows(
            seq_len,
            eos_id=eos_id,
            mask_boundaries=mask_boundaries,
            pad_last=pad_last,
            packing="whole",
        )
        cached = cache.rows(
            seq_len, mask_boundaries=mask_boundaries, pad_last=pad_last, packing="whole"
        )
        assert (cached.num_rows, cached.seq_len) == (memory.num_rows, seq_len)
        _assert_rows_equal(memory, cached.take(np.arange(cached.num_rows)))
        assert cached.packed == memory.packed == bool(memory.segment_ids.any())
        _, padding, _ = dataset.rows_and_padding(
            seq_len,
            eos_id=eos_id,
            mask_boundaries=mask_boundaries,
            pad_last=pad_last,
            packing="whole",
        )
        assert padding == cached.padding
        stream = dataset.rows(seq_len, eos_id=eos_id, pad_last=pad_last)
        if seq_len > 1:  # some example of 1-40 tokens does not fit the rest of a row
            assert memory.num_rows > stream.num_rows and cached.padding > 0
    a = Batches(dataset.rows(16, eos_id=eos_id, packing="whole"), 4, seed=3, num_epochs=2)
    b = Batches(cache.rows(16, packing="whole"), 4, seed=3, num_epochs=2)
    for x, y in zip(a, b, strict=True):
        _assert_rows_equal(x, y)


def test_packing_whole_in_memory_lays_the_examples_out_once(tmp_path, monkeypatch, capsys):
    """`packed_rows` of a data file loaded into memory with `packing="whole"` runs
    `whole_layout` (a loop over the examples) once, for the rows and the padding it
    says alike."""
    from train import dataset as dataset_lib

    source = _pkl(tmp_path / "d.pkl", _records(40))
    layouts = []
    layout = dataset_lib.whole_layout

    def counted(lengths, seq_len):
        layouts.append(seq_len)
        return layout(lengths, seq_len)

    monkeypatch.setattr(dataset_lib, "whole_layout", counted)
    monkeypatch.setattr(data_cache, "whole_layout", counted)
    rows = data_cache.packed_rows(source, 16, eos_id=0, packing="whole")
    assert layouts == [16]
    _, padding, _ = load_dataset(source).rows_and_padding(16, eos_id=0, packing="whole")
    assert f"{padding:,} of the rows' {rows.num_rows * 16:,} tokens" in capsys.readouterr().out


@pytest.mark.parametrize("eval", [False, True])
def test_trainer_packing_whole_through_a_cache_equals_in_memory(tmp_path, capsys, eval):
    """`--packing whole` reaches the training and the evaluation rows, in memory and
    through `--data_cache_dir` alike, and the log says how many tokens are padding; the
    evaluation (`pad_last`) keeps every label the stream packing has."""
    source = _pkl(tmp_path / "d.pkl", _records(40))
    key = "eval_data_path" if eval else "data_path"

    def rows(**flags):
        return load_rows(
            _cfg(**{key: str(source)}, model_max_length=16, **flags), models.TINY, eval=eval
        )

    memory = rows(packing="whole")
    said = capsys.readouterr().out
    cached = rows(packing="whole", data_cache_dir=str(tmp_path / "cc"))
    assert isinstance(cached, data_cache.CachedRows)
    _assert_rows_equal(memory, cached.take(np.arange(memory.num_rows)))
    assert said.count("--packing whole: ") == 1 and "are padding" in said
    assert f"{cached.padding:,} of the rows' {cached.num_rows * 16:,} tokens" in said
    assert f"{cached.padding:,} of the rows'" in capsys.readouterr().out
    stream = rows()
    assert memory.num_rows > stream.num_rows
    if eval:
        assert (memory.labels != IGNORE).sum() == (stream.labels != IGNORE).sum()


def test_cache_resumes_at_the_exact_batch(tmp_path):
    cache = data_cache.build_cache(_pkl(tmp_path / "d.pkl", _records(80)), tmp_path / "c")
    rows = cache.rows(8)
    full = [b.input_ids for b in Batches(rows, 3, seed=1, num_epochs=3)]
    each = -(-rows.num_rows // 3)  # the epoch's last batch filled up
    assert len(full) == 3 * each
    for k in (1, 5, each + 2):  # inside the first epoch and into the second
        first = Batches(rows, 3, seed=1, num_epochs=3)
        for _ in range(k):
            next(first)
        state = json.loads(json.dumps(first.state()))  # as a checkpoint stores it
        rest = [
            b.input_ids
            for b in Batches(
                data_cache.open_cache(tmp_path / "c").rows(8), 3, seed=1, num_epochs=3, start=state
            )
        ]
        assert len(rest) == len(full) - k
        for x, y in zip(full[k:], rest, strict=True):
            np.testing.assert_array_equal(x, y)


def test_eos_goes_between_documents_once(tmp_path):
    source = _pkl(tmp_path / "d.pkl", [[5, 6], [7, EOS], [8]])
    cache = data_cache.build_cache(source, tmp_path / "c", eos_id=EOS)
    assert np.asarray(cache.tokens).tolist() == [5, 6, EOS, 7, EOS, 8, EOS]
    assert np.asarray(cache.offsets).tolist() == [0, 3, 5, 7]
    rows = cache.rows(7).take([0])
    assert rows.labels.tolist() == [[6, EOS, IGNORE, EOS, IGNORE, EOS, IGNORE]]
    assert rows.segment_ids.tolist() == [[0, 0, 0, 1, 1, 2, 2]]
    plain = data_cache.build_cache(source, tmp_path / "p")
    assert np.asarray(plain.tokens).tolist() == [5, 6, 7, EOS, 8]
    assert plain.eos_id is None and not (tmp_path / "p" / data_cache.LABELS).exists()


def test_eos_after_a_masked_record_is_ignored_in_the_cache(tmp_path):
    """The cache labels the appended EOS as the in-memory rows do: -100 after a record
    whose last label is -100, the EOS itself after a labelled one."""
    records = [
        {"input_ids": [5, 6], "labels": [IGNORE, IGNORE]},
        {"input_ids": [7, 8], "labels": [IGNORE, 8]},
        [9, 10],
    ]
    source = tmp_path / "d.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    cache = data_cache.build_cache(source, tmp_path / "c", eos_id=EOS)
    assert np.asarray(cache.targets).tolist() == [
        IGNORE,
        IGNORE,
        IGNORE,
        IGNORE,
        8,
        EOS,
        9,
        10,
        EOS,
    ]
    memory = load_dataset(source).rows(9, eos_id=EOS)
    _assert_rows_equal(memory, cache.rows(9).take([0]))
    assert memory.labels.tolist() == [[IGNORE, IGNORE, IGNORE, 8, EOS, IGNORE, 10, EOS, IGNORE]]


def test_older_caches_without_labels_are_read_and_with_labels_rebuilt(tmp_path, capsys):
    source = _pkl(tmp_path / "d.pkl", [[5, 6], {"input_ids": [7, 8], "labels": [IGNORE, IGNORE]}])
    plain = _pkl(tmp_path / "p.pkl", [[5, 6], [7, 8]])
    for path, cache_dir in ((source, tmp_path / "c"), (plain, tmp_path / "p")):
        data_cache.build_cache(path, cache_dir, eos_id=EOS)
        meta = json.loads((cache_dir / data_cache.META).read_text())
        (cache_dir / data_cache.META).write_text(json.dumps({**meta, "version": 1}))
    assert data_cache.open_cache(tmp_path / "p").num_tokens == 6
    with pytest.raises(ValueError, match="token cache version 1, this jflash reads 2; rebuild"):
        data_cache.open_cache(tmp_path / "c")
    cache, built = data_cache.ensure_cache(source, tmp_path / "c", eos_id=EOS)
    assert built and cache.meta["version"] == data_cache.VERSION
    assert "is stale" in capsys.readouterr().out


@pytest.mark.parametrize("packing", ["stream", "whole"])
def test_summary_counts_the_targets_the_rows_hold(tmp_path, packing):
    """`labelled_tokens` of a dataset and of its cache is the number of labels that are
    not -100 in all its rows (none dropped): what the loss is taken on over an epoch, but
    the EOS that whole packing leaves out after an example exactly a row long.
    Unlabelled examples, prompt-masked ones, a prompt-only one, each with its EOS."""
    records = [
        [5, 6, 7, 8],
        {"input_ids": [9, 10, 11, 12, 13], "labels": [-100, -100, 11, 12, 13]},
        {"input_ids": [14, 15], "labels": [-100, -100]},
        [16, 17, 18],
        {"input_ids": [19, 20, 21], "labels": [19, -100, 21]},
    ]
    source = _pkl(tmp_path / "d.pkl", records)
    dataset = load_dataset(source)
    cache = data_cache.build_cache(source, tmp_path / "c", eos_id=2)
    for seq_len in (3, 4, 7):
        held = [
            int(np.count_nonzero(rows.labels != -100))
            for rows in (
                dataset.rows(seq_len, eos_id=2, pad_last=True, packing=packing),
                cache.rows(seq_len, pad_last=True, packing=packing).take(
                    np.arange(cache.rows(seq_len, pad_last=True, packing=packing).num_rows)
                ),
            )
        ]
        # 6 7 8 EOS | 11 12 13 EOS | - | 17 18 EOS | 21 EOS (not 20, nor the firsts); in
        # whole rows, an example of seq_len tokens fills a row without its EOS: the last
        # two at 3, the first at 4
        expected = 13 - {3: 2, 4: 1}.get(seq_len, 0) * (packing == "whole")
        assert held == [expected, expected], (seq_len, held)
    assert dataset.summary(eos_id=2)["labelled_tokens"] == cache.summary()["labelled_tokens"] == 13


def test_whole_packing_fills_a_row_with_an_example_of_its_length(tmp_path):
    """An example exactly a row long fills its row without its EOS (as one cut to the
    row's length ends), in memory and from a cache: before, its EOS alone began the next
    row and the rest of that row was padding, a row of nothing to learn."""
    examples = [list(range(10 + 8 * i, 18 + 8 * i)) for i in range(3)] + [[40, 41]]
    source = _pkl(tmp_path / "d.pkl", examples)
    cache = data_cache.build_cache(source, tmp_path / "c", eos_id=2)
    in_memory, padding, _ = load_dataset(source).rows_and_padding(8, eos_id=2, packing="whole")
    cached = cache.rows(8, packing="whole")
    for rows in (in_memory, cached.take(np.arange(cached.num_rows))):
        assert rows.input_ids.tolist() == [*examples[:3], [40, 41, 2, 0, 0, 0, 0, 0]][:3]
        assert rows.labels[0].tolist() == [*range(11, 18), -100]  # no EOS to predict
        assert rows.segment_ids.tolist() == [[0] * 8] * 3
    assert padding == cached.padding == 0
    assert cached.num_rows == 3  # the last row, 3 tokens and padding, is the dropped tail
    rows = cache.rows(8, packing="whole", pad_last=True)
    assert rows.take([3]).input_ids.tolist() == [[40, 41, 2, 0, 0, 0, 0, 0]]
    assert rows.padding == 5


def test_the_dropped_tail_is_counted_in_memory_and_from_a_cache(tmp_path, capsys):
    """The tail past the last whole row is not trained on: its tokens, and the examples
    wholly in it (with whole packing up to a row of conversations), are said in one line,
    the same in memory and from a cache; evaluation's rows (pad_last) drop nothing."""
    examples = [list(range(10, 10 + n)) for n in (50, 60, 40, 30, 20, 5, 3)]
    source = _pkl(tmp_path / "d.pkl", examples)
    cache = data_cache.build_cache(source, tmp_path / "c", eos_id=2)
    dataset = load_dataset(source)
    # Lengths with EOS 51 61 41 31 21 6 4 (215). Stream: 3 rows of 64 keep 192, the last
    # 23 tokens hold examples 6 and 7 whole. Whole: rows start 0, 64, 128 (examples 1-3),
    # and 31 + 21 + 6 + 4 tokens past 192 (the 4th row, unfilled).
    for packing, tail in (("stream", (23, 2)), ("whole", (62, 4))):
        assert dataset.rows_and_padding(64, eos_id=2, packing=packing)[2] == tail
        assert cache.rows(64, packing=packing).tail == tail
        assert dataset.rows_and_padding(64, eos_id=2, packing=packing, pad_last=True)[2] == (0, 0)
        assert cache.rows(64, packing=packing, pad_last=True).tail == (0, 0)
    capsys.readouterr()
    data_cache.packed_rows(source, 64, eos_id=2, packing="whole")
    data_cache.packed_rows(tmp_path / "c", 64, eos_id=2, packing="whole")
    said = [line for line in capsys.readouterr().out.splitlines() if "not trained on" in line]
    assert said == [
        f"{source}: the last 62 tokens (less than a row of 64; 4 whole examples among them) "
        "are not trained on",
        f"{tmp_path / 'c'}: the last 62 tokens (less than a row of 64; 4 whole examples "
        "among them) are not trained on",
    ]
    data_cache.packed_rows(source, 64, eos_id=2, pad_last=True)
    assert "not trained on" not in capsys.readouterr().out


def test_a_cache_whose_only_labels_are_first_tokens_has_nothing_to_learn(tmp_path):
    """A document's first token is no target, whatever its label: a cache whose only
    labels sit there is unlabelled, as the same data in memory is (the trainer refuses
    both, not trains at loss 0); a cache written before `max_target` is counted."""
    records = [{"input_ids": [5, 6, 7], "labels": [5, -100, -100]}] * 6
    source = _pkl(tmp_path / "d.pkl", records)
    cache = data_cache.build_cache(source, tmp_path / "c", eos_id=2)
    assert not load_dataset(source).rows(4, eos_id=2).labelled
    assert not cache.rows(4).labelled
    meta = json.loads((tmp_path / "c" / "meta.json").read_text())
    del meta["max_target"]
    (tmp_path / "c" / "meta.json").write_text(json.dumps(meta))
    assert not data_cache.open_cache(tmp_path / "c").rows(4).labelled
    records[2] = {"input_ids": [5, 6, 7], "labels": [5, 6, -100]}
    labelled = data_cache.build_cache(_pkl(tmp_path / "l.pkl", records), tmp_path / "l", eos_id=2)
    assert labelled.rows(4).labelled


def test_cache_files_and_summary(tmp_path):
    cache = data_cache.build_cache(_pkl(tmp_path / "d.pkl", [[5, 6], [9]]), tmp_path / "c")
    meta = json.loads((tmp_path / "c" / "meta.json").read_text())
    assert meta["source"]["size"] == (tmp_path / "d.pkl").stat().st_size
    assert (meta["eos_id"], meta["tokenizer"], meta["num_tokens"]) == (None, None, 3)
    assert (tmp_path / "c" / "tokens.bin").read_bytes() == np.array([5, 6, 9], "<u4").tobytes()
    assert np.load(tmp_path / "c" / "index.npy").tolist() == [0, 2, 3]
    assert cache.summary() == {
        "examples": 2,
        "tokens": 3,
        "labelled_tokens": 1,  # 6: each document's first token is no target
        "min_length": 1,
        "max_length": 2,
        "max_id": 9,
    }
    labelled = data_cache.build_cache(
        _pkl(tmp_path / "l.pkl", [[5, 6], {"input_ids": [7, 8, 9], "labels": [-100, -100, 9]}]),
        tmp_path / "l",
    )
    assert labelled.summary()["labelled_tokens"] == 2  # 6 and 9; labels.bin read
    with pytest.raises(ValueError, match=r"c: token id 9 is out of range for vocab_size=9"):
        data_cache.open_cache(tmp_path / "c", vocab_size=9)
    with pytest.raises(ValueError, match=r"tokens do not fill one row of seq_len=4"):
        cache.rows(4)
    index = tmp_path / "c" / "index.npy"
    written = index.read_bytes()
    for damage, problem in ((index.unlink, "missing"), (lambda: index.write_text("1 2"), "not a")):
        damage()
        with pytest.raises(ValueError) as error:
            data_cache.open_cache(tmp_path / "c")
        assert str(error.value).startswith(f"{index}: {problem}"), str(error.value)
        assert str(error.value).endswith("(a damaged cache: rebuild it)"), str(error.value)
    index.write_bytes(written)
    (tmp_path / "c" / "tokens.bin").write_bytes(b"\0" * 8)  # truncated
    with pytest.raises(ValueError, match=r"tokens\.bin: 8 bytes, expected 3 tokens"):
        data_cache.open_cache(tmp_path / "c")
    (tmp_path / "c" / "tokens.bin").unlink()
    with pytest.raises(ValueError, match=r"tokens\.bin: missing \(a damaged cache: rebuild it\)"):
        data_cache.open_cache(tmp_path / "c")


# --- atomic writes, stale caches -------------------------------------------------------


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


# A process holding a build's lock on the folder argv[1] (made here), as a build in
# another PID namespace would.
_HOLD_LOCK = (
    "import fcntl, os, sys, time\n"
    "os.mkdir(sys.argv[1])\n"
    "fd = os.open(os.path.join(sys.argv[1], '.building'), os.O_WRONLY | os.O_CREAT)\n"
    "fcntl.flock(fd, fcntl.LOCK_EX)\n"
    "print('locked', flush=True)\n"
    "time.sleep(600)\n"
)


def test_a_failed_build_leaves_no_cache(tmp_path, small_flushes):
    bad = _pkl(tmp_path / "bad.pkl", [*_records(30), [1, -4]])  # the last record is bad
    with pytest.raises(ValueError, match=r"bad\.pkl: record 30: 'input_ids': id -4"):
        data_cache.build_cache(bad, tmp_path / "c")
    assert not (tmp_path / "c").exists() and _leftovers(tmp_path) == []
    with pytest.raises(ValueError, match=r"record 2: token id 250 is out of range"):
        data_cache.build_cache(
            _pkl(tmp_path / "v.pkl", [[1], [2], [250]]), tmp_path / "c", vocab_size=200
        )
    assert not (tmp_path / "c").exists() and _leftovers(tmp_path) == []

    # A failed rebuild keeps the cache that was there.
    good = _pkl(tmp_path / "good.pkl", [[5, 6, 7]])
    data_cache.build_cache(good, tmp_path / "c")
    with pytest.raises(ValueError, match=r"record 30"):
        data_cache.build_cache(bad, tmp_path / "c")
    assert np.asarray(data_cache.open_cache(tmp_path / "c").tokens).tolist() == [5, 6, 7]
    assert _leftovers(tmp_path) == []
    # Something that is not a cache is never written over.
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"other exists and is not a token cache"):
        data_cache.build_cache(good, tmp_path / "other")
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="process start times: /proc")
def test_a_build_killed_outright_is_cleared_by_the_next(tmp_path, capsys):
    """A build killed by SIGKILL (the out-of-memory killer) leaves its half-written folder
    beside the cache; the next build of that cache removes it, saying so, and leaves a
    running build's folder (its process runs, or, in another PID namespace, it holds the
    build lock), another host's and one named as before owners were recorded (each but
    the running ones with a line)."""
    import signal
    import sys

    source = _pkl(tmp_path / "d.pkl", _records(40))
    code = (
        "import sys, time\n"
        "from train import data_cache\n"
        "add = data_cache._Writer.add\n"
        "def stuck(self, ids, labels, end=None):\n"
        "    add(self, ids, labels, end)\n"
        "    self.flush()\n"
        "    print('writing', flush=True)\n"
        "    time.sleep(600)\n"
        "data_cache._Writer.add = stuck\n"
        "data_cache.build_cache(sys.argv[1], sys.argv[2])\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(source), str(tmp_path / "c")],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        assert child.stdout.readline() == "writing\n"
        (killed,) = _leftovers(tmp_path)
        assert killed.startswith(".c.tmp-") and f"@{child.pid}@" in killed
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    running = data_cache._aside(tmp_path / "c", "tmp")  # this process's: it runs
    # A build in another PID namespace of this host: its process id names no process
    # here, its lock is held.
    dead = next(p for p in range(4_000_000, 4_100_000) if processes.started(p) is None)
    hidden = tmp_path / f".c.tmp-{processes.host()}@{dead}@1@89abcdef"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, str(hidden)], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline() == "locked\n"
    elsewhere = tmp_path / ".c.old-otherhost@12@345@0123abcd"
    before = tmp_path / ".c.tmp-0123abcd"
    for folder in (running, elsewhere, before):
        folder.mkdir()
    (tmp_path / ".d.tmp-0123abcd").mkdir()  # another cache's
    capsys.readouterr()
    try:
        data_cache.build_cache(source, tmp_path / "c")
    finally:
        holder.kill()
        holder.wait()
    out = capsys.readouterr().out
    assert (
        f"c: removed {killed} (0 kB), left by a cache build that was stopped outright "
        f"(process {child.pid} has ended)" in out
    )
    assert hidden.name not in out and hidden.is_dir()
    assert not (tmp_path / "c" / data_cache.BUILD_LOCK).exists()
    assert (
        "left as it is: .c.old-otherhost@12@345@0123abcd, a cache build's folder on host "
        "otherhost (remove it if no build of this cache runs there)" in out
    )
    assert "left as it is: .c.tmp-0123abcd, what a cache build stopped outright left" in out
    assert running.name not in out and ".d.tmp" not in out
    assert _leftovers(tmp_path) == sorted(
        [running.name, hidden.name, elsewhere.name, before.name, ".d.tmp-0123abcd"]
    )
    assert np.asarray(data_cache.open_cache(tmp_path / "c").tokens).size > 0
    # A build killed once its cache was in place, before the old one was removed: an
    # up-to-date cache's next use removes the old one.
    replaced = tmp_path / killed.replace(".c.tmp-", ".c.old-")
    replaced.mkdir()
    (replaced / "tokens.bin").write_bytes(b"\0" * 4)
    _, built = data_cache.ensure_cache(source, tmp_path / "c")
    assert not built and not replaced.exists()
    assert f"c: removed {replaced.name} (0 kB)" in capsys.readouterr().out
    # A build's folder before its lock is taken: left a minute, then removed.
    young = tmp_path / f".c.new-{processes.host()}@{dead}@1@01234567"
    stale = tmp_path / f".c.new-{processes.host()}@{dead}@1@76543210"
    young.mkdir()
    stale.mkdir()
    os.utime(stale, (1e9, 1e9))
    removed = data_cache.remove_leftovers(tmp_path / "c")
    assert stale in removed and young not in removed and young.is_dir()
    young.rmdir()


def test_stale_cache_is_rebuilt_or_refused(tmp_path, capsys):
    source = _pkl(tmp_path / "d.pkl", [[5, 6, 7, 8]])
    cache, built = data_cache.ensure_cache(source, tmp_path / "c", eos_id=EOS, announce=True)
    assert built  # said at its start (a training run's): its first progress line is 30 s away
    assert capsys.readouterr().out.startswith(
        f"token cache: tokenizing {source} into {tmp_path / 'c'}, once\n"
    )
    _, built = data_cache.ensure_cache(source, tmp_path / "c", eos_id=EOS)
    assert not built and not capsys.readouterr().out  # reused
    _, built = data_cache.ensure_cache(source, tmp_path / "c", eos_id=3)
    assert built and "built with eos_id=2, this run's is 3" in capsys.readouterr().out

    _pkl(source, [[5, 6, 7, 8, 9, 10]])  # the source changes
    os.utime(source, ns=(1, 1))
    assert "changed since the cache was built" in " ".join(
        data_cache.open_cache(tmp_path / "c").mismatch(eos_id=3)
    )
    with pytest.raises(ValueError, match=r"does not match this run \(.*d\.pkl changed.*rebuild"):
        data_cache.packed_rows(tmp_path / "c", 4, eos_id=3)
    with pytest.raises(ValueError, match=r"built with eos_id=3, this run's is none"):
        data_cache.packed_rows(tmp_path / "c", 4, eos_id=None)
    cache, built = data_cache.ensure_cache(source, tmp_path / "c", eos_id=3)
    assert built and np.asarray(cache.tokens).tolist() == [5, 6, 7, 8, 9, 10, 3]
    assert data_cache.packed_rows(tmp_path / "c", 7, eos_id=3).num_rows == 1


def test_attention_masks_padding_is_left_out_in_memory_and_in_a_cache(tmp_path, capsys):
    """Token-id records padded by an HF tokenizer (`padding="max_length"`, left or
    right) carry an attention_mask whose 0s mark the padding: those tokens are left out
    (and their labels), said in a line, not learned as text; a cache records it, and one
    built before the mask was read is stale. A mask that is not 0s and 1s as long as the
    ids, or that masks every token, is refused naming the record."""
    source = tmp_path / "padded.jsonl"
    records = [
        {"input_ids": [5, 6, 7, 0, 0], "attention_mask": [1, 1, 1, 0, 0]},
        {"input_ids": [0, 0, 8, 9], "attention_mask": [0, 0, 1, 1], "labels": [0, 0, -100, 9]},
        {"input_ids": [10, 11]},
    ]
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    want = [5, 6, 7, EOS, 8, 9, EOS, 10, 11, EOS]
    cache, built = data_cache.ensure_cache(source, tmp_path / "c", eos_id=EOS)
    assert built and np.asarray(cache.tokens).tolist() == want
    assert np.asarray(cache.targets).tolist() == [5, 6, 7, EOS, -100, 9, EOS, 10, 11, EOS]
    assert f"{source}: left out 4 tokens that the records' attention_mask marks as padding" in (
        capsys.readouterr().out
    )
    rows = load_rows(_cfg(data_path=str(source), model_max_length=5), models.TINY)
    assert np.concatenate([rows.take(np.arange(rows.num_rows))[0].ravel()]).tolist() == want
    meta = json.loads((tmp_path / "c" / "meta.json").read_text())
    assert meta["masked_tokens"] == 4
    del meta["masked_tokens"]  # a cache built before the mask was read
    (tmp_path / "c" / "meta.json").write_text(json.dumps(meta))
    assert data_cache.open_cache(tmp_path / "c").mismatch(eos_id=EOS) == [
        "built before records' attention_mask was read (padding was kept)"
    ]
    for mask, said in (
        ([1, 1], "'attention_mask' has 2 entries, 'input_ids' has 3"),
        ([1, 2, 0], "'attention_mask' must hold 0s and 1s, got [0, 1, 2]"),
        ([0, 0, 0], "'attention_mask' masks every token (a record of padding alone)"),
    ):
        source.write_text(json.dumps({"input_ids": [5, 6, 7], "attention_mask": mask}) + "\n")
        with pytest.raises(ValueError, match=re.escape(f"{source}: line 1: {said}")):
            data_cache.build_cache(source, tmp_path / "bad", eos_id=EOS)


# --- the trainer's data flags ----------------------------------------------------------


def _cfg(**data) -> TrainConfig:
    return TrainConfig(model=ModelArgs(model_name_or_path="tiny"), data=DataArgs(**data))


def test_the_trainer_reads_a_pattern_of_files_or_names_what_matches_none(tmp_path):
    """`--data_path` takes a glob pattern (quoted on the command line), in memory and
    through `--data_cache_dir`, with the same rows; one matching nothing is refused."""
    import gzip

    for k in range(3):
        with gzip.open(tmp_path / f"shard-{k}.jsonl.gz", "wt") as f:
            f.write("".join(f"[{k + 10}, {k + 10}, {i + 10}]\n" for i in range(4)))
    pattern = str(tmp_path / "shard-*.jsonl.gz")
    memory = load_rows(_cfg(data_path=pattern, model_max_length=8), models.TINY)
    cached = load_rows(
        _cfg(data_path=pattern, model_max_length=8, data_cache_dir=str(tmp_path / "c")),
        models.TINY,
    )
    assert memory.num_rows == cached.num_rows == 6
    ids = np.arange(6)
    for a, b in zip(memory.take(ids), cached.take(ids), strict=True):
        np.testing.assert_array_equal(a, b)
    assert memory.take(ids).input_ids[0].tolist()[:4] == [10, 10, 10, models.TINY.eos_token_id]
    missing = str(tmp_path / "none-*.jsonl")
    with pytest.raises(
        TrainingError, match=r"--data_path='.*none-\*\.jsonl': no data file matches"
    ):
        load_rows(_cfg(data_path=missing, model_max_length=8), models.TINY)


def test_data_around_the_output_directory_is_refused_or_warned(tmp_path, capsys):
    """An --output_dir inside a --data_path folder, or where a pattern would match its
    log.jsonl, links followed, is refused (that file would be data at the next start);
    one data file in the output directory, or a folder of data under it, is not;
    evaluation data sharing files with the training data gets
    a warning."""
    root = tmp_path / "proj"
    root.mkdir()
    _dump = [f"[{10 + i}, 11, 12]\n" for i in range(8)]
    (root / "train.jsonl").write_text("".join(_dump))
    (root / "test.jsonl").write_text("".join(_dump[:4]))
    cfg = _cfg(data_path=str(root), model_max_length=4)
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, output_dir=str(root / "r")))
    refused = r"--output_dir='.*proj/r': --data_path='.*' would read the run's own files"
    with pytest.raises(TrainingError, match=refused):
        load_rows(cfg, models.TINY)

    def run_in(data_path, out):
        cfg = _cfg(data_path=data_path, model_max_length=4)
        return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, output_dir=str(out)))

    # A pattern that would match the run's log.jsonl: refused at the first start, before
    # the file exists (its resume would read it).
    with pytest.raises(TrainingError, match=refused):
        load_rows(run_in(f"{root}/**/*.jsonl", root / "r"), models.TINY)
    assert load_rows(run_in(f"{root}/t*.jsonl", root / "r"), models.TINY).num_rows > 0
    # One data file named in the output directory is the user's choice.
    (root / "r").mkdir()
    (root / "r" / "mine.jsonl").write_text("".join(_dump))
    assert load_rows(run_in(str(root / "r" / "mine.jsonl"), root / "r"), models.TINY).num_rows
    # A folder or pattern of data under the output directory reads none of the run's
    # files; nor does a folder whose walk leaves out the output directory's hidden one.
    assert load_rows(run_in(str(root / "r"), tmp_path / "proj"), models.TINY).num_rows
    assert load_rows(run_in(f"{root}/r/*.jsonl", tmp_path / "proj"), models.TINY).num_rows
    assert load_rows(run_in(str(root), root / ".runs" / "r1"), models.TINY).num_rows
    # Reached through a link in the data folder: refused at the first start too (the
    # resume, once log.jsonl exists, would read it).
    (tmp_path / "scratch").mkdir()
    (root / "runs").symlink_to(tmp_path / "scratch")
    linked = r"--output_dir='.*(scratch|runs)/r1': --data_path='.*' would read the run's own"
    for data, out in (
        (str(root), root / "runs" / "r1"),
        (str(root), tmp_path / "scratch" / "r1"),
        (f"{root}/**/*.jsonl", tmp_path / "scratch" / "r1"),
    ):
        with pytest.raises(TrainingError, match=linked):
            load_rows(run_in(data, out), models.TINY)
    (root / "runs").unlink()
    cfg = _cfg(data_path=str(root), eval_data_path=f"{root}/test*", model_max_length=4)
    load_rows(cfg, models.TINY, eval=True)
    assert (
        f"warning: --eval_data_path='{root}/test*' shares 1 file with --data_path "
        f"({root}/test.jsonl): its loss is measured on data the run trains on"
    ) in capsys.readouterr().out
    cfg = _cfg(data_path=f"{root}/train*", eval_data_path=f"{root}/test*", model_max_length=4)
    load_rows(cfg, models.TINY, eval=True)
    assert "warning" not in capsys.readouterr().out


def test_a_source_rewritten_to_its_size_and_time_is_noticed(tmp_path):
    """A data file rewritten to the same size with its mtime kept (cp -p, rsync -t) is
    noticed by the hash of its ends; a cache from before that hash keeps working."""
    source = tmp_path / "d.jsonl"
    source.write_text("[5, 6, 7]\n[8, 9, 10]\n")
    data_cache.build_cache(source, tmp_path / "c", eos_id=3)
    cache = data_cache.open_cache(tmp_path / "c")
    assert cache.mismatch(eos_id=3) == []
    stat = source.stat()
    source.write_text("[5, 6, 7]\n[8, 9, 11]\n")
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert cache.mismatch(eos_id=3) == [
        f"{source} changed since the cache was built (its first or last MiB)"
    ]
    meta = json.loads((tmp_path / "c" / "meta.json").read_text())
    del meta["source"]["edges"]  # written before the hash was recorded
    (tmp_path / "c" / "meta.json").write_text(json.dumps(meta))
    assert data_cache.open_cache(tmp_path / "c").mismatch(eos_id=3) == []
    # a save_to_disk directory of shards is stamped by its files' sizes and times (no
    # file read)
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "state.json").write_text("{}")
    (saved / "data-00000-of-00001.arrow").write_bytes(b"\0" * 100)
    assert data_cache.source_stamp(saved)["edges"] is None
    assert data_cache.source_bytes(saved) == data_cache.source_stamp(saved)["size"] == 102


def test_a_long_cache_build_says_how_far_it_is(tmp_path, monkeypatch, capsys):
    """A cache build prints a progress line every PROGRESS_SECONDS (hours of text
    tokenized said nothing until the end)."""
    source = _pkl(tmp_path / "d.pkl", _records(5))
    monkeypatch.setattr(data_cache, "PROGRESS_SECONDS", 0.0)
    data_cache.build_cache(source, tmp_path / "cache", eos_id=EOS)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 5  # before each record
    assert lines[-1].startswith(f"cache {tmp_path / 'cache'}: 4 records, ")
    assert f"tokens so far from {source} (0 kB), " in lines[-1]
    assert lines[-1].endswith(" tokens/s")


def test_a_stopped_cache_build_ends_in_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    """SIGTERM (SIGHUP, Ctrl-C) during `train.data cache`: one line, the signal's exit
    status, and no temporary directory left (it was left, and Ctrl-C a traceback)."""
    import signal

    from train.errors import Terminated

    source = _pkl(tmp_path / "d.pkl", _records(5))
    real = data_cache.read_examples

    def stopped(*args, **kwargs):
        for i, example in enumerate(real(*args, **kwargs)):
            if i == 3:
                raise Terminated(signal.SIGTERM)
            yield example

    monkeypatch.setattr(data_cache, "read_examples", stopped)
    with pytest.raises(SystemExit) as ended:
        data_lib.main(["cache", str(source), str(tmp_path / "c"), "--no-eos"])
    assert ended.value.code == 143
    err = capsys.readouterr().err
    assert err == "terminated (SIGTERM): python -m train.data cache stopped\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.pkl"]


def test_a_big_data_file_read_into_memory_gets_a_note(tmp_path, monkeypatch, capsys):
    """Without --data_cache_dir a big file is read into memory (about 40 bytes a token,
    at every start): a note says so and names the flag; with it, no note."""
    from train import build

    source = _pkl(tmp_path / "d.pkl", _records(40))
    monkeypatch.setattr(build, "IN_MEMORY_NOTE_BYTES", 1)
    load_rows(_cfg(data_path=str(source), model_max_length=16), models.TINY)
    out = capsys.readouterr().out
    assert out.startswith(f"note: --data_path={str(source)!r} (0.0 GB) is read into memory")
    assert "--data_cache_dir DIR tokenizes it once" in out
    cached = _cfg(data_path=str(source), model_max_length=16, data_cache_dir=str(tmp_path / "c"))
    load_rows(cached, models.TINY)
    assert "note:" not in capsys.readouterr().out


def test_trainer_reads_a_cache_dir_and_builds_caches_in_data_cache_dir(tmp_path):
    source = _pkl(tmp_path / "d.pkl", _records(40))
    config = models.TINY
    eos = data_eos(_cfg(), config)
    memory = load_rows(_cfg(data_path=str(source), model_max_length=16), config)
    cached = load_rows(
        _cfg(data_path=str(source), model_max_length=16, data_cache_dir=str(tmp_path / "cc")),
        config,
    )
    assert isinstance(cached, data_cache.CachedRows) and cached.cache.eos_id == eos
    (where,) = (tmp_path / "cc").iterdir()
    assert where.name.startswith("d.pkl-")
    _assert_rows_equal(memory, cached.take(np.arange(memory.num_rows)))
    direct = load_rows(_cfg(data_path=str(where), model_max_length=16), config)
    _assert_rows_equal(memory, direct.take(np.arange(memory.num_rows)))
    with pytest.raises(ValueError, match=r"built with eos_id=2, this run's is 7"):
        load_rows(_cfg(data_path=str(where), eos_token_id=7), config)


def test_a_data_cache_dir_that_cannot_be_a_directory_is_named(tmp_path):
    """A file, or a path under one (`/dev/null/x`): one line naming the flag and what
    is in the way, not an OSError from makedirs."""
    source = _pkl(tmp_path / "d.pkl", _records(40))
    (tmp_path / "f").write_text("")
    for root, blocked in (
        (tmp_path / "f", tmp_path / "f"),
        (tmp_path / "f" / "caches", tmp_path / "f"),
        (Path("/dev/null/caches"), Path("/dev/null")),
    ):
        cfg = _cfg(data_path=str(source), model_max_length=16, data_cache_dir=str(root))
        with pytest.raises(ValueError) as error:
            load_rows(cfg, models.TINY)
        assert str(error.value) == f"--data_cache_dir={str(root)!r}: {blocked} is not a directory"
    # `python -m train.data cache`'s directory alike.
    with pytest.raises(ValueError, match=r"f exists and is not a token cache"):
        data_cache.build_cache(source, tmp_path / "f")
    with pytest.raises(ValueError, match=rf"f/c: {tmp_path / 'f'} is not a directory"):
        data_cache.build_cache(source, tmp_path / "f" / "c")


def test_eos_token_id_flag(tmp_path):
    source = _pkl(tmp_path / "d.pkl", [[5, 6], [8, 9]])
    rows = load_rows(_cfg(data_path=str(source), model_max_length=3, eos_token_id=4), models.TINY)
    assert rows.input_ids.tolist() == [[5, 6, 4], [8, 9, 4]]
    with pytest.raises(TrainingError, match=r"--eos_token_id: 512 is not an id of vocab_size=512"):
        load_rows(_cfg(data_path=str(source), eos_token_id=512), models.TINY)


def test_eos_token_id_none_packs_documents_with_no_token_between(tmp_path):
    """`--eos_token_id none` (flag or YAML): examples that already end as they should, or
    pieces of longer documents, are packed as they are (HF's Trainer appends nothing),
    in memory and through a token cache, and from the run's `train_config.yaml`, which
    writes it as -1; another negative or a non-integer id is refused."""
    from train.config import parse_args

    source = _pkl(tmp_path / "d.pkl", [[5, 6], [8, 9]])
    (tmp_path / "c.yaml").write_text("data:\n  eos_token_id: none\n")
    (tmp_path / "run.yaml").write_text("data:\n  eos_token_id: -1\n")  # an earlier record
    for argv in (
        ["--eos_token_id", "none"],
        ["--config", str(tmp_path / "c.yaml")],
        ["--config", str(tmp_path / "run.yaml")],
    ):
        cfg = parse_args(["--data_path", str(source), "--model_max_length", "2", *argv])
        assert data_eos(cfg, models.TINY) is None
        assert load_rows(cfg, models.TINY).input_ids.tolist() == [[5, 6], [8, 9]]
    cfg = parse_args(
        ["--data_path", str(source), "--model_max_length", "2", "--eos_token_id", "none"]
        + ["--data_cache_dir", str(tmp_path / "cc")]
    )
    from train.outputs import write_settings

    (tmp_path / "run").mkdir()
    written = Path(write_settings(str(tmp_path / "run"), cfg)).read_text()
    assert "  eos_token_id: none\n" in written  # as the flag spells it; read back above
    cached = load_rows(cfg, models.TINY)
    assert cached.cache.eos_id is None
    assert cached.take(np.arange(2)).input_ids.tolist() == [[5, 6], [8, 9]]
    for bad in ("-3", "-1", "x", "1.5"):  # -1: how the YAML a run writes says none
        with pytest.raises(SystemExit):
            parse_args(["--data_path", str(source), "--eos_token_id", bad])
    (tmp_path / "bad.yaml").write_text("data:\n  eos_token_id: -3\n")
    with pytest.raises(ValueError, match=r"eos_token_id=-3 is not a token id or none"):
        parse_args(["--data_path", str(source), "--config", str(tmp_path / "bad.yaml")])


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Path:
    """A byte-level BPE of 300 tokens trained on a little English."""
    pytest.importorskip("tokenizers")
    folder = tmp_path_factory.mktemp("bpe")
    text = folder / "corpus.txt"
    text.write_text((REPO / "docs" / "trainer.md").read_text() * 2)
    data_lib.train_tokenizer([text], folder / "tok", vocab_size=300)
    return folder / "tok"


def test_train_tokenizer_writes_a_deterministic_bpe_with_eos(bpe, tmp_path):
    data_lib.train_tokenizer([bpe.parent / "corpus.txt"], tmp_path / "again", vocab_size=300)
    assert (tmp_path / "again" / "tokenizer.json").read_bytes() == (
        bpe / "tokenizer.json"
    ).read_bytes()
    assert convert.tokenizer_vocab_size(bpe / "tokenizer.json") == 300
    assert data_lib.tokenizer_eos_id(bpe) == data_lib.tokenizer_eos_id(bpe / "tokenizer.json")
    assert data_lib.tokenizer_eos_id(bpe) == 0
    tokenizer = load_tokenizer(bpe)
    ids = tokenizer.encode("The trainer packs documents.").ids
    assert tokenizer.decode(ids) == "The trainer packs documents." and max(ids) < 300
    with pytest.raises(ValueError, match=r"--vocab-size=100 must be at least 257"):
        data_lib.train_tokenizer([bpe.parent / "corpus.txt"], tmp_path / "x", vocab_size=100)


def test_a_special_token_that_is_not_text_is_refused(bpe, tmp_path):
    """An `eos_token` given as an id (or anything but its text, or {"content": text})
    is named in one line, where it used to read as no EOS at all: documents packed
    without the separator, unsaid. null stays "none"."""
    import shutil

    folder = tmp_path / "tok"
    shutil.copytree(bpe, folder)
    config = folder / "tokenizer_config.json"
    for value, shown in ((5, "5"), (["</s>"], '["</s>"]'), ({"id": 0}, '{"id": 0}')):
        config.write_text(json.dumps({"eos_token": value}))
        with pytest.raises(ValueError) as error:
            data_lib.tokenizer_eos_id(folder)
        assert str(error.value) == (
            f'{config}: eos_token {shown} is not a token: give its text, as "</s>" or '
            '{"content": "</s>"}'
        )
    config.write_text(json.dumps({"eos_token": None, "bos_token": {"content": "<|endoftext|>"}}))
    (folder / "special_tokens_map.json").unlink()
    assert convert.special_token_ids(folder / "tokenizer.json") == {"bos_token": 0}


def test_train_tokenizer_learns_from_prompt_completion_records(bpe, tmp_path):
    """A .jsonl of prompt/completion records is text to learn from, as one of text
    records is: the same merges as the two fields' text records give."""
    text = (bpe.parent / "corpus.txt").read_text()
    half = len(text) // 2
    pairs = tmp_path / "qa.jsonl"
    pairs.write_text(json.dumps({"prompt": text[:half], "completion": text[half:]}) + "\n")
    texts = tmp_path / "t.jsonl"
    texts.write_text("".join(json.dumps({"text": t}) + "\n" for t in (text[:half], text[half:])))
    data_lib.train_tokenizer([pairs], tmp_path / "qa", vocab_size=300)
    data_lib.train_tokenizer([texts], tmp_path / "t", vocab_size=300)
    assert convert.tokenizer_vocab_size(tmp_path / "qa" / "tokenizer.json") == 300
    assert (tmp_path / "qa" / "tokenizer.json").read_bytes() == (
        tmp_path / "t" / "tokenizer.json"
    ).read_bytes()
    # Compressed, .jsonl records and text alike: the same merges as the files themselves.
    import gzip

    for name, plain in (("t.jsonl.gz", texts), ("corpus.txt.gz", bpe.parent / "corpus.txt")):
        (tmp_path / name).write_bytes(gzip.compress(plain.read_bytes()))
        data_lib.train_tokenizer([tmp_path / name], tmp_path / f"{name}-tok", vocab_size=300)
    assert (tmp_path / "t.jsonl.gz-tok" / "tokenizer.json").read_bytes() == (
        tmp_path / "t" / "tokenizer.json"
    ).read_bytes()
    assert (tmp_path / "corpus.txt.gz-tok" / "tokenizer.json").read_bytes() == (
        bpe / "tokenizer.json"
    ).read_bytes()
    # A folder's files (hidden ones left out) and a pattern's: the same as the file.
    shards = tmp_path / "shards"
    (shards / ".git").mkdir(parents=True)
    (shards / ".git" / "HEAD").write_text("ref: refs/heads/main")
    (shards / "corpus.txt.gz").write_bytes((tmp_path / "corpus.txt.gz").read_bytes())
    for given in (shards, f"{shards}/*.gz"):
        data_lib.train_tokenizer([given], tmp_path / "from-folder", vocab_size=300)
        assert (tmp_path / "from-folder" / "tokenizer.json").read_bytes() == (
            bpe / "tokenizer.json"
        ).read_bytes()
    with pytest.raises(ValueError, match=r"none/\*\.txt: no such text file \(nor a folder"):
        data_lib.train_tokenizer([tmp_path / "none" / "*.txt"], tmp_path / "x", vocab_size=300)


def test_cli_tokenizer_says_the_vocabulary_size_it_wrote(bpe, tmp_path, capsys):
    """A text with fewer merges than --vocab-size asks gives a smaller vocabulary (a
    model from it gets that size): the line says the size written, and that it is short."""
    text = tmp_path / "little.txt"
    text.write_text("a little text, a little text")
    data_lib.main(["tokenizer", str(text), "--out", str(tmp_path / "tok")])
    size = convert.tokenizer_vocab_size(tmp_path / "tok" / "tokenizer.json")
    assert size < 4096
    assert capsys.readouterr().out == (
        f"wrote {tmp_path / 'tok' / 'tokenizer.json'}: vocab_size={size} (of --vocab-size "
        "4096: the text has no more merges)\n"
    )
    argv = ["tokenizer", str(bpe.parent / "corpus.txt"), "--out", str(tmp_path / "t2")]
    data_lib.main([*argv, "--vocab-size", "300"])
    assert capsys.readouterr().out.endswith(": vocab_size=300\n")


@pytest.mark.parametrize("command", ["cache", "inspect"])
def test_a_tokenizer_that_does_not_exist_is_named_by_its_flag(tmp_path, capsys, command):
    """`--tokenizer` naming nothing is refused by the flag, before any record is read
    (not as a fault of the data's first line)."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hello"}\n')
    argv = [command, str(data), *([str(tmp_path / "c")] if command == "cache" else [])]
    with pytest.raises(SystemExit) as stopped:
        data_lib.main([*argv, "--tokenizer", str(tmp_path / "none")])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert (
        err
        == f"error: --tokenizer={str(tmp_path / 'none')!r}: {tmp_path / 'none'} does not exist\n"
    )


def test_cli_tokenizer_out_that_is_a_file_is_one_line(bpe, tmp_path, capsys):
    """--out a file, or under one: one line naming it, before any training."""
    (tmp_path / "f").write_text("")
    text = str(bpe.parent / "corpus.txt")
    for out, why in (("f", "is a file, not a directory"), ("f/tok", "cannot be created")):
        with pytest.raises(SystemExit) as stopped:
            data_lib.main(["tokenizer", text, "--out", str(tmp_path / out)])
        assert stopped.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --out={str(tmp_path / out)!r} {why}"), err
        assert len(err.splitlines()) == 1, err


@pytest.mark.parametrize(
    ("record", "why"),
    [
        ('{"txt": "hello"}', "expected key 'text' or 'messages', or keys 'prompt' and"),
        ('{"text": 5}', "'text' must be a str, got int"),
        ('{"input_ids": [1, 2]}', "token ids, no text to learn a tokenizer from"),
        ("[1, 2]", "token ids, no text to learn a tokenizer from"),
        ('{"prompt": "a"}', "has 'prompt' or 'completion' but not 'completion'"),
        ('{"prompt": "a", "completion": null}', "'completion' must be a str, got NoneType"),
        ('{"messages": "hi"}', "'messages' must be a list, got str"),
    ],
)
def test_cli_tokenizer_names_a_record_it_cannot_learn_from(tmp_path, capsys, record, why):
    """A record the trainer would not read as text stops the tokenizer in one line naming
    its file and line, not skipped unsaid; a new --out is not left behind empty."""
    pytest.importorskip("tokenizers")
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hello world"}\n' + record + "\n")
    out = tmp_path / "tok"
    with pytest.raises(SystemExit) as stopped:
        data_lib.main(["tokenizer", str(data), "--out", str(out), "--vocab-size", "300"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {data}: line 2: {why}"), err
    assert len(err.splitlines()) == 1, err
    assert not out.exists()


@pytest.mark.parametrize("as_file", [False, True])
def test_tokenizer_name_or_path_tokenizes_text_with_its_eos(bpe, tmp_path, as_file):
    texts = ["Packed rows of text.", "Labels never cross documents."]
    source = tmp_path / "t.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tokenizer = str(bpe / "tokenizer.json" if as_file else bpe)
    cfg = _cfg(
        data_path=str(source),
        model_max_length=4,
        tokenizer_name_or_path=tokenizer,
        data_cache_dir=str(tmp_path / "cc"),
    )
    assert data_eos(cfg, models.TINY) == 0  # the tokenizer's, not the model's (2)
    rows = load_rows(cfg, models.TINY)
    encoded = load_tokenizer(bpe).encode
    stream = [i for t in texts for i in [*encoded(t).ids, 0]]
    used = rows.num_rows * 4
    np.testing.assert_array_equal(
        rows.take(np.arange(rows.num_rows)).input_ids.ravel(), stream[:used]
    )
    (where,) = (tmp_path / "cc").iterdir()
    meta = json.loads((where / "meta.json").read_text())
    assert meta["tokenizer"]["path"] == str((bpe / "tokenizer.json").resolve())
    # Without a tokenizer, text is refused by name (the tiny preset has no directory).
    with pytest.raises(ValueError, match=r"t\.jsonl: line 1: has 'text' but no tokenizer"):
        load_rows(_cfg(data_path=str(source), model_max_length=4), models.TINY)


def test_prompt_completion_records_through_the_trainer_flags(bpe, tmp_path):
    """Prompt/completion records tokenized by --tokenizer_name_or_path: the rows, in
    memory and through --data_cache_dir, learn the completions and the EOS after each,
    nothing of the prompts."""
    pairs = [("Packed rows of", " text."), ("Labels never cross", " documents.")]
    source = tmp_path / "qa.jsonl"
    source.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in pairs))
    encode = load_tokenizer(bpe).encode
    stream, targets = [], []
    for prompt, completion in pairs:
        question, answer = encode(prompt).ids, encode(completion, add_special_tokens=False).ids
        stream += [*question, *answer, 0]  # the tokenizer's EOS is 0
        targets += [IGNORE] * len(question) + [*answer, 0]
    for cache_dir in ("", str(tmp_path / "cc")):
        cfg = _cfg(
            data_path=str(source),
            model_max_length=len(stream),
            tokenizer_name_or_path=str(bpe),
            data_cache_dir=cache_dir,
        )
        rows = load_rows(cfg, models.TINY)
        row = rows.take([0])
        assert rows.num_rows == 1 and rows.labelled
        assert row.input_ids[0].tolist() == stream
        assert row.labels[0].tolist() == [*targets[1:], IGNORE]  # shifted: the next token's


def test_a_tokenizer_with_more_ids_than_the_model_is_named_as_the_cause(bpe, tmp_path):
    """Text whose ids run past the model's vocabulary because the tokenizer has more ids
    than the model: the error names the tokenizer, its size and the model's."""
    source = tmp_path / "t.jsonl"
    source.write_text(json.dumps({"text": "Packed rows of text for the trainer."}) + "\n")
    cfg = _cfg(data_path=str(source), model_max_length=4, tokenizer_name_or_path=str(bpe))
    small = models.TINY.replace(vocab_size=258)
    with pytest.raises(TrainingError) as refused:
        load_rows(cfg, small)
    message = str(refused.value)
    assert "is out of range for vocab_size=258" in message
    assert f"--tokenizer_name_or_path={str(bpe)!r} has 300 ids" in message
    assert "the model's vocab_size is 258" in message and "\n" not in message
    # Pre-tokenized ids past the vocabulary are the data's own: no tokenizer named.
    ids = _pkl(tmp_path / "v.pkl", [[1], [2], [300]])
    with pytest.raises(ValueError, match="out of range") as refused:
        load_rows(_cfg(data_path=str(ids), model_max_length=4), small)
    assert "--tokenizer_name_or_path" not in str(refused.value)


def test_cache_of_another_tokenizer_names_it_in_the_rebuild_command(bpe, tmp_path):
    """The command a refused cache suggests rebuilds it with this run's tokenizer."""
    source = tmp_path / "t.jsonl"
    source.write_text(json.dumps({"text": "Some text to cache."}) + "\n")
    other = tmp_path / "other"
    data_lib.train_tokenizer([source], other, vocab_size=260)
    data_cache.ensure_cache(source, tmp_path / "c", tokenizer=other, eos_id=0)
    with pytest.raises(ValueError, match="another tokenizer") as refused:
        data_cache.packed_rows(tmp_path / "c", 4, tokenizer=bpe, eos_id=0)
    assert str(refused.value).endswith(
        f"cache {source} {tmp_path / 'c'} --eos-id 0 --tokenizer {bpe}"
    )  # the cache's recorded source, ready to run


def test_cli_cache_and_inspect(bpe, tmp_path, capsys):
    source = tmp_path / "t.jsonl"
    source.write_text(json.dumps({"text": "Some text to cache."}) + "\n")
    argv = ["cache", str(source), str(tmp_path / "c"), "--tokenizer", str(bpe)]
    data_lib.main(argv)
    assert capsys.readouterr().out.startswith(f"wrote {tmp_path / 'c'}: 1 documents")
    data_lib.main(argv)
    assert "up to date:" in capsys.readouterr().out
    data_lib.main(["inspect", str(tmp_path / "c")])
    assert "examples: 1\n" in (said := capsys.readouterr().out) and "stale" not in said
    # A cache whose data changed since: counted, and said to be what the trainer refuses.
    before = source.read_text()
    source.write_text(before + json.dumps({"text": "More."}) + "\n")
    data_lib.main(["inspect", str(tmp_path / "c")])
    assert capsys.readouterr().out.startswith(
        f"note: {tmp_path / 'c'} is stale ({source} changed since the cache was built (size "
        "or mtime)): its counts are of the data as it was; the trainer refuses it until it "
        "is rebuilt (python -m train.data cache)\n"
    )
    source.write_text(before)
    data_lib.main(argv)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        data_lib.main([*argv, "--eos-id", "3", "--no-eos"])
    assert capsys.readouterr().err.startswith("error: give --eos-id or --no-eos")
    # Another data file into the same directory: refused, the cache kept, unless asked.
    other = tmp_path / "u.jsonl"
    other.write_text(json.dumps({"text": "Other text, another corpus."}) + "\n" * 2)
    before = (tmp_path / "c" / "meta.json").read_text()
    with pytest.raises(SystemExit):
        data_lib.main(["cache", str(other), str(tmp_path / "c"), "--tokenizer", str(bpe)])
    assert capsys.readouterr().err.startswith(
        f"error: {tmp_path / 'c'} holds the token cache of another data file, {source}: "
        "pass --overwrite to replace it (nothing was written)"
    )
    assert (tmp_path / "c" / "meta.json").read_text() == before
    data_lib.main(
        ["cache", str(other), str(tmp_path / "c"), "--tokenizer", str(bpe), "--overwrite"]
    )
    assert f"\nwrote {tmp_path / 'c'}: 1 documents" in capsys.readouterr().out
    # The same file changed is rebuilt without --overwrite (a stale cache of it).
    other.write_text(json.dumps({"text": "Changed."}) + "\n")
    data_lib.main(["cache", str(other), str(tmp_path / "c"), "--tokenizer", str(bpe)])
    assert "is stale" in capsys.readouterr().out


# --- models.convert --init -------------------------------------------------------------

HF_LLAMA_KEYS = {
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling", "tie_word_embeddings",
    "max_position_embeddings", "initializer_range", "attention_bias", "bos_token_id",
    "eos_token_id", "torch_dtype",
}  # fmt: skip


def test_convert_init_round_trip(bpe, tmp_path):
    out = tmp_path / "model"
    convert.main(["--init", "tiny", "--tokenizer", str(bpe), "--out", str(out)])
    hf = json.loads((out / "config.json").read_text())
    assert HF_LLAMA_KEYS <= set(hf) and hf["model_type"] == "llama"
    assert (hf["vocab_size"], hf["eos_token_id"], hf["bos_token_id"]) == (300, 0, 0)
    assert hf["hidden_size"] == models.TINY.hidden_size
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (out / name).is_file()
    config, params = models.load_hf(out)  # strict: every tensor, every shape
    assert config.vocab_size == 300 and params["embed"]["embedding"].shape == (300, 128)
    cfg = TrainConfig(model=ModelArgs(model_name_or_path=str(out)))
    loaded, host = load_model(cfg)
    assert loaded.vocab_size == 300 and host is not None
    assert data_eos(cfg, loaded) == 0
    with pytest.raises(SystemExit):
        convert.main(["--init", "no-such-preset", "--out", str(tmp_path / "x")])


def test_the_model_directorys_tokenizer_names_the_eos_packed(bpe, tmp_path):
    """Without --tokenizer_name_or_path the run reads the model directory's tokenizer, and
    packs its eos_token: an Instruct model's end of turn (Llama-3's `<|eot_id|>`), not
    config.json's first EOS (`<|end_of_text|>`), which would follow each conversation's
    own end of turn as a second EOS to learn."""
    out = tmp_path / "model"
    convert.main(["--init", "tiny", "--tokenizer", str(bpe), "--out", str(out)])
    hf = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(hf | {"eos_token_id": [7, 0]}))
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|endoftext|>"  # id 0
    cfg = TrainConfig(model=ModelArgs(model_name_or_path=str(out)))
    loaded, _ = load_model(cfg)
    assert data_eos(cfg, loaded) == 0
    assert data_eos(dataclasses.replace(cfg, data=DataArgs(eos_token_id=7)), loaded) == 7


@pytest.mark.slow
def test_convert_init_loads_in_transformers(bpe, tmp_path):
    """HF's own loader reads the directory, where the side environment is built."""
    oracle = os.environ.get("JFLASH_ORACLE_PYTHON") or str(REPO / ".venv-oracle/bin/python")
    if not os.path.exists(oracle):
        pytest.skip("no HF side environment (make oracle, or JFLASH_ORACLE_PYTHON)")
    out = tmp_path / "model"
    convert.init_hf("tiny", out, tokenizer=bpe / "tokenizer.json")
    code = (
        "import sys; from transformers import LlamaForCausalLM; "
        "m = LlamaForCausalLM.from_pretrained(sys.argv[1]); "
        "print(m.config.vocab_size, m.config.eos_token_id, m.num_parameters())"
    )
    result = subprocess.run(
        [oracle, "-c", code, str(out)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    _, params = models.load_hf(out)
    count = sum(np.size(x) for x in jax.tree.leaves(params))
    assert result.stdout.split() == ["300", "0", str(count)]


# --- the trainer on a cache, the text demo's gathering ----------------------------------


@pytest.mark.slow
def test_trainer_losses_on_a_cache_equal_in_memory(tmp_path):
    from train.config import parse_args
    from train.loop import run

    source = _pkl(tmp_path / "d.pkl", _records(60))
    data_cache.build_cache(source, tmp_path / "cache", eos_id=models.TINY.eos_token_id)
    argv = ["--model_name_or_path", "tiny", "--bf16", "false", "--attention", "xla"]
    argv += ["--mesh", "data=1,fsdp=-1,seq=1", "--model_max_length", "32", "--max_steps", "3"]
    argv += ["--logging_steps", "1", "--save_strategy", "no", "--report_to", "none"]
    argv += ["--export_hf", "false", "--learning_rate", "1e-2", "--progress", "false"]
    losses = [
        run(parse_args([*argv, "--data_path", str(data), "--output_dir", str(tmp_path / out)]))[
            "losses"
        ]
        for data, out in ((source, "memory"), (tmp_path / "cache", "cached"))
    ]
    assert len(losses[0]) == 3 and losses[0] == losses[1]


def test_text_demo_gathers_each_text_once_in_path_order(tmp_path):
    from train import text_demo

    body = "Permission is hereby granted, free of charge, to any person. " * 5
    files = {
        "b/LICENSE": body,
        "a/README.md": "# A\n\n" + body,
        "a/docs/x.rst": "A  " + body,
        "c/LICENSE.txt": body.replace(" ", "  "),  # the same text, other whitespace
        "pkg-1.0.dist-info/METADATA": "Name: pkg\nVersion: 1.0\n\nThe description. " + body,
        "pkg/METADATA": body + "not a dist-info",
        "d/short.md": "too short",
        "e/data.txt": body + "not a text file the demo reads",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    texts = text_demo.gather(tmp_path)
    assert texts == [files["a/README.md"], files["a/docs/x.rst"], files["b/LICENSE"],
                     "The description. " + body]  # fmt: skip


def test_examples_with_a_prompt_longer_than_a_row_are_named(tmp_path, capsys):
    """A prompt/completion example longer than a row is cut across rows, and its
    completion past the first row trains without the start of its prompt: one line
    says how many and which, in memory, through --data_cache_dir and from a cache.
    Plain documents longer than a row (a token stream) are cut as always, without a
    word."""

    def prompted(n_prompt: int, n_completion: int) -> str:
        ids = list(range(3, 3 + n_prompt + n_completion))
        return json.dumps({"input_ids": ids, "labels": [IGNORE] * n_prompt + ids[n_prompt:]})

    source = tmp_path / "d.jsonl"
    lines = [prompted(4, 2), prompted(20, 3), json.dumps(list(range(3, 60))), prompted(30, 1)]
    source.write_text("\n".join(lines) + "\n")
    warned = (
        f"{source}: 2 examples with a prompt (tokens labelled -100) are longer than a row of "
        "16 tokens (the longest: 31 tokens, line 4): each is cut across rows, and its "
        "tokens past its first row are predicted without the start of its prompt; raise "
        "--model_max_length or shorten them\n"
    )
    tail = f"{source}: the last 9 tokens (less than a row of 16) are not trained on\n"
    load_rows(_cfg(data_path=str(source), model_max_length=16), models.TINY)
    assert capsys.readouterr().out == warned + tail
    # A cache keeps no line numbers: it counts its examples from 1 in the file's order.
    cached = warned.replace(", line 4)", ", the cache's example 4)")
    cache_dir = str(tmp_path / "cc")
    load_rows(
        _cfg(data_path=str(source), model_max_length=16, data_cache_dir=cache_dir), models.TINY
    )
    assert capsys.readouterr().out.endswith(cached + tail)
    (cache,) = (tmp_path / "cc").iterdir()
    load_rows(_cfg(data_path=str(cache), model_max_length=16), models.TINY)
    assert capsys.readouterr().out == (cached + tail).replace(f"{source}: ", f"{cache}: ")
    # At 32 none is longer than a row, but the last straddles a row end: the stream
    # packing's own line names that one (`test_stream_packing_names_...`).
    load_rows(_cfg(data_path=str(source), model_max_length=32), models.TINY)
    said = capsys.readouterr().out
    assert "longer than a row" not in said
    assert said == (
        f"{source}: 1 of 3 examples with a prompt are cut at a row end of 32 tokens (their "
        "tokens past the cut are predicted without the start of their prompt); --packing "
        "whole keeps each that fits a row in one\n"
        f"{source}: the last 25 tokens (less than a row of 32) are not trained on\n"
    )


def test_an_examples_own_eos_counts_as_an_appended_one_does(tmp_path, capsys):
    """An example of a row's length ending with its own EOS fits the row as one without
    it does (the EOS packing appends is not counted either): in memory and from a cache
    alike, neither is named as longer than a row."""
    eos = data_eos(_cfg(), models.TINY)
    ids = list(range(3, 19))  # 16 tokens: a row of 16, then the EOS
    own = {"input_ids": [*ids, eos], "labels": [IGNORE] * 8 + ids[8:] + [eos]}
    appended = {"input_ids": ids, "labels": [IGNORE] * 8 + ids[8:]}
    longer = {"input_ids": [*ids, 19, eos], "labels": [IGNORE] * 8 + ids[8:] + [19, eos]}
    source = tmp_path / "d.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in (own, appended, longer)))
    for cache_dir in (None, str(tmp_path / "cc")):
        load_rows(
            _cfg(data_path=str(source), model_max_length=16, data_cache_dir=cache_dir),
            models.TINY,
        )
        said = capsys.readouterr().out
        assert "1 example with a prompt (tokens labelled -100) is longer than a row of 16 " in said
        assert "(the longest: 17 tokens, " in said


def test_cli_inspect_of_a_file_counts_as_its_cache_does(bpe, tmp_path, capsys):
    """`inspect FILE` counts the EOS that packing appends (the tokenizer's, or
    --eos-id), as `inspect` of the file's cache does and as the trainer's labelled
    tokens count it: prompt/completion records learn their EOS."""
    source = tmp_path / "qa.jsonl"
    records = [{"prompt": f"Question {i}?", "completion": f" Answer {i}."} for i in range(5)]
    source.write_text("".join(json.dumps(r) + "\n" for r in records))

    def inspect(*args) -> dict[str, str]:
        data_lib.main(["inspect", *map(str, args)])
        return dict(line.split(": ") for line in capsys.readouterr().out.splitlines())

    data_lib.main(["cache", str(source), str(tmp_path / "c"), "--tokenizer", str(bpe)])
    capsys.readouterr()
    cached = inspect(tmp_path / "c")
    assert inspect(source, "--tokenizer", bpe) == cached
    assert cached["eos_id"] == "0"
    plain = inspect(source, "--tokenizer", bpe, "--no-eos")
    assert plain["eos_id"] == "none"
    for key in ("tokens", "labelled_tokens", "min_length", "max_length"):
        assert int(plain[key]) == int(cached[key]) - (5 if "length" not in key else 1), key
    # Token ids with labels: no tokenizer names an EOS; --eos-id counts one.
    ids = tmp_path / "ids.jsonl"
    ids.write_text(json.dumps({"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}) + "\n")
    assert inspect(ids)["tokens"] == "3" and inspect(ids)["eos_id"] == "none"
    counted = inspect(ids, "--eos-id", 2)
    assert (counted["tokens"], counted["labelled_tokens"], counted["eos_id"]) == ("4", "3", "2")
    # A cache holds its own EOS: another one asked for is refused.
    with pytest.raises(SystemExit):
        data_lib.main(["inspect", str(tmp_path / "c"), "--eos-id", "3"])
    assert capsys.readouterr().err == (
        f"error: {tmp_path / 'c'}: the token cache holds eos_id=0 after each document, "
        "not --eos-id 3; its counts include it\n"
    )


def test_stream_packing_names_the_prompted_examples_it_cuts(tmp_path, capsys):
    """With `--packing stream`, examples with a prompt that fit a row but straddle a row
    end are counted in one line pointing to `--packing whole` (in memory and from the
    cache alike, the count worked out here by hand); whole packing cuts none and says
    nothing of it."""
    records = _records(40)
    source = _pkl(tmp_path / "d.pkl", records)

    def rows(**flags):
        return load_rows(_cfg(data_path=str(source), model_max_length=16, **flags), models.TINY)

    eos = models.TINY.eos_token_id
    lengths, prompted = [], []
    for r in records:
        ids = r["input_ids"] if isinstance(r, dict) else r
        lengths.append(len(ids) + (ids[-1] != eos))
        prompted.append(isinstance(r, dict) and IGNORE in r["labels"])
    ends = np.cumsum(lengths)
    starts = ends - np.asarray(lengths)
    cut = np.asarray(prompted) & (np.asarray(lengths) <= 16) & (starts // 16 != (ends - 1) // 16)
    want = f"{int(cut.sum())} of {sum(prompted)} examples with a prompt are cut at a row end of 16"
    assert cut.sum() > 0
    for flags in ({}, {"data_cache_dir": str(tmp_path / "cc")}):
        rows(**flags)
        said = capsys.readouterr().out
        assert want in said and "--packing whole keeps each that fits a row" in said, said
        rows(packing="whole", **flags)
        assert "are cut at a row end" not in capsys.readouterr().out


def test_cli_inspect_shows_the_tokens_the_loss_learns(bpe, tmp_path, capsys):
    """`inspect --show N` prints the first N examples with the learned tokens in [[ ]]:
    of a prompt/completion file, the completion and the EOS packing appends, as its
    token cache shows them; as ids without a tokenizer; the example's first token never
    (nothing predicts it)."""
    source = tmp_path / "qa.jsonl"
    records = [{"prompt": f"Question {i}?", "completion": f" Answer {i}."} for i in range(3)]
    source.write_text("".join(json.dumps(r) + "\n" for r in records))

    def shown(*args) -> list[str]:
        data_lib.main(["inspect", *map(str, args)])
        lines = capsys.readouterr().out.splitlines()
        return lines[next(i for i, s in enumerate(lines) if s.startswith("---")) :]

    got = shown(source, "--tokenizer", bpe, "--show", 2)
    assert len(got) == 4 and got[0].startswith("--- example 0: ")
    assert got[1] == "Question 0?[[ Answer 0.<|endoftext|>]]", got
    assert got[3] == "Question 1?[[ Answer 1.<|endoftext|>]]", got
    data_lib.main(["cache", str(source), str(tmp_path / "c"), "--tokenizer", str(bpe)])
    capsys.readouterr()
    assert shown(tmp_path / "c", "--tokenizer", bpe, "--show", 2) == got

    ids = tmp_path / "ids.jsonl"
    ids.write_text(json.dumps({"input_ids": [5, 6, 7, 8], "labels": [5, -100, 7, 8]}) + "\n")
    assert shown(ids, "--no-eos", "--show", 5) == [
        "--- example 0: 4 tokens, 2 learned (in [[ ]])",
        "5 6 [[7 8]]",
    ]
    with pytest.raises(SystemExit):
        data_lib.main(["inspect", str(ids), "--show", "-1"])
    assert capsys.readouterr() == ("", "error: --show -1: give a number of examples, 0 or more\n")


def test_cli_inspect_reads_a_data_file_one_example_at_a_time(tmp_path, monkeypatch, capsys):
    """`inspect --show N` of a data file counts as `TokenDataset.summary` does and shows
    what its packed stream holds, reading one example at a time: the dataset is never
    gathered in memory (a corpus larger than memory can be inspected). A token past
    --vocab-size is named by its line, as loading names it."""
    from train import dataset as dataset_lib

    path = tmp_path / "ids.jsonl"
    records = [{"input_ids": [5, 6, 7, 8], "labels": [5, -100, 7, 8]}, {"input_ids": [9, 3]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = load_dataset(path).summary(3)

    def gathered(self):
        raise AssertionError("inspect gathered the whole dataset")

    monkeypatch.setattr(dataset_lib._Gathered, "__init__", gathered)
    data_lib.main(["inspect", str(path), "--eos-id", "3", "--show", "2"])
    printed = capsys.readouterr().out.splitlines()
    assert printed[: len(summary)] == [f"{k}: {v}" for k, v in summary.items()]
    assert printed[len(summary) :] == [
        "eos_id: 3",
        "--- example 0: 5 tokens, 3 learned (in [[ ]])",
        "5 6 [[7 8 3]]",
        "--- example 1: 2 tokens, 1 learned (in [[ ]])",
        "9 [[3]]",
    ]
    with pytest.raises(SystemExit):
        data_lib.main(["inspect", str(path), "--vocab-size", "9"])
    assert capsys.readouterr().err.endswith(
        f"{path}: line 2: token id 9 is out of range for vocab_size=9\n"
    )


def test_cli_tokenizer_with_special_tokens_and_a_chat_template(bpe, tmp_path):
    """`train.data tokenizer --special-tokens ... --chat-template FILE`: the tokens get
    ids 1, 2, ... and are never split, the template lands as chat_template.jinja, and
    `models.convert --init --tokenizer` carries it into the model, where a conversation
    renders with it."""
    from models.convert import main as convert_main
    from train.chat import read_chat_template

    template = tmp_path / "t.jinja"
    template.write_text(
        "{% for m in messages %}<|start|>{{ m['role'] }}: {{ m['content'] }}<|eot|>{% endfor %}"
    )
    specials = ["<|start|>", "<|eot|>"]
    data_lib.main(
        ["tokenizer", str(bpe.parent / "corpus.txt"), "--out", str(tmp_path / "tok")]
        + ["--vocab-size", "300", "--special-tokens", *specials, "--chat-template", str(template)]
    )
    tokenizer = load_tokenizer(tmp_path / "tok")
    assert [tokenizer.token_to_id(t) for t in specials] == [1, 2]
    assert tokenizer.encode("<|start|>user: hi<|eot|>").ids[0] == 1
    assert tokenizer.encode("<|start|>user: hi<|eot|>").ids[-1] == 2
    convert_main(
        ["--init", "tiny", "--tokenizer", str(tmp_path / "tok"), "--out", str(tmp_path / "m")]
    )
    assert read_chat_template(tmp_path / "m")[0] == {"default": template.read_text()}
    with pytest.raises(SystemExit):
        data_lib.main(
            [
                "tokenizer",
                str(template),
                "--out",
                str(tmp_path / "x"),
                "--chat-template",
                "no.jinja",
            ]
        )
    # A template that does not compile, or a JSON file, is refused before training:
    # nothing written, as the trainer would refuse it only later.
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}{{ m }")
    for given, said in (
        ("bad.jinja", "does not compile"),
        ("tok/tokenizer.json", "a JSON file, not a Jinja chat template"),
    ):
        with pytest.raises(ValueError, match=rf"--chat-template='.*{given}': .*{said}"):
            data_lib.train_tokenizer(
                [bpe.parent / "corpus.txt"],
                tmp_path / "y",
                vocab_size=300,
                chat_template=tmp_path / given,
            )
        assert not (tmp_path / "y").exists()


def test_errors_name_the_record_an_example_came_from(bpe, tmp_path):
    """In a format without lines (a pickle), an error names the record the example came
    from, not the example's index: here an empty text is dropped before it, so the
    out-of-range record is record 2, the dataset's example 1."""
    source = tmp_path / "r.pkl"
    records = [{"text": "The trainer packs documents."}, {"text": ""}, {"input_ids": [4, 400]}]
    source.write_bytes(pickle.dumps(records))
    dataset = load_dataset(source, tokenizer=bpe)
    assert dataset.num_examples == 2 and dataset.where(1) == "record 2"
    with pytest.raises(ValueError, match=r"r\.pkl: record 2: token id 400 is out of range"):
        load_dataset(source, tokenizer=bpe, vocab_size=300)


def test_a_start_lists_a_data_folder_once(tmp_path, monkeypatch):
    """The trainer's start lists a folder of data files once, for its stamp, its names
    and its reading (seven walks before, each slow on a network filesystem), with a
    cache built and with one reused."""
    from train import readers

    root = tmp_path / "d"
    for k in range(6):
        (root / f"s{k % 2}").mkdir(parents=True, exist_ok=True)
        (root / f"s{k % 2}" / f"f{k}.jsonl").write_text(f"[{k + 1}, 2, 3]\n")
    listings = []
    real = readers._list
    monkeypatch.setattr(readers, "_list", lambda path: listings.append(path) or real(path))
    cfg = _cfg(data_path=str(root), model_max_length=4)
    cfg = dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, data_cache_dir=str(tmp_path / "caches"))
    )
    for _ in range(2):  # built, then reused
        listings.clear()
        assert load_rows(cfg, models.TINY).num_rows > 0
        assert [str(p) for p in listings] == [str(root)]
    assert readers._listings is None  # outside a start, a folder is listed afresh


def test_a_cache_builds_where_the_filesystem_has_no_locks(tmp_path, monkeypatch):
    """A filesystem without flock (some FUSE and network mounts answer ENOLCK) builds
    its cache unlocked rather than failing."""
    import errno

    def no_locks(fd, how):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(data_cache.fcntl, "flock", no_locks)
    source = _pkl(tmp_path / "d.pkl", [[5, 6, 7]])
    cache = data_cache.build_cache(source, tmp_path / "c")
    assert np.asarray(cache.tokens).tolist() == [5, 6, 7]
    assert not data_cache._held(tmp_path / "c")


def test_a_text_that_is_not_unicode_is_named_by_its_record(bpe, tmp_path):
    """A lone UTF-16 surrogate (valid JSON, `"\\ud800"`, in scraped text) in a text, a
    prompt or a completion is refused naming its file, line and field, where the
    tokenizer raised a TypeError naming none; the tokenizer tool names it too."""
    good = json.dumps({"text": "fine text"})
    for record, field in (
        ('{"text": "bad \\ud800 surrogate"}', "'text'"),
        ('{"prompt": "q \\udc80", "completion": "a"}', "'prompt'"),
        ('{"prompt": "q", "completion": "a \\udc80"}', "'completion'"),
    ):
        source = tmp_path / "s.jsonl"
        source.write_text(f"{good}\n{record}\n")
        cfg = _cfg(data_path=str(source), model_max_length=4, tokenizer_name_or_path=str(bpe))
        with pytest.raises(ValueError) as refused:
            load_rows(cfg, models.TINY)
        assert f"{source}: line 2: {field} holds " in str(refused.value), str(refused.value)
        assert "a lone UTF-16 surrogate" in str(refused.value)
    with pytest.raises(ValueError, match=r"s\.jsonl: line 2: a text holds '\\udc80' at character"):
        data_lib.train_tokenizer([source], tmp_path / "tok", vocab_size=300)
    assert not (tmp_path / "tok").exists()


def test_the_tokenizer_tool_reads_utf8_text_once_per_file(bpe, tmp_path):
    """Plain text that is not UTF-8 is refused naming the file and byte (it was decoded
    with replacement characters, which the tokenizer then learned); a byte order mark
    is no text; a file reached twice (a link, a folder and a file in it) is learned
    from once: the same tokenizer as from the file alone."""
    latin = tmp_path / "latin.txt"
    latin.write_bytes(("café naïve " * 50).encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin\.txt: byte 3 is not UTF-8 \(invalid contin"):
        data_lib.train_tokenizer([latin], tmp_path / "t0", vocab_size=300)
    corpus = bpe.parent / "corpus.txt"
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_bytes(b"\xef\xbb\xbf" + corpus.read_bytes())
    os.symlink("../a.txt", folder / "sub" / "again.txt")
    data_lib.train_tokenizer([folder, folder / "a.txt"], tmp_path / "t1", vocab_size=300)
    assert (tmp_path / "t1" / "tokenizer.json").read_bytes() == (
        bpe / "tokenizer.json"
    ).read_bytes()


def test_a_full_disk_while_caching_names_the_file_in_one_line(tmp_path, monkeypatch, capsys):
    """A file object's write on a full disk raises an OSError naming no file: the cache
    writer names the file it was writing, and `python -m train.data` ends with that one
    line and exit status 1, as the trainer does, instead of a traceback."""
    import errno

    class Full:
        name = str(tmp_path / "tokens.bin")

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError) as e:
        data_cache._write_to(Full(), lambda f: f.write(b"x"))
    assert e.value.errno == errno.ENOSPC and e.value.filename == Full.name

    def full(args):
        data_cache._write_to(Full(), lambda f: f.write(b"x"))

    monkeypatch.setattr(data_lib, "_command", full)
    (tmp_path / "ids.jsonl").write_text('{"input_ids": [1, 2]}\n')
    with pytest.raises(SystemExit) as stop:
        data_lib.main(["cache", str(tmp_path / "ids.jsonl"), str(tmp_path / "c")])
    assert stop.value.code == 1
    assert capsys.readouterr().err == f"error: {Full.name}: No space left on device\n"


def test_a_cache_without_its_meta_is_not_read_as_a_data_folder(tmp_path):
    """A token cache whose meta.json is missing or damaged is refused as a damaged cache,
    naming the file: read as a folder of data files, its index.npy of document offsets
    would be trained on as token ids."""
    data_cache.build_cache(_pkl(tmp_path / "d.pkl", _records(8)), tmp_path / "c")
    meta = tmp_path / "c" / "meta.json"
    for damage in (lambda: meta.write_text('{"format": "jflash-tok'), meta.unlink):
        damage()
        with pytest.raises(ValueError, match=r"a token cache's tokens\.bin with no readable meta"):
            load_dataset(tmp_path / "c")


def test_one_corpus_tokenized_two_ways_keeps_a_cache_each(tmp_path, capsys):
    """`--data_cache_dir` names a cache by its source and the settings that make its
    bytes: two runs of one corpus with different EOS ids (or tokenizers, chat settings)
    each reuse their own cache, not rebuild one by turns."""
    source = _pkl(tmp_path / "d.pkl", _records(20))
    root = tmp_path / "caches"
    for eos in (EOS, None, EOS, None):
        data_cache.packed_rows(source, 8, eos_id=eos, cache_root=root)
    said = capsys.readouterr().out
    assert said.count("token cache: wrote") == 2 and "stale" not in said, said
    assert len(list(root.iterdir())) == 2
    assert all(p.name.startswith("d.pkl-") for p in root.iterdir())
    where = data_cache.cache_location(source, root, eos_id=EOS)
    assert where != data_cache.cache_location(source, root, eos_id=None)
    assert where == data_cache.cache_location(str(source), root, eos_id=EOS, chat_turns="auto")


def test_a_cache_another_process_checked_is_read_whatever_this_copys_time(tmp_path, capsys):
    """A multi-host run sharing its cache, each host with its own copy of the data
    (their times apart): the processes after process 0 read the cache process 0 checked,
    checking the settings only, instead of rebuilding it under process 0 by turns."""
    source = _pkl(tmp_path / "d.pkl", _records(20))
    root = tmp_path / "caches"
    data_cache.packed_rows(source, 8, eos_id=EOS, cache_root=root)
    os.utime(source, ns=(10**18, 10**18))  # this host's copy: another time
    capsys.readouterr()
    data_cache.packed_rows(source, 8, eos_id=EOS, cache_root=root, source_checked=True)
    assert "stale" not in capsys.readouterr().out
    cache = data_cache.open_cache(data_cache.cache_location(source, root, eos_id=EOS))
    assert cache.mismatch(eos_id=7, check_source=False) == ["built with eos_id=2, this run's is 7"]
    data_cache.packed_rows(source, 8, eos_id=EOS, cache_root=root)  # process 0's check
    assert "changed since the cache was built (size or mtime)): rebuilding" in (
        capsys.readouterr().out
    )


def test_a_cache_replaced_as_this_build_finished_is_refused(tmp_path, monkeypatch):
    """Two builds of one cache with other settings finishing together: the cache in
    place once this one's rename is done is checked, and another's is refused in one
    line, not trained on."""
    source = _pkl(tmp_path / "d.pkl", _records(20))
    move = data_cache._move_into_place

    def and_another(tmp, cache_dir):
        move(tmp, cache_dir)  # this build's cache is in place; the other one finishes now
        monkeypatch.setattr(data_cache, "_move_into_place", move)
        data_cache.build_cache(source, cache_dir, eos_id=7)

    monkeypatch.setattr(data_cache, "_move_into_place", and_another)
    with pytest.raises(
        ValueError,
        match=r"c: the token cache in place as this build finished "
        r"is not this run's \(built with eos_id=7, this run's is 2\)",
    ):
        data_cache.ensure_cache(source, tmp_path / "c", eos_id=EOS)


def test_a_cache_that_cannot_be_written_is_named_in_one_line(tmp_path, monkeypatch):
    """Permission denied (another user's cache folder) or a file size limit while
    building: one line naming the cache, not a traceback naming a hidden folder; the
    same errors reading the data stay the data's."""
    import errno

    source = _pkl(tmp_path / "d.pkl", _records(20))
    for code, words in ((errno.EACCES, "Permission denied"), (errno.EFBIG, "File too large")):

        def refuse(folder, code=code, words=words):
            raise OSError(code, words, str(folder / "tokens.bin"))

        monkeypatch.setattr(data_cache, "_Writer", refuse)
        with pytest.raises(ValueError) as e:
            data_cache.ensure_cache(source, tmp_path / "c", eos_id=EOS)
        assert str(e.value).startswith(
            f"{tmp_path / 'c'}: the token cache cannot be written there ("
        ) and f"tokens.bin: {words})" in str(e.value)
        assert _leftovers(tmp_path) == []
    monkeypatch.undo()

    def unreadable(path, parser):
        raise PermissionError(errno.EACCES, "Permission denied", str(source))

    monkeypatch.setattr(data_cache, "read_examples", unreadable)
    with pytest.raises(PermissionError):
        data_cache.ensure_cache(source, tmp_path / "c", eos_id=EOS)


def test_a_cache_whose_meta_a_crash_emptied_is_rebuilt(tmp_path, capsys):
    """A cache with an empty or cut meta.json (a machine's crash before it reached the
    disk) is rebuilt in place under `--data_cache_dir` and by `train.data cache`, where
    a folder holding other files is still refused."""
    source = _pkl(tmp_path / "d.pkl", _records(20))
    cache, _ = data_cache.ensure_cache(source, tmp_path / "c", eos_id=EOS)
    tokens = np.asarray(cache.tokens).tolist()
    (tmp_path / "c" / "meta.json").write_text("")
    capsys.readouterr()
    cache, built = data_cache.ensure_cache(source, tmp_path / "c", eos_id=EOS)
    assert built and np.asarray(cache.tokens).tolist() == tokens
    assert "is damaged (its meta.json is unreadable): rebuilding" in capsys.readouterr().out
    (tmp_path / "c" / "meta.json").write_text('{"format": ')
    (tmp_path / "c" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"c exists and is not a token cache; not writing"):
        data_cache.ensure_cache(source, tmp_path / "c", eos_id=EOS)
    # Another tool's folder with a readable meta.json of its own is kept, whatever else.
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "meta.json").write_text('{"experiment": "important"}')
    for files in ((), ("tokens.bin", "index.npy")):
        for name in files:
            (mine / name).write_bytes(b"")
        for build in (data_cache.build_cache, data_cache.ensure_cache):
            with pytest.raises(ValueError, match=r"mine exists and is not a token cache"):
                build(source, mine, eos_id=EOS)
        assert (mine / "meta.json").read_text() == '{"experiment": "important"}'


def test_the_trainers_other_processes_read_the_shared_cache_process_0_checked(
    tmp_path, monkeypatch, capsys
):
    """The trainer as process 1 of a run sharing `--data_cache_dir`, its host's copy of
    the data at process 0's path with another time: it reads the cache process 0 built
    (rebuilding it would delete the files process 0 is reading, and every start would
    tokenize the corpus again on every host)."""
    from jax.experimental import multihost_utils

    from train import hosts

    source = _pkl(tmp_path / "d.pkl", _records(20))
    cfg = _cfg(data_path=str(source), model_max_length=8, data_cache_dir=str(tmp_path / "cc"))
    rows = load_rows(cfg, models.TINY)  # process 0's build
    os.utime(source, ns=(10**18, 10**18))
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    monkeypatch.setattr(hosts, "shared", lambda folder: True)
    monkeypatch.setattr(multihost_utils, "broadcast_one_to_all", lambda x: np.int32(0))
    capsys.readouterr()
    again = load_rows(cfg, models.TINY)
    assert "token cache" not in capsys.readouterr().out
    _assert_rows_equal(rows.take(np.arange(rows.num_rows)), again.take(np.arange(rows.num_rows)))


def test_a_cache_an_earlier_jflash_named_by_its_path_is_taken_under_its_new_name(tmp_path, capsys):
    """Caches were named by the hash of their source's path alone: one that is this
    run's is renamed to the name its settings give it, not tokenized again; one of
    other settings is left where it is."""
    import hashlib

    source = _pkl(tmp_path / "d.pkl", _records(20))
    root = tmp_path / "caches"
    digest = hashlib.sha256(data_cache.source_path(source).encode()).hexdigest()[:12]
    former = root / f"d.pkl-{digest}"
    data_cache.build_cache(source, former, eos_id=EOS)
    capsys.readouterr()
    data_cache.packed_rows(source, 8, eos_id=7, cache_root=root)  # other settings: kept
    assert former.is_dir() and "token cache: wrote" in capsys.readouterr().out
    data_cache.packed_rows(source, 8, eos_id=EOS, cache_root=root)
    said = capsys.readouterr().out
    location = data_cache.cache_location(source, root, eos_id=EOS)
    assert f"token cache: {former} renamed {location}" in said and "wrote" not in said
    assert not former.exists() and data_cache.is_cache(location)
