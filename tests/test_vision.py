"""Vision-language models: records with images read in the forms peers write them and every bad
image named; tokens as the model's own processor makes them, answers alone labelled, image tokens
never cut; pixels batched; exact counts and plans of public configs; and tiny models of two
families (Gemma-3's and LLaVA's shapes, tests/vlm_models.py) trained for real, one process and two,
generated from with an image, merged; and Idefics3's (SmolVLM's architecture), which splits
pictures into crops, through its processor, collator and model."""

from __future__ import annotations

import base64
import json
import os
import random
from pathlib import Path

import pytest
import torch

from sft_play.config import load as load_config
from sft_play.data import DataStats, build, load_records
from sft_play.data.formats import InvalidRow
from sft_play.data.tokenize import IGNORE_INDEX
from sft_play.errors import UserError
from tests import vlm_models
from tests.conftest import FIXTURES, FORKED, REPO, printed_answers, run_scripts_together

FAMILIES = tuple(vlm_models.BUILDERS)


@pytest.fixture(scope="module")
def colours(tmp_path_factory) -> Path:
    """64 training and 8 validation questions about synthetic pictures, made here."""
    folder = tmp_path_factory.mktemp("colours")
    vlm_models.tiny_vlm_data(folder, train=64, validation=8)
    return folder


def _config(model: Path, data: Path, *overrides: str):
    return load_config(None, [f"model.name_or_path={model}", f"data.path={data}", "data.packing=false",
                              "data.max_seq_length=128", "data.num_proc=1", *overrides], check_paths=False)


def _processor(model: Path, *overrides: str):
    from sft_play import model as model_module

    config = _config(model, REPO / "data" / "tiny_vlm" / "train.jsonl", *overrides)
    tokenizer = model_module.load_tokenizer(config)
    return config, tokenizer, model_module.load_processor(config, tokenizer)


def test_the_shipped_tiny_vlm_is_what_its_builder_makes(tmp_path):
    made = vlm_models.tiny_gemma3(tmp_path / "model")
    shipped = REPO / "configs" / "tiny_vlm"
    assert sorted(p.name for p in shipped.iterdir()) == sorted(p.name for p in made.iterdir())
    for path in made.iterdir():
        assert (shipped / path.name).read_bytes() == path.read_bytes(), path.name
    data = vlm_models.tiny_vlm_data(tmp_path / "data")
    for name in ("train.jsonl", "validation.jsonl"):
        assert (REPO / "data" / "tiny_vlm" / name).read_text() == (data / name).read_text()
    assert sorted(p.name for p in (data / "images").iterdir()) == sorted(
        p.name for p in (REPO / "data" / "tiny_vlm" / "images").iterdir())


def _png(path: Path, colour: str = "red") -> Path:
    return vlm_models.colour_image(path, colour)


