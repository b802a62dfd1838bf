"""Using what a run wrote (found by :func:`sft_play.run_folder.resolve_run`): load it (adapter, merged or full model), generate answers
(with the base model's beside them), merge an adapter into its base, and evaluate.

A run folder (``train.output_dir/<run name>``) holds ``config.yaml`` and ``model/``; ``make
merge`` adds ``merged/``. Every function here accepts a run folder, or a model folder inside
one (``<run>/model``, ``<run>/merged``), or any folder holding a full model.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sft_play import architecture, data, hardware, hub, model_card, patches
from sft_play import config as config_module
from sft_play.config import RunConfig
from sft_play.data.collate import make_collator
from sft_play.data.formats import text_of
from sft_play.errors import UserError, hub_error
from sft_play.model import (TORCH_DTYPES, keep_cpu_4bit_inference_general, load_tokenizer, quantization_config,
                             quiet_loading, weights_location)
from sft_play.precision import Precision, inference_dtype, resolve_precision
from sft_play.run import collator_kind


def _locate(path: Path) -> tuple[Path, RunConfig | None]:
    """(model folder, the run's config if known) for a run folder or a model folder."""
    if (path / "config.yaml").is_file():
        if not (path / "model").is_dir():
            raise FileNotFoundError(f"{path} has no model/ folder: did the run finish? (see {path}/checkpoints)")
        return path / "model", run_config(path)
    return path, (run_config(path.parent) if (path.parent / "config.yaml").is_file() else None)


def run_config(run: Path) -> RunConfig:
    """A run folder's ``config.yaml``, its local paths relative to where the run trained: a
    relative model, tokenizer or data path (``configs/tiny_model``) that does not exist from here
    but does from the folder the run started in (``run.json``'s ``workdir``) is made absolute
    there, so that a run is used from any folder, as a model folder would be."""
    config = config_module.load(run / "config.yaml", check_paths=False)
    try:
        workdir = json.loads((run / "run.json").read_text()).get("workdir")
    except (OSError, ValueError):
        workdir = None
    if not workdir:
        return config

    def moved(value: str | None) -> str | None:
        if not value or os.path.isabs(value) or os.path.exists(value) or not os.path.exists(os.path.join(workdir, value)):
            return value
        return os.path.join(workdir, value)

    model, data_config = config.model, config.data
    model.name_or_path = moved(model.name_or_path) or model.name_or_path
    model.tokenizer_name_or_path = moved(model.tokenizer_name_or_path)
    data_config.path = [moved(p) for p in data_config.path] if isinstance(data_config.path, list) else moved(data_config.path)
    if isinstance(data_config.validation_path, list):
        data_config.validation_path = [moved(p) for p in data_config.validation_path]
    else:
        data_config.validation_path = moved(data_config.validation_path)
    return config


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def precision_here(config: RunConfig | None, device: str) -> Precision:
    """The run's precision on the device at hand, by the rule training used
    (:func:`sft_play.precision.resolve_precision`): a run trained in bf16 on an H100 and merged
    on a T4 gets fp16 there, as it would have trained there."""
    on_cuda = device.startswith("cuda")
    bf16 = hardware.cuda_device_bf16(device) if on_cuda else False  # the CPU infers and de-quantises in fp32
    if config is None:  # a model folder outside a run: its 16-bit dtype where the GPU has one
        mixed = "bf16" if bf16 else "fp16" if on_cuda else "no"
        return Precision(mixed=mixed, weights_dtype="float32")
    return resolve_precision(config, has_gpu=on_cuda, bf16_supported=bf16)


def loading_dtype(config: RunConfig | None, device: str) -> torch.dtype:
    """The dtype a run's model is loaded in on `device` (:func:`sft_play.precision.inference_dtype`)."""
    return TORCH_DTYPES[inference_dtype(precision_here(config, device), device.startswith("cuda"))]


def _base_model(config: RunConfig, device: str, dtype: torch.dtype, quantized: bool) -> Any:
    """The run's base model as it trained (4-bit for QLoRA when `quantized`, with the compute
    dtype training used on this device; else in `dtype`)."""
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": config.model.trust_remote_code,
                              "use_safetensors": True}
    if quantized and config.finetune.method == "qlora":
        kwargs["quantization_config"] = quantization_config(config, precision_here(config, device))
        kwargs["device_map"] = {"": device}
    location = weights_location(config)
    hub.prepare(location)  # offline: at once, without the hub client's minute of retries
    model_class = architecture.model_class(architecture.load_model_config(
        config.model.name_or_path, config.model.revision, config.model.trust_remote_code))
    try:
        model = model_class.from_pretrained(location, **kwargs)
    except OSError as exc:
        raise hub_error(location, exc) from None
    if "quantization_config" in kwargs:
        keep_cpu_4bit_inference_general(model)
    return model


