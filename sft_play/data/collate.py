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

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from sft_play.data.tokenize import IGNORE_INDEX
from sft_play.data.vision import TEXT_KEYS, TOKEN_TYPE_KEYS


def _pad(rows: list[list[int]], value: int | None) -> torch.Tensor:
    """Rows padded at the end to the longest, with `value`, or (None: positions) with one span
    counting from 0: the padding is an example of its own, which no real token attends to."""
    width = max(len(r) for r in rows)
    return torch.tensor([list(r) + (list(range(width - len(r))) if value is None else [value] * (width - len(r)))
                         for r in rows], dtype=torch.long)


@dataclass
class PackedRowsCollator:
    """Batches packed rows: ``input_ids``, ``labels`` and per-example ``position_ids``."""

    pad_token_id: int

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        position_ids = DataCollatorForLanguageModeling.get_position_ids_from_packed_seq_lengths(
            [e["seq_lengths"] for e in examples]
        )
        labels = _pad([e["labels"] for e in examples], IGNORE_INDEX)
        positions = _pad([p.tolist() for p in position_ids], None)
        # An example's first token would be predicted from the previous example's last one
        labels[positions == 0] = IGNORE_INDEX
        return {
            "input_ids": _pad([e["input_ids"] for e in examples], self.pad_token_id),
            "labels": labels,
            "position_ids": positions,
        }


STAND_IN_SIDE = 56  # pixels a side of the stand-in picture: every processor takes it (Qwen-VL's least is 56x56)


@dataclass
class VisionCollator:
    """Batches examples with images (:mod:`sft_play.data.vision`): the tokens padded as text is
    (`inner`), the token types padded with 0, and the pixels the processor makes of the batch's
    images (``pixel_values`` and what else the model takes), from the references the rows keep.
    Padded to `length` tokens where given (gloo gathers only equal shapes).

    With `stand_in` (ZeRO-3, where data mixes rows with and without images), a batch without an
    image gets a white picture, its tokens in the first row's padding, unattended and unlabelled:
    every process then runs the vision encoder on every step, as ZeRO-3's gathers of its sharded
    weights need, and the picture changes no real token's output (LLaMA-Factory's fake image).
    Every batch then has room for it (its tokens more than the longest row, or than `length`)."""

    inner: Any
    processor: Any
    length: int | None = None
    stand_in: bool = False
    _picture: dict | None = None

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        from sft_play.data.vision import pixel_inputs

        batch = self.inner([{key: e[key] for key in ("input_ids", "labels")} for e in examples])
        room = len(self.picture()["input_ids"][0]) if self.stand_in else 0
        width = max(batch["input_ids"].shape[1], self.length or 0) + room
        if width > batch["input_ids"].shape[1]:
            extra = width - batch["input_ids"].shape[1]
            for key, value in (("input_ids", self.inner.pad_token_id), ("labels", IGNORE_INDEX), ("attention_mask", 0)):
                batch[key] = torch.cat([batch[key], torch.full((len(examples), extra), value, dtype=batch[key].dtype)], 1)
        types = [list(e.get("token_types") or ()) + [0] * (width - len(e.get("token_types") or ())) for e in examples]
        pictures = pixel_inputs(self.processor, [e.get("images") for e in examples])
        if self.stand_in and not pictures:
            picture = self.picture()
            batch["input_ids"][0, -room:] = torch.as_tensor(picture["input_ids"][0])
            types[0][-room:] = list(next((picture[key][0] for key in TOKEN_TYPE_KEYS if key in picture), [0] * room))
            pictures = {key: value for key, value in picture.items() if key not in TEXT_KEYS}
        if any(any(row) for row in types):
            batch[self.token_type_key] = _pad(types, 0)
        return {**batch, **pictures}

    def picture(self) -> dict[str, Any]:
        """The stand-in picture as the processor makes it: a user turn showing it, through the
        processor's chat template, its tokens and pixel inputs."""
        if self._picture is None:
            from PIL import Image

            white = Image.new("RGB", (STAND_IN_SIDE, STAND_IN_SIDE), (255, 255, 255))
            turn = [{"role": "user", "content": [{"type": "image"}]}]
            text = self.processor.apply_chat_template(turn, tokenize=False)
            self._picture = dict(self.processor(text=[text], images=[[white]], add_special_tokens=False,
                                                return_tensors="pt"))
        return self._picture

    @property
    def token_type_key(self) -> str:
        return "token_type_ids" if "token_type_ids" in getattr(self.processor, "model_input_names", ()) else "mm_token_type_ids"


