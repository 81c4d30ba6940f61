"""A chat template given in place of the tokenizer's (`--chat_template`, train/chat.py):
a base model's tokenizer, which has none, learns conversations with it; it wins over a
tokenizer's own; bad values are refused in one line before anything is written; the
token cache rebuilds when its text changes; the HF exports carry it alone, and
transformers renders with it what the trainer rendered."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import run_oracle

from train import chat, data_cache
from train.__main__ import main
from train.config import parse_args
from train.data import main as data_main
from train.data import train_tokenizer
from train.dataset import load_dataset
from train.loop import run
from train.records import load_tokenizer
from train.tools import export

pytest.importorskip("jinja2")

REPO = Path(__file__).resolve().parents[1]
IGNORE = -100
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# A ChatML template, as a user writes one for a base model's tokenizer.
CHATML = (
    "{{ bos_token }}{% for m in messages %}" + IM_START + "{{ m['role'] }}\n"
    "{{ m['content'] }}" + IM_END + "\n{% endfor %}"
    "{% if add_generation_prompt %}" + IM_START + "assistant\n{% endif %}"
)
# Another template, the tokenizer's own where it has one.
PLAIN = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
CONVERSATION = [
    {"role": "user", "content": "How are documents packed?"},
    {"role": "assistant", "content": "Back to back, with an EOS after each."},
]


@pytest.fixture(scope="module")
def base_tokenizer(tmp_path_factory) -> Path:
    """A base model's tokenizer directory: a byte-level BPE with ChatML's special tokens
    and no chat template (tokenizer_config.json names only its BOS and EOS)."""
    pytest.importorskip("tokenizers")
    folder = tmp_path_factory.mktemp("base")
    (folder / "corpus.txt").write_text((REPO / "docs" / "trainer.md").read_text())
    train_tokenizer(
        [folder / "corpus.txt"], folder / "tok", vocab_size=300, special_tokens=[IM_START, IM_END]
    )
    assert chat.read_chat_template(folder / "tok") is None
    return folder / "tok"


def _jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _template(path: Path, text: str = CHATML) -> Path:
    path.write_text(text)
    return path


def _chats(tmp_path: Path, n: int = 48) -> Path:
    conversations = [
        [
            {"role": "user", "content": f"What is {i} plus {i}?"},
            {"role": "assistant", "content": f"It is {2 * i}."},
        ]
        for i in range(n)
    ]
    return _jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in conversations])


def _argv(data: Path, tokenizer: Path, out: Path, *extra: str) -> list[str]:
    """Two steps of the tiny model on `data`, rows of 64 tokens packed whole, saving
    each step."""
    return [
        *("--model_name_or_path", "tiny", "--data_path", str(data)),
        *("--tokenizer_name_or_path", str(tokenizer), "--model_max_length", "64"),
        *("--packing", "whole", "--max_steps", "2", "--save_steps", "1"),
        *("--mesh", "data=-1", "--per_device_train_batch_size", "1", "--attention", "xla"),
        *("--report_to", "none", "--progress", "false", "--output_dir", str(out), *extra),
    ]


def _template_files(folder: Path) -> list[str]:
    """The chat template files of a tokenizer directory, and whether its
    tokenizer_config.json holds one."""
    files = sorted(
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*.jinja")
        if chat.is_template_file(p.relative_to(folder).as_posix())
    )
    config = folder / "tokenizer_config.json"
    if config.is_file() and "chat_template" in json.loads(config.read_text()):
        files.append("tokenizer_config.json: chat_template")
    return files


# ---------------------------------------------------------------------------------------
# Rendering with the given template
# ---------------------------------------------------------------------------------------


def test_a_base_tokenizer_learns_conversations_with_the_given_template(
    base_tokenizer, tmp_path, capsys
):
    """A tokenizer without a chat template: conversations are refused naming the flag
    that gives one; with `--chat_template file.jinja` the trainer learns them (the
    assistant turns only), records the template in its settings, and its HF export
    carries it as chat_template.jinja and tokenizer_config.json's chat_template, the
    only template there."""
    data = _chats(tmp_path)
    template = _template(tmp_path / "chatml.jinja")
    assert main(_argv(data, base_tokenizer, tmp_path / "none")) == 2
    err = capsys.readouterr().err
    assert "has no chat_template" in err and "--chat_template FILE" in err, err
    assert not (tmp_path / "none").exists()

    out = tmp_path / "out"
    summary = run(parse_args(_argv(data, base_tokenizer, out, "--chat_template", str(template))))
    assert len(summary["losses"]) == 2 and all(np.isfinite(summary["losses"]))
    dataset = load_dataset(data, tokenizer=base_tokenizer, chat_template=template)
    assert 0 < (dataset.targets != IGNORE).sum() < dataset.num_tokens / 3
    settings = yaml.safe_load((out / "train_config.yaml").read_text())
    assert settings["data"]["chat_template"] == str(template.resolve())
    assert parse_args(["--config", str(out / "train_config.yaml")]).data.chat_template == str(
        template.resolve()
    )
    assert (out / "hf" / "chat_template.jinja").read_text() == CHATML
    both = ["chat_template.jinja", "tokenizer_config.json: chat_template"]
    assert _template_files(out / "hf") == both
    assert json.loads((out / "hf" / "tokenizer_config.json").read_text())["chat_template"] == CHATML
    assert (out / "hf" / "tokenizer.json").read_bytes() == (
        base_tokenizer / "tokenizer.json"
    ).read_bytes()


def test_the_given_template_wins_over_the_tokenizers_own(base_tokenizer, tmp_path):
    """A tokenizer with its own template: the given file renders the conversations (its
    ids, not the tokenizer's template's), as does a directory's template, which is read
    as a tokenizer directory's (chat_template.jinja before tokenizer_config.json)."""
    own = _tokenizer_with(tmp_path / "own", base_tokenizer, PLAIN)
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    tokenizer = load_tokenizer(own)
    bos = json.loads((own / "tokenizer_config.json").read_text())["bos_token"]
    chatml = bos + "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in CONVERSATION)
    plain = "".join(f"{m['role']}: {m['content']}\n" for m in CONVERSATION)
    want = {text: tokenizer.encode(text, add_special_tokens=False).ids for text in (chatml, plain)}
    assert want[chatml] != want[plain]
    assert load_dataset(path, tokenizer=own).example(0).tolist() == want[plain]

    folder = tmp_path / "templates"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": PLAIN}))
    (folder / "chat_template.jinja").write_text(CHATML)  # wins, as transformers reads it
    for given in (_template(tmp_path / "chatml.jinja"), folder):
        dataset = load_dataset(path, tokenizer=own, chat_template=given)
        ids = dataset.example(0).tolist()
        assert ids == want[chatml], given
        learned = [t for t, label in zip(ids, dataset.targets, strict=True) if label != IGNORE]
        assert tokenizer.decode(learned, skip_special_tokens=False) == (
            f"{CONVERSATION[1]['content']}{IM_END}\n"
        )


