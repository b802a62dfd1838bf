"""Records with images, for vision-language models: tokens and labels through the model's own
processor, and the pixels of a batch.

An example's tokens are what its processor makes of the rendered conversation and its images:
each image placeholder expanded into the tokens the image costs (Qwen-VL: one per 28x28 patch
of the resized image; Gemma-3: a fixed 256; Idefics3/SmolVLM: a grid of crops), so the lengths
the planner reads and the truncation below see every image token. The assistant turns are found
as characters of the rendered text (:func:`sft_play.data.tokenize.assistant_spans`) and carried
through the expansion by the offsets the processor reports for each replacement. Image tokens
are never labelled, and never cut: an example whose cut would fall inside or before an image is
left out, as TRL refuses to truncate one and peers' users hit the feature/token mismatch
(trl#4289, LlamaFactory#8622).

The pixels are not stored: the collator (:class:`sft_play.data.collate.VisionCollator`) has the
processor make them for each batch from the images' references (:func:`pixel_inputs`), with the
same settings that counted the tokens.
"""

from __future__ import annotations

import bisect
import json
from typing import Any

from sft_play.data import images
from sft_play.data.tokenize import (IGNORE_INDEX, assistant_spans, labelled_in, last_turn_only,
                                    prompt_turns_unlabelled)

# Per-token inputs a processor returns beside the ids (Gemma-3's token_type_ids marks image tokens,
# which attend to each other both ways); kept with the tokens, padded with 0
TOKEN_TYPE_KEYS = ("token_type_ids", "mm_token_type_ids")
TEXT_KEYS = ("input_ids", "attention_mask", "offset_mapping", "text_replacement_offsets", *TOKEN_TYPE_KEYS)
CUT_IMAGE = "cut_image"  # the status of an example whose image tokens a cut would reach


def encode(record: dict[str, Any], processor: Any, template: str, train_on: str) -> dict[str, Any]:
    """Tokens, labels, token types and where the last image's tokens end, for one chat record
    with images (:mod:`sft_play.data.images`)."""
    tokenizer = processor.tokenizer
    full, spans = assistant_spans(tokenizer, record["messages"], template, record.get("tools"))
    pictures = [images.load(ref) for ref in record["images"]]
    out = processor(text=[full], images=[pictures], add_special_tokens=False, return_offsets_mapping=True,
                    return_text_replacement_offsets=True)
    ids = list(out["input_ids"][0])
    offsets = [tuple(o) for o in out["offset_mapping"][0]]
    replaced = sorted((r["span"], r["new_span"]) for r in out["text_replacement_offsets"][0])
    shifted = [(_moved(start, replaced), _moved(end, replaced)) for start, end in spans]
    image_spans = [new for _, new in replaced]
    in_image = [any(a <= begin and end <= b for a, b in image_spans) and end > begin for begin, end in offsets]
    if train_on == "all":
        labels = list(ids)
    else:
        labels = labelled_in(ids, offsets, shifted)
        if train_on == "last":
            labels = last_turn_only(labels)
    labels = [IGNORE_INDEX if image else label for label, image in zip(labels, in_image)]
    labels = prompt_turns_unlabelled(record, labels, train_on)
    types = next((list(out[key][0]) for key in TOKEN_TYPE_KEYS if key in out), [0] * len(ids))
    image_end = max((i + 1 for i, image in enumerate(in_image) if image), default=0)
    pixels, inputs = encoder_inputs(out)
    return {"input_ids": ids, "labels": labels, "token_types": types, "image_end": image_end,
            "image_tokens": sum(in_image), "pixels": pixels, "encoder_inputs": inputs}