def load_trained(path: str | Path, device: str | None = None) -> tuple[Any, Any, RunConfig | None]:
    """(model, tokenizer, run config) for a run folder or a model folder, ready for inference; for
    a vision-language model the processor (with its tokenizer inside) in the tokenizer's place,
    as TRL's processing class.

    An adapter is loaded onto its base as the base trained (QLoRA: the 4-bit base), a merged or
    full model as it is. Raises FileNotFoundError for a folder with neither.
    """
    from transformers import AutoConfig, AutoProcessor, AutoTokenizer

    quiet_loading()
    model_dir, config = _locate(Path(path))
    device = device or default_device()
    dtype = loading_dtype(config, device)
    trust = bool(config and config.model.trust_remote_code)
    model_config = (AutoConfig.from_pretrained(model_dir, trust_remote_code=trust) if (model_dir / "config.json").is_file()
                    else architecture.load_model_config(config.model.name_or_path, config.model.revision, trust)
                    if config is not None else None)
    vision = model_config is not None and architecture.is_vision_language(model_config)
    tokenizer = (AutoProcessor if vision else AutoTokenizer).from_pretrained(model_dir)
    if (model_dir / "adapter_config.json").is_file():
        if config is None:
            raise FileNotFoundError(f"{model_dir} is an adapter outside a run folder: pass the run folder")
        from peft import PeftModel

        model = PeftModel.from_pretrained(_base_model(config, device, dtype, quantized=True), model_dir)
    elif (model_dir / "config.json").is_file():
        if not any(model_dir.glob("*.safetensors")):
            pickled = sorted(p.name for p in model_dir.glob("*.bin"))
            raise FileNotFoundError(f"{model_dir} has no safetensors weights" + (
                f" (only {', '.join(pickled)}: pickled files, which can run code and are not loaded here; convert "
                "them to safetensors where you trust them)" if pickled else ""))
        model = architecture.model_class(model_config).from_pretrained(model_dir, dtype=dtype, trust_remote_code=trust,
                                                                       use_safetensors=True)
    else:
        raise FileNotFoundError(f"{model_dir} holds neither an adapter nor a model")
    if not getattr(model, "is_loaded_in_4bit", False) and not hasattr(model, "hf_device_map"):
        model.to(device)
    return model.eval(), tokenizer, config


def text_tokenizer(processing: Any) -> Any:
    """The tokenizer of a processing class (:func:`load_trained`'s: a tokenizer, or a processor holding one)."""
    return processing.tokenizer if hasattr(processing, "image_processor") else processing


@dataclass
class Prompt:
    """A held-out question: the conversation up to the first answer (and the images it shows, as
    references: :mod:`sft_play.data.images`), or a plain prompt."""

    messages: list[dict[str, Any]] | None
    text: str | None
    reference: str
    images: list[dict[str, str]] | None = None

    def shown(self) -> str:
        if not self.messages:
            return self.text or ""
        shown = text_of(self.messages[-1]["content"])
        return f"[{len(self.images)} image(s)] {shown}" if self.images else shown