def _tokenizer_with(folder: Path, base: Path, template: str, named: dict | None = None) -> Path:
    """A copy of tokenizer directory ``base`` with ``template`` as its chat_template (in
    tokenizer_config.json), and ``named`` templates in additional_chat_templates/ (with
    the default in chat_template.jinja) where given."""
    folder.mkdir(parents=True)
    for name in ("tokenizer.json", "special_tokens_map.json"):
        (folder / name).write_bytes((base / name).read_bytes())
    config = json.loads((base / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    if named:
        (folder / "chat_template.jinja").write_text(template)
        (folder / "additional_chat_templates").mkdir()
        for name, text in named.items():
            (folder / "additional_chat_templates" / f"{name}.jinja").write_text(text)
    return folder


# ---------------------------------------------------------------------------------------
# Bad values: one line naming the flag and the value, before anything is written
# ---------------------------------------------------------------------------------------

BAD_TEMPLATES = [
    ("missing.jinja", None, "no such file or directory"),
    ("empty_dir", "dir", "a directory without a chat template"),
    ("broken.jinja", "{% for m in messages %}{{ m['content'] }}", "does not compile"),
    ("blank.jinja", " \n", "an empty file"),
]


def _bad_template(tmp_path: Path, name: str, content: str | None) -> Path:
    path = tmp_path / name
    if content == "dir":
        path.mkdir()
        (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "x"}))
    elif content is not None:
        path.write_text(content)
    return path


