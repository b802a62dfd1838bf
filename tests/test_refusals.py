"""Every combination a run refuses, and its words: one place lists them
(:func:`sft_play.config.consistency_problems`), asked of the values alone when a config loads, with
the processes and devices by the launcher and the training process, with the model too by the
planner (``make plan``, ``make check``, a run's own plan), and by the remedy search to leave out what
a run would refuse. Each refusal is one line saying what to do instead. (That the launcher and
the make targets print these lines without a traceback is tested with them: test_long_rows.py,
test_sequence_parallel.py, test_fsdp2.py.)"""

from __future__ import annotations

import pytest

from sft_play import config as config_module
from sft_play.architecture import ModelFacts
from sft_play.config import consistency_problems, sequence_split_problem
from sft_play.errors import UserError
from sft_play.planner import Target
from sft_play.planner.plan import resolve_for
from sft_play.run import resolve
from sft_play.units import GIB
from tests.conftest import LORA, REPO

TINY = str(REPO / "configs" / "run_tiny.yaml")
SPLIT = ("distributed.strategy=deepspeed_zero2", "distributed.sequence_parallel=2")
RING = ("distributed.strategy=fsdp2", "distributed.context_parallel=2", "data.packing=false")
DPO, KTO, ORPO, SIMPO = (f"finetune.objective={o}" for o in ("dpo", "kto", "orpo", "simpo"))


def _problems(base: str | None, overrides: tuple[str, ...]) -> list[str]:
    with pytest.raises(config_module.ConfigError) as caught:
        config_module.load(base, list(overrides), check_paths=False)
    return caught.value.problems


# (base config: None for the defaults, overrides, words that one problem holds)
VALUES = [
    # preference tuning: DPO
    (None, (DPO, "finetune.method=full", "preference.reference=adapters_off"), "no adapters to switch off"),
    (None, (DPO, "finetune.method=qlora", "preference.reference=copy"), "use adapters_off"),
    (None, (DPO, "preference.reference=precomputed", "data.streaming=true", "train.max_steps=5"),
     "a stream cannot be scored"),
    (None, (DPO, "data.train_on=all"), "scores the answers"),
    (None, (DPO, "data.format=alpaca"), "is an SFT format"),
    (None, (DPO, "preference.loss_type=sigmod"), "'sigmod'"),
    (None, (DPO, "preference.loss_type=exo_pair"), "label_smoothing above 0"),
    (None, (DPO, "preference.loss_type=robust", "preference.label_smoothing=0.6"), "below 0.5"),
    (None, (DPO, 'preference.loss_type=["sigmoid","sft"]', "preference.loss_weights=[1.0]"),
     "1 weight(s) for 2 loss type(s)"),
    (None, (DPO, "train.tiled_mlp=true"), "train.tiled_mlp: an SFT lever"),
    (None, (DPO, "distributed.strategy=deepspeed_zero2", "distributed.sequence_parallel=2"), "rows are not split"),
    (None, (DPO, 'preference.loss_type=["sigmoid","sft"]', "preference.sft_weight=0.5"), "give it once"),
    (None, (DPO, "finetune.method=full", "preference.reference=precomputed", "distributed.strategy=fsdp2"),
     "TRL then loads a reference of its own"),
    (None, (DPO, "data.special_tokens_in_text=escape"), "leave it at keep"),
    (None, (DPO, "preference.loss_type=kto"), "kto and apo_zero_unpaired are KTO's: set finetune.objective=kto"),
    (None, (DPO, "preference.desirable_weight=1.33"), "weighs KTO's labelled answers"),
    (None, (DPO, "data.format=unpaired"), "use finetune.objective=kto"),
    (None, (DPO, "preference.simpo_gamma=1"), "set finetune.objective=simpo"),
    # KTO
    (None, (KTO, "preference.loss_type=sigmoid"), "TRL's KTO losses are kto, apo_zero_unpaired"),
    (None, (KTO, 'preference.loss_type=["kto","kto"]'), "TRL's KTO losses are"),
    (None, (KTO, "preference.loss_weights=[1.0]"), "DPO's loss weights"),
    (None, (KTO, "preference.sft_weight=1"), "an sft term beside DPO's loss"),
    (None, (KTO, "train.micro_batch_size=1"), "it needs at least 2"),
    (None, (KTO, "finetune.method=full", "preference.reference=adapters_off"), "no adapters to switch off"),
    (None, (KTO, "data.format=alpaca"), "is an SFT format"),
    # ORPO and SimPO
    (None, (ORPO, "preference.reference=copy"), "preference.reference: copy; finetune.objective=orpo scores the policy"),
    (None, (SIMPO, "preference.reference=precomputed"), "finetune.objective=simpo scores the policy alone"),
    (None, (ORPO, "preference.loss_type=ipo"), "preference.loss_type: a reference loss"),
    (None, (SIMPO, "preference.desirable_weight=2"), "weighs KTO's labelled answers"),
    (None, (SIMPO, "preference.precompute_batch_size=4"), "preference.precompute_batch_size"),
    (None, (ORPO, "preference.sft_weight=1"), "the NLL is part of ORPO already"),
    (None, (ORPO, "preference.label_smoothing=0.1"), "TRL's ORPO has none"),
    (None, (ORPO, "preference.simpo_gamma=1"), "SimPO's margin"),
    (None, (SIMPO, "train.tiled_mlp=true"), "train.tiled_mlp: an SFT lever"),
    (None, (ORPO, "data.train_on=all"), "scores the answers"),
    # the long-row levers
    (None, ("finetune.method=lora", "train.offload_activations=true"), "set train.gradient_checkpointing=true too"),
    (None, ("finetune.method=lora", "train.tiled_mlp=true", "distributed.strategy=fsdp2"),
     "train.tiled_mlp: FSDP2 reduces a weight's gradient"),
    (None, ("finetune.method=lora", "train.tiled_mlp=true", "lora.dropout=0.1"), "set lora.dropout=0"),
    # FSDP2, offload
    (TINY, (*LORA, "distributed.strategy=fsdp2", "distributed.offload_optimizer=true"),
     "offloads parameters, gradients and optimizer states together; set distributed.offload_parameters=true"),
    (TINY, (*LORA, "distributed.strategy=ddp", "distributed.offload_optimizer=true"), "DDP keeps the optimizer on the GPU"),
    (TINY, (*LORA, "distributed.strategy=fsdp2"), "lora.modules_to_save: under FSDP2"),  # (run_tiny trains lm_head)
    (TINY, (*LORA, "distributed.strategy=fsdp2", "finetune.method=qlora", "lora.modules_to_save=[]"),
     "QLoRA under FSDP2 needs the packed 4-bit weights stored in the compute dtype"),
    (TINY, (*LORA, "distributed.offload_parameters=true"), "offloaded by ZeRO-3 or FSDP2"),
    # rows split across processes: DeepSpeed Ulysses, torch's ring attention
    (TINY, ("distributed.sequence_parallel=2",), "Ulysses runs under ZeRO; set distributed.strategy"),
    (TINY, (*SPLIT, "model.attn_implementation=eager"), "cannot run on a split sequence"),
    (TINY, ("distributed.strategy=deepspeed_zero2", "distributed.sequence_parallel=0"), "use a positive number"),
    (TINY, ("distributed.context_parallel=2",), "runs under FSDP2"),
    (TINY, ("distributed.strategy=fsdp2", "distributed.context_parallel=2"), "packed examples would attend to each other"),
    (TINY, (*RING, "model.attn_implementation=eager"), "shards SDPA only"),
    (TINY, (*RING, "distributed.sequence_parallel=2"), "use one of the two"),
]