# Formats that train on text as it is (sft_play.data.formats): no chat template around the prompt
PLAIN_FORMATS = ("prompt_completion", "text")


def trained_on_plain_text(path: str | Path) -> bool:
    """Whether the run at `path` (a run folder, or its model/ or merged/ folder) trained on plain
    prompts without a chat template: every data source it read was prompt/completion or text, as
    its ``summary.json`` records. Unknown (no summary): False, the chat template."""
    path = Path(path)
    for folder in (path, path.parent):
        try:
            formats = json.loads((folder / "summary.json").read_text())["data"]["formats"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        return bool(formats) and all(fmt in PLAIN_FORMATS for fmt in formats.values())
    return False


def user_prompt(path: str | Path, text: str, image: str | None = None, given_as: str = "IMAGE=") -> Prompt:
    """`text` typed by a user, as the run at `path` was trained to read it: as it is after plain
    prompt/completion data, else a user message through the chat template (showing `image`, a
    file, first; `given_as` names how the user gave it, for the error).

    Raises:
        UserError: `image` cannot be read.
    """
    if image is not None:
        from sft_play.data import images

        try:
            ref = images.reference(image, Path.cwd(), given_as.strip(" ="))
        except images.ImageProblem as exc:
            raise UserError(f"{given_as}{image}: {exc.reason}") from None
        return Prompt([*system_turn(path), {"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": text}]}], None, "", [ref])
    if trained_on_plain_text(path):
        return Prompt(None, text, "")
    return Prompt([*system_turn(path), {"role": "user", "content": text}], None, "")


def system_turn(path: str | Path) -> list[dict[str, str]]:
    """The system message the run at `path` trained its chats with (``data.system_prompt``), if any."""
    try:
        config = _locate(Path(path))[1]
    except FileNotFoundError:
        return []
    prompt = config.data.system_prompt if config is not None else None
    return [{"role": "system", "content": prompt}] if prompt else []


def held_out_prompts(config: RunConfig, count: int) -> list[Prompt]:
    """The first `count` validation records of the run's data (``data.validation_path``'s, or
    those ``data.validation_fraction`` held out), cut before their first answer; a preference
    run's held-out pairs, with the chosen answer as the reference (KTO's labelled answers: a
    desirable one)."""
    if config.finetune.objective != "sft":
        from sft_play.data import preference

        pairs = preference.held_out_pairs(config.data, config.train.seed, count)
        # (KTO's labelled answers: the answer where desirable, else none)
        answers = [p["chosen"] if "chosen" in p else p["completion"] if p["label"] else None for p in pairs]
        return [Prompt(p["prompt"], None, text_of(a[-1]["content"]) if a is not None else "")
                if isinstance(p["prompt"], list) else Prompt(None, p["prompt"], a or "") for p, a in zip(pairs, answers)]
    prompts = []
    for record in data.validation_records(config.data, config.train.seed, limit=count):
        if "messages" in record:
            messages = record["messages"]
            context = record.get("prompt_turns") or 0  # a conversational prompt's turns, its answers among them
            first = next(i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= context)
            shown = sum(1 for m in messages[:first] if isinstance(m["content"], list)
                        for part in m["content"] if part.get("type") == "image")
            prompts.append(Prompt(messages[:first], None, text_of(messages[first]["content"]),
                                  (record.get("images") or [])[:shown] or None))
        elif "prompt" in record:
            prompts.append(Prompt(None, record["prompt"], record["completion"]))
    return prompts


