"""Exact model sizes from a config alone: the model is built on the meta device
(:mod:`sft_play.architecture`: no weight memory, no download beyond config.json), and its
parameters are counted by module kind, for full fine-tuning, LoRA (peft applied to the meta
model, with the run's own ``LoraConfig``) and QLoRA (the linears bitsandbytes would quantise,
found with transformers' own rule).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

from sft_play.adapters import LoraSpec, peft_config, unmatched_modules
from sft_play.architecture import (ModelFacts, adapter_facts, adapter_parts, attention_eager_only, build_meta_model,
                                   config_identity, config_int, decoder_layers, experts, frozen_parts, in_parts,
                                   layer_signature, load_model_config, quantized_linears, sequential_mixers,
                                   sliding_window, text_config, vision_parts, with_layers)
from sft_play.errors import UserError
from sft_play.planner.simulate import cache

logger = logging.getLogger(__name__)

KINDS = ("embeddings", "attention", "mlp", "norms", "lm_head", "other")
_ATTENTION_NAMES = ("attn", "attention")
_MLP_NAMES = ("mlp", "feed_forward", "ffn", "experts", "moe")
_FIRST_LAYER = re.compile(r"\.(layers|layer|h|blocks)\.0\.")
_ANY_LAYER = re.compile(r"\.(layers|layer|h|blocks)\.\d+\.")
# Layer kinds (config.layer_types) that transformers builds a causal mask for, one per kind present
ATTENTION_KINDS = {"full_attention", "sliding_attention"}


@dataclass
class ModelShape:
    """Sizes of one model for one fine-tuning method; every count is exact."""

    model_type: str
    architecture: str
    total_params: int
    params_by_kind: dict[str, int]
    trainable_params: int
    lora_params: int
    quantized_params: int  # weights that become 4-bit under QLoRA (0 for other methods)
    quantized_blocks: int  # NF4 blocks of 64 weights, one absmax constant each
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    lora_in_out: list[tuple[int, int]] = field(default_factory=list)  # (in, out) of each adapted linear, per layer
    lora_rank: int = 0  # the adapters' r (0: full fine-tuning, or a shape built without it)
    # What peft trains, tensor by tensor: in the first decoder layer, and outside the layers
    lora_layer_tensors: list[int] = field(default_factory=list)
    lora_outside_tensors: list[int] = field(default_factory=list)
    lora_unadapted: list[str] = field(default_factory=list)  # all-linear: linears of a layer peft left frozen
    attention_eager_only: bool = False  # SDPA cannot run it (architecture.attention_eager_only): Gemma-2, gpt-oss
    # 4-D masks the backbone builds per batch where attention takes one: one per attention kind of
    # its layers (Gemma-2, Qwen2 with sliding layers: a full and a sliding-window causal mask)
    attention_masks: int = 1
    sliding_window: int | None = None  # tokens, where layers attend through a sliding window (architecture.sliding_window)
    # Parameter tensors as the GPU allocates them: (elements, quantised by QLoRA) for one decoder
    # layer, and the elements of each tensor outside the layers (embeddings, final norm, head)
    layer_tensors: list[tuple[int, bool]] = field(default_factory=list)
    other_tensors: list[int] = field(default_factory=list)
    # Hybrid models (layers of different kinds): every layer's tensors; empty when all are alike
    layers_tensors: list[list[tuple[int, bool]]] = field(default_factory=list)
    # Mixture of experts: routed experts per MoE layer, experts per token, the routed experts'
    # parameters (all layers); 0 for dense models
    num_experts: int = 0
    experts_per_token: int = 0
    expert_params: int = 0
    max_positions: int = 0  # the positions the model was trained on (max_position_embeddings); 0: unknown
    # what LoRA all-linear adapts beyond linears, and the linears it leaves (architecture.adapter_facts)
    expert_parameters: tuple[str, ...] = ()
    lora_exclude: tuple[str, ...] = ()
    sequential_mixers: tuple[str, ...] = ()  # hybrid layers without attention (architecture.sequential_mixers)
    # Vision-language models: the vision encoder(s) and projector(s) (module paths), the parameters
    # of each, and how many of the model's parameters stay frozen in this run
    vision_towers: tuple[str, ...] = ()
    projectors: tuple[str, ...] = ()
    part_params: dict[str, int] = field(default_factory=dict)
    frozen_params: int = 0
    # the projectors' linears QLoRA quantises by default, (weights, NF4 blocks): kept 16-bit where they train
    projector_quantized: tuple[int, int] = (0, 0)

    @property
    def vision_params(self) -> int:
        """The vision encoder's parameters (a projector inside it not counted)."""
        inside = sum(n for path, n in self.part_params.items()
                     if path in self.projectors and in_parts(path, tuple(self.vision_towers)))
        return sum(self.part_params.get(path, 0) for path in self.vision_towers) - inside

    @property
    def projector_params(self) -> int:
        return sum(self.part_params.get(path, 0) for path in self.projectors)

    def frozen_count(self, frozen: tuple[tuple[str, ...], tuple[str, ...]]) -> int:
        """The parameters the `frozen` parts hold (:func:`sft_play.architecture.frozen_parts`)."""
        paths, inside = frozen
        outer = [path for path in paths if not any(path != other and in_parts(path, (other,)) for other in paths)]
        return sum(self.part_params.get(path, 0) for path in outer) - sum(self.part_params.get(path, 0) for path in inside)

    @property
    def active_params(self) -> int:
        """Parameters one token passes through: all but the routed experts it is not sent to."""
        if not self.num_experts:
            return self.total_params
        idle = self.expert_params * (self.num_experts - self.experts_per_token) // self.num_experts
        return self.total_params - idle

    @property
    def facts(self) -> ModelFacts:
        """What resolving a run needs to know of the model (:func:`sft_play.run.resolve`)."""
        return ModelFacts(hidden_size=self.hidden_size, num_experts=self.num_experts,
                          attention_eager_only=self.attention_eager_only,
                          expert_parameters=tuple(self.expert_parameters), lora_exclude=tuple(self.lora_exclude),
                          attention_heads=self.num_attention_heads, kv_heads=self.num_key_value_heads,
                          sliding_window=self.sliding_window, sequential_mixers=tuple(self.sequential_mixers),
                          vision_towers=tuple(self.vision_towers), projectors=tuple(self.projectors))

    def tensors_of_layer(self, index: int) -> list[tuple[int, bool]]:
        """The parameter tensors of decoder layer `index` as the GPU allocates them."""
        return self.layers_tensors[index] if self.layers_tensors else self.layer_tensors

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def key(self) -> tuple:
        """A hashable identity of the shape (for caching predictions): made once, as a plan asks
        for it at every prediction; a field set anew makes it again."""
        def frozen(value: Any) -> Any:
            if isinstance(value, dict):
                return tuple((k, frozen(v)) for k, v in value.items())
            return tuple(frozen(v) for v in value) if isinstance(value, (list, tuple)) else value

        if "_key" not in self.__dict__:
            self.__dict__["_key"] = tuple(frozen(getattr(self, f.name)) for f in dataclasses.fields(self))
        return self.__dict__["_key"]

    def __setattr__(self, name: str, value: Any) -> None:
        self.__dict__.pop("_key", None)
        super().__setattr__(name, value)


