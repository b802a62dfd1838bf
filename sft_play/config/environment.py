"""What a config needs from the machine it runs on: the local files it names (model folder,
data, templates, DeepSpeed JSON) and the optional packages its settings need. Checked by
:func:`sft_play.config.load` unless ``check_paths`` is off (packages: always)."""

from __future__ import annotations

import glob
import importlib.machinery
import importlib.util
import os
import re
import sys
from pathlib import Path

from sft_play import chat_templates
from sft_play.config.schema import RunConfig
from sft_play.parallelism import Strategy

def _looks_like_local_path(text: str) -> bool:
    return (
        text.startswith((".", "/", "~"))
        or os.path.exists(os.path.expanduser(text))
        or bool(re.search(r"\.(jsonl?|csv|parquet|arrow|txt)$", text))
        or any(ch in text for ch in "*?[")
        or text.count("/") > 1
    )


_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")


def _what_it_is(path: Path) -> str:
    """What a model folder without a config.json is, when it is something of ours or peft's."""
    import json

    if (path / "adapter_config.json").is_file():
        try:
            base = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
        except (OSError, ValueError):
            base = None
        run = path.parent if (path.parent / "run.json").is_file() else None
        return (": it is a LoRA adapter" + (f" of '{base}'" if base else "") + ". To fine-tune on from it, merge it "
                "into its base" + (f" (make merge RUN={run}) and set model.name_or_path={run / 'merged'}" if run
                                   else " (peft's merge_and_unload) and point model.name_or_path at the merged folder"))
    for inner in ("merged", "model"):
        if (path / inner / "config.json").is_file() or (path / inner / "adapter_config.json").is_file():
            return f": it is a run folder; its model is in {path / inner}" + (
                "" if (path / inner / "config.json").is_file() else " (an adapter: make merge RUN=... first)")
    return ""


def path_problems(config: RunConfig) -> list[str]:
    problems = []
    model_path = config.model.name_or_path
    if _looks_like_local_path(model_path):
        path = Path(model_path).expanduser()
        build_with = config.model.build_with
        if build_with and not Path(build_with).is_file():
            problems.append(f"model.build_with: file '{build_with}' does not exist")
        if build_with and not path.is_dir():
            if path.name != "model":
                problems.append(f"model.build_with: model.name_or_path ({model_path}) must be a run's model folder, "
                                "<output_dir>/<run_name>/model, for the run that builds it to write it there")
        elif not path.is_dir():
            problems.append(f"model.name_or_path: folder '{model_path}' does not exist")
        elif not (path / "config.json").is_file():
            problems.append(f"model.name_or_path: '{model_path}' has no config.json" + _what_it_is(path))
    elif not _HUB_ID.match(model_path):
        problems.append(f"model.name_or_path: '{model_path}' is neither a local folder nor a hub id (org/name)")
    tokenizer = config.model.tokenizer_name_or_path
    if tokenizer and _looks_like_local_path(tokenizer) and not Path(tokenizer).expanduser().is_dir():
        problems.append(f"model.tokenizer_name_or_path: folder '{tokenizer}' does not exist")

    for key in ("path", "validation_path"):
        value = getattr(config.data, key)
        for entry in [value] if isinstance(value, str) else (value or []):
            if not _looks_like_local_path(entry):
                continue  # a hub dataset name, resolved when the data loads
            expanded = os.path.expanduser(entry)
            if any(ch in entry for ch in "*?["):
                if not glob.glob(expanded, recursive=True):
                    problems.append(f"data.{key}: no file matches '{entry}'")
            elif not os.path.exists(expanded):
                problems.append(f"data.{key}: file '{entry}' does not exist")
    template = config.data.chat_template
    if template and template.endswith((".jinja", ".j2")):
        if not os.path.isfile(template):
            problems.append(f"data.chat_template: file '{template}' does not exist")
    elif template and not chat_templates.is_inline_template(template) and chat_templates.named_template(template) is None:
        problems.append(f"data.chat_template: '{template}' is no template name we know, nor a .jinja file, nor inline "
                        f"Jinja; the names: {', '.join(chat_templates.chat_template_names())}")
    if Strategy(config.distributed.strategy).deepspeed and not os.path.isfile(config.distributed.deepspeed_config):
        problems.append(f"distributed.deepspeed_config: file '{config.distributed.deepspeed_config}' does not exist")
    return problems


def _installed(package: str) -> bool:
    """Whether `package` can be imported from this environment's paths; a process that hid it from
    itself (``lean_imports.without_bitsandbytes``: planning runs no kernel) still sees it installed."""
    if package in sys.modules and sys.modules[package] is None:  # hidden: look where it would be imported from
        return importlib.machinery.PathFinder.find_spec(package) is not None
    return importlib.util.find_spec(package) is not None


def package_problems(config: RunConfig) -> list[str]:
    """Settings that need a package this environment lacks, with how to install it."""
    problems = []
    train, method = config.train, config.finetune.method
    if method == "qlora" and not _installed("bitsandbytes"):
        problems.append("finetune.method: qlora needs bitsandbytes; run `make install` (or pip install bitsandbytes)")
    if train.optimizer in {"adamw_8bit", "paged_adamw_8bit"} and not _installed("bitsandbytes"):
        problems.append(f"train.optimizer: {train.optimizer} needs bitsandbytes; run `make install`")
    if config.model.attn_implementation == "flash_attention_2" and not _installed("flash_attn"):
        problems.append(
            "model.attn_implementation: flash_attention_2 needs the flash-attn package "
            "(pip install flash-attn --no-build-isolation); or use 'sdpa'"
        )
    for tracker in train.report_to:
        if not _installed(tracker):
            problems.append(f"train.report_to: {tracker} needs its package (pip install {tracker.replace('_', '-')} "
                            "into .venv), or leave it out")
    if train.liger_kernels and not _installed("liger_kernel"):
        problems.append("train.liger_kernels: needs the liger-kernel package (pip install liger-kernel); or set it false")
    return problems