def encoder_inputs(out: Any) -> tuple[int, str]:
    """(the pixel values, a description) of what `out`, the processor's answer for one example,
    gives the vision encoder: each input's shape and dtype, and the values of small integer ones
    (Qwen-VL's ``image_grid_thw``), as JSON. The planner traces the encoder on the heaviest
    example's (:mod:`sft_play.planner.simulate.encoder`)."""
    import numpy as np

    described: dict[str, Any] = {}
    pixels = 0
    for key, value in out.items():
        if key in TEXT_KEYS:
            continue
        dtype = None
        if hasattr(value, "detach"):  # a torch tensor: numpy has no bf16, so its dtype is named here
            dtype = str(value.dtype).removeprefix("torch.")
            value = value.detach().cpu()
            value = value.float() if value.is_floating_point() else value
        try:
            array = np.asarray(value)
        except (TypeError, ValueError):  # ragged: nothing an encoder takes as one tensor
            continue
        if array.dtype == object:
            continue
        if array.dtype.kind in "iu" and array.size <= SMALL_INPUT:
            described[key] = {"values": array.tolist()}
        else:
            described[key] = {"shape": list(array.shape), "dtype": dtype or str(array.dtype)}
        if array.dtype.kind == "f":
            pixels += int(array.size)
    return pixels, json.dumps(described, sort_keys=True)


SMALL_INPUT = 4096  # integer inputs up to this many values are kept (grids, sizes), larger ones by shape


def _moved(position: int, replaced: list[tuple[tuple[int, int], tuple[int, int]]]) -> int:
    """Where character `position` of the rendered text is once the replacements before it are made."""
    ends = [old[1] for old, _ in replaced]
    done = bisect.bisect_right(ends, position)
    return position + sum((new[1] - new[0]) - (old[1] - old[0]) for old, new in replaced[:done])


def limited(encoded: dict[str, Any], limit: int, overlong: str) -> dict[str, Any]:
    """:func:`sft_play.data.pipeline._limited` for an example with images: cut at `limit` only
    after its last image token, else left out (:data:`CUT_IMAGE`)."""
    ids, labels, types = encoded["input_ids"], encoded["labels"], encoded["token_types"]
    status = "ok"
    if len(ids) > limit:
        if encoded["image_end"] > limit:
            status = CUT_IMAGE
        elif overlong == "drop":
            status = "dropped"
        else:
            ids, labels, types = ids[:limit], labels[:limit], types[:limit]
            status = "no_answer" if all(label == IGNORE_INDEX for label in labels) else "truncated"
    return {"input_ids": ids, "labels": labels, "token_types": types, "status": status,
            "image_tokens": encoded["image_tokens"], "pixels": encoded["pixels"],
            "encoder_inputs": encoded["encoder_inputs"],
            "text_tokens": len(encoded["input_ids"]) - encoded["image_tokens"]}  # (before any cut)


def pixel_inputs(processor: Any, references: list[str | None]) -> dict[str, Any]:
    """The image inputs of a batch (``pixel_values``, and ``image_grid_thw``, ``pixel_attention_mask``
    and the like where the model takes them) for the examples' JSON lists of image references; the
    examples without images contribute none (models place image features in order, at the image
    tokens). Empty when no example has an image."""
    try:
        nested = [[images.load(ref) for ref in json.loads(refs)] for refs in references if refs]
    except images.ImageProblem as exc:
        from sft_play.errors import UserError

        raise UserError(f"{exc.reason}, after its tokens were counted from the image as it was: put it back, or start "
                        "the run again, which prepares the data again") from None
    nested = [pictures for pictures in nested if pictures]
    if not nested:
        return {}
    out = processor(images=nested, return_tensors="pt", padding=True)
    return {key: value for key, value in out.items() if key not in TEXT_KEYS}


def pixel_budget(processor: Any) -> int:
    """The most pixels `processor` keeps of an image where it sizes images by area (Qwen-VL's
    ``size["longest_edge"]``, after :func:`apply_pixel_budget`); 0 where it sizes them otherwise."""
    image_processor = getattr(processor, "image_processor", None)
    size = getattr(image_processor, "size", None) or {}
    if hasattr(image_processor, "merge_size") and isinstance(size.get("longest_edge"), int):
        return size["longest_edge"]
    return 0


