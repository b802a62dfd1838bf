"""The precision recipe: what dtype the weights are stored in and what precision computes.

One pure function, shared by the model loader (which loads weights in this dtype), the trainer
set-up (which turns on bf16/fp16 autocast) and the planner (which counts bytes from the same
answer), so that the plan describes the run that really happens.

| method | weights (auto)                     | trainable params          | compute          |
|--------|------------------------------------|---------------------------|------------------|
| full   | float32 master weights             | float32, grads float32    | autocast bf16/fp16 |
| lora   | 16-bit frozen base (the mixed dtype)| adapters float32 (peft)  | autocast bf16/fp16 |
| qlora  | 4-bit linears, the rest 16-bit     | adapters bf16 (TRL casts) | bnb compute dtype = mixed dtype |

With ``mixed_precision: no`` everything is float32. ``auto`` picks bf16 where the devices that
train compute it natively (Ampere or newer GPUs; CPUs with AMX, AVX512-BF16 or Arm BF16), fp16
on older GPUs and float32 on other CPUs, where bf16 autocast is emulated and ~25x slower.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sft_play.config import RunConfig
from sft_play.parallelism import Strategy

MixedPrecision = Literal["bf16", "fp16", "no"]
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
TORCH_DTYPE_NAMES = tuple(DTYPE_BYTES)
COMPUTE_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "no": "float32"}


@dataclass(frozen=True)
class Precision:
    """The resolved recipe: autocast mode and the storage dtype of the (base) weights."""

    mixed: MixedPrecision
    weights_dtype: str
    reason: str = ""  # why this autocast mode: the config, or what auto found on the hardware
    warning: str | None = None  # a configured choice that will run slowly here

    @property
    def compute_dtype(self) -> str:
        return COMPUTE_DTYPE[self.mixed]

    @property
    def autocast(self) -> bool:
        return self.mixed != "no"

    @property
    def weight_bytes(self) -> int:
        """Bytes per element of the (base) weights as loaded."""
        return DTYPE_BYTES[self.weights_dtype]

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of activations: 2 under autocast, 4 in fp32."""
        return DTYPE_BYTES[self.compute_dtype]


def auto_mixed_precision(has_gpu: bool, bf16_supported: bool) -> tuple[MixedPrecision, str]:
    """What ``train.mixed_precision: auto`` means on this hardware, and why."""
    if has_gpu:
        if bf16_supported:
            return "bf16", "auto: every GPU computes bf16 (compute capability 8.0 or newer)"
        return "fp16", "auto: a GPU without bf16 (compute capability below 8.0): fp16 with loss scaling"
    if bf16_supported:
        return "bf16", "auto: this CPU computes bf16 natively"
    return "no", "auto: this CPU has no native bf16, and emulated bf16 is ~25x slower than fp32"


def resolve_precision(config: RunConfig, has_gpu: bool, bf16_supported: bool) -> Precision:
    """The precision recipe for `config` on hardware with (or without) GPUs.

    Args:
        config: the run config.
        has_gpu: whether training runs on CUDA GPUs.
        bf16_supported: whether the devices that train compute bf16 natively: every
            participating GPU (compute capability >= 8.0), or the CPU when training runs there
            (:meth:`sft_play.hardware.HardwareInfo.bf16_supported`).
    """
    mixed = config.train.mixed_precision
    warning = None
    if not has_gpu and Strategy(config.distributed.strategy).deepspeed:
        # DeepSpeed without GPUs (its CPU accelerator, for trying the launch path) trains in fp32:
        # transformers allows 16-bit autocast without a GPU only with use_cpu, which DeepSpeed's
        # process group cannot use
        mixed, reason = "no", "DeepSpeed without GPUs trains in fp32"
    elif mixed == "auto":
        mixed, reason = auto_mixed_precision(has_gpu, bf16_supported)
    else:
        reason = f"train.mixed_precision={mixed}"
        if not has_gpu and mixed == "bf16" and not bf16_supported:
            warning = ("train.mixed_precision=bf16 on a CPU without native bf16: emulated, about 25x slower than "
                       "fp32; train.mixed_precision=auto (or no) trains in fp32 here")
    return Precision(mixed=mixed, weights_dtype=_weights_dtype(config, mixed), reason=reason, warning=warning)


def _weights_dtype(config: RunConfig, mixed: MixedPrecision) -> str:
    """The storage dtype of the (base) weights: ``model.torch_dtype``, or for ``auto`` fp32
    masters for full fine-tuning and the compute dtype for a frozen LoRA/QLoRA base."""
    if config.model.torch_dtype != "auto":
        return config.model.torch_dtype
    return "float32" if config.finetune.method == "full" else COMPUTE_DTYPE[mixed]


def init_weights_dtype(config: RunConfig) -> str:
    """The dtype random weights for a config-only model are initialised and stored in: the
    weights dtype of the run, with ``auto`` precision read as bf16. It depends on the config
    alone, not on the machine, so that every command of a run (train, merge, generate, eval)
    finds the same weights on any machine."""
    mixed = config.train.mixed_precision
    return _weights_dtype(config, "fp16" if mixed == "fp16" else "bf16")


def inference_dtype(precision: Precision, on_cuda: bool) -> str:
    """The dtype a trained run is loaded in for merging, generating and evaluating: on a GPU the
    dtype it computed in (`precision` resolved for the GPU at hand, so fp16 on one without bf16);
    on the CPU fp32, which is exact and, for inference, as fast as emulated 16-bit."""
    return precision.compute_dtype if on_cuda else "float32"


def resolve_optimizer(config: RunConfig, on_cuda: bool) -> str:
    """The optimizer the trainer builds: ``auto`` is torch's fused AdamW on CUDA (one kernel, no
    full-size temporaries) and its foreach AdamW elsewhere; any other value as configured."""
    if config.train.optimizer != "auto":
        return config.train.optimizer
    return "adamw_torch_fused" if on_cuda else "adamw_torch"
