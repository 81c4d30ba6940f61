"""Tests of conversational ("messages") records (train/chat.py, train/records.py): the
chat template's rendering, assistant-only labels, errors, the token cache, the
tokenizer command, transformers' parity and a trainer run."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import run_oracle

from train import chat, data_cache, readers
from train.data import main as data_main
from train.data import train_tokenizer
from train.dataset import load_dataset
from train.records import RecordParser, load_tokenizer

pytest.importorskip("jinja2")

REPO = Path(__file__).resolve().parents[1]
IGNORE = -100
BOS, HEADER, END_HEADER, EOT = (
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
)
# Meta-Llama-3-8B-Instruct's chat template (a BOS before the first message's header).
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
CONVERSATIONS = [
    [
        {"role": "system", "content": "You pack rows of text."},
        {"role": "user", "content": "How are documents packed?"},
        {"role": "assistant", "content": "Back to back, with an EOS after each."},
        {"role": "user", "content": " And labels? "},
        {"role": "assistant", "content": "They never cross an example boundary.\n"},
    ],
    [
        {"role": "user", "content": "Is a token cache memory-mapped? ✓"},
        {"role": "assistant", "content": "Yes: tokens.bin, labels.bin and index.npy — mapped."},
    ],
]


def _write_tokenizer(folder: Path, base: Path, template: str | None = LLAMA3_TEMPLATE) -> Path:
    """``folder`` with ``base``'s tokenizer.json and a tokenizer_config.json naming Llama-3's
    BOS and EOS (and ``template`` as its chat_template, where given)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_bytes((base / "tokenizer.json").read_bytes())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOT}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return folder


@pytest.fixture(scope="module")
def llama3_bpe(tmp_path_factory) -> Path:
    """A byte-level BPE with Llama-3's special tokens (BOS, headers, end of turn), whose
    post-processor adds the BOS before every text as Llama-3's does, and a
    tokenizer_config.json with Llama-3's chat template."""
    tokenizers = pytest.importorskip("tokenizers")
    folder = tmp_path_factory.mktemp("llama3_bpe")
    (folder / "corpus.txt").write_text((REPO / "docs" / "trainer.md").read_text())
    file = train_tokenizer([folder / "corpus.txt"], folder / "base", vocab_size=300)
    tokenizer = tokenizers.Tokenizer.from_file(str(file))
    tokenizer.add_special_tokens([BOS, HEADER, END_HEADER, EOT])
    bos = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = tokenizers.processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, bos)]
    )
    tokenizer.save(str(file))
    return _write_tokenizer(folder / "tok", folder / "base")


def _jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _pieces(messages: list[dict]) -> list[tuple[str, bool]]:
    """The Llama-3 rendering of ``messages``, written out by hand as ``(text, learned)``
    pieces: an assistant message's trimmed content and its end of turn are learned."""
    pieces = [(BOS, False)]
    for m in messages:
        pieces.append((f"{HEADER}{m['role']}{END_HEADER}\n\n", False))
        pieces.append((m["content"].strip() + EOT, m["role"] == "assistant"))
    return pieces


def test_messages_are_the_rendered_conversation_tokenized_whole(llama3_bpe, tmp_path):
    """The ids are the tokenizer's ids of the rendered text (no BOS added on top of the
    template's); the labels are the assistant turns' tokens (content and end of turn),
    -100 on the system and user turns and every header."""
    tokenizer = load_tokenizer(llama3_bpe)
    bos, eot = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOT)
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])
    dataset = load_dataset(path, tokenizer=llama3_bpe)
    assert dataset.num_examples == 2 and list(dataset.lines) == [1, 2]
    for i, messages in enumerate(CONVERSATIONS):
        pieces = _pieces(messages)
        text = "".join(piece for piece, _ in pieces)
        ids = dataset.tokens[dataset.offsets[i] : dataset.offsets[i + 1]].tolist()
        labels = dataset.targets[dataset.offsets[i] : dataset.offsets[i + 1]].tolist()
        assert ids == tokenizer.encode(text, add_special_tokens=False).ids
        assert ids.count(bos) == 1 and ids[0] == bos  # the template's BOS, not doubled
        want = []  # each piece tokenized alone: the same ids here (special tokens split)
        for piece, learned in pieces:
            piece_ids = tokenizer.encode(piece, add_special_tokens=False).ids
            want += piece_ids if learned else [IGNORE] * len(piece_ids)
        assert labels == want
        learned = [t for t, label in zip(ids, labels, strict=True) if label != IGNORE]
        turns = [m["content"].strip() + EOT for m in messages if m["role"] == "assistant"]
        assert tokenizer.decode(learned, skip_special_tokens=False) == "".join(turns)
        assert learned.count(eot) == len(turns)
        for m in messages:  # nothing of the system's or user's words is learned
            if m["role"] != "assistant":
                assert m["content"].strip() not in tokenizer.decode(learned)


def test_assistant_labels_learn_a_token_that_straddles_a_turn_boundary():
    """A token is learned where its character span overlaps an assistant turn, so one
    that straddles the turn's start or end is learned whole; one that only touches the
    turn (ends where it begins) is not."""
    spans = [(4, 8), (12, 14)]
    offsets = [(0, 2), (2, 4), (4, 6), (6, 9), (9, 11), (11, 13), (13, 16), (16, 17)]
    got = chat.assistant_labels(range(len(offsets)), offsets, spans)
    assert got == [False, False, True, True, False, True, True, False]
    assert chat.assistant_labels([0, 1], [(0, 3), (3, 3)], []) == [False, False]


def test_conversations_without_an_assistant_turn_are_skipped_and_counted(
    llama3_bpe, tmp_path, capsys
):
    records = [
        {"messages": [{"role": "user", "content": "Only a question."}]},
        {"messages": CONVERSATIONS[1]},
        {"messages": []},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]},
        {"input_ids": [5]},
    ]
    path = _jsonl(tmp_path / "chat.jsonl", records)
    dataset = load_dataset(path, tokenizer=llama3_bpe)
    assert list(dataset.lines) == [2, 5]
    assert capsys.readouterr().out == (
        f"{path}: skipped 3 records whose 'messages' have no assistant turn (no token to learn)\n"
    )
    cache, _ = data_cache.ensure_cache(path, tmp_path / "c", tokenizer=llama3_bpe, eos_id=None)
    assert int(cache.meta["num_documents"]) == 2  # the token cache reads alike
    assert "skipped 3 records whose 'messages'" in capsys.readouterr().out
    only = _jsonl(tmp_path / "e.jsonl", records[:1])
    with pytest.raises(ValueError, match=r"e\.jsonl: the dataset has no examples"):
        load_dataset(only, tokenizer=llama3_bpe)


GOOD = {"messages": CONVERSATIONS[1]}


@pytest.mark.parametrize(
    ("record", "pattern"),
    [
        (
            {"messages": "hi"},
            r"'messages' must be a list of \{'role': str, 'content': str\} dicts, got str$",
        ),
        ({"messages": [{"role": "user", "content": "a"}, "b"]}, r"'messages'\[1\] must be a dict"),
        ({"messages": [{"content": "a"}]}, r"'messages'\[0\] has no 'role'"),
        (
            {"messages": [{"role": "user", "content": None}]},
            r"'messages'\[0\] has no 'content' \(each message needs a str or a list of text "
            r"parts; only one with 'tool_calls' may go without\)$",
        ),
        (
            {"messages": [{"role": "user", "content": 3}]},
            r"'messages'\[0\]: 'content' must be a str or a list of \{'type': 'text', 'text': "
            r"str\} parts, got int$",
        ),
        ({"messages": [{"role": 1, "content": "a"}]}, r"'messages'\[0\]: 'role' must be a str"),
        (
            {"prompt": [{"role": "user", "content": "a"}], "completion": "b"},
            r"'prompt' must be a str, got list \(a conversation goes in one 'messages' list",
        ),
    ],
)
def test_malformed_messages_name_file_line_and_field(llama3_bpe, tmp_path, record, pattern):
    path = _jsonl(tmp_path / "bad.jsonl", [GOOD, record])
    with pytest.raises(ValueError, match=rf"bad\.jsonl: line 2: {pattern}") as error:
        load_dataset(path, tokenizer=llama3_bpe)
    assert "\n" not in str(error.value)


def test_a_tokenizer_without_a_chat_template_is_named(llama3_bpe, tmp_path):
    plain = _write_tokenizer(tmp_path / "plain", llama3_bpe, template=None)
    path = _jsonl(tmp_path / "chat.jsonl", [{"input_ids": [1]}, GOOD])
    with pytest.raises(ValueError) as error:
        load_dataset(path, tokenizer=plain)
    assert str(error.value) == (
        f"{path}: line 2: has 'messages' but {plain} has no chat_template in "
        "tokenizer_config.json or chat_template.jinja; add the model's chat template there, "
        "give one in its place (--chat_template FILE, or --chat-template FILE in "
        "train.data), or write the conversations as 'prompt' / 'completion' records"
    )
    with pytest.raises(ValueError, match=r"line 2: has 'messages' but no tokenizer was given"):
        load_dataset(path)


def test_a_broken_tokenizer_config_is_named_as_the_model_tools_name_it(llama3_bpe, tmp_path):
    """A tokenizer_config.json that is not JSON: one line naming it, the error that
    models.convert gives for the same file (one reader of a tokenizer's JSON files)."""
    from models import convert

    folder = _write_tokenizer(tmp_path / "tok", llama3_bpe)
    config = folder / "tokenizer_config.json"
    config.write_text('{"chat_template": ')
    with pytest.raises(ValueError) as error:
        load_dataset(_jsonl(tmp_path / "chat.jsonl", [GOOD]), tokenizer=folder)
    with pytest.raises(ValueError) as converting:
        convert.special_token_ids(folder / "tokenizer.json")
    assert str(error.value).startswith(f"{config} is not valid JSON (")
    assert str(error.value) == str(converting.value) and "\n" not in str(error.value)


def test_chat_template_jinja_comes_before_tokenizer_config(llama3_bpe, tmp_path):
    """A ``chat_template.jinja`` beside the tokenizer (newer transformers write it) is the
    template, in place of tokenizer_config.json's, as transformers loads it."""
    folder = _write_tokenizer(tmp_path / "tok", llama3_bpe)
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    path = _jsonl(tmp_path / "chat.jsonl", [GOOD])
    dataset = load_dataset(path, tokenizer=folder)
    tokenizer = load_tokenizer(folder)
    user, answer = (m["content"] for m in GOOD["messages"])
    text = f"user: {user}\nassistant: {answer}\n"
    assert dataset.tokens.tolist() == tokenizer.encode(text, add_special_tokens=False).ids
    learned = [t for t, lab in zip(dataset.tokens, dataset.targets, strict=True) if lab != IGNORE]
    assert tokenizer.decode(learned).strip() == answer


@pytest.mark.parametrize(
    ("template", "pattern"),
    [
        (
            "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
            "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
            "{% endif %}{{ m['content'] }}{% endfor %}",
            r"line 2: 'messages': the chat template \(tokenizer_config\.json\) raised "
            r"TemplateError: Conversation roles must alternate user/assistant$",
        ),
        (  # a generation prompt that the assistant's turn does not begin with
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<answer>{% endif %}",
            r"line 2: 'messages': the chat template \(tokenizer_config\.json\) renders the "
            r"messages before assistant turn 1 \(message 1\) with its generation prompt as "
            r"text that does not begin its rendering through that turn",
        ),
    ],
)
def test_template_errors_name_file_line_and_why(llama3_bpe, tmp_path, template, pattern):
    folder = _write_tokenizer(tmp_path / "tok", llama3_bpe, template=template)
    ok = {"messages": [{"role": "user", "content": "a"}]}  # no assistant turn: not rendered
    bad = {"messages": [*GOOD["messages"], *GOOD["messages"]]}
    if "raise_exception" in template:
        bad = {"messages": [ok["messages"][0], *GOOD["messages"]]}  # user, user, assistant
    path = _jsonl(tmp_path / "chat.jsonl", [ok, bad])
    with pytest.raises(ValueError, match=rf"chat\.jsonl: {pattern}") as error:
        load_dataset(path, tokenizer=folder)
    assert "\n" not in str(error.value)


def test_missing_jinja2_names_the_extra(llama3_bpe, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "jinja2", None)  # makes `import jinja2` fail
    path = _jsonl(tmp_path / "chat.jsonl", [GOOD])
    with pytest.raises(ValueError) as error:
        load_dataset(path, tokenizer=llama3_bpe)
    assert str(error.value) == (
        f"{path}: line 1: has 'messages' but rendering them needs the 'jinja2' package: "
        "pip install 'jflash[text]'"
    )


