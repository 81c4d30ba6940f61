"""Chat templates: conversations (``"messages"`` records, HF TRL's conversational
format) rendered with the model tokenizer's chat template, and where their assistant
turns lie in the rendered text.

The template is the one transformers loads for a tokenizer directory (the folder of
its ``tokenizer.json``; the functions here take that folder): ``chat_template.jinja``,
with the named templates ``additional_chat_templates/<name>.jinja`` (as transformers 5
saves several), where those files exist, else the ``"chat_template"`` of
``tokenizer_config.json`` (a str, or a list of named templates). Of named templates,
the one named ``"default"`` (``chat_template.jinja``), and for a conversation given
``tools`` the one named ``"tool_use"`` where there is one, as transformers picks.

A template given in its place (the trainer's ``--chat_template``, as TRL's
``chat_template_path``; ``train.data inspect`` and ``cache``: ``--chat-template``)
renders every conversation instead, also for a tokenizer without one (a base model's),
or where the model's does not suit training: a Jinja file is the default template, a
directory's templates are read as a tokenizer directory's (:func:`read_template_path`);
the tokenizer still gives the special tokens. The token cache hashes its text, and the
trainer's HF export carries it as transformers 5 saves a tokenizer's templates
(:func:`save_chat_template`: ``chat_template.jinja``, no other template beside it), so
that ``apply_chat_template`` at inference renders what training saw.

A template is rendered as transformers' ``apply_chat_template`` renders it: a sandboxed Jinja
environment (``ImmutableSandboxedEnvironment``, ``trim_blocks``, ``lstrip_blocks``, the
``loopcontrols`` extension and a ``{% generation %}`` block that renders its body), the
globals ``raise_exception`` and ``strftime_now``, a ``tojson`` filter that does not
escape HTML, and the variables ``messages`` (each message dict as the reader gives it,
every key passed: ``tool_calls``, a tool message's ``name`` or ``tool_call_id``, an
assistant's ``reasoning_content``, ...), ``tools`` (the record's list of function
schemas, else None), ``documents`` (None), ``add_generation_prompt`` and the
tokenizer's named special tokens (``bos_token``, ``eos_token``, ...) as strings, from
``tokenizer_config.json`` (else ``special_tokens_map.json``), and the variables of
``chat_template_kwargs`` (the trainer's ``--chat_template_kwargs``, then a record's own,
each winning over those before it, as ``apply_chat_template(..., **kwargs)`` passes
them: e.g. ``enable_thinking``). As transformers 5.21+ gives them, a message's reasoning
(the first of its ``reasoning_content``, ``thinking`` and ``reasoning``) is its
``reasoning_content`` (which Qwen3's template reads) and, where it has none, its
``thinking`` (gpt-oss's). What the reader changes before (train/records.py): keys whose
value is None are dropped at every depth (a table's missing struct fields, as TRL's
SFTTrainer drops them from a dataset's rows; transformers drops a message's own).

A ``content`` list of text parts reaches the template as it is, as transformers passes
it: a template that iterates the parts renders them (its ids are transformers'). One
that takes a str only writes the list as Python text (``[{'type': 'text', ...}]``) or
nothing of it; transformers renders that too, but as training data it is garbage, so
a conversation whose rendering holds a part's Python text, or lacks a part's text
(trimmed; as written, or JSON-escaped), is refused: write such contents as a str.

Assistant turns (:meth:`ChatTemplate.examples`), the prefix rule: for each assistant
message ``i`` (one that calls tools too) that is learned, the rendering of
``messages[:i]`` with the generation prompt must be a prefix of the rendering of
``messages[:i + 1]``, which must be a prefix of the whole conversation's rendering (all
with the conversation's ``tools``); the turn is the text between the two (its content
or tool calls and what the template writes to end the turn, e.g. ``<|eot_id|>``). A
tool's result (a ``"tool"`` message) is not a turn: it is never learned; nor is an
assistant message that opens the conversation (it answers nothing, and no rendering of
no messages begins it). Where the rule
holds the conversation is one example, its whole rendering, learning every turn.

A template that rewrites earlier turns breaks the rule's second half: Qwen3's writes the
``<think>`` block (the reasoning, or an empty one) of an assistant turn only after the
last user query, so in a conversation of several questions an earlier turn, as the
whole rendering writes it, is not the turn the model wrote at inference. Such a
conversation is learned as the model sees it at inference by splitting it: one example
per learned assistant turn ``i``, the rendering of ``messages[:i + 1]`` (where turn
``i`` is the last, its reasoning kept), learning turn ``i`` only, found by the first
half of the rule on that example alone. ``chat_turns`` (:data:`CHAT_TURNS`, the
trainer's ``--chat_turns``) picks: ``"auto"`` (the default) splits exactly the
conversations whose whole rendering breaks the rule, so a conversation that keeps it is
one example as before; ``"whole"`` refuses those (:class:`RewrittenTurns`); ``"split"``
splits every conversation, one example per learned turn. A template whose generation
prompt does not begin its rendering of the turn (the first half) is refused either way:
no split tells such a turn apart.

``jinja2`` (the ``text`` extra) is imported only when a template is compiled. The first
of the data modules: it imports none of ``train``.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from models.convert import read_json

CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"  # transformers' other named templates
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
# The named special tokens transformers passes to a chat template (its special_tokens_map).
SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
ASSISTANT = "assistant"  # the role whose turns are learned
DEFAULT = "default"  # the named template conversations are rendered with
TOOL_USE = "tool_use"  # the named template for a conversation given tools, where there is one
# A message's reasoning, by the names templates read it under (transformers' order).
REASONING = ("reasoning_content", "thinking", "reasoning")
# The remedy for a template that takes a message's content as a str only.
TAKES_STR = (
    "a template that takes str content only; write the content as a str, or use a template "
    "that renders text parts"
)
# What the reader gives a template besides the special tokens (documents is None), and
# how it keeps the rendering: part of the token cache's stamp, so that a cache rendered
# with other inputs, or kept otherwise, is rebuilt.
TEMPLATE_INPUTS = (
    "messages (content lists as given, reasoning under both names), tools, "
    "chat_template_kwargs; kept through the last EOS where only white space follows"
)
# The variables the reader sets itself, which chat_template_kwargs may not.
READER_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt")
# How a conversation's assistant turns become examples (module docstring; the trainer's
# --chat_turns), the default first: one example where the prefix rule holds, else one
# per turn; always one (else refused); always one per turn.
CHAT_TURNS = ("auto", "whole", "split")
AUTO, WHOLE, SPLIT = CHAT_TURNS


def template_kwargs(value: Any, where: str) -> dict[str, Any]:
    """``value``, extra variables for a chat template (``chat_template_kwargs``, e.g.
    ``{"enable_thinking": false}``), as a dict; ValueError starting with ``where`` for
    one that is not a dict, or that sets a variable of :data:`READER_VARIABLES`."""
    if not isinstance(value, dict):
        raise ValueError(
            f"{where} must be a dict of chat template variables (e.g. "
            f'{{"enable_thinking": false}}), got {type(value).__name__}'
        )
    for key in value:
        if not isinstance(key, str) or key in READER_VARIABLES:
            raise ValueError(
                f"{where}: {key!r} is not a variable it may set (a str, none of "
                f"{', '.join(READER_VARIABLES)}: the conversation's own)"
            )
    return dict(value)


def parse_template_kwargs(text: str, flag: str) -> dict[str, Any]:
    """``text``, a JSON object of chat template variables (a flag's value; empty: none),
    as a dict; ValueError naming ``flag`` and the value where it is not one."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{flag}={text!r} is not JSON ({e}); give an object") from None
    return template_kwargs(value, f"{flag}={text!r}")