def _kind(name: str, module: Any, output_embeddings: Any) -> str:
    import torch

    if module is output_embeddings:
        return "lm_head"
    if isinstance(module, torch.nn.Embedding):
        return "embeddings"
    if "norm" in type(module).__name__.lower() or name.split(".")[-1].endswith("norm"):
        return "norms"
    parts = name.lower().split(".")
    if any(p in _ATTENTION_NAMES or p.endswith(_ATTENTION_NAMES) for p in parts):
        return "attention"
    if any(p in _MLP_NAMES for p in parts):
        return "mlp"
    return "other"


def count_by_kind(model: Any) -> dict[str, int]:
    """Parameters by module kind; shared (tied) tensors are counted once, under the first owner."""
    counts = dict.fromkeys(KINDS, 0)
    seen: set[int] = set()
    output_embeddings = model.get_output_embeddings()
    for name, module in model.named_modules():
        for param in module.parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            counts[_kind(name, module, output_embeddings)] += param.numel()
    return counts


def lora_counts(model: Any, lora_config: Any) -> tuple[int, list[tuple[int, int]], list[int], list[int], list[str]]:
    """Adapter parameters peft adds to `model` for `lora_config`; the (in, out) of each adapted
    linear of the first decoder layer (what the activation model needs); the size of each tensor
    peft trains in that layer (its linears' A and B, DoRA's magnitudes, the factors of adapters
    on fused experts); of each it trains outside the layers (``modules_to_save`` copies); and,
    for all-linear, the linears of the layers it left without an adapter (peft gives some
    families' gate/up/down_proj names to the routed experts, so their dense and shared-expert
    projections of those names stay frozen)."""
    import copy

    from peft import get_peft_model

    # Adapter weights on the meta device and no initialisation: only their shapes are needed
    lora_config = copy.copy(lora_config)
    lora_config.init_lora_weights = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(model, lora_config, low_cpu_mem_usage=True)
    total = sum(p.numel() for n, p in peft_model.named_parameters() if p.requires_grad)
    trained = [(f".{n}.", p.numel()) for n, p in peft_model.named_parameters() if p.requires_grad]
    first_layer = [size for name, size in trained if _FIRST_LAYER.search(name)]
    outside = [size for name, size in trained if not _ANY_LAYER.search(name)]
    in_out = []
    for name, module in peft_model.named_modules():
        if hasattr(module, "lora_A") and _FIRST_LAYER.search(f".{name}."):
            base = getattr(module, "base_layer", None)
            if base is not None and hasattr(base, "in_features"):
                in_out.append((base.in_features, base.out_features))
    unadapted = []
    if isinstance(lora_config.target_modules, str) or lora_config.target_parameters:  # all-linear, as peft read it
        import torch

        excluded = lora_config.exclude_modules or ()

        def kept_out(name: str) -> bool:  # as peft reads exclude_modules: a regular expression, or names
            key = name.removeprefix("base_model.model.")
            return bool(re.fullmatch(excluded, key)) if isinstance(excluded, str) else key.rsplit(".", 1)[-1] in excluded

        for name, module in peft_model.named_modules():
            match = _ANY_LAYER.search(f".{name}.")
            if (match and type(module) is torch.nn.Linear and not hasattr(module, "lora_A")
                    and ".base_layer" not in name and ".lora_" not in name and not kept_out(name)):
                unadapted.append(f".{name}."[match.end():].strip("."))
    peft_model.unload()
    return total, in_out, first_layer, outside, sorted(set(unadapted))