def test_transformers_template_environment(llama3_bpe, tmp_path):
    """What transformers gives a chat template: tojson without HTML escaping, the
    loopcontrols extension, strftime_now, trim_blocks / lstrip_blocks, a {% generation %}
    block that renders its body, the special tokens and tools=None as variables, and a
    sandbox."""
    source = (
        "{{ bos_token }}|{{ eos_token }}|{{ messages[0] | tojson }}|"
        "{% for m in messages %}{% if loop.index0 > 0 %}{% break %}{% endif %}"
        "{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}|"
        "{{ strftime_now('%Y') | length }}|{{ tools is none }}\n"
        "  {% if true %}\nkept\n  {% endif %}\n"
    )
    folder = _write_tokenizer(tmp_path / "tok", llama3_bpe, template=source)
    template = chat.ChatTemplate(folder, "where:")
    messages = [{"role": "user", "content": "<b> & é"}, {"role": "assistant", "content": "x"}]
    assert template.render(messages) == (
        f'{BOS}|{EOT}|{{"role": "user", "content": "<b> & é"}}|<b> & é|4|True\nkept\n'
    )
    unsafe = _write_tokenizer(tmp_path / "unsafe", llama3_bpe, "{{ messages.__class__.__mro__ }}")
    with pytest.raises(chat.ChatTemplateError, match="raised SecurityError"):
        chat.ChatTemplate(unsafe, "where:").render(messages)
    broken = _write_tokenizer(tmp_path / "broken", llama3_bpe, template="{% for %}")
    with pytest.raises(ValueError, match=r"^where: .*tokenizer_config\.json: the chat template "):
        chat.ChatTemplate(broken, "where:")


def test_records_with_messages_and_other_keys(llama3_bpe, tmp_path):
    """A record is read by the first of input_ids, text, prompt and completion (both),
    messages: a "prompt" beside "messages" (a chat dataset's first question) does not
    make it a prompt/completion record."""
    tokenizer = load_tokenizer(llama3_bpe)
    messages = GOOD["messages"]
    records = [
        {"prompt": messages[0]["content"], "prompt_id": "x", "messages": messages},
        {"text": "Plain text.", "messages": messages},
        {"prompt": "Q", "completion": " A", "messages": messages},
        {"input_ids": [7], "messages": messages},
    ]
    dataset = load_dataset(_jsonl(tmp_path / "mixed.jsonl", records), tokenizer=llama3_bpe)
    alone = load_dataset(_jsonl(tmp_path / "one.jsonl", [GOOD]), tokenizer=llama3_bpe)
    first = dataset.tokens[: dataset.offsets[1]]
    np.testing.assert_array_equal(first, alone.tokens)
    np.testing.assert_array_equal(dataset.targets[: dataset.offsets[1]], alone.targets)
    text = tokenizer.encode("Plain text.").ids
    assert dataset.example(1).tolist() == text
    pair = tokenizer.encode("Q").ids + tokenizer.encode(" A", add_special_tokens=False).ids
    assert dataset.example(2).tolist() == pair and dataset.example(3).tolist() == [7]


def test_the_token_cache_reads_messages_and_records_the_template(llama3_bpe, tmp_path, capsys):
    """The token cache holds the in-memory ids and labels; its meta records the chat
    template, and another template makes the cache stale (rebuilt by --data_cache_dir,
    refused with the rebuild command when given as the data)."""
    folder = _write_tokenizer(tmp_path / "tok", llama3_bpe)
    records = [{"messages": c} for c in CONVERSATIONS] + [{"text": "Some text."}]
    path = _jsonl(tmp_path / "chat.jsonl", records)
    eot = load_tokenizer(folder).token_to_id(EOT)
    memory = load_dataset(path, tokenizer=folder)
    cache_dir = tmp_path / "c"
    data_main(["cache", str(path), str(cache_dir), "--tokenizer", str(folder)])
    assert f"(eos_id={eot})" in capsys.readouterr().out  # tokenizer_config's eos_token
    cache = data_cache.open_cache(cache_dir)
    assert cache.meta["chat_template"]["path"] == str((folder / "tokenizer_config.json").resolve())
    stream = memory.rows(1, eos_id=eot)  # rows of one token: the stream, shifted
    cached = cache.rows(1).take(np.arange(cache.rows(1).num_rows))
    for got, want in zip(cached, stream, strict=True):
        np.testing.assert_array_equal(got, want)
    assert memory.tokens[memory.offsets[2] - 1] == eot  # a turn's end is the EOS: no second
    assert int(cache.meta["num_tokens"]) == memory.num_tokens + 1  # only the text's EOS
    assert cache.mismatch(path, tokenizer=folder, eos_id=eot) == []
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = config["chat_template"].replace("\\n\\n", "\\n")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    stale = "its conversations were rendered with another chat template"
    assert cache.mismatch(path, tokenizer=folder, eos_id=eot) == [
        f"{stale} ({folder.resolve() / 'tokenizer_config.json'})"
    ]
    with pytest.raises(ValueError, match=f"does not match this run \\({stale}"):
        data_cache.packed_rows(cache_dir, 4, tokenizer=folder, eos_id=eot)
    _, built = data_cache.ensure_cache(path, cache_dir, tokenizer=folder, eos_id=eot)
    assert built and f"is stale ({stale}" in capsys.readouterr().out
    (folder / "chat_template.jinja").write_text(LLAMA3_TEMPLATE)
    _, built = data_cache.ensure_cache(path, cache_dir, tokenizer=folder, eos_id=eot)
    assert built  # the .jinja file is the template now: another one
    _, built = data_cache.ensure_cache(path, cache_dir, tokenizer=folder, eos_id=eot)
    assert not built


def test_parquet_messages_column(llama3_bpe, tmp_path):
    """A parquet column of lists of structs gives each row's messages as dicts; a field
    that only some messages have is None in the others, dropped as transformers drops it."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [
        [{"role": "user", "content": "Hi", "name": None}, {"role": "assistant", "content": "Yo"}],
        CONVERSATIONS[0],
    ]
    table = pa.table({"messages": rows, "id": [0, 1]})
    pq.write_table(table, tmp_path / "chat.parquet")
    dataset = load_dataset(tmp_path / "chat.parquet", tokenizer=llama3_bpe)
    plain = [[{k: v for k, v in m.items() if v is not None} for m in c] for c in rows]
    want = load_dataset(
        _jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in plain]), tokenizer=llama3_bpe
    )
    np.testing.assert_array_equal(dataset.tokens, want.tokens)
    np.testing.assert_array_equal(dataset.targets, want.targets)
    assert readers._columns(tmp_path, ["id", "messages"]) == ["messages"]
    assert readers._columns(tmp_path, ["messages", "prompt", "completion"]) == [
        "prompt",
        "completion",
    ]
    assert readers._columns(tmp_path, ["prompt", "messages"]) == ["messages"]


def test_train_tokenizer_learns_from_the_messages(tmp_path):
    """`python -m train.data tokenizer` learns the messages' contents of a .jsonl of
    conversations: a word said only there becomes one token."""
    tokenizers = pytest.importorskip("tokenizers")
    line = [
        {"role": "user", "content": "quokka " * 20},
        {"role": "assistant", "content": "wombat " * 20},
    ]
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": line}] * 5)
    file = train_tokenizer([path], tmp_path / "tok", vocab_size=300)
    tokenizer = tokenizers.Tokenizer.from_file(str(file))
    assert len(tokenizer.encode(" quokka").ids) == 1
    assert len(tokenizer.encode(" wombat").ids) == 1


def test_inspect_counts_the_assistant_tokens(llama3_bpe, tmp_path, capsys):
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])
    data_main(["inspect", str(path), "--tokenizer", str(llama3_bpe)])
    counts = dict(line.split(": ") for line in capsys.readouterr().out.strip().splitlines())
    dataset = load_dataset(path, tokenizer=llama3_bpe)
    assert int(counts["labelled_tokens"]) == int((dataset.targets != IGNORE).sum())
    assert 0 < int(counts["labelled_tokens"]) < int(counts["tokens"]) == dataset.num_tokens


def _mark_llama3(template: str) -> str:
    """Llama-3's template (or one that writes a turn as it does) with {% generation %}
    around each assistant turn's content and end of turn: the same text, and
    transformers' assistant mask (for contents without a blank line)."""
    return template.replace(
        "{{ content }}",
        "{% if message['role'] == 'assistant' %}{{ content.split('\\n\\n', 1)[0] + '\\n\\n' }}"
        "{% generation %}{{ content.split('\\n\\n', 1)[1] }}{% endgeneration %}"
        "{% else %}{{ content }}{% endif %}",
    )


ORACLE_CHAT = """
import json, sys
from transformers import AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
conversations = json.loads(open(sys.argv[2]).read())
out = [tokenizer.apply_chat_template(c, tokenize=True, return_dict=True)["input_ids"]
       for c in conversations]
masks = [tokenizer.apply_chat_template(c, tokenize=True, return_dict=True,
         return_assistant_tokens_mask=True, chat_template=sys.argv[3])["assistant_masks"]
         for c in conversations]
print(json.dumps({"ids": out, "masks": masks}))
"""


@pytest.mark.slow
def test_ids_and_labels_match_transformers_apply_chat_template(llama3_bpe, tmp_path):
    """transformers' ``apply_chat_template(messages, tokenize=True)`` gives the ids for the
    same tokenizer directory, and its assistant mask (from the template's
    ``{% generation %}`` markers) the labelled tokens. Skipped without the oracle."""
    marked = _mark_llama3(LLAMA3_TEMPLATE)
    conversations = [*CONVERSATIONS, [{"role": "user", "content": "Tab\tand  spaces"}]]
    conversations[-1].append({"role": "assistant", "content": "  ok  "})
    (tmp_path / "c.json").write_text(json.dumps(conversations))
    oracle = run_oracle(ORACLE_CHAT, llama3_bpe, tmp_path / "c.json", marked)
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in conversations])
    dataset = load_dataset(path, tokenizer=llama3_bpe)
    for i in range(len(conversations)):
        ids, targets = (
            dataset.example(i),
            dataset.targets[dataset.offsets[i] : dataset.offsets[i + 1]],
        )
        assert ids.tolist() == oracle["ids"][i]
        assert (targets != IGNORE).astype(int).tolist() == oracle["masks"][i]


def _two_steps(path: Path, tokenizer: Path, seq_len: int, out: Path) -> list[dict]:
    """`python -m train` (in process) for two steps of the tiny model on `path`, rows of
    `seq_len` tokens packed whole, 8 a step however many devices there are (the 8
    simulated CPU devices, one GPU): the logged step records."""
    from train.config import parse_args
    from train.loop import run

    per_device, rest = divmod(8, jax.device_count())
    assert per_device and not rest, f"8 rows a step over {jax.device_count()} devices"
    argv = ["--model_name_or_path", "tiny", "--data_path", str(path), "--progress", "false"]
    argv += ["--tokenizer_name_or_path", str(tokenizer), "--model_max_length", str(seq_len)]
    argv += ["--packing", "whole", "--max_steps", "2", "--logging_steps", "1"]
    argv += ["--mesh", "data=-1", "--per_device_train_batch_size", str(per_device)]
    run(parse_args([*argv, "--output_dir", str(out)]))
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return [r for r in records if "loss" in r]


def test_the_trainer_learns_the_assistant_turns(llama3_bpe, tmp_path, capsys):
    """`python -m train` on conversations: two steps of the tiny model, rows packed whole,
    the loss finite and averaged over the assistant tokens only (and their EOS)."""
    conversations = [
        [
            {"role": "user", "content": f"What is {i} plus {i}?"},
            {"role": "assistant", "content": f"It is {2 * i}."},
        ]
        for i in range(48)
    ]
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in conversations])
    steps = _two_steps(path, llama3_bpe, 64, tmp_path / "out")
    assert [r["step"] for r in steps] == [1, 2] and all(np.isfinite(r["loss"]) for r in steps)
    # 8 rows of 64 tokens a step, a third or less of each conversation learned.
    dataset = load_dataset(path, tokenizer=llama3_bpe)
    assert (dataset.targets != IGNORE).sum() < dataset.num_tokens / 3
    assert all(0 < r["labelled_tokens"] < 8 * 64 / 3 for r in steps)


# ---------------------------------------------------------------------------------------
# Tool calls, tool results, a record's tools and content lists
# ---------------------------------------------------------------------------------------

