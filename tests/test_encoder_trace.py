"""The vision encoder's meta-device trace (sft_play.planner.simulate.encoder) against the encoder
itself: the tiny Gemma-3, LLaVA and Idefics3 of tests/vlm_models.py, run on the CPU on the
processor's own pixels with every allocation recorded, keep for backward exactly what the trace
says, frozen or training, one example or two; a frozen encoder keeps nothing and runs no
backward, with checkpointing on as training runs it; and plans of public configs trace theirs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sft_play.adapters import LoraSpec
from sft_play.architecture import frozen_parts, in_parts, keep_out_of_backward, vision_parts
from sft_play.data import vision
from sft_play.planner.simulate import encoder as tracing
from sft_play.planner.simulate.trace import TraceSpec, _Recorder
from tests import vlm_models
from tests.conftest import FIXTURES



@pytest.fixture(scope="module")
def tiny_qwen(tmp_path_factory) -> Path:
    """A Qwen2.5-VL-shaped model: a 2-block encoder (windowed, then full attention) of 14-pixel
    patches merged 2x2, the tiny text model; its processor needs torchvision, so its inputs are
    made here as the processor makes them (``image_grid_thw`` and flattened patches)."""
    from transformers import Qwen2_5_VLConfig

    folder = tmp_path_factory.mktemp("qwen")
    Qwen2_5_VLConfig(
        text_config={"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
                     "num_key_value_heads": 1, "vocab_size": 512,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}},
        vision_config={"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                       "window_size": 56, "fullatt_block_indexes": [1]},
        image_token_id=500, video_token_id=501, vision_start_token_id=502).save_pretrained(folder)
    return folder


def _qwen_inputs(images: int) -> tuple[dict, str]:
    """`images` pictures of 8x12 patches (4x6 tokens) as Qwen-VL's processor hands them over."""
    grid = torch.tensor([[1, 8, 12]] * images)
    batch = {"pixel_values": torch.randn(images * 96, 3 * 2 * 14 * 14), "image_grid_thw": grid}
    return batch, vision.encoder_inputs({key: value.numpy() for key, value in batch.items()})[1]


def _spec(model: Path, method: str = "full") -> TraceSpec:
    return TraceSpec(str(model), None, False, method, "float32", "float32", None, "eager", False, False,
                     None if method == "full" else LoraSpec(8, 16, 0.0, "all-linear"))


def _inputs(model: Path, pictures: int) -> tuple[dict, str]:
    """The processor's encoder inputs for one example of `pictures` images (as tensors) and their
    description (sft_play.data.vision.encoder_inputs)."""
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model)
    images = [Image.new("RGB", (90 + 20 * i, 70), ("red", "blue", "green")[i % 3]) for i in range(pictures)]
    out = processor(images=[images], return_tensors="pt")
    kept = {key: value for key, value in out.items() if key not in vision.TEXT_KEYS}
    return kept, vision.encoder_inputs({key: value.numpy() for key, value in kept.items()})[1]


def _kept(events: list, output: int) -> int:
    """Bytes alive after the forward pass (less the features), from ("a"/"f", id, bytes) events."""
    alive: dict = {}
    for kind, key, size in events:
        if kind == "a":
            alive[key] = size
        else:
            alive.pop(key, None)
    alive.pop(output, None)
    return sum(alive.values())


def _measured(model_path: Path, batch: dict, train_tower: bool, train_projector: bool) -> int:
    """What the real encoder (fp32, eager attention, on the CPU) keeps for backward once it has
    encoded `batch`, recorded allocation by allocation."""
    model = _model(model_path, "eager")
    towers, projectors = vision_parts(model)
    frozen, inside = frozen_parts(towers, projectors, train_tower, train_projector)
    for name, param in model.named_parameters():
        param.requires_grad_(not in_parts(name, frozen) or in_parts(name, inside))
    model.train()
    ignore = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers(), *batch.values()]}
    recorder = _Recorder(ignore)
    with recorder:
        features = tracing._features(model.get_image_features(**batch))
    return _kept(recorder.cut(), features[0].untyped_storage()._cdata)