@pytest.mark.parametrize("base, overrides, says", VALUES)
def test_each_combination_of_values_is_refused_in_one_line_when_a_config_loads(base, overrides, says):
    problems = _problems(base, overrides)
    assert len([p for p in problems if says in p]) == 1, problems


def test_what_the_refused_combinations_leave_is_taken():
    for base, overrides in [
        (None, (SIMPO, "preference.simpo_gamma=1", "preference.sft_weight=0.5", "preference.label_smoothing=0.1",
                "preference.beta=2")),  # CPO-SimPO: the margin, the NLL beside it, label smoothing
        (TINY, (*LORA, "distributed.strategy=fsdp2", "lora.modules_to_save=[embed_tokens]",
                "distributed.offload_parameters=true")),
        (TINY, (*LORA, "distributed.strategy=fsdp2", "finetune.method=full", "distributed.reshard_after_forward=false")),
        (TINY, SPLIT), (TINY, RING),
    ]:
        config = config_module.load(base, list(overrides), check_paths=False)
        assert consistency_problems(config) == []


# (overrides of run_tiny, processes, CPU processes?, words of the one problem; None: none)
PROCESSES = [
    (SPLIT, 2, False, None),
    (SPLIT, 3, False, "3 process(es) cannot be grouped so: use a number of processes (NUM_GPUS x NNODES) divisible by 2"),
    (RING, 4, False, None),
    (RING, 3, False, "3 process(es) cannot be grouped so: use a number of processes divisible by 2"),
    (RING, 2, True, "context parallelism runs on CUDA GPUs only"),
    (("train.tiled_mlp=true",), 1, True, None),
    (("train.tiled_mlp=true",), 2, True, "train.tiled_mlp: DDP reduces a weight's gradient at the first tile's backward"),
    (("train.tiled_mlp=true", "distributed.strategy=deepspeed_zero2"), 2, True, None),
    ((*LORA, "distributed.strategy=fsdp2", "distributed.offload_parameters=true", "lora.modules_to_save=[]"), 2, False,
     None),
    ((*LORA, "distributed.strategy=fsdp2", "distributed.offload_parameters=true", "lora.modules_to_save=[]"), 2, True,
     "distributed.offload_parameters under FSDP2 moves the shards between CPU and GPU memory (pinned), which CPU "
     "processes do not have: leave it out with CPU=1, or train on GPUs"),
]


