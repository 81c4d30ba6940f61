"""Tests of conversational ("messages") records (train/chat.py, train/readers.py): the
chat template's rendering, assistant-only labels, errors, the token cache, the
tokenizer command, transformers' parity and a trainer run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from train import chat, data_cache, readers
from train.data import main as data_main
from train.data import train_tokenizer
from train.dataset import load_dataset

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
    tokenizer = readers.load_tokenizer(llama3_bpe)
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
        ({"messages": [{"role": "user", "content": None}]}, r"'messages'\[0\] has no 'content'"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]},
            r"'messages'\[0\]: 'content' must be a str, got list$",
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
        "or write the conversations as 'prompt' / 'completion' records"
    )
    with pytest.raises(ValueError, match=r"line 2: has 'messages' but no tokenizer was given"):
        load_dataset(path)


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
    tokenizer = readers.load_tokenizer(folder)
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
        (  # earlier assistant turns shortened: the prefix rule does not hold
            "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}[answer]"
            "{% else %}{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}",
            r"line 2: 'messages': the chat template \(tokenizer_config\.json\) renders the "
            r"messages through assistant turn 1 \(message 1\) as text that does not begin the "
            r"whole conversation's rendering",
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
        bad = {"messages": [{"role": "assistant", "content": "a"}]}
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
    tokenizer = readers.load_tokenizer(llama3_bpe)
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
    eot = readers.load_tokenizer(folder).token_to_id(EOT)
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


def _oracle_python() -> str | None:
    """The parity oracle's interpreter (as tests/test_models_parity.py finds it), or None
    where it is absent."""
    exe = os.environ.get("JFLASH_ORACLE_PYTHON") or str(REPO / ".venv-oracle" / "bin" / "python")
    return exe if os.path.isfile(exe) or not os.path.isabs(exe) else None


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
    exe = _oracle_python()
    if exe is None:
        pytest.skip("no HF oracle interpreter (make oracle, or JFLASH_ORACLE_PYTHON)")
    probe = subprocess.run([exe, "-c", "import transformers, jinja2"], capture_output=True)
    if probe.returncode:
        pytest.skip(f"the oracle interpreter {exe} lacks transformers or jinja2")
    marked = LLAMA3_TEMPLATE.replace(  # the assistant's content and end of turn marked
        "{{ content }}",
        "{% if message['role'] == 'assistant' %}{{ content.split('\\n\\n', 1)[0] + '\\n\\n' }}"
        "{% generation %}{{ content.split('\\n\\n', 1)[1] }}{% endgeneration %}"
        "{% else %}{{ content }}{% endif %}",
    )
    conversations = [*CONVERSATIONS, [{"role": "user", "content": "Tab\tand  spaces"}]]
    conversations[-1].append({"role": "assistant", "content": "  ok  "})
    (tmp_path / "c.json").write_text(json.dumps(conversations))
    result = subprocess.run(
        [exe, "-c", ORACLE_CHAT, str(llama3_bpe), str(tmp_path / "c.json"), marked],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    oracle = json.loads(result.stdout.strip().splitlines()[-1])
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in conversations])
    dataset = load_dataset(path, tokenizer=llama3_bpe)
    for i in range(len(conversations)):
        ids, targets = (
            dataset.example(i),
            dataset.targets[dataset.offsets[i] : dataset.offsets[i + 1]],
        )
        assert ids.tolist() == oracle["ids"][i]
        assert (targets != IGNORE).astype(int).tolist() == oracle["masks"][i]


def test_the_trainer_learns_the_assistant_turns(llama3_bpe, tmp_path, capsys):
    """`python -m train` on conversations: two steps of the tiny model, rows packed whole,
    the loss finite and averaged over the assistant tokens only (and their EOS)."""
    from train.config import parse_args
    from train.loop import run

    conversations = [
        [
            {"role": "user", "content": f"What is {i} plus {i}?"},
            {"role": "assistant", "content": f"It is {2 * i}."},
        ]
        for i in range(48)
    ]
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in conversations])
    out = tmp_path / "out"
    argv = ["--model_name_or_path", "tiny", "--data_path", str(path), "--progress", "false"]
    argv += ["--tokenizer_name_or_path", str(llama3_bpe), "--model_max_length", "64"]
    argv += ["--packing", "whole", "--max_steps", "2", "--logging_steps", "1"]
    argv += ["--mesh", "data=-1", "--per_device_train_batch_size", "1"]
    run(parse_args([*argv, "--output_dir", str(out)]))
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(np.isfinite(r["loss"]) for r in steps)
    # 8 rows of 64 tokens a step, a third or less of each conversation learned.
    dataset = load_dataset(path, tokenizer=llama3_bpe)
    assert (dataset.targets != IGNORE).sum() < dataset.num_tokens / 3
    assert all(0 < r["labelled_tokens"] < 8 * 64 / 3 for r in steps)
