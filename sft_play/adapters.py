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

    @classmethod
    def from_config(cls, lora: Any, moe: bool = False) -> LoraSpec:
        """From the run config's ``lora`` section (:class:`sft_play.config.LoraConfig`). On a
        mixture-of-experts model without dropout: peft cannot apply it to LoRA on fused expert
        weights (its ``ParamWrapper`` refuses it), and "all-linear" reaches them."""
        targets = lora.target_modules
        if moe and lora.use_dora and targets == "all-linear":
            from sft_play.errors import UserError

            raise UserError("lora.use_dora=true cannot adapt this mixture-of-experts model's fused expert weights, "
                            "which lora.target_modules=all-linear reaches (peft's ParamWrapper has no DoRA): "
                            "set lora.use_dora=false, or name the linears to adapt, e.g. "
                            "lora.target_modules=[q_proj,k_proj,v_proj,o_proj]")
        return cls(r=lora.r, alpha=lora.alpha, dropout=0.0 if moe else lora.dropout,
                   targets=targets if isinstance(targets, str) else tuple(targets), bias=lora.bias,
                   modules_to_save=tuple(lora.modules_to_save or ()), dora=lora.use_dora, rslora=lora.use_rslora)


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
    )
