"""Records into token ids: what a data record may hold, and how it is tokenized.

A record (a dict, or a table's row) is read by the first of its keys that it has, in
this order (other keys are ignored):

- ``"input_ids"``: token ids, with optional ``"labels"`` in the HuggingFace convention:
  aligned with ``input_ids`` (the model shifts), ``-100`` = ignored.
- ``"text"``: a str, tokenized (with the tokenizer's special tokens, e.g. the BOS its
  post-processor adds); every token is labelled.
- ``"prompt"`` and ``"completion"`` (HF TRL's prompt-completion format; both str):
  supervised fine-tuning with the prompt masked. The prompt is tokenized with the
  tokenizer's special tokens, the completion separately without them
  (``add_special_tokens=False``), and the ids are the two concatenated; the prompt's
  labels are ``-100``, the completion's its tokens. Being tokenized separately, the
  completion's leading space is its own: ``" Paris"``, not ``"Paris"``, after
  ``"The capital of France is"``, as in TRL, with a byte-level BPE (Llama-3's); a
  tokenizer whose normalizer prepends ``▁`` to every text (Llama-2's) gives the
  completion that space itself (``"Paris"``). A record whose completion tokenizes to
  nothing (nothing to learn) is skipped, as is a ``"text"`` that tokenizes to nothing
  but the special tokens the tokenizer adds (a BOS); the log says how many. Both lists
  of messages (TRL's conversational prompt-completion form): the conversation
  ``prompt + completion`` (with the record's ``"tools"`` and ``"chat_template_kwargs"``),
  read as ``"messages"`` are, learning the completion's assistant turns only.
- ``"messages"`` (HF TRL's conversational format: a list of ``{"role": str, "content":
  ...}`` dicts, with an optional record-level ``"tools"``): supervised fine-tuning on
  the assistant turns. Keys whose value is None are dropped at every depth (a table's
  missing struct fields; TRL's SFTTrainer drops them so), and each message is passed
  to the template with all its keys. A message's ``content`` is a str, or a list of
  parts ``{"type": "text", "text": str}``, passed as it is (as transformers passes it:
  a template that iterates the parts renders them; one that takes a str only is refused,
  :mod:`train.chat`; only text is trained: a part of another type, e.g. ``"image"``,
  is refused); an assistant message with
  ``"tool_calls"`` (a list of ``{"type": "function", "function": {"name": str,
  "arguments": dict or JSON str}}``, or of the function dicts themselves) may have no
  content; a tool's result is a ``{"role": "tool", "content": ..., "name" or
  "tool_call_id": ...}`` message. ``"tools"`` (a list of the functions' JSON schemas)
  goes to the template as its ``tools``, as TRL passes a dataset's ``tools`` column,
  and ``"chat_template_kwargs"`` (a dict, e.g. ``{"enable_thinking": false}``) as
  extra template variables, as TRL passes them to ``apply_chat_template``, over the
  trainer's ``--chat_template_kwargs``.
  The conversation is rendered with the tokenizer's chat template, or the one given in
  its place (the trainer's ``--chat_template``; :mod:`train.chat`), and the text
  tokenized whole, without adding special tokens (the template writes the BOS), as
  transformers' ``apply_chat_template(tokenize=True)`` does, so the ids are
  its ids. A token is labelled (its id) where its character span overlaps an assistant
  turn (the turn's content or tool calls and what the template writes to end it, e.g.
  ``<|eot_id|>``; a token straddling the turn's boundary is labelled whole), every
  other token ``-100`` (a tool's result too). The assistant turns are found by the
  prefix rule of :mod:`train.chat`; a conversation whose template rewrites its earlier
  turns (Qwen3's drops their reasoning) is split, under the parser's ``chat_turns``
  (``"auto"``, the default; ``"whole"`` refuses it, ``"split"`` splits every one), into
  one example per learned assistant turn, the conversation rendered through that turn,
  each with the record's number, and the log says how many conversations gave how many
  examples. A conversation
  without an assistant turn with a token to learn is skipped, and the log says how
  many. A record with ``"messages"`` and only one of ``"prompt"`` and ``"completion"``
  is read by its messages (``"prompt"`` beside ``"messages"``, as in some chat
  datasets); with both, or with ``"input_ids"`` or ``"text"``, by those.

Text is tokenized with a ``tokenizer.json`` (the file, or the directory holding it,
e.g. the model's; the ``tokenizers`` package, imported only when a record needs it),
one ``encode_batch`` call per ``_CHUNK`` records (for prompt/completion records one for
the prompts, one for the completions; one for the conversations).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from models.convert import read_json, special_token_ids
from models.loss import IGNORE_INDEX
from train.chat import (
    ASSISTANT,
    AUTO,
    CHAT_TURNS,
    ChatTemplate,
    ChatTemplateError,
    RewrittenTurns,
    assistant_labels,
    template_kwargs,
    unrendered,
)

_MAX_ID = np.iinfo(np.int32).max

PROMPT_COMPLETION = ("prompt", "completion")  # a record's fields for prompt-masked training
MESSAGES = "messages"  # a conversational record's field (its assistant turns are learned)
# An input_ids record's HF padding mask (0: a pad token, left out of the example).
ATTENTION_MASK = "attention_mask"
TOOLS = "tools"  # a conversational record's functions (JSON schemas), passed to the template
CHAT_TEMPLATE_KWARGS = "chat_template_kwargs"  # a conversational record's template variables


# What a reader gets for a record that is tokenized: ``(input_ids, labels or None)``;
# for a conversation split into one example per assistant turn, a list of them.
Tokens = tuple[np.ndarray, np.ndarray | None]


def split_note(conversations: int, examples: int, chat_turns: str) -> str:
    """The log's words for ``conversations`` split into ``examples``, one per assistant
    turn, under ``chat_turns`` (:data:`train.chat.CHAT_TURNS`)."""
    why = ": their chat template rewrites earlier turns" if chat_turns == AUTO else ""
    return (
        f"split {conversations} conversation{'s' * (conversations != 1)} into {examples} "
        f"example{'s' * (examples != 1)}, one per assistant turn, each the conversation "
        f"rendered through its turn (chat_turns {chat_turns}{why})"
    )


class ChatTurnsError(ValueError):
    """A conversation whose template rewrites its earlier turns, read whole (chat_turns
    ``"whole"``): the message names the trainer's ``--chat_turns``, which splits it;
    :meth:`asking_for` names another command's flag."""

    def __init__(self, where: str, flag: str = "--chat_turns"):
        self.where = where
        super().__init__(
            f"{where}; {flag} auto (or split) learns such a conversation as one example per "
            "assistant turn, each the conversation rendered through that turn as the model "
            "sees it at inference"
        )

    def asking_for(self, flag: str) -> ChatTurnsError:
        """The same error naming ``flag``."""
        return ChatTurnsError(self.where, flag)


