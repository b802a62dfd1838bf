"""LoRA adapters: the settings as the run holds them, and the one peft ``LoraConfig`` built from
them, which the loader (training), the planner's counts and the planner's trace all use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LoraSpec:
    """The adapter of a LoRA/QLoRA run (hashable: the planner caches counts and traces by it)."""

    r: int
    alpha: int
    dropout: float
    targets: str | tuple[str, ...]  # "all-linear" or module names
    bias: str = "none"
    modules_to_save: tuple[str, ...] = ()
    dora: bool = False  # weight-decomposed LoRA
    rslora: bool = False  # alpha / sqrt(r) scaling
    # all-linear on a mixture-of-experts model: its fused expert weights (parameters, not linears)
    # and the linears no adapter may wrap: routers, Mamba mixers (architecture.adapter_facts)
    parameters: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    # a vision-language model's parts no adapter goes into (module paths: architecture.adapter_parts)
    kept_out: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, lora: Any, expert_parameters: tuple[str, ...] = (),
                    excluded: tuple[str, ...] = (), vision: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())) -> LoraSpec:
        """From the run config's ``lora`` section (:class:`sft_play.config.LoraConfig`) and what
        the model holds (:func:`sft_play.architecture.adapter_facts`, the one account of it, which
        the run and the planner both pass): "all-linear" reaches the fused expert weights
        `expert_parameters` too (peft maps only some families' names onto them) and leaves the
        `excluded` linears out. With fused experts, no dropout: peft cannot apply it to LoRA on
        them (its ``ParamWrapper`` refuses it). A vision-language model's `vision` parts are (the
        paths no adapter goes into, the projectors trained in full):
        :func:`sft_play.architecture.adapter_parts`."""
        moe = bool(expert_parameters)
        targets = lora.target_modules
        if moe and lora.use_dora and targets == "all-linear":
            from sft_play.errors import UserError

            raise UserError("lora.use_dora=true cannot adapt this mixture-of-experts model's fused expert weights, "
                            "which lora.target_modules=all-linear reaches (peft's ParamWrapper has no DoRA): "
                            "set lora.use_dora=false, or name the linears to adapt, e.g. "
                            "lora.target_modules=[q_proj,k_proj,v_proj,o_proj]")
        every_linear = targets == "all-linear"
        return cls(r=lora.r, alpha=lora.alpha, dropout=0.0 if moe else lora.dropout,
                   targets=targets if isinstance(targets, str) else tuple(targets), bias=lora.bias,
                   modules_to_save=tuple(dict.fromkeys([*(lora.modules_to_save or ()), *vision[1]])),
                   dora=lora.use_dora, rslora=lora.use_rslora,
                   parameters=tuple(expert_parameters) if every_linear else (),
                   exclude=tuple(excluded) if every_linear else (), kept_out=tuple(vision[0]))


def peft_config(spec: LoraSpec, base_model: str | None = None, revision: str | None = None,
                initialise: bool = True) -> Any:
    """peft's ``LoraConfig`` for `spec`.

    Args:
        base_model, revision: recorded in the saved adapter (where its base comes from).
        initialise: False for the planner's meta-device models, where only shapes matter.
    """
    from peft import LoraConfig

    return LoraConfig(
        task_type="CAUSAL_LM",
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=spec.targets if isinstance(spec.targets, str) else list(spec.targets),
        bias=spec.bias,
        modules_to_save=list(spec.modules_to_save) or None,
        base_model_name_or_path=base_model,
        revision=revision,
        init_lora_weights=initialise,
        use_dora=spec.dora,
        use_rslora=spec.rslora,
        target_parameters=list(spec.parameters) or None,
        exclude_modules=excluded_modules(spec),
    )


def excluded_modules(spec: LoraSpec) -> list[str] | str | None:
    """peft's ``exclude_modules`` for `spec`: its excluded names (peft matches a name or a dotted
    suffix), or, with parts kept out, one regular expression (peft matches it against each
    module's whole path) that also covers everything inside them."""
    if not spec.kept_out:
        return list(spec.exclude) or None
    import re

    def either(names: tuple[str, ...]) -> str:
        return "|".join(re.escape(name) for name in names)

    pattern = f"(?:{either(spec.kept_out)})(?:\\..*)?"
    if spec.exclude:
        pattern = f"(?:.*\\.)?(?:{either(spec.exclude)})|{pattern}"
    return pattern


def peft_mapped_names(model_type: str | None) -> set[str]:
    """The target names peft maps onto a family's fused expert weights (Qwen-MoE's gate_proj, up_proj,
    down_proj; Mixtral's w1, w2, w3: the linears they were before transformers 5 fused them)."""
    try:
        from peft.utils.transformers_weight_conversion import _MODEL_TO_CONVERSION_PATTERN, _MOE_TARGET_MODULE_MAPPING
    except ImportError:  # another peft: no names are mapped, as before it mapped them
        return set()
    return set(_MOE_TARGET_MODULE_MAPPING.get(_MODEL_TO_CONVERSION_PATTERN.get(model_type, ""), {}))


def unmatched_modules(model: Any, lora_config: Any) -> list[str]:
    """What in `lora_config` names no module of `model` (a meta model will do), one message each:
    peft stops with a traceback when no target matches, and adapts the rest in silence when one of
    several does not (``[q_proj, gate]``), as it trains no copy for a ``modules_to_save`` typo."""
    import torch

    names = [name for name, _ in model.named_modules() if name]
    mapped = peft_mapped_names(getattr(model.config, "model_type", None))

    def absent(keys: Any) -> list[str]:
        return [key for key in keys if key not in mapped
                and not any(name == key or name.endswith("." + key) for name in names)]

    leaves = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                     if isinstance(module, (torch.nn.Linear, torch.nn.Embedding))})
    problems = []
    targets = lora_config.target_modules
    missing = absent(sorted(targets)) if targets is not None and not isinstance(targets, str) else []
    if missing:
        problems.append(f"lora.target_modules: {', '.join(missing)} names no module of this model "
                        f"(its linears and embeddings: {', '.join(leaves)}; or all-linear)")
    missing = absent(lora_config.modules_to_save or [])
    if missing:
        problems.append(f"lora.modules_to_save: {', '.join(missing)} names no module of "
                        f"this model (its linears and embeddings: {', '.join(leaves)})")
    return problems