def test_images_are_read_in_the_forms_peers_write(tmp_path):
    picture = _png(tmp_path / "pics" / "a.png")
    raw = picture.read_bytes()
    uri = "data:image/png;base64," + base64.b64encode(raw).decode()
    answer = {"role": "assistant", "content": "red"}
    rows = [
        # TRL: an images column beside parts
        {"images": ["pics/a.png"], "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}, answer]},
        # an image inside its part (absolute path), and OpenAI's image_url with a data: URI
        {"messages": [{"role": "user", "content": [{"type": "image", "image": str(picture)},
                                                   {"type": "image_url", "image_url": {"url": uri}},
                                                   {"type": "text", "text": "Colours?"}]}, answer]},
        # LLaMA-Factory: <image> in string content, an images list; datasets' Image cell with bytes
        {"images": [{"bytes": None, "path": "pics/a.png"}], "messages": [
            {"role": "user", "content": "Look: <image> Colour?"}, answer]},
        # images and no place marked: before the first user turn's text (TRL)
        {"image": "pics/a.png", "messages": [{"role": "user", "content": "Colour?"}, answer]},
        # no images: "<image>" is text, and parts of text become a string
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Is <image> a tag?"}]}, answer]},
    ]
    vlm_models.write_jsonl(tmp_path / "train.jsonl", rows)
    records = load_records(str(tmp_path / "train.jsonl"), _config(tmp_path, tmp_path).data, DataStats())
    resolved = {"path": str(picture.resolve()), "size": picture.stat().st_size, "mtime": picture.stat().st_mtime_ns}
    assert records[0]["images"] == [resolved]
    assert records[0]["messages"][0]["content"] == [{"type": "image"}, {"type": "text", "text": "Colour?"}]
    assert records[1]["images"] == [resolved, {"bytes": base64.b64encode(raw).decode()}]
    assert records[1]["messages"][0]["content"][:2] == [{"type": "image"}, {"type": "image"}]
    assert records[2]["images"] == [resolved]
    assert records[2]["messages"][0]["content"] == [
        {"type": "text", "text": "Look: "}, {"type": "image"}, {"type": "text", "text": " Colour?"}]
    assert records[3]["messages"][0]["content"] == [{"type": "image"}, {"type": "text", "text": "Colour?"}]
    assert "images" not in records[4] and records[4]["messages"][0]["content"] == "Is <image> a tag?"

    import datasets  # a hub dataset's or save_to_disk folder's Image column: datasets decodes it to PIL images

    saved = datasets.Dataset.from_dict(
        {"images": [[str(picture)]], "messages": [[{"role": "user", "content": "<image>Colour?"}, answer]]},
        features=datasets.Features({"images": datasets.List(datasets.Image()), "messages": [
            {"role": datasets.Value("string"), "content": datasets.Value("string")}]}))
    saved.save_to_disk(str(tmp_path / "saved"))
    record, = load_records(str(tmp_path / "saved"), _config(tmp_path, tmp_path).data, DataStats())
    assert set(record["images"][0]) == {"bytes"} and record["messages"][0]["content"][0] == {"type": "image"}

    sharegpt = [{"conversations": [{"from": "human", "value": "<image>Colour?"}, {"from": "gpt", "value": "red"}],
                 "images": ["pics/a.png"]}]
    vlm_models.write_jsonl(tmp_path / "sharegpt.jsonl", sharegpt)
    record, = load_records(str(tmp_path / "sharegpt.jsonl"), _config(tmp_path, tmp_path).data, DataStats())
    assert record["images"] == [resolved] and record["messages"][0]["content"][0] == {"type": "image"}


def test_every_bad_image_is_named_by_file_row_and_field(tmp_path):
    good = _png(tmp_path / "ok.png")
    (tmp_path / "cut.png").write_bytes(good.read_bytes()[:60])
    (tmp_path / "text.png").write_text("not a picture")
    (tmp_path / "folder.png").mkdir()
    user, answer = {"role": "user", "content": "<image>Colour?"}, {"role": "assistant", "content": "red"}
    rows = [{"images": [name], "messages": [user, answer]}
            for name in ("ok.png", "missing.png", "cut.png", "text.png", "folder.png", "https://example.com/a.png")]
    rows += [{"images": ["ok.png", "ok.png"], "messages": [user, answer]},
             {"images": [3], "messages": [user, answer]},
             {"messages": [{"role": "user", "content": [{"type": "video"}]}, answer]},
             {"images": ["data:image/png,abc"], "messages": [user, answer]}]
    path = vlm_models.write_jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(InvalidRow) as caught:
        load_records(str(path), _config(tmp_path, tmp_path).data, DataStats())
    text = str(caught.value)
    assert caught.value.count == 9, text
    for row, reason in [(2, f"field 'images': no such image file: {tmp_path / 'missing.png'}"),
                        (3, f"field 'images': {tmp_path / 'cut.png'} is not a readable image"),
                        (4, f"field 'images': {tmp_path / 'text.png'} is not an image (no format PIL reads)"),
                        (5, "is a folder, not an image file"),
                        (6, "https://example.com/a.png is a URL: images are read from files or the data itself"),
                        (7, "2 image(s) for 1 place(s) marked in the messages"),
                        (8, "expected an image path or bytes, got int"),
                        (9, "'messages[0].content[0].type': 'video': only text and image parts are read"),
                        (10, "a data: URI of an image must be base64")]:
        assert f"{path}, row {row}, " in text and reason in text, (row, reason, text)


def _encoded(tmp_path: Path, model: Path, rows: list[dict], *overrides: str):
    from sft_play import model as model_module

    data = vlm_models.write_jsonl(tmp_path / "rows.jsonl", rows)
    config = _config(model, data, "data.cache=false", *overrides)
    tokenizer = model_module.load_tokenizer(config)
    processor = model_module.load_processor(config, tokenizer)
    return build(config.data, tokenizer, processor=processor), processor


@pytest.mark.parametrize("family", FAMILIES)
def test_tokens_are_the_processors_own_and_only_the_answer_is_labelled(tmp_path, families, family):
    from sft_play.data import images

    rows = vlm_models.colour_rows(tmp_path, 3)
    bundle, processor = _encoded(tmp_path, families[family], rows)
    assert bundle.stats.images == 3 and bundle.stats.images_max == 1
    for row, source in zip(bundle.train, rows):
        text = processor.tokenizer.apply_chat_template(source["messages"], tokenize=False)
        picture = images.load({"path": str(tmp_path / source["images"][0])})
        own = processor(text=[text], images=[[picture]], add_special_tokens=False)
        assert row["input_ids"] == list(own["input_ids"][0])
        answer = processor.tokenizer(source["messages"][1]["content"][0]["text"] + "<|im_end|>\n",
                                     add_special_tokens=False)["input_ids"]
        labelled = [label for label in row["labels"] if label != IGNORE_INDEX]
        assert labelled == answer
        image_token = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
        assert image_token in row["input_ids"]
    per_image = bundle.stats.image_tokens / bundle.stats.images
    assert per_image >= 4 and bundle.stats.image_tokens < bundle.stats.tokens_total


def test_a_cut_never_reaches_an_image(tmp_path, families):
    rows = vlm_models.colour_rows(tmp_path, 3)
    for row in rows:
        row["messages"][0]["content"][1]["text"] = "Colour?"
    rows[1]["messages"][0]["content"] = [{"type": "text", "text": " ".join("abcdefghijklmnopqrstuvwxyz" * 2)},
                                         {"type": "image"}, {"type": "text", "text": "?"}]
    rows[2]["messages"][1]["content"] = "red " * 40  # a long answer after the image: cut there, the image kept
    bundle, processor = _encoded(tmp_path, families["gemma3"], rows, "data.max_seq_length=40", "data.on_invalid=skip")
    stats = bundle.stats
    reason = "an image's tokens reach past data.max_seq_length=40 (image tokens are never cut)"
    assert stats.skipped == {reason: 1} and stats.skipped_rows[reason] == [f"{tmp_path / 'rows.jsonl'}:2"]
    assert stats.truncated == 1 and stats.examples == 2 and stats.images == 2
    image = processor.tokenizer.image_token_id
    assert [len(row["input_ids"]) for row in bundle.train][1] == 40
    assert all(row["input_ids"].count(image) == 4 for row in bundle.train)


def test_packing_streaming_a_text_model_and_a_written_out_image_token_are_refused_in_one_error(tmp_path, families):
    rows = vlm_models.colour_rows(tmp_path, 2)
    with pytest.raises(UserError, match="data.streaming is not done for vision-language models yet"):
        _encoded(tmp_path, families["gemma3"], rows, "data.streaming=true", "train.max_steps=2")
    text_only = [{"messages": [{"role": "user", "content": "What does <image> do?"}, {"role": "assistant", "content": "x"}]}]
    with pytest.raises(UserError, match=r"rows.jsonl:3 has no image, and its text holds one of the model's image tokens"):
        _encoded(tmp_path, families["llava"], rows + text_only)
    with pytest.raises(UserError, match="data.packing joins examples into rows, which examples with images cannot "
                                        "share"):
        _encoded(tmp_path, families["gemma3"], rows, "data.packing=true")
    with pytest.raises(UserError, match=r"rows.jsonl:1 shows images, and the model is a text model"):
        _encoded(tmp_path, REPO / "configs" / "tiny_model", rows)


def test_the_pixel_budget_is_applied_as_each_processor_sizes_images(tmp_path):
    from types import SimpleNamespace

    from PIL import Image
    from transformers import Idefics3ImageProcessorPil, Qwen2VLImageProcessorPil

    from sft_play.data.vision import apply_pixel_budget

    big = Image.new("RGB", (1120, 840), (10, 200, 30))
    qwen = SimpleNamespace(image_processor=Qwen2VLImageProcessorPil())
    note = apply_pixel_budget(qwen, 256 * 28 * 28, 4 * 28 * 28)
    assert note == "images keep 3,136 to 200,704 pixels"
    grid = qwen.image_processor(images=[big], return_tensors="pt")["image_grid_thw"][0]
    tokens = int(grid.prod()) // 4  # one token per 2x2 merge of 14-pixel patches: per 28x28
    assert 200 <= tokens <= 256
    idefics = SimpleNamespace(image_processor=Idefics3ImageProcessorPil())
    assert "longest edge of 728 pixels" in apply_pixel_budget(idefics, 800 * 800, None)
    _, _, gemma = _processor(REPO / "configs" / "tiny_vlm", "data.image_max_pixels=1000")
    assert apply_pixel_budget(gemma, 1000, None) == ("every image is resized to 56x56 (data.image_max_pixels/"
                                                      "image_min_pixels have no effect on this processor)")


def test_the_collator_batches_pixels_and_token_types(tmp_path, families):
    from sft_play.data import collate

    rows = vlm_models.colour_rows(tmp_path, 2) + [{"messages": [{"role": "user", "content": "Hello?"},
                                                                {"role": "assistant", "content": "hi"}]}]
    bundle, processor = _encoded(tmp_path, families["gemma3"], rows)
    examples = [bundle.train[i] for i in range(3)]
    assert examples[2]["images"] is None
    batch = collate.make_collator(processor.tokenizer.pad_token_id, "padded", processor=processor, length=64)(examples)
    assert batch["input_ids"].shape == batch["token_type_ids"].shape == (3, 64)  # (length: gloo's equal shapes)
    assert batch["pixel_values"].shape == (2, 3, 56, 56)  # the text-only row contributes none
    assert int(batch["token_type_ids"].sum()) == 8 == int((batch["input_ids"] == processor.tokenizer.image_token_id).sum())


def test_an_image_changed_after_preparation_is_prepared_again_and_one_gone_is_named(tmp_path, families, caplog):
    from sft_play import model as model_module
    from sft_play.data import collate

    rows = vlm_models.colour_rows(tmp_path, 2)
    rows[1]["images"] = rows[0]["images"]
    config = _config(families["gemma3"], vlm_models.write_jsonl(tmp_path / "rows.jsonl", rows))
    tokenizer = model_module.load_tokenizer(config)
    processor = model_module.load_processor(config, tokenizer)
    first = build(config.data, tokenizer, processor=processor)
    picture = tmp_path / rows[0]["images"][0]
    vlm_models.colour_image(picture, "blue", size=(112, 56))  # the same path, another picture
    with caplog.at_level("WARNING"):
        again = build(config.data, tokenizer, processor=processor)
    assert "2 image(s) changed since the data was prepared" in caplog.text
    assert json.loads(again.train[0]["images"])[0]["size"] == picture.stat().st_size != json.loads(
        first.train[0]["images"])[0]["size"]
    collator = collate.make_collator(tokenizer.pad_token_id, "padded", processor=processor)
    assert collator([again.train[0]])["pixel_values"].shape[0] == 1
    picture.unlink()
    with pytest.raises(UserError, match="changed or went since it was read, after its tokens were counted"):
        collator([again.train[0]])


@pytest.mark.parametrize("family", FAMILIES)
def test_each_familys_model_takes_the_collated_batch_and_learns_from_its_labels(tmp_path, families, family):
    """A batch of two pictured rows and a text-only one, as the collator makes it, goes through the
    family's model forward and backward: the image features meet as many image tokens, and the
    loss reaches the answers. Idefics3 (SmolVLM's architecture) splits each picture into crops."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from sft_play.data import collate

    rows = vlm_models.colour_rows(tmp_path, 2) + [{"messages": [{"role": "user", "content": "Hello?"},
                                                                {"role": "assistant", "content": "hi"}]}]
    bundle, processor = _encoded(tmp_path, families[family], rows)
    batch = collate.make_collator(processor.tokenizer.pad_token_id, "padded", processor=processor)(
        [bundle.train[i] for i in range(3)])
    if family == "idefics3":  # (rows with images, crops of the most pictured row, 3, 56, 56), and which pixels are real
        assert batch["pixel_values"].shape[:2] == batch["pixel_attention_mask"].shape[:2] == (2, 5)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(families[family]))
    loss = model(**batch).loss
    loss.backward()
    assert torch.isfinite(loss) and model.lm_head.weight.grad.abs().sum() > 0


# The released checkpoints' parameters: all, the vision encoder's, the projector's
PUBLISHED = {"qwen2.5-vl-7b": (8_292_166_656, 631_975_680, 44_574_464), "gemma-3-4b": (4_300_079_472, 416_866_032, 2_950_272)}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_public_vlms_are_counted_exactly_and_planned_without_a_traceback(name):
    from sft_play.architecture import build_meta_model, load_model_config, vision_parts
    from sft_play.planner import QUICK, Target, make_plan, model_shape
    from sft_play.units import GIB

    path = FIXTURES / "model_configs" / name
    meta = build_meta_model(load_model_config(str(path)))
    towers, projectors = vision_parts(meta)
    total, vision, projector = PUBLISHED[name]
    assert sum(p.numel() for p in meta.parameters()) == total
    peaks, loading = {}, {}
    for method in ("qlora", "lora", "full"):
        # one micro-batch a GPU: the peaks compared, without the search for the largest that fits
        # (nor the shorter rows' lengths, which the peaks at the planned length do not need)
        config = load_config(None, [f"model.name_or_path={path}", f"finetune.method={method}",
                                    "data.max_seq_length=2048", "train.gradient_checkpointing=true",
                                    "train.global_batch_size=8", "train.micro_batch_size=1"], check_paths=False)
        shape = model_shape(config)
        assert shape.total_params == total and shape.vision_params == vision and shape.projector_params == projector
        assert shape.frozen_params == vision + projector
        if method == "full":
            assert shape.trainable_params == total - vision - projector
        for gpus in (1, 8):
            planned = load_config(None, [f"model.name_or_path={path}", f"finetune.method={method}",
                                         "data.max_seq_length=2048", "train.gradient_checkpointing=true",
                                         f"train.global_batch_size={2 * gpus}", "train.micro_batch_size=1",
                                         "distributed.strategy=" + ("deepspeed_zero3" if gpus > 1 else "ddp"),
                                         # (QLoRA sharded: its packed weights stored in the compute dtype)
                                         *(["quantization.quant_storage=bfloat16"] if gpus > 1 else [])],
                                  check_paths=False)
            plan = make_plan(planned, Target(gpus, 80 * GIB, f"{gpus} x H100"), options=QUICK)
            peaks[method, gpus] = plan.peak_bytes_per_gpu
            loading[method, gpus] = plan.breakdown.get("loading", 0)
    assert peaks["qlora", 1] < peaks["lora", 1] < peaks["full", 1], peaks
    assert peaks["lora", 8] < peaks["full", 8] < peaks["full", 1], peaks
    # under ZeRO-3, LoRA and full fine-tuning load partitioned (zero.Init); a quantised model loads
    # outside it, whole on each GPU, which is then QLoRA's peak
    assert loading["qlora", 8] > 0
    assert loading["lora", 8] == loading["full", 8] == 0 and loading["qlora", 1] == 0
    trained = load_config(None, [f"model.name_or_path={path}", "finetune.method=full", "finetune.train_vision_tower=true",
                                 "finetune.train_projector=true"], check_paths=False)
    assert model_shape(trained).trainable_params == total
    # the projector alone (Qwen-VL's merger lies inside its frozen encoder); under QLoRA it stays 16-bit
    projector_only = [f"model.name_or_path={path}", "finetune.train_projector=true"]
    assert model_shape(load_config(None, [*projector_only, "finetune.method=full"], check_paths=False)
                       ).trainable_params == total - vision
    quantized = {trains: model_shape(load_config(None, [f"model.name_or_path={path}", "finetune.method=qlora",
                                                        f"finetune.train_projector={trains}"], check_paths=False))
                 for trains in ("true", "false")}
    kept = quantized["false"].quantized_params - quantized["true"].quantized_params
    assert kept <= projector and (kept > 0) == (name == "qwen2.5-vl-7b")  # Gemma-3's projector is a bare weight


def test_lora_keeps_adapters_out_of_a_frozen_vision_encoder_and_trains_the_projector_whole(families):
    from peft import get_peft_model

    from sft_play.adapters import LoraSpec, peft_config
    from sft_play.architecture import adapter_parts, build_meta_model, load_model_config, vision_parts

    config = load_config(None, ["finetune.method=lora"], check_paths=False)
    for family, model in families.items():
        meta = build_meta_model(load_model_config(str(model)))
        towers, projectors = vision_parts(meta)
        for train_tower, train_projector in ((False, False), (True, True)):
            spec = LoraSpec.from_config(config.lora, vision=adapter_parts(towers, projectors, train_tower, train_projector))
            wrapped = get_peft_model(build_meta_model(load_model_config(str(model))), peft_config(spec, initialise=False))
            trained = [name for name, p in wrapped.named_parameters() if p.requires_grad]
            in_tower = [n for n in trained if any(f".{t}." in n for t in towers) and "lora_" in n]
            in_projector = [n for n in trained if any(f".{p}." in n for p in projectors)]
            assert bool(in_tower) == train_tower, (family, in_tower[:3])
            assert bool(in_projector) == train_projector and all("lora_" not in n for n in in_projector), family
            assert any(("language_model" in n or "text_model" in n) and "lora_A" in n for n in trained)


@pytest.fixture(scope="module")
def vision_runs(tmp_path_factory, families, colours):
    """A full fine-tune of the Gemma-3 shape (projector training, encoder frozen), LoRA and QLoRA
    runs of the LLaVA shape (its two-layer projector trained whole beside the adapters, 16-bit under
    QLoRA), and the Gemma-3 shape on two gloo processes under DDP and under ZeRO-3, on rows mostly
    without pictures (a process's micro-batch often has none while the other's has one), started
    together."""
    root = tmp_path_factory.mktemp("vision-runs")
    common = (f"data.path={colours / 'train.jsonl'}", f"data.validation_path={colours / 'validation.jsonl'}",
              "data.num_proc=1", "train.global_batch_size=8", "train.mixed_precision=no", "train.logging_steps=1",
              f"train.output_dir={root}", "train.save_steps=0")
    config = ("--config", "configs/run_tiny_vlm.yaml")
    # 8 rows with a picture among 56 without: most micro-batches of 4 have none, some have one
    text = [{"messages": [{"role": "user", "content": f"Say {n}."}, {"role": "assistant", "content": str(n)}]}
            for n in range(56)]
    pictured = [json.loads(line) for line in (colours / "train.jsonl").read_text().splitlines()[:8]]
    mixed = vlm_models.write_jsonl(colours / "mixed.jsonl", random.Random(0).sample(text + pictured, 64))
    results = run_scripts_together(
        ("train_distributed.py", *config, *common, f"model.name_or_path={families['gemma3']}", "train.max_steps=16",
         "train.run_name=gemma3-full"),
        ("train_distributed.py", *config, *common, f"model.name_or_path={families['llava']}", "finetune.method=lora",
         "train.learning_rate=5e-3", "train.max_steps=16", "train.run_name=llava-lora"),
        ("train_distributed.py", *config, *common, f"model.name_or_path={families['llava']}", "finetune.method=qlora",
         "train.max_steps=2", "train.run_name=llava-qlora"),
        ("launch.py", "--launcher", "accelerate", "--accelerate-config", "configs/accelerate/ddp.yaml", "--cpu",
         "--num-gpus", "2", *config, *common, f"model.name_or_path={families['gemma3']}", "train.max_steps=3",
         f"data.path={mixed}", "train.run_name=gemma3-ddp"),
        ("launch.py", "--launcher", "torchrun", "--cpu", "--num-gpus", "2", *config, *common,
         f"model.name_or_path={families['gemma3']}", "distributed.strategy=deepspeed_zero3", "train.max_steps=4",
         f"data.path={mixed}", "train.run_name=gemma3-zero3"),
        timeout=900)
    for result in results:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return {name: root / name for name in ("gemma3-full", "llava-lora", "llava-qlora", "gemma3-ddp", "gemma3-zero3")}


@pytest.mark.slow
def test_full_fine_tuning_lowers_the_loss_and_leaves_the_frozen_encoder_bit_identical(vision_runs, families):
    from safetensors.torch import load_file

    from sft_play.model import init_weights_dir

    run = vision_runs["gemma3-full"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["last_loss"] < 0.5 * summary["first_loss"], summary["losses"]
    assert summary["data"]["images"] == 64
    trained = load_file(run / "model" / "model.safetensors")
    initial = load_file(init_weights_dir(str(families["gemma3"]), 0) / "model.safetensors")
    tower = [name for name in initial if "vision_tower" in name]
    assert tower and all(torch.equal(trained[name], initial[name]) for name in tower)
    projector = [name for name in initial if "multi_modal_projector" in name]
    assert any(not torch.equal(trained[name], initial[name]) for name in projector)  # train_projector: true
    assert any(not torch.equal(trained[name], initial[name]) for name in initial if "language_model" in name)
    for name in ("processor_config.json", "chat_template.jinja", "tokenizer.json"):
        assert (run / "model" / name).is_file(), name


@pytest.mark.slow
def test_qlora_trains_a_projector_whole_beside_4_bit_linears(vision_runs):
    summary = json.loads((vision_runs["llava-qlora"] / "summary.json").read_text())
    assert summary["global_step"] == 2 and all(loss == loss for loss in summary["losses"])
    adapter = json.loads((vision_runs["llava-qlora"] / "model" / "adapter_config.json").read_text())
    assert adapter["modules_to_save"] == ["multi_modal_projector"]


@pytest.mark.slow
def test_two_gloo_ranks_train_a_vision_language_model_on_rows_with_and_without_pictures(vision_runs):
    summary = json.loads((vision_runs["gemma3-ddp"] / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_step"] == 3
    assert summary["batch"] == "global 8 = micro 4 x accum 1 x world 2"
    assert len(set(summary["weights_fingerprints"])) == 1
    # ZeRO-3: a micro-batch without a picture gets a stand-in (without it, the ranks' gathers of the
    # encoder's weights part ways and the run aborts)
    zero3 = json.loads((vision_runs["gemma3-zero3"] / "summary.json").read_text())
    assert zero3["world_size"] == 2 and zero3["global_step"] == 4


@pytest.mark.slow
def test_lora_generates_from_an_image_and_merges_into_the_same_answers(vision_runs, colours):
    run = vision_runs["llava-lora"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["last_loss"] < 0.7 * summary["first_loss"], summary["losses"]
    picture = str(sorted((colours / "images").iterdir())[0])
    merged_dir = run / "merged"
    prompt = ("--prompt", "What colour is this picture?", "--image", picture, "--no-base")
    merge, = run_scripts_together(("merge.py", "--run", str(run)))
    assert merge.returncode == 0, merge.stderr[-3000:]
    adapter, merged, held_out = run_scripts_together(
        ("generate.py", "--run", str(run), *prompt), ("generate.py", "--run", str(merged_dir), *prompt),
        ("generate.py", "--run", str(run), "--count", "4"))
    for result in (adapter, merged, held_out):
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert printed_answers(adapter.stdout) == printed_answers(merged.stdout)
    for folder in (run / "model", merged_dir):  # the model cards load it as what it is, with its processor
        card = (folder / "README.md").read_text()
        assert "AutoModelForImageTextToText.from_pretrained(" in card and "AutoProcessor.from_pretrained(" in card
    assert "[1 image(s)] What colour is this picture?" in adapter.stdout
    assert held_out.stdout.count("[1 image(s)]") == 4 and len(printed_answers(held_out.stdout)) == 4
    missing, = run_scripts_together(("generate.py", "--run", str(run), "--prompt", "Colour?", "--image", "nope.png"))
    assert missing.returncode != 0 and "IMAGE=nope.png: no such image file" in missing.stderr
    assert "Traceback" not in missing.stderr


@pytest.mark.slow
def test_chat_shows_a_picture_with_the_next_line(vision_runs, colours):
    import subprocess
    import sys

    picture = sorted((colours / "images").iterdir())[0]
    lines = f"/image {picture}\nWhat colour is this picture?\n/image missing.png\nAnd now?\n"
    done = subprocess.run([sys.executable, "scripts/chat.py", "--run", str(vision_runs["gemma3-full"])], cwd=REPO,
                          input=lines, capture_output=True, text=True, timeout=300, env={**os.environ, **FORKED})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("(the picture goes with your next line)") == 1
    assert "(/image missing.png: no such image file" in done.stdout
    assert done.stdout.count("model> ") == 2 and "Traceback" not in done.stderr


def test_a_plan_without_data_says_what_an_image_costs_from_the_config(families):
    from sft_play.architecture import image_tokens, load_model_config
    from sft_play.planner import WITHOUT_REMEDIES, Target, make_plan
    from sft_play.units import GIB

    qwen = load_model_config(str(FIXTURES / "model_configs" / "qwen2.5-vl-7b"))
    assert image_tokens(qwen, 1280 * 28 * 28)[0] == 1280 and image_tokens(qwen) is None  # by area: the budget's
    assert image_tokens(load_model_config(str(FIXTURES / "model_configs" / "gemma-3-4b")))[0] == 256
    assert image_tokens(load_model_config(str(families["llava"])))[0] == 4  # 28x28 in 14-pixel patches
    assert image_tokens(load_model_config(str(families["idefics3"]))) is None  # crops: the processor's to say
    config = load_config(None, [f"model.name_or_path={FIXTURES / 'model_configs' / 'qwen2.5-vl-7b'}",
                                "data.image_max_pixels=200704", "data.max_seq_length=1024", "train.micro_batch_size=1",
                                "train.global_batch_size=1"], check_paths=False)
    plan = make_plan(config, Target(1, 80 * GIB, "1 x H100"), options=WITHOUT_REMEDIES)
    assert any("an image costs up to 256 tokens besides its marks (one per 28x28 pixels" in note for note in plan.notes), plan.notes


def test_qlora_keeps_a_training_projector_16_bit(families):
    from sft_play.model import quantization_config
    from sft_play.precision import Precision

    llava = families["llava"]
    qlora = load_config(None, [f"model.name_or_path={llava}", "finetune.method=qlora", "finetune.train_projector=true"],
                        check_paths=False)
    skipped = quantization_config(qlora, Precision("bf16", "float32")).llm_int8_skip_modules
    assert "model.multi_modal_projector" in skipped and "lm_head" in skipped  # transformers' own skips kept
    frozen = load_config(None, [f"model.name_or_path={llava}", "finetune.method=qlora"], check_paths=False)
    assert quantization_config(frozen, Precision("bf16", "float32")).llm_int8_skip_modules is None


@pytest.mark.parametrize("family", FAMILIES)
def test_under_zero3_a_batch_without_an_image_gets_a_stand_in_that_changes_no_token(tmp_path, families, family):
    """ZeRO-3 gathers the encoder's sharded weights on every process alike: text-only rows among
    pictured ones are trained, a batch of them with a white picture in its first row's padding."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from sft_play.data import DataStats
    from sft_play.data.collate import make_collator
    from sft_play.run import resolve

    zero3 = load_config(None, [f"model.name_or_path={families[family]}", "distributed.strategy=deepspeed_zero3"],
                        check_paths=False)
    mixed = resolve(zero3, on_cuda=True, bf16_supported=True, world_size=2,
                    data_stats=DataStats(examples=10, images=8, pictured=8))
    assert mixed.images and mixed.parallel.strategy.zero3
    rows = vlm_models.colour_rows(tmp_path, 2)
    text_only = [{"messages": [{"role": "user", "content": "Name a colour."},
                               {"role": "assistant", "content": "Red."}]}] * 2
    bundle, processor = _encoded(tmp_path, families[family], [*rows, *text_only])
    examples = [bundle.train[i] for i in range(len(bundle.train))]
    texts = [e for e in examples if not json.loads(e.get("images") or "[]")]
    assert len(texts) == 2
    plain = make_collator(processor.tokenizer.pad_token_id, "padded", processor=processor)(texts)
    stood = make_collator(processor.tokenizer.pad_token_id, "padded", processor=processor, stand_in=True)(texts)
    assert "pixel_values" not in plain and stood["pixel_values"].shape[0] >= 1
    width = plain["input_ids"].shape[1]
    assert torch.equal(stood["input_ids"][:, :width], plain["input_ids"])
    assert (stood["labels"][:, width:] == IGNORE_INDEX).all() and (stood["attention_mask"][:, width:] == 0).all()
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(families[family])).eval()
    with torch.no_grad():
        alone, beside = model(**plain), model(**stood)
    # the picture's features sit at its own tokens, which no real token attends to
    assert torch.allclose(alone.logits, beside.logits[:, :width], atol=1e-5) and torch.isclose(alone.loss, beside.loss)
    pictured = make_collator(processor.tokenizer.pad_token_id, "padded", processor=processor, stand_in=True)(
        [e for e in examples if e not in texts])
    assert pictured["pixel_values"].shape[0] == 2  # a batch with images gets none


