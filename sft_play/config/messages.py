"""How config problems are said: unknown keys with the nearest valid one, bad values with what
the key accepts, and the config with every rejected key reset so the other checks still run."""

from __future__ import annotations

import difflib
import types
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import ValidationError

from sft_play.config.schema import SECTIONS, RunConfig, valid_keys

def _nearest(name: str, candidates: list[str]) -> str | None:
    matches = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return matches[0] if matches else None


def unknown_key_message(dotted: str) -> str:
    parts = dotted.split(".")
    if len(parts) == 1:
        hint = _nearest(parts[0], list(SECTIONS))
        valid = ", ".join(SECTIONS)
        return f"unknown section '{dotted}'" + (f"; did you mean '{hint}'?" if hint else f"; sections are: {valid}")
    section, leaf = parts[0], parts[-1]
    keys = valid_keys()
    same_section = [k for k in keys if k.startswith(section + ".")]
    # the right leaf in the wrong section (train.method -> finetune.method) beats a near miss
    hint = next((k for k in keys if k.split(".")[-1] == leaf), None)
    hint = hint or _nearest(dotted, same_section) or _nearest(dotted, keys)
    if hint is None:
        hint = _nearest(leaf, [k.split(".")[-1] for k in keys])
        hint = next((k for k in keys if k.split(".")[-1] == hint), None) if hint else None
    return f"unknown key '{dotted}'" + (f"; did you mean '{hint}'?" if hint else "")


def _expected_text(annotation: Any) -> str:
    """Human text for what a field accepts, e.g. "an integer or 'auto'"."""
    origin = get_origin(annotation)
    if origin is Literal:
        choices = get_args(annotation)
        return repr(choices[0]) if len(choices) == 1 else "one of " + ", ".join(repr(a) for a in choices)
    if origin is Union or origin is types.UnionType:
        parts = [_expected_text(a) for a in get_args(annotation) if a is not type(None)]
        text = " or ".join(parts)
        return text + (" or null" if type(None) in get_args(annotation) else "")
    if origin is list:
        return "a list of " + _expected_text(get_args(annotation)[0]) + "s"
    if origin is dict:
        return "a mapping, e.g. data.columns.prompt=question (one entry per override) or {prompt:question,completion:answer}"
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def field_annotation(dotted: str) -> Any:
    section, key = dotted.split(".", 1)
    return SECTIONS[section].model_fields[key].annotation


def schema_problems(error: ValidationError) -> list[str]:
    """One message per bad key, merging pydantic's per-union-member errors."""
    keys = set(valid_keys())
    by_key: dict[str, list[dict]] = {}
    for item in error.errors():
        loc = [str(p) for p in item["loc"]]
        dotted = ".".join(loc[:2])
        if item["type"] == "extra_forbidden":
            by_key.setdefault("!" + ".".join(loc), []).append(item)
            continue
        if dotted not in keys:
            dotted = ".".join(loc[:1])
        by_key.setdefault(dotted, []).append(item)
    problems = []
    for dotted, items in by_key.items():
        if dotted.startswith("!"):
            problems.append(unknown_key_message(dotted[1:]))
            continue
        first = items[0]
        got = first.get("input")
        if dotted in keys:
            annotation = field_annotation(dotted)
            constraint = next((i for i in items if i["type"] in {"greater_than", "greater_than_equal", "less_than"}), None)
            if constraint is not None:
                problems.append(f"{dotted}: got {got!r}; {constraint['msg'].replace('Input should be', 'must be')}")
            else:
                problems.append(f"{dotted}: got {got!r}; expected {_expected_text(annotation)}")
        else:
            problems.append(f"{dotted}: {first['msg']} (got {got!r})")
    return problems


def validate_without_bad_keys(raw: dict[str, Any], error: ValidationError) -> RunConfig:
    """The config with every rejected key reset to its default, so that the remaining checks
    (paths, consistency) can still run and all problems are reported together."""
    cleaned = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for item in error.errors():
        loc = [str(p) for p in item["loc"]]
        if len(loc) == 1:
            cleaned.pop(loc[0], None)
        elif isinstance(cleaned.get(loc[0]), dict):
            cleaned[loc[0]].pop(loc[1], None)
    try:
        return RunConfig.model_validate(cleaned)
    except ValidationError:
        return RunConfig()