def record_kind(record: dict) -> str | None:
    """The key a record is read by: ``"input_ids"``, ``"text"``, ``"prompt"`` (a
    prompt/completion record), ``"messages"``, or None (none of them). The first it has
    of ``input_ids``, ``text``, both ``prompt`` and ``completion``, ``messages``; a
    record with one of ``prompt`` and ``completion`` and no ``messages`` is ``"prompt"``
    (refused for the missing one)."""
    if "input_ids" in record:
        return "input_ids"
    if "text" in record:
        return "text"
    if all(key in record for key in PROMPT_COMPLETION):
        return "prompt"
    if MESSAGES in record:
        return MESSAGES
    if any(key in record for key in PROMPT_COMPLETION):
        return "prompt"
    return None


def _without_none(value: Any) -> Any:
    """``value`` with the keys of its dicts whose value is None dropped, at every depth
    (as TRL's SFTTrainer cleans a dataset's rows: a table's missing struct fields)."""
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_without_none(v) for v in value]
    return value


def _check_content(field: str, content: Any) -> None:
    """ValueError naming the field, or the part, unless a message's ``content`` is a str
    or a list of text parts ``{"type": "text", "text": str}`` (a part of another type,
    e.g. an image, is refused: only text is trained)."""
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise ValueError(
            f"{field}: 'content' must be a str or a list of {{'type': 'text', 'text': str}} "
            f"parts, got {type(content).__name__}"
        )
    for k, part in enumerate(content):
        where = f"{field}: 'content'[{k}]"
        if not isinstance(part, dict):
            raise ValueError(
                f"{where} must be a dict with a 'type' (a text part: {{'type': 'text', "
                f"'text': str}}), got {type(part).__name__}"
            )
        kind = part.get("type")
        if kind is None:
            raise ValueError(
                f"{where} has no 'type' (a text part: {{'type': 'text', 'text': str}})"
            )
        if kind != "text":
            raise ValueError(
                f"{where} is a {kind!r} part: only text parts can be trained (a text-only "
                "model); drop the record or its non-text parts"
            )
        if not isinstance(part.get("text"), str):
            got = type(part["text"]).__name__ if "text" in part else "none"
            raise ValueError(f"{where}: a text part's 'text' must be a str, got {got}")


