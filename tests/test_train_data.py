"""Tests of the data modules (train/patterns.py, train/readers.py, train/records.py,
train/dataset.py, train/data.py): formats, malformed data, row packing, batches,
resume, CLI."""

from __future__ import annotations

import collections
import json
import pickle
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from train import data_cache, readers
from train.data import (
    Batches,
    document_lengths,
    markov_samples,
    save_dataset,
    text_files_of,
    train_tokenizer,
)
from train.data import main as data_main
from train.dataset import Rows, TokenDataset, load_dataset
from train.records import load_tokenizer

REPO = Path(__file__).resolve().parents[1]
IGNORE = -100


def _dump_pkl(path: Path, obj) -> Path:
    with open(path, "wb") as f:
        pickle.dump(obj, f)
    return path


def _dump_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def _dataset(*examples: list[int]) -> TokenDataset:
    return TokenDataset.from_examples("mem", [np.asarray(e, np.int32) for e in examples])


def _rows(num_rows: int, seq_len: int = 4) -> Rows:
    ids = np.arange(num_rows * seq_len, dtype=np.int32).reshape(num_rows, seq_len)
    return Rows(ids, ids + 1, np.zeros_like(ids))


# --- formats ---------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".pkl", ".jsonl", ".npy"])
def test_round_trip(tmp_path, suffix):
    examples = markov_samples(6, 33, vocab_size=500, seed=3)
    path = tmp_path / f"data{suffix}"
    save_dataset(path, examples)
    dataset = load_dataset(path, vocab_size=500)
    assert dataset.num_examples == 6
    for i in range(6):
        np.testing.assert_array_equal(dataset.example(i), examples[i])
    np.testing.assert_array_equal(dataset.targets, dataset.tokens)
    assert dataset.summary() == {
        "examples": 6,
        "tokens": 6 * 33,
        "labelled_tokens": 6 * 32,  # each example's first token is no target
        "min_length": 33,
        "max_length": 33,
        "max_id": int(examples.max()),
    }


def test_pkl_accepts_lists_arrays_and_dicts_with_labels(tmp_path):
    path = _dump_pkl(
        tmp_path / "d.pkl",
        [[1, 2, 3], np.array([4, 5], np.int64), {"input_ids": [6, 7], "labels": [IGNORE, 7]}],
    )
    dataset = load_dataset(path)
    assert dataset.lengths.tolist() == [3, 2, 2]
    assert dataset.tokens.tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert dataset.targets.tolist() == [1, 2, 3, 4, 5, IGNORE, 7]
    # 2, 3, 5 and 7: not the -100 label, nor an example's first token (1, 4, 6)
    assert dataset.summary()["labelled_tokens"] == 4


def test_npy_token_stream(tmp_path):
    np.save(tmp_path / "s.npy", np.arange(10, dtype=np.int64))
    dataset = load_dataset(tmp_path / "s.npy")
    assert dataset.num_examples == 1
    assert dataset.tokens.tolist() == list(range(10))


def test_parquet_columns(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({"input_ids": [[1, 2, 3], [4, 5]], "labels": [[IGNORE, 2, 3], [4, 5]]})
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=1)
    dataset = load_dataset(tmp_path / "d.parquet", vocab_size=6)
    assert dataset.tokens.tolist() == [1, 2, 3, 4, 5]
    assert dataset.targets.tolist() == [IGNORE, 2, 3, 4, 5]
    pq.write_table(pa.table({"input_ids": [[1], [2, -7]]}), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"bad\.parquet: record 1: 'input_ids': id -7"):
        load_dataset(tmp_path / "bad.parquet")
    pq.write_table(pa.table({"tokens": [[1]]}), tmp_path / "cols.parquet")
    with pytest.raises(ValueError, match=r"cols\.parquet: expected a column 'input_ids', "):
        load_dataset(tmp_path / "cols.parquet")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match=r"junk\.parquet: not a readable parquet file"):
        load_dataset(tmp_path / "junk.parquet")


def test_parquet_text_and_saved_dataset(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setitem(sys.modules, "tokenizers", types.SimpleNamespace(Tokenizer=_FakeTokenizer))
    (tmp_path / "tokenizer.json").write_text("{}")
    records = datasets.Dataset.from_dict({"text": ["ab", "c"], "meta": [1, 2]})
    records.to_parquet(str(tmp_path / "t.parquet"))
    assert load_dataset(tmp_path / "t.parquet", tokenizer=tmp_path).tokens.tolist() == [97, 98, 99]
    ids = datasets.Dataset.from_dict({"input_ids": [[7, 8], [9]]})
    ids.save_to_disk(str(tmp_path / "saved"))
    dataset = load_dataset(tmp_path / "saved")
    assert dataset.tokens.tolist() == [7, 8, 9] and dataset.offsets.tolist() == [0, 2, 3]
    datasets.DatasetDict({"train": ids}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(ValueError, match=r"dict: holds the splits \['train'\]; pass .*dict/train"):
        load_dataset(tmp_path / "dict")
    assert load_dataset(tmp_path / "dict" / "train").num_tokens == 3
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / "state.json").write_text("{}")
    with pytest.raises(ValueError, match=r"torn: not a dataset saved with save_to_disk"):
        load_dataset(tmp_path / "torn")


def test_missing_hf_packages_name_the_extra(tmp_path, monkeypatch):
    (tmp_path / "d.parquet").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # makes the import fail
    with pytest.raises(
        ValueError, match=r"d\.parquet: .*'pyarrow' package: pip install 'jflash\[hf\]'"
    ):
        load_dataset(tmp_path / "d.parquet")
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "state.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(
        ValueError, match=r"saved: .*'datasets' package: pip install 'jflash\[hf\]'"
    ):
        load_dataset(tmp_path / "saved")


def test_a_directory_of_neither_kind_says_what_it_lacks(tmp_path):
    """A directory that no reader knows (empty, a tokenizer's, a cache without its
    meta.json) is named as neither kind, not sent to the `datasets` package."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty: a directory that is neither a token cache"):
        load_dataset(tmp_path / "empty")


def test_a_format_is_one_reader_entry(tmp_path, monkeypatch):
    """A new format is one entry in READERS: `.tsv` lines of ids, here."""

    def read_tsv(path):
        for i, line in enumerate(path.read_text().splitlines()):
            yield i, [int(x) for x in line.split("\t")]

    monkeypatch.setitem(readers.READERS, ".tsv", readers.Reader(readers.records_reader(read_tsv)))
    (tmp_path / "d.tsv").write_text("1\t2\n3\n")
    dataset = load_dataset(tmp_path / "d.tsv")
    assert dataset.tokens.tolist() == [1, 2, 3] and dataset.lengths.tolist() == [2, 1]
    assert set(readers.FORMATS) == {".pkl", ".jsonl", ".npy", ".parquet", "save_to_disk", "files"}


class _FakeTokenizer:
    """Stands in for ``tokenizers.Tokenizer``: one id per character, after the BOS id
    ``bos`` (None: none) where special tokens are added."""

    bos: int | None = None

    @classmethod
    def from_file(cls, path):
        assert Path(path).name == "tokenizer.json"
        return cls()

    def encode(self, text, add_special_tokens=True):
        bos = [self.bos] if add_special_tokens and self.bos is not None else []
        mask = [1] * len(bos) + [0] * len(text)
        return types.SimpleNamespace(ids=bos + [ord(c) for c in text], special_tokens_mask=mask)

    def encode_batch(self, texts, add_special_tokens=True):
        return [self.encode(t, add_special_tokens) for t in texts]

    def no_padding(self):
        pass

    def no_truncation(self):
        pass


class _FakeBosTokenizer(_FakeTokenizer):
    """A fake tokenizer whose post-processor adds BOS ``1``, as Llama's does."""

    bos = 1


def _fake_tokenizer(monkeypatch, folder: Path, cls=_FakeBosTokenizer) -> Path:
    """``folder``, holding a ``tokenizer.json`` that ``cls`` stands in for."""
    monkeypatch.setitem(sys.modules, "tokenizers", types.SimpleNamespace(Tokenizer=cls))
    (folder / "tokenizer.json").write_text("{}")
    return folder