def lora_counts_for_config(model_config: Any, lora_config: Any,
                           trust_remote_code: bool = False) -> tuple[int, list[tuple[int, int]], list[int], list[int]]:
    """:func:`lora_counts` for the model `model_config` describes, without wrapping every layer.

    peft's module-by-module wrapping takes seconds for an 80-layer model, so when the decoder
    layers are identical (same modules, same shapes, checked on the full meta model) peft is run
    on copies of the model with one and with two layers, and the count is extended linearly:
    ``n(L) = n(1) + (L - 1) x (n(2) - n(1))``. Different layers fall back to the whole model.
    """
    full = build_meta_model(model_config, trust_remote_code)
    problems = unmatched_modules(full, lora_config)
    if problems:
        raise UserError("; ".join(problems))
    text = text_config(model_config)
    num_layers = config_int(text, "num_hidden_layers", "n_layer", "num_layers")
    layers = decoder_layers(full, num_layers) if num_layers > 2 else None
    if layers is None or len({layer_signature(layer) for layer in layers}) != 1:
        return lora_counts(full, lora_config)
    one, in_out, first_layer, outside, unadapted = lora_counts(
        build_meta_model(with_layers(model_config, 1), trust_remote_code), lora_config)
    two, *_ = lora_counts(build_meta_model(with_layers(model_config, 2), trust_remote_code), lora_config)
    return one + (num_layers - 1) * (two - one), in_out, first_layer, outside, unadapted