def _check_tool_calls(field: str, calls: Any) -> None:
    """ValueError naming the call and the field unless ``calls`` is a list of
    ``{"type": "function", "function": {"name": str, "arguments": dict or str}}`` (or of
    the function dicts themselves; ``type`` and ``arguments`` optional)."""
    shape = (
        "a list of {'type': 'function', 'function': {'name': str, 'arguments': dict or "
        "JSON str}} dicts"
    )
    if not isinstance(calls, list):
        raise ValueError(f"{field}: 'tool_calls' must be {shape}, got {type(calls).__name__}")
    for k, call in enumerate(calls):
        where = f"{field}: 'tool_calls'[{k}]"
        if not isinstance(call, dict):
            raise ValueError(f"{where} must be a dict, got {type(call).__name__}")
        if "type" in call and not isinstance(call["type"], str):
            raise ValueError(f"{where}: 'type' must be a str, got {type(call['type']).__name__}")
        function = call.get("function", call)
        if "function" in call:
            where += ": 'function'"
            if not isinstance(function, dict):
                raise ValueError(
                    f"{where} must be a dict with a str 'name', got {type(function).__name__}"
                )
        if not isinstance(function.get("name"), str):
            got = type(function["name"]).__name__ if "name" in function else "none"
            raise ValueError(f"{where}: 'name' must be a str (the function called), got {got}")
        arguments = function.get("arguments", {})
        if not isinstance(arguments, (dict, str)):
            raise ValueError(
                f"{where}: 'arguments' must be a dict or a JSON str, got {type(arguments).__name__}"
            )


def _conversation_field(learned_from: int) -> str:
    """How an error names a conversation's field: ``'messages'``, or the messages of a
    conversational prompt-completion record (its completion learned from message
    ``learned_from`` on)."""
    return f"'{MESSAGES}'" if not learned_from else "'prompt' and 'completion' messages"


class Chat(NamedTuple):
    """A conversation to render: record ``index``'s ``messages``, ``tools`` and template
    variables ``kwargs`` (each None where it has none), its assistant turns learned from
    message ``learned_from`` on."""

    index: int
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    kwargs: dict[str, Any] | None
    learned_from: int


