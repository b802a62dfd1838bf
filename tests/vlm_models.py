"""Tiny vision-language models of two families, built offline from configs, with processors made
here, and synthetic images: what the vision tests train, and what ``configs/tiny_vlm`` (Gemma-3's
shape) ships, made by :func:`tiny_gemma3` (tests/test_vision.py checks the shipped files match).

Both start from the embedded tiny model's tokenizer (configs/tiny_model) with the families' image
tokens added, so that a text of the tests tokenises alike in both."""

from __future__ import annotations

import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHATML_IMAGES = (  # ChatML whose content may list text and image parts; `image` is the family's mark
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "IMAGE{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 60, 220), "yellow": (235, 220, 40),
           "black": (15, 15, 15), "white": (245, 245, 245), "purple": (140, 50, 170), "orange": (245, 140, 20)}


def _tokenizer(folder: Path, tokens: list[str], extra: dict[str, str] | None = None):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ROOT / "configs" / "tiny_model")
    tokenizer.add_tokens(tokens, special_tokens=True)
    tokenizer.save_pretrained(folder)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    if extra:
        settings["extra_special_tokens"] = extra
    (folder / "tokenizer_config.json").write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
    return AutoTokenizer.from_pretrained(folder)


def _text(**changes) -> dict:
    text = json.loads((ROOT / "configs" / "tiny_model" / "config.json").read_text())
    for key in ("architectures", "model_type", "dtype", "use_cache"):
        text.pop(key, None)
    return {**text, **changes}


def tiny_gemma3(folder: Path) -> Path:
    """A Gemma-3-shaped model: a 2-layer SigLIP encoder of 56x56 images in 14-pixel patches,
    average-pooled to 4 tokens per image, and a 4-layer Gemma-3 text model 128 wide."""
    from transformers import Gemma3Config, Gemma3ImageProcessorPil, Gemma3Processor

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(folder, ["<start_of_image>", "<end_of_image>", "<image_soft_token>"],
                           {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                            "image_token": "<image_soft_token>"})
    processor = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 56, "width": 56}),
                                tokenizer=tokenizer, chat_template=CHATML_IMAGES.replace("IMAGE", "<start_of_image>"),
                                image_seq_length=4)
    processor.save_pretrained(folder)
    text = _text(model_type="gemma3_text", head_dim=64, query_pre_attn_scalar=64, sliding_window=128,
                 layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
                 rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    config = Gemma3Config(
        text_config=text,
        vision_config={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "image_size": 56, "patch_size": 14, "vision_use_head": False},
        mm_tokens_per_image=4, boi_token_id=tokenizer.boi_token_id, eoi_token_id=tokenizer.eoi_token_id,
        image_token_id=tokenizer.image_token_id, initializer_range=0.06, tie_word_embeddings=False)
    config.save_pretrained(folder)
    _tidy(folder)
    return folder


def tiny_llava(folder: Path) -> Path:
    """A LLaVA-shaped model: a 2-layer CLIP encoder of 28x28 images in 14-pixel patches (4 tokens
    per image, its class token dropped), a two-layer projector, and the tiny Llama."""
    from transformers import LlavaConfig, LlavaImageProcessorPil, LlavaProcessor

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(folder, ["<image>"], {"image_token": "<image>"})
    image_processor = LlavaImageProcessorPil(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=14,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=CHATML_IMAGES.replace("IMAGE", "<image>"))
    processor.save_pretrained(folder)
    config = LlavaConfig(
        text_config={**_text(), "model_type": "llama"},
        vision_config={"model_type": "clip_vision_model", "hidden_size": 64, "intermediate_size": 128,
                       "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 28, "patch_size": 14,
                       "projection_dim": 64},
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_select_strategy="default",
        vision_feature_layer=-1, tie_word_embeddings=False)
    config.save_pretrained(folder)
    _tidy(folder)
    return folder


# Keys transformers writes that describe how the files were loaded, not what they are
_LOADED_HOW = ("local_files_only", "is_local")


def tiny_idefics3(folder: Path) -> Path:
    """An Idefics3-shaped model (SmolVLM's architecture): images scaled to a longest edge of 112
    pixels and split into crops of 56x56 beside a global view, each crop a 2-layer SigLIP-like
    encoding of 14-pixel patches pixel-shuffled to 4 tokens, and the tiny Llama."""
    from transformers import Idefics3Config, Idefics3ImageProcessorPil, Idefics3Processor

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    grid = [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
    tokenizer = _tokenizer(folder, ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>", *grid])
    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": 112}, max_image_size={"longest_edge": 56})
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4,
                                  chat_template=CHATML_IMAGES.replace("IMAGE", "<image>"))
    processor.save_pretrained(folder)
    config = Idefics3Config(
        text_config={**_text(), "model_type": "llama"},
        vision_config={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "image_size": 56, "patch_size": 14},
        scale_factor=2, image_token_id=tokenizer.convert_tokens_to_ids("<image>"), tie_word_embeddings=False)
    config.save_pretrained(folder)
    _tidy(folder)
    return folder


# The families the tests build, by name (tests/conftest.py's `families` fixture builds each once)
BUILDERS = {"gemma3": tiny_gemma3, "llava": tiny_llava, "idefics3": tiny_idefics3}


def _tidy(folder: Path) -> None:
    """Every JSON file with sorted keys and a final newline, without how it was loaded (stable bytes
    for the shipped copy, whether the hub is reachable or not)."""
    for path in folder.glob("*.json"):
        if path.name != "tokenizer.json":
            settings = {k: v for k, v in json.loads(path.read_text()).items() if k not in _LOADED_HOW}
            path.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")


def colour_image(path: Path, colour: str, shade: int = 0, size: tuple[int, int] = (56, 56)) -> Path:
    """A picture of one colour (its shade moved by `shade`), lighter towards one corner."""
    from PIL import Image

    base = [max(0, min(255, c + shade)) for c in COLOURS[colour]]
    width, height = size
    image = Image.new("RGB", size)
    image.putdata([tuple(max(0, min(255, c + (x + y) // 8)) for c in base) for y in range(height) for x in range(width)])
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path


QUESTIONS = ["What colour is this picture?", "Which colour do you see?", "Name the colour of the image.",
             "What is the main colour here?"]


def colour_rows(folder: Path, count: int, seed: int = 0, shades: int = 4) -> list[dict]:
    """`count` conversations asking the colour of a picture in `folder/images/` (made here, the
    paths relative to `folder`), in TRL's form: an ``images`` list beside messages with an image part."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        colour, shade = rng.choice(sorted(COLOURS)), rng.randrange(shades)
        name = f"images/{colour}-{shade}.png"
        if not (folder / name).exists():
            colour_image(folder / name, colour, (shade - shades // 2) * 12)
        rows.append({"images": [name], "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": rng.choice(QUESTIONS)}]},
            {"role": "assistant", "content": [{"type": "text", "text": colour}]}]})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def tiny_vlm_data(folder: Path, train: int = 480, validation: int = 32) -> Path:
    """The colour questions ``data/tiny_vlm`` ships: `train` and `validation` rows over 32 pictures."""
    folder = Path(folder)
    write_jsonl(folder / "train.jsonl", colour_rows(folder, train, seed=0))
    write_jsonl(folder / "validation.jsonl", colour_rows(folder, validation, seed=1))
    return folder