def test_an_image_that_passes_the_check_but_cannot_be_decoded_is_named_or_skipped(tmp_path, families):
    from PIL import Image

    whole = tmp_path / "whole.jpg"
    Image.new("RGB", (56, 56), (200, 30, 30)).save(whole, quality=95)
    (tmp_path / "cut.jpg").write_bytes(whole.read_bytes()[:-10])  # its end cut: PIL's verify passes, decoding fails
    rows = [{"images": [name], "messages": [{"role": "user", "content": "<image>Colour?"},
                                            {"role": "assistant", "content": "red"}]} for name in ("whole.jpg", "cut.jpg")]
    with pytest.raises(UserError, match=r"rows.jsonl:2 with its images"):
        _encoded(tmp_path, families["gemma3"], rows)
    bundle, _ = _encoded(tmp_path, families["gemma3"], rows, "data.on_invalid=skip")
    reason = "images: an image the processor could not decode (a file cut short?)"
    assert bundle.stats.examples == 1 and bundle.stats.skipped == {reason: 1}
    assert bundle.stats.skipped_rows[reason] == [f"{tmp_path / 'rows.jsonl'}:2"]


def test_an_image_placeholder_with_an_empty_images_list_is_a_bad_row_and_a_plan_too_short_for_an_image_warns(tmp_path):
    from sft_play.planner import WITHOUT_REMEDIES, Target, make_plan
    from sft_play.units import GIB

    rows = [{"conversations": [{"from": "human", "value": "<image>Colour?"}, {"from": "gpt", "value": "red"}],
             "images": []}]
    path = vlm_models.write_jsonl(tmp_path / "train.jsonl", rows)
    with pytest.raises(InvalidRow, match=r"row 1, field 'images': 0 image\(s\) for 1 place\(s\) marked"):
        load_records(str(path), _config(tmp_path, tmp_path).data, DataStats())
    config = load_config(None, [f"model.name_or_path={FIXTURES / 'model_configs' / 'gemma-3-4b'}",
                                "data.max_seq_length=128", "train.micro_batch_size=1", "train.global_batch_size=1"],
                         check_paths=False)
    plan = make_plan(config, Target(1, 80 * GIB, "1 x H100"), options=WITHOUT_REMEDIES)
    assert any("data.max_seq_length=128 cannot hold one image (256 tokens)" in w for w in plan.warnings), plan.warnings


