"""Loading the tokenizer and the model: hub id or local folder, precision, attention kernel,
LoRA/QLoRA through peft and bitsandbytes.

A local folder that holds a ``config.json`` but no weights (the embedded tiny model, or a
config written by hand) gets weights initialised from the config with ``model.init_seed``.
They are written once, as safetensors, into a cache folder keyed by the config and seed, so
that every method (QLoRA included) loads through the same ``from_pretrained`` path and every
process and every later command (merge, generate) sees identical weights.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from sft_play import adapters, architecture, cache_usage, hub, patches
from sft_play.config import RunConfig
from sft_play.data.tokenize import resolve_chat_template
from sft_play.errors import UserError, hub_error
from sft_play.paths import cache_dir
from sft_play.precision import TORCH_DTYPE_NAMES, Precision, init_weights_dtype
from sft_play.run import Run

logger = logging.getLogger(__name__)

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
TORCH_DTYPES = {name: getattr(torch, name) for name in TORCH_DTYPE_NAMES}


def quiet_loading() -> None:
    """Turn off transformers' "Loading weights" and "Writing model shards" progress bars (they
    tell the user nothing; hub downloads keep their own bars)."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()


def has_weights(path: str) -> bool:
    folder = Path(path)
    return any((folder / name).exists() for name in WEIGHT_FILES)


def init_weights_dir(config_dir: str, seed: int, dtype: str = "float32") -> Path:
    """Where weights initialised from ``config_dir/config.json`` under `seed` in `dtype` are kept."""
    config_bytes = (Path(config_dir) / "config.json").read_bytes()
    salt = f"|seed={seed}" + ("" if dtype == "float32" else f"|dtype={dtype}")
    return cache_dir() / "init_weights" / hashlib.sha256(config_bytes + salt.encode()).hexdigest()[:16]


# A model this large without weights is more likely a download cut short than a model meant to
# start from random weights (the embedded default has 0.9M parameters)
RANDOM_INIT_WARNING_PARAMS = 100_000_000


def random_init_warning(config_dir: str, parameters: int) -> str | None:
    """What to say when a folder with a config.json and no weights holds a large model."""
    if parameters < RANDOM_INIT_WARNING_PARAMS:
        return None
    return (f"{config_dir} has no weights: its {parameters / 1e9:.1f}B-parameter model starts from random weights "
            "(training it from scratch); if you meant to fine-tune released weights, they are missing (a download "
            "cut short? hf download <id> --local-dir DIR)")


def _rough_parameter_count(model_config: Any) -> int:
    """About how many parameters a dense decoder of this config has (attention, gated MLP,
    embeddings and head), from its widths alone; 0 where they are missing."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    hidden, layers = getattr(text, "hidden_size", 0) or 0, getattr(text, "num_hidden_layers", 0) or 0
    inner, vocab = getattr(text, "intermediate_size", 0) or 0, getattr(text, "vocab_size", 0) or 0
    heads = getattr(text, "num_attention_heads", 0) or 1
    kv_width = (getattr(text, "num_key_value_heads", None) or heads) * (getattr(text, "head_dim", None) or hidden // heads)
    tied = getattr(text, "tie_word_embeddings", False)
    return layers * (2 * hidden * hidden + 2 * hidden * kv_width + 3 * hidden * inner) + (1 if tied else 2) * vocab * hidden


def materialise_init_weights(config_dir: str, seed: int, dtype: str = "float32") -> str:
    """A folder with weights initialised from ``config_dir/config.json`` under `seed`, in `dtype`.

    The folder is created once (atomically, so concurrent ranks cannot see half of it) and
    reused while the config, seed and dtype stay the same. The weights are built on the CPU
    (the CPU's random numbers are the same on every machine, a GPU's are not), in `dtype`, so a
    16-bit run needs 2 bytes per parameter of host memory, not 4.

    Raises:
        UserError: the host has too little memory to build them.
    """
    import psutil
    from transformers import AutoConfig

    target = init_weights_dir(config_dir, seed, dtype)
    model_config = AutoConfig.from_pretrained(config_dir)
    # (a rough count: no model is built here, which under ZeRO-3's zero.Init would be partitioned)
    warning = random_init_warning(config_dir, _rough_parameter_count(model_config))
    if warning:
        logger.warning("%s", warning)
    if has_weights(str(target)):
        cache_usage.used(target)
        return str(target)
    needed = architecture.parameter_count(model_config) * TORCH_DTYPES[dtype].itemsize
    available = psutil.virtual_memory().available
    if needed > 0.9 * available:
        raise UserError(
            f"{config_dir} has a config.json but no weights, and initialising random {dtype} weights for it needs "
            f"{needed / 1024**3:.1f} GiB of host memory ({available / 1024**3:.1f} GiB available): point "
            "model.name_or_path at real weights (a hub id or a folder with safetensors)"
        )
    logger.info("no weights in %s: initialising them from config.json with seed %d in %s", config_dir, seed, dtype)
    quiet_loading()  # and its "Writing model shards" bar
    torch.manual_seed(seed)
    save_init_weights(architecture.model_class(model_config).from_config(model_config, dtype=TORCH_DTYPES[dtype]), target)
    return str(target)


def save_init_weights(model: Any, target: Path) -> None:
    """Write `model` into `target` atomically (staged beside it, then renamed), so that
    concurrent ranks never see half of it; a process that got there first wins."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-")
    patches.save_from_every_rank(model)  # (each rank writes its own copy; the rename picks one)
    model.save_pretrained(staging, safe_serialization=True)
    try:
        os.rename(staging, target)
    except OSError:  # another process got there first
        shutil.rmtree(staging, ignore_errors=True)
        if not has_weights(str(target)):
            raise