def _model(path: Path, attention: str = "sdpa"):
    """The tiny model of `path`'s config, built with random weights (the builders write none)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(path), attn_implementation=attention)


def _traced(events, micro: int) -> int:
    alive: dict = {}
    for event in events.forward:
        if event[0] == "a":
            alive[event[1]] = events.size(event, micro)
        else:
            alive.pop(event[1], None)
    alive.pop(events.output, None)
    return sum(alive.values())


def _after_the_step(events, micro: int) -> dict:
    """What the encoder's events leave alive at `micro` once the step's backward is over (the
    features' gradient given to it, as the replay gives it): id -> bytes."""
    from sft_play.planner.simulate.trace import GRAD_IN

    alive: dict = {}
    for phase in (events.forward, events.after_forward, events.cache_release):
        for event in phase:
            if event[0] == "a":
                alive[event[1]] = events.size(event, micro)
            else:
                alive.pop(event[1], None)
    if events.backward:
        alive[GRAD_IN] = 1
    for event in events.backward:
        if event[0] == "a":
            alive[event[1]] = events.size(event, micro)
        else:
            alive.pop(event[1], None)
    return alive


@pytest.mark.parametrize("family", [*sorted(vlm_models.BUILDERS), "qwen2.5-vl"])
def test_the_trace_keeps_what_the_real_encoder_keeps(families, tiny_qwen, family):
    model = tiny_qwen if family == "qwen2.5-vl" else families[family]
    for pictures in (1, 2):
        batch, described = _qwen_inputs(pictures) if family == "qwen2.5-vl" else _inputs(model, pictures)
        for train_tower, train_projector in ((True, True), (False, True), (False, False)):
            trace = tracing._traced(_spec(model), json.loads(described), train_tower, train_projector)
            measured = _measured(model, batch, train_tower, train_projector)
            assert _traced(trace.at(1), 1) == measured, (pictures, train_tower, train_projector)
            assert trace.trains == (train_tower or train_projector)
            if not trace.trains:
                assert measured == 0  # a frozen encoder keeps nothing for backward
        # the collated pixels on the GPU: what the processor handed over
        assert trace.input_bytes == sum(t.numel() * t.element_size() for t in batch.values())


@pytest.mark.parametrize("family", [*sorted(vlm_models.BUILDERS), "qwen2.5-vl"])
def test_more_examples_keep_more_and_the_gradients_stay_those_of_the_weights(families, tiny_qwen, family):
    model = tiny_qwen if family == "qwen2.5-vl" else families[family]
    one_batch, described = _qwen_inputs(1) if family == "qwen2.5-vl" else _inputs(model, 1)
    trace = tracing._traced(_spec(model), json.loads(described), True, True)
    kept = [_traced(trace.at(micro), micro) for micro in (1, 2, 3)]
    for micro in (2, 3):  # traced, and measured on the encoder given that many examples alike
        batch = {key: torch.cat([value] * micro) for key, value in one_batch.items()}
        assert kept[micro - 1] == _measured(model, batch, True, True), micro
    assert kept[0] < kept[1] < kept[2] <= 3 * kept[0] + 4096
    real = _model(model, "eager")
    for feature in tracing._features(real.get_image_features(**one_batch)):
        feature.sum().backward(retain_graph=True)
    weights = sum(4 * p.numel() for p in real.parameters() if p.grad is not None)  # (LLaVA's last norm takes none)
    for micro in (1, 2, 8):  # after backward: the gradients the real backward makes, once each, nothing else
        events = trace.at(micro)
        left = _after_the_step(events, micro)
        assert set(left) == set(events.persistent), micro
        assert sum(left.values()) == weights, micro


def test_a_frozen_encoder_runs_no_backward_with_checkpointing_on(families):
    """transformers' enable_input_require_grads, which checkpointing runs, would make a frozen
    encoder's patch embedding require grad: architecture.keep_out_of_backward keeps it out."""
    model_path = families["gemma3"]
    batch, described = _inputs(model_path, 1)
    model = _model(model_path)
    model.requires_grad_(False)
    model.model.language_model.requires_grad_(True)
    model.gradient_checkpointing_enable({"use_reentrant": False})
    model.train()
    assert model.get_image_features(**batch).pooler_output.requires_grad  # transformers' own behaviour
    model = _model(model_path)
    model.requires_grad_(False)
    model.model.language_model.requires_grad_(True)
    keep_out_of_backward(model, vision_parts(model)[0])
    model.gradient_checkpointing_enable({"use_reentrant": False})
    model.train()
    assert not model.get_image_features(**batch).pooler_output.requires_grad
    assert model.get_input_embeddings()(torch.tensor([[1, 2]])).requires_grad  # the text still takes gradients
    towers, projectors = vision_parts(model)
    lora = LoraSpec(8, 16, 0.0, "all-linear", kept_out=towers + projectors)
    for method in ("full", "lora"):
        spec = TraceSpec(str(model_path), None, False, method, "float32", "float32", None, "sdpa", False, True, lora)
        frozen = tracing._traced(spec, json.loads(described), False, False)
        assert not frozen.trains and _traced(frozen.at(1), 1) == 0


def _planned(name: str, *overrides: str, data_stats=None):
    """(the peak at micro-batch 1 on one GPU, the plan's vision notes and warnings) for a public
    config: one replay, without the fit search."""
    from sft_play.config import load as load_config
    from sft_play.planner import model_shape
    from sft_play.planner.present.notes import vision_notes
    from sft_play.planner.simulate.predict import predict
    from sft_play.run import resolve

    config = load_config(None, [f"model.name_or_path={FIXTURES / 'model_configs' / name}", "finetune.method=lora",
                                "data.max_seq_length=2048", "data.packing=false", "train.gradient_checkpointing=true",
                                *overrides], check_paths=False)
    run = resolve(config, on_cuda=True, bf16_supported=True, world_size=1, data_stats=data_stats)
    shape = model_shape(config)
    prediction = predict(shape, run, 1)
    return (prediction.peak_bytes, *vision_notes(config, run, shape, data_stats, prediction))


def test_plans_of_public_configs_trace_their_encoders():
    _, _, warnings = _planned("qwen2.5-vl-7b")  # Qwen-VL sizes images by pixels: without a budget, no image
    assert any("vision encoder's activations are not in this plan" in w for w in warnings)
    peaks = {}
    for pixels in (200_704, 1_003_520):
        peaks[pixels], notes, warnings = _planned("qwen2.5-vl-7b", f"data.image_max_pixels={pixels}")
        assert any("vision encoder is traced on one image sized from the config" in n for n in notes)
        assert not any("not in this plan" in w for w in warnings), warnings
    assert peaks[200_704] < peaks[1_003_520]
    _, notes, _ = _planned("gemma-3-4b")  # a fixed 896x896 image
    assert any("pixel_values 1x3x896x896" in n and "keeps nothing for backward" in n for n in notes)


def test_smaller_images_are_a_remedy_planned_from_the_same_data():
    """Data prepared at the processor's own budget, its heaviest example one 3,136-token image:
    halving the pixel budget is planned from the same statistics (image tokens and pixels bounded
    by the new budget), and the remedies of a vision-language model never split its rows."""
    from sft_play.config import load as load_config
    from sft_play.data import DataStats
    from sft_play.planner import Target, model_shape, peak_at
    from sft_play.planner.choose import remedies
    from sft_play.run import resolve
    from sft_play.units import GIB

    path = FIXTURES / "model_configs" / "qwen2.5-vl-7b"
    stats = DataStats(examples=100, tokens_total=330_000, tokens_max=3300, tokens_p50=3300, tokens_p95=3300,
                      loss_tokens=10_000, images=100, image_tokens=313_600, images_max=1, pictured=100,
                      text_tokens_max=164, image_max_pixels=0, encoder_inputs={
                          "image_grid_thw": {"values": [[1, 112, 112]]},
                          "pixel_values": {"shape": [112 * 112, 1176], "dtype": "float32"}})
    config = load_config(None, [f"model.name_or_path={path}", "finetune.method=lora", "data.max_seq_length=4096",
                                "data.packing=false", "train.global_batch_size=8", "train.micro_batch_size=1",
                                "train.gradient_checkpointing=true"], check_paths=False)
    target = Target(8, 80 * GIB, "8 x H100")
    smaller = next(r for r in remedies.REMEDIES if r.name == "smaller images")
    assert smaller.applies(config, target)
    assert smaller.change_text(config, target) == ["data.image_max_pixels=1003520"]
    halved = smaller.config_for(smaller.config_for(config))
    assert halved.data.image_max_pixels == 501_760
    changed = smaller.config_for(config)
    resolved = {c.data.image_max_pixels: resolve(c, on_cuda=True, bf16_supported=True, world_size=8, data_stats=stats)
                for c in (config, changed)}
    before, after = resolved[None], resolved[1_003_520]
    assert before.sequence.tokens == 3300
    assert after.sequence.tokens == 164 + 1280  # the text, and one image of at most 1,280 tokens
    assert "below the budget the data were prepared with" in after.sequence.source
    pixels = json.loads(after.encoder_inputs)["pixel_values"]["shape"][0]
    assert 0.9 * 1_003_520 // (14 * 14) <= pixels <= 1_003_520 // (14 * 14)  # patches of 14x14 pixels
    shape = model_shape(config)
    assert peak_at(shape, after, 1) < peak_at(shape, before, 1)
    for remedy in remedies.REMEDIES:
        if remedy.applies(config, target):
            assert remedy.name not in ("shorter sequences", "sequence parallelism")
            assert not any(o.startswith("distributed.sequence_parallel") for o in remedy.overrides_for(config))
            assert "sequence parallelism" not in remedy.description_for(config), remedy.name


def test_the_data_keeps_the_encoder_inputs_of_its_heaviest_example(tmp_path, families):
    from tests.test_vision import _encoded

    rows = vlm_models.colour_rows(tmp_path, 3)
    rows[1]["images"] = rows[1]["images"] * 2
    rows[1]["messages"][0]["content"].insert(0, {"type": "image"})
    bundle, processor = _encoded(tmp_path, families["idefics3"], rows, "data.image_max_pixels=12544")
    stats = bundle.stats
    pictures = [vision.images.load({"path": str(tmp_path / name)}) for name in rows[1]["images"]]
    own = processor(images=[pictures], return_tensors="np")
    assert stats.encoder_inputs["pixel_values"] == {"shape": list(own["pixel_values"].shape), "dtype": "float32"}
    assert stats.image_max_pixels == 0  # (Idefics3 sizes images by their longest edge, not by area)
    lengths = [len(row["input_ids"]) for row in bundle.train]
    assert 0 < stats.text_tokens_max < min(lengths)  # every example's image tokens left out


def test_sequence_parallel_auto_never_splits_rows_that_hold_images():
    """``distributed.sequence_parallel: auto`` chooses among the splits the run may take: with
    images in the data, none (a split would part an image's tokens, which the run refuses)."""
    from sft_play.config import load as load_config
    from sft_play.data import DataStats
    from sft_play.planner import model_shape
    from sft_play.planner.plan import split_sizes
    from sft_play.run import resolve

    config = load_config(None, [f"model.name_or_path={FIXTURES / 'model_configs' / 'qwen2.5-vl-7b'}",
                                "distributed.strategy=deepspeed_zero3", "distributed.sequence_parallel=auto"],
                         check_paths=False)
    shape = model_shape(config)
    text = resolve(config, on_cuda=True, bf16_supported=True, world_size=8, data_stats=DataStats(examples=10))
    pictured = resolve(config, on_cuda=True, bf16_supported=True, world_size=8,
                       data_stats=DataStats(examples=10, images=8, pictured=8))
    assert split_sizes(shape, text)[:2] == [1, 2] and split_sizes(shape, pictured) == [1]
