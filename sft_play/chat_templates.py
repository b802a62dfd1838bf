"""Chat templates by name: ``data.chat_template: llama3`` instead of a template's Jinja.

Our own two (``chatml``, and ``plain``: what a tokenizer without a template gets) and the models'
templates TRL ships. Kept below the config so that a config naming an unknown template is told at
once, with the names."""

from __future__ import annotations

import os
import re

# For tokenizers that ship no chat template; plain text markers need no new tokens. It starts with
# the tokenizer's BOS where it names one (a prompt/completion record gets one where the tokenizer adds
# it to text: GPT-2's names <|endoftext|> as BOS but adds none).
DEFAULT_CHAT_TEMPLATE = (
    "{%- if bos_token %}{{- bos_token }}{%- endif %}"
    "{%- if tools %}{{- '### Tools:\\n' }}{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{%- endfor %}"
    "{{- '\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{{- message['content'] + '\\n\\n' }}"
    "{%- elif message['role'] == 'user' %}{{- '### User:\\n' + message['content'] + '\\n\\n' }}"
    "{%- elif message['role'] == 'assistant' %}{{- '### Assistant:\\n' }}"
    "{%- generation %}{{- message['content'] }}"
    "{%- for call in message['tool_calls'] or [] %}{{- '\\n<tool_call>' + (call['function'] | tojson) + '</tool_call>' }}"
    "{%- endfor %}{{- eos_token }}{%- endgeneration %}{{- '\\n\\n' }}"
    "{%- else %}{{- '### ' + message['role'] + ':\\n' + message['content'] + '\\n\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '### Assistant:\\n' }}{%- endif %}"
)

# ChatML (<|im_start|>role ... <|im_end|>), with the assistant turns marked for the loss mask
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}{{- '\\n' }}"
    "{%- else %}{{- message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_IMAGE_TEMPLATES = re.compile(r"(_vl|llava|idefics|smolvlm)")
BUILTIN_TEMPLATES = {"chatml": CHATML_TEMPLATE, "plain": DEFAULT_CHAT_TEMPLATE}


def _trl_templates() -> dict[str, str]:
    """The chat templates TRL ships (trl/chat_templates/*.jinja), by name: the models' own templates
    as published, each replaced by its ``_training`` variant where TRL has one (the same rendering
    with ``{% generation %}`` markers, and earlier turns rendered as a prefix). Found without
    importing TRL."""
    import importlib.util

    spec = importlib.util.find_spec("trl")
    if spec is None or not spec.submodule_search_locations:
        return {}
    folder = os.path.join(next(iter(spec.submodule_search_locations)), "chat_templates")
    files = sorted(f for f in os.listdir(folder) if f.endswith(".jinja")) if os.path.isdir(folder) else []
    names = {f[: -len(".jinja")]: os.path.join(folder, f) for f in files
             if not _IMAGE_TEMPLATES.search(f)}  # content as lists of text and image blocks: not our records
    return {name: names.get(f"{name}_training", path) for name, path in names.items() if not name.endswith("_training")}


def chat_template_names() -> list[str]:
    """The names ``data.chat_template`` accepts besides inline Jinja and a .jinja file."""
    return sorted({*BUILTIN_TEMPLATES, *_trl_templates()})


def is_inline_template(value: str) -> bool:
    return "{{" in value or "{%" in value


def named_template(name: str) -> str | None:
    """The Jinja of a named template (:func:`chat_template_names`), or None for another name."""
    if name in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[name]
    path = _trl_templates().get(name)
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        return f.read()