def generate(model: Any, tokenizer: Any, prompt: Prompt | list[dict[str, str]], max_new_tokens: int = 64) -> str:
    """The model's greedy answer: chat prompts go through the chat template, plain prompts as they
    are; a prompt with images through a vision-language model's processor (`tokenizer`)."""
    if isinstance(prompt, list):
        prompt = Prompt(prompt, None, "")
    processor, tokenizer = tokenizer, text_tokenizer(tokenizer)
    if prompt.images and processor is tokenizer:
        raise UserError("the prompt shows an image, and this model reads text only")
    if prompt.images:
        from sft_play.data import images

        text = tokenizer.apply_chat_template(prompt.messages, add_generation_prompt=True, tokenize=False)
        try:
            pictures = [images.load(ref) for ref in prompt.images]
        except images.ImageProblem as exc:
            raise UserError(exc.reason) from None
        inputs = processor(text=[text], images=[pictures], add_special_tokens=False, return_tensors="pt")
    elif prompt.messages is not None:
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
def base_model_of(model: Any, config: RunConfig | None) -> Iterator[Any]:
    """The model before training: the adapter switched off, or the base weights reloaded."""
    if hasattr(model, "disable_adapter"):
        with model.disable_adapter():
            yield model
        return
    if config is None:
        raise UserError("this model folder is not inside a run folder, so its base is unknown")
    device = str(model.device)
    yield _base_model(config, device, model.dtype, quantized=False).to(device).eval()


def merge(path: str | Path, output: str | Path | None = None) -> Path:
    """Merge a run's LoRA/QLoRA adapter into its base and save a standalone model (safetensors)
    plus tokenizer that ``AutoModelForCausalLM.from_pretrained`` loads.

    LoRA merges into the base in its training dtype. QLoRA merges into the de-quantised base:
    the 4-bit weights the adapter trained against, expanded to the compute dtype (merging into a
    4-bit base would round the adapter away; merging into the original full-precision weights
    would not be the model that trained).

    Returns:
        The folder written (default ``<run>/merged``).
    """
    from peft import PeftModel
    from transformers import AutoTokenizer

    from transformers import AutoProcessor

    quiet_loading()
    model_dir, config = _locate(Path(path))
    if config is None:
        raise UserError(f"{path} is not a run folder (it needs config.yaml beside model/)")
    if not (model_dir / "adapter_config.json").is_file():
        raise UserError(f"{model_dir} is a full model already (finetune.method={config.finetune.method}): "
                        "nothing to merge; load it as it is")
    run_dir = model_dir.parent
    output = Path(output) if output else run_dir / "merged"
    device = default_device()
    dtype = loading_dtype(config, device)
    if config.finetune.method == "qlora":
        base = _base_model(config, device, dtype, quantized=True).dequantize()
    else:
        base = _base_model(config, device, dtype, quantized=False)
    merged = PeftModel.from_pretrained(base, model_dir).merge_and_unload()
    merged.config.name_or_path = str(output)
    merged.save_pretrained(output, safe_serialization=True)
    vision = architecture.is_vision_language(merged.config)
    (AutoProcessor if vision else AutoTokenizer).from_pretrained(model_dir).save_pretrained(output)
    (output / "sft_play_merge.json").write_text(json.dumps(
        {"run": str(run_dir), "method": config.finetune.method, "base": config.model.name_or_path,
         "dtype": str(dtype).removeprefix("torch.")}, indent=2) + "\n")
    model_card.write(run_dir, output, merged=True)
    _readable(output)
    return output


def _readable(folder: Path) -> None:
    """Give every file of `folder` the permissions a new file gets (safetensors writes through a
    private temporary file, mode 0600): a merged model is meant to be shared and served."""
    umask = os.umask(0)
    os.umask(umask)
    for file in folder.iterdir():
        if file.is_file():
            file.chmod(0o666 & ~umask)