def test_text_records_use_the_model_tokenizer(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", types.SimpleNamespace(Tokenizer=_FakeTokenizer))
    (tmp_path / "tokenizer.json").write_text("{}")
    path = _dump_jsonl(tmp_path / "t.jsonl", ['{"text": "ab"}', '{"input_ids": [5]}'])
    dataset = load_dataset(path, tokenizer=tmp_path)
    assert dataset.tokens.tolist() == [97, 98, 5]


def test_empty_texts_are_skipped_and_counted(tmp_path, monkeypatch, capsys):
    """Corpora hold empty records (blank lines of a text dump): they give no tokens, so
    they are skipped, and the log says how many; the others keep their line numbers."""
    monkeypatch.setitem(sys.modules, "tokenizers", types.SimpleNamespace(Tokenizer=_FakeTokenizer))
    (tmp_path / "tokenizer.json").write_text("{}")
    lines = ['{"text": ""}', '{"text": "ab"}', '{"text": ""}', '{"input_ids": [5]}']
    path = _dump_jsonl(tmp_path / "t.jsonl", lines)
    dataset = load_dataset(path, tokenizer=tmp_path)
    assert dataset.tokens.tolist() == [97, 98, 5] and list(dataset.lines) == [2, 4]
    assert "t.jsonl: skipped 2 records whose 'text' tokenizes to nothing" in capsys.readouterr().out
    cache, _ = data_cache.ensure_cache(path, tmp_path / "c", tokenizer=tmp_path, eos_id=None)
    assert np.asarray(cache.tokens).tolist() == [97, 98, 5]  # the token cache reads alike
    assert "skipped 2 records" in capsys.readouterr().out
    empty = _dump_jsonl(tmp_path / "e.jsonl", ['{"text": ""}'])
    with pytest.raises(ValueError, match="e.jsonl: the dataset has no examples"):
        load_dataset(empty, tokenizer=tmp_path)


def test_text_without_tokenizer_is_a_clear_error(tmp_path, monkeypatch, capsys):
    path = _dump_jsonl(tmp_path / "t.jsonl", ['{"input_ids": [5]}', '{"text": "ab"}'])
    with pytest.raises(ValueError, match=r"t\.jsonl: line 2: .*no tokenizer was given"):
        load_dataset(path)
    with pytest.raises(ValueError, match=r"given; pass --tokenizer_name_or_path \(a "):
        load_dataset(path)  # the trainer's flag
    for command in (["inspect", str(path)], ["cache", str(path), str(tmp_path / "c")]):
        with pytest.raises(SystemExit):
            data_main(command)  # these commands' own flag
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err
        assert "no tokenizer was given; pass --tokenizer (a tokenizer.json or its " in err, err
    with pytest.raises(ValueError, match=r"tokenizer\.json does not exist"):
        load_dataset(path, tokenizer=tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(ValueError, match=r"line 2: .*'tokenizers' package"):
        load_dataset(path, tokenizer=tmp_path)


# --- prompt/completion records ---------------------------------------------------------


def _write(path: Path, records: list) -> Path:
    """``records`` as a ``.jsonl`` file (one per line) or a pickled ``.pkl`` list."""
    if path.suffix == ".pkl":
        return _dump_pkl(path, records)
    return _dump_jsonl(path, [json.dumps(r) for r in records])


@pytest.fixture(scope="module")
def bos_bpe(tmp_path_factory) -> Path:
    """A byte-level BPE of 300 tokens whose post-processor adds BOS ``<|endoftext|>``
    (id 0) before every text, as Llama's adds its ``<s>``."""
    tokenizers = pytest.importorskip("tokenizers")
    folder = tmp_path_factory.mktemp("bos_bpe")
    (folder / "corpus.txt").write_text((REPO / "docs" / "trainer.md").read_text())
    file = train_tokenizer([folder / "corpus.txt"], folder / "tok", vocab_size=300)
    tokenizer = tokenizers.Tokenizer.from_file(str(file))
    tokenizer.post_processor = tokenizers.processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
    )
    tokenizer.save(str(file))
    return folder / "tok"


def test_text_is_tokenized_without_the_files_padding_or_truncation(bos_bpe, tmp_path):
    """A tokenizer.json saved with padding and truncation on (the `tokenizers`
    quicktour's `enable_padding`, `enable_truncation`) gives each text its own ids, as
    an HF tokenizer's call does: no pad tokens to train on, no text cut."""
    tokenizers = pytest.importorskip("tokenizers")
    folder = tmp_path / "tok"
    shutil.copytree(bos_bpe, folder)
    saved = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    saved.enable_padding(pad_id=0, pad_token="<|endoftext|>")
    saved.enable_truncation(8)
    saved.save(str(folder / "tokenizer.json"))
    texts = ["Short.", "A longer document about packing rows of tokens for the trainer."]
    dataset = load_dataset(
        _write(tmp_path / "t.jsonl", [{"text": s} for s in texts]), tokenizer=folder
    )
    plain = tokenizers.Tokenizer.from_file(str(bos_bpe / "tokenizer.json"))
    expected = [plain.encode(s).ids for s in texts]
    assert len(expected[1]) > 8  # the file's truncation would cut it
    assert dataset.tokens.tolist() == expected[0] + expected[1]


def test_a_text_of_only_the_tokenizers_bos_is_empty(bos_bpe, tmp_path, capsys):
    """An empty text tokenizes to the BOS alone where the post-processor adds one
    (Llama-3's): it is skipped and counted as empty, not trained as BOS then EOS."""
    lines = [{"text": ""}, {"text": "hello"}, {"text": ""}]
    dataset = load_dataset(_write(tmp_path / "t.jsonl", lines), tokenizer=bos_bpe)
    hello = load_tokenizer(bos_bpe).encode("hello").ids
    assert hello[0] == 0 and dataset.tokens.tolist() == hello and list(dataset.lines) == [2]
    assert "t.jsonl: skipped 2 records whose 'text' tokenizes to nothing" in capsys.readouterr().out


def test_prompt_completion_records_label_the_completion_only(bos_bpe, tmp_path):
    """The prompt is tokenized with the tokenizer's special tokens (its BOS), the
    completion without them; the ids are both, the labels -100 on the prompt."""
    pairs = [
        ("The trainer packs documents", " into rows."),
        ("Labels never cross", " an example boundary"),
        ("", "An empty prompt is fine."),
    ]
    path = _write(tmp_path / "qa.jsonl", [{"prompt": p, "completion": c} for p, c in pairs])
    dataset = load_dataset(path, tokenizer=bos_bpe)
    tokenizer = load_tokenizer(bos_bpe)
    assert dataset.num_examples == 3 and list(dataset.lines) == [1, 2, 3]
    for i, (prompt, completion) in enumerate(pairs):
        question = tokenizer.encode(prompt).ids
        answer = tokenizer.encode(completion, add_special_tokens=False).ids
        assert question[0] == 0 and 0 not in answer  # the BOS opens the prompt only
        span = slice(dataset.offsets[i], dataset.offsets[i + 1])
        assert dataset.tokens[span].tolist() == question + answer
        assert dataset.targets[span].tolist() == [IGNORE] * len(question) + answer


def test_chat_settings_on_data_without_conversations_get_a_line(bos_bpe, tmp_path, capsys):
    """The chat settings render conversations only: on text records they change
    nothing, and one line says which of them were given; none is printed when a
    record is a conversation or when no chat setting was given."""
    path = _write(tmp_path / "t.jsonl", [{"text": "The trainer packs documents"}])
    load_dataset(path, tokenizer=bos_bpe, chat_turns="split", chat_template_kwargs={"a": 1})
    out = capsys.readouterr().out
    assert (
        f"{path}: no record holds 'messages', so the chat settings given (chat_template_kwargs, "
        "chat_turns) change nothing in it" in out
    )
    load_dataset(path, tokenizer=bos_bpe)
    assert "messages" not in capsys.readouterr().out


def test_the_eos_after_a_completion_is_learned(tmp_path, monkeypatch):
    """Packed with an EOS after each record, a prompt/completion record's EOS is
    labelled (the model learns to stop), in memory and in the token cache alike; the
    labelled positions are the completion's tokens and its EOS, nothing of the prompt."""
    tok = _fake_tokenizer(monkeypatch, tmp_path)
    records = [{"prompt": "ab", "completion": "cd"}, {"prompt": "e", "completion": "f"}]
    path = _write(tmp_path / "qa.jsonl", records)
    eos = 2
    rows = load_dataset(path, tokenizer=tok).rows(12, eos_id=eos, pad_last=True)
    bos, a, b, c, d, e, f = 1, 97, 98, 99, 100, 101, 102
    assert rows.input_ids.tolist() == [[bos, a, b, c, d, eos, bos, e, f, eos, 0, 0]]
    # labels[t] is the target of input_ids[t]: the last prompt token's is the completion's
    # first token, the completion's last token's the EOS.
    assert rows.labels.tolist() == [
        [IGNORE, IGNORE, c, d, eos, IGNORE, IGNORE, f, eos, IGNORE, IGNORE, IGNORE]
    ]
    assert rows.labelled and (rows.labels != IGNORE).sum() == len("cd") + 1 + len("f") + 1
    cache = data_cache.build_cache(path, tmp_path / "c", tokenizer=tok, eos_id=eos)
    assert np.asarray(cache.targets).tolist() == [
        *[IGNORE, IGNORE, IGNORE, c, d, eos],
        *[IGNORE, IGNORE, f, eos],
    ]
    cached = cache.rows(12, pad_last=True)
    assert cached.labelled
    for got, want in zip(cached.take([0]), rows, strict=True):
        np.testing.assert_array_equal(got, want)


def test_the_token_cache_reads_prompt_completion_records(tmp_path, monkeypatch, capsys):
    """`python -m train.data cache` builds a cache of prompt/completion records with
    their labels (labels.bin: they carry labels) and their tokenizer's stamp; rows cut
    from it are the in-memory rows."""
    tok = _fake_tokenizer(monkeypatch, tmp_path)
    records = [{"prompt": "ab", "completion": "c"}, {"input_ids": [5, 6]}, {"text": "d"}]
    path = _write(tmp_path / "qa.jsonl", records)
    data_main(["cache", str(path), str(tmp_path / "c"), "--tokenizer", str(tok), "--eos-id", "2"])
    assert capsys.readouterr().out.startswith(f"wrote {tmp_path / 'c'}: 3 documents, 11 tokens")
    meta = json.loads((tmp_path / "c" / data_cache.META).read_text())
    assert meta["labels"] and (tmp_path / "c" / data_cache.LABELS).is_file()
    assert meta["tokenizer"]["path"] == str((tmp_path / "tokenizer.json").resolve())
    cache = data_cache.open_cache(tmp_path / "c")
    assert np.asarray(cache.tokens).tolist() == [1, 97, 98, 99, 2, 5, 6, 2, 1, 100, 2]
    assert np.asarray(cache.targets).tolist() == [
        *[IGNORE, IGNORE, IGNORE, 99, 2],
        *[5, 6, 2],
        *[1, 100, 2],
    ]
    memory = load_dataset(path, tokenizer=tok).rows(4, eos_id=2)
    for got, want in zip(cache.rows(4).take(np.arange(memory.num_rows)), memory, strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("suffix", [".jsonl", ".pkl"])
def test_mixed_records_are_read_by_their_first_kind(tmp_path, monkeypatch, suffix):
    """input_ids, text and prompt/completion records side by side, each read by the
    first of those keys it has (input_ids, then text, then prompt and completion)."""
    tok = _fake_tokenizer(monkeypatch, tmp_path)
    records = [
        {"input_ids": [5, 6], "labels": [IGNORE, 6]},
        {"text": "ab"},
        {"prompt": "c", "completion": "de", "source": "qa"},
        [7],
        {"input_ids": [8], "prompt": "x", "completion": "y"},
        {"text": "f", "prompt": "x", "completion": 3},
        {"prompt": "", "completion": "g"},
    ]
    dataset = load_dataset(_write(tmp_path / f"mixed{suffix}", records), tokenizer=tok)
    assert dataset.lengths.tolist() == [2, 3, 4, 1, 1, 2, 2]
    assert dataset.tokens.tolist() == [5, 6, 1, 97, 98, 1, 99, 100, 101, 7, 8, 1, 102, 1, 103]
    assert dataset.targets.tolist() == [
        *[IGNORE, 6],
        *[1, 97, 98],
        *[IGNORE, IGNORE, 100, 101],
        *[7, 8, 1, 102],
        *[IGNORE, 103],
    ]


def test_prompt_completion_is_tokenized_a_chunk_at_a_time(tmp_path, monkeypatch):
    """One encode_batch call for a chunk's prompts and one for its completions (the
    completions without special tokens), none per record."""
    calls = []

    class Counting(_FakeBosTokenizer):
        def encode(self, text, add_special_tokens=True):
            raise AssertionError("tokenized one record at a time")

        def encode_batch(self, texts, add_special_tokens=True):
            calls.append((len(texts), add_special_tokens))
            return [super(Counting, self).encode(t, add_special_tokens) for t in texts]

    tok = _fake_tokenizer(monkeypatch, tmp_path, Counting)
    records = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(700)]
    dataset = load_dataset(_write(tmp_path / "qa.jsonl", records), tokenizer=tok)
    assert dataset.num_examples == 700
    assert calls == [(512, True), (512, False), (188, True), (188, False)]


@pytest.mark.parametrize(
    ("record", "pattern"),
    [
        ({"prompt": "a"}, r"has 'prompt' but no 'completion' \(a prompt/completion record"),
        ({"completion": "a"}, r"has 'completion' but no 'prompt'"),
        ({"prompt": 3, "completion": "a"}, r"'prompt' must be a str, got int$"),
        ({"prompt": "a", "completion": None}, r"'completion' must be a str, got NoneType$"),
        (
            {"prompt": [{"role": "user", "content": "a"}], "completion": "b"},
            r"'prompt' must be a str, got list \(a conversation goes in one 'messages' list",
        ),
    ],
)
@pytest.mark.parametrize(("suffix", "where"), [(".jsonl", "line 2"), (".pkl", "record 1")])
def test_malformed_prompt_completion_names_file_record_and_field(
    tmp_path, monkeypatch, record, pattern, suffix, where
):
    tok = _fake_tokenizer(monkeypatch, tmp_path)
    path = _write(tmp_path / f"bad{suffix}", [{"prompt": "a", "completion": "b"}, record])
    with pytest.raises(ValueError, match=rf"bad\{suffix}: {where}: {pattern}") as error:
        load_dataset(path, tokenizer=tok)
    assert "\n" not in str(error.value)


def test_empty_completions_are_skipped_and_counted(tmp_path, monkeypatch, capsys):
    """A completion that tokenizes to nothing leaves nothing to learn: the record is
    skipped and counted, in one log line with the empty texts; an empty prompt is fine."""
    tok = _fake_tokenizer(monkeypatch, tmp_path, _FakeTokenizer)
    records = [
        {"prompt": "ab", "completion": ""},
        {"text": ""},
        {"prompt": "", "completion": "c"},
        {"prompt": "d", "completion": ""},
        {"input_ids": [5]},
    ]
    path = _write(tmp_path / "qa.jsonl", records)
    dataset = load_dataset(path, tokenizer=tok)
    assert dataset.tokens.tolist() == [99, 5] and list(dataset.lines) == [3, 5]
    assert dataset.targets.tolist() == [99, 5]
    assert capsys.readouterr().out == (
        f"{path}: skipped 1 record whose 'text' tokenizes to nothing (empty text) and 2 "
        "records whose 'completion' tokenizes to nothing (no token to learn)\n"
    )
    cache, _ = data_cache.ensure_cache(path, tmp_path / "c", tokenizer=tok, eos_id=None)
    assert np.asarray(cache.tokens).tolist() == [99, 5]  # the token cache reads alike
    assert "and 2 records whose 'completion'" in capsys.readouterr().out
    only = _write(tmp_path / "e.jsonl", [{"prompt": "a", "completion": ""}])
    with pytest.raises(ValueError, match="e.jsonl: the dataset has no examples"):
        load_dataset(only, tokenizer=tok)
    assert "skipped 1 record whose 'completion' tokenizes" in capsys.readouterr().out


def test_prompt_completion_without_tokenizer_names_the_fields(tmp_path):
    path = _write(tmp_path / "qa.jsonl", [{"input_ids": [5]}, {"prompt": "a", "completion": "b"}])
    with pytest.raises(
        ValueError, match=r"qa\.jsonl: line 2: has 'prompt' and 'completion' but no tokenizer"
    ):
        load_dataset(path)


def test_table_columns_prompt_and_completion(tmp_path):
    """A table is read from its `prompt` and `completion` columns where it has neither
    `input_ids` nor `text` (those come first, as in records); one of the two is refused."""
    columns = readers._columns
    assert columns(tmp_path, ["id", "prompt", "completion"]) == ["prompt", "completion"]
    assert columns(tmp_path, ["prompt", "completion", "text"]) == ["text"]
    assert columns(tmp_path, ["completion", "prompt", "input_ids"]) == ["input_ids"]
    with pytest.raises(
        ValueError,
        match=r"expected a column 'input_ids', 'text' or 'messages', or columns 'prompt' and "
        r"'completion', got \['prompt', 'answer'\]",
    ):
        columns(tmp_path, ["prompt", "answer"])


def test_parquet_prompt_completion(tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    tok = _fake_tokenizer(monkeypatch, tmp_path)
    table = pa.table({"prompt": ["ab", "", "c"], "completion": ["d", "e", ""], "id": [0, 1, 2]})
    pq.write_table(table, tmp_path / "qa.parquet", row_group_size=2)
    dataset = load_dataset(tmp_path / "qa.parquet", tokenizer=tok)
    assert dataset.tokens.tolist() == [1, 97, 98, 100, 1, 101]
    assert dataset.targets.tolist() == [IGNORE, IGNORE, IGNORE, 100, IGNORE, 101]
    nulls = pa.table({"prompt": ["a", "b"], "completion": ["c", None]})
    pq.write_table(nulls, tmp_path / "null.parquet")
    with pytest.raises(ValueError, match=r"null\.parquet: record 1: 'completion' must be a str"):
        load_dataset(tmp_path / "null.parquet", tokenizer=tok)
    pq.write_table(pa.table({"prompt": ["a"]}), tmp_path / "half.parquet")
    with pytest.raises(ValueError, match=r"half\.parquet: expected a column 'input_ids', "):
        load_dataset(tmp_path / "half.parquet", tokenizer=tok)


# --- malformed data --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("records", "pattern"),
    [
        ([[1, 2], {"input_ids": "abc"}], r"record 1: 'input_ids' must be a list of ints, got str"),
        ([[1, 2], "abc"], r"record 1: expected a record \(an object with 'input_ids', .* got str"),
        ([[1, 2], [3, -4]], r"record 1: 'input_ids': id -4 at position 1 is negative"),
        ([[1.5, 2.0]], r"record 0: 'input_ids' must be a list of ints, got elements of float"),
        ([[1], [True]], r"record 1: 'input_ids' must be a list of ints, got elements of bool"),
        ([[1], [[1], [2, 3]]], r"record 1: 'input_ids' must be a list of ints"),
        ([[1], [[]]], r"record 1: 'input_ids' must be a non-empty 1-D list"),
        (
            [{"tokens": [1]}],
            r"record 0: expected key 'input_ids', 'text' or 'messages', or keys 'prompt' and "
            r"'completion', got \['tokens'\]",
        ),
        ([{"input_ids": [1, 2], "labels": [1]}], r"record 0: 'labels' has 1 entries"),
        ([{"input_ids": [1], "labels": [-5]}], r"record 0: 'labels': id -5 .* is negative"),
        ([[1], 7], r"record 1: expected a record \(an object .* or a list of token ids, got int"),
        ([[1], [2**40]], r"record 1: 'input_ids': id 1099511627776 at position 0 exceeds int32"),
    ],
)
def test_malformed_pkl_names_file_and_record(tmp_path, records, pattern):
    path = _dump_pkl(tmp_path / "bad.pkl", records)
    with pytest.raises(ValueError, match=r"bad\.pkl: " + pattern):
        load_dataset(path)


def test_empty_token_id_records_are_skipped_and_counted(tmp_path, capsys):
    """Pre-tokenized corpora hold empty documents: a record with no ids is skipped and
    counted in one line, as a text that tokenizes to nothing is, not refused."""
    records = ['{"input_ids": [5, 6]}', '{"input_ids": []}', "[]", '{"input_ids": [7]}']
    dataset = load_dataset(_dump_jsonl(tmp_path / "ids.jsonl", records))
    assert dataset.tokens.tolist() == [5, 6, 7] and dataset.num_examples == 2
    assert "skipped 2 records whose 'input_ids' is empty" in capsys.readouterr().out


def test_malformed_jsonl_names_file_and_line(tmp_path):
    bad_json = _dump_jsonl(tmp_path / "a.jsonl", ['{"input_ids": [1]}', '{"input_ids": [2,'])
    with pytest.raises(ValueError, match=r"a\.jsonl: line 2: invalid JSON") as error:
        load_dataset(bad_json)
    # The file's line, not json's own count of the lines in it (its line break made 2).
    assert str(error.value).endswith("invalid JSON: Expecting value at column 18"), error.value
    cut = _dump_jsonl(tmp_path / "s.jsonl", ['{"text": "hi'])
    with pytest.raises(ValueError) as error:
        load_dataset(cut)
    assert str(error.value).endswith(
        "line 1: invalid JSON: Unterminated string starting at column 10"
    ), error.value
    wrong_type = _dump_jsonl(tmp_path / "b.jsonl", ['{"input_ids": [1]}', "", '{"input_ids": 3}'])
    with pytest.raises(ValueError, match=r"b\.jsonl: line 3: 'input_ids' must be a list"):
        load_dataset(wrong_type)
    text_type = _dump_jsonl(tmp_path / "c.jsonl", ['{"text": 3}'])
    with pytest.raises(ValueError, match=r"c\.jsonl: line 1: 'text' must be a str"):
        load_dataset(text_type, tokenizer=tmp_path)


def test_jsonl_errors_name_one_based_lines_counting_blank_ones(tmp_path):
    """Line numbers as an editor shows them: the out-of-range id is on line 4."""
    path = _dump_jsonl(
        tmp_path / "v.jsonl", ['{"input_ids": [1]}', "", "  ", '{"input_ids": [99]}']
    )
    with pytest.raises(ValueError, match=r"v\.jsonl: line 4: token id 99 .*vocab_size=10"):
        load_dataset(path, vocab_size=10)
    first = _dump_jsonl(tmp_path / "f.jsonl", ["", '{"input_ids": [1, -3]}'])
    with pytest.raises(ValueError, match=r"f\.jsonl: line 2: 'input_ids': id -3"):
        load_dataset(first)


def test_malformed_npy(tmp_path):
    np.save(tmp_path / "f.npy", np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"f\.npy: expected an integer array"):
        load_dataset(tmp_path / "f.npy")
    np.save(tmp_path / "n.npy", np.array([[1, 2], [3, -1]]))
    with pytest.raises(ValueError, match=r"n\.npy: record 1: negative token id -1"):
        load_dataset(tmp_path / "n.npy")


def test_out_of_vocab_names_file_record_and_value(tmp_path):
    path = _dump_pkl(tmp_path / "v.pkl", [[1, 2], [3, 4], [5, 99]])
    with pytest.raises(ValueError, match=r"v\.pkl: record 2: token id 99 .*vocab_size=10"):
        load_dataset(path, vocab_size=10)
    labels = _dump_pkl(tmp_path / "l.pkl", [{"input_ids": [1, 2], "labels": [IGNORE, 12]}])
    with pytest.raises(ValueError, match=r"l\.pkl: record 0: label 12 .*vocab_size=10"):
        load_dataset(labels, vocab_size=10)
    assert load_dataset(labels, vocab_size=13).num_tokens == 2


def test_empty_and_unknown(tmp_path):
    with pytest.raises(ValueError, match=r"e\.pkl: the dataset has no examples"):
        load_dataset(_dump_pkl(tmp_path / "e.pkl", []))
    with pytest.raises(ValueError, match=r"e\.jsonl: the dataset has no examples"):
        load_dataset(_dump_jsonl(tmp_path / "e.jsonl", [""]))
    np.save(tmp_path / "e.npy", np.zeros((0, 4), np.int32))
    with pytest.raises(ValueError, match=r"e\.npy: the dataset has no tokens"):
        load_dataset(tmp_path / "e.npy")
    with pytest.raises(ValueError, match=r"p\.pkl: expected a pickled list"):
        load_dataset(_dump_pkl(tmp_path / "p.pkl", {"input_ids": [1]}))
    (tmp_path / "x.csv").write_text("1,2\n")
    with pytest.raises(ValueError, match=r"unknown data format '\.csv'"):
        load_dataset(tmp_path / "x.csv")


class _RunsCode:
    """An object whose unpickling calls a function it names (any code, as a data file
    from elsewhere could)."""

    def __reduce__(self):
        return (Path.touch, (Path(self.mark),))


def test_a_pickle_that_names_code_is_refused_and_runs_nothing(tmp_path):
    """Unpickling calls what a pickle names: a `.pkl` of examples is read where it holds
    lists, dicts, text, numbers and numpy arrays (every protocol, numpy's forms), and one
    naming anything else is refused in one line before it runs."""
    examples = [
        [1, 2, 3],
        np.arange(3, 7, dtype=np.int32),
        {"input_ids": np.arange(2, 5), "labels": [-100, 3, 4]},
        {"input_ids": (5, 6, np.int64(7))},
        collections.defaultdict(list, {"input_ids": [8, 9]}),
    ]
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        path = tmp_path / f"ok{protocol}.pkl"
        path.write_bytes(pickle.dumps(examples, protocol=protocol))
        dataset = load_dataset(path)
        assert [dataset.example(i).tolist() for i in range(dataset.num_examples)] == [
            [1, 2, 3], [3, 4, 5, 6], [2, 3, 4], [5, 6, 7], [8, 9]
        ]  # fmt: skip
    code = _RunsCode()
    code.mark = str(tmp_path / "ran")
    (tmp_path / "code.pkl").write_bytes(pickle.dumps([[1, 2], code]))
    with pytest.raises(ValueError) as error:
        load_dataset(tmp_path / "code.pkl")
    assert str(error.value).startswith(
        f"{tmp_path / 'code.pkl'}: it names pathlib.Path.touch, which examples have no need of"
    )
    assert not (tmp_path / "ran").exists()


def test_missing_and_unreadable_files_name_the_file(tmp_path):
    with pytest.raises(ValueError, match=r"nope\.pkl: no such data file"):
        load_dataset(tmp_path / "nope.pkl")
    for missing in ("samples", "no/such/path"):  # no extension: missing, not of format ''
        with pytest.raises(ValueError, match=rf"{missing}: no such data file"):
            load_dataset(tmp_path / missing)
    (tmp_path / "g.pkl").write_bytes(b"garbage\n")
    (tmp_path / "t.pkl").write_bytes(pickle.dumps([[1, 2, 3]] * 50)[:40])
    for name in ("g.pkl", "t.pkl"):
        with pytest.raises(ValueError, match=rf"{name[0]}\.pkl: not a readable pickle"):
            load_dataset(tmp_path / name)
    (tmp_path / "g.npy").write_bytes(b"garbage")
    (tmp_path / "bad.npy").write_text("1 2 3\n")
    for name in ("g.npy", "bad.npy"):  # not numpy's advice to unpickle it
        with pytest.raises(ValueError) as error:
            load_dataset(tmp_path / name)
        assert str(error.value).endswith(f"{name}: not a valid .npy array file (no .npy header)")
    (tmp_path / "b.jsonl").write_bytes(b'{"input_ids": [1]}\n\xff\xfe\n')
    with pytest.raises(ValueError, match=r"b\.jsonl: line 2: not UTF-8 text"):
        load_dataset(tmp_path / "b.jsonl")


def test_a_byte_order_mark_opening_a_jsonl_file_is_not_json(tmp_path):
    """Windows editors save UTF-8 with a byte order mark; a later line's is refused."""
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"input_ids": [1, 2]}\n{"input_ids": [3]}\n')
    bom = load_dataset(path)
    assert bom.tokens.tolist() == [1, 2, 3] and bom.offsets.tolist() == [0, 2, 3]
    path.write_bytes(b'{"input_ids": [1, 2]}\n\xef\xbb\xbf{"input_ids": [3]}\n')
    with pytest.raises(ValueError, match=r"bom\.jsonl: line 2: invalid JSON"):
        load_dataset(path)