def not_unicode(text: str) -> str | None:
    """What makes ``text`` no Unicode text (a lone UTF-16 surrogate, which a JSON escape
    such as ``"\\ud800"`` writes and no tokenizer encodes), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return (
            f"holds {text[e.start]!r} at character {e.start}: a lone UTF-16 surrogate (half "
            "of a pair, as a JSON escape can write it), which is not text; fix or drop it"
        )
    return None


class RecordParser:
    """Turns one record into ``(input_ids, labels or None)``; ``tokenizer``: a
    ``tokenizer.json`` or its directory, loaded at the first record that needs it
    (``"text"``, ``"prompt"`` and ``"completion"``, or ``"messages"``, which also load
    its directory's chat template, or ``chat_template``'s in its place)."""

    def __init__(
        self,
        path: Path,
        tokenizer: str | Path | None,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_turns: str = AUTO,
        chat_template: str | Path | None = None,
    ):
        if chat_turns not in CHAT_TURNS:
            raise ValueError(f"chat_turns={chat_turns!r} must be one of {CHAT_TURNS}")
        self.path = path
        self.tokenizer = tokenizer
        self._eos: int | None = None  # the tokenizer's eos_token id (-1: none), once read
        self.chat_template_kwargs = dict(chat_template_kwargs or {})  # for every conversation
        self.chat_turns = chat_turns  # train.chat.CHAT_TURNS: which conversations are split
        # A Jinja file or directory whose template renders the conversations (None: the
        # tokenizer's own, train.chat.read_template_path)
        self.chat_template_path = None if chat_template is None else Path(chat_template)
        self._tokenizer = None
        self.chat_template = None  # train.chat.ChatTemplate, at the first "messages" record
        self.masked_tokens = 0  # input_ids an attention_mask marks as padding (left out)
        self.empty_texts = 0  # text records that tokenize to nothing (skipped)
        self.empty_ids = 0  # token-id records with no id (skipped)
        self.empty_completions = 0  # prompt/completion records whose completion does (skipped)
        self.empty_conversations = 0  # messages records without an assistant token (skipped)
        # Of those: conversational prompt-completion records (the completion's turns are
        # learned), and conversations whose assistant turns render to no token.
        self.empty_completion_turns = 0
        self.unrendered_turns = 0
        self.split_conversations = 0  # conversations read as one example per assistant turn
        self.split_examples = 0  # the examples they gave
        self.opening_turns = 0  # conversations opened by an assistant message (context)
        self.unrendered_roles: dict[str, int] = {}  # messages the template writes nothing of
        self.unrendered_reasoning = 0  # assistant messages whose reasoning it writes nothing of

    @property
    def unused_chat_settings(self) -> list[str]:
        """The chat settings given (away from their defaults) where no record was a
        conversation, so none rendered one: their names (the trainer's flags', the data
        tool's with dashes)."""
        if self.chat_template is not None:
            return []
        given = (
            ("chat_template", self.chat_template_path is not None),
            ("chat_template_kwargs", bool(self.chat_template_kwargs)),
            ("chat_turns", self.chat_turns != AUTO),
        )
        return [name for name, away in given if away]

    @property
    def used_tokenizer(self) -> bool:
        """Whether any record was tokenized (so the tokenizer shaped the tokens)."""
        return self._tokenizer is not None

    def parse(
        self, where: str, record: Any, tokens: Tokens | list[Tokens] | None = None
    ) -> Tokens | list[Tokens]:
        """``(input_ids, labels or None)`` (a list of them for a conversation split into
        one example per assistant turn); ``tokens``: the record's text (or prompt and
        completion, or conversation), tokenized by :meth:`tokenize_texts`."""
        if not isinstance(record, dict):
            if isinstance(record, (str, bytes)) or np.isscalar(record) or record is None:
                raise ValueError(
                    f"{self.path}: {where}: expected a record (an object with 'input_ids', "
                    "'text' or 'messages', or 'prompt' and 'completion') or a list of token "
                    f"ids, got {type(record).__name__}"
                )
            ids = self._ids(where, "input_ids", record, allow_empty=True)
            self.empty_ids += not ids.size
            return ids, None
        kind = record_kind(record)
        if kind == "input_ids":
            ids = self._ids(where, "input_ids", record["input_ids"], allow_empty=True)
            if not ids.size:  # an empty document (pre-tokenized corpora hold them): skipped
                self.empty_ids += 1
                return ids, None
            labels = record.get("labels")
            labels = None if labels is None else self._labels(where, labels, len(ids))
            if (mask := record.get(ATTENTION_MASK)) is not None:
                keep = self._mask(where, mask, len(ids))
                self.masked_tokens += len(ids) - int(keep.sum())
                ids, labels = ids[keep], None if labels is None else labels[keep]
            return ids, labels
        if kind is not None:
            if tokens is None:
                tokens = self.tokenize_texts([where], [record])[0]
            return tokens
        raise ValueError(
            f"{self.path}: {where}: expected key 'input_ids', 'text' or 'messages', or keys "
            f"'prompt' and 'completion', got {sorted(record)}"
        )

    def tokenize_texts(
        self, wheres: Sequence[str], records: Sequence[Any]
    ) -> list[Tokens | list[Tokens] | None]:
        """The tokens of each record that holds text: a ``"text"`` record's ids (labels
        None); a prompt/completion record's ids and labels (the prompt's ``-100``); a
        ``"messages"`` record's ids and labels (``-100`` but on the assistant turns), or
        a list of them, one per learned assistant turn, for a conversation split
        (``chat_turns``, :mod:`train.chat`). None for the others. One ``encode_batch``
        call for the texts, one for the prompts, one for the completions and one for the
        conversations. Empty ids where the record has nothing to train on (a text, or a
        completion, that tokenizes to nothing, or a conversation without an assistant
        token, counted in ``empty_texts`` / ``empty_completions`` /
        ``empty_conversations``): the reader skips it. ValueError naming the first
        record whose field is not a str (or a list of messages, or whose messages or
        tools are malformed), that has only one of prompt and completion, or whose
        conversation the chat template cannot render (:class:`ChatTurnsError` where
        only splitting it would learn it)."""
        texts: list[tuple[int, str]] = []
        pairs: list[tuple[int, str, str]] = []
        chats: list[Chat] = []
        for i, record in enumerate(records):
            kind = record_kind(record) if isinstance(record, dict) else None
            if kind == "text":
                texts.append((i, self._string(wheres[i], record, "text")))
            elif kind == "prompt" and all(
                isinstance(record.get(key), list) for key in PROMPT_COMPLETION
            ):  # TRL's conversational prompt-completion: the completion's turns learned
                prompt, completion = (
                    self._messages(wheres[i], record[key], key) for key in PROMPT_COMPLETION
                )
                chats.append(self._chat(wheres[i], i, record, prompt + completion, len(prompt)))
            elif kind == "prompt":
                prompt, completion = (
                    self._string(wheres[i], record, key) for key in PROMPT_COMPLETION
                )
                pairs.append((i, prompt, completion))
            elif kind == MESSAGES:
                messages = self._messages(wheres[i], record[MESSAGES])
                chats.append(self._chat(wheres[i], i, record, messages, 0))
        out: list[Tokens | list[Tokens] | None] = [None] * len(records)
        if not texts and not pairs and not chats:
            return out
        first, fields = min(
            (found[0][0], name)
            for found, name in (
                (texts, "'text'"),
                (pairs, "'prompt' and 'completion'"),
                (chats, _conversation_field(chats[0].learned_from) if chats else ""),
            )
            if found
        )
        tokenizer = self._get_tokenizer(f"{wheres[first]}: has {fields}")
        if texts:
            encoded = self._encode(tokenizer, wheres, [(i, "'text'", t) for i, t in texts])
            for (i, _), encoding in zip(texts, encoded, strict=True):
                # Empty where the post-processor's special tokens (a BOS) are all it holds.
                empty = all(encoding.special_tokens_mask)
                self.empty_texts += empty
                out[i] = np.asarray([] if empty else encoding.ids, dtype=np.int32), None
        if pairs:
            prompts = self._encode(tokenizer, wheres, [(i, "'prompt'", p) for i, p, _ in pairs])
            completions = self._encode(
                tokenizer,
                wheres,
                [(i, "'completion'", c) for i, _, c in pairs],
                add_special_tokens=False,
            )
            for (i, *_), prompt, completion in zip(pairs, prompts, completions, strict=True):
                answer = np.asarray(completion.ids, dtype=np.int32)
                if not answer.size:
                    self.empty_completions += 1
                    out[i] = answer, None
                    continue
                question = np.asarray(prompt.ids, dtype=np.int32)
                ignored = np.full(question.shape, IGNORE_INDEX, dtype=np.int32)
                out[i] = np.concatenate([question, answer]), np.concatenate([ignored, answer])
        if chats:
            self._tokenize_chats(wheres, chats, tokenizer, out)
        return out

    def _encode(
        self,
        tokenizer,
        wheres: Sequence[str],
        texts: Sequence[tuple[int, str, str]],
        add_special_tokens: bool = True,
    ) -> list:
        """``tokenizer.encode_batch`` of the texts of ``(record index, field, text)``;
        a text that is not Unicode (a lone surrogate, which JSON's escapes can write)
        refused naming its record and field, where the tokenizer would raise a
        TypeError naming neither."""
        batch = [text for *_, text in texts]
        try:
            return tokenizer.encode_batch(batch, add_special_tokens=add_special_tokens)
        except (TypeError, ValueError):
            for i, field, text in texts:
                if problem := not_unicode(text):
                    raise ValueError(f"{self.path}: {wheres[i]}: {field} {problem}") from None
            raise

    def _tokenize_chats(
        self,
        wheres: Sequence[str],
        chats: Sequence[Chat],
        tokenizer,
        out: list[Tokens | list[Tokens] | None],
    ) -> None:
        """Renders each conversation with the chat template (one example, or one per
        learned assistant turn where it is split: :meth:`train.chat.ChatTemplate.examples`
        under ``chat_turns``) and tokenizes the texts in one ``encode_batch`` call (no
        special tokens added: the template wrote them), labelling the tokens of the
        assistant turns (:func:`train.chat.assistant_labels`). An example without a
        learned token is dropped; a conversation left without one is empty."""
        if self.chat_template is None:
            field = _conversation_field(chats[0].learned_from)
            where = f"{self.path}: {wheres[chats[0].index]}: has {field} but"
            folder = tokenizer_file(self.tokenizer).parent
            self.chat_template = ChatTemplate(
                folder, where, self.chat_template_kwargs, self.chat_template_path
            )
        rendered: list[tuple[int, list[tuple[str, list[tuple[int, int]]]], bool]] = []
        for i, messages, tools, kwargs, learned_from in chats:
            turns = [j for j, m in enumerate(messages) if m["role"] == ASSISTANT]
            if turns and turns[0] == 0 and learned_from == 0:
                self.opening_turns += 1  # context: nothing before it to answer
            if not any(j >= max(learned_from, 1) for j in turns):
                self.empty_conversations += 1
                self.empty_completion_turns += learned_from > 0
                out[i] = np.zeros(0, np.int32), None
                continue
            field = _conversation_field(learned_from)
            try:
                examples, split = self.chat_template.examples(
                    messages, tools, kwargs, self.chat_turns, learned_from
                )
            except RewrittenTurns as e:
                raise ChatTurnsError(f"{self.path}: {wheres[i]}: {field}: {e}") from None
            except ChatTemplateError as e:
                raise ValueError(f"{self.path}: {wheres[i]}: {field}: {e}") from None
            texts = [text for text, _ in examples]
            roles, reasoning = unrendered(messages, texts, learned_from, tools)
            for role in roles:
                self.unrendered_roles[role] = self.unrendered_roles.get(role, 0) + 1
            self.unrendered_reasoning += reasoning
            rendered.append((i, examples, split))
        texts = [(i, "'messages'", text) for i, examples, _ in rendered for text, _ in examples]
        encodings = iter(self._encode(tokenizer, wheres, texts, add_special_tokens=False))
        for i, examples, split in rendered:
            tokens = []
            mine = itertools.islice(encodings, len(examples))
            for (text, spans), encoding in zip(examples, mine, strict=True):
                learned = np.asarray(assistant_labels(encoding.ids, encoding.offsets, spans), bool)
                if learned.any():
                    ids = np.asarray(encoding.ids, dtype=np.int32)
                    labels = np.where(learned, ids, np.int32(IGNORE_INDEX)).astype(np.int32)
                    end = self._through_last_eos(ids, encoding.offsets, text)
                    tokens.append((ids[:end], labels[:end]))
            if not tokens:
                self.empty_conversations += 1
                self.unrendered_turns += 1
                out[i] = np.zeros(0, np.int32), None
            elif split:
                self.split_conversations += 1
                self.split_examples += len(tokens)
                out[i] = tokens
            else:
                (out[i],) = tokens

    def _through_last_eos(self, ids: np.ndarray, offsets, text: str) -> int:
        """How many of a rendered conversation's tokens to keep: through its last EOS
        (the tokenizer's `eos_token`) where only white space follows it (ChatML's
        `<|im_end|>\n` where `<|im_end|>` is the EOS, as Qwen's tokenizers name it), so
        that the packing adds no second EOS after it to be learned; all of them
        elsewhere."""
        if self._eos is None:
            self._eos = special_token_ids(tokenizer_file(self.tokenizer)).get("eos_token", -1)
        if not len(ids) or ids[-1] == self._eos:
            return len(ids)
        (found,) = np.nonzero(ids == self._eos)
        if found.size and not text[offsets[found[-1]][1] :].strip():
            return int(found[-1]) + 1
        return len(ids)

    def _messages(self, where: str, value: Any, key: str = MESSAGES) -> list[dict[str, Any]]:
        """A conversation's messages (the record's ``key``) as the template gets them:
        each a dict with a str ``role``; a ``content`` str or list of text parts, which
        only a message with ``tool_calls`` may lack; ``tool_calls`` a
        list of function calls; keys whose value is None dropped at every depth (module
        docstring), the others passed as they are. ValueError naming the record, the
        message and the field."""
        prefix = f"{self.path}: {where}: {key!r}"
        shape = "a list of {'role': str, 'content': str} dicts"
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{prefix} must be {shape}, got {type(value).__name__}")
        messages = []
        for n, message in enumerate(value):
            if not isinstance(message, dict):
                raise ValueError(
                    f"{prefix}[{n}] must be a dict with str 'role' and 'content', got "
                    f"{type(message).__name__}"
                )
            message = _without_none(message)
            field = f"{prefix}[{n}]"
            if "role" not in message:
                raise ValueError(f"{field} has no 'role' (each message needs a str one)")
            if not isinstance(message["role"], str):
                raise ValueError(
                    f"{field}: 'role' must be a str, got {type(message['role']).__name__}"
                )
            if "tool_calls" in message:
                _check_tool_calls(field, message["tool_calls"])
            if "content" in message:
                _check_content(field, message["content"])
            elif "tool_calls" not in message:
                raise ValueError(
                    f"{field} has no 'content' (each message needs a str or a list of text "
                    "parts; only one with 'tool_calls' may go without)"
                )
            messages.append(message)
        return messages

    def _chat(
        self,
        where: str,
        index: int,
        record: dict,
        messages: list[dict[str, Any]],
        learned_from: int,
    ) -> Chat:
        """Record ``index``'s conversation: its ``messages``, and its ``tools`` and
        ``chat_template_kwargs`` (keys whose value is None dropped at every depth);
        ValueError naming the record and the field where they are malformed."""
        tools = self._tools(where, record.get(TOOLS))
        kwargs = _without_none(record.get(CHAT_TEMPLATE_KWARGS))
        if kwargs is not None:
            kwargs = template_kwargs(kwargs, f"{self.path}: {where}: {CHAT_TEMPLATE_KWARGS!r}")
        return Chat(index, messages, tools, kwargs, learned_from)

    def _tools(self, where: str, value: Any) -> list[dict[str, Any]] | None:
        """A conversation's ``tools`` (None where it has none): a list of dicts, the
        functions' JSON schemas, keys whose value is None dropped at every depth;
        ValueError naming the record and the field."""
        if value is None:
            return None
        prefix = f"{self.path}: {where}: 'tools'"
        if not isinstance(value, (list, tuple)):
            hint = " (a JSON string of them: parse it into the list)" * isinstance(value, str)
            raise ValueError(
                f"{prefix} must be a list of dicts (the functions' JSON schemas), got "
                f"{type(value).__name__}{hint}"
            )
        for n, tool in enumerate(value):
            if not isinstance(tool, dict):
                raise ValueError(
                    f"{prefix}[{n}] must be a dict (a function's JSON schema), got "
                    f"{type(tool).__name__}"
                )
        return [_without_none(tool) for tool in value]

    def _string(self, where: str, record: dict, key: str) -> str:
        """``record[key]``, a str; ValueError naming the record and the field otherwise."""
        prefix = f"{self.path}: {where}:"
        if key not in record:
            (other,) = set(PROMPT_COMPLETION) - {key}
            raise ValueError(
                f"{prefix} has {other!r} but no {key!r} (a prompt/completion record needs both)"
            )
        value = record[key]
        if not isinstance(value, str):
            hint = " (a conversation goes in one 'messages' list of role/content dicts)"
            raise ValueError(
                f"{prefix} {key!r} must be a str, got {type(value).__name__}"
                + (hint if isinstance(value, list) and key != "text" else "")
            )
        return value

    def _ids(
        self,
        where: str,
        key: str,
        value: Any,
        *,
        allow_ignore: bool = False,
        allow_empty: bool = False,
    ) -> np.ndarray:
        prefix = f"{self.path}: {where}: {key!r}"
        if isinstance(value, (str, bytes, dict)) or np.isscalar(value):
            raise ValueError(f"{prefix} must be a list of ints, got {type(value).__name__}")
        try:
            array = np.asarray(value)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{prefix} must be a list of ints ({e})") from None
        if array.ndim == 1 and array.size == 0 and allow_empty:
            return np.zeros(0, np.int32)
        if array.ndim != 1 or array.size == 0:
            raise ValueError(f"{prefix} must be a non-empty 1-D list of ints, shape {array.shape}")
        if not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"{prefix} must be a list of ints, got elements of {array.dtype}")
        ignored = (array == IGNORE_INDEX) if allow_ignore else np.zeros(array.shape, bool)
        for problem, bad in (
            ("is negative", (array < 0) & ~ignored),
            ("exceeds int32", array > _MAX_ID),
        ):
            if bad.any():
                pos = int(np.argmax(bad))
                raise ValueError(f"{prefix}: id {int(array[pos])} at position {pos} {problem}")
        return array.astype(np.int32)

    def _mask(self, where: str, value: Any, length: int) -> np.ndarray:
        """The tokens an HF ``attention_mask`` keeps (its 1s; its 0s mark padding, as
        ``tokenizer(..., padding=...)`` writes it): ValueError naming the record where it
        is not 0s and 1s as long as ``input_ids``, or masks every token."""
        mask = self._ids(where, ATTENTION_MASK, value)
        prefix = f"{self.path}: {where}: {ATTENTION_MASK!r}"
        if len(mask) != length:
            raise ValueError(f"{prefix} has {len(mask)} entries, 'input_ids' has {length}")
        if ((mask != 0) & (mask != 1)).any():
            raise ValueError(f"{prefix} must hold 0s and 1s, got {sorted(set(mask.tolist()))[:5]}")
        if not mask.any():
            raise ValueError(f"{prefix} masks every token (a record of padding alone)")
        return mask.astype(bool)

    def _labels(self, where: str, value: Any, length: int) -> np.ndarray:
        labels = self._ids(where, "labels", value, allow_ignore=True)
        if len(labels) != length:
            raise ValueError(
                f"{self.path}: {where}: 'labels' has {len(labels)} entries, "
                f"'input_ids' has {length}"
            )
        return labels

    def _get_tokenizer(self, where: str):
        """The tokenizer, loaded the first time; ``where``: the record needing it, and why."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.tokenizer, f"{self.path}: {where} but")
        return self._tokenizer


class NoTokenizerError(ValueError):
    """Text data and no tokenizer given. The message asks for the trainer's
    ``--tokenizer_name_or_path``; :meth:`asking_for` asks for another command's flag."""

    def __init__(self, where: str, remedy: str = ""):
        self.where = where
        remedy = remedy or (
            "--tokenizer_name_or_path (a tokenizer.json or its directory) or a model "
            "directory that holds tokenizer.json"
        )
        super().__init__(f"{where} no tokenizer was given; pass {remedy}")

    def asking_for(self, flag: str) -> NoTokenizerError:
        """The same error asking for ``flag`` (a tokenizer.json or its directory)."""
        return NoTokenizerError(self.where, f"{flag} (a tokenizer.json or its directory)")


