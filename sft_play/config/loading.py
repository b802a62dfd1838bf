"""Loading a run config: the YAML file, the overrides on top, and every problem at once."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from sft_play.config.environment import package_problems, path_problems
from sft_play.config.messages import schema_problems, validate_without_bad_keys
from sft_play.config.overrides import apply_overrides
from sft_play.config.schema import ConfigError, RunConfig, consistency_problems

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
            raw = yaml.safe_load(file.read_text(encoding="utf-8")) or {}
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
    return config
