"""Turning canonical records into training tokens: ``input_ids`` and ``labels``.

Labels are ``-100`` on every token the model should not learn to produce: with
``data.train_on: completion`` that is everything but the assistant turns (chat) or the
completion (prompt/completion); ``last``: but the last assistant turn (earlier turns are
context only); with ``train_on: all`` no token is masked. Plain text is
always learned in full.

Chat records go through the chat template. Where the template marks assistant turns with
``{% generation %}`` the tokenizer returns the assistant mask itself; otherwise each assistant
turn's characters are found by rendering the conversation up to that turn and the tokens that
overlap them are kept (which needs a template that renders a conversation's prefix as a prefix
of the whole; a template that does not is reported).
"""

from __future__ import annotations

import functools
import os
import re
from typing import Any

from sft_play.chat_templates import DEFAULT_CHAT_TEMPLATE, chat_template_names, is_inline_template, named_template
from sft_play.errors import UserError

IGNORE_INDEX = -100


def resolve_chat_template(tokenizer: Any, override: str | None) -> str:
    """The template chat records go through: the config's override (a name of
    :func:`chat_template_names`, inline Jinja or a .jinja file), else the tokenizer's own, else
    :data:`DEFAULT_CHAT_TEMPLATE`."""
    if override:
        if override.endswith((".jinja", ".j2")) and os.path.isfile(override):
            with open(override, encoding="utf-8") as f:
                return f.read()
        if not is_inline_template(override):
            template = named_template(override)
            if template is None:  # the config's check says so first; here for callers that skip it
                raise ValueError(f"data.chat_template: '{override}' is not a template name ("
                                 f"{', '.join(chat_template_names())}), a .jinja file or inline Jinja")
            return template
        return override
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one
        template = template.get("default") or next(iter(template.values()))
    return template or DEFAULT_CHAT_TEMPLATE


def has_generation_markers(template: str) -> bool:
    return "generation" in template and "endgeneration" in template


def _encode_chat_with_markers(tokenizer: Any, messages: list[dict], template: str,
                              tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    out = tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
        tools=tools,
    )
    ids = list(out["input_ids"])
    mask = list(out["assistant_masks"])
    return ids, [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]


