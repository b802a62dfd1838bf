"""FSDP2 (``distributed.strategy=fsdp2``): checked, planned, launched and trained like DDP and
ZeRO. The processes are real: two CPU ranks over gloo (accelerate applies FSDP only to GPU-type
processes; :func:`sft_play.training.shard_on_cpu` sets its state up on CPU processes the way it
does on GPUs, and ``fully_shard`` itself runs on CPU tensors). The SIGTERM and resume test is in
test_distributed.py, beside DDP's and ZeRO-2's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sft_play import launch, training
from sft_play import config as config_module
from sft_play.errors import UserError
from sft_play.planner.simulate import memory
from sft_play.planner.plan import Target, make_plan
from sft_play.planner.simulate.shapes import model_shape
from sft_play.planner.simulate.timing import gradient_traffic_bytes
from sft_play.run import BatchSplit, resolve
from sft_play.units import GIB
from tests.conftest import FORKED, LORA, PINNED, REPO, TINY_FULL, with_parallel

CONFIGS = REPO / "tests" / "fixtures" / "model_configs"


def load(*overrides: str):
    return config_module.load(REPO / "configs" / "run_tiny.yaml", [*LORA, *overrides], check_paths=False)


# --- the config says what FSDP2 cannot do ------------------------------------------------------


def test_make_train_without_a_launcher_says_which_target_runs_fsdp2(monkeypatch):
    from sft_play.train import train

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    config = load("distributed.strategy=fsdp2", "finetune.method=full")
    with pytest.raises(UserError, match="make train-distributed CONFIG=configs/run_tiny.yaml"):
        train(config, "configs/run_tiny.yaml")


def test_one_sharded_process_is_still_started_as_distributed():
    topology, _ = launch.resolve_topology(1, None, 1, 0, None, None, True, 0)
    sharded = launch.accelerate_command(topology, "c.yaml", [], sharded=True)
    assert "--use_fsdp" in sharded and "--multi_gpu" not in sharded  # accelerate refuses --multi_gpu for one
    assert "--use_fsdp" not in launch.accelerate_command(topology, "c.yaml", [])


# --- the trainer's arguments come from the run -------------------------------------------------


@pytest.fixture
def process_state():
    """This process's accelerate state, as the training flow forms it before the arguments
    (CPU processes keep it: ``use_configured_state``); reset afterwards."""
    from accelerate import PartialState
    from accelerate.state import AcceleratorState

    PartialState(cpu=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def arguments(tmp_path, *overrides: str, on_cuda: bool = False, bf16: bool = False):
    config = load("distributed.strategy=fsdp2", "lora.modules_to_save=[embed_tokens]", *overrides)
    run = resolve(config, on_cuda=on_cuda, bf16_supported=bf16, world_size=2).with_changes(
        batch=BatchSplit(2, 2, 2, 8))
    return run, training.trainer_arguments(config, run, tmp_path, False, layer_classes=["LlamaDecoderLayer"])


def test_fsdp2_arguments_follow_the_run(tmp_path, process_state):
    run, args = arguments(tmp_path, "train.gradient_checkpointing=true", "train.mixed_precision=no",
                          "lora.dropout=0")
    plugin = args.fsdp_plugin_args
    assert plugin["fsdp_version"] == 2 and plugin["reshard_after_forward"] is True
    assert plugin["transformer_cls_names_to_wrap"] == "LlamaDecoderLayer"
    assert plugin["state_dict_type"] == "SHARDED_STATE_DICT"  # every rank writes its own shard
    # FSDP's own checkpoint wrapper, not transformers' (which would all-gather once more)
    assert plugin["activation_checkpointing"] is True and not args.activation_checkpointing
    assert "mixed_precision_policy" not in plugin  # fp32: nothing to cast
    # each micro-batch reduce-scattered, so only this rank's gradient shard is held
    assert args.accelerator_config.gradient_accumulation_kwargs["sync_each_batch"] is True
    assert training.accelerator_settings(run)["use_configured_state"]  # CPU processes: shard_on_cpu's state
    assert run.placement.fsdp_on_cpu and run.placement.cpu_processes


def test_dropout_keeps_transformers_checkpointing_which_preserves_the_random_state(tmp_path, process_state):
    # accelerate's FSDP checkpoint wrapper does not preserve the random state: a recomputed
    # dropout would draw other masks than the forward did
    run, args = arguments(tmp_path, "train.gradient_checkpointing=true", "train.mixed_precision=no",
                          "lora.dropout=0.05")
    assert not run.fsdp_checkpointing
    assert args.activation_checkpointing and args.activation_checkpointing_kwargs == {"use_reentrant": False}
    assert args.fsdp_plugin_args["activation_checkpointing"] is False


def test_fsdp2_mixed_precision_gathers_in_bf16_and_reduces_in_fp32(tmp_path, process_state):
    import torch
    from accelerate.utils import FullyShardedDataParallelPlugin

    run, args = arguments(tmp_path, "train.mixed_precision=bf16", "distributed.reshard_after_forward=false", bf16=True)
    assert run.precision.mixed == "bf16"
    plugin = FullyShardedDataParallelPlugin(**args.fsdp_plugin_args)  # as the trainer builds it
    policy = plugin.mixed_precision_policy
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (torch.bfloat16, torch.float32,
                                                                              torch.bfloat16)
    assert args.fsdp_plugin_args["reshard_after_forward"] is False
    # QLoRA gathers in the packed weights' storage dtype: a cast by value would destroy them
    qlora = resolve(load("distributed.strategy=fsdp2", "lora.modules_to_save=[]", "finetune.method=qlora",
                         "quantization.quant_storage=float32", "train.mixed_precision=bf16"),
                    on_cuda=True, bf16_supported=True, world_size=2)
    assert training.fsdp_mixed_precision(qlora, "float32")["param_dtype"] == torch.float32
    # on GPUs accelerate forms the state itself
    config = load("distributed.strategy=fsdp2", "lora.modules_to_save=[embed_tokens]")
    gpu = resolve(config, on_cuda=True, bf16_supported=True, world_size=8)
    assert not gpu.placement.fsdp_on_cpu and "use_configured_state" not in training.accelerator_settings(gpu)
    assert gpu.placement.backend is None  # accelerate's NCCL
    offloaded = resolve(load("distributed.strategy=fsdp2", "lora.modules_to_save=[embed_tokens]",
                             "distributed.offload_parameters=true"), on_cuda=True, bf16_supported=True, world_size=8)
    # offloaded gradients are CPU tensors: clipping's all-reduce of their norm needs gloo beside NCCL
    assert offloaded.placement.backend == "cuda:nccl,cpu:gloo"


# --- planned: what each GPU holds, what it sends, and the remedy -------------------------------


def full_14b(*overrides: str):
    return config_module.load(None, [f"model.name_or_path={CONFIGS / 'qwen2.5-14b'}", "finetune.method=full",
                                     "train.global_batch_size=64", "data.max_seq_length=2048", *overrides],
                              check_paths=False)


def test_fsdp2_holds_one_world_th_of_the_model_state_and_gathered_layers():
    config = full_14b("distributed.strategy=fsdp2")
    shape = model_shape(config)
    run = resolve(config, on_cuda=True, bf16_supported=True, world_size=8, model_facts=shape.facts)
    n = shape.trainable_params
    assert memory.trainable_bytes(run) == 4  # accelerate upcasts the trainable parameters to fp32 before sharding
    assert memory.gradient_bytes(shape, run) == n * 4 // 8
    assert memory.optimizer_state_bytes(shape, run) == n * 8 // 8
    assert memory.master_weights_bytes(shape, run) == 0  # the fp32 shards are the masters
    assert memory.ddp_bucket_bytes(shape, run) == 0 and memory.zero_buffer_bytes(shape, run) == 0
    layer = memory.largest_layer_params(shape)
    # accelerate's tail unit: the head and the final norm (the untied embedding is a unit of its own,
    # gathered around its passes only); untied, it is resharded before the layers' backward gathers
    # two of them, the most at once
    tail = shape.params_by_kind["lm_head"] + shape.hidden_size
    assert sum(memory.fsdp_step_gathered_tensors(shape)) == tail and not shape.tie_word_embeddings
    assert memory.weights_bytes(shape, run) == n * 4 // 8 + 2 * layer * 2  # shards + bf16 gathers
    kept = with_parallel(run, reshard_after_forward=False)
    assert memory.weights_bytes(shape, kept) == n * 4 // 8 + (shape.num_layers * layer + tail) * 2
    offloaded = with_parallel(run, offload_parameters=True)
    assert memory.weights_bytes(shape, offloaded) == 2 * layer * 2
    assert memory.gradient_bytes(shape, offloaded) == memory.optimizer_state_bytes(shape, offloaded) == 0
    assert 0 < memory.fsdp_buffer_bytes(shape, run) < layer * 8


@pytest.mark.parametrize("model, tied", [("qwen2.5-14b", False), ("qwen2.5-0.5b", True)])
def test_fsdp2s_lower_bound_stays_under_the_replayed_peak(model, tied):
    """The planner prunes what its lower bound puts over the budget before any replay: with the tail
    unit gathered by pass (untied: resharded before the layers' backward), the weights it counts
    must all be alive at once in the replay, short rows or long, offloaded or not (LoRA on rows of 16
    tokens: the untied head is most of what the step adds to its weights)."""
    from sft_play.planner.simulate.predict import predict, static_lower_bound

    for method, seq, offload in (("lora", 16, False), ("full", 256, False), ("full", 4096, False), ("full", 256, True)):
        config = config_module.load(None, [f"model.name_or_path={CONFIGS / model}", f"finetune.method={method}",
                                           "distributed.strategy=fsdp2", f"data.max_seq_length={seq}",
                                           "train.global_batch_size=8"], check_paths=False)
        shape = model_shape(config)
        assert shape.tie_word_embeddings is tied
        run = resolve(config, on_cuda=True, bf16_supported=True, world_size=8, model_facts=shape.facts)
        run = with_parallel(run, offload_parameters=offload).with_changes(batch=BatchSplit(1, 1, 8, 8))
        assert static_lower_bound(shape, run) <= predict(shape, run, 1).peak_bytes, (method, seq, offload)


def test_a_sharded_run_is_planned_with_the_whole_model_every_gpu_loads_before_sharding():
    """sft_play.model.load_model places the whole model on every GPU and accelerate's
    fsdp2_prepare_model shards it as training starts, its state dict holding the whole tensors
    until the last shard is made: Llama-3-70B LoRA's start (the whole model and its shards at once)
    does not fit two 80 GiB GPUs. Full fine-tuning loaded in bf16 is upcast to fp32 first; ZeRO-3 loads under
    zero.Init and has no such start, except for QLoRA."""
    from sft_play.planner import WITHOUT_REMEDIES

    def planned(model: str, gpus: int, *overrides: str):
        config = config_module.load(None, [f"model.name_or_path={CONFIGS / model}", "train.global_batch_size=8",
                                           "train.gradient_checkpointing=true", "data.max_seq_length=2048",
                                           *overrides], check_paths=False)
        return model_shape(config), make_plan(config, Target(gpus, 80 * GIB, f"{gpus} x H100", gpu_model="H100"),
                                              options=WITHOUT_REMEDIES)

    from sft_play.planner.simulate.loading import replay_start
    from sft_play.run import resolve

    def resolved(shape, gpus: int, *overrides: str):
        config = config_module.load(None, [f"model.name_or_path={CONFIGS / 'llama-3-70b'}", *overrides],
                                    check_paths=False)
        return resolve(config, on_cuda=True, bf16_supported=True, world_size=gpus, model_facts=shape.facts)

    shape, plan = planned("llama-3-70b", 2, "finetune.method=lora", "distributed.strategy=fsdp2")
    whole = shape.total_params * 2 + shape.lora_params * 4  # bf16 base, fp32 adapters (not upcast)
    assert not plan.fits and plan.breakdown["loading"] == pytest.approx(whole, rel=1e-3)
    run = resolved(shape, 2, "finetune.method=lora", "distributed.strategy=fsdp2")
    # every shard made before the whole tensors are freed
    assert replay_start(shape, run, on_cuda=False).at_peak_allocated == {"loading": whole, "weights": whole // 2}
    _, zero3 = planned("llama-3-70b", 2, "finetune.method=lora", "distributed.strategy=deepspeed_zero3")
    assert "loading" not in zero3.breakdown  # loaded under zero.Init
    assert replay_start(shape, resolved(shape, 2, "finetune.method=lora", "distributed.strategy=deepspeed_zero3"),
                        on_cuda=True) is None
    # QLoRA under ZeRO-3 loads outside zero.Init, the packed model whole on each GPU, partitioned
    # by DeepSpeed one parameter at a time
    qlora = resolved(shape, 2, "finetune.method=qlora", "distributed.strategy=deepspeed_zero3",
                     "quantization.quant_storage=bfloat16")
    start = replay_start(shape, qlora, on_cuda=False)
    loaded = [size for size, _ in memory.loaded_tensors(shape, qlora)]
    # the most at once: every tensor whole and the first one's partition
    assert start.peak_allocated == sum(int(size) for size in loaded) + int(loaded[0] / 2)
    assert sum(loaded) > 36 * GIB  # the packed 70B: no 24 GiB GPU starts it
    shape, plan = planned("qwen2.5-0.5b", 8, "finetune.method=full", "distributed.strategy=fsdp2",
                          "model.torch_dtype=bfloat16")
    assert plan.fits and plan.breakdown["loading"] == pytest.approx(shape.total_params * 4, rel=1e-2)  # its start is its peak
    config = config_module.load(None, [f"model.name_or_path={CONFIGS / 'qwen2.5-0.5b'}", "finetune.method=full",
                                       "distributed.strategy=fsdp2", "model.torch_dtype=bfloat16"], check_paths=False)
    run = resolve(config, on_cuda=True, bf16_supported=True, world_size=8, model_facts=shape.facts)
    assert run.precision.weight_bytes == 2 and run.precision.autocast
    start = replay_start(shape, run, on_cuda=False)
    # upcast to fp32 one tensor at a time (the bf16 one freed), then an eighth of each as its shard
    assert start.at_peak_allocated == {"loading": shape.total_params * 4, "weights": shape.total_params * 4 // 8}
    # DPO's reference copy, loaded whole after the policy in the compute dtype, sharded by TRL's one
    # fully_shard call, which frees the whole tensors only as it returns
    dpo = config_module.load(REPO / "configs" / "run_tiny_dpo.yaml", [
        f"model.name_or_path={CONFIGS / 'qwen2.5-0.5b'}", "model.build_with=null", "finetune.method=full",
        "preference.reference=copy", "distributed.strategy=fsdp2"], check_paths=False)
    run = resolve(dpo, on_cuda=True, bf16_supported=True, world_size=8, model_facts=shape.facts)
    policy, reference = shape.total_params * 4, shape.total_params * 2  # fp32 masters; bf16 copy
    assert replay_start(shape, run, on_cuda=False).at_peak_allocated == {"loading": policy + reference,
                                                                         "reference": reference // 8}


def test_a_reference_pass_under_fsdp2_scores_with_the_whole_model_as_loaded():
    """TRL scores the pairs (``preference.reference: precomputed``) as its trainer is built, before
    accelerate shards the policy: under FSDP2 the pass holds the whole model as loaded (the bf16 base
    and the adapters), not the shards and two gathered layers of a training step."""
    from sft_play.planner.simulate import predict

    config = config_module.load(REPO / "configs" / "run_tiny_dpo.yaml", [
        f"model.name_or_path={CONFIGS / 'llama-3.1-8b'}", "model.build_with=null", "finetune.method=lora",
        "preference.reference=precomputed", "preference.precompute_batch_size=8", "distributed.strategy=fsdp2",
        "data.max_seq_length=512"], check_paths=False)
    shape = model_shape(config)
    run = resolve(config, on_cuda=True, bf16_supported=True, world_size=8, model_facts=shape.facts)
    scored = predict.reference_pass(shape, run.with_changes(batch=BatchSplit(1, 1, 8, 8)), 1, None)
    whole = sum(size for size, _ in memory.loaded_tensors(shape, run))
    assert whole == shape.total_params * 2 + shape.lora_params * 4
    assert scored.at_peak_allocated["weights"] == whole


@pytest.mark.slow
def test_an_fsdp2_start_on_two_processes_holds_what_its_replay_holds():
    """PyTorch's count of the bytes alive from before the model loads until the first step, on
    each of two gloo ranks of an FSDP2 full fine-tune (bench/cpu_ground_truth.py's start cell),
    against the planner's replay of that start: the whole model and every shard at once."""
    from sft_play.launch.tensorboard import free_port

    cell = {"method": "full", "checkpointing": True, "micro": 2, "seq": 128, "strategy": "fsdp2", "start": True}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                             "127.0.0.1", "--master-port", str(free_port(host="127.0.0.1")), "bench/cpu_ground_truth.py", "--worker",
                             json.dumps(cell)], cwd=REPO, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    ranks = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(ranks) == 2, result.stderr[-3000:]
    for rank in ranks:
        assert rank["predicted_bytes"] == pytest.approx(rank["measured_bytes"], rel=0.01), rank


def test_fsdp2_communicates_every_micro_batch():
    config = full_14b("distributed.strategy=fsdp2")
    shape = model_shape(config)
    run = resolve(config, on_cuda=True, bf16_supported=True, world_size=8, model_facts=shape.facts)
    one = gradient_traffic_bytes(shape, run, 1)
    # all-gathers for forward and backward in bf16, the reduce-scatter in fp32, 7/8 of each
    assert one == pytest.approx(7 / 8 * (2 * 2 * shape.total_params + 4 * shape.trainable_params))
    assert gradient_traffic_bytes(shape, run, 4) == pytest.approx(4 * one)
    once = gradient_traffic_bytes(shape, with_parallel(run, reshard_after_forward=False), 1)
    assert once == pytest.approx(7 / 8 * (2 * shape.total_params + 4 * shape.trainable_params))


def test_zero_communicates_every_micro_batch_and_zero3_gathers_the_parameters():
    """ZeRO-3's parameter gathers were not counted (a quarter of FSDP2's traffic for the same
    weights), nor ZeRO's reduce-scatter after every micro-batch."""
    zero3 = full_14b("distributed.strategy=deepspeed_zero3")
    shape = model_shape(zero3)
    run = resolve(zero3, on_cuda=True, bf16_supported=True, world_size=8, model_facts=shape.facts)
    one = gradient_traffic_bytes(shape, run, 1)
    assert one == pytest.approx(7 / 8 * (2 * 2 * shape.total_params + 2 * shape.trainable_params))
    assert gradient_traffic_bytes(shape, run, 4) == pytest.approx(4 * one)
    zero2 = full_14b("distributed.strategy=deepspeed_zero2")
    run = resolve(zero2, on_cuda=True, bf16_supported=True, world_size=8, model_facts=shape.facts)
    # the gradients reduce-scattered once per micro-batch, the updated parameters gathered once per step
    assert gradient_traffic_bytes(shape, run, 4) == pytest.approx(7 / 8 * (4 + 1) * 2 * shape.trainable_params)


def test_a_14b_full_fine_tune_on_8_gpus_is_offered_fsdp2_and_zero3_with_their_commands():
    plan = make_plan(full_14b("train.global_batch_size=8"), Target(8, 80 * GIB, "8 x H100"))
    assert not plan.fits  # DDP replicates 14.8 B fp32 parameters with their states
    remedies = {r["name"]: r for r in plan.remedies}
    fsdp, zero3 = remedies["FSDP2"], remedies["ZeRO-3"]
    assert fsdp["fits"] and zero3["fits"], remedies
    assert fsdp["command"].startswith("make train-distributed NUM_GPUS=8")
    assert fsdp["command"].endswith('distributed.strategy=fsdp2"')
    assert zero3["command"].startswith("make train-deepspeed NUM_GPUS=8")
    # the same model state per GPU, 16 bytes a parameter over 8: FSDP2's fp32 shard, gradient and
    # Adam's two states; ZeRO-3's 16-bit shard and gradient partition, fp32 master and Adam's states
    shape = model_shape(full_14b())
    runs = {name: resolve(full_14b(f"distributed.strategy={name}"), on_cuda=True, bf16_supported=True, world_size=8,
                          model_facts=shape.facts) for name in ("fsdp2", "deepspeed_zero3")}
    state = {name: shape.total_params * memory.stored_bytes(run) // 8 + memory.gradient_bytes(shape, run)
             + memory.master_weights_bytes(shape, run) + memory.optimizer_state_bytes(shape, run)
             for name, run in runs.items()}
    assert state["fsdp2"] == state["deepspeed_zero3"] == shape.total_params * 16 // 8
    assert fsdp["peak_bytes"] < plan.peak_bytes_per_gpu / 4 and zero3["peak_bytes"] < plan.peak_bytes_per_gpu / 4


# --- trained by real processes ------------------------------------------------------------------

@pytest.fixture(scope="module")
def fsdp2_full_run(tmp_path_factory):
    """The shared full fine-tuning run's settings (tiny_full_run: one process, micro-batch 8),
    under FSDP2 on two ranks of 4 rows: the same 8 rows in each step, the same seed."""
    root = tmp_path_factory.mktemp("fsdp2-full")
    arguments = " ".join([*PINNED, *TINY_FULL, "train.micro_batch_size=4", "distributed.strategy=fsdp2",
                          f"train.output_dir={root}", "train.run_name=full"])
    result = subprocess.run(["make", "--no-print-directory", "train-distributed", "CPU=1", "NUM_GPUS=2",
                             f"ARGS={arguments}"], cwd=REPO, capture_output=True, text=True, timeout=600,
                            env={**os.environ, **FORKED})
    return root / "full", result.stdout + result.stderr, result.returncode


def test_fsdp2_full_fine_tuning_matches_one_process_and_saves_whole_weights(fsdp2_full_run, tiny_full_run):
    """DDP on two ranks gives one process's losses for the same global batch (the DDP runs of
    test_distributed check DDP itself); FSDP2 must too."""
    run_dir, output, status = fsdp2_full_run
    assert status == 0, output[-5000:]
    reference_dir = tiny_full_run[0]
    ours, theirs = (json.loads((d / "summary.json").read_text()) for d in (run_dir, reference_dir))
    assert ours["batch"] == "global 8 = micro 4 x accum 1 x world 2"
    assert ours["distributed_type"] == "FSDP"  # what the trainer's accelerator really ran
    assert len(ours["losses"]) == len(theirs["losses"]) == 3
    for (_, mine), (_, reference) in zip(ours["losses"], theirs["losses"]):
        assert mine == pytest.approx(reference, rel=1e-4)
    from safetensors import safe_open

    with safe_open(str(run_dir / "model" / "model.safetensors"), "pt") as whole, \
            safe_open(str(reference_dir / "model" / "model.safetensors"), "pt") as reference:
        assert set(whole.keys()) == set(reference.keys())
        name = "model.embed_tokens.weight"
        assert whole.get_tensor(name).shape == reference.get_tensor(name).shape  # not a shard
        assert float((whole.get_tensor(name) - reference.get_tensor(name)).abs().max()) < 1e-3