def weights_source(config: RunConfig) -> tuple[bool, str]:
    """(whether the run can load its base weights here, from where): a local folder's files, or
    weights initialised from its bare config.json; a hub id's files in the local hub cache, or
    downloaded when training starts where the hub can be reached."""
    name, revision = config.model.name_or_path, config.model.revision
    if Path(name).is_dir():
        missing = missing_shards(Path(name))
        if missing:
            return False, (f"{name} lacks {len(missing)} of the files its index names ({', '.join(missing[:3])}"
                           f"{', ...' if len(missing) > 3 else ''}): a download or copy cut short? Fetch them again")
        if has_weights(name):
            return True, f"in {name}"
        return True, f"none in {name}: initialised from its config.json (model.init_seed {config.model.init_seed})"
    from huggingface_hub import try_to_load_from_cache

    for filename in WEIGHT_FILES:
        try:
            cached = try_to_load_from_cache(name, filename, revision=revision)
        except ValueError:  # not a valid repo id
            cached = None
        if isinstance(cached, str):
            return True, f"{name}: in the local hub cache"
    hub.prepare(name)
    if hub.offline():
        return False, (f"{name}'s weights are not in the local hub cache and the hub cannot be reached (or "
                       f"HF_HUB_OFFLINE is set): download them where there is a network (hf download {name}), "
                       "or point model.name_or_path at a local folder with them")
    return True, f"{name}: downloaded from the hub when training starts (not in the local cache yet)"


def missing_shards(folder: Path) -> list[str]:
    """The weight files a sharded checkpoint's index names that `folder` lacks."""
    import json

    missing: set[str] = set()
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        try:
            weight_map = json.loads((folder / index).read_text()).get("weight_map", {})
        except (OSError, ValueError):
            continue
        missing |= {f for f in set(weight_map.values()) if not (folder / f).is_file()}
    return sorted(missing)


def weights_location(config: RunConfig) -> str:
    """Where the base weights load from: the configured model, or initialised weights for a bare config."""
    path = config.model.name_or_path
    if Path(path).is_dir() and not has_weights(path):
        return materialise_init_weights(path, config.model.init_seed, init_weights_dtype(config))
    return path


TOKENIZER_PROBE = "The quick brown fox jumps over the lazy dog."
# A folder holds a tokenizer when it has one of these (transformers' fast and slow tokenizers)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model")