def evaluate(path: str | Path, count: int = 5, max_new_tokens: int = 64, batch_size: int = 8,
             data_path: str | None = None, on_invalid: str | None = None) -> dict[str, Any]:
    """Loss and perplexity on the run's validation data (the tokens that carry loss, as in
    training), plus greedy answers to the first `count` held-out prompts; written to
    ``<run>/eval.json`` and returned. With `data_path` (a held-out test set, any source
    ``data.path`` takes; a source of splits gives its held-out split) the same on that data, read
    and tokenised as the run read its own (its bad rows refused or skipped as `on_invalid` says,
    else as the run's ``data.on_invalid``), written to ``<run>/eval-<name>.json``."""
    model, processing, config = load_trained(path)
    if config is None:
        raise UserError(f"{path} is not inside a run folder: its validation data is unknown")
    if data_path is not None and on_invalid is not None:
        config = config.model_copy(update={"data": config.data.model_copy(update={"on_invalid": on_invalid})})
    if config.finetune.objective != "sft":
        return evaluate_pairs(path, model, processing, config, count, max_new_tokens, batch_size, data_path)
    # (the run's own tokenizer, as it prepared the data; a vision-language model's in its processor)
    processor = processing if text_tokenizer(processing) is not processing else None
    tokenizer = processor.tokenizer if processor is not None else load_tokenizer(config)
    if data_path is not None:
        config = config.model_copy(update={"data": config.data.model_copy(
            update={"validation_path": data_path, "validation_fraction": 0.0})})
        stats = data.DataStats()
        rows = data.tokenize_file(data_path, tokenizer, config.data, stats, processor=processor)
        examples = stats.examples
        if len(rows) == 0:
            raise UserError(f"no usable example in {data_path} to evaluate on"
                            + (f": {data.skip_summary(stats)}" if stats.skipped else ""))
    elif not config.data.validation_path and not config.data.validation_fraction:
        raise UserError("the run has no validation data: set data.validation_path or data.validation_fraction, or "
                        "evaluate on other data (make eval DATA=test.jsonl)")
    else:
        bundle = data.build(config.data, tokenizer, seed=config.train.seed, processor=processor)
        rows, examples = bundle.validation, bundle.validation_stats.examples if bundle.validation_stats else None
    # Batches for the kernel the model was loaded with here (SDPA by default), not the training
    # run's: flash-attn may be missing on the machine that evaluates
    collator = make_collator(tokenizer.pad_token_id, collator_kind(config.data.packing, model.config._attn_implementation),
                             processor=processor if processor is not None and "images" in rows.column_names else None)
    loss_sum, tokens = 0.0, 0
    # TRL's chunked head, as in training: log-probabilities of the labels without b x s x V logits
    from trl.trainer.utils import add_fused_lm_head

    patches.labelled_positions_on_cpu()
    add_fused_lm_head(model.get_base_model() if hasattr(model, "get_base_model") else model)
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            batch = collator([rows[i] for i in range(start, min(start + batch_size, len(rows)))])
            batch = {k: v.to(model.device) for k, v in batch.items()}
            output = model(**batch, use_cache=False, fused_lm_head=True)
            loss_sum += float(-output.log_probs.double().sum())
            tokens += int(output.label_mask.sum())
    loss = loss_sum / max(1, tokens)
    generations = []
    for prompt in held_out_prompts(config, count):
        answer = generate(model, processing, prompt, max_new_tokens)
        generations.append({"prompt": prompt.shown(), "reference": prompt.reference, "answer": answer,
                            "exact_match": answer == prompt.reference})
    result = {"data": data_path or "the run's validation data", "loss": loss, "perplexity": math.exp(min(loss, 50.0)),
              "loss_tokens": tokens, "validation_rows": len(rows), "validation_examples": examples or len(rows),
              "generations": generations}
    model_dir, _ = _locate(Path(path))
    (model_dir.parent / eval_file_name(data_path)).write_text(json.dumps(result, indent=2) + "\n")
    return result


