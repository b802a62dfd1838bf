"""What the plan says for micro-batch m and rows of s tokens holds for every smaller batch and every
shorter row: reported peaks never fall as the micro-batch or the sequence length grows, at every
length, and a batch fits only when every smaller and shorter one does. The simulated allocator's
cache swings a few per cent from one batch shape to the next (Llama-3.2-3B full with
checkpointing went 53.8, 55.4, 51.2 ... GiB over micro-batches 1-3; Qwen2.5-0.5B LoRA at micro-batch
1 12.010 GiB at 36,352 tokens, 11.822 at 36,864), so without the envelope
(sft_play.planner.choose.search) neither held."""

from __future__ import annotations

import random

import pytest

from sft_play import config as config_module
from sft_play.planner import WITHOUT_REMEDIES, Target, make_plan, model_shape, resolve_for
from sft_play.planner.simulate.predict import predict, static_lower_bound
from sft_play.planner.choose.search import power_above, shorter_lengths
from tests.conftest import FIXTURES

GIB = 1024**3
CASES = [
    ("llama-3.2-3b", "full", True, 2048, 8),
    ("qwen2.5-0.5b", "full", True, 2048, 8),
    ("qwen2.5-0.5b", "lora", False, 1024, 8),
    ("llama-3.1-8b", "qlora", True, 2048, 6),
    ("tiny-qwen3-moe", "lora", False, 256, 6),
    ("tiny-bamba", "full", True, 256, 6),
]


def _config(model: str, method: str, checkpointing: bool, seq: int, micro: int):
    return config_module.load(None, [
        f"model.name_or_path={FIXTURES / 'model_configs' / model}", f"finetune.method={method}",
        f"train.gradient_checkpointing={str(checkpointing).lower()}", f"data.max_seq_length={seq}",
        f"train.micro_batch_size={micro}", f"train.global_batch_size={micro}", "train.gradient_accumulation_steps=1",
    ], check_paths=False)


@pytest.mark.parametrize("model, method, checkpointing, seq, largest", CASES)
def test_reported_peaks_and_fit_decisions_are_monotone_in_the_micro_batch(model, method, checkpointing, seq, largest):
    plans = [make_plan(_config(model, method, checkpointing, seq, m), Target(1, 80 * GIB, "1 x H100"),
                       options=WITHOUT_REMEDIES) for m in range(1, largest + 1)]
    peaks = [p.peak_bytes_per_gpu for p in plans]
    assert peaks == sorted(peaks), [round(p / GIB, 2) for p in peaks]
    # and under a budget between the smallest and the largest peak, the fitting ones form a prefix
    budget = (peaks[0] + peaks[-1]) // 2
    fits = [p <= budget for p in peaks]
    assert fits == sorted(fits, reverse=True)
    for plan in plans:  # the terms add up to the peak reported
        assert sum(plan.breakdown.values()) == plan.peak_bytes_per_gpu


LENGTHS = [512, 1024, 2048, 4096]
# Where the peak fell as the rows grew before the envelope covered shorter rows (each of these
# fails without it); bench/planner_monotone.py checks every public config, method and
# checkpointing choice the same way and writes docs/reports/planner_monotone.md
SEQUENCE_CASES = [
    ("qwen2.5-0.5b", "full", True),
    ("llama-3.1-8b", "full", True),
    ("mistral-7b-v0.1", "full", True),
    ("gemma-2-9b", "full", True),
]


def test_the_ladder_is_the_same_for_every_plan():
    assert shorter_lengths(256) == [] and shorter_lengths(257) == [256]
    assert shorter_lengths(4096) == [256, 512, 1024, 2048] and shorter_lengths(3000) == [256, 512, 1024, 2048]
    # a length between powers of two is planned on the line between the two
    assert power_above(4096) is None and power_above(3000) == 4096 and power_above(4097) == 8192
    assert power_above(100) == 256 and power_above(36352) == 65536