@pytest.mark.parametrize("overrides, processes, on_cpu, says", PROCESSES)
def test_what_the_processes_and_devices_rule_out_is_one_line(overrides, processes, on_cpu, says):
    config = config_module.load(TINY, list(overrides), check_paths=False)
    assert consistency_problems(config) == []  # the values alone are fine
    problems = consistency_problems(config, processes, on_cpu)
    assert problems == [] if says is None else (len(problems) == 1 and says in problems[0]), problems


LLAMA = ModelFacts(hidden_size=4096, num_experts=0, attention_eager_only=False, attention_heads=32, kv_heads=8)
GEMMA2 = ModelFacts(hidden_size=3584, num_experts=0, attention_eager_only=True, attention_heads=16, kv_heads=8,
                    sliding_window=4096)
MISTRAL = ModelFacts(hidden_size=4096, num_experts=0, attention_eager_only=False, attention_heads=32, kv_heads=8,
                     sliding_window=4096)
HYBRID = ModelFacts(hidden_size=2048, num_experts=0, attention_eager_only=False, attention_heads=16, kv_heads=2,
                    sequential_mixers=("linear_attention",))


@pytest.mark.parametrize("facts, size, attention, says", [
    (LLAMA, 8, "sdpa", None),
    (LLAMA, 16, "flash_attention_2", None),  # the 8 key/value heads copied twice
    (LLAMA, 3, "sdpa", "do not divide by 3"),
    (LLAMA, 2, "flex_attention", "runs on SDPA or FlashAttention only"),
    (GEMMA2, 2, "eager", "needs eager attention"),
    (MISTRAL, 2, "sdpa", "use model.attn_implementation=flash_attention_2"),
    (MISTRAL, 2, "flash_attention_2", None),
    (HYBRID, 2, "sdpa", "carry a state along the sequence"),
])
def test_what_a_model_cannot_split_is_one_line(facts, size, attention, says):
    found = sequence_split_problem(facts, size, attention, size)
    assert found is None if says is None else says in found
    config = config_module.load(TINY, ["distributed.strategy=deepspeed_zero2", f"distributed.sequence_parallel={size}"],
                                check_paths=False)
    assert consistency_problems(config, size, False, facts, attention) == ([] if found is None else [found])
    # a row of images split across processes: whatever the model
    assert consistency_problems(config, size, False, facts, attention, images=True) == [
        "the data shows images, and a row split across processes would part an image's tokens from its pixels: leave "
        "distributed.sequence_parallel and context_parallel at 1 for vision-language data"]


def test_resolve_decides_and_the_planner_refuses_for_its_target():
    """resolve decides and does not refuse; the planner asks the one list with the target's processes
    and devices and the model, and refuses with it (a plan of 3 GPUs, say, or of CPU processes)."""
    ring = config_module.load(TINY, list(RING), check_paths=False)
    with pytest.raises(UserError, match=r"3 process\(es\) cannot be grouped so"):
        resolve_for(ring, Target(3, 80 * GIB, "3 x H100"))
    offloaded = config_module.load(TINY, [*LORA, "distributed.strategy=fsdp2", "distributed.offload_parameters=true",
                                          "lora.modules_to_save=[]"], check_paths=False)
    assert resolve(offloaded, on_cuda=False, bf16_supported=False, world_size=2).parallel.offload_parameters
    with pytest.raises(UserError, match="which CPU processes do not have: leave it out with CPU=1"):
        resolve_for(offloaded, Target(2, 8 * GIB, "host memory", bf16_supported=False, on_cuda=False,
                                      source="host memory"))
    assert resolve_for(offloaded, Target(2, 80 * GIB, "2 x H100")).parallel.offload_parameters


def test_make_check_says_what_a_run_here_would_refuse():
    from sft_play import checks, hardware

    offloaded = config_module.load(TINY, [*LORA, "distributed.strategy=fsdp2", "distributed.offload_parameters=true",
                                          "lora.modules_to_save=[]"], check_paths=False)
    here, disk = checks.run_checks(offloaded, hardware.detect().without_gpus())
    assert here.warning and "would refuse it: distributed.offload_parameters under FSDP2" in here.detail and disk.ok
    here, disk = checks.run_checks(config_module.load(TINY, [], check_paths=False), hardware.detect().without_gpus())
    assert here.ok and here.detail.endswith("nothing refused") and "checkpoints need about" in disk.detail


def test_the_planners_own_copies_of_a_config_are_not_refused():
    """LONGEST and the remedies ask how far rows split under ZeRO-2 (plan.largest_split): the copy
    they plan leaves a ring config's context parallelism out, as a run under ZeRO would."""
    from sft_play.planner import model_shape
    from sft_play.planner.plan import largest_split

    ring = config_module.load(TINY, list(RING), check_paths=False)
    assert largest_split(ring, Target(8, 80 * GIB, "8 x H100"), model_shape(ring)) == 2  # its 2 heads