@pytest.mark.parametrize(("name", "content", "why"), BAD_TEMPLATES)
def test_a_bad_chat_template_is_refused_naming_the_flag(
    base_tokenizer, tmp_path, capsys, name, content, why
):
    """A missing file, a directory without a template, a template that does not compile
    or an empty file: the trainer and the data commands refuse it in one line naming the
    flag and the value, before reading any record or writing anything."""
    given = _bad_template(tmp_path, name, content)
    data = _chats(tmp_path, 4)
    out = tmp_path / "out"
    assert main(_argv(data, base_tokenizer, out, "--chat_template", str(given))) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --chat_template={str(given)!r}: ") and why in err, err
    assert err.count("\n") == 1 and not out.exists()
    if why == "does not compile":
        assert "(line 1: " in err, err
    for command in (["inspect", str(data)], ["cache", str(data), str(tmp_path / "c")]):
        with pytest.raises(SystemExit):
            data_main([*command, "--tokenizer", str(base_tokenizer), "--chat-template", str(given)])
        err = capsys.readouterr().err
        assert err.startswith(f"error: --chat-template={str(given)!r}: ") and why in err, err
        assert err.count("\n") == 1
    assert not (tmp_path / "c").exists()


# ---------------------------------------------------------------------------------------
# The token cache
# ---------------------------------------------------------------------------------------


def test_the_token_cache_rebuilds_when_the_templates_text_changes(base_tokenizer, tmp_path, capsys):
    """A cache of conversations rendered with a given template hashes its text: the
    same file with other text (same path) makes it stale and it is rebuilt with the new
    rendering; the tokenizer's own template (here none) does not stand in for it; a
    cache directory given as the data names the flag that rebuilds it."""
    path = _chats(tmp_path, 4)
    template = _template(tmp_path / "t.jinja")
    where = tmp_path / "cache"
    eos = 0
    cache, built = data_cache.ensure_cache(
        path, where, tokenizer=base_tokenizer, eos_id=eos, chat_template=template
    )
    assert built and cache.meta["chat_template"]["path"] == str(template.resolve())
    first = np.asarray(cache.tokens).tolist()
    _, built = data_cache.ensure_cache(
        path, where, tokenizer=base_tokenizer, eos_id=eos, chat_template=template
    )
    assert not built
    capsys.readouterr()

    _template(template, CHATML.replace(IM_END + "\n", IM_END))
    assert cache.mismatch(path, tokenizer=base_tokenizer, eos_id=eos, chat_template=template) == [
        f"its conversations were rendered with another chat template ({template.resolve()})"
    ]
    with pytest.raises(ValueError) as error:
        data_cache.packed_rows(
            where, 16, tokenizer=base_tokenizer, eos_id=eos, chat_template=template
        )
    assert str(error.value).endswith(
        f"--eos-id {eos} --tokenizer {base_tokenizer} --chat-template {template}"
    )
    cache, built = data_cache.ensure_cache(
        path, where, tokenizer=base_tokenizer, eos_id=eos, chat_template=template
    )
    assert built and "another chat template" in capsys.readouterr().out
    assert np.asarray(cache.tokens).tolist() != first
    dataset = load_dataset(path, tokenizer=base_tokenizer, chat_template=template)
    assert np.asarray(cache.tokens).tolist() == dataset.packed_stream(eos)[0].tolist()
    with pytest.raises(ValueError, match="no chat_template in tokenizer_config.json"):
        data_cache.ensure_cache(path, where, tokenizer=base_tokenizer, eos_id=eos)