# --- rows ------------------------------------------------------------------------------


def test_rows_labels_are_the_next_token():
    dataset = _dataset(range(10, 20))  # one example of 10 tokens
    rows = dataset.rows(4)
    assert rows.input_ids.tolist() == [[10, 11, 12, 13], [14, 15, 16, 17]]  # 18, 19 dropped
    assert rows.labels.tolist() == [[11, 12, 13, 14], [15, 16, 17, 18]]
    assert rows.input_ids.dtype == rows.labels.dtype == np.int32
    assert _dataset(range(8)).rows(4).labels[-1, -1] == IGNORE  # nothing after the stream


def test_evaluation_rows_fill_the_tail_up_instead_of_dropping_it():
    """`pad_last`: the tokens past the last whole row make one more row, filled with
    ignored tokens in the last document's segment (after every real token: causal
    attention never reads them); the last real token has nothing after it to predict."""
    rows = _dataset([1, 2, 3], range(10, 17)).rows(4, pad_last=True)  # 10 tokens
    assert rows.input_ids.tolist() == [[1, 2, 3, 10], [11, 12, 13, 14], [15, 16, 0, 0]]
    assert rows.labels.tolist() == [
        [2, 3, IGNORE, 11],
        [12, 13, 14, 15],
        [16, IGNORE, IGNORE, IGNORE],
    ]
    assert rows.segment_ids.tolist() == [[0, 0, 0, 1], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert _dataset([1, 2, 3]).rows(4, pad_last=True).num_rows == 1  # less than a row
    assert _dataset(range(8)).rows(4, pad_last=True).num_rows == 2  # nothing to fill


def test_rows_mask_document_boundaries_and_segments():
    dataset = _dataset([1, 2, 3], [4, 5], [6, 7, 8])
    masked = dataset.rows(4)
    assert masked.input_ids.tolist() == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert masked.labels.tolist() == [[2, 3, IGNORE, 5], [IGNORE, 7, 8, IGNORE]]
    assert masked.segment_ids.tolist() == [[0, 0, 0, 1], [0, 1, 1, 1]]
    crossing = dataset.rows(4, mask_boundaries=False)
    assert crossing.labels.tolist() == [[2, 3, 4, 5], [6, 7, 8, IGNORE]]


def test_rows_with_eos_and_example_labels():
    dataset = TokenDataset.from_examples(
        "mem", [np.array([1, 2]), np.array([3, 4])], [np.array([IGNORE, 2]), None]
    )
    rows = dataset.rows(3, eos_id=0)  # stream 1 2 0 | 3 4 0
    assert rows.input_ids.tolist() == [[1, 2, 0], [3, 4, 0]]
    assert rows.labels.tolist() == [[2, 0, IGNORE], [4, 0, IGNORE]]
    assert dataset.rows(3, eos_id=0, mask_boundaries=False).labels.tolist() == [
        [2, 0, 3],
        [4, 0, IGNORE],
    ]


def test_rows_aligned_with_examples_of_seq_len():
    examples = markov_samples(5, 16, vocab_size=100, seed=1)
    rows = _dataset(*examples).rows(16)
    np.testing.assert_array_equal(rows.input_ids, examples)
    np.testing.assert_array_equal(rows.labels[:, :-1], examples[:, 1:])
    assert (rows.labels[:, -1] == IGNORE).all()


def test_rows_too_short():
    with pytest.raises(ValueError, match=r"mem: 3 tokens do not fill one row of seq_len=4"):
        _dataset([1, 2, 3]).rows(4)


# --- batches ---------------------------------------------------------------------------


def _collect(batches: Batches, n: int) -> list[np.ndarray]:
    return [next(batches).input_ids for _ in range(n)]


def test_shuffle_is_deterministic_and_differs_per_epoch():
    rows = _rows(20)
    first = _collect(Batches(rows, 4, seed=7), 10)
    again = _collect(Batches(rows, 4, seed=7), 10)
    other_seed = _collect(Batches(rows, 4, seed=8), 5)
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a, b)
    epoch0, epoch1 = np.concatenate(first[:5]), np.concatenate(first[5:])
    assert not np.array_equal(epoch0, epoch1)
    assert not np.array_equal(epoch0, np.concatenate(other_seed))
    # each epoch is a permutation of all rows (20 rows, 5 full batches)
    for epoch in (epoch0, epoch1):
        np.testing.assert_array_equal(np.sort(epoch[:, 0]), rows.input_ids[:, 0])


