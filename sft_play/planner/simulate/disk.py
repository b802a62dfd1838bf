"""How much disk a run's checkpoints take: pure arithmetic on the model shape and recipe."""

from __future__ import annotations

from sft_play.planner.simulate.shapes import ModelShape
from sft_play.precision import DTYPE_BYTES, Precision

# AdamW keeps two states per trainable parameter; the 8-bit variants keep them in one byte each.
OPTIMIZER_STATE_BYTES = {
    "auto": 8,
    "adamw_torch": 8, "adamw_torch_fused": 8, "adamw_8bit": 2, "paged_adamw_8bit": 2, "sgd": 0, "adafactor": 4,
}


def saved_model_bytes(shape: ModelShape, method: str, precision: Precision) -> int:
    """The final model/ folder: the whole model for full fine-tuning, else the adapter.

    Full models are saved in their storage dtype; LoRA adapters in float32 (peft upcasts them),
    QLoRA adapters in bfloat16 (TRL casts them).
    """
    if method == "full":
        return shape.total_params * DTYPE_BYTES[precision.weights_dtype]
    return shape.lora_params * (2 if method == "qlora" else 4)


def checkpoint_bytes(shape: ModelShape, method: str, precision: Precision, optimizer: str) -> int:
    """One training checkpoint: the trainable weights plus the optimizer states."""
    return saved_model_bytes(shape, method, precision) + shape.trainable_params * OPTIMIZER_STATE_BYTES[optimizer]


def run_disk_bytes(
    shape: ModelShape, method: str, precision: Precision, optimizer: str, save_steps: int, save_total_limit: int
) -> int:
    """Disk the whole run needs at its peak: the kept checkpoints, one more being written before
    the oldest is deleted, and the final model."""
    kept = (save_total_limit + 1) if save_steps > 0 else 0
    return kept * checkpoint_bytes(shape, method, precision, optimizer) + saved_model_bytes(shape, method, precision)
