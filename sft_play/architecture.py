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
import warnings
from typing import Any

from sft_play import hub
from sft_play.errors import hub_error

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

    hub.prepare(name_or_path)
    try:
        return AutoConfig.from_pretrained(name_or_path, revision=revision, trust_remote_code=trust_remote_code)
    except OSError as exc:
        shipped = hub.shipped_config(name_or_path, revision)
        if shipped is None:
            raise hub_error(name_or_path, exc) from None
    logger.info("%s: the hub's config.json cannot be read here; using the copy shipped in %s", name_or_path, shipped)
    return AutoConfig.from_pretrained(shipped, trust_remote_code=trust_remote_code)


def build_meta_model(model_config: Any, trust_remote_code: bool = False) -> Any:
    """The causal LM for `model_config` on the meta device, tied weights tied.

    ``torch.device("meta")`` rather than accelerate's ``init_empty_weights``: with current
    transformers the latter leaves tied embeddings untied (counted twice).
    """
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(model_config, trust_remote_code=trust_remote_code)
    model.tie_weights()
    return model


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


def with_layers(model_config: Any, layers: int) -> Any:
    """A copy of `model_config` with `layers` decoder layers (per-layer lists cut to match)."""
    shorter = copy.deepcopy(model_config)
    text = text_config(shorter)
    text.num_hidden_layers = layers
    value = getattr(text, "layer_types", None)
    if isinstance(value, list):
        text.layer_types = value[:layers]
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


def attention_softcapping(model_config: Any) -> bool:
    """Whether the model caps its attention logits (Gemma-2), which SDPA cannot run."""
    return getattr(text_config(model_config), "attn_logit_softcapping", None) is not None


def hidden_size(model_config: Any) -> int:
    return config_int(text_config(model_config), "hidden_size", "n_embd", "d_model")


def vocab_size(model_config: Any) -> int | None:
    return getattr(text_config(model_config), "vocab_size", None)
