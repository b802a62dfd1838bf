"""Exact model sizes from a config alone: the model is built on the meta device (no weight
memory, no download beyond config.json), and its parameters are counted by module kind, for
full fine-tuning, LoRA (peft applied to the meta model) and QLoRA (the linears bitsandbytes
would quantise, found with transformers' own rule).

``torch.device("meta")`` is used rather than accelerate's ``init_empty_weights``: with current
transformers the latter leaves tied embeddings untied and counts them twice.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

KINDS = ("embeddings", "attention", "mlp", "norms", "lm_head", "other")
_ATTENTION_NAMES = ("attn", "attention")
_MLP_NAMES = ("mlp", "feed_forward", "ffn", "experts", "moe")
_FIRST_LAYER = re.compile(r"\.(layers|layer|h|blocks)\.0\.")


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def load_model_config(name_or_path: str, revision: str | None = None, trust_remote_code: bool = False) -> Any:
    """The transformers config of a hub id (config download only) or a local folder."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(name_or_path, revision=revision, trust_remote_code=trust_remote_code)


def build_meta_model(model_config: Any, trust_remote_code: bool = False) -> Any:
    """The causal LM for `model_config` on the meta device, tied weights tied."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(model_config, trust_remote_code=trust_remote_code)
    model.tie_weights()
    return model


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


def lora_counts(model: Any, lora_config: Any) -> tuple[int, list[tuple[int, int]]]:
    """Adapter parameters peft adds for `lora_config`, and the (in, out) of each adapted linear
    of the first decoder layer (what the activation model needs)."""
    import torch
    from peft import get_peft_model

    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(model, lora_config)
    total = sum(p.numel() for n, p in peft_model.named_parameters() if p.requires_grad)
    in_out = []
    for name, module in peft_model.named_modules():
        if hasattr(module, "lora_A") and _FIRST_LAYER.search(f".{name}."):
            base = getattr(module, "base_layer", None)
            if base is not None and hasattr(base, "in_features"):
                in_out.append((base.in_features, base.out_features))
    peft_model.unload()
    return total, in_out


def _attr(config: Any, *names: str, default: int = 0) -> int:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    return default


def shape_from_config(model_config: Any, method: str, lora_config: Any = None, trust_remote_code: bool = False) -> ModelShape:
    """Exact sizes of the model `model_config` describes, for `method` (full, lora or qlora).

    Args:
        model_config: a transformers ``PretrainedConfig`` (see :func:`load_model_config`).
        method: ``full``, ``lora`` or ``qlora``.
        lora_config: peft ``LoraConfig`` for lora/qlora.
        trust_remote_code: allow custom architectures' code.
    """
    model = build_meta_model(model_config, trust_remote_code)
    by_kind = count_by_kind(model)
    total = sum(by_kind.values())
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    hidden = _attr(text, "hidden_size", "n_embd", "d_model")
    heads = _attr(text, "num_attention_heads", "n_head")
    quantized = 0
    blocks = 0
    if method == "qlora":
        for _, module in quantized_linears(model):
            n = module.weight.numel()
            quantized += n
            blocks += -(-n // 64)
    lora, in_out = (0, [])
    if method in ("lora", "qlora"):
        lora, in_out = lora_counts(model, lora_config)
    return ModelShape(
        model_type=getattr(model_config, "model_type", "unknown"),
        architecture=type(model).__name__,
        total_params=total,
        params_by_kind=by_kind,
        trainable_params=total if method == "full" else lora,
        lora_params=lora,
        quantized_params=quantized,
        quantized_blocks=blocks,
        num_layers=_attr(text, "num_hidden_layers", "n_layer", "num_layers"),
        hidden_size=hidden,
        intermediate_size=_attr(text, "intermediate_size", "n_inner", "ffn_dim", default=4 * hidden),
        num_attention_heads=heads,
        num_key_value_heads=_attr(text, "num_key_value_heads", "num_kv_heads", default=heads),
        head_dim=_attr(text, "head_dim", default=hidden // max(1, heads)),
        vocab_size=_attr(text, "vocab_size"),
        tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
        lora_in_out=in_out,
    )