def test_make_check_says_what_preparing_image_data_would_refuse():
    from sft_play.checks import check_data

    data = REPO / "data" / "tiny_vlm" / "train.jsonl"

    def images_check(*overrides: str):
        config = load_config(None, [f"model.name_or_path={REPO / 'configs' / 'tiny_vlm'}", f"data.path={data}",
                                    "data.packing=false", *overrides], check_paths=False)
        found = {check.name: check for check in check_data(config)}
        assert "480 with images" in found["data.path"].detail
        return found["images"]

    assert images_check().ok
    for overrides, said in ((["data.packing=true"], "data.packing=false"),
                            ([f"model.name_or_path={REPO / 'configs' / 'tiny_model'}"], "is a text model"),
                            (["data.max_seq_length=4"], "cannot hold one")):
        found = images_check(*overrides)
        assert not found.ok and said in found.detail, (overrides, found.detail)


def test_the_encoder_is_traced_on_the_tokens_an_image_is_charged_and_a_budget_that_does_nothing_is_said():
    """Qwen2.5-VL at data.image_max_pixels=401408 was charged 512 image tokens and its encoder traced
    on 506 (a 22 x 23 grid); Gemma-3 planned the same peak under any budget, without a word."""
    from sft_play.architecture import image_inputs, image_tokens, load_model_config
    from sft_play.planner import WITHOUT_REMEDIES, Target, make_plan
    from sft_play.units import GIB

    qwen = load_model_config(str(FIXTURES / "model_configs" / "qwen2.5-vl-7b"))
    merge = qwen.vision_config.spatial_merge_size
    for pixels in (401408, 1003520, 200704, 12845056):
        [[frames, height, width]] = image_inputs(qwen, pixels)["image_grid_thw"]["values"]
        assert frames * height * width // merge**2 == image_tokens(qwen, pixels)[0], pixels
    gemma = str(FIXTURES / "model_configs" / "gemma-3-4b")
    config = load_config(None, [f"model.name_or_path={gemma}", "finetune.method=lora", "data.max_seq_length=2048",
                                "train.gradient_checkpointing=true", "train.global_batch_size=8",
                                "train.micro_batch_size=1", "data.image_max_pixels=401408"], check_paths=False)
    notes = make_plan(config, Target(1, 80 * GIB, "1 x H100"), options=WITHOUT_REMEDIES).notes
    assert any(note.startswith(f"data.image_max_pixels/image_min_pixels change nothing for {gemma}: every image "
                               "costs 256 tokens whatever its size") for note in notes), notes
