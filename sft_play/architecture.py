"""The model's facts, read from its config alone: the transformers config (hub id, local folder
or the copy the project ships), the causal LM built on the meta device, its decoder layers, and
the linears bitsandbytes would quantise.

Everything that needs to know what a model *is* reads it here: the run (which attention kernel
it can take), the loader (where the layers are, to compile them), and the planner (exact counts
and the layer it traces). Nothing here loads weights or decides anything about a run.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sft_play import hub
from sft_play.errors import UserError, hub_error

logger = logging.getLogger(__name__)


def text_config(model_config: Any) -> Any:
    """The language model's part of a config (a multimodal config holds one inside)."""
    return model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config


def config_int(config: Any, *names: str, default: int = 0) -> int:
    """The first of `names` that `config` sets, as an int (architectures name the same fact differently)."""
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    return default


@functools.lru_cache(maxsize=32)
def load_model_config(name_or_path: str, revision: str | None = None, trust_remote_code: bool = False) -> Any:
    """The transformers config of a hub id (config download only, or the local cache) or a local
    folder (cached: treat it as read-only). A hub id that cannot be read while the project ships
    its config (:func:`sft_play.hub.shipped_config`) is read from that copy.

    Raises:
        UserError: the hub id cannot be loaded (network, name or access, said which).
    """
    from transformers import AutoConfig

    local = Path(name_or_path) / "config.json"
    if local.is_file():
        _LOADED_TEXT[str(local.resolve())] = local.read_text()
    hub.prepare(name_or_path)
    try:
        return AutoConfig.from_pretrained(name_or_path, revision=revision, trust_remote_code=trust_remote_code)
    except OSError as exc:
        shipped = hub.shipped_config(name_or_path, revision)
        if shipped is None:
            raise hub_error(name_or_path, exc, config_only=True) from None
    except (ValueError, KeyError) as exc:  # a model_type this transformers does not know, or a broken config
        import transformers

        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"cannot read the model config of '{name_or_path}': {first} (transformers "
                        f"{transformers.__version__}; a newer model may need a newer transformers, or "
                        "model.trust_remote_code=true for one that ships its own code)") from None
    logger.info("%s: the hub's config.json cannot be read here; using the copy shipped in %s", name_or_path, shipped)
    return AutoConfig.from_pretrained(shipped, trust_remote_code=trust_remote_code)


# A local folder's config.json as this process first read it (load_model_config caches by path)
_LOADED_TEXT: dict[str, str] = {}


def config_is_current(name_or_path: str) -> bool:
    """False when this process loaded a local folder's config.json and the file has changed since:
    what the process computes from it belongs to the old text (it must not be kept under the new)."""
    local = Path(name_or_path) / "config.json"
    if not local.is_file():
        return True
    loaded = _LOADED_TEXT.get(str(local.resolve()))
    return loaded is None or loaded == local.read_text()


def config_identity(name_or_path: str, revision: str | None = None, trust_remote_code: bool = False) -> str:
    """What identifies a model's config, for what is cached from it: the text of a local
    folder's ``config.json`` (read without importing transformers), else every field of the
    config transformers loads (hub ids: the hub decides which revision is current)."""
    local = Path(name_or_path) / "config.json"
    if local.is_file():
        return f"{local.resolve()}\n{local.read_text()}"
    return load_model_config(name_or_path, revision, trust_remote_code).to_json_string(use_diff=False)


def is_vision_language(model_config: Any) -> bool:
    """Whether the model sees images: its config holds a vision encoder's (Qwen-VL, Gemma-3, LLaVA...)."""
    return getattr(model_config, "vision_config", None) is not None


