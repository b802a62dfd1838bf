"""Issue 46's questions, planned as ``make plan`` plans them (bench/planner_questions.py asks the
same and writes the report): the recipes people use are offered because the planner's own
prediction says they fit, ranked as a careful engineer would pick them, with host memory and
communication counted as the hand counts below count them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from planner_questions import QUESTIONS, plan  # noqa: E402

from sft_play.planner.choose.remedies import SAME  # noqa: E402
from sft_play.planner.present.report import run_command  # noqa: E402
from sft_play.units import GIB  # noqa: E402

# Llama-3-70B: its linears quantised (all but the two 1,050,673,152-parameter embedding and head
# matrices and the 1,318,912 norm weights), the rest in bf16; LoRA r16 on every linear: 207,093,760
LLAMA_70B_QUANTIZED = 70_553_706_496 - 2 * 1_050_673_152 - 1_318_912
LLAMA_70B_REST = 2 * 1_050_673_152 + 1_318_912
LLAMA_70B_ADAPTERS = 207_093_760


@pytest.fixture(scope="module")
def plans():
    return {question.name: plan(question) for question in QUESTIONS}


def _fitting(made) -> list[dict]:
    return [r for r in made.remedies if r["fits"]]


def test_70b_qlora_on_two_24_gib_gpus_does_not_fit_as_the_packed_model_loads_whole_on_each(plans):
    """It was offered ZeRO-3 with parameter offload (19.7 GiB a GPU). But a quantised model loads
    outside zero.Init (transformers: ``is_deepspeed_zero3_enabled() and not is_quantized``), placed
    whole on each GPU by bitsandbytes, and FSDP2 loads every model whole on each GPU: 37 GiB of
    packed weights before any sharding, which no 24 GiB GPU holds. The plan says which GPU would."""
    made = plans["70b-qlora-2x24"]
    assert not made.fits and not _fitting(made)
    assert made.smallest_hardware == "1 x 48 GiB GPU(s) with gradient checkpointing"
    sharded = {r["name"]: r for r in made.remedies if r["name"] in ("ZeRO-3", "FSDP2", "parameter offload")}
    assert len(sharded) == 3
    packed = LLAMA_70B_QUANTIZED // 2
    assert all(r["peak_bytes"] > packed for r in sharded.values())


def test_mixtral_qlora_on_eight_80_gib_gpus_cannot_hold_its_bf16_experts_whole_while_loading(plans):
    """Its fused experts stay bf16 beside the packed linears (86 GiB whole). ZeRO-3 and FSDP2 would
    shard them for the step, but each GPU loads the whole quantised model first (outside zero.Init;
    FSDP2 always), so neither fits 80 GiB GPUs, nor do more of them: one 141 GiB GPU would."""
    made = plans["mixtral-qlora-8x80"]
    assert not made.fits and not _fitting(made)
    assert made.smallest_hardware == "1 x 141 GiB GPU(s)"
    for name in ("ZeRO-3", "FSDP2"):
        remedy = next(r for r in made.remedies if r["name"] == name)
        assert "quantization.quant_storage=bfloat16" in remedy["change"]
        assert not remedy["fits"] and remedy["peak_bytes"] > 80 * GIB


def test_8b_qlora_at_98k_tokens_is_offered_a_mask_free_kernel_before_shorter_rows(plans):
    made = plans["8b-qlora-98k"]
    assert not made.fits and made.attention_mask
    names = [r["name"] for r in _fitting(made)]
    assert names[0] in ("flex attention", "FlashAttention-2") and "flex attention" in names
    assert names.index("flex attention") < names.index("shorter sequences")


def test_offloaded_70b_qlora_needs_its_4_bit_weights_in_host_memory(plans):
    made = plans["70b-qlora-offload-host"]
    # the packed base at half a byte, the rest in bf16 and the bf16 adapters with their gradients
    # and Adam's two states (2 bytes each); both processes on the node. It said 134.1 GiB: about bf16's
    hand = LLAMA_70B_QUANTIZED // 2 + 2 * LLAMA_70B_REST + 8 * LLAMA_70B_ADAPTERS
    assert made.host_bytes_per_node == hand
    assert f"host memory per node: {hand / GIB:.1f} GiB offloaded while training (parameters " in " ".join(made.notes)


def test_fsdp2_and_zero3_gather_the_same_packed_weights(plans):
    """They were 1243 GB against 4522 GB a step: ZeRO-3 counted QLoRA's packed weights at 16 bits."""
    gathers = {}
    for name in ("70b-qlora-fsdp2-traffic", "70b-qlora-zero3-traffic"):
        made = plans[name]
        assert made.fits and made.gradient_accumulation_steps == 1
        said = next(s for s in made.time["sources"] if s.startswith("communication:"))
        gathers[name] = said.split("parameter all-gathers ")[1].split(",")[0]
    # forward and backward, 7/8 of the packed base and the bf16 rest, one micro-batch
    hand = 2 * 7 / 8 * (LLAMA_70B_QUANTIZED / 2 + 2 * LLAMA_70B_REST)
    assert set(gathers.values()) == {f"{hand / 1e9:.2f}"}


def test_a_plan_that_fits_says_how_to_run_it_and_why_this_micro_batch(plans):
    made = plans["fits-micro"]
    assert made.fits and (made.micro_batch_size, made.gradient_accumulation_steps) == (2, 4)
    assert ("micro-batch 2, not 3 (the largest that fits): 3 does not divide the 8 rows each process takes of the "
            "global batch, 2 does (accumulation 4, the global batch unchanged)") in made.notes
    assert run_command(made, "c.yaml", ["finetune.method=qlora", "--no-data"]) == \
        'make train-distributed CONFIG=c.yaml NUM_GPUS=2 ARGS="finetune.method=qlora"'


def test_qwen_7b_full_on_eight_80_gib_gpus_is_offered_zero2_before_rounding_bf16_weights(plans):
    made = plans["qwen-7b-full-8x80"]
    fitting = _fitting(made)
    assert fitting[0]["name"] == "ZeRO-2" and not fitting[0]["tight"]
    results = [r["result"] for r in fitting if not r["more_gpus"]]
    assert results == sorted(results)  # nothing that changes the training ahead of what does not
    assert not any("bf16 weights" in r["remedies"] for r in fitting if r["result"] == SAME)
