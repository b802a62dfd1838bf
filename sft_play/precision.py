"""The precision recipe: what dtype the weights are stored in and what precision computes.

One pure function, shared by the model loader (which loads weights in this dtype), the trainer
set-up (which turns on bf16/fp16 autocast) and the planner (which counts bytes from the same
answer), so that the plan describes the run that really happens.

| method | weights (auto)                     | trainable params          | compute          |
|--------|------------------------------------|---------------------------|------------------|
| full   | float32 master weights             | float32, grads float32    | autocast bf16/fp16 |
| lora   | 16-bit frozen base (the mixed dtype)| adapters float32 (peft)  | autocast bf16/fp16 |
| qlora  | 4-bit linears, the rest 16-bit     | adapters bf16 (TRL casts) | bnb compute dtype = mixed dtype |

With ``mixed_precision: no`` everything is float32 (the CPU case).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sft_play.config import RunConfig

MixedPrecision = Literal["bf16", "fp16", "no"]
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Precision:
    """The resolved recipe: autocast mode and the storage dtype of the (base) weights."""

    mixed: MixedPrecision
    weights_dtype: str

    @property
    def compute_dtype(self) -> str:
        return {"bf16": "bfloat16", "fp16": "float16", "no": "float32"}[self.mixed]


def resolve_precision(config: RunConfig, has_gpu: bool, bf16_supported: bool) -> Precision:
    """The precision recipe for `config` on hardware with (or without) GPUs.

    Args:
        config: the run config.
        has_gpu: whether training runs on CUDA GPUs.
        bf16_supported: whether every participating GPU supports bf16 (compute capability >= 8.0).
    """
    mixed = config.train.mixed_precision
    if mixed == "auto":
        mixed = ("bf16" if bf16_supported else "fp16") if has_gpu else "no"
    elif not has_gpu and config.distributed.strategy.startswith("deepspeed"):
        # DeepSpeed without GPUs (its CPU accelerator, for trying the launch path) trains in fp32:
        # transformers allows 16-bit autocast without a GPU only with use_cpu, which DeepSpeed's
        # process group cannot use
        mixed = "no"
    dtype = config.model.torch_dtype
    if dtype == "auto":
        if config.finetune.method == "full":
            dtype = "float32"
        else:
            dtype = {"bf16": "bfloat16", "fp16": "float16", "no": "float32"}[mixed]
    return Precision(mixed=mixed, weights_dtype=dtype)


def resolve_optimizer(config: RunConfig, on_cuda: bool) -> str:
    """The optimizer the trainer builds: ``auto`` is torch's fused AdamW on CUDA (one kernel, no
    full-size temporaries) and its foreach AdamW elsewhere; any other value as configured."""
    if config.train.optimizer != "auto":
        return config.train.optimizer
    return "adamw_torch_fused" if on_cuda else "adamw_torch"