# Random lengths of 1k-128k tokens (seeded), and where the peak fell as rows grew by 512 tokens
# (issue 61: at 8 of 117 lengths of Qwen2.5-0.5B LoRA from 1,024 to 59,392), for three models
RANDOM_LENGTHS = sorted(random.Random(61).sample(range(1024, 131073), 6))
FELL_AT = [31744, 34816, 36864, 41472, 45056, 49664, 54272, 58880]


@pytest.mark.parametrize("model, method, lengths", [
    ("qwen2.5-0.5b", "lora", sorted(RANDOM_LENGTHS[::2] + FELL_AT + [tokens - 512 for tokens in FELL_AT])),
    ("llama-3.1-8b", "lora", RANDOM_LENGTHS),
    ("gemma-2-9b", "qlora", RANDOM_LENGTHS),
])
def test_at_every_length_a_longer_row_never_reports_less_nor_fits_where_a_shorter_does_not(model, method, lengths):
    def plans(free: float):
        return [make_plan(_config(model, method, True, seq, 1), Target(1, int(free), "1 x GPU"),
                          options=WITHOUT_REMEDIES) for seq in lengths]

    roomy = plans(1000 * GIB)
    peaks = [p.peak_bytes_per_gpu for p in roomy]
    assert peaks == sorted(peaks), [(seq, round(p / GIB, 3)) for seq, p in zip(lengths, peaks)]
    for plan in roomy:
        assert sum(plan.breakdown.values()) == plan.peak_bytes_per_gpu
    # under a budget the middle length's peak sets, the lengths that fit come first
    free = (peaks[len(peaks) // 2] + 0.5 * GIB) / (1 - 0.03) + 1
    fits = [p.fits for p in plans(free)]
    assert fits == sorted(fits, reverse=True) and any(fits) and not all(fits), fits


@pytest.mark.parametrize("model, method, checkpointing", SEQUENCE_CASES)
def test_reported_peaks_and_fit_decisions_are_monotone_in_the_sequence_length(model, method, checkpointing):
    plans = [make_plan(_config(model, method, checkpointing, seq, 4), Target(1, 80 * GIB, "1 x H100"),
                       options=WITHOUT_REMEDIES) for seq in LENGTHS]
    peaks = [p.peak_bytes_per_gpu for p in plans]
    assert peaks == sorted(peaks), [round(p / GIB, 2) for p in peaks]
    for plan in plans:
        assert sum(plan.breakdown.values()) == plan.peak_bytes_per_gpu
    # under a budget that the longest rows exceed and the shortest fit, the fitting lengths form a prefix
    free = int((peaks[0] + peaks[-1]) // 2 / (1 - 0.03)) + 1
    fits = [make_plan(_config(model, method, checkpointing, seq, 4), Target(1, free, "1 x GPU"),
                      options=WITHOUT_REMEDIES).fits for seq in LENGTHS]
    assert fits == sorted(fits, reverse=True), fits



def test_the_chosen_micro_batch_has_no_smaller_one_that_does_not_fit():
    config = config_module.load(None, [
        f"model.name_or_path={FIXTURES / 'model_configs' / 'llama-3.2-3b'}", "finetune.method=full",
        "train.gradient_checkpointing=true", "data.max_seq_length=2048", "train.global_batch_size=8",
    ], check_paths=False)
    shape = model_shape(config)
    run = resolve_for(config, Target(1, 80 * GIB, "1 x H100"), None, shape)
    own = {m: predict(shape, run, m).peak_bytes for m in range(1, 9)}
    for budget in sorted(own.values()):  # every budget at which the prediction changes
        free = int(budget / (1 - config.planner.safety_fraction)) + 1
        plan = make_plan(config, Target(1, free, "1 x GPU"), options=WITHOUT_REMEDIES)
        if plan.fits:
            assert all(own[m] <= plan.budget_bytes_per_gpu for m in range(1, plan.micro_batch_size + 1))


def test_beyond_the_budget_the_reported_peak_is_the_whole_step_not_the_weights_alone():
    config = config_module.load(None, [
        f"model.name_or_path={FIXTURES / 'model_configs' / 'llama-3.1-8b'}", "finetune.method=full",
        "data.max_seq_length=2048", "train.global_batch_size=8",
    ], check_paths=False)
    target = Target(1, 80 * GIB, "1 x H100")
    plan = make_plan(config, target, options=WITHOUT_REMEDIES)
    shape = model_shape(config)
    floor = static_lower_bound(shape, resolve_for(config, target, None, shape))
    assert floor > plan.budget_bytes_per_gpu and not plan.fits
    assert plan.peak_bytes_per_gpu > floor  # activations, the head and the allocator on top
    assert plan.breakdown.get("activations (forward)", 0) or plan.breakdown.get("activations", 0)


def test_a_bf16_full_fine_tune_keeps_its_head_gradient_in_bf16():
    from sft_play.planner.simulate.step import StepSpec, _Replay, _head_backward, _head_forward
    from sft_play.planner.simulate.allocator import CachingAllocator

    def kept_head_gradient(dtype: str) -> int:
        config = config_module.load(None, [f"model.name_or_path={FIXTURES / 'model_configs' / 'qwen2.5-0.5b'}",
                                           "finetune.method=full", f"model.torch_dtype={dtype}",
                                           "data.max_seq_length=512"], check_paths=False)
        shape = model_shape(config)
        run = resolve_for(config, Target(1, 80 * GIB, "1 x H100"), None, shape)
        spec = StepSpec(run=run, micro_batch=1, seq_len=512, checkpointing=False, masked=False)
        replay = _Replay(CachingAllocator())
        last = replay.new(512 * shape.hidden_size * 2, "activations")
        head = _head_forward(replay, shape, spec, last, 2)
        grads: list = []
        _head_backward(replay, shape, spec, head, 2, grads, keep_grads=True)
        return replay.allocator._live[grads[0]].size
    vocab_by_hidden = 151936 * 896
    assert kept_head_gradient("bfloat16") >= 2 * vocab_by_hidden and kept_head_gradient("bfloat16") < 3 * vocab_by_hidden
    assert kept_head_gradient("float32") >= 4 * vocab_by_hidden


def test_between_powers_of_two_a_plan_is_the_line_between_their_envelopes_not_its_own_swing(monkeypatch):
    """The allocator's cache swinging tenfold at 3,072 tokens changes nothing a plan reports: 3,072
    lies on the line between 2,048 and 4,096 (a length a few tokens longer would not repeat the
    swing); the same swing at 2,048, a power of two, counts for every longer length."""
    from sft_play.planner.choose import search
    from sft_play.planner.simulate.predict import Prediction

    real = search.predict_many

    def swinging_at(tokens: int):
        def swinging(shape, requests):
            predictions = real(shape, requests)
            return [Prediction(p.micro_batch, p.allocated_bytes + 10 * (p.peak_bytes - p.allocated_bytes),
                               p.allocated_bytes, p.breakdown, False) if run.sequence.tokens == tokens else p
                    for (run, *_), p in zip(requests, predictions)]
        return swinging

    gpu = Target(1, 80 * GIB, "1 x H100")
    lengths = (2048, 2560, 3072, 3584, 4096)

    def reported() -> dict[int, int]:
        return {seq: make_plan(_config("llama-3.2-3b", "lora", True, seq, 1), gpu, options=WITHOUT_REMEDIES)
                .peak_bytes_per_gpu for seq in lengths}

    before = reported()
    assert list(before.values()) == sorted(before.values())
    # on the line: equal steps of 512 tokens, equal steps of the peak (to a byte's rounding)
    steps = [b - a for a, b in zip(before.values(), list(before.values())[1:])]
    assert max(steps) - min(steps) <= 1
    monkeypatch.setattr(search, "predict_many", swinging_at(3072))
    assert reported() == before
    monkeypatch.setattr(search, "predict_many", swinging_at(2048))
    after = reported()
    assert all(after[seq] > before[seq] for seq in lengths) and list(after.values()) == sorted(after.values())


def test_longests_fit_decisions_are_monotone_over_the_lengths_it_bisects():
    """The lengths make plan LONGEST=1 bisects above 2,048 (its gallop found 2,048 fitting), 2,560
    to 4,096 in quarters, planned as it plans them (one row): peaks never fall, and under any
    budget the lengths that fit come first."""
    lengths = [2560, 3072, 3584, 4096]

    def plans(free: int):
        return [make_plan(_config("qwen2.5-0.5b", "lora", False, seq, 1), Target(1, free, "1 x GPU"),
                          options=WITHOUT_REMEDIES) for seq in lengths]

    at_80 = plans(80 * GIB)
    peaks = [p.peak_bytes_per_gpu for p in at_80]
    assert peaks == sorted(peaks), [round(p / GIB, 3) for p in peaks]
    assert peaks[-1] > peaks[0]
    # the budget is the free memory less planner.safety_margin_gib and the safety fraction
    kept = 1 - (at_80[0].budget_bytes_per_gpu + 0.5 * GIB) / (80 * GIB)
    # (under a tighter budget the replays may release the allocator's cache and fit below the
    # unlimited peak: where the cut falls is the plans' own answer, a prefix at every budget)
    answers = set()
    for share in (-0.5, 0.0, 0.25, 0.5, 0.75, 1.0):
        free = int((peaks[0] + share * (peaks[-1] - peaks[0]) + 0.5 * GIB) / (1 - kept)) + 1
        fits = [p.fits for p in plans(free)]
        assert fits == sorted(fits, reverse=True), (share, fits)
        answers.add(sum(fits))
    assert len(answers) >= 2  # the sweep crosses the lengths' peaks


@pytest.mark.parametrize("model, method, gpus, strategy, split, seq", [
    ("llama-3.1-8b", "lora", 8, "deepspeed_zero3", 8, 8192),
    ("llama-3.1-8b", "qlora", 8, "deepspeed_zero2", 2, 4096),
    ("qwen2.5-0.5b", "full", 8, "ddp", 1, 2048),
    ("qwen2.5-0.5b", "full", 8, "fsdp2", 1, 1024),
    ("gemma-2-9b", "lora", 1, "ddp", 1, 4096),
    ("tiny-bamba", "full", 1, "ddp", 1, 256),
    ("tiny-qwen3-moe", "lora", 8, "deepspeed_zero3", 2, 512),
])
def test_the_layers_kept_inputs_bound_stays_under_the_replayed_peak(model, method, gpus, strategy, split, seq):
    """``sequence_parallel: auto`` passes over a size whose bound (weights, states and every layer's
    checkpointed input) exceeds the budget without a trace: the bound must never exceed what the
    replay of micro-batch 1 peaks at, or a size that fits would be passed over."""
    from sft_play.planner.simulate.predict import checkpointed_lower_bound

    config = config_module.load(None, [
        f"model.name_or_path={FIXTURES / 'model_configs' / model}", f"finetune.method={method}",
        f"distributed.strategy={strategy}", f"distributed.sequence_parallel={split}", f"data.max_seq_length={seq}",
        "train.gradient_checkpointing=true", "train.global_batch_size=8",
    ], check_paths=False)
    shape = model_shape(config)
    run = resolve_for(config, Target(gpus, 80 * GIB, f"{gpus} x H100", gpu_model="H100"), None, shape)
    bound = checkpointed_lower_bound(shape, run, 1)  # (under what is allocated: a replay fits on that)
    assert static_lower_bound(shape, run) < bound <= predict(shape, run, 1).allocated_bytes
    assert checkpointed_lower_bound(shape, run.with_changes(offload_activations=True), 1) == static_lower_bound(
        shape, run)