def load_tokenizer(config: RunConfig) -> Any:
    """The tokenizer, with the config's chat template override applied and a pad token set.

    Raises:
        UserError: the tokenizer cannot be loaded, or it cannot encode text (a folder with only a
            config.json gives a vocabulary of one that turns every text into nothing), or its
            vocabulary is larger than the model's embeddings.
    """
    source = config.model.tokenizer_name_or_path or config.model.name_or_path
    if Path(source).is_dir() and not any((Path(source) / name).is_file() for name in TOKENIZER_FILES):
        # said before transformers is imported: a folder with a config.json only (planning a model
        # from its config) learns it at once
        raise UserError(f"the tokenizer from '{source}' cannot encode text: the folder has no tokenizer files "
                        f"({', '.join(TOKENIZER_FILES[:3])}...). Set model.tokenizer_name_or_path to the model's "
                        "tokenizer (a hub id, or a folder with tokenizer.json)")
    from transformers import AutoTokenizer

    hub.prepare(source)
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            source, revision=config.model.revision, trust_remote_code=config.model.trust_remote_code
        )
    except OSError as exc:
        raise hub_error(source, exc, "tokenizer") from None
    except (ValueError, TypeError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"cannot load a tokenizer from '{source}' ({reason}); set model.tokenizer_name_or_path to the "
                        "model's tokenizer (a hub id, or a folder with tokenizer.json)") from None
    encoded = tokenizer(TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]
    if len(tokenizer) < 32 or len(encoded) < 2:
        raise UserError(
            f"the tokenizer from '{source}' cannot encode text: its vocabulary has {len(tokenizer)} token(s) and "
            f"'{TOKENIZER_PROBE}' becomes {len(encoded)} token(s) (the folder has no tokenizer files?). Set "
            "model.tokenizer_name_or_path to the model's tokenizer (a hub id, or a folder with tokenizer.json)"
        )
    vocab = architecture.vocab_size(architecture.load_model_config(
        config.model.name_or_path, config.model.revision, config.model.trust_remote_code))
    if vocab and len(tokenizer) > vocab:
        raise UserError(
            f"the tokenizer from '{source}' has {len(tokenizer)} tokens but the model embeds only {vocab}: they do not "
            "belong together. Set model.tokenizer_name_or_path to the model's own tokenizer"
        )
    if vocab and len(tokenizer) < vocab // 8:
        logger.warning("the tokenizer from %s has %d tokens, the model %d: is it the model's own tokenizer?",
                       source, len(tokenizer), vocab)
    if config.data.chat_template or not tokenizer.chat_template:
        # the template the chats train with, saved with the run's tokenizer: what generate and chat use
        tokenizer.chat_template = resolve_chat_template(tokenizer, config.data.chat_template)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_processor(config: RunConfig, tokenizer: Any) -> Any:
    """A vision-language model's processor (transformers' ``AutoProcessor``: its image processor,
    and how an image's placeholder becomes the tokens the image costs), with `tokenizer` (the run's,
    from :func:`load_tokenizer`) in it and ``data.image_max_pixels``/``image_min_pixels`` applied;
    None for a text model. Where the config names no chat template and the processor has one,
    the tokenizer takes the processor's (a vision model's template renders image parts).

    Raises:
        UserError: the processor cannot be loaded (no processor files; a package it needs missing).
    """
    model_config = architecture.load_model_config(config.model.name_or_path, config.model.revision,
                                                  config.model.trust_remote_code)
    if not architecture.is_vision_language(model_config):
        return None
    from transformers import AutoProcessor

    from sft_play.data.vision import apply_pixel_budget

    source = config.model.tokenizer_name_or_path or config.model.name_or_path
    hub.prepare(source)
    try:
        processor = AutoProcessor.from_pretrained(source, revision=config.model.revision,
                                                  trust_remote_code=config.model.trust_remote_code)
    except ImportError as exc:  # transformers names the package (torchvision for Qwen-VL's video processor)
        reason = " ".join(str(exc).split())[:300]
        raise UserError(f"cannot load the processor of '{source}': {reason}") from None
    except OSError as exc:
        raise hub_error(source, exc, "processor") from None
    except (ValueError, TypeError, KeyError) as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"cannot load a processor from '{source}' ({reason}): a vision-language model needs its "
                        "processor files (preprocessor_config.json or processor_config.json) beside the tokenizer") from None
    if getattr(processor, "image_processor", None) is None:
        raise UserError(f"the processor of '{source}' ({type(processor).__name__}) has no image processor")
    if not config.data.chat_template and getattr(processor, "chat_template", None):
        tokenizer.chat_template = processor.chat_template
    processor.tokenizer = tokenizer
    note = apply_pixel_budget(processor, config.data.image_max_pixels, config.data.image_min_pixels)
    logger.info("vision-language model: %s (%s)", type(processor).__name__, note)
    return processor