def image_token_ids(processor: Any) -> set[int]:
    """The token ids that stand for an image's features in `processor`'s model (what its image
    placeholder expands into, and the placeholder itself): a text that holds one would make the
    model look for an image."""
    tokenizer = processor.tokenizer
    names = {getattr(processor, key, None) for key in ("image_token", "boi_token")}
    names |= {getattr(tokenizer, key, None) for key in ("image_token", "boi_token")}
    ids = {tokenizer.convert_tokens_to_ids(name) for name in names if isinstance(name, str)}
    ids |= {value for key in ("image_token_id", "image_token_index") if isinstance(
        value := getattr(processor, key, None), int)}
    return {i for i in ids if isinstance(i, int) and i != tokenizer.unk_token_id}


def changed_images(*datasets: Any) -> list[str]:
    """The image files that tokenised `datasets` (with an ``images`` column) name and that changed
    or went since their tokens were counted (:func:`sft_play.data.images.changed`): their tokens
    may no longer be what the processor makes of them."""
    found: list[str] = []
    for dataset in datasets:
        if dataset is None or "images" not in dataset.column_names:
            continue
        column = dataset.data.column("images")
        for chunk in column.chunks:
            for refs in chunk.to_pylist():
                found += [ref["path"] for ref in json.loads(refs) if images.changed(ref)] if refs else []
    return found


def image_settings(processor: Any) -> str:
    """What identifies how `processor` turns images into tokens and pixels (for the data cache's key)."""
    image_processor = getattr(processor, "image_processor", None)
    own = {key: getattr(processor, key) for key in ("image_seq_length", "image_seq_len", "num_image_tokens")
           if isinstance(getattr(processor, key, None), int)}
    return json.dumps({"processor": type(processor).__name__, **own,
                       "images": image_processor.to_json_string() if image_processor is not None else None})


def apply_pixel_budget(processor: Any, max_pixels: int | None, min_pixels: int | None) -> str:
    """Set ``data.image_max_pixels``/``image_min_pixels`` on the processor, the way it sizes images;
    returns how it sizes them now (for the plan and the logs).

    Qwen-VL's processor keeps an image's area between two pixel counts (its ``size`` holds them
    as ``shortest_edge``/``longest_edge``); Idefics3's and SmolVLM's scale the longest edge to a
    length and split the image into crops of ``max_image_size``; Gemma-3's and LLaVA's resize
    every image to one height and width, where a budget has no effect."""
    image_processor = processor.image_processor
    size = dict(getattr(image_processor, "size", None) or {})
    if hasattr(image_processor, "merge_size") and {"shortest_edge", "longest_edge"} <= set(size):  # Qwen-VL
        if max_pixels:
            size["longest_edge"] = max_pixels
        if min_pixels:
            size["shortest_edge"] = min_pixels
        image_processor.size = size
        for key, value in (("max_pixels", max_pixels), ("min_pixels", min_pixels)):
            if value and hasattr(image_processor, key):
                setattr(image_processor, key, value)
        return f"images keep {size['shortest_edge']:,} to {size['longest_edge']:,} pixels"
    crop = (getattr(image_processor, "max_image_size", None) or {}).get("longest_edge")
    if crop and size.get("longest_edge"):  # Idefics3, SmolVLM
        if max_pixels:
            size["longest_edge"] = max(crop, int(max_pixels ** 0.5) // crop * crop)
            image_processor.size = size
        return (f"images are scaled to a longest edge of {size['longest_edge']} pixels and split into crops of "
                f"{crop}x{crop}")
    fixed = size if size.get("height") else dict(getattr(image_processor, "crop_size", None) or {})
    if fixed.get("height"):
        note = f"every image is resized to {fixed['height']}x{fixed['width']}"
    elif size.get("shortest_edge"):
        note = f"every image's shorter edge is resized to {size['shortest_edge']}"
    else:
        note = f"images are sized by {type(image_processor).__name__}'s own rule"
    if max_pixels or min_pixels:
        note += " (data.image_max_pixels/image_min_pixels have no effect on this processor)"
    return note