def tokenizer_file(tokenizer: str | Path) -> Path:
    """The ``tokenizer.json`` that ``tokenizer`` names: the file, or the one in the directory."""
    path = Path(tokenizer)
    return path / "tokenizer.json" if path.is_dir() else path


def load_tokenizer(tokenizer: str | Path | None, where: str = "text data needs a tokenizer;"):
    """``tokenizers.Tokenizer`` from a ``tokenizer.json`` or its directory, with clear errors
    (``where`` starts each message)."""
    if tokenizer is None:
        raise NoTokenizerError(where)
    file = tokenizer_file(tokenizer)
    if not file.is_file():
        raise ValueError(f"{where} {file} does not exist")
    try:
        import tokenizers
    except ImportError:
        raise ValueError(
            f"{where} the 'tokenizers' package is missing (pip install 'jflash[text]' or "
            "tokenizers); or pre-tokenize the data into 'input_ids'"
        ) from None
    try:
        tokenizer = tokenizers.Tokenizer.from_file(str(file))
    except Exception as e:  # noqa: BLE001 - the Rust library's errors: name the file
        raise ValueError(f"{where} {file} is not a readable tokenizer ({e})") from None
    # Padding or truncation saved in the file (`enable_padding` / `enable_truncation`
    # before `save`) would pad each text to the longest of its batch, or cut it; an HF
    # tokenizer's call turns both off unless asked, and so does the trainer.
    tokenizer.no_padding()
    tokenizer.no_truncation()
    _check_special_token_flags(tokenizer, file)
    return tokenizer