def test_the_last_batch_is_filled_not_dropped_and_num_epochs():
    """Every row once per epoch, as HF's dataloader without drop_last: the last batch is
    filled up with rows of nothing to learn (labels -100), also a process's share of it."""
    rows = _rows(11)
    batches = Batches(rows, 4, num_epochs=2, shuffle=False)
    assert batches.steps_per_epoch == 3
    got = list(batches)
    assert [b.input_ids[:, 0].tolist() for b in got] == [
        [0, 4, 8, 12], [16, 20, 24, 28], [32, 36, 40, 0]
    ] * 2  # fmt: skip
    assert (got[2].labels[3] == IGNORE).all() and (got[2].labels[:3] != IGNORE).any()
    assert got[2].segment_ids[3].tolist() == [0] * rows.seq_len
    assert batches.state() == {"epoch": 2, "index": 0}
    last = Batches(rows, 4, shuffle=False, process_index=1, process_count=2).batch_at(2)
    assert last.input_ids[:, 0].tolist() == [40, 0] and (last.labels[1] == IGNORE).all()
    dropped = Batches(rows, 4, num_epochs=2, shuffle=False, drop_last=True)  # HF's flag
    assert dropped.steps_per_epoch == 2
    assert [b.input_ids[:, 0].tolist() for b in dropped] == [[0, 4, 8, 12], [16, 20, 24, 28]] * 2
    # With gradient accumulation HF drops the partial micro-batch only: micro-batches
    # of 2 rows, 4 a step, drop row 10 alone, and the last step's one micro-batch is
    # filled up (it used to drop all of rows 8-10, a whole step's share).
    micro = Batches(rows, 4, num_epochs=1, shuffle=False, drop_last=True, micro_batch_size=2)
    assert micro.steps_per_epoch == 3 and micro.rows_per_epoch == 10
    got = list(micro)
    assert got[2].input_ids[:, 0].tolist() == [32, 36, 0, 0]
    assert (got[2].labels[2:] == IGNORE).all() and (got[2].labels[:2] != IGNORE).any()
    resumed = micro.starting_at({"epoch": 0, "index": 2})
    np.testing.assert_array_equal(next(resumed).input_ids, got[2].input_ids)
    with pytest.raises(ValueError, match="micro_batch_size=3 must divide global_batch_size=4"):
        Batches(rows, 4, micro_batch_size=3)


