"""The planner: exact sizes, every memory term, the batch it picks, remedies, and its interface."""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path

import pytest

from sft_play import config as config_module
from sft_play.planner import QUICK, WITHOUT_REMEDIES, Target, make_plan, model_shape, resolve_for, target_for
from sft_play.planner.simulate import memory
from sft_play.planner.choose.split import BatchSplit, budget_bytes, choose_split, largest_fitting_micro, split_global_batch
from sft_play.planner.choose.search import shorter_lengths
from sft_play.planner.simulate.shapes import ModelShape
from tests.conftest import REPO, bare_run, run_scripts_together, with_parallel

GIB = 1024**3
CONFIGS = Path(__file__).resolve().parent / "fixtures" / "model_configs"


def plan_config(model: str, *overrides: str):
    return config_module.load(None, [f"model.name_or_path={CONFIGS / model}", *overrides], check_paths=False)


# --- sizes -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "model, total",
    [("llama-3.1-8b", 8_030_261_248), ("qwen2.5-0.5b", 494_032_768), ("mistral-7b-v0.1", 7_241_732_096),
     ("gemma-2-9b", 9_241_705_984), ("llama-3-70b", 70_553_706_496), ("llama-3.2-3b", 3_212_749_824)],
)
def test_published_parameter_counts(model, total):
    shape = model_shape(plan_config(model, "finetune.method=full"))
    assert shape.total_params == total
    assert shape.trainable_params == total
    assert sum(shape.params_by_kind.values()) == total


def test_tied_embeddings_are_counted_once():
    shape = model_shape(plan_config("qwen2.5-0.5b", "finetune.method=full"))
    assert shape.tie_word_embeddings
    assert shape.params_by_kind["lm_head"] == 0
    assert shape.params_by_kind["embeddings"] == 151_936 * 896


def test_kinds_of_llama_8b():
    kinds = model_shape(plan_config("llama-3.1-8b", "finetune.method=full")).params_by_kind
    assert kinds["embeddings"] == kinds["lm_head"] == 128_256 * 4096
    assert kinds["attention"] == 32 * (4096 * 4096 * 2 + 4096 * 1024 * 2)
    assert kinds["mlp"] == 32 * 3 * 4096 * 14336
    assert kinds["norms"] == (2 * 32 + 1) * 4096


@pytest.mark.parametrize("model, lora", [("llama-3.1-8b", 41_943_040), ("qwen2.5-0.5b", 8_798_208)])
def test_lora_r16_all_linear_counts(model, lora):
    shape = model_shape(plan_config(model, "finetune.method=lora", "lora.r=16"))
    assert shape.trainable_params == shape.lora_params == lora
    assert shape.total_params > lora


def test_lora_targets_and_rank_change_the_count():
    shape = model_shape(plan_config("llama-3.1-8b", "finetune.method=lora", "lora.r=8", "lora.target_modules=[q_proj, v_proj]"))
    assert shape.lora_params == 32 * 8 * ((4096 + 4096) + (4096 + 1024))


@pytest.mark.parametrize("override, said", [
    ("lora.target_modules=[foo_proj]", "lora.target_modules: foo_proj names no module"),  # peft's traceback
    ("lora.target_modules=[q_proj, gate]", "lora.target_modules: gate names no module"),  # q_proj alone, unsaid
    ("lora.modules_to_save=[embed]", "lora.modules_to_save: embed names no module"),  # no copy trained, unsaid
])
def test_adapter_module_names_that_match_nothing_are_refused_with_the_models_names(override, said):
    from sft_play.errors import UserError

    with pytest.raises(UserError, match=said + r" of this model \(its linears and embeddings: down_proj, embed_tokens, "
                                               r"gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"):
        model_shape(plan_config("llama-3.1-8b", "finetune.method=lora", override))


def test_target_names_peft_maps_onto_fused_experts_are_not_refused():
    """The usual list on a Qwen-MoE model: gate/up/down_proj name no module of transformers 5's
    model, but peft maps them onto the fused expert weights (review finding: they were refused)."""
    experts = "lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"
    shape = model_shape(plan_config("tiny-qwen3-moe", "finetune.method=lora", experts))
    assert shape.lora_params > model_shape(plan_config("tiny-qwen3-moe", "finetune.method=lora",
                                                        "lora.target_modules=[q_proj,k_proj,v_proj,o_proj]")).lora_params


def test_dora_adds_a_magnitude_per_output_feature_and_the_memory_of_its_full_weights():
    lora = plan_config("llama-3.1-8b", "finetune.method=lora", "lora.r=16", "train.micro_batch_size=1",
                       "train.global_batch_size=2", "data.max_seq_length=1024")
    dora = plan_config("llama-3.1-8b", "finetune.method=lora", "lora.r=16", "lora.use_dora=true",
                       "train.micro_batch_size=1", "train.global_batch_size=2", "data.max_seq_length=1024")
    outputs = 32 * (4096 + 1024 + 1024 + 4096 + 14336 + 14336 + 4096)  # q, k, v, o, gate, up, down
    assert model_shape(dora).trainable_params == model_shape(lora).trainable_params + outputs == 41_943_040 + outputs
    # rsLoRA changes the scale, not the memory
    rslora = plan_config("llama-3.1-8b", "finetune.method=lora", "lora.r=16", "lora.use_rslora=true",
                         "train.micro_batch_size=1", "train.global_batch_size=2", "data.max_seq_length=1024")
    gpu = Target(1, 80 * GIB, "1 x H100", gpu_model="H100")
    planned = {name: make_plan(c, gpu, options=WITHOUT_REMEDIES) for name, c in (("lora", lora), ("dora", dora),
                                                                             ("rslora", rslora))}
    assert planned["rslora"].peak_bytes_per_gpu == planned["lora"].peak_bytes_per_gpu
    # peft's DoRA scales each base output by the magnitude over the norm of W + scale x B @ A: the
    # outputs are kept for backward, and every adapted linear builds its whole weight
    assert planned["dora"].breakdown["activations"] > 1.5 * planned["lora"].breakdown["activations"]


def test_neftune_draws_its_noise_beside_the_embedding_output():
    """transformers' NEFTune hook adds zeros_like(output).uniform_() to the embedding output: two
    tensors of the output's size while the original is alive, neither kept for backward."""
    from sft_play.planner import resolve_for
    from sft_play.planner.simulate.predict import replay_step

    overrides = ("finetune.method=lora", "lora.r=16", "train.micro_batch_size=2", "data.max_seq_length=1024")
    gpu = Target(1, 80 * GIB, "1 x H100", gpu_model="H100")
    logs = {}
    for alpha in (None, 5):
        config = plan_config("llama-3.1-8b", *overrides, *([f"train.neftune_noise_alpha={alpha}"] if alpha else []))
        shape = model_shape(config)
        run = resolve_for(config, gpu, None, shape)
        assert run.neftune == bool(alpha)
        logs[alpha] = []
        replay_step(shape, run, 2, False, None, logs[alpha])
    embedding_output = 2 * 1024 * 4096 * 2  # b x s x h in bf16 (the LoRA base's dtype)
    sized = {alpha: sum(1 for e in log if e[0] == "a" and e[2] == embedding_output) for alpha, log in logs.items()}
    assert sized[5] == sized[None] + 2 * 2  # noise and noised output, in each of the two replayed steps
    assert len(logs[5]) == len(logs[None]) + 2 * 2 * 2  # ...each allocated and freed


def test_lora_trains_the_tensors_peft_makes():
    # each layer's A and B matrices at the configured rank, and modules_to_save as whole copies
    from sft_play.planner.simulate.memory import adapter_tensors

    shape = model_shape(plan_config("llama-3.1-8b", "finetune.method=lora", "lora.r=32",
                                    "lora.modules_to_save=[embed_tokens, lm_head]"))
    tensors = adapter_tensors(shape)
    per_layer = [32 * n for i, o in [(4096, 4096), (4096, 1024), (4096, 1024), (4096, 4096), (4096, 14336),
                                     (4096, 14336), (14336, 4096)] for n in (i, o)]
    assert sorted(tensors) == sorted(per_layer * 32 + [128_256 * 4096] * 2)
    assert sum(tensors) == shape.trainable_params


def test_qlora_quantises_every_linear_but_the_head():
    shape = model_shape(plan_config("llama-3.1-8b", "finetune.method=qlora"))
    kinds = shape.params_by_kind
    assert shape.quantized_params == kinds["attention"] + kinds["mlp"]
    assert shape.quantized_blocks == shape.quantized_params // 64
    assert shape.trainable_params == 41_943_040


# --- the state a GPU holds whatever the batch, on a small shape worked out by hand ----------

SHAPE = ModelShape(
    model_type="llama", architecture="LlamaForCausalLM", total_params=1_000_000,
    params_by_kind={"embeddings": 100_000, "attention": 300_000, "mlp": 500_000, "norms": 0, "lm_head": 100_000, "other": 0},
    trainable_params=1_000_000, lora_params=0, quantized_params=0, quantized_blocks=0, num_layers=2, hidden_size=64,
    intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=1000,
    tie_word_embeddings=False,
)
LORA_SHAPE = dataclasses.replace(SHAPE, trainable_params=10_000, lora_params=10_000, lora_in_out=[(64, 64), (64, 128)])
QLORA_SHAPE = dataclasses.replace(LORA_SHAPE, quantized_params=800_000, quantized_blocks=12_500)
FULL = bare_run("full", weights_dtype="float32", mixed="bf16")  # fp32 weights, bf16 compute
LORA = bare_run("lora", weights_dtype="bfloat16", mixed="bf16")  # a bf16 base, fp32 adapters
QLORA = dataclasses.replace(LORA, method="qlora", adapter_dtype="bfloat16")