def encode_chats_with_markers(tokenizer: Any, conversations: list[list[dict]], template: str,
                              train_on: str) -> list[tuple[list[int], list[int]]]:
    """:func:`encode_chat` of many conversations through a template with ``{% generation %}``
    markers, in one call: the tokenizer renders them all, then tokenises them as one batch
    (twice as fast as one call per conversation)."""
    out = tokenizer.apply_chat_template(
        conversations, chat_template=template, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    encoded = []
    for ids, mask in zip(out["input_ids"], out["assistant_masks"]):
        ids = list(ids)
        encoded.append((ids, _trained_on(ids, [t if m else IGNORE_INDEX for t, m in zip(ids, mask)], train_on)))
    return encoded


def _encode_chat_by_spans(tokenizer: Any, messages: list[dict], template: str,
                          tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    full, spans = assistant_spans(tokenizer, messages, template, tools)
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    return ids, labelled_in(ids, encoded["offset_mapping"], spans)


def labelled_in(ids: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """Labels of the tokens `ids` (at character `offsets`): their id where they overlap one of `spans`."""
    return [t if any(start < end_tok and begin_tok < end for start, end in spans) else IGNORE_INDEX
            for t, (begin_tok, end_tok) in zip(ids, offsets)]


def assistant_spans(tokenizer: Any, messages: list[dict], template: str,
                    tools: list[dict] | None = None) -> tuple[str, list[tuple[int, int]]]:
    """A conversation rendered through `template`, and the characters of each assistant turn in it,
    found by rendering the conversation up to each turn."""
    full = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, tools=tools)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(
            messages[:i], chat_template=template, tokenize=False, add_generation_prompt=True, tools=tools
        ) if i else ""
        through = tokenizer.apply_chat_template(messages[: i + 1], chat_template=template, tokenize=False, tools=tools)
        if not (full.startswith(through) and through.startswith(before)):
            raise UserError(
                "the chat template does not render a conversation's beginning as a prefix of the whole (it "
                "changes earlier turns as later ones come, as templates that drop past reasoning do), so the "
                "assistant turns cannot be located; use a template with {% generation %} markers "
                "(data.chat_template: e.g. qwen3 is TRL's training variant of Qwen3's) or data.train_on=all"
            )
        spans.append((len(before), len(through)))
    return full, spans


def encode_chat(tokenizer: Any, messages: list[dict], template: str, train_on: str,
                tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    """Token ids of a conversation (with the `tools` it may call) and their labels (see the module docstring)."""
    if has_generation_markers(template):
        ids, labels = _encode_chat_with_markers(tokenizer, messages, template, tools)
    else:
        ids, labels = _encode_chat_by_spans(tokenizer, messages, template, tools)
    return ids, _trained_on(ids, labels, train_on)


def _trained_on(ids: list[int], labels: list[int], train_on: str) -> list[int]:
    """A chat's `labels` (every assistant turn) for ``data.train_on``: all of `ids`, the last turn, or as they are."""
    return list(ids) if train_on == "all" else last_turn_only(labels) if train_on == "last" else labels


def last_turn_only(labels: list[int]) -> list[int]:
    """`labels` with only the last assistant turn kept (``data.train_on: last``): each turn's
    labelled tokens are one run, turns apart (a user or tool turn lies between), so the last run."""
    end = max((i for i, label in enumerate(labels) if label != IGNORE_INDEX), default=-1) + 1
    start = end
    while start > 0 and labels[start - 1] != IGNORE_INDEX:
        start -= 1
    return [label if start <= i < end else IGNORE_INDEX for i, label in enumerate(labels)]


def _eos(tokenizer: Any) -> list[int]:
    return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []


def encode_prompt_completion(tokenizer: Any, prompt: str, completion: str, train_on: str) -> tuple[list[int], list[int]]:
    """Prompt tokens (with the tokenizer's BOS, if any) then completion tokens and EOS.

    The two halves are tokenised apart so that no token straddles the boundary and the label
    mask falls exactly on the completion.
    """
    prompt_ids = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    if prompt_ids and tokenizer.eos_token_id is not None and prompt_ids[-1] == tokenizer.eos_token_id:
        prompt_ids = prompt_ids[:-1]  # tokenizers that append EOS to every text
    completion_ids = list(tokenizer(completion, add_special_tokens=False)["input_ids"]) + _eos(tokenizer)
    ids = prompt_ids + completion_ids
    if train_on == "all":
        return ids, list(ids)
    return ids, [IGNORE_INDEX] * len(prompt_ids) + completion_ids


def encode_text(tokenizer: Any, text: str) -> tuple[list[int], list[int]]:
    """Plain text, learned in full, ending with EOS."""
    ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    if not ids or ids[-1] != tokenizer.eos_token_id:
        ids += _eos(tokenizer)
    return ids, list(ids)


def uses_tools(record: dict[str, Any]) -> bool:
    return bool(record.get("tools")) or any(m.get("tool_calls") for m in record.get("messages") or [])


def renders_tools(template: str) -> bool:
    """Whether a chat template renders tool calls (and tools): one that does not drops them in silence."""
    return "tool_calls" in template


def prompt_turns_unlabelled(record: dict[str, Any], labels: list[int], train_on: str) -> list[int]:
    """`labels` of a conversation whose first ``prompt_turns`` turns are a prompt (TRL's
    conversational prompt-completion) without the prompt's assistant turns where every assistant
    turn trains (``data.train_on: completion``; ``last`` keeps the completion's last turn alone,
    ``all`` every token): each assistant turn's labels are one run, so the first runs."""
    context = record.get("prompt_turns") or 0
    answered = sum(1 for message in record["messages"][:context] if message["role"] == "assistant")
    if not answered or train_on != "completion":
        return labels
    out, runs, inside = list(labels), 0, False
    for i, label in enumerate(out):
        if label != IGNORE_INDEX and not inside:
            runs += 1
        inside = label != IGNORE_INDEX
        if inside and runs <= answered:
            out[i] = IGNORE_INDEX
    return out


def encode_record(record: dict[str, Any], tokenizer: Any, template: str, train_on: str) -> tuple[list[int], list[int]]:
    """Tokens and labels of one canonical record (see :mod:`sft_play.data.formats`)."""
    if record.get("messages") is not None:
        ids, labels = encode_chat(tokenizer, record["messages"], template, train_on, record.get("tools"))
        return ids, prompt_turns_unlabelled(record, labels, train_on)
    if record.get("prompt") is not None:
        return encode_prompt_completion(tokenizer, record["prompt"], record["completion"], train_on)
    return encode_text(tokenizer, record["text"])


# --- special tokens written in the text --------------------------------------------------------

# A special token's text inside a record ("<|im_start|>assistant" in a user's message) is read by
# the tokenizer as the token itself: the user's text can open a turn. data.special_tokens_in_text
# says what happens to it: kept as the tokenizer reads it (said by make check and data-stats),
# escaped (a WORD JOINER after its first character: the same text, read as text), or refused.
WORD_JOINER = "\u2060"
# What is text a person wrote: the messages' contents (and their parts' text), prompts, completions,
# plain text; not roles, tool calls' names and arguments, or images' paths
_FIELDS = ("messages", "prompt", "completion", "text")
_TEXT = frozenset({"content", "text", "prompt", "completion"})


def text_markers(tokenizer: Any) -> tuple[str, ...]:
    """The tokenizer's special tokens that text can spell (longest first, so that one that contains
    another is found whole)."""
    found = set(getattr(tokenizer, "all_special_tokens", None) or ())
    found |= {token.content for token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values()
              if getattr(token, "special", False)}
    return tuple(sorted((marker for marker in found if len(marker) > 1), key=lambda m: (-len(m), m)))


def markers_in(record: dict[str, Any], markers: tuple[str, ...]) -> dict[str, int]:
    """How often each of `markers` is written in `record`'s text (messages' contents, prompt,
    completion, text)."""
    found: dict[str, int] = {}
    if not markers:
        return found
    pattern = _pattern(markers)
    for text in _texts(record):
        for marker in pattern.findall(text):
            found[marker] = found.get(marker, 0) + 1
    return found


def escape_markers(record: dict[str, Any], markers: tuple[str, ...]) -> dict[str, Any]:
    """`record` with every marker in its text written so that the tokenizer reads it as text."""
    pattern = _pattern(markers)

    def escaped(value: Any, key: str | None = None) -> Any:
        if isinstance(value, str):
            return pattern.sub(lambda m: m.group()[0] + WORD_JOINER + m.group()[1:], value) if key in _TEXT else value
        if isinstance(value, dict):
            return {k: escaped(v, k) for k, v in value.items()}
        if isinstance(value, list):
            return [escaped(v, key) for v in value]
        return value

    return {key: escaped(record[key], key) if key in _FIELDS else record[key] for key in record}


@functools.lru_cache(maxsize=8)
def _pattern(markers: tuple[str, ...]) -> re.Pattern:
    return re.compile("|".join(map(re.escape, markers)))  # (longest first: one containing another is found whole)


def _texts(record: dict[str, Any]):
    def walk(value: Any, key: str | None = None):
        if isinstance(value, str):
            if key in _TEXT:
                yield value
        elif isinstance(value, dict):
            for k, v in value.items():
                yield from walk(v, k)
        elif isinstance(value, list):
            for v in value:
                yield from walk(v, key)

    for key in _FIELDS:
        if record.get(key) is not None:
            yield from walk(record[key], key)