SPLIT_KEYS = ("input_ids", "labels", "position_ids", "attention_mask")


@dataclass
class SplitSequencePadding:
    """Batches for a run that splits each row's tokens across `split` processes (DeepSpeed
    Ulysses): padded at the end to a multiple of `split`, and to at least `length` tokens where
    given (gloo, which CPU processes use, gathers only tensors of equal shapes, and Ulysses
    gathers each batch across the split). Position ids come with every batch (Ulysses gathers them
    to find where each example starts), and count on through the padding, which follows every real
    token of its row and is therefore attended by none."""

    inner: Any
    pad_token_id: int
    split: int
    length: int | None = None

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        # what Ulysses splits: [rows, tokens] tensors (not the padding-free collator's cumulative
        # lengths, which FlashAttention-2 then finds again from the gathered position ids)
        batch = {key: value for key, value in self.inner(examples).items() if key in SPLIT_KEYS}
        rows, width = batch["input_ids"].shape
        if "position_ids" not in batch:
            batch["position_ids"] = torch.arange(width).expand(rows, width).clone()
        target = max(width, self.length or 0)
        target = -(-target // self.split) * self.split
        extra = target - width
        if extra:
            tail = {"input_ids": self.pad_token_id, "labels": IGNORE_INDEX, "attention_mask": 0}
            for key, value in list(batch.items()):
                if key == "position_ids":  # counting on from each row's last position
                    pad = value[:, -1:] + 1 + torch.arange(extra)
                else:
                    pad = torch.full((rows, extra), tail.get(key, 0), dtype=value.dtype)
                batch[key] = torch.cat([value, pad.to(value.dtype)], dim=1)
        return batch


@dataclass
class RecordingCollator:
    """Wraps a collator and appends a fingerprint of every row it batches to a JSON-lines file
    (one file per rank): what each process trained on, for debugging runs that differ."""

    inner: Any
    path: Path

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        fingerprints = [hashlib.sha1(json.dumps(list(e["input_ids"])).encode()).hexdigest()[:16] for e in examples]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(fingerprints) + "\n")
        return self.inner(examples)


def make_collator(pad_token_id: int, kind: str, record_to: Path | None = None, split: int = 1,
                  length: int | None = None, processor: Any = None, stand_in: bool = False) -> Any:
    """The collator the run resolved (``Run.kernels.collator``, :func:`sft_play.run.collator_kind`).

    ``padded``: TRL's collator, which pads to the longest in the batch; ``padding_free``: TRL's
    padding-free one (packed rows under FlashAttention-2, variable length); ``packed_rows``:
    :class:`PackedRowsCollator`. With `record_to`, every row's fingerprint is recorded there.
    With `split` above 1 (sequence parallelism), batches are padded for it (:class:`SplitSequencePadding`,
    to `length` tokens at least). With a vision-language model's `processor`, batches carry their
    images' pixels (:class:`VisionCollator`, padded to `length` tokens where given; with
    `stand_in`, a stand-in picture for a batch without one).
    """
    if processor is not None:
        if kind != "padded" or split > 1:
            raise ValueError("examples with images are batched padded, one process per row")
        collator: Any = VisionCollator(DataCollatorForLanguageModeling(pad_token_id=pad_token_id), processor, length,
                                       stand_in)
        return RecordingCollator(collator, record_to) if record_to is not None else collator
    if kind == "padded":
        collator: Any = DataCollatorForLanguageModeling(pad_token_id=pad_token_id)
    elif kind == "padding_free":
        collator = DataCollatorForLanguageModeling(pad_token_id=pad_token_id, padding_free=True)
    elif kind == "packed_rows":
        collator = PackedRowsCollator(pad_token_id=pad_token_id)
    else:
        raise ValueError(f"unknown collator {kind!r}")
    if split > 1:
        collator = SplitSequencePadding(collator, pad_token_id, split, length)
    return RecordingCollator(collator, record_to) if record_to is not None else collator