def quantization_config(config: RunConfig, precision: Precision) -> Any:
    """bitsandbytes 4-bit settings for QLoRA (None for the other methods)."""
    if config.finetune.method != "qlora":
        return None
    from transformers import BitsAndBytesConfig

    quant = config.quantization
    model_config = architecture.load_model_config(config.model.name_or_path, config.model.revision,
                                                  config.model.trust_remote_code)
    skipped = (architecture.unquantised(architecture.build_meta_model(model_config, config.model.trust_remote_code),
                                        config.finetune.train_projector)
               if architecture.is_vision_language(model_config) else None)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        llm_int8_skip_modules=skipped,
        bnb_4bit_quant_type=quant.quant_type,
        bnb_4bit_use_double_quant=quant.double_quant,  # what the run holds as run.double_quant
        bnb_4bit_compute_dtype=TORCH_DTYPES[precision.compute_dtype],
        bnb_4bit_quant_storage=getattr(torch, quant.quant_storage),
    )


def load_model(config: RunConfig, run: Run, device: str | None = None) -> Any:
    """The base causal LM, loaded in the resolved run's dtype with its attention kernel (4-bit
    linears for QLoRA).

    Args:
        config: the run config.
        run: the resolved run (:func:`sft_play.run.resolve`).
        device: where the model is placed at load, each rank its own (e.g. ``cuda:1``), so that
            large models never pass through host memory; under ZeRO-3 transformers loads them
            inside DeepSpeed's zero.Init, partitioned as they load, when the training arguments
            (and DeepSpeed's config with them) exist before this is called (sft_play.train).
    """
    precision = run.precision
    if config.model.trust_remote_code:
        logger.warning("model.trust_remote_code is on: running Python code shipped with %s", config.model.name_or_path)
    location = weights_location(config)
    quant = quantization_config(config, precision)
    kwargs: dict[str, Any] = {
        "dtype": TORCH_DTYPES[precision.weights_dtype],
        "attn_implementation": run.kernels.attention,
        "trust_remote_code": config.model.trust_remote_code,
        "use_safetensors": True,
    }
    if location == config.model.name_or_path:
        kwargs["revision"] = config.model.revision
    if quant is not None:
        kwargs["quantization_config"] = quant
    if run.kernels.experts:
        kwargs["experts_implementation"] = run.kernels.experts
    if not run.parallel.strategy.zero3 and (quant is not None or (device or "").startswith("cuda")):
        kwargs["device_map"] = {"": device or ("cuda:0" if run.on_cuda else "cpu")}
    hub.prepare(location)
    quiet_loading()
    model_class = architecture.model_class(architecture.load_model_config(
        config.model.name_or_path, config.model.revision, config.model.trust_remote_code))
    try:
        model = model_class.from_pretrained(location, **kwargs)
    except OSError as exc:
        raise hub_error(location, exc) from None
    freeze_vision(model, config)
    if not config.finetune.train_vision_tower:
        architecture.keep_out_of_backward(model, architecture.vision_parts(model)[0])
    if quant is not None and config.finetune.train_projector:
        for path in architecture.vision_parts(model)[1]:
            model.get_submodule(path).register_forward_pre_hook(_in_weights_dtype)
    if quant is not None:
        keep_cpu_4bit_inference_general(model)
    # Adapters and saved configs record where the base came from: the configured name, not a cache folder.
    model.name_or_path = model.config.name_or_path = config.model.name_or_path
    # Training never decodes; and with a cache, transformers stops separating packed examples.
    model.config.use_cache = False
    name_the_experts(model.config)
    if run.kernels.tiled_mlp:
        from sft_play import long_rows

        long_rows.tile_mlps(architecture.decoder_layers(model, architecture.num_layers(model.config)),
                            architecture.hidden_size(model.config))
    if run.kernels.compile_layers:
        compile_decoder_layers(model)
    return model