TEMPLATES = REPO / "tests" / "data" / "chat_templates"
# Llama-3.1-8B-Instruct's chat template (tool calls as JSON, tool results as ipython
# turns, the tools in the first user message) and Qwen2.5-Instruct's (tools in the
# system turn, <tool_call> blocks, consecutive tool results in one user turn).
LLAMA31_TEMPLATE = (TEMPLATES / "llama3.1.jinja").read_text()
QWEN25_TEMPLATE = (TEMPLATES / "qwen2.5.jinja").read_text()
# Llama-3.2-1B-Instruct's: 3.1's with today's date (strftime_now) in the system turn.
LLAMA32_TEMPLATE = LLAMA31_TEMPLATE.replace(
    '{%- set date_string = "26 Jul 2024" %}',
    '{%- if strftime_now is defined %}{%- set date_string = strftime_now("%d %b %Y") %}'
    '{%- else %}{%- set date_string = "26 Jul 2024" %}{%- endif %}',
)
IM_START, IM_END = "<|im_start|>", "<|im_end|>"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city."}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def _call(name: str, arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


# One call per turn (Llama-3.1 takes one), the assistant's content null as OpenAI writes it.
TOOL_CHAT = [
    {"role": "system", "content": "You check the weather."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [_call("get_weather", {"city": "Paris"})]},
    {"role": "tool", "name": "get_weather", "content": '{"temperature": 21, "sky": "clear"}'},
    {"role": "assistant", "content": "It is 21 degrees and clear in Paris."},
    {"role": "user", "content": "And in Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [_call("get_weather", {"city": "Oslo"})]},
    {"role": "tool", "name": "get_weather", "content": '{"temperature": 4, "sky": "rain"}'},
    {"role": "assistant", "content": "4 degrees and raining in Oslo."},
]
# Two calls in one turn, with content, arguments as a JSON string, two results in a row.
PARALLEL_CHAT = [
    {"role": "user", "content": "Weather and time in Rome?"},
    {
        "role": "assistant",
        "content": "Checking both.",
        "tool_calls": [
            _call("get_weather", {"city": "Rome"}),
            {"type": "function", "function": {"name": "get_time", "arguments": '{"city": "Rome"}'}},
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 25"},
    {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
    {"role": "assistant", "content": "Sunny and 25 degrees; it is 14:05."},
]


def _qwen_tokenizer(folder: Path, base: Path, template: str = QWEN25_TEMPLATE) -> Path:
    """``folder``: ``base``'s BPE with Qwen's <|im_start|> / <|im_end|> as special tokens
    and no BOS added, and Qwen's tokenizer_config (eos <|im_end|>, no BOS) with
    ``template``."""
    tokenizers = pytest.importorskip("tokenizers")
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizers.Tokenizer.from_file(str(base / "tokenizer.json"))
    tokenizer.add_special_tokens([IM_START, IM_END])
    tokenizer.post_processor = tokenizers.processors.TemplateProcessing(single="$A")
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": IM_END,
        "pad_token": "<|endoftext|>",
        "chat_template": template,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return folder


def _learned(dataset, i: int) -> tuple[list[int], list[int]]:
    ids = dataset.example(i).tolist()
    labels = dataset.targets[dataset.offsets[i] : dataset.offsets[i + 1]].tolist()
    return ids, labels


def test_tool_calls_and_results_render_and_only_the_assistant_turns_are_learned(
    llama3_bpe, tmp_path
):
    """A small template, its rendering written out by hand: each message reaches it with
    its keys (tool_calls, a tool result's name; the null content dropped), the record's
    tools too; the tool-calling turn is learned, the tool's result is not."""
    template = (
        "{% if tools %}tools: {{ tools | map(attribute='function') | map(attribute='name') "
        "| join(', ') }}\n{% endif %}"
        "{% for m in messages %}<{{ m.role }}{% if m.name %} {{ m.name }}{% endif %}>"
        "{% if 'content' not in m %}[no content]{% endif %}{{ m.content }}"
        "{% for c in m.tool_calls %}call {{ c.function.name }}"
        "{{ c.function.arguments | tojson }}{% endfor %}</>\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    folder = _write_tokenizer(tmp_path / "tok", llama3_bpe, template=template)
    messages = TOOL_CHAT[1:5]
    records = [{"messages": messages, "tools": [WEATHER, TIME]}, {"messages": messages}]
    path = _jsonl(tmp_path / "tools.jsonl", records)
    dataset = load_dataset(path, tokenizer=folder)
    tokenizer = load_tokenizer(folder)
    turns = [
        '[no content]call get_weather{"city": "Paris"}</>\n',
        "It is 21 degrees and clear in Paris.</>\n",
    ]
    body = (
        "<user>What is the weather in Paris?</>\n<assistant>"
        + turns[0]
        + '<tool get_weather>{"temperature": 21, "sky": "clear"}</>\n<assistant>'
        + turns[1]
    )
    for i, head in enumerate(["tools: get_weather, get_time\n", ""]):
        ids, labels = _learned(dataset, i)
        assert ids == tokenizer.encode(head + body, add_special_tokens=False).ids
        learned = [t for t, label in zip(ids, labels, strict=True) if label != IGNORE]
        assert tokenizer.decode(learned) == "".join(turns)
    spans = chat.ChatTemplate(folder, "where:").assistant_spans(
        RecordParser(path, folder)._messages("line 1", messages), [WEATHER, TIME]
    )
    text, found = spans
    assert [text[a:b] for a, b in found] == turns


@pytest.mark.parametrize(
    ("template", "messages", "turns"),
    [
        (
            LLAMA31_TEMPLATE,
            TOOL_CHAT,
            [
                '{"name": "get_weather", "parameters": {"city": "Paris"}}' + EOT,
                "It is 21 degrees and clear in Paris." + EOT,
                '{"name": "get_weather", "parameters": {"city": "Oslo"}}' + EOT,
                "4 degrees and raining in Oslo." + EOT,
            ],
        ),
        (
            LLAMA32_TEMPLATE,
            TOOL_CHAT[1:5],
            [
                '{"name": "get_weather", "parameters": {"city": "Paris"}}' + EOT,
                "It is 21 degrees and clear in Paris." + EOT,
            ],
        ),
        (
            QWEN25_TEMPLATE,
            TOOL_CHAT,
            [
                '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                "</tool_call><|im_end|>\n",
                "It is 21 degrees and clear in Paris.<|im_end|>\n",
                '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                "</tool_call><|im_end|>\n",
                "4 degrees and raining in Oslo.<|im_end|>\n",
            ],
        ),
        (
            QWEN25_TEMPLATE,
            PARALLEL_CHAT,
            [
                'Checking both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
                '"Rome"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
                '"{\\"city\\": \\"Rome\\"}"}\n</tool_call><|im_end|>\n',
                "Sunny and 25 degrees; it is 14:05.<|im_end|>\n",
            ],
        ),
    ],
    ids=["llama3.1", "llama3.2", "qwen2.5", "qwen2.5-parallel"],
)
def test_real_templates_keep_the_prefix_rule_with_tool_calls(
    llama3_bpe, tmp_path, template, messages, turns
):
    """Llama-3.1/3.2's and Qwen2.5's templates, given the tools: each assistant turn (a
    tool call, or the answer after the tool's result) is the text between the rendering
    before it with the generation prompt and the rendering through it; tool results,
    the tools' descriptions and the headers are not in any turn."""
    folder = _write_tokenizer(tmp_path / "tok", llama3_bpe, template=template)
    path = _jsonl(tmp_path / "tools.jsonl", [{"messages": messages, "tools": [WEATHER, TIME]}])
    parser = RecordParser(path, folder)
    text, spans = chat.ChatTemplate(folder, "where:").assistant_spans(
        parser._messages("line 1", messages), parser._tools("line 1", [WEATHER, TIME])
    )
    assert [text[a:b] for a, b in spans] == turns
    assert "get_time" in text  # the tools reached the template
    dataset = load_dataset(path, tokenizer=folder)  # the reader learns those turns
    ids, labels = _learned(dataset, 0)
    tokenizer = load_tokenizer(folder)
    learned = tokenizer.decode(
        [t for t, label in zip(ids, labels, strict=True) if label != IGNORE],
        skip_special_tokens=False,
    )
    for turn in turns:
        assert turn.strip() in learned
    for result in ("temperature", "sunny, 25", "14:05\n", "The city."):
        assert result not in learned


# Llama-3's template, each content part rendered trimmed where the content is a list of
# parts (as list-aware templates, Gemma-3's and Llama-4's, render their text parts).
PARTS_TEMPLATE = LLAMA3_TEMPLATE.replace(
    "+ message['content'] | trim + '<|eot_id|>' %}",
    "%}{% set ns = namespace(text='') %}{% if message['content'] is string %}"
    "{% set ns.text = message['content'] | trim %}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}"
    "{% set ns.text = ns.text + part['text'] | trim %}{% endif %}{% endfor %}{% endif %}"
    "{% set content = content + ns.text + '<|eot_id|>' %}",
)
assert PARTS_TEMPLATE != LLAMA3_TEMPLATE


def _parts(text: str) -> list[dict]:
    """``text`` as two text parts, cut after its first space (a space either side of
    the cut, which a template that trims each part drops)."""
    cut = text.index(" ") + 1
    return [{"type": "text", "text": text[:cut]}, {"type": "text", "text": " " + text[cut:]}]


PARTS_CHAT = [
    {"role": "system", "content": _parts("You pack rows of text.")},
    {"role": "user", "content": "How are documents packed?"},
    {"role": "assistant", "content": _parts("Back to back, with an EOS after each.")},
    {"role": "user", "content": _parts("And labels?")},
    {"role": "assistant", "content": "They never cross an example boundary."},
]


def test_content_lists_reach_the_template_as_they_are(llama3_bpe, tmp_path):
    """A content list of text parts goes to the template as a list, as transformers
    passes it: a template that iterates the parts renders each (here trimmed, so the
    text is not the parts joined), and an assistant turn given as parts is learned."""
    folder = _write_tokenizer(tmp_path / "tok", llama3_bpe, template=PARTS_TEMPLATE)
    dataset = load_dataset(
        _jsonl(tmp_path / "p.jsonl", [{"messages": PARTS_CHAT}]), tokenizer=folder
    )
    ids, labels = _learned(dataset, 0)
    tokenizer = load_tokenizer(folder)
    text = BOS
    for m in PARTS_CHAT:
        content = m["content"]
        words = (
            content.strip()
            if isinstance(content, str)
            else "".join(p["text"].strip() for p in content)
        )
        text += f"{HEADER}{m['role']}{END_HEADER}\n\n{words}{EOT}"
    assert "Backto back, with an EOS" in text
    assert ids == tokenizer.encode(text, add_special_tokens=False).ids
    learned = [t for t, label in zip(ids, labels, strict=True) if label != IGNORE]
    assert tokenizer.decode(learned, skip_special_tokens=False) == (
        f"Backto back, with an EOS after each.{EOT}They never cross an example boundary.{EOT}"
    )


@pytest.mark.parametrize(
    ("template", "pattern"),
    [
        (  # Llama-3's: `content | trim` writes the list's Python text
            LLAMA3_TEMPLATE,
            r"the chat template \(tokenizer_config\.json\) writes message 0's content list as "
            r"Python text \(\{'type': 'text', 'text': 'You '\}\) \(a template that takes str "
            r"content only; write the content as a str, or use a template that renders text "
            r"parts\)$",
        ),
        (  # Qwen2.5's: `'\n' + message.content` raises
            QWEN25_TEMPLATE,
            r"the chat template \(tokenizer_config\.json\) raised TypeError: can only "
            r"concatenate str \(not \"list\"\) to str \(a template that takes str content "
            r"only; .*\)$",
        ),
        (  # Qwen3's way: a content that is not a str written as nothing
            "{% for m in messages %}{{ m.role }}: {% if m.content is string %}{{ m.content }}"
            "{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}",
            r"the chat template \(tokenizer_config\.json\) writes nothing of message 0's "
            r"content part 0 \('You'\) \(a template that takes str content only; .*\)$",
        ),
    ],
    ids=["repr", "raises", "nothing"],
)
def test_a_template_that_takes_str_content_only_is_refused_for_lists(
    llama3_bpe, tmp_path, template, pattern
):
    """transformers renders a content list with such a template too, as garbage (the
    list's Python text, or nothing of it): the reader refuses it in one line, naming the
    message and the remedy; the same conversation with str contents renders."""
    folder = _write_tokenizer(tmp_path / "tok", llama3_bpe, template=template)
    path = _jsonl(tmp_path / "p.jsonl", [GOOD, {"messages": PARTS_CHAT}])
    with pytest.raises(ValueError, match=rf"p\.jsonl: line 2: 'messages': {pattern}") as error:
        load_dataset(path, tokenizer=folder)
    assert "\n" not in str(error.value)
    joined = [
        {**m, "content": "".join(p["text"] for p in m["content"])}
        if isinstance(m["content"], list)
        else m
        for m in PARTS_CHAT
    ]
    load_dataset(_jsonl(tmp_path / "s.jsonl", [{"messages": joined}]), tokenizer=folder)


def test_a_tool_use_template_renders_the_conversations_with_tools(llama3_bpe, tmp_path):
    """tokenizer_config.json's named templates: a conversation given tools is rendered
    with the 'tool_use' one, as transformers picks it; one without, with 'default'. Both
    are in the token cache's stamp."""
    folder = _write_tokenizer(tmp_path / "tok", llama3_bpe, template=None)
    named = [
        {"name": "default", "template": "{% for m in messages %}{{ m.content }}\n{% endfor %}"},
        {
            "name": "tool_use",
            "template": "{{ tools | length }} tools\n{% for m in messages %}{{ m.content }}\n"
            "{% endfor %}",
        },
    ]
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": named}))
    template = chat.ChatTemplate(folder, "where:")
    messages = [{"role": "user", "content": "a"}]
    assert template.render(messages) == "a\n"
    assert template.render(messages, tools=[WEATHER]) == "1 tools\na\n"
    assert template.render(messages, tools=[]) == "0 tools\na\n"
    stamp = chat.chat_template_stamp(folder)
    named[1]["template"] = named[1]["template"].replace("tools\n", "functions\n")
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": named}))
    assert chat.chat_template_stamp(folder)["sha256"] != stamp["sha256"]


def test_named_templates_in_additional_chat_templates(llama3_bpe, tmp_path):
    """transformers 5 saves named templates as chat_template.jinja (the default) and
    additional_chat_templates/<name>.jinja, and those files win over tokenizer_config.json:
    a conversation given tools is rendered with tool_use.jinja, one without with the
    default; the stamp covers tool_use.jinja; without a default, a one-line error."""
    folder = _write_tokenizer(tmp_path / "tok", llama3_bpe, template="config's {{ messages }}")
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.content }}\n{% endfor %}"
    )
    named = folder / "additional_chat_templates"
    named.mkdir()
    (named / "tool_use.jinja").write_text("{{ tools | length }} tools\n{{ messages[0].content }}")
    (named / "rag.jinja").write_text("{{ documents }}")  # never rendered here
    template = chat.ChatTemplate(folder, "where:")
    messages = [{"role": "user", "content": "a"}]
    assert template.render(messages) == "a\n"
    assert template.render(messages, tools=[WEATHER]) == "1 tools\na"
    stamp = chat.chat_template_stamp(folder)
    assert stamp["path"] == str((folder / "chat_template.jinja").resolve())
    (named / "tool_use.jinja").write_text("{{ tools | length }} functions")
    assert chat.chat_template_stamp(folder)["sha256"] != stamp["sha256"]
    (named / "tool_use.jinja").write_text("{{ raise_exception('no') }}")
    path = _jsonl(tmp_path / "t.jsonl", [{"messages": GOOD["messages"], "tools": [WEATHER]}])
    with pytest.raises(
        ValueError,
        match=r"line 1: 'messages': the chat template "
        r"\(additional_chat_templates/tool_use\.jinja\) raised TemplateError: no$",
    ):
        load_dataset(path, tokenizer=folder)
    (folder / "chat_template.jinja").unlink()
    with pytest.raises(ValueError) as error:
        chat.ChatTemplate(folder, "where:")
    assert str(error.value) == (
        f"{named} holds the templates ['rag', 'tool_use'] and {folder} has no "
        "chat_template.jinja (the default one, that conversations are rendered with)"
    )


def test_a_cache_rendered_without_tools_is_stale(llama3_bpe, tmp_path):
    """The token cache's stamp records what the template was given (messages and tools)
    and how its rendering is kept: a cache whose stamp lacks it (rendered before tools
    were passed, or before conversations ended on their last EOS) is rebuilt."""
    folder = _write_tokenizer(tmp_path / "tok", llama3_bpe, template=LLAMA31_TEMPLATE)
    path = _jsonl(tmp_path / "tools.jsonl", [{"messages": TOOL_CHAT, "tools": [WEATHER]}])
    eot = load_tokenizer(folder).token_to_id(EOT)
    cache, built = data_cache.ensure_cache(path, tmp_path / "c", tokenizer=folder, eos_id=eot)
    assert built and cache.meta["chat_template"]["inputs"] == chat.TEMPLATE_INPUTS
    assert cache.mismatch(path, tokenizer=folder, eos_id=eot) == []
    memory = load_dataset(path, tokenizer=folder)
    np.testing.assert_array_equal(np.asarray(cache.targets), memory.targets)  # EOT: the EOS
    meta_file = Path(cache.path) / "meta.json"
    meta = json.loads(meta_file.read_text())
    del meta["chat_template"]["inputs"]
    meta_file.write_text(json.dumps(meta))
    old = data_cache.open_cache(tmp_path / "c")
    assert old.mismatch(path, tokenizer=folder, eos_id=eot) == [
        "its conversations' template was given messages, this jflash gives it "
        + chat.TEMPLATE_INPUTS
    ]
    # Rendered before each conversation ended on its last EOS (a ChatML one got a second
    # EOS after its newline): stale too.
    before = "messages (content lists as given, reasoning under both names), tools, "
    meta["chat_template"]["inputs"] = before + "chat_template_kwargs"
    meta_file.write_text(json.dumps(meta))
    assert data_cache.open_cache(tmp_path / "c").mismatch(path, tokenizer=folder, eos_id=eot)


BAD_TOOLS = {"messages": TOOL_CHAT[1:5]}


@pytest.mark.parametrize(
    ("record", "pattern"),
    [
        (
            {"messages": [{"role": "assistant", "content": None, "tool_calls": {"a": 1}}]},
            r"'messages'\[0\]: 'tool_calls' must be a list of \{'type': 'function', 'function': "
            r"\{'name': str, 'arguments': dict or JSON str\}\} dicts, got dict$",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": ["get_weather"]}]},
            r"'messages'\[0\]: 'tool_calls'\[0\] must be a dict, got str$",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": "get_weather"}]}]},
            r"'messages'\[0\]: 'tool_calls'\[0\]: 'function' must be a dict with a str 'name', "
            r"got str$",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}]},
            r"'messages'\[0\]: 'tool_calls'\[0\]: 'function': 'name' must be a str \(the "
            r"function called\), got none$",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [_call("f", [1, 2])]}]},
            r"'messages'\[0\]: 'tool_calls'\[0\]: 'function': 'arguments' must be a dict or a "
            r"JSON str, got list$",
        ),
        (
            {"messages": [{"role": "user", "content": [{"text": "a"}]}]},
            r"'messages'\[0\]: 'content'\[0\] has no 'type' \(a text part: \{'type': 'text', "
            r"'text': str\}\)$",
        ),
        (
            {"messages": [{"role": "user", "content": ["a"]}]},
            r"'messages'\[0\]: 'content'\[0\] must be a dict with a 'type' .*, got str$",
        ),
        (
            {
                "messages": [
                    {"role": "system", "content": "s"},
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "What is this?"},
                            {"type": "image", "url": "cat.png"},
                        ],
                    },
                ]
            },
            r"'messages'\[1\]: 'content'\[1\] is a 'image' part: only text parts can be trained "
            r"\(a text-only model\); drop the record or its non-text parts$",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}
                ]
            },
            r"'messages'\[0\]: 'content'\[0\] is a 'input_audio' part: only text parts",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
            r"'messages'\[0\]: 'content'\[0\]: a text part's 'text' must be a str, got int$",
        ),
        (
            {"messages": [{"role": "assistant"}]},
            r"'messages'\[0\] has no 'content' \(each message needs a str or a list of text parts",
        ),
        (
            {**BAD_TOOLS, "tools": json.dumps([WEATHER])},
            r"'tools' must be a list of dicts \(the functions' JSON schemas\), got str \(a JSON "
            r"string of them: parse it into the list\)$",
        ),
        (
            {**BAD_TOOLS, "tools": {"get_weather": WEATHER}},
            r"'tools' must be a list of dicts \(the functions' JSON schemas\), got dict$",
        ),
        (
            {**BAD_TOOLS, "tools": [WEATHER, "get_time"]},
            r"'tools'\[1\] must be a dict \(a function's JSON schema\), got str$",
        ),
    ],
)
def test_malformed_tool_calls_parts_and_tools_name_file_line_and_field(
    llama3_bpe, tmp_path, record, pattern
):
    folder = _write_tokenizer(tmp_path / "tok", llama3_bpe, template=LLAMA31_TEMPLATE)
    path = _jsonl(tmp_path / "bad.jsonl", [GOOD, record])
    with pytest.raises(ValueError, match=rf"bad\.jsonl: line 2: {pattern}") as error:
        load_dataset(path, tokenizer=folder)
    assert "\n" not in str(error.value)