def _answer_logps(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The summed log-probabilities of each row's answer tokens (TRL's fused head, as DPO scores them)."""
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    output = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels,
                   use_cache=False, fused_lm_head=True)
    return output.log_probs[:, -(labels.shape[1] - 1):].double().sum(dim=1)


def _policy_and_reference_logps(model: Any, config: RunConfig, batches: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's summed answer log-probability under the trained model and under the reference
    the run trained against (the base with the adapter off, or the model it started from), through
    TRL's fused head as training scored them."""
    from trl.trainer.utils import add_fused_lm_head

    patches.labelled_positions_on_cpu()
    add_fused_lm_head(model.get_base_model() if hasattr(model, "get_base_model") else model)
    device = model.device
    with torch.no_grad():
        policy = torch.cat([_answer_logps(model, {k: v.to(device) for k, v in b.items()}) for b in batches]).cpu()
        with base_model_of(model, config) as reference_model:
            if reference_model is not model:
                add_fused_lm_head(reference_model)
            reference = torch.cat([_answer_logps(reference_model, {k: v.to(device) for k, v in b.items()})
                                   for b in batches]).cpu()
    return policy, reference


def evaluate_answers(path: str | Path, model: Any, tokenizer: Any, config: RunConfig, count: int, max_new_tokens: int,
                     batch_size: int, data_path: str | None) -> dict[str, Any]:
    """A KTO run's evaluation on held-out answers labelled one by one (or `data_path`'s): each
    answer's reward as KTO defines it, beta x (policy - reference) log-probability, with the
    reference the run trained against; ``reward_accuracy`` the share of answers whose reward has
    their label's sign (above 0 for a desirable one, below for an undesirable one; 0 before
    training). Greedy answers to the first `count` held-out prompts, beside the answer and its label."""
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

    from sft_play.data import preference

    rows = preference.answers_of(data_path, config, tokenizer)
    if not rows:
        raise UserError(f"no usable held-out answer in {data_path or config.data.validation_path or config.data.path}")
    collator = DataCollatorForUnpairedPreference(pad_token_id=tokenizer.pad_token_id,
                                                 max_length=config.data.max_seq_length)
    batches = [collator(rows[start:start + batch_size]) for start in range(0, len(rows), batch_size)]
    policy, reference = _policy_and_reference_logps(model, config, batches)
    labels = torch.tensor([bool(row["label"]) for row in rows])
    beta = config.preference.beta
    reward = beta * (policy - reference)
    if data_path is not None:
        config = config.model_copy(update={"data": config.data.model_copy(
            update={"validation_path": data_path, "validation_fraction": 0.0})})
    generations = []
    for record in preference.held_out_pairs(config.data, config.train.seed, count):
        shown = record["prompt"]
        prompt = Prompt(shown, None, "") if isinstance(shown, list) else Prompt(None, shown, "")
        given = text_of(record["completion"][-1]["content"]) if isinstance(record["completion"], list) else record["completion"]
        answer = generate(model, tokenizer, prompt, max_new_tokens)
        generations.append({"prompt": prompt.shown(), "given": given.strip(), "label": record["label"],
                            "answer": answer, "matches_given": answer == given.strip()})
    desirable, undesirable = reward[labels], reward[~labels]
    result = {"data": data_path or "the run's held-out answers", "answers": len(rows), "desirable": int(labels.sum()),
              "beta": beta, "reward_accuracy": float(((reward > 0) == labels).double().mean()),
              "desirable_reward": float(desirable.mean()) if len(desirable) else None,
              "undesirable_reward": float(undesirable.mean()) if len(undesirable) else None,
              "generations": generations}
    model_dir, _ = _locate(Path(path))
    (model_dir.parent / eval_file_name(data_path)).write_text(json.dumps(result, indent=2) + "\n")
    return result