def load_reference(config: RunConfig, run: Run, device: str | None = None) -> Any:
    """A preference run's frozen reference (``preference.reference: copy``): the same weights as
    the policy loads, in the compute dtype (TRL would load it in the policy's, fp32 masters for
    full fine-tuning: twice the memory for the same forward under autocast); None where the run
    takes its reference otherwise."""
    if run.preference is None or run.preference.reference != "copy":
        return None
    precision = run.precision
    if precision.mixed != "no":  # loaded in it, not cast after: the fp32 masters' size never held twice
        precision = dataclasses.replace(precision, weights_dtype=precision.compute_dtype)
    reference = load_model(config, run.with_changes(precision=precision), device)
    reference.requires_grad_(False)
    return reference.eval()


def freeze_vision(model: Any, config: RunConfig) -> int:
    """Keep a vision-language model's vision encoder and projector frozen unless
    ``finetune.train_vision_tower``/``train_projector`` say otherwise (LoRA leaves them without
    adapters: :class:`sft_play.adapters.LoraSpec`); returns the parameters frozen (0 for a text model)."""
    towers, projectors = architecture.vision_parts(model)
    frozen, inside = architecture.frozen_parts(towers, projectors, config.finetune.train_vision_tower,
                                               config.finetune.train_projector)
    count = 0
    for name, parameter in model.named_parameters():
        if architecture.in_parts(name, frozen) and not architecture.in_parts(name, inside):
            parameter.requires_grad_(False)
            count += parameter.numel()
    return count


def _in_weights_dtype(module: Any, args: tuple) -> tuple:
    """A projector trained whole under QLoRA (architecture.unquantised) is bf16, as TRL casts every
    trainable weight of a quantised model; the 4-bit encoder before it computes in the compute
    dtype, fp32 without autocast, which a bf16 linear refuses: its input is cast to its weights'."""
    dtype = next(module.parameters()).dtype
    return tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


def name_the_experts(model_config: Any) -> None:
    """TRL's load-balancing loss reads the experts' count as ``num_experts``, which some families
    call otherwise (Granite-MoE ``num_local_experts``): training stopped there with an AttributeError.
    The count goes under that name too (a full fine-tune's saved config.json carries it)."""
    text = architecture.text_config(model_config)
    count, _ = architecture.experts(model_config)
    if count and getattr(text, "num_experts", None) is None:
        text.num_experts = count


def keep_cpu_4bit_inference_general(model: Any) -> None:
    """bitsandbytes repacks a 4-bit linear's weight for its AVX512-BF16 CPU kernel at the first
    forward without gradients (evaluation, generation), which needs the output features to be a
    multiple of 32 and the input features of the quantisation block (64): a model of other widths
    (a 96-wide test model) trained, then failed at its first evaluation. Those linears keep the
    general kernel, as on a CPU without AVX512-BF16; the others keep the fast one."""
    for module in model.modules():
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if getattr(module, "support_avx512bf16_for_cpu", False) and state is not None:
            out_features, in_features = state.shape[0], state.shape[1]
            if out_features % 32 or in_features % state.blocksize:
                module.support_avx512bf16_for_cpu = False


def compile_decoder_layers(model: Any) -> int:
    """``torch.compile`` every decoder layer in place (``train.torch_compile``), as torchtune does:
    the layers are identical, so one compiled graph serves them all, and the loss head, the
    checkpointing wrapper and peft's adapters (injected later, inside the layers, before the first
    call that compiles) stay outside any graph break. Returns how many layers were compiled.

    Kept rather than accelerate's ``compile_regions``: that returns a new model whose blocks are
    ``OptimizedModule`` wrappers (parameter names gain ``_orig_mod.``, which peft's targeting and
    the saved adapter see) and compiles everything else too, the loss head included."""
    layers = architecture.decoder_layers(model, architecture.num_layers(model.config))
    if layers is None:
        raise UserError("train.torch_compile: cannot find the decoder layers of "
                        f"{type(model).__name__}; set train.torch_compile=false")
    for layer in layers:
        layer.compile()
    logger.info("torch.compile: %d decoder layers (compiled on the first step)", len(layers))
    return len(layers)


def lora_config(run: Run) -> Any:
    """peft's ``LoraConfig`` for the run (None for full fine-tuning): the one the planner counts
    and traces too (:func:`sft_play.adapters.peft_config`)."""
    if run.lora is None:
        return None
    return adapters.peft_config(run.lora, base_model=run.model, revision=run.revision)