class ChatTemplateError(ValueError):
    """A conversation the template cannot render, or whose assistant turns it does not
    render as prefixes; the message says why (the caller names file and record)."""


class RewrittenTurns(ChatTemplateError):
    """A conversation whose whole rendering does not begin with its rendering through an
    assistant turn (a template that rewrites earlier turns), read with ``chat_turns``
    ``"whole"``: splitting it (``"auto"`` or ``"split"``) would learn it."""


# A rendered example of a conversation: its text, the [start, end) character spans learned.
Rendered = tuple[str, list[tuple[int, int]]]


def _read_text(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not a readable text file ({e})") from None


def read_chat_template(folder: str | Path) -> tuple[dict[str, str], dict[str, Path]] | None:
    """``({name: template text}, {name: the file it came from})`` for the tokenizer
    directory ``folder``: ``"default"``, and ``"tool_use"`` where there is one (the
    others are never rendered here); None where it has none. As transformers loads them:
    ``chat_template.jinja`` (the default) and the ``<name>.jinja`` files of
    ``additional_chat_templates/`` where either exists, else ``tokenizer_config.json``'s
    ``chat_template`` (a str, or a list of named templates). ValueError where there is
    no default among named templates, or a ``chat_template`` of another type."""
    folder = Path(folder)
    files = {}
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        files[DEFAULT] = folder / CHAT_TEMPLATE_FILE
    named_dir = folder / CHAT_TEMPLATE_DIR
    if named_dir.is_dir():  # after chat_template.jinja: a default.jinja here wins, as in HF
        files |= {
            f.name.removesuffix(".jinja"): f for f in named_dir.glob("*.jinja") if f.is_file()
        }
    if files:
        if DEFAULT not in files:
            raise ValueError(
                f"{named_dir} holds the templates {sorted(files)} and {folder} has no "
                f"{CHAT_TEMPLATE_FILE} (the default one, that conversations are rendered with)"
            )
        files = {k: v for k, v in files.items() if k in (DEFAULT, TOOL_USE)}
        return {k: _read_text(v) for k, v in files.items()}, files
    config = folder / TOKENIZER_CONFIG
    if not config.is_file():
        return None
    template = read_json(config).get("chat_template")
    if template is None:
        return None
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if not isinstance(named.get(DEFAULT), str):
            raise ValueError(
                f"{config}: 'chat_template' holds the templates {sorted(map(str, named))} and "
                "none named 'default' (the one conversations are rendered with)"
            )
        named = {k: v for k, v in named.items() if k in (DEFAULT, TOOL_USE) and isinstance(v, str)}
        return named, dict.fromkeys(named, config)
    if not isinstance(template, str):
        raise ValueError(f"{config}: 'chat_template' must be a str, got {type(template).__name__}")
    return {DEFAULT: template}, {DEFAULT: config}


def read_template_path(path: str | Path, prefix: str) -> tuple[dict[str, str], dict[str, Path]]:
    """The templates of ``path``, given in place of a tokenizer's (the trainer's
    ``--chat_template``), as :func:`read_chat_template` gives them: a Jinja file is the
    default template; a directory's are read as a tokenizer directory's. ValueError
    starting with ``prefix`` where ``path`` does not exist, is a directory without a chat
    template, or is not a text file, or an empty one."""
    path = Path(path)
    if path.is_dir():
        try:
            found = read_chat_template(path)
        except ValueError as e:
            raise ValueError(f"{prefix}: {e}") from None
        if found is None:
            raise ValueError(
                f"{prefix}: a directory without a chat template (no {CHAT_TEMPLATE_FILE}, "
                f"{CHAT_TEMPLATE_DIR}/ or 'chat_template' in {TOKENIZER_CONFIG}); give a Jinja "
                "file, or a tokenizer directory with one"
            )
        return found
    if not path.is_file():
        raise ValueError(
            f"{prefix}: no such file or directory (give a Jinja chat template file, or a "
            "tokenizer directory with one)"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{prefix}: not a readable text file ({e})") from None
    if not text.strip():
        raise ValueError(f"{prefix}: an empty file (a Jinja chat template renders nothing)")
    if path.suffix.lower() == ".json":  # tokenizer.json, tokenizer_config.json
        raise ValueError(
            f"{prefix}: a JSON file, not a Jinja chat template; give the template file, or "
            "the tokenizer directory whose template is meant"
        )
    return {DEFAULT: text}, {DEFAULT: path}


def check_template_path(path: str | Path, flag: str) -> dict[str, str]:
    """``{name: template text}`` of ``path`` (:func:`read_template_path`), each compiled
    as it will render; ValueError starting with ``flag=path`` (one line) where it cannot
    be read, ``jinja2`` is missing, or a template does not compile."""
    prefix = f"{flag}={str(path)!r}"
    templates, files = read_template_path(path, prefix)
    given = Path(path)
    _compile_all(
        templates,
        files,
        f"{prefix}:",
        lambda name: f"{prefix}:" if files[name] == given else f"{prefix}: {files[name]}:",
    )
    return templates


def template_files(names: Sequence[str]) -> list[str]:
    """The files that hold the named templates ``names`` as transformers 5 saves them
    (paths relative to the tokenizer directory): the default in ``chat_template.jinja``,
    each other in ``additional_chat_templates/<name>.jinja``."""
    return [
        CHAT_TEMPLATE_FILE if name == DEFAULT else f"{CHAT_TEMPLATE_DIR}/{name}.jinja"
        for name in names
    ]


def is_template_file(name: str) -> bool:
    """Whether ``name`` (a path relative to a tokenizer directory) holds a chat template
    as transformers 5 saves them."""
    return name == CHAT_TEMPLATE_FILE or name.startswith(f"{CHAT_TEMPLATE_DIR}/")


def save_chat_template(folder: str | Path, templates: dict[str, str]) -> list[str]:
    """Writes ``templates`` (``{name: text}``, a ``"default"`` among them) into the
    tokenizer directory ``folder`` as transformers 5's ``save_pretrained`` saves them
    (:func:`template_files`), and into its ``tokenizer_config.json``'s ``chat_template``
    where there is one (the text, or a list of ``{"name", "template"}`` where there are
    several, as transformers 4 saves them: the versions that read only the config find
    the same templates), and removes other ``additional_chat_templates/*.jinja`` files,
    which would give another. Returns the files written."""
    folder = Path(folder)
    written = template_files(list(templates))
    for text, file in zip(templates.values(), written, strict=True):
        (folder / file).parent.mkdir(parents=True, exist_ok=True)
        (folder / file).write_text(text, encoding="utf-8")
    named_dir = folder / CHAT_TEMPLATE_DIR
    if named_dir.is_dir():
        for f in named_dir.glob("*.jinja"):
            if f"{CHAT_TEMPLATE_DIR}/{f.name}" not in written:
                f.unlink()
        if not any(named_dir.iterdir()):
            named_dir.rmdir()
    config = folder / TOKENIZER_CONFIG
    if config.is_file():
        values = read_json(config)
        values["chat_template"] = (
            templates["default"]
            if list(templates) == ["default"]
            else [{"name": name, "template": text} for name, text in templates.items()]
        )
        config.write_text(json.dumps(values, indent=2, ensure_ascii=False) + "\n")
    return written


def special_tokens(folder: str | Path) -> dict[str, str]:
    """The named special tokens of the tokenizer directory ``folder`` as strings
    (``tokenizer_config.json``'s, else ``special_tokens_map.json``'s; str or
    ``{"content": ...}``)."""
    folder = Path(folder)
    tokens: dict[str, str] = {}
    for name in (SPECIAL_TOKENS_MAP, TOKENIZER_CONFIG):  # the latter wins
        if (folder / name).is_file():
            config = read_json(folder / name)
            for key in SPECIAL_TOKENS:
                value = config.get(key)
                value = value.get("content") if isinstance(value, dict) else value
                if isinstance(value, str):
                    tokens[key] = value
    return tokens


def chat_template_stamp(
    folder: str | Path,
    kwargs: dict[str, Any] | None = None,
    template: str | Path | None = None,
) -> dict[str, Any] | None:
    """``{"path", "sha256", "inputs", "kwargs"}``: the template's file, a hash of the
    template text (and of the ``tool_use`` one, where there is one) and the special
    tokens passed to it, :data:`TEMPLATE_INPUTS` and the template variables ``kwargs``
    given to every conversation (what a token cache records: another template, other
    inputs or other variables render the conversations otherwise); None where the
    tokenizer has no template. ``template``: the templates given in place of the
    tokenizer's (:func:`read_template_path`), whose text is hashed then. Reads the files
    only (no ``jinja2`` needed)."""
    if template is None:
        found = read_chat_template(folder)
    else:
        found = read_template_path(template, f"the chat template {template}")
    if found is None:
        return None
    templates, files = found
    variables = json.dumps(special_tokens(folder), sort_keys=True)
    hashed = f"{templates[DEFAULT]}\0{variables}"
    if TOOL_USE in templates:
        hashed += f"\0{TOOL_USE}\0{templates[TOOL_USE]}"
    digest = hashlib.sha256(hashed.encode()).hexdigest()
    return {
        "path": str(files[DEFAULT].resolve()),
        "sha256": digest,
        "inputs": TEMPLATE_INPUTS,
        "kwargs": dict(kwargs or {}),
    }


def _compile(template: str, jinja2):
    """The template compiled as transformers compiles chat templates (module docstring)."""
    sandbox = importlib.import_module("jinja2.sandbox")
    ext = importlib.import_module("jinja2.ext")

    class Generation(ext.Extension):
        """``{% generation %}...{% endgeneration %}``: renders its body (transformers
        uses the block to mark assistant text; here the prefix rule finds it)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format):
        return datetime.datetime.now().strftime(format)

    env = sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


def _compile_all(templates: dict[str, str], files: dict[str, Path], where: str, label) -> dict:
    """``{name: compiled template}``; ValueError starting with ``where`` where ``jinja2``
    is missing, or with ``label(name)`` (which names the template's file) where a
    template does not compile (with the line)."""
    try:
        jinja2 = importlib.import_module("jinja2")
    except ImportError:
        raise ValueError(
            f"{where} rendering them needs the 'jinja2' package: pip install 'jflash[text]'"
        ) from None
    compiled = {}
    for name, text in templates.items():
        try:
            compiled[name] = _compile(text, jinja2)
        except jinja2.exceptions.TemplateError as e:
            named = "the chat template" if name == DEFAULT else f"the {name!r} chat template"
            line = getattr(e, "lineno", None)
            at = f"line {line}: " if line else ""
            raise ValueError(f"{label(name)} {named} does not compile ({at}{e})") from None
    return compiled


class ChatTemplate:
    """A tokenizer's chat template, compiled: :meth:`render` and :meth:`assistant_spans`.

    Args:
        folder: the tokenizer directory (of its ``tokenizer.json``).
        where: starts each error message (the data file and the record needing it).
        kwargs: template variables for every conversation (checked by
            :func:`template_kwargs`), as transformers' ``apply_chat_template(**kwargs)``
            passes them; a conversation's own win over them, and both over the special
            tokens.
        template: a Jinja file, or a directory, whose templates render the conversations
            in place of the tokenizer's (:func:`read_template_path`; the trainer's
            ``--chat_template``); None: the tokenizer's.

    Raises:
        ValueError: the tokenizer has no chat template (and none is given), or the one
            given cannot be read; ``jinja2`` is missing (naming the extra that installs
            it); the template does not compile.
    """

    def __init__(
        self,
        folder: str | Path,
        where: str,
        kwargs: dict[str, Any] | None = None,
        template: str | Path | None = None,
    ):
        folder = Path(folder)
        if template is None:
            found = read_chat_template(folder)
            self.base: Path | None = folder  # where the error messages' files are named from
        else:
            found = read_template_path(template, f"{where} the chat template {template}")
            self.base = Path(template) if Path(template).is_dir() else None
        if found is None:
            raise ValueError(
                f"{where} {folder} has no chat_template in {TOKENIZER_CONFIG} or "
                f"{CHAT_TEMPLATE_FILE}; add the model's chat template there, give one in its "
                "place (--chat_template FILE, or --chat-template FILE in train.data), or write "
                "the conversations as 'prompt' / 'completion' records"
            )
        self.folder = folder
        self.templates, self.files = found
        self.path = self.files[DEFAULT]
        self.text = self.templates[DEFAULT]
        self.variables = special_tokens(folder)
        self.kwargs = dict(kwargs or {})
        self.stamp = chat_template_stamp(folder, self.kwargs, template)
        self._compiled = _compile_all(
            self.templates, self.files, where, lambda name: f"{where} {self.files[name]}:"
        )

    def _name(self, tools: Sequence[dict[str, Any]] | None) -> str:
        """The named template a conversation is rendered with (``tool_use`` given tools,
        where there is one, as transformers picks it)."""
        return TOOL_USE if tools is not None and TOOL_USE in self._compiled else DEFAULT

    def _label(self, tools: Sequence[dict[str, Any]] | None) -> str:
        """The template in an error message: its file (in the tokenizer directory), and
        its name where that file holds several."""
        name = self._name(tools)
        file = self.files[name]
        named = name != DEFAULT and file.name == TOKENIZER_CONFIG
        shown = str(file) if self.base is None else file.relative_to(self.base).as_posix()
        return shown + (f", {name!r}" if named else "")

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = False,
        tools: Sequence[dict[str, Any]] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The template's text for ``messages`` (and ``tools``, the functions' JSON
        schemas, or None; ``kwargs``, the conversation's template variables);
        :class:`ChatTemplateError` where the template raises (its message)."""
        try:
            return self._compiled[self._name(tools)].render(
                **{**self.variables, **self.kwargs, **(kwargs or {})},
                messages=[_with_reasoning_aliases(m) for m in messages],
                tools=None if tools is None else list(tools),
                documents=None,
                add_generation_prompt=add_generation_prompt,
            )
        except Exception as e:  # noqa: BLE001 - a template is code: whatever it raises
            hint = ""
            if isinstance(e, TypeError) and any(
                isinstance(m.get("content"), list) for m in messages
            ):
                hint = f" ({TAKES_STR})"
            raise ChatTemplateError(
                f"the chat template ({self._label(tools)}) raised {type(e).__name__}: {e}{hint}"
            ) from None

    def assistant_spans(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> tuple[str, list[tuple[int, int]]]:
        """``(text, spans)``: the conversation's rendering (with ``tools`` and template
        variables ``kwargs``) and the ``[start, end)`` character span of each assistant
        turn in it (see the module docstring); no span without an assistant message.
        :class:`ChatTemplateError` where the template raises or does not render the
        turns as prefixes (:class:`RewrittenTurns` where only splitting would learn
        them). :meth:`examples` with ``"whole"``."""
        (example,), _ = self.examples(messages, tools, kwargs, WHOLE)
        return example

    def examples(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        kwargs: dict[str, Any] | None = None,
        turns: str = AUTO,
        first: int = 0,
    ) -> tuple[list[Rendered], bool]:
        """``(examples, split)``: the conversation (with ``tools`` and template variables
        ``kwargs``) as ``(text, spans)`` examples, the ``[start, end)`` character span of
        each learned turn in its text, learning the assistant messages from message
        ``first`` on (those before are context); ``split``: whether it is one example per
        learned turn (rendered through it) rather than one of its whole rendering.
        ``turns``, one of :data:`CHAT_TURNS`, picks (module docstring); without a learned
        turn, ``"auto"`` and ``"whole"`` give the whole rendering and no span,
        ``"split"`` no example. :class:`ChatTemplateError` where the template raises or
        does not render a learned turn as a prefix; :class:`RewrittenTurns` where
        ``turns`` is ``"whole"`` and only splitting would learn it."""
        if turns not in CHAT_TURNS:
            raise ValueError(f"chat_turns={turns!r} must be one of {CHAT_TURNS}")
        label = self._label(tools)
        text = None  # "split" needs no whole rendering
        if turns != SPLIT:
            text = self.render(messages, tools=tools, kwargs=kwargs)
            if why := _unrendered_parts(messages, text):
                raise ChatTemplateError(f"the chat template ({label}) {why} ({TAKES_STR})")
        found: list[tuple[int, str, str]] = []  # (message, before it, through it)
        rewritten = None  # the first learned turn that the whole rendering rewrites
        number = 0
        for i, message in enumerate(messages):
            if message["role"] != ASSISTANT:
                continue
            number += 1
            if i < first or i == 0:  # an opening assistant message answers nothing
                continue
            before = self.render(
                messages[:i], add_generation_prompt=True, tools=tools, kwargs=kwargs
            )
            through = self.render(messages[: i + 1], tools=tools, kwargs=kwargs)
            turn = f"assistant turn {number} (message {i})"
            if not through.startswith(before):  # no split tells this turn apart
                why = "a template that rewrites earlier turns"
                if reasoning_of(message) is not None:
                    why = (
                        "the turn has reasoning, which the generation prompt does not leave "
                        "room for: a template variable such as enable_thinking false writes "
                        "an empty think block there; drop the variable or the reasoning"
                    )
                raise ChatTemplateError(
                    f"the chat template ({label}) renders the messages before {turn} "
                    "with its generation prompt as text that does not begin its rendering "
                    f"through that turn, so the turn's text cannot be told apart ({why})"
                )
            if text is not None and rewritten is None and not text.startswith(through):
                rewritten = turn
            found.append((i, before, through))
        if rewritten is not None and turns == WHOLE:
            raise RewrittenTurns(
                f"the chat template ({label}) renders the messages through "
                f"{rewritten} as text that does not begin the whole conversation's rendering, "
                "so the turn's text cannot be told apart (a template that rewrites "
                "earlier turns)"
            )
        if rewritten is None and turns != SPLIT:
            return [(text, [(len(before), len(through)) for _, before, through in found])], False
        for i, _, through in found:
            if why := _unrendered_parts(messages[: i + 1], through):
                raise ChatTemplateError(f"the chat template ({label}) {why} ({TAKES_STR})")
        return [(through, [(len(before), len(through))]) for _, before, through in found], True


def reasoning_of(message: dict[str, Any]) -> Any:
    """A message's reasoning: the first of :data:`REASONING` it has (None: none)."""
    return next((message[k] for k in REASONING if message.get(k) is not None), None)


def _found(words: str, texts: Sequence[str]) -> bool:
    """Whether ``words`` (stripped), as written or JSON-escaped, is in one of ``texts``."""
    words = words.strip()
    escaped = json.dumps(words, ensure_ascii=False)[1:-1]
    return any(words in text or escaped in text for text in texts)


def unrendered(
    messages: Sequence[dict[str, Any]],
    texts: Sequence[str],
    first: int = 0,
    tools: Sequence[Any] | None = None,
) -> tuple[list, int]:
    """What of ``messages`` the renderings ``texts`` (a conversation's examples) hold
    nothing of: the roles of the messages whose str content is missing (a role the
    template skips), and how many learned assistant messages' (from message ``first``
    on) reasoning is (a template that does not write ``reasoning_content``; a context
    turn's may be dropped, as Qwen3's drops it at inference). Empty content and
    reasoning count as written. A message's tool calls whose function names the
    renderings do not hold count under `<role> tool_calls` (a template that writes no
    tool calls: the turn would teach an empty answer), and the record's ``tools`` whose
    function names they do not hold under `tools` (the model never sees them)."""
    roles, reasoning = [], 0
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, str) and content.strip() and not _found(content, texts):
            roles.append(message["role"])
        calls = message.get("tool_calls") or ()
        names = [c.get("function", {}).get("name") for c in calls if isinstance(c, dict)]
        if any(isinstance(n, str) and n and not _found(n, texts) for n in names):
            roles.append(f"{message['role']} tool_calls")
        thought = reasoning_of(message) if i >= max(first, 1) else None
        if isinstance(thought, str) and thought.strip() and not _found(thought, texts):
            reasoning += 1
    for tool in tools or ():
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if isinstance(name, str) and name and not _found(name, texts):
            roles.append("tools")
            break
    return roles, reasoning


def _with_reasoning_aliases(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` with its reasoning (the first of :data:`REASONING` it has) as
    ``reasoning_content`` and, where it has none, ``thinking``, as transformers 5.21+ gives
    a template its messages."""
    reasoning = reasoning_of(message)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _unrendered_parts(messages: Sequence[dict[str, Any]], text: str) -> str | None:
    """Why ``text``, the rendering of ``messages``, does not render their content lists'
    text parts (module docstring), or None where it does."""
    for n, message in enumerate(messages):
        content = message.get("content")
        for k, part in enumerate(content if isinstance(content, list) else ()):
            if not isinstance(part, dict) or not isinstance(part.get("text"), str):
                continue  # the reader refuses such parts before
            if str(part) in text:
                return f"writes message {n}'s content list as Python text ({str(part)[:60]})"
            if not _found(part["text"], [text]):
                words = part["text"].strip()
                return f"writes nothing of message {n}'s content part {k} ({words[:60]!r})"
    return None


def assistant_labels(
    ids: Sequence[int], offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]
) -> list[bool]:
    """Which tokens are learned: those whose character span ``offsets[t]`` overlaps an
    assistant span (``start < span end`` and ``end > span start``), as transformers'
    ``return_assistant_tokens_mask`` marks them: a token straddling a turn's boundary
    is learned whole. ``offsets`` and ``spans`` both in text order."""
    learned = [False] * len(ids)
    k = 0
    for t, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        learned[t] = end > spans[k][0]
    return learned