def test_weights_by_storage_dtype():
    assert memory.weights_bytes(SHAPE, FULL) == 4_000_000
    assert memory.weights_bytes(LORA_SHAPE, LORA) == 2_000_000 + 4 * 10_000
    # NF4: half a byte per quantised weight, constants, the rest in 16 bits, adapters in bf16
    constants = 12_500 + 4 * -(-12_500 // 256)
    assert memory.quantization_constants_bytes(QLORA_SHAPE, QLORA) == constants
    assert memory.weights_bytes(QLORA_SHAPE, QLORA) == 400_000 + constants + 2 * 200_000 + 2 * 10_000
    no_double = dataclasses.replace(QLORA, double_quant=False)
    assert memory.quantization_constants_bytes(QLORA_SHAPE, no_double) == 4 * 12_500


def test_gradients_and_optimizer_states():
    assert memory.gradient_bytes(SHAPE, FULL) == 4_000_000
    assert memory.optimizer_state_bytes(SHAPE, FULL) == 8_000_000
    assert memory.optimizer_state_bytes(LORA_SHAPE, LORA) == 80_000
    assert memory.optimizer_state_bytes(QLORA_SHAPE, QLORA) == 40_000  # bf16 adapters keep bf16 states
    assert memory.optimizer_state_bytes(SHAPE, dataclasses.replace(FULL, optimizer="adamw_8bit")) == int(1e6 * (2 + 8 / 256))
    assert memory.optimizer_state_bytes(SHAPE, dataclasses.replace(FULL, optimizer="sgd")) == 0
    assert 0 < memory.optimizer_state_bytes(SHAPE, dataclasses.replace(FULL, optimizer="adafactor")) < 1_000_000
    assert memory.master_weights_bytes(SHAPE, FULL) == 0
    assert memory.optimizer_step_bytes(SHAPE, FULL) == 4_000_000  # foreach AdamW: one state-sized intermediate
    assert memory.optimizer_step_bytes(SHAPE, dataclasses.replace(FULL, optimizer="adamw_torch_fused")) == 0


@pytest.mark.parametrize("strategy", ["deepspeed_zero2", "fsdp2"])
def test_a_gradient_shard_and_its_buckets_live_from_backward_to_the_step(strategy):
    """As measured on two gloo processes (bench/cpu_ground_truth.py): at the peak in the loss's
    backward neither this rank's gradient shard nor the buckets reducing into it exist yet
    (ZeRO-2 makes them as the first gradients are reduced, FSDP2 in each unit's post-backward;
    zero_grad drops the shard); accumulating, the shard the earlier micro-batches filled is held
    through the forward."""
    from sft_play.planner.simulate.predict import predict, static_lower_bound
    from sft_play.run import resolve

    config = config_module.load(REPO / "configs" / "run_tiny.yaml", [
        "finetune.method=full", "train.gradient_checkpointing=true", "train.mixed_precision=no",
        f"distributed.strategy={strategy}"], check_paths=False)
    shape = model_shape(config)
    run = resolve(config, on_cuda=False, bf16_supported=False, world_size=2).with_changes(batch=BatchSplit(2, 1, 2, 4))
    shard = memory.gradient_bytes(shape, run)
    peak = predict(shape, run, 2)
    assert peak.breakdown.get("gradients", 0) < shard, peak.breakdown  # (the head's own, being made)
    assert "zero_buffers" not in peak.breakdown and "fsdp_buffers" not in peak.breakdown, peak.breakdown
    assert peak.peak_bytes >= static_lower_bound(shape, run)
    accumulating = predict(shape, run, 2, accumulating=True)
    assert accumulating.breakdown["gradients"] >= shard and accumulating.peak_bytes > peak.peak_bytes


@pytest.mark.parametrize("strategy", ["deepspeed_zero2", "fsdp2"])
def test_a_gradient_shard_is_made_after_the_loss_and_kept_to_the_step_its_buckets_freed_before(strategy):
    """The order of the replay's own events: the shard and its buckets are made after the loss
    head's backward (its last tensors freed), the buckets freed before the optimizer step, the
    shard only at zero_grad after it."""
    from sft_play.planner.simulate.predict import replay_step
    from sft_play.run import resolve

    config = config_module.load(REPO / "configs" / "run_tiny.yaml", [
        "finetune.method=full", "train.gradient_checkpointing=true", "train.mixed_precision=no",
        f"distributed.strategy={strategy}"], check_paths=False)
    shape = model_shape(config)
    run = resolve(config, on_cuda=False, bf16_supported=False, world_size=2).with_changes(batch=BatchSplit(2, 1, 2, 4))
    log: list = []
    replay_step(shape, run, 2, False, None, log)
    made = {event[1]: (i, event[2], event[3]) for i, event in enumerate(log) if event[0] == "a"}
    freed = {event[1]: i for i, event in enumerate(log) if event[0] == "f"}
    step = min(i for i, size, category in made.values() if category == "optimizer_step")  # the first step's
    loss_ends = max(freed[h] for h, (i, _, category) in made.items() if category == "logits_loss" and i < step)
    buckets = [h for h, (i, _, category) in made.items() if category in ("zero_buffers", "fsdp_buffers") and i < step]
    shard = [h for h, (i, size, category) in made.items()
             if category == "gradients" and size == memory.gradient_bytes(shape, run) and i < step]
    assert buckets and all(loss_ends < made[h][0] < freed[h] < step for h in buckets)
    assert len(shard) == 1 and loss_ends < made[shard[0]][0] and freed[shard[0]] > step


def _tiny_step_log(strategy: str, *overrides: str, method: str = "full") -> tuple:
    """The replay's events of two steps of the embedded default on two CPU processes, with the
    shape and run they came from."""
    from sft_play.planner.simulate.predict import replay_step
    from sft_play.run import resolve

    config = config_module.load(REPO / "configs" / "run_tiny.yaml", [
        f"finetune.method={method}", "train.gradient_checkpointing=true", "train.mixed_precision=no",
        f"distributed.strategy={strategy}", *overrides], check_paths=False)
    shape = model_shape(config)
    run = resolve(config, on_cuda=False, bf16_supported=False, world_size=2).with_changes(batch=BatchSplit(2, 1, 2, 4))
    log: list = []
    replay_step(shape, run, 2, False, None, log)
    return shape, run, log


def test_fsdp2_gathers_its_layers_around_their_passes_and_none_through_the_optimizer_step():
    """FSDP2 resharding after the forward (measured on two gloo processes, bench/cpu_ground_truth.py):
    decoder layers two at a time through the forward, none as it ends, one (the top one, prefetched
    as the head's backward starts) through the loss head's backward, two through the layers'
    backward (each with the one below prefetched), none at the optimizer step. accelerate's tail unit
    (final norm and head), untied here, is gathered as the final norm's forward starts and resharded
    as its backward ends (``fsdp2_prepare_model``), before the second layer is prefetched."""
    shape, run, log = _tiny_step_log("fsdp2")
    layer = memory.gathered_layer_bytes(shape, run)
    tail = sorted(numel * memory.gathered_bytes(run) for numel in memory.fsdp_step_gathered_tensors(shape))
    step = next(i for i, event in enumerate(log) if event[0] == "a" and event[3] == "optimizer_step")
    first_step = log[:step]
    static = 1 + max(i for i, event in enumerate(first_step) if event[0] == "a" and event[3] == "optimizer_states")
    live, states, sizes = set(), [(0, False)], {}
    for event in first_step[static:]:
        if event[0] == "a" and event[3] == "weights":
            live.add(event[1])
            sizes[event[1]] = event[2]
        elif event[0] == "f":
            live.discard(event[1])
        # (layers gathered, the tail's tensors gathered)
        state = (sum(1 for h in live if sizes[h] == layer), sorted(sizes[h] for h in live if sizes[h] != layer) == tail)
        if state != states[-1]:
            states.append(state)
    layers_only = [count for count, _ in states]
    assert [count for i, count in enumerate(layers_only) if i == 0 or count != layers_only[i - 1]] \
        == [0, 1, 2, 1, 0, 1, 2, 1, 0], states  # (each gathered one after the other)
    with_tail = [state for state in states if state[1]]
    assert with_tail == [(0, True), (1, True)], states  # after the forward's layers, before the second backward layer
    assert not live  # nothing gathered at the step
    # besides the layers and the tail: the untied embedding (a unit of its own) gathered for its
    # forward and again for its backward
    assert not shape.tie_word_embeddings
    embedding = shape.params_by_kind["embeddings"] * memory.gathered_bytes(run)
    assert sorted(size for size in sizes.values() if size != layer) == sorted(tail + [embedding] * 2)


@pytest.mark.parametrize("strategy, overrides", [("deepspeed_zero2", ()), ("ddp", ("train.gradient_accumulation_steps=2",))])
def test_a_trained_heads_gradient_lives_until_its_backward_function_returns(strategy, overrides):
    """TRL's chunked loss makes the head's weight gradient before its tiles and returns it at the
    end: ZeRO's hook copies it into the reduction bucket, an accumulating micro-batch adds it into
    the held gradient, only then (measured under ZeRO-2 on two gloo processes: the gradient alive at
    the peak inside the loss's backward; the accumulating case is the same function's code)."""
    shape, run, log = _tiny_step_log(strategy, *overrides)
    if overrides:  # an accumulating micro-batch
        from sft_play.planner.simulate.predict import replay_step

        log = []
        replay_step(shape, run, 2, True, None, log)
    freed = {event[1]: i for i, event in enumerate(log) if event[0] == "f"}
    head = shape.vocab_size * shape.hidden_size * 4  # (fp32: made as it is returned, no copy)
    # the head's gradient, made just before the function's first tile
    pairs = [(event[1], after[1]) for event, after in zip(log, log[1:]) if event[0] == after[0] == "a"
             and event[3] == "gradients" and event[2] == head and after[3] == "logits_loss"]
    assert len(pairs) == 2  # one a step
    assert all(freed[gradient] > freed[tile] for gradient, tile in pairs)


def test_zero3_keeps_gathered_the_layers_its_reuse_distance_covers_from_forward_to_backward():
    """As measured on two gloo processes (bench/cpu_ground_truth.py): after the first step ZeRO-3
    releases a gathered parameter only when the step's trace does not use it again within
    stage3_max_reuse_distance parameters, so the top layers, whose backward follows their forward
    by what the layers above pass (three times under checkpointing), stay gathered in between; a
    model this small keeps every layer and its trained embedding, and TRL's fused head gathers the
    head's weight around the loss."""
    from sft_play.planner.simulate.predict import predict
    from sft_play.run import resolve

    config = config_module.load(REPO / "configs" / "run_tiny.yaml", [
        "finetune.method=full", "train.gradient_checkpointing=true", "train.mixed_precision=no",
        "distributed.strategy=deepspeed_zero3"], check_paths=False)
    shape = model_shape(config)
    run = resolve(config, on_cuda=False, bf16_supported=False, world_size=2).with_changes(batch=BatchSplit(2, 1, 2, 4))
    assert run.parallel.reuse_distance_elements == 10**9  # DeepSpeed's default, as the JSON leaves it
    layer = memory.largest_layer_params(shape)
    assert memory.zero3_kept_layers(shape, run, True) == shape.num_layers == 4
    assert memory.zero3_kept_embedding(shape, run, True)
    # a layer is kept when the rest of it (twice without checkpointing) and the layers above fit
    near = with_parallel(run, reuse_distance_elements=6 * layer + 1)
    assert memory.zero3_kept_layers(shape, near, True) == 2 and memory.zero3_kept_layers(shape, near, False) == 3
    assert not memory.zero3_kept_embedding(shape, near, True)
    assert memory.zero3_kept_layers(shape, with_parallel(run, reuse_distance_elements=0), True) == 0
    # the two below the two in flight, and the embedding, more at the peak (in the loss's backward)
    extra = predict(shape, run, 2).breakdown["weights"] - predict(shape, near, 2).breakdown["weights"]
    assert extra == 2 * memory.gathered_layer_bytes(shape, run) + shape.params_by_kind["embeddings"] * 4
    # an 8B model's layers: the top two (a third would follow its forward by 1.3e9 parameters)
    llama = model_shape(config_module.load(None, [f"model.name_or_path={CONFIGS / 'llama-3.1-8b'}"], check_paths=False))
    assert memory.zero3_kept_layers(llama, run, True) == 2


def test_zero_shards_gradients_states_masters_and_parameters():
    zero2 = with_parallel(FULL, world_size=4, strategy="deepspeed_zero2")
    assert memory.weights_bytes(SHAPE, zero2) == 2_000_000  # DeepSpeed holds the 16-bit copy
    assert memory.gradient_bytes(SHAPE, zero2) == 2_000_000 // 4
    assert memory.optimizer_state_bytes(SHAPE, zero2) == 8_000_000 // 4
    assert memory.master_weights_bytes(SHAPE, zero2) == 4_000_000 // 4
    # the reduce bucket (h^2 by default) double-buffered in 16 bits, during backward only; the
    # updated parameters are gathered into their flat groups, through no bucket
    assert memory.zero_buffer_bytes(SHAPE, zero2) == 2 * 2 * 64 * 64
    assert memory.sharded_gradients_in_backward(zero2) and not memory.sharded_gradients_in_backward(
        with_parallel(zero2, strategy="deepspeed_zero3"))
    sized = with_parallel(zero2, reduce_bucket_elements=5 * 10**8)
    assert memory.zero_buffer_bytes(SHAPE, sized) == 2 * 2 * 1_000_000  # capped at the parameters
    # ZeRO-3: one bucket for the whole run
    assert memory.zero_buffer_bytes(SHAPE, with_parallel(sized, strategy="deepspeed_zero3")) == 2 * 1_000_000
    offload = with_parallel(zero2, offload_optimizer=True)
    assert memory.optimizer_state_bytes(SHAPE, offload) == memory.master_weights_bytes(SHAPE, offload) == 0
    # the gradient partition lives in CPU memory too: ZeRO-2 stages through one GPU buffer of the
    # largest trainable tensor (16-bit), ZeRO-3 holds none on the GPU
    tensors = dataclasses.replace(SHAPE, other_tensors=[100_000, 100_000],  # embeddings, head; 2 layers of 400,000:
                                  layer_tensors=[(150_000, True), (150_000, True), (100_000, True)])
    assert memory.gradient_bytes(tensors, offload) == 2 * 150_000 < memory.gradient_bytes(tensors, zero2)
    assert memory.gradient_bytes(tensors, with_parallel(offload, strategy="deepspeed_zero3")) == 0
    zero3 = with_parallel(zero2, strategy="deepspeed_zero3")
    deep = dataclasses.replace(SHAPE, num_layers=32)  # ZeRO-3 gathers two layers at a time
    per_layer = (2_000_000 - 2 * 100_000) // 32
    assert memory.weights_bytes(deep, zero3) == 2_000_000 // 4 + 2 * per_layer
    offloaded = with_parallel(zero3, offload_parameters=True)  # only the gathered layers stay
    assert memory.weights_bytes(deep, offloaded) == 2 * per_layer


def test_host_memory_per_node_while_loading_and_while_offloaded():
    # 1,000,000 parameters on 2 nodes of 4 processes: a node holds half the partitions
    world = with_parallel(FULL, world_size=8)
    assert memory.host_bytes_per_node(SHAPE, world, 4) == (0, 0)  # DDP: loaded straight onto each GPU
    zero3 = with_parallel(world, strategy="deepspeed_zero3")
    # under zero.Init each process gathers a layer at a time: (1,000,000 - 100,000 embeddings) / 2 layers, fp32
    assert memory.host_bytes_per_node(SHAPE, zero3, 4) == (4 * 450_000 * 4, 0)
    offload = with_parallel(world, strategy="deepspeed_zero2", offload_optimizer=True)
    # fp32 masters, gradients and Adam's two states, and a 16-bit gradient partition
    assert memory.host_bytes_per_node(SHAPE, offload, 4) == (0, (16 + 2) * 1_000_000 // 2)
    parameters = with_parallel(zero3, offload_optimizer=True, offload_parameters=True)
    assert memory.host_bytes_per_node(SHAPE, parameters, 4) == (4 * 450_000 * 4, (16 + 2 + 2) * 1_000_000 // 2)
    fsdp = with_parallel(LORA, world_size=8, strategy="fsdp2", offload_parameters=True)
    # the 1,000,000 base parameters (total_params counts no adapter) frozen in bf16; the 10,000 fp32
    # adapters with their gradients and Adam's two states
    assert memory.host_bytes_per_node(LORA_SHAPE, fsdp, 4) == (0, (16 * 10_000 + 2 * 1_000_000) // 2)


def test_offloaded_qlora_keeps_its_4_bit_weights_in_host_memory_at_half_a_byte():
    """Issue 46: the 70B QLoRA plan with parameter offload said 134.1 GiB offloaded, about the
    weights' bf16 size, where the planner itself counts them at 37.2 GiB in 4 bits."""
    # QLORA_SHAPE: 800,000 of the 1,000,000 base parameters quantised (12,500 blocks, whose double-
    # quantised constants stay on the GPU), 200,000 in bf16, 10,000 bf16 adapters
    fsdp = with_parallel(QLORA, world_size=8, strategy="fsdp2", offload_parameters=True)
    # adapters under FSDP2 QLoRA keep their bf16: parameter, gradient and Adam's two states, 2 bytes each
    assert memory.offloaded_bytes(QLORA_SHAPE, fsdp) == {"parameters": 800_000 // 2 + 2 * 200_000 + 2 * 10_000,
                                                         "gradients": 2 * 10_000, "optimizer states": 4 * 10_000}
    assert memory.host_bytes_per_node(QLORA_SHAPE, fsdp, 4)[1] == (400_000 + 400_000 + 20_000 + 20_000 + 40_000) // 2
    zero3 = with_parallel(QLORA, world_size=8, strategy="deepspeed_zero3", offload_optimizer=True,
                          offload_parameters=True)
    # DeepSpeed: 16 bytes of optimizer and a 16-bit gradient per adapter, the packed base and bf16 adapters
    assert memory.offloaded_bytes(QLORA_SHAPE, zero3) == {
        "optimizer (fp32 masters, Adam states, gradients)": 16 * 10_000, "16-bit gradients": 2 * 10_000,
        "parameters": 800_000 // 2 + 2 * 200_000 + 2 * 10_000}
    # the constants stay on the GPU with the gathered layers: 12,500 one-byte constants and 49 fp32 scales
    # (the adapters' partition is in host memory with the rest, counted there above)
    assert memory.weights_bytes(QLORA_SHAPE, zero3) - 2 * memory.gathered_layer_bytes(QLORA_SHAPE, zero3) \
        == 12_500 + 4 * 49


def test_a_plan_says_the_host_memory_a_node_needs():
    config = plan_config("llama-3-70b", "finetune.method=full", "distributed.strategy=deepspeed_zero3",
                         "train.gradient_checkpointing=true", "train.global_batch_size=16", "data.max_seq_length=2048",
                         "distributed.offload_optimizer=true")
    plan = make_plan(config, Target(16, 80 * GIB, "16 x H100"), options=QUICK)
    # 8 processes a node, each gathering one 855,654,400-parameter layer in fp32 while it loads (q, o
    # 8192^2; k, v 8192 x 1024; MLP 3 x 8192 x 28672; two norms);
    # then half of the optimizer's 18 bytes per parameter (the other node holds the rest)
    loading, training = 855_654_400 * 4 * 8, 70_553_706_496 * 18 // 2
    assert memory.largest_layer_params(model_shape(config)) == 855_654_400
    assert plan.host_bytes_per_node == max(loading, training)
    assert any(note == f"host memory per node: {loading / GIB:.1f} GiB while its 8 process(es) load the model under "
               f"ZeRO-3's zero.Init (a layer at a time); {training / GIB:.1f} GiB offloaded while training "
               f"(optimizer (fp32 masters, Adam states, gradients) {70_553_706_496 * 16 / 2 / GIB:.1f}, 16-bit gradients "
               f"{70_553_706_496 * 2 / 2 / GIB:.1f}) (DeepSpeed's own estimators allow 1.5x that)" for note in plan.notes), \
        plan.notes


def test_ddp_buckets_and_nccl_only_with_several_processes():
    assert memory.ddp_bucket_bytes(SHAPE, FULL) == 0
    assert memory.ddp_bucket_bytes(SHAPE, with_parallel(FULL, world_size=2)) == 4_000_000
    two = with_parallel(FULL, world_size=2)
    assert memory.outside_allocator_bytes(two) - memory.outside_allocator_bytes(FULL) == memory.NCCL_BYTES
    assert memory.outside_allocator_bytes(FULL, on_cuda=False) == 0


# --- the choice ------------------------------------------------------------------------------


def test_budget_keeps_the_larger_margin():
    assert budget_bytes(80 * GIB, 1.0, 0.05) == 76 * GIB
    assert budget_bytes(10 * GIB, 1.0, 0.05) == 9 * GIB
    assert budget_bytes(100 * GIB, 0.5, 0.03) == 97 * GIB


@pytest.mark.parametrize("guess", [None, 1, 6, 7, 8, 40])
def test_largest_fitting_micro_finds_the_boundary(guess):
    tried = []

    def fits(m):
        tried.append(m)
        return m * 10 <= 75

    assert largest_fitting_micro(fits, 64, guess) == 7
    assert largest_fitting_micro(lambda m: m * 10 <= 5, 64, guess) == 0
    assert largest_fitting_micro(lambda m: True, 16, guess) == 16
    if guess in (6, 7, 8):  # a good guess needs few predictions
        assert len(tried) <= 5


def test_choose_split_prefers_an_exact_global_batch():
    assert choose_split(64, 8, 5) == BatchSplit(4, 2, 8, 64)
    split = choose_split(64, 1, 48)
    assert (split.micro_batch_size, split.gradient_accumulation_steps) == (32, 2)


def test_choose_split_says_what_changed_when_nothing_divides():
    split = choose_split(37, 1, 8)  # 37 is prime: an exact split would need micro 1
    assert split.micro_batch_size == 8 and split.global_batch_size == 40
    assert "nearest" in split.note
    split = choose_split(10, 4, 8)
    assert split.global_batch_size != 10 and split.note
    # the global batch changes anyway: the micro-batch that fits takes it in fewer passes
    assert choose_split(12, 8, 2) == BatchSplit(2, 1, 8, 12, note=choose_split(12, 8, 2).note)
    assert choose_split(12, 8, 2).global_batch_size == 16 and choose_split(12, 8, 1).gradient_accumulation_steps == 2


def test_split_with_fixed_values_reports_a_changed_global_batch():
    split = split_global_batch(64, 2, 8, 3)
    assert split.global_batch_size == 48 and "not train.global_batch_size 64" in split.note
    assert split_global_batch(64, 2, 8) == BatchSplit(8, 4, 2, 64)
    assert BatchSplit(8, 4, 2, 64).halved() == BatchSplit(4, 8, 2, 64)


def test_plan_picks_the_largest_micro_that_fits():
    # 8B LoRA at 2048 tokens on one 80 GiB GPU: a few sequences fit, 64 do not
    config = plan_config("llama-3.1-8b", "finetune.method=lora", "train.global_batch_size=64",
                         "data.max_seq_length=2048", "lora.dropout=0")
    plan = make_plan(config, Target(1, 80 * GIB, "1 x H100"))
    assert plan.fits and plan.global_batch_size == 64
    assert plan.micro_batch_size * plan.gradient_accumulation_steps == 64
    assert sum(plan.breakdown.values()) == plan.peak_bytes_per_gpu <= plan.budget_bytes_per_gpu
    fitting = max(c["micro_batch_size"] for c in plan.candidates if c["fits"])
    assert fitting in range(2, 64)  # the search stopped between what fits and what does not
    assert any(c["micro_batch_size"] == fitting + 1 and not c["fits"] for c in plan.candidates)
    assert plan.micro_batch_size <= fitting and 2 * plan.micro_batch_size >= fitting
    beyond = next(c for c in plan.candidates if c["micro_batch_size"] == fitting + 1)
    assert (f"micro-batch {fitting}: the largest that fits; {fitting + 1} is predicted at "
            f"{beyond['peak_bytes'] / GIB:.1f} GiB of {plan.budget_bytes_per_gpu / GIB:.1f} GiB") in plan.notes
    assert plan.describe().startswith(f"global 64 = micro {plan.micro_batch_size} x accum")


def test_a_micro_batch_below_the_largest_that_fits_says_why():
    """Issue 46: a plan of micro 2 when 3 fits did not say that 3 does not divide the 8 rows per GPU."""
    from types import SimpleNamespace

    from sft_play.planner.present.notes import micro_batch_reason

    search = SimpleNamespace(per_process=8, budget=23 * GIB, tried={})
    split = choose_split(16, 2, 3)
    assert (split.micro_batch_size, split.gradient_accumulation_steps) == (2, 4)
    assert micro_batch_reason(search, split, 3) == ("micro-batch 2, not 3 (the largest that fits): 3 does not divide "
                                                    "the 8 rows each process takes of the global batch, 2 does "
                                                    "(accumulation 4, the global batch unchanged)")


def test_explicit_micro_is_respected_with_a_warning():
    config = plan_config("llama-3.1-8b", "finetune.method=full", "train.micro_batch_size=16",
                         "train.global_batch_size=64", "data.max_seq_length=4096")
    plan = make_plan(config, Target(8, 80 * GIB, "8 x H100"), options=QUICK)
    assert plan.micro_batch_size == 16 and not plan.fits
    assert any("train.micro_batch_size=16 is predicted not to fit" in w for w in plan.warnings)


def test_when_nothing_fits_remedies_are_ranked_with_their_peaks_and_commands():
    config = plan_config("llama-3.1-8b", "finetune.method=lora", "train.global_batch_size=64",
                         "data.max_seq_length=4096")
    plan = make_plan(config, Target(8, 24 * GIB, "8 x 24 GiB"))
    assert not plan.fits
    remedies = plan.remedies
    assert remedies and all(r["peak_bytes"] > 0 and r["change"] and r["command"].startswith("make ") for r in remedies)
    fitting = [r for r in remedies if r["fits"]]
    assert fitting, remedies
    assert remedies[: len(fitting)] == fitting  # those that work lead
    names = [r["name"] for r in remedies]
    assert "gradient checkpointing" in names and "QLoRA instead of LoRA" in names
    checkpointing = next(r for r in remedies if r["name"] == "gradient checkpointing")
    assert checkpointing["peak_bytes"] < plan.peak_bytes_per_gpu
    assert checkpointing["command"] == 'make train-distributed NUM_GPUS=8 ARGS="train.gradient_checkpointing=true"'
    zero2 = next(r for r in remedies if r["name"] == "ZeRO-2")
    assert zero2["command"].startswith("make train-deepspeed NUM_GPUS=8")  # DeepSpeed needs its launcher target
    assert all(r["peak_bytes"] <= plan.budget_bytes_per_gpu for r in fitting)
    more = next(r for r in remedies if r["name"] == "more GPUs")  # the change as make takes it, not plan.py's flag
    # training reads NUM_GPUS per node: 16 GPUs are two nodes of 8 (NUM_GPUS=16 asked 16 per node)
    assert more["change"][0] == "NNODES=2 NUM_GPUS=8" and "NNODES=2 NUM_GPUS=8" in more["command"]
    assert "--gpus" not in more["command"]


def test_a_single_remedy_that_fits_is_offered_alone():
    config = plan_config("llama-3-70b", "finetune.method=qlora", "train.global_batch_size=8",
                         "data.max_seq_length=4096")
    plan = make_plan(config, Target(8, 80 * GIB, "8 x H100"))
    first = plan.remedies[0]
    assert first["name"] == "gradient checkpointing" and first["fits"] and first["micro_batch_size"] >= 1


def test_a_remedy_that_fits_is_what_its_run_plans():
    # Remedies that do not fit are planned without covering shorter rows; one that fits is planned
    # as the run will plan it. Llama-3.1-8B full at 4096 tokens on 150 GiB: with checkpointing,
    # rows of 2048 tokens peak higher than rows of 4096 (143.4 against 143.2 GiB)
    target = Target(1, 150 * GIB, "1 x 150 GiB")
    plan = make_plan(plan_config("llama-3.1-8b", "finetune.method=full", "train.global_batch_size=4",
                                 "data.max_seq_length=4096"), target)
    offered = next(r for r in plan.remedies if r["name"] == "gradient checkpointing")
    applied = make_plan(plan_config("llama-3.1-8b", "finetune.method=full", "train.global_batch_size=4",
                                    "data.max_seq_length=4096", "train.gradient_checkpointing=true"),
                        target, options=WITHOUT_REMEDIES)
    assert not plan.fits and offered["fits"] and applied.fits
    assert (offered["micro_batch_size"], offered["peak_bytes"]) == (applied.micro_batch_size, applied.peak_bytes_per_gpu)
    assert applied.breakdown.get("smaller_batch", 0) > 0


@pytest.fixture
def one_core(monkeypatch):
    """The remedy search plans here, one remedy after another (a stand-in planner that records
    its calls in this process, and costs less than a fork)."""
    from sft_play.planner.simulate import predict

    monkeypatch.setattr(predict.hardware, "usable_cores", lambda: 1)


def test_the_remedy_combination_is_searched_on_quick_plans_and_what_is_offered_is_planned_as_it_runs(one_core):
    """A stand-in planner in place of replays: the peak each remedy saves is fixed, the budget
    needs several of them, and a plan as the run plans it (covering shorter rows) fits only with
    enough room left. The search plans quickly, then the combination found as it runs; when that
    plan does not fit, the combination before the last removal, and when none of those fits, the
    search goes on. Remedies are combined in the search order (those that train the same model
    first, cheapest first), only those ahead of the first that fits alone."""
    from types import SimpleNamespace

    from sft_play.planner.choose import remedies as catalogue

    # unpacked rows: the remedies for packed and long rows (FlashAttention-2, tiling, offload) do not
    # apply; of those that do, the stand-in fixes what each saves (ZeRO-2's optimizer offload 70,
    # ZeRO-3's and FSDP2's parameter offload 20 more)
    config = plan_config("llama-3.1-8b", "finetune.method=full", "train.gradient_checkpointing=false", "data.packing=false")
    target = Target(1, 80 * GIB, "1 x 80 GiB")
    saves = {"train.gradient_checkpointing": 10, "train.optimizer": 20, "model.torch_dtype": 25,
             "distributed.offload_optimizer": 70, "distributed.offload_parameters": 20, "finetune.method": 5}
    base = {"train.gradient_checkpointing": False, "train.optimizer": "auto", "model.torch_dtype": "auto",
            "distributed.offload_optimizer": False, "distributed.offload_parameters": False, "finetune.method": "full"}

    def peak(changed) -> int:
        now = {key: getattr(getattr(changed, key.split(".")[0]), key.split(".")[1]) for key in base}
        return 200 - sum(saves[key] for key in base if now[key] != base[key])

    def run_with(room_needed_as_run: int):
        planned = []

        def plan_for(changed, changed_target, as_run):
            planned.append(as_run)
            fits = peak(changed) <= 100 - (room_needed_as_run if as_run else 0)
            return SimpleNamespace(fits=fits, peak_bytes_per_gpu=peak(changed), budget_bytes_per_gpu=100, time=None,
                                   micro_batch_size=1, host_bytes_per_node=0)

        return catalogue.plan_remedies(config, target, plan_for), planned

    order = [r.name for r in catalogue.search_order([r for r in catalogue.REMEDIES if r.applies(config, target)])]
    assert order == ["gradient checkpointing", "optimizer offload", "parameter offload", "FSDP2 with offload",
                     "8-bit AdamW", "bf16 weights", "LoRA instead of full", "shorter sequences", "more GPUs"]
    entries, planned = run_with(0)
    combination = next(e for e in entries if " + " in e["name"])
    # none fits alone (200 less its saving); checkpointing, optimizer offload and parameter offload
    # are added until it fits (100), then optimizer offload taken out again (parameter offload's own
    # overrides offload the optimizer: 100 still)
    assert not any(e["fits"] for e in entries if " + " not in e["name"])
    assert combination["fits"] and combination["peak_bytes"] == 100
    assert combination["remedies"] == ["gradient checkpointing", "parameter offload"]
    singles = len([e for e in entries if " + " not in e["name"]])
    assert planned[:singles] == [True] * singles  # each remedy alone is offered as it runs
    assert planned[singles:].count(True) == 1, "only the combination found is planned as the run plans it"
    # as the run plans it, those need 5 more: nothing found fits, FSDP2's offload (nothing more saved)
    # and then 8-bit AdamW are added; of the combinations left after removals, the smallest that fits
    # as the run plans it
    entries, planned = run_with(5)
    combination = next(e for e in entries if " + " in e["name"])
    assert combination["fits"] and combination["peak_bytes"] == 80
    assert combination["remedies"] == ["gradient checkpointing", "optimizer offload", "parameter offload", "8-bit AdamW"]
    # parameter offload alone fits: only the remedies ahead of it are combined, and checkpointing
    # with optimizer offload does not fit, so nothing is combined
    saves["distributed.offload_parameters"] = 40
    entries, planned = run_with(0)
    assert [e["name"] for e in entries if e["fits"]] == ["parameter offload"]
    # bf16 weights alone fit, but they change the training: checkpointing with optimizer offload,
    # which does not, is found ahead of them and ranked first
    saves.update({"distributed.offload_parameters": 0, "distributed.offload_optimizer": 90, "model.torch_dtype": 100})
    entries, planned = run_with(0)
    assert [e["name"] for e in entries if e["fits"]] == ["gradient checkpointing + optimizer offload", "bf16 weights"]
    assert [e["result_text"] for e in entries if e["fits"]] == ["the same training", "changes what is trained"]


def test_where_only_the_long_row_levers_together_fit_the_remedies_stack_them_as_longest_does(one_core):
    """Issue 61: make plan LONGEST=1 carried 6,291,456 tokens of Llama-3.1-8B LoRA on 8 x 80 GiB
    with its levers stacked, while a plain plan at 3,000,000 said nothing fits: its combinations
    let ZeRO-3 take ZeRO-2's place with sequence parallelism, so no combination split rows under
    ZeRO-3, and tiling never applied under DDP. The stand-in plan fits only with ZeRO-3, tiling,
    activation offload and rows split across all eight GPUs."""
    from types import SimpleNamespace

    from sft_play.planner.choose import remedies as catalogue

    config = plan_config("llama-3.1-8b", "finetune.method=lora", "lora.modules_to_save=[]", "data.max_seq_length=3000000",
                         "train.gradient_checkpointing=true", "train.global_batch_size=8")
    target = Target(8, 80 * GIB, "8 x H100", gpu_model="H100")

    def plan_for(changed, changed_target, as_run):
        needed = (changed.distributed.strategy == "deepspeed_zero3", changed.train.tiled_mlp,
                  changed.train.offload_activations, changed.distributed.sequence_parallel == 8,
                  changed_target.world_size == 8)
        peak = 100 - 20 * sum(needed[:4])
        return SimpleNamespace(fits=all(needed), peak_bytes_per_gpu=peak, budget_bytes_per_gpu=30, time=None,
                               micro_batch_size=1, host_bytes_per_node=0)

    entries = catalogue.plan_remedies(config, target, plan_for, split=8)
    fitting = [e for e in entries if e["fits"]]
    assert len(fitting) == 1 and fitting[0] is entries[0]
    # stacked in LONGEST's order, then trimmed of what the later levers made unnecessary
    assert fitting[0]["remedies"] == ["ZeRO-3", "tiled MLP", "activation offload", "sequence parallelism"]
    assert {"distributed.sequence_parallel=8", "distributed.strategy=deepspeed_zero3", "train.tiled_mlp=true",
            "train.offload_activations=true"} <= set(fitting[0]["change"])
    assert fitting[0]["command"].startswith("make train-deepspeed NUM_GPUS=8 ")
    # rows split across four: not even the whole stack fits, and nothing is offered as fitting
    assert not any(e["fits"] for e in catalogue.plan_remedies(config, target, plan_for, split=4))


def test_remedies_that_fit_are_ranked_by_hardware_then_result_then_room_then_speed():
    """Issue 46: Qwen2.5-7B full on 8 x 80 GiB offered checkpointing with bf16 weights (76.99 of
    77.6 GiB, updates rounding away) before ZeRO-2 at 61.3 GiB."""
    from sft_play.planner.choose.remedies import rank

    def entry(name, fits=True, more_gpus=False, result=0, tight=False, seconds=1.0):
        return {"remedies": [name], "fits": fits, "more_gpus": more_gpus, "result": result, "tight": tight,
                "seconds_per_step": seconds, "name": name}

    entries = [entry("more GPUs", more_gpus=True, seconds=0.5), entry("bf16 weights", result=2, seconds=0.1),
               entry("8-bit AdamW", result=1), entry("ZeRO-3", tight=True, seconds=0.2), entry("parameter offload", seconds=9),
               entry("ZeRO-2", seconds=3), entry("gradient checkpointing", fits=False), entry("FSDP2", fits=False)]
    assert [e["name"] for e in sorted(entries, key=rank)] == [
        "ZeRO-2", "parameter offload", "ZeRO-3", "8-bit AdamW", "bf16 weights", "more GPUs", "gradient checkpointing", "FSDP2"]


def test_a_remedy_that_contradicts_an_earlier_one_takes_its_place_in_the_combination(one_core):
    """Optimizer offload (ZeRO-2's) comes before FSDP2 in the search, and FSDP2 cannot offload the
    optimizer alone: the search kept optimizer offload and so never tried FSDP2, and the fitting
    combination of checkpointing and FSDP2 was not found."""
    from types import SimpleNamespace

    from sft_play.planner.choose import remedies as catalogue

    config = plan_config("llama-3.1-8b", "finetune.method=full", "train.gradient_checkpointing=false")
    target = Target(8, 80 * GIB, "8 x 80 GiB")
    by_strategy = {"ddp": 0, "deepspeed_zero2": 10, "deepspeed_zero3": 15, "fsdp2": 90}

    def plan_for(changed, changed_target, as_run):
        peak = (200 - 10 * changed.train.gradient_checkpointing - 10 * (changed.train.optimizer == "adamw_8bit")
                - by_strategy[changed.distributed.strategy] - 10 * changed.distributed.offload_optimizer
                - 5 * changed.distributed.offload_parameters - 5 * (changed.finetune.method != "full"))
        return SimpleNamespace(fits=peak <= 100, peak_bytes_per_gpu=peak, budget_bytes_per_gpu=100, time=None,
                               micro_batch_size=1, host_bytes_per_node=0)

    entries = catalogue.plan_remedies(config, target, plan_for)
    assert not any(e["fits"] for e in entries if " + " not in e["name"])
    combination = next(e for e in entries if " + " in e["name"])
    assert combination["fits"] and combination["remedies"] == ["gradient checkpointing", "FSDP2"]
    assert "distributed.strategy=fsdp2" in combination["change"]
    assert not any("offload_optimizer" in change for change in combination["change"])


def test_nodes_are_planned_as_training_reads_them_and_consumer_gpus_over_pcie():
    """make plan ignored NNODES (NUM_GPUS is per node when training), and every described GPU was
    timed over NVLink, RTX 4090s and L4s too."""
    from types import SimpleNamespace

    from sft_play.planner import target_for

    nodes = target_for(SimpleNamespace(gpus=[]), 8, 80, nodes=2)
    assert (nodes.world_size, nodes.gpus_per_node, nodes.interconnect) == (16, 8, "nvlink")
    assert nodes.device_name.startswith("2 node(s) x 8 x 80 GiB")
    alone = target_for(SimpleNamespace(gpus=[]), 16, 80)  # NUM_GPUS alone: all of them, 8 to a node
    assert (alone.world_size, alone.gpus_per_node) == (16, 8)
    consumer = target_for(SimpleNamespace(gpus=[]), 4, 24, gpu_model="RTX 4090")
    assert (consumer.interconnect, consumer.gpus_per_node) == ("pcie", 4)
    with pytest.raises(ValueError, match="nodes must be at least 1"):
        target_for(SimpleNamespace(gpus=[]), 8, 80, nodes=0)


def test_a_fixed_micro_batch_that_does_not_fit_is_offered_the_planners_first():
    """train.micro_batch_size=8 where 2 fit: the one remedy offered was ZeRO-3 with parameters offloaded."""
    config = plan_config("llama-3.1-8b", "finetune.method=lora", "lora.modules_to_save=[]", "train.micro_batch_size=8",
                         "train.global_batch_size=8", "data.max_seq_length=2048", "train.gradient_checkpointing=true")
    plan = make_plan(config, Target(1, 24 * GIB, "1 x 24 GiB"))
    assert not plan.fits
    first = plan.remedies[0]
    assert first["name"] == "planner's micro-batch" and first["fits"] and first["micro_batch_size"] < 8
    assert "train.micro_batch_size=auto" in first["command"]


def test_the_time_says_what_it_does_not_count():
    """Offload printed the same time as none, and a mixture of experts the dense model's efficiency, unsaid."""
    offloaded = plan_config("llama-3.1-8b", "finetune.method=full", "distributed.strategy=deepspeed_zero2",
                            "distributed.offload_optimizer=true", "train.global_batch_size=8")
    plan = make_plan(offloaded, Target(8, 80 * GIB, "8 x H100", gpu_model="H100"), options=QUICK)
    # ZeRO-2's offload: the one micro-batch's 16-bit gradient partition out, the updated 16-bit
    # parameters back (8,030,261,248 parameters over 8 GPUs), at 25 GB/s; the CPU's step uncounted
    assert plan.split.gradient_accumulation_steps == 1
    moved = 8_030_261_248 / 8 * 2 * (1 + 1)
    assert any(s.startswith(f"parameter/optimizer offload: {moved / 1e9:.1f} GB per step per GPU to host memory")
               and "not counted: the optimizer's step on the CPU" in s for s in plan.time["sources"]), plan.time["sources"]
    moe = plan_config("qwen3-30b-a3b", "finetune.method=lora", "train.global_batch_size=8")
    plan = make_plan(moe, Target(1, 80 * GIB, "1 x H100", gpu_model="H100"), options=QUICK)
    assert any(s.startswith("mixture of experts: timed at the efficiency measured on dense") for s in plan.time["sources"])


def test_a_peak_close_to_the_budget_is_not_printed_equal_to_it():
    """"predicted peak 23.3 GiB of 23.3 GiB FITS" read as a plan with no room at all."""
    from types import SimpleNamespace

    from sft_play.planner.plan import Plan

    def described(peak: float, budget: float) -> str:
        return Plan.describe(SimpleNamespace(split=SimpleNamespace(describe=lambda: "global 8"), sequence_parallel=1, context_parallel=1,
                                             peak_bytes_per_gpu=int(peak * GIB), budget_bytes_per_gpu=int(budget * GIB)))

    assert described(23.27, 23.31).endswith("predicted peak 23.27 GiB of 23.31 GiB")
    assert described(20.0, 23.31).endswith("predicted peak 20.0 GiB of 23.3 GiB")


def test_a_safety_margin_larger_than_the_memory_is_one_clear_error():
    """A margin of 100 GiB on 80 GiB planned a budget of -20 GiB, with remedies and hardware for it."""
    from sft_play.errors import UserError

    config = plan_config("llama-3.1-8b", "finetune.method=lora", "planner.safety_margin_gib=100")
    with pytest.raises(UserError, match="the safety margin leaves nothing to plan with: 80.00 GiB free per GPU"):
        make_plan(config, Target(1, 80 * GIB, "1 x H100"))


def test_the_json_plans_remedy_commands_are_the_texts():
    """--json's remedy commands dropped CONFIG= and the user's overrides: run as given, they trained
    the embedded default."""
    from sft_play.planner.present import report

    config = plan_config("llama-3.1-8b", "finetune.method=full", "train.global_batch_size=2")
    plan = make_plan(config, Target(1, 80 * GIB, "1 x H100", gpu_model="H100"))
    fitting = [r for r in json.loads(report.to_json(plan, "my/base.yaml", ["finetune.method=full"]))["remedies"]
               if r["fits"]]
    assert fitting and all(r["command"].startswith("make ") and "CONFIG=my/base.yaml" in r["command"] for r in fitting)
    # the user's override stays, unless the remedy changes that setting itself (LoRA instead of full)
    assert all("finetune.method=full" in r["command"] or any(c.startswith("finetune.method=") for c in r["change"])
               for r in fitting)
    text = report.to_text(plan, "my/base.yaml", ["finetune.method=full"], "VRAM_GIB=80")
    assert all(f"run:  {r['command']}" in text for r in fitting)
    # beside each, the make plan that plans it on the same hardware: run as printed, it fits as offered
    # (the run: line alone re-planned for this machine, without the GPUs described)
    overrides = [f"model.name_or_path={CONFIGS / 'llama-3.1-8b'}", "finetune.method=full", "train.global_batch_size=2"]
    described = json.loads(report.to_json(plan, None, overrides, "VRAM_GIB=80 GPU_MODEL=H100"))["remedies"]
    fitting = [r for r in described if r["fits"]]
    assert len(fitting) >= 2, [r["name"] for r in described]
    for remedy in fitting[:2]:
        assert f"plan: {remedy['plan_command']}" in report.to_text(plan, None, overrides, "VRAM_GIB=80 GPU_MODEL=H100")
        words = dict(word.split("=", 1) for word in shlex.split(remedy["plan_command"])[2:])
        assert words.keys() == {"NUM_GPUS", "VRAM_GIB", "GPU_MODEL", "ARGS"}, remedy["plan_command"]
        replanned = make_plan(config_module.load(None, shlex.split(words["ARGS"]), check_paths=False),
                              target_for(None, gpus=int(words["NUM_GPUS"]), vram_gib=float(words["VRAM_GIB"]),
                                         gpu_model=words["GPU_MODEL"]), options=WITHOUT_REMEDIES)
        assert replanned.fits and replanned.micro_batch_size == remedy["micro_batch_size"], remedy["name"]


def test_70b_qlora_on_one_24_gib_gpu_offloads_or_says_what_hardware_would_do():
    config = plan_config("llama-3-70b", "finetune.method=qlora", "train.global_batch_size=16",
                         "data.max_seq_length=2048")
    # a node that cannot hold the 4-bit weights (37 GiB) in host memory cannot offload them (with
    # the memory, ZeRO-3 offloads them, a layer on the GPU at a time: tests/test_planner_questions.py)
    plan = make_plan(config, Target(1, 24 * GIB, "1 x 24 GiB", host_bytes=16 * GIB))
    assert not plan.fits and not any(r["fits"] for r in plan.remedies)
    offload = next(r for r in plan.remedies if r["name"] == "parameter offload")
    assert "quantization.quant_storage=bfloat16" in offload["change"] and 37 * GIB < offload["host_bytes_per_node"] < 41 * GIB
    # 4-bit 70B weights alone are ~37 GiB: the smallest hardware is named, not guessed
    assert plan.smallest_hardware and "GiB" in plan.smallest_hardware
    assert plan.smallest_hardware.endswith("gradient checkpointing")  # which this config does not have
    assert any("nothing fits on 1 x 24 GiB" in note for note in plan.notes)
    # checkpointing already on is not a change to name (the search's answer stood in for by the bound alone)
    from sft_play.planner.choose.remedies import smallest_hardware
    from sft_play.planner.plan import beyond_budget

    checkpointed = plan_config("llama-3-70b", "finetune.method=qlora", "train.global_batch_size=16",
                               "data.max_seq_length=2048", "train.gradient_checkpointing=true")
    named = smallest_hardware(checkpointed, Target(1, 24 * GIB, "1 x 24 GiB"), lambda c, t: not beyond_budget(c, t))
    assert named and "gradient checkpointing" not in named


def test_cpu_target_plans_host_memory_without_cuda_runtime():
    config = config_module.load(Path(__file__).resolve().parents[1] / "configs" / "run_tiny.yaml",
                                ["train.mixed_precision=auto"])
    plan = make_plan(config, Target(1, 8 * GIB, "CPU", bf16_supported=False, on_cuda=False))
    assert not plan.breakdown.get("cuda_runtime") and plan.fits
    assert plan.precision["mixed"] == "no"  # auto: no autocast on the CPU


def test_a_global_batch_changed_by_a_split_the_user_fixed_is_a_warning():
    """train.global_batch_size=10 with train.micro_batch_size=4 trained global batch 8, said at INFO."""
    config = config_module.load(Path(__file__).resolve().parents[1] / "configs" / "run_tiny.yaml",
                                ["train.global_batch_size=10", "train.micro_batch_size=4"])
    cpu = Target(1, 8 * GIB, "CPU", bf16_supported=False, on_cuda=False)
    plan = make_plan(config, cpu, options=WITHOUT_REMEDIES)
    assert plan.global_batch_size == 8
    assert "global batch 10 is not a multiple of micro 4 x world 1; using the nearest, 8" in plan.warnings


def test_the_plan_says_how_the_steps_cover_the_data():
    """Data smaller than one global batch made each step an epoch of fewer rows than the plan's
    batch, unsaid; how many epochs train.max_steps covers was nowhere either."""
    from sft_play.data import DataStats

    config = config_module.load(Path(__file__).resolve().parents[1] / "configs" / "run_tiny.yaml",
                                ["train.max_steps=500", "train.global_batch_size=12"])
    cpu = Target(1, 8 * GIB, "CPU", bf16_supported=False, on_cuda=False)
    plan = make_plan(config, cpu, DataStats(examples=24000, packed_rows=2858, tokens_p95=50, max_seq_length=256))
    # the whole share fits: memory does not limit it, and "largest that fits: 12" said it did
    assert ("micro-batch 12 is the whole per-process share of the global batch, and it fits: memory is not what "
            "limits it") in plan.notes
    assert "one epoch is 2,858 packed rows, 239 steps of 12: train.max_steps=500 covers 2.09 epochs" in plan.notes
    assert not any("global batch" in w for w in plan.warnings)
    small = make_plan(config, cpu, DataStats(examples=5, tokens_p95=40, max_seq_length=256))
    assert any("the training data is 5 examples, fewer than one global batch of 12: every optimizer step is a whole "
               "epoch" in w for w in small.warnings)
    assert not any("positions" in w for w in plan.warnings + small.warnings)
    long = make_plan(config.model_copy(update={"data": config.data.model_copy(update={"max_seq_length": 1024})}), cpu,
                     DataStats(examples=200, packed_rows=100, tokens_p95=600, tokens_max=700, max_seq_length=1024))
    assert ("the longest example is 700 tokens, longer than the 512 positions the model was trained on "
            "(max_position_embeddings)") in " ".join(long.warnings)


# --- the interface ---------------------------------------------------------------------------


# make plan as a user runs it: these processes start together (conftest.run_scripts_together)
PLAN_COMMANDS = {
    "70b": ("plan.py", "--config", "configs/run_tiny.yaml", f"model.name_or_path={CONFIGS / 'llama-3-70b'}",
            "finetune.method=qlora", "lora.modules_to_save=[]", "train.micro_batch_size=auto",
            "train.global_batch_size=64", "train.gradient_checkpointing=true", "data.max_seq_length=4096", "--gpus", "8",
            "--vram-gib", "80", "--json", "--plot"),  # the picture's path is added
    "no gpu": ("plan.py", "--config", "configs/run_tiny.yaml", "--no-data"),
    "real data": ("plan.py", "--config", "configs/run_tiny.yaml", "data.packing=false", "data.num_proc=1", "--gpus", "1",
                  "--vram-gib", "24", "--json"),
    "does not fit": ("plan.py", "--config", "configs/run_tiny.yaml", f"model.name_or_path={CONFIGS / 'llama-3-70b'}",
                     "finetune.method=full", "--gpus", "1", "--vram-gib", "80", "--no-data"),
    "flash described": ("plan.py", "--config", "configs/run_tiny.yaml", "model.attn_implementation=flash_attention_2",
                        "--gpus", "1", "--vram-gib", "80", "--no-data"),
}


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    image = tmp_path_factory.mktemp("plot") / "plan.png"
    # (the 70B plan counts its replays: a cache of its own, not one another test's plan of it filled)
    commands = {**PLAN_COMMANDS, "70b": (*PLAN_COMMANDS["70b"], str(image),
                                         {"SFT_PLAY_CACHE": str(tmp_path_factory.mktemp("cache"))})}
    return {"image": image, **dict(zip(commands, run_scripts_together(*commands.values())))}


@pytest.fixture(scope="module")
def plan_json(plans):
    result = plans["70b"]
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout), plans["image"]


def test_a_plot_of_many_micro_batches_stays_readable_on_one_screen(tmp_path):
    """PLOT= drew one bar per micro-batch planned: 45 bars made a 4680 x 600 picture."""
    from types import SimpleNamespace

    from PIL import Image

    from sft_play.planner.present import report

    candidates = [{"micro_batch_size": m, "breakdown": {"weights": 2 * GIB, "activations": m * GIB / 8},
                   "peak_bytes": 2 * GIB + m * GIB / 8} for m in range(1, 46)]
    plan = SimpleNamespace(candidates=candidates, micro_batch_size=30, breakdown=candidates[29]["breakdown"],
                           peak_bytes_per_gpu=candidates[29]["peak_bytes"], budget_bytes_per_gpu=6 * GIB, fits=True,
                           model="m", method="lora", sequence_length=2048, device="1 x H100")
    shown = [c["micro_batch_size"] for c in report._readable(candidates, 30)]
    assert len(shown) == report.PLOTTED_BARS and shown == sorted(shown) and {1, 29, 30, 31, 45} <= set(shown)
    width, height = Image.open(report.plot(plan, tmp_path / "plan.png")).size
    assert width <= 1600 and height == 600
    assert report._readable(candidates[:10], 3) == candidates[:10]


def test_plan_json_contract(plan_json):
    doc, _ = plan_json
    for key in ("total_params", "trainable_params", "micro_batch_size", "gradient_accumulation_steps", "world_size",
                "global_batch_size", "peak_bytes_per_gpu", "budget_bytes_per_gpu", "fits", "breakdown", "remedies",
                "sequence_length", "sequence_length_source", "plan_seconds"):
        assert key in doc, key
    assert doc["total_params"] == 70_553_706_496 and doc["world_size"] == 8
    assert sum(doc["breakdown"].values()) == doc["peak_bytes_per_gpu"]
    assert doc["fits"] is True and doc["remedies"] == []
    assert doc["micro_batch_size"] * doc["gradient_accumulation_steps"] * 8 == doc["global_batch_size"] == 64
    assert doc["command"].startswith("make train-distributed CONFIG=configs/run_tiny.yaml NUM_GPUS=8 ARGS=\"model.name_or_path=")
    assert doc["sequence_length"] == 4096 and "data.max_seq_length" in doc["sequence_length_source"]
    assert "no tokenizer" in " ".join(doc["notes"])  # a folder with config.json only


def test_planning_70b_replays_a_handful_of_steps(plan_json):
    doc, _ = plan_json
    # What planning costs is the allocator replays (one trace, then ~0.1-0.15 s per replay of 80
    # layers on 2 cores): the search walks from where the line through micro 1 and micro 8 crosses
    # the budget instead of trying every micro-batch, and then checks each micro-batch below the one
    # it found (a micro-batch fits only when every smaller one does: test_planner_monotone.py), so
    # at most 8 for a per-GPU batch of 8; then the chosen micro-batch and every smaller one with
    # rows of each shorter power of two of the ladder (256, 512, 1024, 2048 below 4096), once each. The
    # seconds are measured by bench/planner_accuracy.py (docs/reports/planner_accuracy.md), not here: a
    # shared VM's clock and even its CPU time vary by half from one run to the next.
    assert 2 <= doc["replays"] <= 8 + doc["micro_batch_size"] * len(shorter_lengths(4096))
    assert 0 < doc["plan_cpu_seconds"] and 0 < doc["plan_seconds"]


def test_plot_is_written(plan_json):
    _, image = plan_json
    assert image.is_file() and image.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the machine without a GPU")
def test_plan_without_a_gpu_plans_the_cpu_run_make_train_takes(plans):
    result = plans["no gpu"]
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Hardware CPU (host memory / 1 process(es))" in result.stdout
    assert "per-process memory term (host)" in result.stdout and "per-GPU" not in result.stdout
    assert "Plan     global 12 = " in result.stdout and "FITS" in result.stdout  # the micro-batch follows the RAM free
    assert "no CUDA GPU here: this is the CPU run make train takes on this machine" in result.stdout
    # GPUs counted but not described cannot be planned on a machine without one
    from sft_play import hardware

    with pytest.raises(ValueError, match="NUM_GPUS=N VRAM_GIB=G"):
        target_for(hardware.detect().without_gpus(), gpus=2)


def test_plan_uses_the_real_data_when_it_can(plans):
    result = plans["real data"]
    assert result.returncode == 0, result.stderr[-2000:]
    doc = json.loads(result.stdout)
    assert doc["sequence_length"] == 62  # the longest tiny example, not data.max_seq_length (256)
    assert "longest example" in doc["sequence_length_source"]


def test_plan_exit_status_says_whether_it_fits(plans):
    result = plans["does not fit"]
    assert result.returncode == 3
    assert "DOES NOT FIT" in result.stdout and "Remedies" in result.stdout


def test_calibration_fits_two_measurements_and_replans():
    from sft_play.planner import peak_at, resolve_for
    from sft_play.planner.choose import calibrate

    assert calibrate.fit({1: 10 * GIB, 2: 14 * GIB}) == (6 * GIB, 4 * GIB)
    config = plan_config("llama-3.1-8b", "finetune.method=qlora", "train.global_batch_size=64",
                         "data.max_seq_length=2048", "train.gradient_checkpointing=true")
    target = Target(1, 80 * GIB, "1 x H100")
    plan = make_plan(config, target, options=QUICK)  # (what calibration reads of it: the budget, the split asked)
    shape = model_shape(config)
    predicted = {m: peak_at(shape, resolve_for(config, target, None, shape), m) for m in (1, 2)}
    assert predicted[1] < predicted[2]
    # The GPU turns out to spend 10 GiB fixed and 7 GiB per sequence: 66 GiB of budget fits 9
    measured = {1: 17 * GIB, 2: 24 * GIB}
    replanned = calibrate.calibrated_plan(plan, measured, predicted, config.train,
                                          config.planner.model_copy(update={"safety_margin_gib": 1.0,
                                                                            "safety_fraction": 0.05}))
    assert replanned.micro_batch_size == 8 and replanned.gradient_accumulation_steps == 8  # exact split of 64
    assert replanned.peak_bytes_per_gpu == 10 * GIB + 8 * 7 * GIB
    assert replanned.budget_bytes_per_gpu == budget_bytes(plan.free_bytes_per_gpu, 1.0, 0.05)  # the budget it used
    # an eager-attention plan keeps its measured shortfall when calibrated too: the same budget as planned
    eager = dataclasses.replace(plan, attention="eager", budget_bytes_per_gpu=budget_bytes(80 * GIB, 0.5, 0.11))
    recalibrated = calibrate.calibrated_plan(eager, measured, predicted, config.train, config.planner)
    assert recalibrated.budget_bytes_per_gpu == eager.budget_bytes_per_gpu
    assert recalibrated.fits == (recalibrated.peak_bytes_per_gpu <= recalibrated.budget_bytes_per_gpu)
    assert any("calibrated on this GPU: micro 1: predicted" in note for note in replanned.notes)
    with pytest.raises(ValueError, match="two different micro-batch sizes"):
        calibrate.fit({1: GIB})


# --- time ------------------------------------------------------------------------------------


def test_a_tiny_models_short_rows_take_time_not_less_than_none():
    """The credit for rows shorter than the measured ones (their attention) outweighed a tiny
    model's weights: the plan printed -438,390,539 tokens/s."""
    config = plan_config("tiny-llama-256", "finetune.method=lora", "data.max_seq_length=64", "train.global_batch_size=8")
    plan = make_plan(config, Target(8, 80 * GIB, "8 x H100", gpu_model="H100"), options=WITHOUT_REMEDIES)
    assert plan.time["tokens_per_second"] > 0 and plan.time["seconds_per_step"] > 0


def test_the_time_prediction_is_the_measured_efficiency_of_the_gpus_peak_over_the_flops_per_token():
    # at the measured rows' length the time is the model's FLOPs at the efficiency measured for the
    # method on that GPU (timing.MEASURED_MFU; what it was measured at is bench/throughput.py's)
    from sft_play.planner.simulate import timing

    config = plan_config("llama-3.1-8b", "finetune.method=lora", "train.global_batch_size=2", "lora.dropout=0",
                         "data.max_seq_length=2048", "train.max_steps=100")
    plan = make_plan(config, Target(1, 80 * GIB, "1 x H100", gpu_model="NVIDIA H100 80GB HBM3"))
    shape = model_shape(config)
    per_token = 4 * shape.total_params + 6 * shape.lora_params
    efficiency = timing.MEASURED_MFU["H100"]["lora"][0]
    assert plan.time["efficiency"] == efficiency
    assert plan.time["tokens_per_second"] == pytest.approx(efficiency * timing.PEAK_BF16["H100"] / per_token, rel=1e-6)
    assert plan.time["communication_seconds"] == 0 and plan.time["steps"] == 100
    assert plan.time["wall_seconds"] == pytest.approx(100 * plan.time["seconds_per_step"])
    assert plan.time["gpu_hours"] == pytest.approx(plan.time["wall_seconds"] / 3600)


def test_the_step_time_grows_with_the_length_as_attentions_flops_do():
    """LoRA on Llama-3.1-8B was predicted at the same tokens/s from 8k to 131k tokens: attention's
    FLOPs, which grow with the keys a token attends to, were not counted beyond the measured rows'."""
    from sft_play.planner.simulate import timing

    def timed(seq: int, *extra: str) -> dict:
        config = plan_config("llama-3.1-8b", "finetune.method=lora", "train.global_batch_size=1", "lora.dropout=0",
                             f"data.max_seq_length={seq}", "train.gradient_checkpointing=true", *extra)
        return make_plan(config, Target(1, 80 * GIB, "1 x H100", gpu_model="H100"), options=QUICK).time

    flash = "model.attn_implementation=flex_attention"  # mask-free, as FlashAttention-2 (needs no package)
    shape = model_shape(plan_config("llama-3.1-8b", "finetune.method=lora"))
    per_key = 4 * 32 * 128 * 32 * 4  # 4 x heads x head_dim x layers per key, forward + backward + recompute
    weights = 6 * shape.total_params + 6 * shape.lora_params  # 4 N + 6 N_lora, and the recompute's 2 N
    seconds = {}
    for seq in (8192, 32768, 131072):
        time = timed(seq, flash)
        # causal, one example per row: seq / 2 keys per token, against the measured rows' 2048
        per_token = weights + per_key * (seq / 2 - timing.MEASURED_KEYS_PER_TOKEN)
        assert time["tokens_per_second"] == pytest.approx(0.272 * 989.4e12 / per_token, rel=1e-6)
        assert f"{seq // 2:,} keys per token (causal, within its example)" in time["sources"][2]
        seconds[seq] = time["seconds_per_step"] / seq
    assert seconds[8192] < seconds[32768] < seconds[131072]
    assert seconds[131072] / seconds[8192] > 2.5  # at 131k attention costs about twice the dense forward
    # a 4-D mask: the kernel computes the whole square
    masked = timed(32768)
    assert "32,768 keys per token (a mask: the whole row)" in masked["sources"][2]
    assert masked["seconds_per_step"] > timed(32768, flash)["seconds_per_step"]


def test_each_gpu_model_is_timed_at_its_own_measured_efficiency_else_the_h100s_said():
    from sft_play.planner.simulate import timing

    config = plan_config("llama-3.1-8b", "finetune.method=lora", "train.global_batch_size=2", "lora.dropout=0",
                         "data.max_seq_length=2048", "train.max_steps=100")

    def timed(gpu_model: str):
        return make_plan(config, Target(1, 80 * GIB, f"1 x {gpu_model}", gpu_model=gpu_model), options=WITHOUT_REMEDIES).time

    h100, h200, a100 = timed("NVIDIA H100 80GB HBM3"), timed("NVIDIA H200"), timed("NVIDIA A100-SXM4-80GB")
    assert h200["efficiency"] == timing.MEASURED_MFU["H200"]["lora"][0] != h100["efficiency"]
    assert "H200, Llama-3.1-8B LoRA" in h200["sources"][0]  # the lease of 2026-11-26 (docs/reports/gpu_lease.md)
    # same dense peak, more MFU measured: the H200 is predicted faster by exactly the ratio of the MFUs
    assert h100["seconds_per_step"] / h200["seconds_per_step"] == pytest.approx(0.329 / 0.272)
    assert a100["efficiency"] == h100["efficiency"] and "not yet measured on A100" in a100["sources"][0]
    assert "not yet measured" not in h100["sources"][0]


def test_gpu_models_are_named_as_people_write_them_and_an_unknown_one_is_said():
    """GPU_MODEL=h100 (or RTX4090, RTX9999) printed 'timed as h100' and then no time, unsaid."""
    from types import SimpleNamespace

    from sft_play.planner import WITHOUT_REMEDIES, target_for
    from sft_play.planner.simulate import timing

    assert [timing.gpu_model(n) for n in ("h100", "RTX4090", "rtx 4090", "H100-PCIe", "NVIDIA L40S", "NVIDIA L4",
                                          "NVIDIA A100-SXM4-80GB", "RTX9999", "NVIDIA L40", "NVIDIA A100 80GB PCIe",
                                          "NVIDIA H100 NVL")] == [
        "H100", "RTX 4090", "RTX 4090", "H100 PCIe", "L40S", "L4", "A100", None, None, "A100", "H100 NVL"]  # an L40 is no L4
    described = target_for(SimpleNamespace(gpus=[]), 8, 24, gpu_model="rtx4090")
    assert described.gpu_model == "RTX 4090" and "timed as RTX 4090" in described.device_name
    with pytest.raises(ValueError, match="GPU model 'RTX9999' is not one the planner can time"):
        target_for(SimpleNamespace(gpus=[]), 8, 24, gpu_model="RTX9999")
    # a detected GPU the table lacks: the plan says why it has no time
    config = plan_config("llama-3.1-8b", "finetune.method=lora", "train.global_batch_size=8")
    plan = make_plan(config, Target(1, 80 * GIB, "1 x NVIDIA RTX PRO 9000", gpu_model="NVIDIA RTX PRO 9000"),
                     options=WITHOUT_REMEDIES)
    assert plan.time is None and any("no time: the planner has no peak FLOP/s for 'NVIDIA RTX PRO 9000'" in note
                                     for note in plan.notes)


def test_eager_attention_plans_keep_its_measured_shortfall_free_and_count_a_mask_per_attention_kind():
    # Gemma-2 caps its attention logits: eager attention, whose float masks transformers always
    # builds (full and sliding window: two); its peak was measured 10.6 % over the replay (H200)
    gemma = plan_config("gemma-2-9b", "finetune.method=lora", "data.max_seq_length=1024",
                        "train.gradient_checkpointing=true", "train.global_batch_size=2")
    assert model_shape(gemma).attention_masks == 2
    assert model_shape(plan_config("qwen2.5-0.5b")).attention_masks == 1
    assert model_shape(plan_config("llama-3.1-8b")).attention_masks == 1  # no layer_types: one mask
    gpu = Target(1, 80 * GIB, "1 x H100", gpu_model="H100")
    plan = make_plan(gemma, gpu, options=QUICK)
    assert plan.attention == "eager" and plan.attention_mask
    assert plan.budget_bytes_per_gpu == int(80 * GIB * (1 - 0.11))
    assert any("11 % of free memory kept free, not planner.safety_fraction's 3 %" in n for n in plan.notes)
    # SDPA plans keep planner.safety_fraction; so does a CPU plan of the same model (CUDA's allocator only)
    sdpa = make_plan(plan_config("qwen2.5-0.5b", "finetune.method=lora", "train.global_batch_size=8"), gpu,
                     options=QUICK)
    assert sdpa.budget_bytes_per_gpu == int(80 * GIB * 0.97)
    cpu = make_plan(gemma, Target(1, 80 * GIB, "CPU (host memory)", on_cuda=False), options=QUICK)
    assert not any("kept free, not planner.safety_fraction" in n for n in cpu.notes)


# Tiny configs of the families that attend through a sliding window: without layer_types every
# layer slides (Mistral, Phi-3, Starcoder2) when sliding_window is set; with them, the layers named
# sliding_attention do (Gemma-3, Qwen2 with use_sliding_window)
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
WINDOWED = {
    "mistral": ("MistralConfig", dict(sliding_window=16)),
    "mistral without a window": ("MistralConfig", dict(sliding_window=None)),
    "phi3": ("Phi3Config", dict(sliding_window=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "starcoder2": ("Starcoder2Config", dict(sliding_window=16, bos_token_id=1, eos_token_id=2)),
    "gemma3": ("Gemma3TextConfig", dict(sliding_window=16, head_dim=16, layer_types=["sliding_attention", "full_attention"] * 2)),
    "qwen2": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=16, max_window_layers=2)),
    "llama": ("LlamaConfig", {}),
}


@pytest.mark.parametrize("family", WINDOWED)
def test_the_layers_planned_with_a_sliding_mask_are_those_transformers_gives_one(family):
    # SDPA runs unmasked rows with is_causal, which has no window: from rows as long as the window,
    # transformers gives the sliding layers a mask (run.sliding_mask), and their kernel changes
    import torch
    import transformers

    from sft_play.architecture import is_sliding, layer_kinds, sliding_window
    from sft_play.run import sliding_mask

    name, settings = WINDOWED[family]
    model_config = getattr(transformers, name)(**SMALL, num_hidden_layers=4, **settings)
    model_config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(model_config).eval()
    layers = model.model.layers
    given: list = []
    for layer in layers:
        layer.self_attn.register_forward_pre_hook(
            lambda _, args, kwargs: given.append(kwargs.get("attention_mask") is not None), with_kwargs=True)
    window = sliding_window(model_config)
    assert (window is None) == (family in ("mistral without a window", "llama"))
    for tokens in (8, 15, 16, 24):
        given.clear()
        ids = torch.randint(3, 64, (2, tokens))
        with torch.no_grad():
            model(input_ids=ids, attention_mask=torch.ones_like(ids))  # what the padded collator passes
        kinds = layer_kinds(model_config, windows=sliding_mask("sdpa", False, window, tokens)) or [None] * len(layers)
        planned = [sliding_mask("sdpa", False, window, tokens) and is_sliding(model_config, kind) for kind in kinds]
        assert given == planned, (tokens, kinds)
    if family in ("gemma3", "qwen2"):
        assert any(given) and not all(given)  # only the sliding layers


def _windowed_model(folder, **settings):
    import transformers

    transformers.Gemma3TextConfig(**{**SMALL, "hidden_size": 256, "intermediate_size": 512, "head_dim": 64,
                                     "num_attention_heads": 4, "vocab_size": 1024, "num_hidden_layers": 4,
                                     "sliding_window": 2048, **settings}).save_pretrained(folder)
    return folder


def test_sdpa_plans_the_sliding_windows_mask_once_rows_reach_it(tmp_path):
    # A Gemma-3-like model: two sliding-window layers (2048 tokens) and two full ones, rows of one
    # example each (micro-batch 1, no packing): no mask below the window; at it, the sliding layers
    # take an s x s mask (bool) and a bias (bf16) that the memory-efficient kernel keeps for backward
    model = _windowed_model(tmp_path / "windowed", layer_types=["sliding_attention", "full_attention"] * 2)
    gpu = Target(1, 80 * GIB, "1 x H100", gpu_model="H100")

    def plan(tokens: int, attention: str):
        config = plan_config("qwen2.5-0.5b", f"model.name_or_path={model}", "finetune.method=full",
                             "data.packing=false", f"data.max_seq_length={tokens}", "train.micro_batch_size=1",
                             "train.global_batch_size=8", f"model.attn_implementation={attention}")
        return make_plan(config, gpu, options=WITHOUT_REMEDIES)

    below = {attention: plan(2047, attention) for attention in ("sdpa", "flex_attention")}
    at = {attention: plan(2048, attention) for attention in ("sdpa", "flex_attention")}
    assert not any("sliding window" in note for note in below["sdpa"].notes)
    assert any("at 2048 tokens its sliding-window layers of this model (2048-token window) get an s x s mask," in n
               for n in at["sdpa"].notes)
    assert at["sdpa"].sliding_window_mask and not at["sdpa"].attention_mask and not below["sdpa"].sliding_window_mask
    # (the replays' own peaks: a plan between powers of two reports at least the line between them,
    # which at 2,047 tokens already carries most of what 2,048 adds)
    def replayed(plan) -> int:
        return plan.candidates[0]["peak_bytes"]

    growth = {attention: replayed(at[attention]) - replayed(below[attention]) for attention in at}
    masked_layers = 2 * (2048 * 2048 * 2)  # what the sliding layers keep for backward at least: their bias
    assert growth["flex_attention"] < masked_layers / 4  # one token more: the window costs nothing
    assert growth["sdpa"] >= growth["flex_attention"] + masked_layers
    assert below["sdpa"].peak_bytes_per_gpu >= replayed(below["sdpa"])
    # every layer sliding: twice the layers keep a bias
    every = _windowed_model(tmp_path / "every", layer_types=["sliding_attention"] * 4)
    config = plan_config("qwen2.5-0.5b", f"model.name_or_path={every}", "finetune.method=full", "data.packing=false",
                         "data.max_seq_length=2048", "train.micro_batch_size=1", "train.global_batch_size=8")
    assert make_plan(config, gpu, options=WITHOUT_REMEDIES).peak_bytes_per_gpu - at["sdpa"].peak_bytes_per_gpu \
        >= masked_layers


def test_the_cublas_workspace_follows_the_gpu_planned_for():
    # 32 MiB on Hopper, 8.125 MiB on Ampere and Blackwell; under train.deterministic, 128 KiB
    config = plan_config("llama-3.1-8b", "finetune.method=lora", "train.global_batch_size=8")
    runtime = {model: make_plan(config, target_for(None, gpus=1, vram_gib=80, gpu_model=model),
                                options=QUICK).breakdown["cuda_runtime"] for model in ("H100", "A100", "B200")}
    assert runtime["H100"] - runtime["A100"] == runtime["H100"] - runtime["B200"] == 32 * 2**20 - (8 * 2**20 + 128 * 2**10)
    deterministic = plan_config("llama-3.1-8b", "finetune.method=lora", "train.global_batch_size=8",
                                "train.deterministic=true")
    h100 = target_for(None, gpus=1, vram_gib=80)
    assert h100.compute_capability == (9, 0)
    assert runtime["H100"] - make_plan(deterministic, h100, options=QUICK).breakdown["cuda_runtime"] \
        == 32 * 2**20 - 128 * 2**10


def test_time_counts_recomputation_communication_and_the_hardware_rented():
    # (the time of the split each plan chooses: the shorter rows' memory, which QUICK leaves out, is not asked)
    base = ["finetune.method=full", "train.global_batch_size=64", "data.max_seq_length=2048", "train.max_steps=10"]
    eight = make_plan(plan_config("qwen2.5-0.5b", *base), Target(8, 80 * GIB, "8 x 80", gpu_model="H100"), options=QUICK)
    checkpointed = make_plan(plan_config("qwen2.5-0.5b", *base, "train.gradient_checkpointing=true"),
                             Target(8, 80 * GIB, "8 x 80", gpu_model="H100"), options=QUICK)
    assert checkpointed.time["compute_seconds"] == pytest.approx(eight.time["compute_seconds"] * 8 / 6)
    assert eight.time["communication_seconds"] > 0  # DDP's all-reduce of fp32 gradients
    slow_links = make_plan(plan_config("qwen2.5-0.5b", *base),
                           Target(8, 80 * GIB, "8 x 80", gpu_model="H100", interconnect="pcie"), options=QUICK)
    assert slow_links.time["communication_seconds"] > 10 * eight.time["communication_seconds"]
    described = target_for(None, gpus=8, vram_gib=80)  # what a user deciding what to rent types
    assert described.gpu_model == "H100"
    assert make_plan(plan_config("qwen2.5-0.5b", *base), described, options=QUICK).time is not None
    assert make_plan(plan_config("qwen2.5-0.5b", *base), Target(1, 8 * GIB, "CPU", on_cuda=False),
                     options=QUICK).time is None


def test_planning_described_hardware_does_not_depend_on_this_machines_packages(plans):
    import importlib.util

    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here")
    overrides = [f"model.name_or_path={CONFIGS / 'llama-3.1-8b'}", "finetune.method=lora", "data.max_seq_length=4096"]
    with pytest.raises(config_module.ConfigError, match="flash_attention_2 needs the flash-attn package"):
        config_module.load(None, [*overrides, "model.attn_implementation=flash_attention_2"])  # training here
    described = Target(8, 80 * GIB, "8 x 80 GiB", source="--vram-gib")
    flash = make_plan(config_module.load(None, [*overrides, "model.attn_implementation=flash_attention_2"],
                                         check_packages=False), described)
    assert flash.attention == "flash_attention_2" and not flash.attention_mask
    auto = make_plan(config_module.load(None, overrides), described)
    assert auto.attention == "sdpa" and any("hardware described" in note for note in auto.notes)
    result = plans["flash described"]
    assert result.returncode == 0 and "attention flash_attention_2" in result.stdout, result.stderr[-2000:]


def test_what_cannot_hold_its_weights_and_optimizer_states_is_refused_without_a_replay():
    """The remedy search asks only whether a changed config fits; where the parameters and
    optimizer states alone exceed the budget, the answer is no without replaying a step, and it is
    the answer the plan itself gives."""
    from sft_play.planner.simulate import predict
    from sft_play.planner.plan import beyond_budget

    config = plan_config("llama-3-70b", "finetune.method=qlora", "train.global_batch_size=16", "data.max_seq_length=2048")
    small, large = Target(1, 24 * GIB, "1 x 24 GiB"), Target(1, 80 * GIB, "1 x 80 GiB")
    before = predict.REPLAYS[0]
    assert beyond_budget(config, small) and not beyond_budget(config, large)  # 4-bit 70B weights: ~37 GiB
    assert predict.REPLAYS[0] == before
    assert not make_plan(config, small, options=QUICK).fits
    # what is not refused so is planned (it fits on 80 GiB with checkpointing: the smallest hardware)
    checkpointed = plan_config("llama-3-70b", "finetune.method=qlora", "train.global_batch_size=16",
                               "data.max_seq_length=2048", "train.gradient_checkpointing=true")
    assert not beyond_budget(checkpointed, large)
    assert make_plan(checkpointed, large, options=QUICK).fits


# --- long rows -------------------------------------------------------------------------------


LONG = ("finetune.method=lora", "lora.modules_to_save=[]", "lora.dropout=0", "train.gradient_checkpointing=true",
        "model.attn_implementation=flex_attention", "train.global_batch_size=1")


def test_offloaded_hidden_states_leave_the_gpu_and_are_counted_in_host_memory():
    """Each checkpointed layer's input and the final norm's, [micro, seq, hidden] in the residual
    dtype, go to host memory: the GPU's forward activations lose them, the node's memory gains them."""
    from sft_play.planner.simulate import memory

    seq = 32768
    plain = plan_config("llama-3.1-8b", *LONG, f"data.max_seq_length={seq}")
    offloaded = plan_config("llama-3.1-8b", *LONG, f"data.max_seq_length={seq}", "train.offload_activations=true")
    target = Target(1, 80 * GIB, "1 x H100", gpu_model="H100")
    before, after = (make_plan(c, target, options=WITHOUT_REMEDIES) for c in (plain, offloaded))
    hidden = seq * 4096 * 2  # one [1, seq, 4096] in bf16
    kept = before.breakdown["activations"] - after.breakdown.get("activations", 0)
    assert kept >= 31 * hidden  # every layer's input but the one being recomputed
    assert after.peak_bytes_per_gpu < before.peak_bytes_per_gpu
    shape = model_shape(offloaded)
    run = resolve_for(offloaded, target, None, shape)
    # 32 layers' inputs, and the final norm's fp32 upcast of its input
    assert memory.offloaded_hidden_bytes(shape, run, 1) == 32 * hidden + 2 * hidden
    assert after.host_bytes_per_node == 34 * hidden and "offloaded while training" in " ".join(after.notes)


def test_tiled_mlps_are_traced_as_they_run_and_shrink_the_backward_working_set():
    seq = 65536
    target = Target(1, 80 * GIB, "1 x H100", gpu_model="H100")
    plain = make_plan(plan_config("llama-3.1-8b", *LONG, f"data.max_seq_length={seq}"), target, options=QUICK)
    tiled = make_plan(plan_config("llama-3.1-8b", *LONG, f"data.max_seq_length={seq}", "train.tiled_mlp=true"),
                      target, options=QUICK)
    # the MLP's intermediates, [seq, 14336] several times over, now exist for 16 tiles of 4096 tokens at a time
    saved = plain.peak_bytes_per_gpu - tiled.peak_bytes_per_gpu
    assert saved > 3 * seq * 14336 * 2, saved / GIB
    # and the MLP's forward runs again in backward: 2 x its parameters more FLOPs per token, a slower step
    from sft_play.planner.simulate.timing import flops_per_token

    runs = [resolve_for(plan_config("llama-3.1-8b", *LONG, f"data.max_seq_length={seq}", *extra), target, None, shape)
            for extra in ((), ("train.tiled_mlp=true",)) for shape in [model_shape(plan_config("llama-3.1-8b", *LONG))]]
    shape = model_shape(plan_config("llama-3.1-8b", *LONG))
    assert flops_per_token(shape, runs[1]) - flops_per_token(shape, runs[0]) == 2 * shape.params_by_kind["mlp"]
    assert tiled.time["seconds_per_step"] > plain.time["seconds_per_step"]


def test_131k_tokens_of_llama_8b_lora_fit_one_80_gib_gpu_with_the_levers_the_remedies_name():
    """Issue 45's table: at 131,072 tokens nothing offered fit but halving the sequence."""
    # as the issue planned it: LoRA r16, checkpointing, packed rows under SDPA
    config = plan_config("llama-3.1-8b", "finetune.method=lora", "lora.modules_to_save=[]", "data.max_seq_length=131072",
                         "train.global_batch_size=8", "train.gradient_checkpointing=true")
    plan = make_plan(config, Target(1, 80 * GIB, "1 x H100", gpu_model="H100"))
    assert not plan.fits
    fitting = [r for r in plan.remedies if r["fits"]]
    assert fitting and "shorter sequences" not in fitting[0]["remedies"], [r["name"] for r in plan.remedies]
    assert set(fitting[0]["remedies"]) & {"tiled MLP", "activation offload", "FlashAttention-2"}
    assert "data.max_seq_length" not in " ".join(fitting[0]["change"])


def test_sequence_parallel_auto_passes_over_a_size_that_cannot_fit_after_one_replay(monkeypatch):
    """``sequence_parallel: auto`` tries 1, 2, 4, 8 processes a row; a size whose micro-batch 1
    does not fit at its own length (a power of two, which the envelope covers) is passed over
    without the shorter rows' traces and replays, and the plan is the one that settles every size."""
    from sft_play.planner import plan as planning
    from sft_play.planner.simulate import predict

    config = plan_config("llama-3.2-3b", "finetune.method=lora", "data.max_seq_length=32768",
                         "train.global_batch_size=8", "train.gradient_checkpointing=true",
                         "distributed.strategy=deepspeed_zero3", "distributed.sequence_parallel=auto")
    gpus = Target(8, 8 * GIB, "8 x H100", gpu_model="H100")
    traced: dict[int, set[int]] = {}
    real_trace, real_fit = predict.layer_trace, planning._fit
    monkeypatch.setattr(predict, "layer_trace", lambda spec, tokens, batched=True: traced.setdefault(
        spec.sequence_parallel, set()).add(tokens) or real_trace(spec, tokens, batched))
    monkeypatch.setattr(predict, "_CACHE", {})
    passed_over = make_plan(config, gpus, options=WITHOUT_REMEDIES)
    assert any("distributed.sequence_parallel=auto: 4 (the fewest" in note for note in passed_over.notes)
    assert traced[1] == {32768} and traced[2] == {16384}  # micro-batch 1 at the size's own share of the row
    assert {256 // 4, 512 // 4} <= traced[4]  # the chosen size's envelope: every shorter octave
    monkeypatch.setattr(planning, "_fit", lambda *args, settle=True: real_fit(*args))
    settled = make_plan(config, gpus, options=WITHOUT_REMEDIES)
    assert dataclasses.asdict(passed_over) | {"plan_seconds": 0, "plan_cpu_seconds": 0, "replays": 0} == \
        dataclasses.asdict(settled) | {"plan_seconds": 0, "plan_cpu_seconds": 0, "replays": 0}
    assert passed_over.replays < settled.replays


def test_the_longest_rows_question_answers_with_lengths_that_fit_and_next_ones_that_do_not(monkeypatch):
    """make plan LONGEST=1: each set of levers adds one to the ones before; its answer fits one row
    per GPU as the run plans it, the next length of the ladder does not, and more levers never
    answer shorter."""
    from sft_play.planner.choose import longest
    from sft_play.planner.choose import remedies as catalogue

    # checkpointing and a mask-free kernel already on; of the levers left, Liger's kernels, tiling
    # and offload (parameter offload, sequence parallelism: below, without planning)
    config = plan_config("qwen2.5-0.5b", "finetune.method=lora", "lora.modules_to_save=[]",
                         "train.gradient_checkpointing=true", "model.attn_implementation=flex_attention")
    target = Target(1, 2.5 * GIB, "1 x 2.5 GiB", gpu_model="L4")  # answers of 2k-8k tokens: fewer lengths traced
    # on one GPU ZeRO-3 alone before parameter offload: DeepSpeed computes in bf16 adapters where peft
    # keeps fp32 ones, which is most of what parameter offload was credited with
    assert [r.name for r in catalogue.long_row_levers(config, target)] == ["Liger kernels", "tiled MLP", "activation offload",
                                                                "ZeRO-3", "parameter offload"]
    eight = Target(8, 80 * GIB, "8 x H100", gpu_model="H100")
    assert "sequence parallelism" not in [r.name for r in catalogue.long_row_levers(config, eight, split=2)]  # flex attention
    sdpa = plan_config("qwen2.5-0.5b", "finetune.method=lora", "lora.modules_to_save=[]")
    levers = catalogue.long_row_levers(sdpa, eight, split=2)
    assert [r.name for r in levers] == ["ZeRO-3", "gradient checkpointing", "FlashAttention-2", "Liger kernels",
                                        "tiled MLP", "activation offload", "sequence parallelism", "parameter offload"]
    assert levers[6].overrides == ("distributed.sequence_parallel=2",)
    monkeypatch.setattr(catalogue, "LEVERS", ("tiled MLP", "activation offload"))  # planned: two of them

    def plan_for(changed, on):
        return make_plan(changed, on, None, options=WITHOUT_REMEDIES)

    answers = longest.longest_rows(config, target, plan_for, 32768, "c.yaml")
    assert [a["settings"] for a in answers] == ["as configured", "+ tiled MLP", "+ activation offload"]
    tokens = [a["tokens"] for a in answers]
    assert tokens == sorted(tokens) and tokens[0] > 0 and tokens[-1] > 2 * tokens[0], tokens
    ladder = longest.ladder()
    for answer in answers:
        assert answer["next_tokens"] == ladder[ladder.index(answer["tokens"]) + 1]
        changed = [*answer["change"]]
        fits = plan_for(longest._with(config, tuple(changed), answer["tokens"], 1), target)
        beyond = plan_for(longest._with(config, tuple(changed), answer["next_tokens"], 1), target)
        assert fits.fits and not beyond.fits
        assert f"data.max_seq_length={answer['tokens']}" in answer["command"]
    assert answers[-1]["host_bytes_per_node"] > 0  # offloaded hidden states
    assert "train.offload_activations=true" in answers[-1]["command"]
    # each answer with the command that trains it and the make plan that plans it (one run: line was
    # printed, the last lever's, though each was promised)
    lines = longest.describe(answers, target, 32768, "c.yaml", (), "VRAM_GIB=2.5")
    runs = [line for line in lines if line.startswith("      run:  make train CONFIG=c.yaml")]
    plans = [line[len("      plan: "):] for line in lines if line.startswith("      plan: ")]
    assert len(runs) == len(plans) == len(answers) == 3
    changes = " ".join([*answers[-1]["change"], f"data.max_seq_length={answers[-1]['tokens']}"])
    assert plans[-1] == f'make plan CONFIG=c.yaml NUM_GPUS=1 VRAM_GIB=2.5 ARGS="{changes}"'
    # and a plain plan at the longest length, without the levers, finds a remedy that fits
    plain = make_plan(longest._with(config, (), answers[-1]["tokens"], 1), target)
    assert not plain.fits
    assert any(r["fits"] and r["result"] != catalogue.CHANGED for r in plain.remedies), [r["name"] for r in plain.remedies]


def test_the_longest_rows_commands_run_past_the_models_positions_and_plan_this_cpu_as_make_plan_does():
    """The answers past the model's trained positions printed commands a run refuses (without
    data.beyond_model_positions=true), and on a machine without a GPU a `make plan NUM_GPUS=1` that
    asks for a GPU's memory there."""
    from types import SimpleNamespace

    from sft_play.planner.choose import longest

    answer = {"settings": "as configured", "change": [], "tokens": 40960, "next_tokens": 49152,
              "peak_bytes": 17 << 30, "host_bytes_per_node": 0, "beyond_positions": True,
              "command": "make train CONFIG=c.yaml"}
    this_cpu = SimpleNamespace(device_name="CPU", world_size=1, on_cuda=False)
    plan_line = next(line for line in longest.describe([answer], this_cpu, 512, "c.yaml") if "plan:" in line)
    assert plan_line.endswith('make plan CONFIG=c.yaml ARGS="data.max_seq_length=40960 data.beyond_model_positions=true"')
    gpu = SimpleNamespace(device_name="1 x H100", world_size=1, on_cuda=True)
    plan_line = next(line for line in longest.describe([answer], gpu, 512, "c.yaml", (), "VRAM_GIB=80") if "plan:" in line)
    assert "make plan CONFIG=c.yaml NUM_GPUS=1 VRAM_GIB=80 " in plan_line
    assert longest.length_overrides({**answer, "beyond_positions": False}) == ["data.max_seq_length=40960"]


def test_the_ladder_has_four_lengths_an_octave():
    from sft_play.planner.choose.longest import ladder

    assert ladder()[:6] == [1024, 1280, 1536, 1792, 2048, 2560]
    assert 131072 in ladder() and 524288 in ladder() and ladder()[-1] == 16 << 20


def test_offload_is_checked_against_the_nodes_host_memory():
    config = plan_config("llama-3.1-8b", *LONG, "data.max_seq_length=131072", "train.offload_activations=true")
    roomy = make_plan(config, Target(1, 80 * GIB, "1 x H100", gpu_model="H100", host_bytes=256 * GIB),
                      options=WITHOUT_REMEDIES)
    assert roomy.fits and roomy.host_bytes_per_node == 34 * 131072 * 4096 * 2
    small = make_plan(config, Target(1, 80 * GIB, "1 x H100", gpu_model="H100", host_bytes=16 * GIB),
                      options=WITHOUT_REMEDIES)
    assert not small.fits
    assert "the node needs 34.0 GiB of host memory for this run and has 16.0 GiB available" in small.warnings


def test_one_process_and_zero3_plan_the_same_row_alike_but_for_the_adapters_dtype(monkeypatch):
    """The same 131k-token LoRA row planned 16.1 hidden states a token of backward working set
    under one process and 12.6 under ZeRO-3, which moves weights, not activations. The whole
    difference is the adapters' dtype: peft keeps them in fp32 under one process and casts each
    adapted linear's input to fp32; DeepSpeed computes in bf16 adapters (fp32 masters in its
    optimizer). With the adapters' dtype the same, the activations are the same."""
    import sft_play.planner.plan as planning

    overrides = ("finetune.method=lora", "lora.dropout=0", "train.gradient_checkpointing=true",
                 "data.max_seq_length=4096", "train.micro_batch_size=1", "train.global_batch_size=1")
    target = Target(1, 80 * GIB, "1 x H100", gpu_model="H100")

    def working(*more: str) -> int:
        plan = make_plan(plan_config("qwen2.5-0.5b", *overrides, *more), target, options=QUICK)
        return plan.breakdown["backward_working"] + plan.breakdown["activations"]

    alone, zero3 = working(), working("distributed.strategy=deepspeed_zero3")
    assert alone > zero3  # fp32 adapters: the inputs' fp32 copies
    resolved = planning.resolve
    monkeypatch.setattr(planning, "resolve", lambda *a, **k: dataclasses.replace(resolved(*a, **k),
                                                                                  adapter_dtype="bfloat16"))
    assert working() == zero3