def test_inspect_of_a_cache_refuses_a_template_it_was_not_built_with(
    base_tokenizer, tmp_path, capsys
):
    """`train.data inspect CACHE` counts the cache, not the flags: the template it was
    built with passes, another template (or template variables) is refused in one
    line naming the difference, where it used to be ignored."""
    path = _chats(tmp_path, 4)
    template = _template(tmp_path / "t.jinja")
    other = _template(tmp_path / "o.jinja", CHATML.replace(IM_END + "\n", IM_END))
    where = tmp_path / "cache"
    data_main(["cache", str(path), str(where), "--tokenizer", str(base_tokenizer),
               "--chat-template", str(template)])  # fmt: skip
    capsys.readouterr()
    data_main(["inspect", str(where), "--chat-template", str(template)])
    assert "examples: 4" in capsys.readouterr().out
    for flags, reason in (
        (["--chat-template", str(other)], "rendered with another chat template"),
        (["--chat-template-kwargs", '{"x": 1}'], "rendered with chat_template_kwargs {}"),
    ):
        with pytest.raises(SystemExit):
            data_main(["inspect", str(where), *flags])
        err = capsys.readouterr().err
        assert err.startswith(f"error: {where}: the token cache was built otherwise"), err
        assert reason in err and err.count("\n") == 1, err


# ---------------------------------------------------------------------------------------
# The HF exports
# ---------------------------------------------------------------------------------------

TOOL_USE = "{{ 'tools: ' }}" + PLAIN


@pytest.fixture(scope="module")
def trained(base_tokenizer, tmp_path_factory) -> dict[str, Path]:
    """A two-step run with --chat_template of a tokenizer with its own templates (the
    default in chat_template.jinja and tokenizer_config.json, tool_use in
    additional_chat_templates/), saving each step."""
    root = tmp_path_factory.mktemp("trained")
    own = _tokenizer_with(root / "own", base_tokenizer, PLAIN, {"tool_use": TOOL_USE})
    template = _template(root / "chatml.jinja")
    data = _chats(root)
    run(parse_args(_argv(data, own, root / "run", "--chat_template", str(template))))
    return {"run": root / "run", "tokenizer": own, "template": template, "data": data}


def test_the_exports_carry_the_given_template_alone(trained, tmp_path):
    """The run's hf/ and train.tools.export's directory hold the given template as
    chat_template.jinja and as tokenizer_config.json's chat_template (whose other keys
    are kept), and none of the tokenizer's own (no additional_chat_templates/), also
    where --overwrite replaces a model that had them."""
    assert _template_files(trained["tokenizer"]) == [
        "additional_chat_templates/tool_use.jinja",
        "chat_template.jinja",
        "tokenizer_config.json: chat_template",
    ]
    out = tmp_path / "export"
    out.mkdir()
    for name in ("chat_template.jinja", "tokenizer_config.json"):  # another model's files
        (out / name).write_bytes((trained["tokenizer"] / name).read_bytes())
    export.export(str(trained["run"]), str(out), overwrite=True)
    config = json.loads((trained["tokenizer"] / "tokenizer_config.json").read_text())
    assert config["chat_template"] == PLAIN
    config["chat_template"] = CHATML
    for folder in (trained["run"] / "hf", out):
        want = ["chat_template.jinja", "tokenizer_config.json: chat_template"]
        assert _template_files(folder) == want, folder
        assert (folder / "chat_template.jinja").read_text() == CHATML
        assert json.loads((folder / "tokenizer_config.json").read_text()) == config
    assert _template_files(trained["tokenizer"])[0].startswith("additional")  # read only