def test_a_template_that_refuses_the_tool_calls_is_named(llama3_bpe, tmp_path):
    """Llama-3.1's template takes one call a turn: two are its own error, with the line."""
    folder = _write_tokenizer(tmp_path / "tok", llama3_bpe, template=LLAMA31_TEMPLATE)
    path = _jsonl(tmp_path / "two.jsonl", [{"messages": PARALLEL_CHAT, "tools": [WEATHER]}])
    with pytest.raises(
        ValueError,
        match=r"two\.jsonl: line 1: 'messages': the chat template "
        r"\(tokenizer_config\.json\) raised TemplateError: This model only "
        r"supports single tool-calls at once!$",
    ):
        load_dataset(path, tokenizer=folder)


def test_nested_none_values_are_dropped_and_a_tools_column_is_read(llama3_bpe, tmp_path):
    """A table's missing struct fields (None at any depth: a tool call's arguments, a
    schema's properties) are dropped, as TRL drops them; a table's 'tools' column is
    read beside 'messages'."""
    folder = _write_tokenizer(tmp_path / "tok", llama3_bpe, template=QWEN25_TEMPLATE)
    holey = json.loads(json.dumps(TOOL_CHAT[1:5]))
    holey[0]["tool_call_id"] = None
    holey[1]["tool_calls"][0]["function"]["arguments"]["units"] = None
    schema = json.loads(json.dumps(WEATHER))
    schema["function"]["parameters"]["properties"]["units"] = None
    records = [
        {"messages": holey, "tools": [schema]},
        {"messages": TOOL_CHAT[1:5], "tools": [WEATHER]},
    ]
    dataset = load_dataset(_jsonl(tmp_path / "holey.jsonl", records), tokenizer=folder)
    assert _learned(dataset, 0) == _learned(dataset, 1)
    assert readers._columns(tmp_path, ["tools", "messages"]) == ["messages", "tools"]
    assert readers._columns(tmp_path, ["tools", "text"]) == ["text"]


