"""The model card (``README.md``) of a model folder a run wrote: ``model/`` at the end of
training, ``merged/`` after ``make merge``. It is written from the run folder alone (its
``config.yaml``, ``run.json`` and ``summary.json``), so it says what trained and how, and how to
load the result, also after the folder is copied or pushed to a hub without the run around it.

It replaces the cards the libraries write: peft's template of "More Information Needed"
sections, and TRL's, which names a model "checkpoints" fine-tuned from "None".
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _what(config: dict[str, Any], run: dict[str, Any], merged: bool) -> str:
    method = (config.get("finetune") or {}).get("method", run.get("method", "full"))
    if method == "full":
        return "Every weight fine-tuned"
    configured = config.get("lora") or {}  # config.yaml's names, where run.json is missing
    lora = run.get("lora") or {"r": configured.get("r"), "alpha": configured.get("alpha", 0),
                               "dora": configured.get("use_dora"), "rslora": configured.get("use_rslora"),
                               "targets": configured.get("target_modules", "all-linear"),
                               "modules_to_save": configured.get("modules_to_save")}
    kind = "DoRA" if lora.get("dora") else "LoRA"
    scale = f"alpha {lora.get('alpha') or 0:g}" + (" / sqrt(r)" if lora.get("rslora") else "")
    ratio = run.get("loraplus_lr_ratio") or configured.get("loraplus_lr_ratio")
    if ratio:
        scale += f", LoRA+ (B at {ratio:g}x the learning rate)"
    targets = lora.get("targets", "all-linear")
    targets = targets if isinstance(targets, str) else ", ".join(targets)
    adapter = f"{kind} r {lora.get('r')}, {scale}, on {targets}"
    if lora.get("modules_to_save"):
        adapter += f" (and {', '.join(lora['modules_to_save'])} in full)"
    if method == "qlora":
        adapter = f"Q{adapter} over the base quantised to 4 bits"
    return f"An adapter ({adapter}), merged into its base" if merged else f"An adapter: {adapter}"


def _loading(method: str, merged: bool, base: str, base_weights: str | None, dtype: str | None,
             vision: bool = False) -> str:
    """How to load the model in Python. An adapter names its base as the run did: a relative
    folder, or a config-only one whose weights were initialised into the cache, loads from
    elsewhere than the adapter says, so the snippet loads the base from where the run did. A
    vision-language model loads as image-text-to-text, with its processor (peft's auto class
    would load its base as a causal LM)."""
    in_dtype = f", dtype={dtype!r}" if dtype else ""  # the base as it trained (else its config.json's dtype)
    model_class, reader = ("AutoModelForImageTextToText", "AutoProcessor") if vision else ("AutoModelForCausalLM",
                                                                                           "AutoTokenizer")
    name = "processor" if vision else "tokenizer"
    if method != "full" and not merged:
        if (base_weights and base_weights != base) or vision:
            why = ("initialised from its config.json, kept in SFT-Play's cache" if "init_weights" in (base_weights or "")
                   else "where the run loaded them from")
            return (f"from peft import PeftModel\nfrom transformers import {model_class}, {reader}\n\n"
                    f"BASE = {(base_weights or base)!r}  # the base's weights: {why}\n"
                    f"model = PeftModel.from_pretrained({model_class}.from_pretrained(BASE{in_dtype}), FOLDER)\n"
                    f"{name} = {reader}.from_pretrained(FOLDER)")
        return ("from peft import AutoPeftModelForCausalLM\nfrom transformers import AutoTokenizer\n\n"
                f"model = AutoPeftModelForCausalLM.from_pretrained(FOLDER{in_dtype})  # loads the base, then the adapter\n"
                "tokenizer = AutoTokenizer.from_pretrained(FOLDER)")
    return (f"from transformers import {model_class}, {reader}\n\n"
            f"model = {model_class}.from_pretrained(FOLDER)\n"
            f"{name} = {reader}.from_pretrained(FOLDER)")


def card(run_dir: Path, model_dir: Path, merged: bool = False) -> str:
    """The card's text for `model_dir`, the model of `run_dir` (merged into its base when `merged`)."""
    try:
        config_text = (run_dir / "config.yaml").read_text()
        config = yaml.safe_load(config_text) or {}
    except (OSError, yaml.YAMLError):
        config_text, config = "", {}
    run = _read_json(run_dir / "run.json")
    summary = _read_json(run_dir / "summary.json")
    model, train, data = config.get("model") or {}, config.get("train") or {}, config.get("data") or {}
    base = model.get("name_or_path", run.get("model", "?"))
    revision = model.get("revision")
    method = (config.get("finetune") or {}).get("method", run.get("method", "full"))
    on_hub = not os.path.isdir(base) and base.count("/") == 1 and not base.startswith((".", "/"))
    front = {"base_model": base} if on_hub else {}
    front.update({"library_name": "peft" if method != "full" and not merged else "transformers",
                  "pipeline_tag": "text-generation",
                  "tags": ["sft-play", "sft", "trl", method] + (["merged"] if merged else [])})

    stats = summary.get("data") or {}
    paths = data.get("path")
    paths = ", ".join(paths) if isinstance(paths, list) else str(paths)
    rows = [("data", f"{paths}: {stats.get('examples', 0):,} examples, {stats.get('tokens_total', 0):,} tokens"
                     f" (loss on {data.get('train_on', 'completion')})" if stats else paths)]
    sequence = (run.get("sequence") or {}).get("tokens", data.get("max_seq_length"))
    packed = " packed" if data.get("packing") else ""
    if summary.get("global_step") is not None:
        rows.append(("steps", f"{summary['global_step']:,} optimizer steps ({summary.get('batch', '?')}) of{packed} rows "
                              f"of up to {sequence} tokens: {summary.get('tokens_seen', 0):,} tokens trained on"))
    warmup = (f"{train['warmup_steps']} steps" if train.get("warmup_steps") is not None
              else f"{train.get('warmup_ratio')} of the steps")
    schedule = (f"{run.get('optimizer', train.get('optimizer'))}, learning rate {train.get('learning_rate')} "
                f"({train.get('lr_scheduler')}, warm-up {warmup}), weight decay "
                f"{train.get('weight_decay')}, seed {train.get('seed')}")
    rows.append(("optimizer", schedule))
    precision = run.get("precision") or {}
    parallel = run.get("parallel") or run  # run.json before the parallel part held these at its top level
    if precision:
        rows.append(("precision", f"{precision.get('mixed')} compute, weights {precision.get('weights_dtype')}, "
                                  f"{parallel.get('world_size', 1)} process(es), {parallel.get('strategy', 'ddp')}"))
    if summary.get("first_loss") is not None:
        rows.append(("training loss", f"{summary['first_loss']:.4g} -> {summary['last_loss']:.4g}"))
    if summary.get("last_eval_loss") is not None:
        rows.append(("validation loss", f"{summary['last_eval_loss']:.4g} (last evaluation)"))
    if summary.get("train_runtime_s"):
        segments = summary.get("segments", 1)
        rows.append(("time", f"{summary['train_runtime_s']:.0f} s of training"
                             + (f", in {segments} segments (stopped and resumed)" if segments > 1 else "")))

    lines = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "",
             f"# {run_dir.name}{' (merged)' if merged else ''}", "",
             f"{_what(config, run, merged)} of `{base}`" + (f" (revision `{revision}`)" if revision else "")
             + ", trained with SFT-Play on TRL's SFTTrainer.", "",
             "| | |", "|---|---|", *[f"| {name} | {value} |" for name, value in rows], "",
             "## Use", "", "```python", f"FOLDER = {str(model_dir)!r}",
             _loading(method, merged, base, run.get("base_weights"), (run.get("precision") or {}).get("weights_dtype"),
                      vision=bool(run.get("vision"))),
             "```", "",
             f"In the SFT-Play workspace: `make generate RUN={run_dir}` (held-out prompts), `make chat RUN={run_dir}`, "
             f"`make eval RUN={run_dir}`.", ""]
    if config_text:
        lines += ["## The run's settings (`config.yaml`)", "", "```yaml", config_text.rstrip(), "```", ""]
    return "\n".join(lines)


def write(run_dir: Path, model_dir: Path, merged: bool = False) -> Path:
    """Write the card into `model_dir` as ``README.md`` (replacing a library's); returns its path."""
    path = model_dir / "README.md"
    path.write_text(card(run_dir, model_dir, merged))
    return path
