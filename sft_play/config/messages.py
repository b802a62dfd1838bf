"""How config problems are said: unknown keys with the nearest valid one, bad values with what
the key accepts, and the config with every rejected key reset so the other checks still run."""

from __future__ import annotations

import difflib
import reprlib
import types
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import ValidationError

from sft_play.config.schema import SECTIONS, RunConfig, valid_keys

def _nearest(name: str, candidates: list[str]) -> str | None:
    matches = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return matches[0] if matches else None


# Keys other fine-tuning tools (transformers, TRL, LLaMA-Factory, Axolotl) use: ours, or what to do instead.
# A near spelling of one of them pointed elsewhere (warmup_steps -> train.max_steps).
PEER_KEYS = {
    "bf16": "train.mixed_precision", "fp16": "train.mixed_precision", "tf32": "train.mixed_precision",
    "cutoff_len": "data.max_seq_length", "max_length": "data.max_seq_length", "sequence_len": "data.max_seq_length",
    "max_seq_len": "data.max_seq_length", "model_max_length": "data.max_seq_length",
    "train_on_inputs": "data.train_on", "completion_only_loss": "data.train_on", "assistant_only_loss": "data.train_on",
    "sample_packing": "data.packing", "dataset": "data.path", "datasets": "data.path", "dataset_dir": "data.path",
    "val_set_size": "data.validation_fraction", "eval_dataset": "data.validation_path", "template": "data.chat_template",
    "num_train_epochs": "train.num_epochs", "per_device_train_batch_size": "train.micro_batch_size",
    "micro_batch_size": "train.micro_batch_size", "lr": "train.learning_rate", "lr_scheduler_type": "train.lr_scheduler",
    "optim": "train.optimizer", "output_dir": "train.output_dir", "resume_from_checkpoint": "train.resume_from",
    "eval_strategy": "train.eval_steps", "evaluation_strategy": "train.eval_steps", "save_strategy": "train.save_steps",
    "base_model": "model.name_or_path", "model_name_or_path": "model.name_or_path",
    "attn_implementation": "model.attn_implementation", "flash_attention": "model.attn_implementation",
    "load_in_4bit": "finetune.method", "adapter": "finetune.method", "finetuning_type": "finetune.method",
    "lora_r": "lora.r", "lora_rank": "lora.r", "lora_alpha": "lora.alpha", "lora_dropout": "lora.dropout",
    "lora_target": "lora.target_modules", "lora_target_modules": "lora.target_modules", "use_dora": "lora.use_dora",
    "deepspeed": "distributed.strategy", "fsdp": "distributed.strategy",
}
# Theirs with no key of ours: what to do instead
PEER_ADVICE = {
    "push_to_hub": "a run does not upload; when it ends, `hf upload <repo id> RUN/model` (or RUN/merged after "
                   "make merge) uploads it",
    "hub_model_id": "a run does not upload; when it ends, `hf upload <repo id> RUN/model` uploads it",
    "wandb_project": "set train.report_to=[wandb] and WANDB_PROJECT in the environment",
}


def unknown_key_message(dotted: str) -> str:
    parts = dotted.split(".")
    leaf = parts[-1]  # (LLaMA-Factory and Axolotl write their keys at the top level: cutoff_len, bf16)
    if leaf in PEER_ADVICE:
        return f"unknown key '{dotted}'; {PEER_ADVICE[leaf]}"
    if leaf in PEER_KEYS and PEER_KEYS[leaf] != dotted:
        return f"unknown key '{dotted}'; did you mean '{PEER_KEYS[leaf]}'?"
    if len(parts) == 1:
        if dotted in SECTIONS:  # a section given a value of its own (train=5)
            example = f"{dotted}.{_keys_of(dotted)[0]}"
            return f"'{dotted}' is a section, not a key: set one of its keys, e.g. {example}=..."
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


def _keys_of(section: str) -> list[str]:
    return [k.split(".", 1)[1] for k in valid_keys() if k.startswith(section + ".")]


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
        inner = _expected_text(get_args(annotation)[0])
        for article in ("a ", "an "):
            if inner.startswith(article):
                return "a list of " + inner[len(article):] + "s"
        return "a list, each " + inner
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
        got = _short(first.get("input"))
        if dotted in keys:
            annotation = field_annotation(dotted)
            constraint = next((i for i in items if i["type"] in {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number"}), None)
            if constraint is not None:
                problems.append(f"{dotted}: got {got!r}; {constraint['msg'].replace('Input should be', 'must be')}")
            else:
                problems.append(f"{dotted}: got {got!r}; expected {_expected_text(annotation)}")
        else:
            problems.append(f"{dotted}: {first['msg']} (got {got!r})")
    return problems


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 3, 8, 8, 120, 120


class _short(str):
    """A value as an error quotes it, cut to a line (reprlib: a value can be megabytes)."""

    def __new__(cls, value: Any) -> str:
        return super().__new__(cls, _REPR.repr(value))

    def __repr__(self) -> str:
        return str(self)


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