def test_train_tokenizer_learns_the_text_parts(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    line = [{"role": "user", "content": [{"type": "text", "text": "quokka " * 20}]}]
    line.append({"role": "assistant", "content": "wombat " * 20})
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": line}] * 5)
    file = train_tokenizer([path], tmp_path / "tok", vocab_size=300)
    tokenizer = tokenizers.Tokenizer.from_file(str(file))
    assert len(tokenizer.encode(" quokka").ids) == 1


def test_the_trainer_learns_tool_calling_turns(llama3_bpe, tmp_path):
    """`python -m train` on a tool-use .jsonl (Llama-3.1's template, tools per record,
    tool calls with null content, tool results): two steps of the tiny model, rows
    packed whole, the loss finite and on the assistant turns only."""
    folder = _write_tokenizer(tmp_path / "tok", llama3_bpe, template=LLAMA31_TEMPLATE)
    records = []
    for i in range(24):
        city = f"City{i}"
        records.append(
            {
                "messages": [
                    {"role": "user", "content": f"Weather in {city}?"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [_call("get_weather", {"city": city})],
                    },
                    {"role": "tool", "name": "get_weather", "content": f"{i} degrees"},
                    {"role": "assistant", "content": f"{i} degrees."},
                ],
                "tools": [WEATHER],
            }
        )
    path = _jsonl(tmp_path / "tools.jsonl", records)
    steps = _two_steps(path, folder, 512, tmp_path / "out")
    assert [r["step"] for r in steps] == [1, 2] and all(np.isfinite(r["loss"]) for r in steps)
    dataset = load_dataset(path, tokenizer=folder)
    assert 0 < (dataset.targets != IGNORE).sum() < dataset.num_tokens / 4
    assert all(0 < r["labelled_tokens"] < 8 * 512 / 4 for r in steps)


ORACLE_TOOLS = """
import json, sys
from transformers import AutoTokenizer
cases = json.loads(open(sys.argv[1]).read())
out = []
for case in cases:
    tokenizer = AutoTokenizer.from_pretrained(case["folder"])
    record = case["record"]
    kwargs = {"tools": record.get("tools"), "tokenize": True, "return_dict": True}
    kwargs |= record.get("chat_template_kwargs") or {}
    ids = tokenizer.apply_chat_template(record["messages"], **kwargs)["input_ids"]
    mask = None
    if case["marked"]:
        mask = tokenizer.apply_chat_template(record["messages"], chat_template=case["marked"],
            return_assistant_tokens_mask=True, **kwargs)["assistant_masks"]
    out.append({"ids": list(ids), "mask": mask})
print(json.dumps(out))
"""


def _mark_llama31(template: str) -> str:
    """Llama-3.1's template with {% generation %} around each assistant turn's text (its
    content or tool call and its end of turn): the same text, and transformers' mask."""
    replaced = template
    for old, new in (
        (  # a plain message: the assistant's content and end of turn marked
            "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ "
            "message['content'] | trim + '<|eot_id|>' }}",
            "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
            "{% if message.role == 'assistant' %}{% generation %}"
            "{{- message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
            "{% else %}{{- message['content'] | trim + '<|eot_id|>' }}{% endif %}",
        ),
        (  # a tool call: the header written once before the call, the rest marked
            "{%- set tool_call = message.tool_calls[0].function %}",
            "{%- set tool_call = message.tool_calls[0].function %}"
            "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% generation %}",
        ),
        ("{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}\n", ""),
        (
            '            {{- "<|eot_id|>" }}\n        {%- endif %}\n',
            '            {{- "<|eot_id|>" }}\n        {%- endif %}{% endgeneration %}\n',
        ),
    ):
        assert old in replaced, old
        replaced = replaced.replace(old, new)
    return replaced


@pytest.mark.slow
def test_tool_conversations_match_transformers_apply_chat_template(llama3_bpe, tmp_path):
    """transformers' ``apply_chat_template(messages, tools=tools, tokenize=True)`` gives
    the ids of tool-call conversations (null content dropped, tool results, tools in the
    prompt, arguments as objects and JSON strings) with Llama-3.1's and Qwen2.5's
    templates; with {% generation %} marks on Llama-3.1's, its assistant mask gives the
    labelled tokens. Skipped without the oracle."""
    llama = _write_tokenizer(tmp_path / "llama", llama3_bpe, template=LLAMA31_TEMPLATE)
    qwen = _qwen_tokenizer(tmp_path / "qwen", llama3_bpe)
    marked = _mark_llama31(LLAMA31_TEMPLATE)
    no_system = TOOL_CHAT[1:]
    cases = [
        (llama, TOOL_CHAT, [WEATHER, TIME], marked),
        (llama, no_system, [WEATHER], marked),
        (llama, CONVERSATIONS[0], None, marked),
        (qwen, TOOL_CHAT, [WEATHER, TIME], None),
        (qwen, PARALLEL_CHAT, [WEATHER, TIME], None),
        (qwen, no_system, None, None),
    ]
    _match_the_oracle(tmp_path, [(f, {"messages": m, "tools": t}, k) for f, m, t, k in cases])


@pytest.mark.slow
def test_content_lists_match_transformers_apply_chat_template(llama3_bpe, tmp_path):
    """transformers' ``apply_chat_template`` gives the ids of conversations with content
    lists (system, user and assistant messages) rendered by a template that iterates
    the parts, and with {% generation %} marks its assistant mask the labelled tokens.
    Skipped without the oracle."""
    folder = _write_tokenizer(tmp_path / "parts", llama3_bpe, template=PARTS_TEMPLATE)
    marked = _mark_llama3(PARTS_TEMPLATE)
    listed = [{**m, "content": _parts(m["content"])} for m in CONVERSATIONS[0]]
    cases = [
        (folder, {"messages": PARTS_CHAT}, marked),
        (folder, {"messages": listed}, marked),
        (folder, {"messages": CONVERSATIONS[0]}, marked),
    ]
    _match_the_oracle(tmp_path, cases)


ORACLE_SAVE = """
import json, os, sys
from transformers import AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
tokenizer.chat_template = json.loads(sys.argv[2])
tokenizer.save_pretrained(sys.argv[3])
print(json.dumps(sorted(os.path.relpath(os.path.join(d, f), sys.argv[3])
                        for d, _, files in os.walk(sys.argv[3]) for f in files)))
"""


@pytest.mark.slow
def test_named_templates_as_transformers_saves_them(llama3_bpe, tmp_path):
    """A tokenizer whose named templates transformers saved (the default in
    chat_template.jinja, tool_use in additional_chat_templates/): conversations with
    and without tools get transformers' ids, Qwen2.5's template for those with tools,
    Llama-3.1's for the others. Skipped without the oracle."""
    source = _write_tokenizer(tmp_path / "source", llama3_bpe, template=None)
    templates = {"default": LLAMA31_TEMPLATE, "tool_use": QWEN25_TEMPLATE}
    saved = tmp_path / "saved"
    written = run_oracle(ORACLE_SAVE, source, json.dumps(templates), saved)
    assert {"chat_template.jinja", "additional_chat_templates/tool_use.jinja"} <= set(written)
    assert "chat_template" not in json.loads((saved / "tokenizer_config.json").read_text())
    cases = [
        (saved, {"messages": TOOL_CHAT, "tools": [WEATHER, TIME]}, None),
        (saved, {"messages": CONVERSATIONS[0]}, None),
    ]
    _match_the_oracle(tmp_path, cases)
    dataset = load_dataset(_jsonl(tmp_path / "t.jsonl", [cases[0][1]]), tokenizer=saved)
    assert IM_START in load_tokenizer(saved).decode(
        dataset.example(0).tolist(), skip_special_tokens=False
    )


def _through_last_eos(ids: list[int], folder: Path) -> list[int]:
    """transformers' ids of a rendered conversation as the reader keeps them: through
    its last EOS (the tokenizer's eos_token) where only white space follows it (ChatML's
    `<|im_end|>\n` under Qwen's tokenizers), whole elsewhere."""
    from models.convert import special_token_ids

    eos = special_token_ids(folder / "tokenizer.json").get("eos_token")
    if eos is None or not ids or ids[-1] == eos or eos not in ids:
        return ids
    last = len(ids) - 1 - ids[::-1].index(eos)
    rest = load_tokenizer(folder).decode(ids[last + 1 :], skip_special_tokens=False)
    return ids[: last + 1] if not rest.strip() else ids


def _match_the_oracle(
    tmp_path: Path,
    cases: list[tuple[Path, dict, str | None]],
    transformers_min: tuple[int, int] = (0, 0),
) -> None:
    """Each ``(tokenizer folder, record, marked template or None)``: the reader's ids for
    the record are transformers' ``apply_chat_template`` ids for its messages, given its
    tools and ``chat_template_kwargs``; with a marked template, the labelled tokens are
    its assistant mask. Skipped where the oracle's transformers is older than
    ``transformers_min``."""
    spec = [
        {"folder": str(folder), "record": record, "marked": marked}
        for folder, record, marked in cases
    ]
    (tmp_path / "cases.json").write_text(json.dumps(spec))
    oracle = run_oracle(ORACLE_TOOLS, tmp_path / "cases.json", transformers_min=transformers_min)
    for (folder, record, marked), want in zip(cases, oracle, strict=True):
        record = {k: v for k, v in record.items() if v is not None}
        dataset = load_dataset(_jsonl(tmp_path / "one.jsonl", [record]), tokenizer=folder)
        ids, labels = _learned(dataset, 0)
        assert ids == _through_last_eos(want["ids"], folder), (folder.name, record)
        if marked:
            assert [int(label != IGNORE) for label in labels] == want["mask"][: len(ids)]


WEATHER_CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {}}}


def test_conversational_prompt_completion_learns_the_completions_turns(
    llama3_bpe, tmp_path, capsys
):
    """TRL's conversational prompt-completion records (`prompt` and `completion` lists of
    messages) read as the conversation `prompt + completion`: the same ids as that
    `messages` record, learning only the completion's assistant turns (an assistant
    turn in the prompt is context); a completion without one has nothing to learn;
    `prompt` a list beside a str `completion` is refused by name."""
    prompt = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Capital of France?"},
    ]
    completion = [{"role": "assistant", "content": "Paris."}]
    records = [
        {"prompt": prompt, "completion": completion},
        {"messages": prompt + completion},
        {"prompt": prompt, "completion": [{"role": "user", "content": "no answer"}]},
    ]
    path = tmp_path / "pc.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    parser = RecordParser(path, llama3_bpe)
    got = parser.tokenize_texts(["line 1", "line 2", "line 3"], records)
    (pc_ids, pc_labels), (ids, labels), (empty, _) = got
    assert pc_ids.tolist() == ids.tolist() and empty.size == 0
    assert parser.empty_conversations == parser.empty_completion_turns == 1
    capsys.readouterr()
    load_dataset(path, tokenizer=llama3_bpe)  # the line names the completion's messages
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"{path}: skipped 1 record whose 'completion' messages have no assistant turn (no "
        "token to learn)"
    )
    learned = pc_labels != -100
    assert 0 < learned.sum() < (labels != -100).sum()  # the prompt's assistant turn is not
    encoding = load_tokenizer(llama3_bpe)
    assert "Paris." in encoding.decode(pc_ids[learned].tolist())
    assert "Hello" not in encoding.decode(pc_ids[learned].tolist())
    bad = {"prompt": prompt, "completion": "Paris."}
    with pytest.raises(ValueError, match=r"line 4: 'prompt' must be a str, got list"):
        parser.tokenize_texts(["line 4"], [bad])


# ---------------------------------------------------------------------------------------
# Reasoning, and the template's other variables
# ---------------------------------------------------------------------------------------

# In the manner of Qwen3's template: an assistant turn's reasoning (reasoning_content) in
# a <think> block, the turn marked for transformers' assistant mask, and with
# enable_thinking false an empty <think> block in the generation prompt.
THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}{% generation %}<think>\n"
    "{{ m.reasoning_content if m.reasoning_content is string else '' }}\n</think>\n\n"
    "{{ m.content }}<|im_end|>\n{% endgeneration %}"
    "{% else %}{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
# In the manner of gpt-oss's: the reasoning (thinking) in an analysis channel.
CHANNEL_TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m.role }}{% if m.thinking is defined %}"
    "<|channel|>analysis<|message|>{{ m.thinking }}<|end|><|start|>{{ m.role }}{% endif %}"
    "<|message|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
QUESTION = {"role": "user", "content": "Capital of France?"}


def _reasoned(key: str, reasoning: str = "The capital is Paris.") -> list[dict]:
    return [QUESTION, {"role": "assistant", "content": "Paris.", key: reasoning}]


def test_an_assistants_reasoning_reaches_the_template_under_both_names(llama3_bpe, tmp_path):
    """A message's reasoning, given as reasoning_content, thinking or reasoning, reaches
    a template that reads reasoning_content (Qwen3's) and one that reads thinking
    (gpt-oss's), as transformers 5.21+ gives it; the reasoning is in the learned turn."""
    records = [{"messages": _reasoned(key)} for key in chat.REASONING]
    for template, turn in (
        (THINK_TEMPLATE, "<think>\nThe capital is Paris.\n</think>\n\nParis.<|im_end|>"),
        (CHANNEL_TEMPLATE, "<|channel|>analysis<|message|>The capital is Paris.<|end|>"),
    ):
        folder = _qwen_tokenizer(tmp_path / "tok", llama3_bpe, template=template)
        dataset = load_dataset(_jsonl(tmp_path / "r.jsonl", records), tokenizer=folder)
        tokenizer = load_tokenizer(folder)
        for i in range(len(records)):
            ids, labels = _learned(dataset, i)
            assert (ids, labels) == _learned(dataset, 0)
            learned = [t for t, label in zip(ids, labels, strict=True) if label != IGNORE]
            assert turn in tokenizer.decode(learned, skip_special_tokens=False)
    both = {**_reasoned("thinking", "B")[1], "reasoning_content": "A"}
    template = chat.ChatTemplate(folder, "where:")
    assert "analysis<|message|>B<|end|>" in template.render([QUESTION, both])  # its own


@pytest.mark.slow
def test_reasoning_matches_transformers_apply_chat_template(llama3_bpe, tmp_path):
    """transformers' ``apply_chat_template`` gives the ids of conversations whose
    assistant reasons (under each name, for a template reading either), and its
    assistant mask the labelled tokens. Skipped without the oracle."""
    think = _qwen_tokenizer(tmp_path / "think", llama3_bpe, template=THINK_TEMPLATE)
    channel = _qwen_tokenizer(tmp_path / "channel", llama3_bpe, template=CHANNEL_TEMPLATE)
    cases = [(think, {"messages": _reasoned(key)}, THINK_TEMPLATE) for key in chat.REASONING]
    cases += [(channel, {"messages": _reasoned(key)}, None) for key in chat.REASONING]
    both = [QUESTION, {**_reasoned("thinking", "B")[1], "reasoning_content": "A"}]
    cases += [(think, {"messages": both}, THINK_TEMPLATE), (channel, {"messages": both}, None)]
    plain = [QUESTION, {"role": "assistant", "content": "Paris."}]
    cases.append((think, {"messages": plain}, THINK_TEMPLATE))
    # Before 5.21 transformers handed a template only the names a message has (no
    # `thinking` as `reasoning_content`); the reader gives what 5.21 on gives.
    _match_the_oracle(tmp_path, cases, transformers_min=(5, 21))