def model_class(model_config: Any) -> Any:
    """The transformers auto class a model of `model_config` trains as: image-text-to-text for a
    vision-language model (``AutoModelForCausalLM`` refuses Qwen-VL's config, and maps Gemma-3's
    to a class that is not the one its processor serves), causal LM otherwise."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_language(model_config) else AutoModelForCausalLM


def build_meta_model(model_config: Any, trust_remote_code: bool = False) -> Any:
    """The model for `model_config` on the meta device (:func:`model_class`), tied weights tied.

    ``torch.device("meta")`` rather than accelerate's ``init_empty_weights``: with current
    transformers the latter leaves tied embeddings untied (counted twice).
    """
    import torch

    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = model_class(model_config).from_config(model_config, trust_remote_code=trust_remote_code)
    model.tie_weights()
    return model


def image_tokens(model_config: Any, max_pixels: int | None = None) -> tuple[int, str] | None:
    """The most tokens one image costs a vision-language model, read from its config (and, where the
    processor sizes images by area, `max_pixels`), and how that follows; None where the config alone
    does not tell (a processor that sizes by area without a budget given, or splits into crops)."""
    vision = getattr(model_config, "vision_config", None)
    if vision is None or getattr(model_config, "image_grid_pinpoints", None):
        return None  # (LLaVA-Next's "anyres": a grid of crops chosen per image)
    patch = getattr(vision, "patch_size", None) or 0
    merge = getattr(vision, "spatial_merge_size", None)
    if merge and patch:  # Qwen-VL: one token per (patch x merge)^2 pixels of the resized image
        if not max_pixels:
            return None
        side = patch * merge  # (an image keeps one token however small the budget: the processor's least size)
        return max(1, max_pixels // (side * side)), \
            f"one per {side}x{side} pixels of at most data.image_max_pixels={max_pixels:,}"
    fixed = getattr(model_config, "mm_tokens_per_image", None)
    if fixed:  # Gemma-3: pooled to a fixed count
        return int(fixed), "a fixed count: the projector pools every image to it, the processor marks its start and end"
    size = getattr(vision, "image_size", None)
    if size and patch and getattr(model_config, "vision_feature_select_strategy", None) in ("default", "full"):
        tokens = (size // patch) ** 2 + (1 if model_config.vision_feature_select_strategy == "full" else 0)
        return tokens, f"one per {patch}x{patch} patch of the {size}x{size} image (LLaVA)"
    return None


def image_inputs(model_config: Any, max_pixels: int | None = None) -> dict[str, Any] | None:
    """What the processor gives the vision encoder for one image, described as
    :func:`sft_play.data.vision.encoder_inputs` describes it, read from the config where
    :func:`image_tokens` can tell: Qwen-VL's patches of an image of `max_pixels` whose merged
    tokens are exactly those :func:`image_tokens` charges, or one image of the encoder's fixed size.
    None otherwise."""
    vision = getattr(model_config, "vision_config", None)
    known = image_tokens(model_config, max_pixels)
    if vision is None or known is None:
        return None
    patch = vision.patch_size
    merge = getattr(vision, "spatial_merge_size", None)
    if merge:  # a grid of exactly the tokens charged, as near square as they factor (512: 16 x 32)
        rows = max(d for d in range(1, math.isqrt(known[0]) + 1) if known[0] % d == 0)
        height, width = rows * merge, known[0] // rows * merge
        channels = getattr(vision, "in_channels", None) or getattr(vision, "in_chans", None) or 3
        values = channels * (getattr(vision, "temporal_patch_size", None) or 1) * patch * patch
        return {"image_grid_thw": {"values": [[1, height, width]]},
                "pixel_values": {"shape": [height * width, values], "dtype": "float32"}}
    size = vision.image_size
    return {"pixel_values": {"shape": [1, getattr(vision, "num_channels", 3), size, size], "dtype": "float32"}}


def sizes_by_pixels(model_config: Any) -> bool:
    """Whether the model's processor sizes each image by a budget of pixels (Qwen-VL: one token per
    (patch x merge)^2 pixels of the resized image), so that ``data.image_max_pixels`` sets its tokens."""
    vision = getattr(model_config, "vision_config", None)
    return bool(getattr(vision, "spatial_merge_size", None) and getattr(vision, "patch_size", None))


def within_pixels(model_config: Any, described: dict[str, Any], max_pixels: int) -> dict[str, Any]:
    """`described` encoder inputs (:func:`image_inputs`' form) with every image larger than
    `max_pixels` scaled down to it, keeping its aspect, as Qwen-VL's processor resizes it
    (``smart_resize``: each side a multiple of patch x merge)."""
    vision = model_config.vision_config
    patch, merge = vision.patch_size, vision.spatial_merge_size
    grids = described.get("image_grid_thw", {}).get("values")
    if not grids:
        return described
    scaled = []
    for frames, height, width in grids:
        area = height * width * patch * patch
        if area > max_pixels:
            factor = math.sqrt(max_pixels / area)
            height = max(merge, int(height * factor) // merge * merge)
            width = max(merge, int(width * factor) // merge * merge)
        scaled.append([frames, height, width])
    pixels = described["pixel_values"]
    rows = sum(frames * height * width for frames, height, width in scaled)
    return {**described, "image_grid_thw": {"values": scaled},
            "pixel_values": {**pixels, "shape": [rows, *pixels["shape"][1:]]}}


# What transformers' vision-language families call their vision encoder and their projector
# (Qwen-VL's projector, the merger, lives inside its encoder)
VISION_TOWERS = ("visual", "vision_tower", "vision_model", "vision_encoder")
PROJECTORS = ("multi_modal_projector", "connector", "merger", "deepstack_merger_list", "mm_projector")


def vision_parts(model: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The module paths of a vision-language model's vision encoder(s) and projector(s); empty for
    a text model."""
    towers: list[str] = []
    projectors: list[str] = []
    for name, _ in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in VISION_TOWERS and not any(name.startswith(t + ".") for t in towers):
            towers.append(name)
        elif leaf in PROJECTORS and not any(name.startswith(p + ".") for p in projectors):
            projectors.append(name)
    return tuple(towers), tuple(projectors)


def frozen_parts(towers: tuple[str, ...], projectors: tuple[str, ...], train_tower: bool,
                 train_projector: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the module paths kept frozen, the paths inside them that train): the vision encoder unless
    `train_tower`, the projector unless `train_projector` (which may lie inside the encoder)."""
    frozen = (() if train_tower else towers) + (() if train_projector else projectors)
    inside = tuple(p for p in projectors if train_projector and any(p.startswith(t + ".") for t in frozen))
    return frozen, inside


def adapter_parts(towers: tuple[str, ...], projectors: tuple[str, ...], train_tower: bool,
                  train_projector: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """How LoRA treats a vision-language model's parts: (the module paths no adapter goes into,
    the projectors trained in full beside the adapters, by name). The vision encoder gets adapters
    on its linears only where it trains (Unsloth's finetune_vision_layers); a projector never does:
    it is small, and trains in full (peft's modules_to_save) or not at all (Gemma-3's is a bare
    weight that no adapter could reach)."""
    kept_out = (() if train_tower else towers) + projectors
    return kept_out, tuple(path.rsplit(".", 1)[-1] for path in projectors) if train_projector else ()


def keep_out_of_backward(model: Any, towers: tuple[str, ...]) -> None:
    """Keep the frozen vision encoders at `towers` out of the backward pass. transformers'
    ``enable_input_require_grads`` (run when checkpointing is enabled, and by peft) makes the
    output of every sub-model's input embeddings require grad, a vision encoder's patch embedding
    included: a frozen encoder would then keep its activations for a backward pass that updates
    nothing (and, checkpointed, run its forward twice). Its sub-model no longer shows it the
    embeddings; what trains after the encoder (a projector) gets its gradients all the same."""
    for path in towers:
        for module in model.get_submodule(path).modules():  # (a sub-model nested in the encoder too)
            if hasattr(module, "get_input_embeddings"):
                module.get_input_embeddings = _no_embeddings


def _no_embeddings() -> None:
    return None


def in_parts(name: str, paths: tuple[str, ...]) -> bool:
    return any(name == path or name.startswith(path + ".") for path in paths)


def parameter_count(model_config: Any, trust_remote_code: bool = False) -> int:
    """Every parameter of the model, tied ones once (counted on the meta device)."""
    return sum(p.numel() for p in build_meta_model(model_config, trust_remote_code).parameters())


def num_layers(model_config: Any) -> int:
    return config_int(text_config(model_config), "num_hidden_layers", "n_layer", "num_layers")


def decoder_layers(model: Any, count: int) -> Any | None:
    """The ModuleList of the `count` decoder layers (the one holding most parameters)."""
    import torch

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == count]
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()), default=None)


def layer_signature(layer: Any) -> tuple:
    """The modules of a layer with their types and parameter shapes: equal for identical layers."""
    return tuple((name, type(m).__name__, tuple(tuple(p.shape) for p in m.parameters(recurse=False)))
                 for name, m in layer.named_modules())


# Layer types that attend the same way (the window is in the mask or the kernel, not the memory)
_ATTENTION_TYPES = {"full_attention", "sliding_attention", "chunked_attention", "attention", "global_attention"}


def layer_kinds(model_config: Any, windows: bool = False) -> list[str]:
    """What each decoder layer is, where a model mixes kinds: its mixer (``layer_types``,
    Bamba's ``attn_layer_indices``) and, for mixture-of-experts models with dense layers among
    the sparse ones, ``+dense`` or ``+moe``. Empty when every layer is alike. Each kind is named
    by the first layer type that has it, so that :func:`with_layers` can build one. With
    `windows`, sliding-window layers are a kind of their own (where they take a mask the others
    do not: :func:`sft_play.run.sliding_mask`)."""
    text = text_config(model_config)
    count = num_layers(model_config)
    mixers: list[str] = [""] * count
    types = getattr(text, "layer_types", None)
    if isinstance(types, list) and len(types) >= count:
        first: dict[str, str] = {}
        for i, name in enumerate(types[:count]):
            group = name if windows and name == "sliding_attention" else \
                "attention" if name in _ATTENTION_TYPES else name
            mixers[i] = first.setdefault(group, name)
    elif isinstance(getattr(text, "attn_layer_indices", None), list):
        attending = set(text.attn_layer_indices)
        mixers = ["attention" if i in attending else "mamba" for i in range(count)]
    mlps = [_mlp_kind(text, i) for i in range(count)]
    kinds = [f"{m}+{f}" if m and f else m or f for m, f in zip(mixers, mlps)]
    return kinds if len(set(kinds)) > 1 else []


def sliding_window(model_config: Any) -> int | None:
    """The window of the model's sliding-window attention layers, None where it has none: the
    layers ``layer_types`` names ``sliding_attention``, or, for a model without ``layer_types``
    (Mistral, Phi-3, Starcoder2), every layer when its config sets ``sliding_window`` (their
    backbones build ``create_sliding_window_causal_mask`` then)."""
    text = text_config(model_config)
    window = getattr(text, "sliding_window", None)
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return None
    types = getattr(text, "layer_types", None)
    if isinstance(types, list) and types:
        return window if "sliding_attention" in types[:num_layers(model_config)] else None
    return window


def is_sliding(model_config: Any, kind: str | None) -> bool:
    """Whether the layers of `kind` (one of :func:`layer_kinds`, None where all are alike) attend
    through a sliding window."""
    if sliding_window(model_config) is None:
        return False
    types = getattr(text_config(model_config), "layer_types", None)
    if isinstance(types, list) and types:
        return (kind or "").partition("+")[0] == "sliding_attention" or (
            not kind and all(name == "sliding_attention" for name in types[:num_layers(model_config)]))
    return True


def _mlp_kind(text: Any, index: int) -> str:
    """``dense`` or ``moe`` for a layer of a mixture-of-experts model that has both, else ''."""
    dense_first = getattr(text, "first_k_dense_replace", None)
    if isinstance(dense_first, int) and dense_first > 0:
        return "dense" if index < dense_first else "moe"
    only_mlp = getattr(text, "mlp_only_layers", None)
    step = getattr(text, "decoder_sparse_step", None)
    experts = getattr(text, "num_experts", 0) or 0
    if experts and (only_mlp or (isinstance(step, int) and step > 1)):
        sparse = index not in (only_mlp or []) and (index + 1) % max(1, step or 1) == 0
        return "moe" if sparse else "dense"
    return ""


def with_layers(model_config: Any, layers: int, kind: str | None = None) -> Any:
    """A copy of `model_config` with `layers` decoder layers (per-layer lists cut to match), all
    of `kind` (one of :func:`layer_kinds`) when given."""
    try:
        shorter = copy.deepcopy(model_config)
    except AttributeError:  # a config with read-only properties (Bamba's layers_block_type)
        shorter = type(model_config).from_dict(model_config.to_dict())
    text = text_config(shorter)
    text.num_hidden_layers = layers
    mixer, _, mlp = (kind or "").partition("+")
    if mlp == "" and mixer in ("dense", "moe"):
        mixer, mlp = "", mixer
    if isinstance(getattr(text, "attn_layer_indices", None), list):  # Bamba: layer_types is read from it
        if mixer:
            text.attn_layer_indices = list(range(layers)) if mixer in _ATTENTION_TYPES else []
        else:
            text.attn_layer_indices = [i for i in text.attn_layer_indices if i < layers]
    elif isinstance(getattr(text, "layer_types", None), list):
        text.layer_types = [mixer] * layers if mixer else text.layer_types[:layers]
    if mlp:
        if isinstance(getattr(text, "first_k_dense_replace", None), int):
            text.first_k_dense_replace = layers if mlp == "dense" else 0
        if hasattr(text, "mlp_only_layers"):
            text.mlp_only_layers = list(range(layers)) if mlp == "dense" else []
            if isinstance(getattr(text, "decoder_sparse_step", None), int):
                text.decoder_sparse_step = 1
    return shorter


def quantized_linears(model: Any) -> list[tuple[str, Any]]:
    """The linear layers bitsandbytes 4-bit loading would replace (transformers' own skip rule)."""
    import torch
    from transformers.quantizers.base import HfQuantizer
    from transformers.quantizers.quantizers_utils import should_convert_module

    skip = HfQuantizer.get_modules_to_not_convert(model, None, getattr(model, "_keep_in_fp32_modules", None))
    return [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is torch.nn.Linear and should_convert_module(name, skip)
    ]


def unquantised(model: Any, train_projector: bool) -> list[str] | None:
    """bitsandbytes' modules not to convert under QLoRA (``llm_int8_skip_modules``), where they
    differ from transformers' defaults: a vision-language model's projector, when it trains, keeps
    its 16-bit weights (peft trains it whole, which a 4-bit weight cannot). None: the defaults."""
    projectors = vision_parts(model)[1] if train_projector else ()
    if not projectors:
        return None
    from transformers.quantizers.base import HfQuantizer

    return sorted({*HfQuantizer.get_modules_to_not_convert(model, None), *projectors})


def experts(model_config: Any) -> tuple[int, int]:
    """(routed experts per MoE layer, experts each token goes to); (0, 0) for a dense model."""
    text = text_config(model_config)
    count = config_int(text, "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
    if count <= 1:
        return 0, 0
    return count, config_int(text, "num_experts_per_tok", "moe_topk", "top_k", default=1)


# Model types whose Mamba mixers peft refuses to adapt, and the modules it refuses there
# (peft.tuners.tuners_utils._check_lora_target_modules_mamba): a traceback under all-linear
MAMBA_LORA_REFUSED = ({"falcon_h1", "mamba", "mamba2", "falcon_mamba", "nemotron_h"}, ("conv1d", "out_proj"))


def adapter_facts(model: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """What LoRA's ``all-linear`` needs to know of a (meta) model beyond its linears: the fused
    expert weights (3-D parameters of an ``experts`` module, as ``experts.gate_up_proj``), which
    are parameters, not linears, so that all-linear reaches them only where peft maps a family's
    names onto them (Qwen-MoE, Mixtral); and the linears no adapter may wrap: routers that subclass
    ``nn.Linear`` but return a tuple (PhiMoE, Llama-4), and the Mamba mixers' projections peft refuses."""
    import torch

    experts, excluded = set(), set()
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if "expert" in leaf and "shared" not in leaf:
            experts |= {f"{leaf}.{p}" for p, param in module.named_parameters(recurse=False) if param.ndim == 3}
        if isinstance(module, torch.nn.Linear) and type(module) is not torch.nn.Linear and "Router" in type(module).__name__:
            excluded.add(leaf)
    excluded |= set(_peft_refused(model.config))
    return tuple(sorted(experts)), tuple(sorted(excluded))


def _peft_refused(model_config: Any) -> tuple[str, ...]:
    """The modules peft refuses to adapt in this model (by its config's model_type, as peft reads it)."""
    types, refused = MAMBA_LORA_REFUSED
    return refused if getattr(model_config, "model_type", None) in types else ()


def lora_facts(model_config: Any, trust_remote_code: bool = False) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """:func:`adapter_facts` of the model `model_config` describes, built only where there is
    something to find (a mixture of experts)."""
    if experts(model_config)[0] > 1:
        return adapter_facts(build_meta_model(model_config, trust_remote_code))
    return (), _peft_refused(model_config)


def attention_eager_only(model_config: Any) -> bool:
    """Whether only eager attention runs the model: it caps its attention logits (Gemma-2), which
    SDPA cannot do, or transformers gives its class no SDPA path (gpt-oss: its attention sinks)."""
    if getattr(text_config(model_config), "attn_logit_softcapping", None) is not None:
        return True
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(model_config)]
    except (KeyError, ValueError, ImportError):  # remote code, or a config we cannot map: as before
        return False
    return getattr(model_class, "_supports_sdpa", True) is False


def hidden_size(model_config: Any) -> int:
    return config_int(text_config(model_config), "hidden_size", "n_embd", "d_model")


@dataclass(frozen=True)
class ModelFacts:
    """What resolving a run needs to know of its model (:func:`sft_play.run.resolve`): read from
    the model's config (:func:`model_facts`), or carried by the planner's exact shape
    (``ModelShape.facts``), which knows them already."""

    hidden_size: int
    num_experts: int  # routed experts per MoE layer; 0 for a dense model
    attention_eager_only: bool  # SDPA cannot run it: Gemma-2's capped logits, gpt-oss's sinks
    expert_parameters: tuple[str, ...] = ()  # the fused expert weights LoRA reaches (adapter_facts)
    lora_exclude: tuple[str, ...] = ()  # the linears LoRA all-linear leaves out
    attention_heads: int = 0  # query heads (sequence parallelism splits them across its processes)
    kv_heads: int = 0
    sliding_window: int | None = None
    sequential_mixers: tuple[str, ...] = ()  # layers that carry a state along the sequence (sequential_mixers)
    # a vision-language model's vision encoder(s) and projector(s), as module paths (vision_parts)
    vision_towers: tuple[str, ...] = ()
    projectors: tuple[str, ...] = ()


def model_facts(model_config: Any, trust_remote_code: bool = False, adapters: bool = True) -> ModelFacts:
    """:class:`ModelFacts` from a transformers config; with `adapters`, what LoRA reaches too (for
    which a mixture-of-experts model is built on the meta device)."""
    expert_parameters, lora_exclude = lora_facts(model_config, trust_remote_code) if adapters else ((), ())
    text = text_config(model_config)
    heads = config_int(text, "num_attention_heads", "n_head", "num_heads")
    return ModelFacts(hidden_size=hidden_size(model_config), num_experts=experts(model_config)[0],
                      attention_eager_only=attention_eager_only(model_config),
                      expert_parameters=tuple(expert_parameters), lora_exclude=tuple(lora_exclude),
                      attention_heads=heads, kv_heads=config_int(text, "num_key_value_heads", "num_kv_heads", default=heads),
                      sliding_window=sliding_window(model_config), sequential_mixers=sequential_mixers(model_config),
                      **dict(zip(("vision_towers", "projectors"), vision_parts(build_meta_model(
                          model_config, trust_remote_code)) if is_vision_language(model_config) else ((), ()))))


def sequential_mixers(model_config: Any) -> tuple[str, ...]:
    """The kinds of a hybrid model's layers that mix tokens without attention (Mamba, linear
    attention, convolutions): each carries a state along the sequence inside its own code, which a
    sequence split across processes would restart on every process."""
    return tuple(sorted({kind.partition("+")[0] for kind in layer_kinds(model_config)
                         if kind.partition("+")[0] and kind.partition("+")[0] not in _ATTENTION_TYPES}))


def vocab_size(model_config: Any) -> int | None:
    return getattr(text_config(model_config), "vocab_size", None)
