"""Using what a run wrote: find the run, generate answers (with the base model's beside them),
chat. Runs are folders under ``train.output_dir`` holding ``config.yaml`` and ``model/``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sft_play.config import RunConfig


def finished_runs(output_dir: str | Path) -> list[Path]:
    """Run folders with a saved model, oldest first."""
    root = Path(output_dir)
    runs = [p for p in root.glob("*") if (p / "model").is_dir() and (p / "config.yaml").is_file()] if root.is_dir() else []
    return sorted(runs, key=lambda p: (p / "model").stat().st_mtime)


def resolve_run(run: str | None, output_dir: str | Path) -> Path:
    """`run` when given, else the newest finished run under `output_dir`.

    Raises:
        FileNotFoundError: with what to do, when there is no such run.
    """
    if run:
        path = Path(run)
        if not (path / "model").is_dir():
            raise FileNotFoundError(f"'{run}' is not a finished run folder (it has no model/); see `ls {output_dir}`")
        return path
    runs = finished_runs(output_dir)
    if not runs:
        raise FileNotFoundError(f"no finished run under '{output_dir}'; train one first with `make train`")
    return runs[-1]


@dataclass
class Prompt:
    """A held-out question: the conversation up to the first answer, or a plain prompt."""

    messages: list[dict[str, str]] | None
    text: str | None
    reference: str

    def shown(self) -> str:
        return self.messages[-1]["content"] if self.messages else (self.text or "")


def held_out_prompts(config: RunConfig, count: int) -> list[Prompt]:
    """The first `count` validation records of the run's data, cut before their first answer."""
    from sft_play.data import DataStats, load_records

    source = config.data.validation_path
    if not source:
        return []
    prompts = []
    for record in load_records(source, config.data, DataStats())[:count]:
        if "messages" in record:
            messages = record["messages"]
            first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
            prompts.append(Prompt(messages[:first], None, messages[first]["content"]))
        elif "prompt" in record:
            prompts.append(Prompt(None, record["prompt"], record["completion"]))
    return prompts


def generate(model: Any, tokenizer: Any, prompt: Prompt | list[dict[str, str]], max_new_tokens: int = 64) -> str:
    """The model's greedy answer: chat prompts go through the chat template, plain prompts as they are."""
    if isinstance(prompt, list):
        prompt = Prompt(prompt, None, "")
    if prompt.messages is not None:
        inputs = tokenizer.apply_chat_template(
            prompt.messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
    else:
        inputs = tokenizer(prompt.text, return_tensors="pt")
    inputs = inputs.to(model.device)
    with torch.no_grad():
        output = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()


@contextlib.contextmanager
def base_model_of(model: Any, config: RunConfig) -> Iterator[Any]:
    """The model before training: the adapter switched off, or the base weights reloaded."""
    if hasattr(model, "disable_adapter"):
        with model.disable_adapter():
            yield model
        return
    from transformers import AutoModelForCausalLM

    from sft_play.model import weights_location

    base = AutoModelForCausalLM.from_pretrained(
        weights_location(config), dtype=model.dtype, use_safetensors=True,
        trust_remote_code=config.model.trust_remote_code,
    ).to(model.device).eval()
    yield base