THINKING_OFF = {"enable_thinking": False}


def test_chat_template_kwargs_reach_the_template(llama3_bpe, tmp_path):
    """A record's chat_template_kwargs, and those given for every conversation, are
    template variables as apply_chat_template(**kwargs) passes them: with
    enable_thinking false the generation prompt holds the empty <think> block, which is
    then not learned; a record's own win over the global ones, both over the special
    tokens."""
    folder = _qwen_tokenizer(tmp_path / "tok", llama3_bpe, template=THINK_TEMPLATE)
    plain = [QUESTION, {"role": "assistant", "content": "Paris."}]
    records = [
        {"messages": plain},
        {"messages": plain, "chat_template_kwargs": THINKING_OFF},
        {"messages": plain, "chat_template_kwargs": {"enable_thinking": True}},
        {"messages": plain, "chat_template_kwargs": None},  # a table's missing value
    ]
    path = _jsonl(tmp_path / "k.jsonl", records)
    tokenizer = load_tokenizer(folder)

    def turns(dataset) -> list[str]:
        return [
            tokenizer.decode(
                [t for t, label in zip(*_learned(dataset, i), strict=True) if label != IGNORE],
                skip_special_tokens=False,
            )
            for i in range(len(records))
        ]

    # Each conversation ends on its EOS, <|im_end|> (the newline after it is dropped).
    thinking, off = "<think>\n\n</think>\n\nParis.<|im_end|>", "Paris.<|im_end|>"
    dataset = load_dataset(path, tokenizer=folder)
    assert turns(dataset) == [thinking, off, thinking, thinking]
    assert len({tuple(_learned(dataset, i)[0]) for i in range(len(records))}) == 1  # same ids
    everywhere = load_dataset(path, tokenizer=folder, chat_template_kwargs=THINKING_OFF)
    assert turns(everywhere) == [off, off, thinking, off]
    template = chat.ChatTemplate(
        _write_tokenizer(tmp_path / "b", llama3_bpe, "{{ bos_token }}"), ""
    )
    assert template.render(plain) == BOS
    assert template.render(plain, kwargs={"bos_token": "<s>"}) == "<s>"


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        (
            "enable_thinking=false",
            r"'chat_template_kwargs' must be a dict of chat template variables \(e\.g\. "
            r'\{"enable_thinking": false\}\), got str$',
        ),
        ([["enable_thinking", False]], r"'chat_template_kwargs' must be a dict .*, got list$"),
        (
            {"tools": [WEATHER]},
            r"'chat_template_kwargs': 'tools' is not a variable it may set \(a str, none of "
            r"messages, tools, documents, add_generation_prompt: the conversation's own\)$",
        ),
    ],
)
def test_malformed_chat_template_kwargs_name_file_line_and_field(
    llama3_bpe, tmp_path, kwargs, pattern
):
    folder = _qwen_tokenizer(tmp_path / "tok", llama3_bpe, template=THINK_TEMPLATE)
    path = _jsonl(tmp_path / "bad.jsonl", [GOOD, {**GOOD, "chat_template_kwargs": kwargs}])
    with pytest.raises(ValueError, match=rf"bad\.jsonl: line 2: {pattern}") as error:
        load_dataset(path, tokenizer=folder)
    assert "\n" not in str(error.value)


def test_the_chat_template_kwargs_flags(llama3_bpe, tmp_path, capsys):
    """The trainer's --chat_template_kwargs (checked with the other settings) reaches
    the conversations it reads; the data commands' --chat-template-kwargs too; a value
    that is not a JSON object is refused in one line naming it."""
    import models
    from train.build import load_rows
    from train.config import parse_args

    folder = _qwen_tokenizer(tmp_path / "tok", llama3_bpe, template=THINK_TEMPLATE)
    plain = [QUESTION, {"role": "assistant", "content": "Paris."}]
    path = _jsonl(tmp_path / "k.jsonl", [{"messages": plain}] * 4)
    argv = ["--data_path", str(path), "--tokenizer_name_or_path", str(folder)]
    argv += ["--model_max_length", "16", "--packing", "whole"]
    learned = []
    for extra in ([], ["--chat_template_kwargs", json.dumps(THINKING_OFF)]):
        rows = load_rows(parse_args([*argv, *extra]), models.TINY)
        learned.append(int((rows.labels != IGNORE).sum()))
    assert learned[0] > learned[1] > 0
    for bad, why in (("{enable_thinking: false}", "is not JSON"), ("[]", "must be a dict")):
        with pytest.raises(ValueError, match=rf"^--chat_template_kwargs='{re.escape(bad)}' {why}"):
            parse_args([*argv, "--chat_template_kwargs", bad])
    data_main(["inspect", str(path), "--tokenizer", str(folder)])
    data_main(
        ["inspect", str(path), "--tokenizer", str(folder)]
        + ["--chat-template-kwargs", json.dumps(THINKING_OFF)]
    )
    counts = [
        int(line.split(": ")[1])
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("labelled_tokens")
    ]
    assert counts[0] > counts[1] > 0
    with pytest.raises(SystemExit):
        data_main(["inspect", str(path), "--tokenizer", str(folder), "--chat-template-kwargs", "1"])
    assert capsys.readouterr().err == (
        "error: --chat-template-kwargs='1' must be a dict of chat template variables (e.g. "
        '{"enable_thinking": false}), got int\n'
    )


def test_the_token_cache_records_the_chat_template_kwargs(llama3_bpe, tmp_path, capsys):
    """A token cache records the template variables given to every conversation: built
    with other ones it is stale (rebuilt under --data_cache_dir, refused as
    --data_path with the command that rebuilds it); a record's own are in the source,
    whose change rebuilds it too."""
    folder = _qwen_tokenizer(tmp_path / "tok", llama3_bpe, template=THINK_TEMPLATE)
    plain = [QUESTION, {"role": "assistant", "content": "Paris."}]
    path = _jsonl(tmp_path / "k.jsonl", [{"messages": plain}])
    eos = load_tokenizer(folder).token_to_id(IM_END)
    where = tmp_path / "c"
    cache, built = data_cache.ensure_cache(
        path, where, tokenizer=folder, eos_id=eos, chat_template_kwargs=THINKING_OFF
    )
    assert built and cache.meta["chat_template"]["kwargs"] == THINKING_OFF
    assert (
        cache.mismatch(path, tokenizer=folder, eos_id=eos, chat_template_kwargs=THINKING_OFF) == []
    )
    assert cache.mismatch(path, tokenizer=folder, eos_id=eos) == [
        'its conversations were rendered with chat_template_kwargs {"enable_thinking": false}, '
        "not {}"
    ]
    with pytest.raises(ValueError) as error:
        data_cache.packed_rows(
            where, 8, tokenizer=folder, eos_id=eos, chat_template_kwargs={"x": 1}
        )
    assert str(error.value).endswith(
        f"--eos-id {eos} --tokenizer {folder} --chat-template-kwargs '{{\"x\": 1}}'"
    )
    _, built = data_cache.ensure_cache(path, where, tokenizer=folder, eos_id=eos)
    assert built and "chat_template_kwargs" in capsys.readouterr().out
    _jsonl(path, [{"messages": plain, "chat_template_kwargs": THINKING_OFF}])
    cache, built = data_cache.ensure_cache(path, where, tokenizer=folder, eos_id=eos)
    memory = load_dataset(path, tokenizer=folder)
    # The conversation ends on <|im_end|>, the EOS: the cache packs none after it.
    assert built and np.asarray(cache.targets).tolist() == memory.targets.tolist()


def test_a_tables_conversation_columns():
    """A table's tools and chat_template_kwargs columns are read beside its messages, or
    its prompt and completion."""
    names = ["chat_template_kwargs", "messages", "tools", "id"]
    assert readers._columns(Path("t"), names) == ["messages", "tools", "chat_template_kwargs"]
    names = ["prompt", "completion", "chat_template_kwargs"]
    assert readers._columns(Path("t"), names) == ["prompt", "completion", "chat_template_kwargs"]


@pytest.mark.slow
def test_chat_template_kwargs_match_transformers_apply_chat_template(llama3_bpe, tmp_path):
    """transformers' ``apply_chat_template(messages, **chat_template_kwargs)`` gives the
    ids of records with chat_template_kwargs (Llama-3.1's date_string and
    tools_in_user_message, with its assistant mask; enable_thinking; a special token
    overridden). Skipped without the oracle."""
    llama = _write_tokenizer(tmp_path / "llama", llama3_bpe, template=LLAMA31_TEMPLATE)
    think = _qwen_tokenizer(tmp_path / "think", llama3_bpe, template=THINK_TEMPLATE)
    dated = {"date_string": "01 Jan 2025", "tools_in_user_message": False}
    plain = [QUESTION, {"role": "assistant", "content": "Paris."}]
    cases = [
        (llama, {"messages": TOOL_CHAT, "tools": [WEATHER], "chat_template_kwargs": dated}, None),
        (llama, {"messages": CONVERSATIONS[0], "chat_template_kwargs": dated}, None),
        (llama, {"messages": CONVERSATIONS[1], "chat_template_kwargs": {"bos_token": ""}}, None),
        (think, {"messages": plain, "chat_template_kwargs": THINKING_OFF}, None),
    ]
    cases = [(f, r, _mark_llama31(LLAMA31_TEMPLATE) if f == llama else m) for f, r, m in cases]
    _match_the_oracle(tmp_path, cases)


# ---------------------------------------------------------------------------------------
# Templates that rewrite earlier turns: one example per assistant turn (chat_turns)
# ---------------------------------------------------------------------------------------

# Qwen3's chat template (Qwen3-8B's tokenizer_config.json): an assistant turn's <think>
# block (its reasoning, or an empty one) written only after the last user query.
QWEN3_TEMPLATE = (TEMPLATES / "qwen3.jinja").read_text()
# Two questions and a thanks, each answer reasoned but the last.
REASONED_CHAT = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris.", "reasoning_content": "France's capital is Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome.", "reasoning_content": "Italy's capital is Rome."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You're welcome."},
]
# Qwen3's rendering of REASONED_CHAT through each assistant turn, written out by hand:
# (the text before the turn, ending with the generation prompt; the turn). An earlier
# turn has lost its <think> block; the last one has it, empty where it has no reasoning.
_HEAD = f"{IM_START}system\nYou answer briefly.{IM_END}\n{IM_START}user\nCapital of France?"
_ITALY = f"{IM_END}\n{IM_START}user\nAnd of Italy?{IM_END}\n{IM_START}assistant\n"
_THANKS = f"{IM_END}\n{IM_START}user\nThanks!{IM_END}\n{IM_START}assistant\n"
REASONED_TURNS = [
    (
        f"{_HEAD}{IM_END}\n{IM_START}assistant\n",
        f"<think>\nFrance's capital is Paris.\n</think>\n\nParis.{IM_END}\n",
    ),
    (
        f"{_HEAD}{IM_END}\n{IM_START}assistant\nParis.{_ITALY}",
        f"<think>\nItaly's capital is Rome.\n</think>\n\nRome.{IM_END}\n",
    ),
    (
        f"{_HEAD}{IM_END}\n{IM_START}assistant\nParis.{_ITALY}Rome.{_THANKS}",
        f"<think>\n\n</think>\n\nYou're welcome.{IM_END}\n",
    ),
]


def _split_line(path, conversations: int, examples: int, turns: str = "auto") -> str:
    why = ": their chat template rewrites earlier turns" if turns == "auto" else ""
    return (
        f"{path}: split {conversations} conversation{'s' * (conversations != 1)} into "
        f"{examples} example{'s' * (examples != 1)}, one per assistant turn, each the "
        f"conversation rendered through its turn (chat_turns {turns}{why})"
    )


def _decoded_turns(tokenizer, dataset) -> list[str]:
    """Each example's learned tokens, decoded (special tokens kept)."""
    return [
        tokenizer.decode(
            [t for t, label in zip(*_learned(dataset, i), strict=True) if label != IGNORE],
            skip_special_tokens=False,
        )
        for i in range(dataset.num_examples)
    ]


