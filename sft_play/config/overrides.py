"""``section.key=value`` overrides: parsing them (values read as YAML, mappings typed the way
people type them on a command line) and applying them to the raw YAML mapping."""

from __future__ import annotations

import types
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from sft_play.config.messages import field_annotation, unknown_key_message
from sft_play.config.schema import SECTIONS, ConfigError, valid_keys

def parse_override(text: str) -> tuple[str, Any]:
    """Split ``section.key=value``; the value is read as YAML (``true``, ``4``, ``[a, b]``).

    A mapping may be written the way people type it on a command line, without spaces (which
    make would split): ``data.columns={prompt:question,completion:answer}`` or
    ``data.columns=prompt:question,completion:answer``; one entry at a time also works,
    ``data.columns.prompt=question``.
    """
    if "=" not in text:
        raise ConfigError([f"override {text!r} is not of the form section.key=value"])
    key, raw = text.split("=", 1)
    key = key.strip()
    if _is_mapping_key(key):
        return key, _parse_mapping(raw)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def _is_mapping_key(dotted: str) -> bool:
    section, _, name = dotted.partition(".")
    fields = SECTIONS[section].model_fields if section in SECTIONS else {}
    return name in fields and get_origin(fields[name].annotation) is dict


def _parse_mapping(raw: str) -> Any:
    """``{a:b,c:d}``, ``a:b,c:d`` or YAML flow mapping text as a dict (other text as YAML)."""
    text = raw.strip()
    try:
        value = yaml.safe_load(text) if text else {}
    except yaml.YAMLError:
        value = None
    if isinstance(value, dict) and all(v is not None for v in value.values()):
        return {str(k): str(v) for k, v in value.items()}
    inner = text[1:-1] if text.startswith("{") and text.endswith("}") else text
    mapping: dict[str, str] = {}
    for entry in filter(None, (part.strip() for part in inner.split(","))):
        name, separator, target = entry.partition(":")
        if not separator:
            name, separator, target = entry.partition("=")
        if not separator or not name.strip() or not target.strip():
            return raw  # not a mapping: validation reports it with the form to use
        mapping[name.strip()] = target.strip()
    return mapping


def _only_strings(annotation: Any) -> bool:
    """Whether a field takes nothing but text (str, optional str, or a choice of strings)."""
    args = [a for a in get_args(annotation) if a is not type(None)]
    if get_origin(annotation) is Literal:
        return all(isinstance(a, str) for a in get_args(annotation))
    if get_origin(annotation) in (Union, types.UnionType):
        return all(_only_strings(a) for a in args)
    return annotation is str


def _set_dotted(raw: dict[str, Any], dotted: str, value: Any) -> None:
    section, _, key = dotted.partition(".")
    target = raw.setdefault(section, {})
    if not isinstance(target, dict):
        raise ConfigError([f"section '{section}' must be a mapping, got {target!r}"])
    target[key] = value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> list[str]:
    """Apply `overrides` to the raw mapping `raw` in order; returns the problems found."""
    problems: list[str] = []
    for text in overrides:
        try:
            key, value = parse_override(text)
        except ConfigError as exc:
            problems.extend(exc.problems)
            continue
        if key.count(".") == 2 and _is_mapping_key(key.rsplit(".", 1)[0]):  # data.columns.prompt=question
            key, entry = key.rsplit(".", 1)
            section, name = key.split(".")
            current = raw.get(section, {}).get(name) if isinstance(raw.get(section), dict) else None
            value = {**(current if isinstance(current, dict) else {}), entry: str(value)}
        if key not in valid_keys():
            problems.append(unknown_key_message(key) + f" (in override {text!r})")
            continue
        if _only_strings(field_annotation(key)) and not isinstance(value, str) and value is not None:
            value = text.split("=", 1)[1].strip()  # train.run_name=off is the name "off", not false
        _set_dotted(raw, key, value)
    return problems
