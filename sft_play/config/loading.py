"""Loading a run config: the YAML file, the overrides on top, and every problem at once."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from sft_play.config.environment import package_problems, path_problems
from sft_play.config.messages import schema_problems, validate_without_bad_keys
from sft_play.config.overrides import apply_overrides
from sft_play.config.schema import ConfigError, RunConfig, consistency_problems

logger = logging.getLogger(__name__)
_SAID: set[str] = set()  # what unused_overrides said in this process: each once
# A run config is a few KB of settings: a file far larger, or YAML aliases that would expand it far
# beyond (an "alias bomb" of nested anchors), is not one
MAX_CONFIG_BYTES = 1 << 20
MAX_ALIASES = 100
MAX_VALUES = 100_000


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (YAML keeps the last one,
    silently: a config with two learning rates trains with the second), and more than
    :data:`MAX_ALIASES` aliases."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self.aliases_seen = getattr(self, "aliases_seen", 0) + 1
            if self.aliases_seen > MAX_ALIASES:
                raise yaml.composer.ComposerError(None, None, f"more than {MAX_ALIASES} aliases (*name): a run "
                                                  "config does not need them", self.peek_event().start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # <<: *anchor: its keys may be overridden here
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                hash(key)
            except TypeError:  # an unhashable key: the loader itself says what is wrong with it
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"'{key}' is given twice in one section (lines {seen[key]} and "
                    f"{key_node.start_mark.line + 1}); YAML would keep the second silently", key_node.start_mark)
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def load(path: str | os.PathLike | None, overrides: list[str] | None = None, check_paths: bool = True,
         check_packages: bool = True) -> RunConfig:
    """Read a YAML run config, apply ``key=value`` overrides, and validate the result.

    Args:
        path: YAML file; ``None`` starts from the defaults.
        overrides: ``section.key=value`` strings applied on top, in order.
        check_paths: also check that local model and data paths exist.
        check_packages: also check that the packages the settings need are installed here (off
            for planning hardware described rather than this machine's: it may have them).

    Returns:
        The validated :class:`RunConfig`.

    Raises:
        ConfigError: listing every problem found (unknown keys, bad values, missing files).
    """
    source = str(path) if path else "defaults"
    raw: dict[str, Any] = {}
    if path is not None:
        file = Path(path)
        if file.is_dir():
            yamls = sorted(p.name for p in [*file.glob("*.yaml"), *file.glob("*.yml")])
            listed = ", ".join(yamls[:3]) + (", ..." if len(yamls) > 3 else "")
            raise ConfigError([f"config file '{path}' is a folder: name a YAML file"
                               + (f" in it ({listed})" if yamls else "")])
        if not file.is_file():
            raise ConfigError([f"config file '{path}' does not exist"])
        if file.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError([f"config file '{path}' is {file.stat().st_size:,} bytes: a run config is a few KB of "
                               "YAML (is this the right file?)"], source)
        try:
            text = file.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError([f"config file '{path}' is not UTF-8 text (byte {exc.start}): is this the right "
                               "file?"], source) from exc
        try:
            raw = yaml.load(text, Loader=_UniqueKeyLoader) or {}
        except yaml.YAMLError as exc:
            raise ConfigError([f"config file '{path}' is not valid YAML: {yaml_problem(exc)}"], source) from exc
        if not isinstance(raw, dict):
            raise ConfigError([f"config file '{path}' must be a mapping of sections, got {type(raw).__name__}"], source)
        if _values(raw) > MAX_VALUES:
            raise ConfigError([f"config file '{path}' expands to more than {MAX_VALUES:,} values (through YAML "
                               "aliases): a run config is a few KB of settings"], source)

    problems = apply_overrides(raw, list(overrides or []))

    try:
        config = RunConfig.model_validate(raw)
    except ValidationError as exc:
        problems += schema_problems(exc)
        config = validate_without_bad_keys(raw, exc)
    problems += consistency_problems(config) + (package_problems(config) if check_packages else [])
    if check_paths:
        problems += path_problems(config)
    if problems:
        raise ConfigError(problems, source)
    for unused in unused_overrides(config, list(overrides or [])):
        if unused not in _SAID:
            _SAID.add(unused)
            logger.warning("%s", unused)
    return config


def unused_overrides(config: RunConfig, overrides: list[str]) -> list[str]:
    """What the overrides set that this run does not use: ``lora.*`` when every weight trains
    (``finetune.method=full``, the embedded default's), ``quantization.*`` without QLoRA; and,
    set anywhere, ``train.eval_steps`` without validation data."""
    keys = [text.split("=", 1)[0].strip() for text in overrides if "=" in text]
    method = config.finetune.method
    said = []
    for section, used, instead, what in (("lora", method != "full", "lora", "adapters"),
                                         ("quantization", method == "qlora", "qlora", "on a 4-bit base")):
        named = sorted({key for key in keys if key.startswith(f"{section}.")})
        if named and not used:
            said.append(f"{', '.join(named)} {'has' if len(named) == 1 else 'have'} no effect: finetune.method is "
                        f"{method} (set finetune.method={instead} to train {what})")
    data = config.data
    if config.train.eval_steps and not (data.validation_path or data.validation_fraction > 0):
        said.append(f"train.eval_steps={config.train.eval_steps} has no effect: there is no validation data (set "
                    "data.validation_path, or data.validation_fraction to hold some out)")
    return said


def yaml_problem(error: yaml.YAMLError) -> str:
    """What PyYAML found, in one line with its place, and the usual fix for a tab."""
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    tab = " (YAML indents with spaces, not tabs)" if "\\t" in problem or "'\\t'" in problem else ""
    return f"{problem}{where}{tab}"


def _values(document: Any) -> int:
    """How many values `document` holds once its aliases are expanded (each shared list or mapping
    counted as often as it appears), without expanding it."""
    sizes: dict[int, int] = {}

    def size(node: Any) -> int:
        if not isinstance(node, (list, dict)):
            return 1
        if id(node) not in sizes:
            sizes[id(node)] = 0  # a cycle counts once
            children = node.values() if isinstance(node, dict) else node
            sizes[id(node)] = 1 + sum(size(child) for child in children)
        return sizes[id(node)]

    return size(document)


def as_built(config: RunConfig) -> tuple[RunConfig, str | None]:
    """`config` to plan and check before its model exists: where ``model.name_or_path`` is a run's
    model folder not trained yet and ``model.build_with`` trains it, the model that run starts from
    stands in (the same shapes and tokenizer: a fine-tune changes neither), with a line that says so;
    else `config` itself and None."""
    from pathlib import Path

    if not config.model.build_with or Path(config.model.name_or_path).is_dir():
        return config, None
    built = load(config.model.build_with, check_paths=False, check_packages=False).model
    stand_in = config.model.model_copy(update={"name_or_path": built.name_or_path, "build_with": None,
                                               "tokenizer_name_or_path": built.tokenizer_name_or_path,
                                               "init_seed": built.init_seed})
    return (config.model_copy(update={"model": stand_in}),
            f"{config.model.name_or_path} does not exist yet (make train builds it first with "
            f"{config.model.build_with}): planned and checked with the model that run starts from, "
            f"{built.name_or_path}")