def test_a_template_that_drops_earlier_reasoning_splits_the_conversation(
    llama3_bpe, tmp_path, capsys
):
    """Qwen3's template drops the reasoning of the turns before the last question, so
    the whole rendering breaks the prefix rule: by default the conversation is one
    example per assistant turn, example i the template's rendering of the messages
    through turn i (its reasoning kept, as at inference), turn i learned and nothing
    else; the examples keep the record's line, and the log counts them. A conversation
    of one question (the rule holds) is one example."""
    folder = _qwen_tokenizer(tmp_path / "tok", llama3_bpe, template=QWEN3_TEMPLATE)
    path = _jsonl(
        tmp_path / "r.jsonl", [{"messages": REASONED_CHAT[:3]}, {"messages": REASONED_CHAT}]
    )
    dataset = load_dataset(path, tokenizer=folder)
    assert capsys.readouterr().out == _split_line(path, 1, 3) + "\n"
    assert dataset.num_examples == 4 and list(dataset.lines) == [1, 2, 2, 2]
    tokenizer = load_tokenizer(folder)
    for i, (before, turn) in enumerate([REASONED_TURNS[0], *REASONED_TURNS]):
        ids, labels = _learned(dataset, i)
        # Each example ends on its EOS, <|im_end|> (the newline after it dropped).
        assert ids == tokenizer.encode((before + turn).rstrip("\n"), add_special_tokens=False).ids
        n = len(tokenizer.encode(before, add_special_tokens=False).ids)
        assert set(labels[:n]) == {IGNORE} and IGNORE not in labels[n:]
    assert _decoded_turns(tokenizer, dataset) == [REASONED_TURNS[0][1].rstrip("\n")] + [
        turn.rstrip("\n") for _, turn in REASONED_TURNS
    ]
    template = chat.ChatTemplate(folder, "where:")
    for (before, turn), i in zip(REASONED_TURNS, (2, 4, 6), strict=True):
        assert template.render(REASONED_CHAT[: i + 1]) == before + turn  # the template's own
        assert template.render(REASONED_CHAT[:i], add_generation_prompt=True) == before
    assert "France's capital" not in template.render(REASONED_CHAT)  # the whole drops it


# A template that shortens every assistant turn but the last (the prefix rule's second
# half does not hold), and one whose generation prompt does not begin the turn (its
# first half does not: no split tells the turn apart).
SHORTENING_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}[answer]\n"
    "{% else %}{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
MISPROMPTING_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<answer>{% endif %}"
)


def test_chat_turns_whole_refuses_such_a_conversation_naming_the_flag(llama3_bpe, tmp_path, capsys):
    """With chat_turns whole a conversation whose template rewrites its earlier turns is
    refused in one line naming the flag that learns it (the trainer's --chat_turns, the
    data commands' --chat-turns); auto and split learn it. A turn that its generation
    prompt does not begin is refused whatever the setting, naming no flag."""
    from train.config import parse_args

    why = (
        "'messages': the chat template (tokenizer_config.json) renders the messages through "
        "assistant turn {turn} (message {message}) as text that does not begin the whole "
        "conversation's rendering, so the turn's text cannot be told apart (a template that "
        "rewrites earlier turns); {flag} auto (or split) learns such a conversation as one "
        "example per assistant turn, each the conversation rendered through that turn as "
        "the model sees it at inference"
    )
    qwen = _qwen_tokenizer(tmp_path / "qwen", llama3_bpe, template=QWEN3_TEMPLATE)
    path = _jsonl(
        tmp_path / "r.jsonl", [{"messages": REASONED_CHAT[:3]}, {"messages": REASONED_CHAT}]
    )
    with pytest.raises(ValueError) as error:
        load_dataset(path, tokenizer=qwen, chat_turns="whole")
    assert str(error.value) == f"{path}: line 2: " + why.format(
        turn=1, message=2, flag="--chat_turns"
    )
    with pytest.raises(SystemExit):
        data_main(["inspect", str(path), "--tokenizer", str(qwen), "--chat-turns", "whole"])
    assert capsys.readouterr().err == (
        f"error: {path}: line 2: {why.format(turn=1, message=2, flag='--chat-turns')}\n"
    )
    argv = ["--data_path", str(path), "--tokenizer_name_or_path", str(qwen)]
    assert parse_args(argv).data.chat_turns == "auto"
    with pytest.raises(ValueError, match=r"^--chat_turns='all' must be one of \('auto', "):
        parse_args([*argv, "--chat_turns", "all"])
    shortening = _write_tokenizer(tmp_path / "short", llama3_bpe, template=SHORTENING_TEMPLATE)
    messages = [*GOOD["messages"], *GOOD["messages"]]
    path = _jsonl(tmp_path / "s.jsonl", [{"messages": messages}])
    with pytest.raises(ValueError) as error:
        load_dataset(path, tokenizer=shortening, chat_turns="whole")
    assert str(error.value) == f"{path}: line 1: " + why.format(
        turn=1, message=1, flag="--chat_turns"
    )
    tokenizer = load_tokenizer(shortening)
    for turns in ("auto", "split"):
        dataset = load_dataset(path, tokenizer=shortening, chat_turns=turns)
        assert [t.strip() for t in _decoded_turns(tokenizer, dataset)] == [
            messages[1]["content"],
            messages[3]["content"],
        ]
    misprompting = _write_tokenizer(tmp_path / "mis", llama3_bpe, template=MISPROMPTING_TEMPLATE)
    for turns in chat.CHAT_TURNS:
        with pytest.raises(ValueError) as error:
            load_dataset(path, tokenizer=misprompting, chat_turns=turns)
        assert str(error.value).endswith(
            "renders the messages before assistant turn 1 (message 1) with its generation "
            "prompt as text that does not begin its rendering through that turn, so the "
            "turn's text cannot be told apart (a template that rewrites earlier turns)"
        )
        assert "--chat_turns" not in str(error.value)


def test_conversations_that_keep_the_prefix_rule_are_one_example_unless_split(
    llama3_bpe, tmp_path, capsys
):
    """A conversation the prefix rule holds for is one example under auto (the
    default) and whole alike, and nothing is said; split makes it one example per
    assistant turn, the template's rendering of the messages through it, learning that
    turn: together the examples learn the whole example's turns."""
    folder = _write_tokenizer(tmp_path / "tok", llama3_bpe, template=LLAMA31_TEMPLATE)
    records = [{"messages": c} for c in CONVERSATIONS]
    records.append({"messages": TOOL_CHAT, "tools": [WEATHER]})
    path = _jsonl(tmp_path / "c.jsonl", records)
    auto = load_dataset(path, tokenizer=folder)
    whole = load_dataset(path, tokenizer=folder, chat_turns="whole")
    for field in ("tokens", "targets", "offsets", "lines"):
        np.testing.assert_array_equal(getattr(auto, field), getattr(whole, field))
    assert auto.num_examples == 3 and capsys.readouterr().out == ""
    split = load_dataset(path, tokenizer=folder, chat_turns="split")
    assert capsys.readouterr().out == _split_line(path, 3, 7, "split") + "\n"
    assert list(split.lines) == [1, 1, 2, 3, 3, 3, 3]
    tokenizer = load_tokenizer(folder)
    template = chat.ChatTemplate(folder, "where:")
    parser = RecordParser(path, folder)
    learned, k = _decoded_turns(tokenizer, split), 0
    for n, record in enumerate(records):
        messages = parser._messages("line 1", record["messages"])
        for i in [i for i, m in enumerate(messages) if m["role"] == "assistant"]:
            text = template.render(messages[: i + 1], tools=record.get("tools"))
            assert split.example(k).tolist() == tokenizer.encode(text, add_special_tokens=False).ids
            k += 1
        turns = sum(m["role"] == "assistant" for m in messages)
        assert "".join(learned[k - turns : k]) == _decoded_turns(tokenizer, whole)[n]


def test_a_prompts_rewritten_turn_is_context(llama3_bpe, tmp_path, capsys):
    """A conversational prompt-completion record learns its completion's turns only, so
    only those keep the prefix rule: an assistant turn of the prompt that Qwen3's
    template rewrites (its reasoning dropped, as at inference) is context, and the
    record is one example under every setting."""
    folder = _qwen_tokenizer(tmp_path / "tok", llama3_bpe, template=QWEN3_TEMPLATE)
    record = {"prompt": REASONED_CHAT[:4], "completion": [REASONED_CHAT[4]]}
    path = _jsonl(tmp_path / "pc.jsonl", [record])
    tokenizer = load_tokenizer(folder)
    before, turn = REASONED_TURNS[1]
    for turns in (None, "auto", "whole", "split"):
        given = {} if turns is None else {"chat_turns": turns}  # the default first
        dataset = load_dataset(path, tokenizer=folder, **given)
        assert dataset.num_examples == 1
        assert dataset.example(0).tolist() == tokenizer.encode((before + turn).rstrip("\n")).ids
        assert _decoded_turns(tokenizer, dataset) == [turn.rstrip("\n")]
    assert capsys.readouterr().out == _split_line(path, 1, 1, "split") + "\n"