@pytest.mark.parametrize("k", [0, 3, 5, 7, 12])
def test_resume_sees_the_uninterrupted_batches(k):
    rows = _rows(23)
    uninterrupted = Batches(rows, 5, seed=3)  # 5 steps per epoch, the last filled up
    reference = [next(uninterrupted) for _ in range(k + 6)]
    interrupted = Batches(rows, 5, seed=3)
    _collect(interrupted, k)
    state = interrupted.state()
    assert state == {"epoch": k // 5, "index": k % 5}
    for resumed in (Batches(rows, 5, seed=3, start=state), Batches(rows, 5, seed=3, start_step=k)):
        assert resumed.step == k
        for expected in reference[k:]:
            got = next(resumed)
            for a, b in zip(got, expected, strict=True):
                np.testing.assert_array_equal(a, b)


def test_process_slices_cover_each_global_batch_once():
    rows = _rows(40)
    count = 4
    whole = Batches(rows, 8, seed=1)
    parts = [Batches(rows, 8, seed=1, process_index=p, process_count=count) for p in range(count)]
    for _ in range(12):  # crosses epochs (5 steps each)
        global_batch = next(whole)
        local = [next(part) for part in parts]
        assert all(b.input_ids.shape == (2, 4) for b in local)
        for field in range(3):
            np.testing.assert_array_equal(
                np.concatenate([b[field] for b in local]), global_batch[field]
            )


def test_batches_validation():
    rows = _rows(10)
    with pytest.raises(ValueError, match=r"global_batch_size=12 exceeds the 10 rows"):
        Batches(rows, 12)
    with pytest.raises(
        ValueError, match=r"global_batch_size=6 must be divisible by process_count=4"
    ):
        Batches(rows, 6, process_count=4)
    with pytest.raises(ValueError, match=r"process_index=2 must be in"):
        Batches(rows, 4, process_index=2, process_count=2)
    with pytest.raises(ValueError, match=r"does not fit 3 steps per epoch"):
        Batches(rows, 4, start={"epoch": 0, "index": 3})
    with pytest.raises(ValueError, match=r"keys 'epoch' and 'index'"):
        Batches(rows, 4, start={"step": 1})


# --- sample data and CLI ---------------------------------------------------------------


def test_markov_samples_are_a_sparse_chain():
    samples = markov_samples(64, 128, vocab_size=32000, seed=0, num_states=50, branching=3)
    assert samples.shape == (64, 128) and samples.dtype == np.int32
    assert len(np.unique(samples)) <= 50 and samples.max() < 32000
    successors: dict[int, set[int]] = {}
    for a, b in zip(samples[:, :-1].ravel(), samples[:, 1:].ravel(), strict=True):
        successors.setdefault(int(a), set()).add(int(b))
    assert max(len(s) for s in successors.values()) <= 3
    np.testing.assert_array_equal(
        samples, markov_samples(64, 128, 32000, 0, num_states=50, branching=3)
    )


def _cli(*args: str, returncode: int = 0) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", "train.data", *args],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == returncode, result
    return result


@pytest.mark.slow
def test_cli_sample_and_inspect(tmp_path):
    for suffix in (".pkl", ".jsonl", ".npy"):
        out = tmp_path / f"data{suffix}"
        sizes = ["--num-samples", "8", "--seq-len", "64", "--vocab-size", "1000", "--seed", "2"]
        _cli("sample", "--out", str(out), *sizes)
        np.testing.assert_array_equal(
            load_dataset(out).tokens, markov_samples(8, 64, 1000, 2).ravel()
        )
    stream = tmp_path / "stream.npy"
    _cli("sample", "--out", str(stream), *sizes, "--stream")
    dataset = load_dataset(stream)
    assert dataset.num_examples == 1
    np.testing.assert_array_equal(dataset.tokens, markov_samples(8, 64, 1000, 2).ravel())
    assert not dataset.rows(64, eos_id=0).packed
    printed = _cli("inspect", str(tmp_path / "data.jsonl"), "--vocab-size", "1000").stdout
    lines = dict(line.split(": ") for line in printed.strip().splitlines())
    assert lines["examples"] == "8" and lines["tokens"] == "512"
    assert lines["min_length"] == lines["max_length"] == "64"
    assert int(lines["max_id"]) < 1000


def test_cli_sample_and_tokenizer_replace_nothing_unasked(tmp_path, capsys, monkeypatch):
    """`sample` refuses an --out file that exists and `tokenizer` an --out holding a
    tokenizer (a model directory's), unless --overwrite; a sample write that fails
    leaves the file that was there (written beside it, then renamed)."""
    from train import data as data_lib

    def refused(*argv) -> str:
        with pytest.raises(SystemExit) as info:
            data_lib.main(list(argv))
        assert info.value.code == 2
        return capsys.readouterr().err

    out = tmp_path / "d.jsonl"
    out.write_text('{"input_ids": [1, 2]}\n')
    sizes = ["--num-samples", "4", "--seq-len", "8", "--vocab-size", "100", "--num-states", "16"]
    err = refused("sample", "--out", str(out), *sizes)
    refusal = "exists: pass --overwrite to replace it (nothing was written)"
    assert err == f"error: --out={str(out)!r} {refusal}\n"
    assert out.read_text() == '{"input_ids": [1, 2]}\n'

    def full_disk(path, examples):
        Path(path).write_text("part")
        raise OSError(28, "No space left on device")

    monkeypatch.setitem(data_lib.WRITERS, ".jsonl", full_disk)
    err = refused("sample", "--out", str(out), *sizes, "--overwrite")
    assert "cannot be written (No space left on device)" in err
    assert out.read_text() == '{"input_ids": [1, 2]}\n' and sorted(tmp_path.iterdir()) == [out]
    monkeypatch.undo()
    data_lib.main(["sample", "--out", str(out), *sizes, "--overwrite"])
    assert load_dataset(out).num_examples == 4

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog " * 20)
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text("{}")
    (model / "chat_template.jinja").write_text("{{ messages }}")
    err = refused("tokenizer", str(corpus), "--out", str(model), "--vocab-size", "300")
    assert f"--out={str(model)!r} holds a tokenizer (tokenizer.json, chat_template.jinja)" in err
    assert (model / "tokenizer.json").read_text() == "{}"
    data_lib.main(
        ["tokenizer", str(corpus), "--out", str(model), "--vocab-size", "300", "--overwrite"]
    )
    assert (model / "tokenizer.json").read_text() != "{}"
    assert not (model / "chat_template.jinja").exists()  # the earlier tokenizer's


def test_document_lengths_are_long_tailed():
    lengths = document_lengths(4000, 2400, seed=0)
    assert lengths.min() >= 1 and lengths.max() <= 16 * 2400
    assert abs(lengths.mean() / 2400 - 1) < 0.05  # mean as asked
    assert np.median(lengths) < 0.7 * 2400 < 2 * 2400 < np.quantile(lengths, 0.9)  # sigma 1
    np.testing.assert_array_equal(lengths, document_lengths(4000, 2400, seed=0))
    assert not np.array_equal(lengths, document_lengths(4000, 2400, seed=1))


def test_cli_sample_lognormal_documents(tmp_path):
    """`--lengths lognormal`: examples of log-normal lengths cut from the chain's samples,
    as documents or as one stream; `.npy` (one length) refused before any work."""
    sizes = ["--num-samples", "40", "--seq-len", "50", "--vocab-size", "1000", "--seed", "3"]
    out = tmp_path / "docs.jsonl"
    _cli("sample", "--out", str(out), *sizes, "--lengths", "lognormal")
    lengths = document_lengths(40, 50, seed=3)
    samples = markov_samples(40, int(lengths.max()), 1000, 3)
    want = np.concatenate([e[:n] for e, n in zip(samples, lengths, strict=True)])
    dataset = load_dataset(out)
    assert dataset.num_examples == 40 and len(set(lengths.tolist())) > 10
    np.testing.assert_array_equal(dataset.tokens, want)
    stream = tmp_path / "stream.pkl"
    _cli("sample", "--out", str(stream), *sizes, "--lengths", "lognormal", "--stream")
    streamed = load_dataset(stream)
    assert streamed.num_examples == 1
    np.testing.assert_array_equal(streamed.tokens, want)
    npy = tmp_path / "d.npy"
    result = _cli("sample", "--out", str(npy), "--lengths", "lognormal", returncode=2)
    assert "d.npy" in result.stderr and not npy.exists()


def test_cli_errors_are_one_line(tmp_path):
    """Bad arguments: `error: ...` and exit 2, no traceback; the extension is checked
    before any sample is generated."""
    for args in (
        ["sample", "--out", str(tmp_path / "d.csv"), "--num-samples", "10000000"],
        ["inspect", str(tmp_path / "missing.npy")],
    ):
        result = _cli(*args, returncode=2)
        assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr
    (tmp_path / "f").write_text("")
    out = str(tmp_path / "f" / "d.pkl")  # under a file
    result = _cli("sample", "--out", out, "--num-samples", "4", "--seq-len", "8", returncode=2)
    assert result.stderr == f"error: --out={out!r} cannot be written (Not a directory)\n"
    for flag in ("--num-samples", "--seq-len"):
        result = _cli("sample", "--out", str(tmp_path / "d.pkl"), flag, "0", returncode=2)
        assert result.stderr == f"error: {flag}=0 must be positive\n"
    result = _cli("sample", "--out", str(tmp_path / "d.pkl"), "--vocab-size", "0", returncode=2)
    assert result.stderr == "error: need 1 <= --branching=4 <= --num-states=256 <= --vocab-size=0\n"


# --- several files, compressed files ---------------------------------------------------


def _shards(root: Path) -> Path:
    """A folder of data files: plain, compressed four ways, nested, beside files and
    folders that are not data (a README, a hidden folder, a token cache)."""
    import bz2
    import gzip
    import lzma

    zstandard = pytest.importorskip("zstandard")
    (root / "sub").mkdir(parents=True)
    (root / ".hidden").mkdir()
    _dump_jsonl(root / "a.jsonl", ['{"input_ids": [1, 2, 3]}', "", '{"input_ids": [4, 5]}'])
    with gzip.open(root / "b.jsonl.gz", "wt") as f:
        f.write('{"input_ids": [6, 7, 8, 9]}\n')
    with bz2.open(root / "sub" / "c.pkl.bz2", "wb") as f:
        pickle.dump([[10, 11], [12]], f)
    with lzma.open(root / "sub" / "d.jsonl.xz", "wt") as f:
        f.write("[13, 14]\n")
    with zstandard.open(root / "sub" / "e.jsonl.zst", "wt") as f:
        f.write("[15]\n[16, 17]\n")
    np.save(root / "sub" / "f.npy", np.array([[18, 19]], np.int64))
    (root / "README.md").write_text("not data")
    _dump_jsonl(root / ".hidden" / "x.jsonl", ["[99]"])
    (root / "._a.jsonl").write_text("macOS metadata")
    data_cache.build_cache(_dump_jsonl(root.parent / "other.jsonl", ["[98]"]), root / "cache")
    return root


def test_a_folder_of_data_files_is_read_file_by_file_in_sorted_order(tmp_path, capsys):
    """A folder's data files, at any depth and in any format (compressed `.jsonl` and
    `.pkl` too), are read one after another in sorted order; hidden files and folders,
    token caches and files of no format are left out; errors and `where` name the file."""
    root = _shards(tmp_path / "corpus")
    capsys.readouterr()
    dataset = load_dataset(root)
    assert dataset.tokens.tolist() == list(range(1, 20))
    assert np.diff(dataset.offsets).tolist() == [3, 2, 4, 2, 1, 2, 1, 2, 2]
    assert [dataset.where(i) for i in range(dataset.num_examples)] == [
        "a.jsonl, line 1",
        "a.jsonl, line 3",
        "b.jsonl.gz, line 1",
        "sub/c.pkl.bz2, record 0",
        "sub/c.pkl.bz2, record 1",
        "sub/d.jsonl.xz, line 1",
        "sub/e.jsonl.zst, line 1",
        "sub/e.jsonl.zst, line 2",
        "sub/f.npy, record 0",
    ]
    assert capsys.readouterr().out == (
        f"{root}: reading 6 data files: a.jsonl, b.jsonl.gz, sub/c.pkl.bz2, sub/d.jsonl.xz, "
        "sub/e.jsonl.zst, sub/f.npy; left out 1 other file (.md)\n"
    )
    # Through a token cache: the same stream, and the same names in its errors.
    cache = data_cache.build_cache(root, tmp_path / "c", eos_id=0)
    assert np.asarray(cache.tokens).tolist() == [
        t for i in range(9) for t in [*dataset.example(i).tolist(), 0]
    ]
    _dump_jsonl(root / "sub" / "g.jsonl", ["[1, 2]", "[1, 300]"])
    for load in (
        lambda: load_dataset(root, vocab_size=200),
        lambda: data_cache.build_cache(root, tmp_path / "c2", vocab_size=200),
    ):
        with pytest.raises(ValueError) as error:
            load()
        assert str(error.value) == (
            f"{root}: sub/g.jsonl, line 2: token id 300 is out of range for vocab_size=200"
        )
    _dump_jsonl(root / "sub" / "g.jsonl", ['{"input_ids": "x"}'])
    with pytest.raises(ValueError, match=rf"^{root}/sub/g\.jsonl: line 1: 'input_ids' must be"):
        load_dataset(root)


def test_a_glob_pattern_names_data_files(tmp_path, capsys):
    """A quoted glob pattern (`**` for any folders) reads the files it matches, in sorted
    order; one of no known format, or a pattern matching nothing, is refused in a line."""
    root = _shards(tmp_path / "corpus")
    dataset = load_dataset(f"{root}/**/*.jsonl*")
    assert dataset.tokens.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 14, 15, 16, 17]
    assert dataset.where(3) == "sub/d.jsonl.xz, line 1"
    assert readers.data_files(f"{root}/*.jsonl") == [root / "a.jsonl"]
    with pytest.raises(ValueError, match=r"README\.md: unknown data format '\.md'"):
        load_dataset(f"{root}/*")
    with pytest.raises(ValueError, match=r"nothing/\*\.jsonl: no data file matches the pattern"):
        load_dataset(tmp_path / "nothing" / "*.jsonl")
    # A file whose name holds a wildcard is that file, not a pattern.
    odd = _dump_jsonl(tmp_path / "odd[1].jsonl", ["[7]"])
    assert load_dataset(odd).tokens.tolist() == [7]


