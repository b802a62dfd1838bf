"""Batching packed rows so that packed examples never attend to each other.

Packed rows (``seq_lengths`` tells where each example starts) are batched with position ids
that restart at 0 for every example and no attention mask: transformers then builds a
block-diagonal causal mask for SDPA and eager attention, and FlashAttention-2 reads the
boundaries from the position ids. Rows stay rows (batch x max_seq_length), unlike TRL's
padding-free collator that flattens a batch into one long row: that is right for
FlashAttention-2's variable-length kernel, but costs quadratic attention over the whole batch
with SDPA or eager attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from sft_play.data.tokenize import IGNORE_INDEX


def _pad(rows: list[list[int]], value: int) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([list(r) + [value] * (width - len(r)) for r in rows], dtype=torch.long)


@dataclass
class PackedRowsCollator:
    """Batches packed rows: ``input_ids``, ``labels`` and per-example ``position_ids``."""

    pad_token_id: int

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        position_ids = DataCollatorForLanguageModeling.get_position_ids_from_packed_seq_lengths(
            [e["seq_lengths"] for e in examples]
        )
        labels = _pad([e["labels"] for e in examples], IGNORE_INDEX)
        positions = _pad([p.tolist() for p in position_ids], 0)
        # An example's first token would be predicted from the previous example's last one
        labels[positions == 0] = IGNORE_INDEX
        return {
            "input_ids": _pad([e["input_ids"] for e in examples], self.pad_token_id),
            "labels": labels,
            "position_ids": positions,
        }


def make_collator(pad_token_id: int, packed: bool, attn_implementation: str) -> Any:
    """The collator for the run's data layout and attention kernel.

    Returns None for unpacked data: TRL's default collator pads to the longest in the batch.
    """
    if not packed:
        return None
    if attn_implementation.startswith("flash_attention"):
        return DataCollatorForLanguageModeling(pad_token_id=pad_token_id, padding_free=True)
    return PackedRowsCollator(pad_token_id=pad_token_id)