def test_the_token_cache_records_chat_turns(llama3_bpe, tmp_path, capsys):
    """A token cache records chat_turns and how many conversations it split, and holds
    the in-memory examples: read with another setting it is stale (rebuilt under
    --data_cache_dir, refused as --data_path with the command that rebuilds it), but
    auto and whole build the same cache where auto split none (one from before the
    setting, read whole, is kept); read as it is, it says in a line what it split."""
    qwen = _qwen_tokenizer(tmp_path / "tok", llama3_bpe, template=QWEN3_TEMPLATE)
    path = _jsonl(
        tmp_path / "r.jsonl", [{"messages": REASONED_CHAT[:3]}, {"messages": REASONED_CHAT}]
    )
    eos = load_tokenizer(qwen).token_to_id(IM_END)
    where = tmp_path / "c"
    cache, built = data_cache.ensure_cache(path, where, tokenizer=qwen, eos_id=eos)
    assert built and capsys.readouterr().out == _split_line(path, 1, 3) + "\n"
    recorded = cache.meta["chat_template"]
    assert (recorded["turns"], recorded["split_conversations"], recorded["split_examples"]) == (
        "auto",
        1,
        3,
    )
    stream = load_dataset(path, tokenizer=qwen).packed_stream(eos)
    for got, want in zip((cache.tokens, cache.targets, cache.offsets), stream, strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
    capsys.readouterr()
    assert cache.mismatch(path, tokenizer=qwen, eos_id=eos) == []
    for turns in ("whole", "split"):
        assert cache.mismatch(path, tokenizer=qwen, eos_id=eos, chat_turns=turns) == [
            f"its conversations were read with chat_turns auto (1 of them split), not {turns}"
        ]
    data_cache.packed_rows(where, 16, tokenizer=qwen, eos_id=eos)
    assert capsys.readouterr().out.startswith(
        _split_line(where, 1, 3).replace(f"{where}: ", f"{where}: token cache: ") + "\n"
    )
    with pytest.raises(ValueError) as error:
        data_cache.packed_rows(where, 16, tokenizer=qwen, eos_id=eos, chat_turns="split")
    assert str(error.value).endswith(
        f"{where} --eos-id {eos} --tokenizer {qwen} --chat-turns split"
    )
    cache, built = data_cache.ensure_cache(
        path, where, tokenizer=qwen, eos_id=eos, chat_turns="split"
    )
    assert built and "(its conversations were read with chat_turns auto" in capsys.readouterr().out
    assert cache.meta["chat_template"]["turns"] == "split"
    with pytest.raises(ValueError, match=r"line 2: .* --chat_turns auto \(or split\) learns"):
        data_cache.ensure_cache(path, where, tokenizer=qwen, eos_id=eos, chat_turns="whole")
    assert data_cache.open_cache(where).meta["chat_template"]["turns"] == "split"  # kept
    # Conversations the prefix rule holds for: auto and whole build the same cache.
    plain = _jsonl(tmp_path / "l.jsonl", [{"messages": c} for c in CONVERSATIONS])
    eot = load_tokenizer(llama3_bpe).token_to_id(EOT)
    where = tmp_path / "l"
    cache, built = data_cache.ensure_cache(plain, where, tokenizer=llama3_bpe, eos_id=eot)
    assert built and cache.meta["chat_template"]["split_conversations"] == 0
    for turns, rebuilt in (("whole", False), ("auto", False), ("split", True)):
        _, built = data_cache.ensure_cache(
            plain, where, tokenizer=llama3_bpe, eos_id=eot, chat_turns=turns
        )
        assert built == rebuilt, turns
    cache, _ = data_cache.ensure_cache(plain, where, tokenizer=llama3_bpe, eos_id=eot)
    meta_file = where / "meta.json"
    meta = json.loads(meta_file.read_text())
    for key in ("turns", "split_conversations", "split_examples"):
        del meta["chat_template"][key]  # as a cache from before the setting
    meta_file.write_text(json.dumps(meta))
    old = data_cache.open_cache(where)
    assert old.mismatch(plain, tokenizer=llama3_bpe, eos_id=eot) == []
    assert old.mismatch(plain, tokenizer=llama3_bpe, eos_id=eot, chat_turns="split") == [
        "its conversations were read with chat_turns whole, not split"
    ]


def test_inspect_and_cache_say_what_they_split(llama3_bpe, tmp_path, capsys):
    """`train.data inspect` counts the split examples as examples, with the line that
    says how many conversations gave them, of a data file and of its token cache alike;
    `cache` says it again when the cache is up to date."""
    qwen = _qwen_tokenizer(tmp_path / "tok", llama3_bpe, template=QWEN3_TEMPLATE)
    path = _jsonl(
        tmp_path / "r.jsonl", [{"messages": REASONED_CHAT[:3]}, {"messages": REASONED_CHAT}]
    )
    data_main(["inspect", str(path), "--tokenizer", str(qwen)])
    first, *counts = capsys.readouterr().out.splitlines()
    assert first == _split_line(path, 1, 3)
    assert dict(line.split(": ") for line in counts)["examples"] == "4"
    where = tmp_path / "c"
    data_main(["cache", str(path), str(where), "--tokenizer", str(qwen)])
    assert capsys.readouterr().out.splitlines()[0] == _split_line(path, 1, 3)
    data_main(["inspect", str(where)])
    cached_first, *cached = capsys.readouterr().out.splitlines()
    assert cached_first == _split_line(where, 1, 3) and cached == counts
    data_main(["cache", str(path), str(where), "--tokenizer", str(qwen)])
    assert capsys.readouterr().out.splitlines()[1] == _split_line(where, 1, 3)
    data_main(["inspect", str(path), "--tokenizer", str(qwen), "--chat-turns", "split"])
    assert capsys.readouterr().out.splitlines()[0] == _split_line(path, 2, 4, "split")


def test_the_trainer_learns_a_qwen3_conversation_turn_by_turn(llama3_bpe, tmp_path, capsys):
    """`python -m train` on multi-turn Qwen3 conversations with reasoning, by default:
    two steps of the tiny model, the loss finite, the log saying how many conversations
    it split into how many examples."""
    folder = _qwen_tokenizer(tmp_path / "tok", llama3_bpe, template=QWEN3_TEMPLATE)
    path = _jsonl(tmp_path / "r.jsonl", [{"messages": REASONED_CHAT}] * 8)
    steps = _two_steps(path, folder, 128, tmp_path / "out")
    assert [r["step"] for r in steps] == [1, 2] and all(np.isfinite(r["loss"]) for r in steps)
    assert _split_line(path, 8, 24) in capsys.readouterr().out


ORACLE_TURNS = """
import json, sys
from transformers import AutoTokenizer
cases = json.loads(open(sys.argv[1]).read())
out = []
for case in cases:
    tokenizer = AutoTokenizer.from_pretrained(case["folder"])
    messages, tools = case["messages"], case["tools"]
    ids = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True,
                                        return_dict=True)["input_ids"]
    prompt = tokenizer.apply_chat_template(messages[:-1], tools=tools, tokenize=True,
                                           return_dict=True, add_generation_prompt=True)
    out.append({"ids": list(ids), "prompt": list(prompt["input_ids"])})
print(json.dumps(out))
"""

# A Qwen3 tool-use conversation, reasoned: in the whole rendering the first question's
# turns lose their reasoning; rendered through the answer to it, the call keeps its
# own (after the last question, and reasoned).
QWEN3_TOOL_CHAT = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "I should ask the weather tool.",
        "tool_calls": [_call("get_weather", {"city": "Paris"})],
    },
    {"role": "tool", "name": "get_weather", "content": '{"temperature": 21}'},
    {"role": "assistant", "content": "21 degrees.", "reasoning_content": "The tool says 21."},
    {"role": "user", "content": "And in Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [_call("get_weather", {"city": "Oslo"})]},
    {"role": "tool", "name": "get_weather", "content": '{"temperature": 4}'},
    {"role": "assistant", "content": "4 degrees."},
]


@pytest.mark.slow
def test_split_examples_match_transformers_apply_chat_template(llama3_bpe, tmp_path):
    """transformers' ``apply_chat_template`` of the messages through each assistant turn
    gives each split example's ids (Qwen3's template, reasoned turns, tool calls and
    results), and the tokens after its rendering of the messages before the turn with
    the generation prompt are the example's learned ones. Skipped without the oracle."""
    folder = _qwen_tokenizer(tmp_path / "tok", llama3_bpe, template=QWEN3_TEMPLATE)
    records = [
        {"messages": REASONED_CHAT},
        {"messages": QWEN3_TOOL_CHAT, "tools": [WEATHER]},
        {"messages": QWEN3_TOOL_CHAT},
    ]
    path = _jsonl(tmp_path / "r.jsonl", records)
    dataset = load_dataset(path, tokenizer=folder)
    parser = RecordParser(path, folder)
    cases = []
    for record in records:
        messages = parser._messages("line 1", record["messages"])
        for i in [i for i, m in enumerate(messages) if m["role"] == "assistant"]:
            cases.append({"folder": str(folder), "messages": messages[: i + 1]})
            cases[-1]["tools"] = record.get("tools")
    assert dataset.num_examples == len(cases) == 3 + 4 + 4
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    oracle = run_oracle(ORACLE_TURNS, tmp_path / "cases.json")
    for k, want in enumerate(oracle):
        ids, labels = _learned(dataset, k)
        assert ids == _through_last_eos(want["ids"], folder), k
        assert ids[-1] == load_tokenizer(folder).token_to_id(IM_END), k
        n = len(want["prompt"])
        assert ids[:n] == want["prompt"], k
        assert [label != IGNORE for label in labels] == [j >= n for j in range(len(ids))], k


def test_an_opening_assistant_message_is_context(llama3_bpe, tmp_path, capsys):
    """An assistant message that opens a conversation answers nothing: it is context, not
    learned (its prefix, no message with the generation prompt, is no rendering a
    template gives), and the log counts such conversations; one with no other turn is
    skipped. Before, the template's failure on no messages refused the whole file."""
    greeting = {"role": "assistant", "content": "Welcome to the front desk."}
    answer = {"role": "assistant", "content": "Paris."}
    path = _jsonl(
        tmp_path / "a.jsonl",
        [{"messages": [greeting, QUESTION, answer]}, {"messages": [greeting]}, GOOD],
    )
    dataset = load_dataset(path, tokenizer=llama3_bpe)
    assert capsys.readouterr().out.splitlines() == [
        f"{path}: skipped 1 record whose 'messages' have no assistant turn (no token to learn)",
        f"{path}: 2 conversations open with an assistant message: context, not learned "
        "(nothing before it to answer)",
    ]
    assert list(dataset.lines) == [1, 3]
    tokenizer = load_tokenizer(llama3_bpe)
    ids, labels = _learned(dataset, 0)
    learned = [t for t, label in zip(ids, labels, strict=True) if label != IGNORE]
    assert tokenizer.decode(learned, skip_special_tokens=False) == "Paris.<|eot_id|>"
    assert "Welcome to the front desk." in tokenizer.decode(ids, skip_special_tokens=False)


def test_what_the_template_writes_nothing_of_is_said(llama3_bpe, tmp_path, capsys):
    """Reasoning a template does not render (Llama 3's writes no reasoning_content), and
    a message of a role it skips (Qwen3's writes user, system, assistant and tool only),
    never reach the model: one line each says how many, where a template that renders
    them says nothing."""
    path = _jsonl(tmp_path / "r.jsonl", [{"messages": _reasoned("reasoning_content")}, GOOD])
    load_dataset(path, tokenizer=llama3_bpe)
    assert capsys.readouterr().out == (
        f"{path}: the chat template writes nothing of 1 assistant message's reasoning: not "
        "learned (a template that does not render reasoning_content; --chat_template gives "
        "one that does)\n"
    )
    think = _qwen_tokenizer(tmp_path / "think", llama3_bpe, template=THINK_TEMPLATE)
    load_dataset(path, tokenizer=think)
    assert capsys.readouterr().out == ""
    narrator = {"role": "narrator", "content": "The hall falls quiet."}
    roles = _jsonl(
        tmp_path / "n.jsonl",
        [{"messages": [QUESTION, narrator, {"role": "assistant", "content": "Paris."}]}],
    )
    qwen3 = _qwen_tokenizer(tmp_path / "qwen3", llama3_bpe, template=QWEN3_TEMPLATE)
    load_dataset(roles, tokenizer=qwen3)
    assert capsys.readouterr().out == (
        f"{roles}: the chat template writes nothing of some messages (1 'narrator'): their "
        "content or tool calls are in no rendering (a role it skips, or tool calls it does "
        "not write?), so the model never sees them\n"
    )
    load_dataset(roles, tokenizer=llama3_bpe)  # Llama 3's writes any role's header
    assert capsys.readouterr().out == ""
    # A template that writes no assistant turn: each conversation is skipped as such.
    skip = (
        "{% for m in messages %}{% if m.role != 'assistant' %}{{ m.content }}{% endif %}"
        "{% endfor %}"
    )
    skipping = _write_tokenizer(tmp_path / "skipping", llama3_bpe, template=skip)
    answered = _jsonl(tmp_path / "a.jsonl", [{"messages": [QUESTION, GOOD["messages"][-1]]}] * 2)
    with pytest.raises(ValueError, match="the dataset has no examples"):
        load_dataset(answered, tokenizer=skipping)
    assert capsys.readouterr().out.splitlines()[0] == (
        f"{answered}: skipped 2 records whose assistant turns render to no token (the chat "
        "template writes nothing of them?)"
    )
    # A template that writes no tool calls: the calling turn would teach an empty answer.
    plain = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</>{% endfor %}"
    no_calls = _write_tokenizer(tmp_path / "nocalls", llama3_bpe, template=plain)
    calling = [QUESTION, {"role": "assistant", "content": "", "tool_calls": [WEATHER_CALL]}]
    calls = _jsonl(tmp_path / "t.jsonl", [{"messages": calling, "tools": [WEATHER]}])
    load_dataset(calls, tokenizer=no_calls)
    assert capsys.readouterr().out == (
        f"{calls}: the chat template writes nothing of some messages (1 'assistant "
        "tool_calls', 1 'tools'): their content or tool calls are in no rendering (a role "
        "it skips, or tool calls it does not write?), so the model never sees them\n"
    )


def test_reasoning_with_thinking_off_is_named_as_the_cause(llama3_bpe, tmp_path):
    """Qwen3's template with enable_thinking false writes an empty think block as the
    generation prompt, which a turn with reasoning does not begin with: the error says
    so, not that the template rewrites earlier turns."""
    folder = _qwen_tokenizer(tmp_path / "tok", llama3_bpe, template=QWEN3_TEMPLATE)
    path = _jsonl(
        tmp_path / "r.jsonl",
        [{"messages": REASONED_CHAT[:3], "chat_template_kwargs": THINKING_OFF}],
    )
    with pytest.raises(
        ValueError, match="the turn has reasoning, which the generation prompt"
    ) as e:
        load_dataset(path, tokenizer=folder)
    assert "drop the variable or the reasoning" in str(e.value) and "\n" not in str(e.value)


def test_a_chatml_conversation_ends_on_its_eos_once(llama3_bpe, tmp_path):
    """ChatML ends each turn `<|im_end|>\\n`, and Qwen's tokenizers name `<|im_end|>` the
    EOS: a conversation is kept through its last `<|im_end|>` (the white space after it
    dropped), so packing adds no second EOS to be learned after it; a text record (no
    EOS of its own) still gets one."""
    folder = _qwen_tokenizer(tmp_path / "qwen", llama3_bpe)
    chat_records = [
        {"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Yo."}]},
        {"text": "plain words"},
    ]
    path = _jsonl(tmp_path / "c.jsonl", chat_records)
    dataset = load_dataset(path, tokenizer=folder)
    tokenizer = load_tokenizer(folder)
    eos = tokenizer.token_to_id(IM_END)
    ids, labels = _learned(dataset, 0)
    assert ids[-1] == eos and tokenizer.decode(ids[-2:], skip_special_tokens=False) == ".<|im_end|>"
    assert labels[-1] == eos  # the turn's end is learned, once
    tokens, targets, _ = dataset.packed_stream(eos)
    stream = tokenizer.decode(tokens.tolist(), skip_special_tokens=False)
    assert stream.count(IM_END + IM_END) == 0 and stream.count(IM_END + "\n" + IM_END) == 0
    assert stream.endswith("plain words" + IM_END)
    assert int(np.count_nonzero(targets == eos)) == 2  # the answer's and the text's