def _check_special_token_flags(tokenizer, file: Path) -> None:
    """ValueError where ``tokenizer_config.json`` sets ``add_bos_token`` or
    ``add_eos_token`` (an unset one reads false, as transformers reads it) and the
    ``tokenizer.json`` post-processor adds otherwise: transformers then builds a text's
    special tokens from the flags, the ``tokenizers`` package from the post-processor,
    and the two would give the model other ids than ``AutoTokenizer`` does."""
    config = file.parent / "tokenizer_config.json"
    flags = read_json(config) if config.is_file() else {}
    flags = {k: flags[k] for k in ("add_bos_token", "add_eos_token") if k in flags}
    if not flags:
        return
    ids = special_token_ids(file)
    encoding = tokenizer.encode("a")
    encoded = encoding.ids
    text = [i for i, special in enumerate(encoding.special_tokens_mask) if not special]
    head, tail = (encoded[: text[0]], encoded[text[-1] + 1 :]) if text else (encoded, encoded)
    for flag, key, added in (
        ("add_bos_token", "bos_token", head),
        ("add_eos_token", "eos_token", tail),
    ):
        wanted = flags.get(flag, False)
        if not isinstance(wanted, bool):
            raise ValueError(f"{config}: {flag} {json.dumps(wanted)} must be true or false")
        if wanted and key not in ids:
            raise ValueError(f"{config}: {flag} is true but no {key} is named")
        if wanted != (key in ids and ids[key] in added):
            does = "adds no" if wanted else "adds the"
            raise ValueError(
                f"{config}: {flag} is {str(wanted).lower()} but {file.name}'s post-processor "
                f"{does} {key.split('_')[0].upper()}; transformers follows the flag, the trainer "
                "the post-processor: make them agree"
            )