def test_the_export_tool_carries_the_template_the_run_read(trained, tmp_path):
    """The run keeps its --chat_template as it read it (chat_template/ in its directory),
    and train.tools.export carries that copy: the file edited, then moved away since the
    run, changes nothing in the export."""
    assert (trained["run"] / "chat_template" / "chat_template.jinja").read_text() == CHATML
    template = trained["template"]
    template.write_text(CHATML.replace(IM_END, "<|end|>"))
    moved = template.with_suffix(".moved")
    try:
        export.export(str(trained["run"]), str(tmp_path / "edited"))
        os.rename(template, moved)
        export.export(str(trained["run"]), str(tmp_path / "moved"))
    finally:
        if moved.exists():
            os.rename(moved, template)
        template.write_text(CHATML)
    for out in ("edited", "moved"):
        want = ["chat_template.jinja", "tokenizer_config.json: chat_template"]
        assert _template_files(tmp_path / out) == want, out
        assert (tmp_path / out / "chat_template.jinja").read_text() == CHATML, out


def test_the_export_tool_refuses_a_template_gone_with_no_copy_in_the_run(trained, tmp_path, capsys):
    """A run directory without its copy of the template (chat_template/ deleted) and the
    run's --chat_template moved away since: the export names the settings file and the
    flag, and writes nothing."""
    template, copy = trained["template"], trained["run"] / "chat_template"
    moved, kept = template.with_suffix(".moved"), tmp_path / "kept"
    os.rename(template, moved)
    os.rename(copy, kept)
    try:
        code = export.main([str(trained["run"]), "--out", str(tmp_path / "x")])
    except SystemExit as e:
        code = e.code
    finally:
        os.rename(moved, template)
        os.rename(kept, copy)
    err = capsys.readouterr().err
    assert code == 2 and f"--chat_template={str(template)!r}: no such file" in err, err
    assert "train_config.yaml" in err and not (tmp_path / "x").exists()


def test_a_resume_with_another_template_is_refused_as_other_data(trained, tmp_path, capsys):
    """Resuming the run with another --chat_template renders its conversations otherwise:
    refused as a resume on other data is, before anything is written."""
    other = _template(tmp_path / "other.jinja", CHATML.replace(IM_END + "\n", IM_END))
    resumed = tmp_path / "resumed"
    argv = _argv(trained["data"], trained["tokenizer"], resumed, "--chat_template", str(other))
    argv += ["--resume_from_checkpoint", str(trained["run"] / "checkpoints" / "1")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "was written by a run with other settings" in err or "on other data" in err, err
    assert not resumed.exists()


ORACLE_RENDER = """
import json, sys
from transformers import AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
conversations = json.loads(open(sys.argv[2]).read())
print(json.dumps([
    {"text": tokenizer.apply_chat_template(c, tokenize=False),
     "ids": tokenizer.apply_chat_template(c, tokenize=True, return_dict=True)["input_ids"]}
    for c in conversations
]))
"""


@pytest.mark.slow
def test_transformers_renders_with_the_exported_template_what_training_saw(trained, tmp_path):
    """transformers' ``apply_chat_template`` with the run's exported tokenizer renders
    the trainer's text byte for byte, and its ids are the trainer's. Skipped without
    the oracle."""
    conversations = [json.loads(line)["messages"] for line in trained["data"].open()][:3]
    (tmp_path / "c.json").write_text(json.dumps(conversations))
    oracle = run_oracle(ORACLE_RENDER, trained["run"] / "hf", tmp_path / "c.json")
    template = chat.ChatTemplate(trained["tokenizer"], "test:", template=trained["template"])
    dataset = load_dataset(
        trained["data"], tokenizer=trained["tokenizer"], chat_template=trained["template"]
    )
    for i, (messages, want) in enumerate(zip(conversations, oracle, strict=True)):
        assert template.render(messages) == want["text"]
        assert dataset.example(i).tolist() == want["ids"]


def test_the_help_says_what_the_flag_does():
    """`python -m train --help` describes the flag."""
    from train.config import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "--chat_template CHAT_TEMPLATE replaces the tokenizer's chat template" in text
