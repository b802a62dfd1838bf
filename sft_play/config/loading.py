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

class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (YAML keeps the last one,
    silently: a config with two learning rates trains with the second)."""

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
        if not file.is_file():
            raise ConfigError([f"config file '{path}' does not exist"])
        try:
            raw = yaml.load(file.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader) or {}
        except yaml.YAMLError as exc:
            raise ConfigError([f"config file '{path}' is not valid YAML: {exc}"], source) from exc
        if not isinstance(raw, dict):
            raise ConfigError([f"config file '{path}' must be a mapping of sections, got {type(raw).__name__}"], source)

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