def base_shape(model_config: Any, trust_remote_code: bool = False) -> ModelShape:
    """Exact sizes of the model `model_config` describes, for full fine-tuning, with the count
    of weights QLoRA would quantise filled in (combine with :func:`with_method`)."""
    model = build_meta_model(model_config, trust_remote_code)
    by_kind = count_by_kind(model)
    total = sum(by_kind.values())
    text = text_config(model_config)
    hidden = config_int(text, "hidden_size", "n_embd", "d_model")
    heads = config_int(text, "num_attention_heads", "n_head")
    quantized = blocks = 0
    quantizable = set()
    towers, projectors = vision_parts(model)
    in_projector = [0, 0]
    for name, module in quantized_linears(model):
        n = module.weight.numel()
        quantized += n
        blocks += -(-n // 64)
        quantizable.add(id(module.weight))
        if in_parts(name, projectors):
            in_projector = [in_projector[0] + n, in_projector[1] + -(-n // 64)]
    num_layers = config_int(text, "num_hidden_layers", "n_layer", "num_layers")
    layers = decoder_layers(model, num_layers)
    in_layers = {id(p) for p in layers.parameters()} if layers is not None else set()
    every = [[(p.numel(), id(p) in quantizable) for p in layer.parameters()] for layer in layers] if layers is not None else []
    layer_tensors = every[0] if every else []
    other_tensors = [p.numel() for p in model.parameters() if id(p) not in in_layers]
    routed, per_token = experts(model_config)
    part_params = {path: sum(p.numel() for p in model.get_submodule(path).parameters()) for path in towers + projectors}
    seen: set[int] = set()
    expert_params = 0
    for name, param in model.named_parameters():
        if routed and ".experts." in f".{name}" and "shared" not in name and id(param) not in seen:
            seen.add(id(param))
            expert_params += param.numel()
    return ModelShape(
        model_type=getattr(model_config, "model_type", "unknown"),
        architecture=type(model).__name__,
        total_params=total,
        params_by_kind=by_kind,
        trainable_params=total,
        lora_params=0,
        quantized_params=quantized,
        quantized_blocks=blocks,
        num_layers=num_layers,
        hidden_size=hidden,
        intermediate_size=config_int(text, "intermediate_size", "n_inner", "ffn_dim", default=4 * hidden),
        num_attention_heads=heads,
        num_key_value_heads=config_int(text, "num_key_value_heads", "num_kv_heads", default=heads),
        head_dim=config_int(text, "head_dim", default=hidden // max(1, heads)),
        vocab_size=config_int(text, "vocab_size"),
        tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
        attention_eager_only=attention_eager_only(model_config),
        attention_masks=max(1, len(set(getattr(text, "layer_types", None) or ()) & ATTENTION_KINDS)),
        sliding_window=sliding_window(model_config),
        layer_tensors=layer_tensors,
        other_tensors=other_tensors,
        layers_tensors=every if any(tensors != layer_tensors for tensors in every) else [],
        num_experts=routed,
        experts_per_token=per_token,
        expert_params=expert_params,
        max_positions=config_int(text, "max_position_embeddings", "n_positions", "max_sequence_length"),
        sequential_mixers=sequential_mixers(model_config),
        vision_towers=towers,
        projectors=projectors,
        part_params=part_params,
        projector_quantized=tuple(in_projector),
        **dict(zip(("expert_parameters", "lora_exclude"), adapter_facts(model))),
    )


def with_method(base: ModelShape, method: str, lora: tuple | None = None, rank: int = 0,
                frozen: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())) -> ModelShape:
    """`base` (from :func:`base_shape`) for `method`; `lora` is :func:`lora_counts`' answer for
    adapters of rank `rank`; a vision-language model's `frozen` parts
    (:func:`sft_play.architecture.frozen_parts`) do not train under full fine-tuning."""
    lora_params, in_out, first_layer, outside, unadapted = lora if lora is not None else (0, [], [], [], [])
    frozen_params = base.frozen_count(frozen)
    paths, inside = frozen
    projector_trains = any(p in inside or not in_parts(p, paths) for p in base.projectors)
    kept, kept_blocks = base.projector_quantized if projector_trains else (0, 0)  # (architecture.unquantised)
    return dataclasses.replace(
        base,
        frozen_params=frozen_params,
        trainable_params=base.total_params - frozen_params if method == "full" else lora_params,
        lora_params=0 if method == "full" else lora_params,
        quantized_params=base.quantized_params - kept if method == "qlora" else 0,
        quantized_blocks=base.quantized_blocks - kept_blocks if method == "qlora" else 0,
        lora_in_out=[] if method == "full" else list(in_out),
        lora_rank=0 if method == "full" else rank,
        lora_layer_tensors=[] if method == "full" else list(first_layer),
        lora_outside_tensors=[] if method == "full" else list(outside),
        lora_unadapted=[] if method == "full" else list(unadapted),
    )


def model_shape(config: Any) -> ModelShape:
    """Exact sizes of the configured model and method (config.json only, no weights).

    Args:
        config: a :class:`sft_play.config.RunConfig`.
    """
    model = config.model
    spec = None
    base = _base_shape(model.name_or_path, model.revision, model.trust_remote_code)
    frozen = frozen_parts(tuple(base.vision_towers), tuple(base.projectors), config.finetune.train_vision_tower,
                          config.finetune.train_projector)
    if config.finetune.method != "full":
        spec = LoraSpec.from_config(config.lora, tuple(base.expert_parameters), tuple(base.lora_exclude), adapter_parts(
            tuple(base.vision_towers), tuple(base.projectors), config.finetune.train_vision_tower,
            config.finetune.train_projector))
    return shape_for(model.name_or_path, model.revision, model.trust_remote_code, config.finetune.method, spec, frozen)


def shape_for(name_or_path: str, revision: str | None, trust_remote_code: bool, method: str,
              lora: LoraSpec | None, frozen: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())) -> ModelShape:
    base = _base_shape(name_or_path, revision, trust_remote_code)
    if method == "full" or lora is None:
        return with_method(base, method, frozen=frozen)
    return with_method(base, method, _lora_counts(name_or_path, revision, trust_remote_code, lora), lora.r, frozen)


# Remedies plan other methods of the same model: the model and each adapter are counted once
# (and on disk: sft_play.planner.simulate.cache, so that a second process needs no modeling code)
@functools.lru_cache(maxsize=16)
def _base_shape(name_or_path: str, revision: str | None, trust_remote_code: bool) -> ModelShape:
    return cache.remembered("shape", (config_identity(name_or_path, revision, trust_remote_code),),
                            lambda: base_shape(load_model_config(name_or_path, revision, trust_remote_code),
                                               trust_remote_code),
                            keep=cache.keeps(name_or_path, trust_remote_code))


@functools.lru_cache(maxsize=16)
def _lora_counts(name_or_path: str, revision: str | None, trust_remote_code: bool, lora: LoraSpec):
    return cache.remembered("lora", (config_identity(name_or_path, revision, trust_remote_code), lora),
                            lambda: lora_counts_for_config(load_model_config(name_or_path, revision, trust_remote_code),
                                                           peft_config(lora, initialise=False), trust_remote_code),
                            keep=cache.keeps(name_or_path, trust_remote_code))
