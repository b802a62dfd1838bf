"""A process does not import the kernel packages it will not use.

bitsandbytes is slow to import (on import it registers its CPU operators through torch's
inductor), and peft imports it whenever it is installed. Only QLoRA and the 8-bit optimizers use
it; a planning process never does (QLoRA is planned from transformers' rule for which linears it
would quantise, on meta-device linears). Such processes see it as absent:
``importlib.util.find_spec`` answers None, as peft and transformers ask.

DeepSpeed the same way: accelerate imports it in every training process where it is installed
(``extract_model_from_parallel``, which TRL's SFTTrainer calls through ``is_peft_model``); only
the DeepSpeed strategies use it. What each import costs a process's start is measured in
docs/reports/test_suite.md.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from sft_play import config as config_module
from sft_play.parallelism import Strategy


def needs_bitsandbytes(config: Any) -> bool:
    """Whether training `config` (a :class:`sft_play.config.RunConfig`) uses bitsandbytes."""
    optimizer = config.train.optimizer
    return config.finetune.method == "qlora" or "8bit" in optimizer or "paged" in optimizer


def needs_deepspeed(config: Any) -> bool:
    """Whether training `config` uses DeepSpeed: its strategy, or its tiled MLPs (DeepSpeed's TiledMLP)."""
    return Strategy(config.distributed.strategy).deepspeed or config.train.tiled_mlp


def for_training(config: Any) -> None:
    """Before a training process imports the model stack: skip what `config`'s run does not use."""
    if not needs_bitsandbytes(config):
        without_bitsandbytes()  # about 2 s of the start on 2 cores
    if not needs_deepspeed(config):
        _absent("deepspeed")


def for_run_folder(run: str | Path) -> None:
    """Before a command that uses a finished run (merge, generate, chat, eval) imports the model
    stack: skip bitsandbytes when the run's saved config did not use it."""
    run = Path(run)
    saved = next((p / "config.yaml" for p in (run, run.parent) if (p / "config.yaml").is_file()), None)
    _absent("deepspeed")  # merging, generating and evaluating never shard
    try:
        if saved is not None and not needs_bitsandbytes(config_module.load(saved, check_paths=False)):
            without_bitsandbytes()
    except config_module.ConfigError:
        return


def without_bitsandbytes() -> None:
    """Make this process see bitsandbytes as absent. Call it before anything imports it (peft,
    transformers' quantizers); a no-op once it is imported."""
    _absent("bitsandbytes")


def needed(package: str) -> None:
    """Undo :func:`_absent` for `package` (a lever that needs it was chosen after the process
    skipped it, e.g. a remedy the planner traces)."""
    if package in sys.modules and sys.modules[package] is None:
        del sys.modules[package]


def _absent(package: str) -> None:
    if package not in sys.modules:
        sys.modules[package] = None  # type: ignore[assignment]


def sanitized_cuda_arch_list(value: str | None) -> str | None:
    """``TORCH_CUDA_ARCH_LIST`` without architecture suffixes (``9.0a`` -> ``9.0``): DeepSpeed
    0.19 parses each entry as numbers and fails on ``9.0a`` ("invalid literal for int()")."""
    if not value:
        return value
    return re.sub(r"(\d+\.\d+)[a-z]+", r"\1", value)