def test_a_folder_or_pattern_cache_notices_a_new_or_changed_file(tmp_path, capsys):
    """A cache of a folder or pattern records its files' count, total size and latest
    time: a file added, removed or rewritten makes it stale; its name under
    --data_cache_dir comes from the pattern's folder on."""
    root = tmp_path / "corpus"
    root.mkdir()
    _dump_jsonl(root / "a.jsonl", ["[1, 2]"])
    pattern = f"{root}/*.jsonl"
    for source in (root, pattern):
        where = data_cache.cache_location(source, tmp_path / "caches")
        _, built = data_cache.ensure_cache(source, where)
        assert built
        _, built = data_cache.ensure_cache(source, where)
        assert not built
    assert data_cache.cache_location(pattern, tmp_path / "caches").name.startswith("corpus_.jsonl-")
    _dump_jsonl(root / "b.jsonl", ["[3]"])
    for source in (root, pattern):
        cache, built = data_cache.ensure_cache(
            source, data_cache.cache_location(source, tmp_path / "caches")
        )
        assert built and np.asarray(cache.tokens).tolist() == [1, 2, 3]
        assert cache.meta["source"]["files"] == 2
    assert "changed since the cache was built" in capsys.readouterr().out


@pytest.mark.parametrize("compression", ["gz", "bz2", "xz", "zst"])
def test_compressed_files_are_read_and_damage_is_named(tmp_path, compression):
    """`.jsonl` and `.pkl` are read compressed; a truncated file is refused naming the
    line it stopped at; compressed `.npy` and `.parquet` are refused in a line."""
    import bz2
    import gzip
    import lzma

    zstandard = pytest.importorskip("zstandard") if compression == "zst" else None
    compress = {
        "gz": gzip.compress,
        "bz2": bz2.compress,
        "xz": lzma.compress,
        "zst": lambda b: zstandard.ZstdCompressor().compress(b),
    }[compression]
    lines = b"".join(b"[%d, %d]\n" % (i, i + 1) for i in range(2000))
    path = tmp_path / f"d.jsonl.{compression}"
    path.write_bytes(compress(lines))
    assert load_dataset(path).num_examples == 2000
    if compression == "zst":  # frames one after another (as pzstd writes them)
        path.write_bytes(compress(lines[:5000]) + compress(lines[5000:]))
        assert load_dataset(path).num_examples == 2000
    pkl = tmp_path / f"d.pkl.{compression}"
    pkl.write_bytes(compress(pickle.dumps([[1, 2], [3]])))
    assert load_dataset(pkl).tokens.tolist() == [1, 2, 3]
    path.write_bytes(compress(lines)[: -len(lines) // 50 or -8])
    with pytest.raises(ValueError) as error:
        load_dataset(path)
    assert str(error.value).startswith(f"{path}: line "), str(error.value)
    assert "a damaged or truncated compressed file?" in str(error.value)
    for name in (f"d.npy.{compression}", f"d.parquet.{compression}"):
        (tmp_path / name).write_bytes(b"x")
        with pytest.raises(ValueError, match=r"is not read \(only \.jsonl and \.pkl are read"):
            load_dataset(tmp_path / name)


def test_a_folder_is_read_as_its_user_means_it(tmp_path, capsys, monkeypatch):
    """Links read each real file once (a link back up is no loop); a folder holding a
    `meta.json` of its own is data (only a token cache's folder is left out); files of
    no format are counted in the line, `.json` ones with a hint; several splits by name
    get a warning; a folder that cannot be listed or a file that cannot be read is one
    line, as is an empty compressed file."""
    import gzip
    import os

    root = tmp_path / "d"
    for folder in ("en", "de", "validation"):
        (root / folder).mkdir(parents=True)
    _dump_jsonl(root / "en" / "train.jsonl", ["[1]"])
    _dump_jsonl(root / "de" / "train.jsonl", ["[2]"])
    (root / "de" / "meta.json").write_text('{"lang": "de"}')
    (root / "de" / "notes.json.gz").write_bytes(gzip.compress(b"{}"))
    os.symlink("..", root / "en" / "up")  # a loop
    os.symlink(root / "en" / "train.jsonl", root / "again.jsonl")
    _dump_jsonl(root / "validation" / "x.jsonl", ["[3]"])
    capsys.readouterr()
    dataset = load_dataset(root)
    assert dataset.tokens.tolist() == [1, 2, 3]  # en/train.jsonl is again.jsonl: read once
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        f"{root}: reading 3 data files: again.jsonl, de/train.jsonl, validation/x.jsonl; "
        "left out 2 other files (.json, .json.gz); one JSON record a line is read from "
        ".jsonl files"
    )
    assert out[1] == (
        f"warning: {root}: its files' names hold several splits (train, validation), all "
        f"read as one dataset; a pattern picks one (e.g. '{root}/**/*train*')"
    )
    assert [p.name for p in readers.data_files(f"{root}/**/*.jsonl")] == [
        "again.jsonl",
        "train.jsonl",
        "x.jsonl",
    ]  # fmt: skip (the pattern too: each real file once, the loop's copies left out)
    with pytest.raises(ValueError, match=r"notes\.json\.gz: a \.json file is not read: one JSON"):
        load_dataset(root / "de" / "notes.json.gz")

    (root / "z.jsonl.gz").write_bytes(b"")
    with pytest.raises(ValueError, match=r"z\.jsonl\.gz: an empty file, not \.gz data"):
        load_dataset(root)
    (root / "z.jsonl.gz").unlink()

    real_open = open

    def refusing(path, *args, **kwargs):
        if str(path).endswith("x.jsonl"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(readers, "open", refusing, raising=False)
    with pytest.raises(ValueError, match=r"x\.jsonl: cannot be read \(Permission denied\)$"):
        load_dataset(root)
    monkeypatch.undo()
    real_scandir = os.scandir

    def unlisted(path="."):
        if str(path).endswith("validation"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", unlisted)
    with pytest.raises(ValueError, match=r"validation: cannot be listed \(Permission denied\)$"):
        readers.data_files(root)


def test_a_pattern_leaves_out_a_token_cache_under_it(tmp_path, capsys):
    """`corpus/**/*.npy` with `--data_cache_dir corpus/cache`: the cache's index.npy is
    not data (it was read, and made the cache stale at every start); `~` is expanded; a
    pattern matching only folders says so."""
    root = tmp_path / "corpus"
    root.mkdir()
    np.save(root / "shard.npy", np.arange(1, 9).reshape(1, -1))
    pattern = f"{root}/**/*.npy"
    where = data_cache.cache_location(pattern, root / "cache")
    assert data_cache.ensure_cache(pattern, where)[1]
    assert readers.data_files(pattern) == [root / "shard.npy"]
    assert not data_cache.ensure_cache(pattern, where)[1]  # up to date
    home = tmp_path / "home"
    (home / "c").mkdir(parents=True)
    _dump_jsonl(home / "c" / "a.jsonl", ["[4]"])
    import os

    old = os.environ.get("HOME")
    os.environ["HOME"] = str(home)
    try:
        assert load_dataset("~/c/*.jsonl").tokens.tolist() == [4]
    finally:
        os.environ["HOME"] = old if old is not None else ""
    with pytest.raises(ValueError, match=r"no data file matches the pattern \(it matches 1 folder"):
        load_dataset(f"{home}/*")


def test_a_folder_cache_goes_stale_when_a_file_is_renamed(tmp_path, capsys):
    """The order of a folder's files is their names': a shard renamed (same size and
    time) changes the stream, so the cache is rebuilt."""
    root = tmp_path / "c"
    root.mkdir()
    _dump_jsonl(root / "a.jsonl", ["[1, 2]"])
    _dump_jsonl(root / "b.jsonl", ["[3, 4]"])
    cache, built = data_cache.ensure_cache(root, tmp_path / "cache")
    assert built and np.asarray(cache.tokens).tolist() == [1, 2, 3, 4]
    (root / "a.jsonl").rename(root / "z.jsonl")
    cache, built = data_cache.ensure_cache(root, tmp_path / "cache")
    assert built and np.asarray(cache.tokens).tolist() == [3, 4, 1, 2]
    assert "files were renamed, moved or reordered" in capsys.readouterr().out


def test_links_folders_and_rewrites_that_a_review_found(tmp_path, capsys):
    """`**` under two links back up ends (Python's glob walked each link at every level,
    without bound); a link to nothing among a folder's data files is one line; a cache
    of a folder whose files were all removed still trains (the data is gone, the cache
    is what is left); a file rewritten to its size with an older time makes a folder's
    cache stale; folders named by split get a pattern that picks a folder."""
    import os
    import threading

    root = tmp_path / "d"
    for folder in ("train", "test"):
        (root / folder).mkdir(parents=True)
        _dump_jsonl(root / folder / "x.jsonl", ["[1, 2]" if folder == "train" else "[3]"])
    os.symlink("..", root / "train" / "up")
    os.symlink("..", root / "test" / "up")
    found = []
    walk = threading.Thread(target=lambda: found.append(readers.data_files(f"{root}/**/*.jsonl")))
    walk.daemon = True
    walk.start()
    walk.join(timeout=60)
    assert not walk.is_alive(), "the pattern's walk did not end"
    assert [str(p.relative_to(root)) for p in found[0]] == ["test/x.jsonl", "train/x.jsonl"]
    capsys.readouterr()
    assert load_dataset(root).tokens.tolist() == [3, 1, 2]
    assert f"a pattern picks one (e.g. '{root}/**/*train*/**')" in capsys.readouterr().out
    assert readers.data_files(f"{root}/**/*train*/**") == [root / "train" / "x.jsonl"]

    # a rewrite to the same size, its time set back: the total and the latest time
    # are as they were
    cache, built = data_cache.ensure_cache(root, tmp_path / "cache")
    assert built
    before = (root / "train" / "x.jsonl").stat()  # the older of the two
    (root / "train" / "x.jsonl").write_text("[5, 6]\n")
    os.utime(root / "train" / "x.jsonl", ns=(before.st_atime_ns, before.st_mtime_ns - 10**9))
    assert data_cache.open_cache(tmp_path / "cache").mismatch() == [
        f"{root} changed since the cache was built (a file's size or mtime)"
    ]
    cache, built = data_cache.ensure_cache(root, tmp_path / "cache")
    assert built and np.asarray(cache.tokens).tolist() == [3, 5, 6]

    os.symlink(root / "gone.jsonl", root / "lost.jsonl")
    with pytest.raises(ValueError, match=rf"^{root}/lost\.jsonl: a link to nothing \("):
        load_dataset(root)
    with pytest.raises(ValueError, match=r"lost\.jsonl: a link to nothing"):
        data_cache.source_stamp(root)
    for file in (root / "lost.jsonl", root / "train" / "x.jsonl", root / "test" / "x.jsonl"):
        file.unlink()
    assert data_cache.open_cache(tmp_path / "cache").mismatch() == []


def test_patterns_match_as_glob_does_and_walk_only_what_can_match(tmp_path, monkeypatch):
    """A pattern's files are glob's, through links and `.`/`..` too (a folder reached
    by two paths is matched by either); `]` first in a set is in the set; a range out
    of order is one line; the walk enters only folders that can hold a match."""
    import glob
    import os

    from train import patterns

    root = tmp_path / "d"
    (root / "eval").mkdir(parents=True)
    (root / "sub").mkdir()
    for name in ("eval/x.jsonl", "f.jsonl", "]a.jsonl", "b.jsonl"):
        (root / name).write_text("[1]\n")
    os.symlink("eval", root / "eval-new")  # listed after eval/, whose files it holds
    os.symlink("..", root / "sub" / "up")
    monkeypatch.chdir(tmp_path)
    for pattern in (
        "d/eval-n*/*.jsonl",
        "d/*/up/*.jsonl",
        "d/*/../*.jsonl",
        "d/[]]*.jsonl",
        "d/[!]]*.jsonl",
        f"{root}/e*/*.jsonl",
    ):
        want = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
        got = [p for p in patterns.expand(pattern) if os.path.isfile(p)]
        assert got == want and want, (pattern, got, want)
    with pytest.raises(ValueError, match=r"^d/\[z-a\]\*: '\[z-a\]\*' is not a pattern of names"):
        patterns.expand("d/[z-a]*")
    # 40 folders beside the one the pattern names: none of them is listed.
    for k in range(40):
        (root / "many" / f"f{k:02d}").mkdir(parents=True)
    (root / "many" / "f07" / "deep").mkdir()
    (root / "many" / "f07" / "deep" / "s.jsonl").write_text("[2]\n")
    listed = []
    listdir = os.listdir
    monkeypatch.setattr(os, "listdir", lambda p=".": listed.append(str(p)) or listdir(p))
    assert patterns.expand("d/many/f0[7]/**/*.jsonl") == ["d/many/f07/deep/s.jsonl"]
    assert sorted(listed) == ["d/many", "d/many/f07", "d/many/f07/deep"]


def test_a_tokenizer_learns_from_a_folders_text_files_only(tmp_path, capsys):
    """`train.data tokenizer FOLDER` reads its text (and .jsonl) files, not the binary
    ones beside them (a token cache, .npy, .pkl, an image) nor a training run's output
    directory, and says what it left out."""
    pytest.importorskip("tokenizers")
    root = tmp_path / "docs"
    root.mkdir()
    (root / "a.md").write_text("hello world " * 50)
    _dump_jsonl(root / "b.jsonl", ['{"text": "more words here"}'])
    np.save(root / "ids.npy", np.arange(10))
    (root / "d.pkl").write_bytes(pickle.dumps([[1, 2]]))
    (root / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
    data_cache.build_cache(_dump_jsonl(tmp_path / "t.jsonl", ["[1, 2]"]), root / "cache")
    (root / "run").mkdir()  # an earlier training run's output directory: no text
    _dump_jsonl(root / "run" / "log.jsonl", ['{"step": 1, "loss": 5.0}'])
    (root / "run" / "train_config.yaml").write_text("run:\n  output_dir: run\n")
    kept, left = text_files_of(root)
    assert kept == [root / "a.md", root / "b.jsonl"]
    assert sorted(p.name for p in left) == sorted(
        [p.name for p in (root / "cache").iterdir() if not p.name.startswith(".")]
        + ["d.pkl", "ids.npy", "logo.png", "log.jsonl", "train_config.yaml"]
    )
    train_tokenizer([root], tmp_path / "tok", vocab_size=300)
    assert f"tokenizer: left out {len(left)} binary or data files: " in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"no text file in this folder or pattern \(2 binary"):
        train_tokenizer([f"{root}/*[yg]"], tmp_path / "tok2", vocab_size=300)
    # Named: a binary file, a token cache or a save_to_disk folder is refused.
    with pytest.raises(ValueError, match=r"ids\.npy: not a text file"):
        train_tokenizer([root / "ids.npy"], tmp_path / "tok2", vocab_size=300)
    with pytest.raises(ValueError, match=r"cache: a token cache, not a folder of text files"):
        train_tokenizer([root / "cache"], tmp_path / "tok2", vocab_size=300)
    with pytest.raises(ValueError, match=r"run: a training run's output directory, not a "):
        train_tokenizer([root / "run"], tmp_path / "tok2", vocab_size=300)
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "state.json").write_text("{}")
    with pytest.raises(ValueError, match=r"saved: a dataset saved with save_to_disk, not"):
        train_tokenizer([tmp_path / "saved"], tmp_path / "tok2", vocab_size=300)
    # Its own folder inside the corpus: an earlier tokenizer there is not learned from.
    train_tokenizer([root], root / "tok", vocab_size=300)
    assert not any("tok" in p.parts for p in text_files_of(root, root / "tok")[0])
    first = (root / "tok" / "tokenizer.json").read_text()
    train_tokenizer([root], root / "tok", vocab_size=300)
    assert (root / "tok" / "tokenizer.json").read_text() == first


def test_the_in_memory_path_holds_a_few_bytes_a_token(tmp_path):
    """Read into memory, unlabelled data is one int32 array (its targets are its
    tokens), gathered in chunks rather than an array per example, and its rows are cut
    with one copy of the stream: tracemalloc's peaks, in bytes a token, where an array
    per example, two copies of each stream and the segment ids' copies took 20 to load
    and 28 for the rows."""
    import tracemalloc

    tokens = np.random.default_rng(0).integers(1, 30000, (4000, 500), dtype=np.int32)
    np.save(tmp_path / "d.npy", tokens)
    n = tokens.size
    tracemalloc.start()
    try:
        dataset = load_dataset(tmp_path / "d.npy")
        held, peak = tracemalloc.get_traced_memory()
        assert dataset.targets is dataset.tokens
        assert held / n < 4.5 and peak / n < 9, (held / n, peak / n)
        tracemalloc.reset_peak()
        rows, _, _ = dataset.rows_and_padding(1024, eos_id=0)
        now, peak = tracemalloc.get_traced_memory()
        assert (now - held) / n < 12.5 and (peak - held) / n < 14, (
            (now - held) / n,
            (peak - held) / n,
        )
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(rows.input_ids[0, :501], [*tokens[0], 0])
    assert rows.segment_ids[0, 500] == 0 and rows.segment_ids[0, 501] == 1


def test_a_runs_output_directory_in_a_data_folder_is_left_out(tmp_path, capsys):
    """An earlier run's --output_dir under a data folder (its train_config.yaml beside
    its log.jsonl) is left out with all it holds, folder or pattern, and the reading
    line names it; a folder with only one of the two files is data; the run's directory
    itself given as the data is refused in one line."""
    root = tmp_path / "data"
    for folder in ("logs", "runs/r0/previous_run"):
        (root / folder).mkdir(parents=True)
    _dump_jsonl(root / "a.jsonl", ["[1, 2]"])
    run = root / "runs" / "r0"
    _dump_jsonl(run / "log.jsonl", ['{"step": 1, "loss": 5.0}'])
    (run / "train_config.yaml").write_text("run:\n  output_dir: runs/r0\n")
    _dump_jsonl(run / "previous_run" / "log.jsonl", ['{"step": 1, "loss": 6.0}'])
    _dump_jsonl(root / "logs" / "log.jsonl", ["[3]"])  # no settings file: data
    capsys.readouterr()
    assert load_dataset(root).tokens.tolist() == [1, 2, 3]
    said = capsys.readouterr().out.splitlines()[0]
    assert said == (
        f"{root}: reading 2 data files: a.jsonl, logs/log.jsonl; left out a training "
        f"run's output directory ({run})"
    )
    pattern = f"{root}/**/*.jsonl"
    assert [p.name for p in readers.data_files(pattern)] == ["a.jsonl", "log.jsonl"]
    assert load_dataset(pattern).tokens.tolist() == [1, 2, 3]
    assert (
        capsys.readouterr()
        .out.splitlines()[0]
        .endswith(f"; left out a training run's output directory ({run})")
    )
    with pytest.raises(ValueError) as refused:
        load_dataset(run)
    assert str(refused.value) == (
        f"{run}: a training run's output directory (its train_config.yaml and log.jsonl), "
        "not a folder of data files"
    )


def test_plain_text_as_data_says_how_to_give_it(tmp_path, capsys):
    """A .txt (or .text, compressed too) file as data is refused in one line that says
    how to write it as records; a folder of only such files likewise; beside data files
    they are counted as left out with the same hint."""
    notes = tmp_path / "notes.txt"
    notes.write_text("hello world\nsecond line\n")
    hint = 'write each document as a .jsonl record, one {"text": "..."} a line'
    for name in ("notes.txt", "notes.text", "notes.txt.gz"):
        (tmp_path / name).write_bytes(notes.read_bytes())
        with pytest.raises(ValueError) as refused:
            load_dataset(tmp_path / name)
        assert str(refused.value) == (
            f"{tmp_path / name}: plain text is not read as data (where would each document "
            f"end?); {hint}"
        )
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text("one")
    (folder / "b.txt").write_text("two")
    with pytest.raises(ValueError) as refused:
        load_dataset(folder)
    assert str(refused.value).endswith(f"; plain text (2 files here) is not read as data: {hint}")
    _dump_jsonl(folder / "c.jsonl", ["[1, 2]"])
    capsys.readouterr()
    assert load_dataset(folder).tokens.tolist() == [1, 2]
    assert capsys.readouterr().out.splitlines()[0] == (
        f"{folder}: reading 1 data file: c.jsonl; left out 2 other files (.txt); plain "
        """text is not read: a .jsonl file's {"text": ...} records are"""
    )


def test_a_long_read_into_memory_says_how_far_it_got(tmp_path, monkeypatch, capsys):
    """Reading a large corpus into memory takes minutes: a line every PROGRESS_SECONDS
    says how many examples and tokens so far, as a cache build's does."""
    from train import dataset as dataset_lib

    monkeypatch.setattr(dataset_lib, "PROGRESS_SECONDS", 0.0)
    path = _dump_jsonl(tmp_path / "ids.jsonl", ['{"input_ids": [5, 6]}', '{"input_ids": [7]}'])
    load_dataset(path)
    lines = [x for x in capsys.readouterr().out.splitlines() if "into memory" in x]
    assert lines[0].startswith(f"reading {path} into memory: 1 example, 2 tokens so far, ")
    assert lines[-1].startswith(f"reading {path} into memory: 2 examples, 3 tokens so far, ")


def test_a_tokenizer_is_not_learned_from_no_text(tmp_path, capsys):
    """Text files or records holding no text leave nothing to learn: `train.data
    tokenizer` says so in one line and, even with --overwrite, keeps the tokenizer
    that --out held (a bytes-only one would have replaced it)."""
    pytest.importorskip("tokenizers")
    from train import data as data_lib

    (tmp_path / "words.txt").write_text("hello world " * 50)
    out = tmp_path / "tok"
    data_lib.main(["tokenizer", str(tmp_path / "words.txt"), "--out", str(out)])
    kept = (out / "tokenizer.json").read_bytes()
    (tmp_path / "empty.txt").write_text("")
    _dump_jsonl(tmp_path / "blank.jsonl", ['{"text": ""}', '{"text": ""}'])
    for name in ("empty.txt", "blank.jsonl"):
        with pytest.raises(SystemExit) as info:
            data_lib.main(["tokenizer", str(tmp_path / name), "--out", str(out), "--overwrite"])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert err.endswith(
            f"{tmp_path / name}: no text to learn a tokenizer from (nothing was written)\n"
        )
        assert (out / "tokenizer.json").read_bytes() == kept
    with pytest.raises(SystemExit):
        data_lib.main(["tokenizer", str(tmp_path / "empty.txt"), "--out", str(tmp_path / "new")])
    assert not (tmp_path / "new").exists()


def test_add_bos_token_flags_that_the_post_processor_contradicts_are_refused(bos_bpe, tmp_path):
    """transformers builds a text's special tokens from tokenizer_config.json's
    add_bos_token / add_eos_token where it sets them (an unset one false), the
    tokenizers package from tokenizer.json's post-processor: where they differ the
    model would see other ids than AutoTokenizer gives, so reading is refused in one
    line; where they agree it reads as before."""
    folder = tmp_path / "tok"
    shutil.copytree(bos_bpe, folder)  # its post-processor adds the BOS only
    config = folder / "tokenizer_config.json"
    settings = json.loads(config.read_text())
    path = _write(tmp_path / "t.jsonl", [{"text": "hello"}])
    for flags in ({"add_bos_token": True}, {"add_bos_token": True, "add_eos_token": False}):
        config.write_text(json.dumps({**settings, **flags}))
        assert load_dataset(path, tokenizer=folder).tokens.tolist()[0] == 0
    refusals = [
        (
            {"add_bos_token": False},
            "add_bos_token is false but tokenizer.json's post-processor adds the BOS",
        ),
        ({"add_eos_token": True}, "add_bos_token is false but"),
        (
            {"add_bos_token": True, "add_eos_token": True},
            "add_eos_token is true but tokenizer.json's post-processor adds no EOS",
        ),
        ({"add_bos_token": "yes"}, 'add_bos_token "yes" must be true or false'),
    ]
    for flags, message in refusals:
        config.write_text(json.dumps({**settings, **flags}))
        with pytest.raises(ValueError) as error:
            load_dataset(path, tokenizer=folder)
        assert str(error.value).startswith(f"{config}: {message}"), error.value
        assert "\n" not in str(error.value)


def test_inspect_into_a_pipe_closed_early_ends_quietly(tmp_path):
    """`inspect --show N | head`: the reader leaving is no traceback; the exit status is
    a shell's for a command SIGPIPE ended."""
    # More than a pipe holds (64 KiB): the tool is still writing when the reader goes.
    path = _dump_jsonl(tmp_path / "d.jsonl", [json.dumps(list(range(1, 50)))] * 2000)
    proc = subprocess.Popen(
        [sys.executable, "-m", "train.data", "inspect", str(path), "--show", "2000"],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout.readline() == b"examples: 2000\n"
    proc.stdout.close()  # as `head -1` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == "", err


def test_inspect_show_escapes_control_characters(bos_bpe, tmp_path, capsys):
    """Text with NUL, escape or carriage-return characters is shown with them escaped,
    not written to the terminal (which an escape sequence would restyle)."""
    from train import data as data_lib

    path = _write(tmp_path / "t.jsonl", [{"text": "a\x00b\x1b[31mc\r\nd\te"}])
    data_lib.main(["inspect", str(path), "--tokenizer", str(bos_bpe), "--show", "1"])
    out = capsys.readouterr().out
    assert "a\\x00b\\x1b[31mc\\r\nd\te" in out
    assert not any(c in out for c in "\x00\x1b\r")