def evaluate_pairs(path: str | Path, model: Any, tokenizer: Any, config: RunConfig, count: int, max_new_tokens: int,
                   batch_size: int, data_path: str | None) -> dict[str, Any]:
    """A preference run's evaluation on its held-out pairs (or `data_path`'s): the rewards as DPO
    defines them, beta x (policy - reference) log-probability of each answer, with the reference
    the run trained against (the base with the adapter off, or the model it started from; for
    ORPO and SimPO, which train against none, the model they started from too);
    ``reward_accuracy`` the share of pairs whose chosen answer's reward is the higher (TRL's
    ``rewards/accuracies``: 0 before training, where every reward is 0); ``preference_accuracy``
    the share of pairs whose chosen answer the model itself finds likelier, for the trained model
    and for the reference ("before"). Greedy answers to the first `count` held-out prompts, with
    whether they match the chosen or the rejected answer."""
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    from sft_play.data import preference

    if config.finetune.objective == "kto" and preference.labelled(config.data, config.train.seed, data_path):
        return evaluate_answers(path, model, tokenizer, config, count, max_new_tokens, batch_size, data_path)
    if data_path is not None:
        rows = preference.pairs_of(data_path, config.data, config.preference, tokenizer)
        config = config.model_copy(update={"data": config.data.model_copy(  # (its prompts for the generations)
            update={"validation_path": data_path, "validation_fraction": 0.0})})
    elif not config.data.validation_path and not config.data.validation_fraction:
        raise UserError("the run has no held-out pairs: set data.validation_path or data.validation_fraction, or "
                        "evaluate on other pairs (make eval DATA=pairs.jsonl)")
    else:
        rows = preference.build_pairs(config.data, config.preference, tokenizer, seed=config.train.seed).validation
    if rows is None or len(rows) == 0:
        raise UserError(f"no usable held-out pair in {data_path or config.data.validation_path}")
    collator = DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id, max_length=config.data.max_seq_length)
    columns = list(preference.PAIR_COLUMNS)
    batches = [collator([{c: rows[i][c] for c in columns} for i in range(start, min(start + batch_size, len(rows)))])
               for start in range(0, len(rows), batch_size)]
    policy, reference = _policy_and_reference_logps(model, config, batches)

    def sides(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # each batch is [chosen..., rejected...]
        chosen, rejected, at = [], [], 0
        for b in batches:
            half = b["input_ids"].shape[0] // 2
            chosen.append(values[at:at + half])
            rejected.append(values[at + half:at + 2 * half])
            at += 2 * half
        return torch.cat(chosen), torch.cat(rejected)

    (policy_chosen, policy_rejected), (ref_chosen, ref_rejected) = sides(policy), sides(reference)
    beta = config.preference.beta
    chosen_reward, rejected_reward = beta * (policy_chosen - ref_chosen), beta * (policy_rejected - ref_rejected)
    margin = chosen_reward - rejected_reward
    generations = []
    for pair, prompt in zip(preference.held_out_pairs(config.data, config.train.seed, count),
                            held_out_prompts(config, count)):
        answer = generate(model, tokenizer, prompt, max_new_tokens)
        rejected = (text_of(pair["rejected"][-1]["content"]) if prompt.messages is not None else pair["rejected"]).strip()
        generations.append({"prompt": prompt.shown(), "chosen": prompt.reference.strip(), "rejected": rejected,
                            "answer": answer, "matches_chosen": answer == prompt.reference.strip(),
                            "matches_rejected": answer == rejected})
    result = {"data": data_path or "the run's held-out pairs", "pairs": len(rows), "beta": beta,
              "reward_accuracy": float((margin > 0).double().mean()),
              "margin_mean": float(margin.mean()), "margin_min": float(margin.min()),
              "chosen_reward": float(chosen_reward.mean()), "rejected_reward": float(rejected_reward.mean()),
              "preference_accuracy": float((policy_chosen > policy_rejected).double().mean()),
              "preference_accuracy_before": float((ref_chosen > ref_rejected).double().mean()),
              "generations": generations}
    model_dir, _ = _locate(Path(path))
    (model_dir.parent / eval_file_name(data_path)).write_text(json.dumps(result, indent=2) + "\n")
    return result


def eval_file_name(data_path: str | None) -> str:
    """``eval.json`` for the run's own validation data; ``eval-<name>.json`` for other data (its
    file's or dataset's name, in characters a file name keeps)."""
    if data_path is None:
        return "eval.json"
    name = Path(data_path.rstrip("/")).name.split(".")[0] or "data"
    return "eval-" + "".join(c if c.isalnum() or c in "-_" else "_" for c in name) + ".json"
