"""Mixture-of-experts and hybrid models (convolution, Mamba-2, linear attention): planned
without a traceback, counted exactly, and trained from the training entry on the CPU.

The tiny configs under tests/fixtures/model_configs/tiny-* use the embedded tokenizer's 512
tokens; the public-shaped ones (mixtral-8x7b, qwen3-30b-a3b) are written from the published
config.json fields and counted by transformers on the meta device."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from sft_play import checkpoints
from sft_play import config as config_module
from sft_play.architecture import build_meta_model, load_model_config
from sft_play.planner import WITHOUT_REMEDIES, Target, make_plan, resolve_for
from tests.conftest import FIXTURES, PINNED, REPO, run_scripts_together
from tests.test_distributed import TINY as TWO_RANKS
from tests.test_distributed import check_two_rank_run, rows_seen

GIB = 1024**3
MOE = ("tiny-qwen3-moe", "tiny-mixtral")
HYBRID = ("tiny-lfm2", "tiny-bamba", "tiny-qwen3-next")


def load(model: str, *overrides: str):
    return config_module.load(REPO / "configs" / "run_tiny.yaml", [
        f"model.name_or_path={FIXTURES / 'model_configs' / model}", "model.tokenizer_name_or_path=configs/tiny_model",
        *overrides], check_paths=False)


@pytest.mark.parametrize("model, method", [(model, "lora") for model in MOE + HYBRID]
                         + [("tiny-qwen3-moe", "full"), ("tiny-bamba", "qlora")])
def test_tiny_moe_and_hybrid_models_plan_by_their_own_layers(model, method):
    config = load(model, f"finetune.method={method}")
    plan = make_plan(config, Target(1, 80 * GIB, "1 x H100"))
    assert plan.fits and plan.micro_batch_size >= 1
    assert not [w for w in plan.warnings if "could not be traced" in w]  # traced, not stood in for
    meta = build_meta_model(load_model_config(config.model.name_or_path))
    assert plan.total_params == sum(p.numel() for p in meta.parameters())


@pytest.mark.parametrize("model", MOE + HYBRID)
def test_the_final_norm_is_traced_whatever_the_family_calls_it(model):
    """The norm after the last layer keeps its input and output for backward: LFM2 calls it
    ``embedding_norm`` (untraced, its CPU step's peak was 1.8 % over the plan)."""
    from sft_play.planner.simulate import trace

    _, norm, _, _ = trace._prepared_layer(trace.TraceSpec(str(FIXTURES / "model_configs" / model), None, False, "lora",
                                                          "float32", "float32", None, "sdpa", False, True, None, False))
    assert norm is not None and type(norm).__name__.endswith("RMSNorm")


def test_moe_plans_report_active_parameters_and_the_experts_kernel():
    gpu = make_plan(load("tiny-qwen3-moe", "finetune.method=lora"), Target(1, 80 * GIB, "1 x H100"))
    # 8 experts, 2 per token: a token skips 6/8 of the 1,179,648 expert parameters
    assert gpu.active_params == gpu.total_params - 1_179_648 * 6 // 8
    assert gpu.experts == "8 routed, 2 per token, grouped_mm kernel"
    config = load("tiny-qwen3-moe", "finetune.method=full")
    cpu = resolve_for(config, Target(1, 8 * GIB, "CPU", bf16_supported=False, on_cuda=False))
    assert cpu.kernels.experts == "grouped_mm"  # torch's CPU kernel takes fp32: the path the planner traces
    full_gpu = resolve_for(config, Target(1, 80 * GIB, "1 x H100"))
    assert full_gpu.kernels.experts == "eager"  # fp32 masters: torch's grouped GEMM takes bf16 only
    assert make_plan(config, Target(1, 80 * GIB, "1 x H100")).experts == "8 routed, 2 per token, per-expert loop (eager)"
    dense = resolve_for(load("tiny-llama-256"), Target(1, 80 * GIB, "1 x H100"))
    assert dense.kernels.experts is None
    qlora = make_plan(load("tiny-mixtral", "finetune.method=qlora"), Target(1, 80 * GIB, "1 x H100"))
    assert any("fused experts" in note for note in qlora.notes)


# Published shapes, counted by hand from their config.json fields:
# Mixtral-8x7B: 32 layers x (attention 41,943,040 + experts 8 x 3 x 4096 x 14336 + router 32,768 + norms 8,192)
#   + embeddings and head 2 x 32000 x 4096 + final norm 4096
# Qwen3-30B-A3B: 48 layers x (attention 18,874,624 incl. q/k norms + experts 128 x 3 x 2048 x 768
#   + router 262,144 + norms 4,096) + 2 x 151936 x 2048 + 2048
PUBLISHED = {"mixtral-8x7b": (46_702_792_704, 8, 2), "qwen3-30b-a3b": (30_532_122_624, 128, 8)}


@pytest.mark.parametrize("model", sorted(PUBLISHED))
@pytest.mark.parametrize("method, gpus", [("full", 1), ("lora", 8), ("qlora", 8)])
def test_public_moe_shapes_plan_or_say_what_would_fit(model, method, gpus):
    total, routed, per_token = PUBLISHED[model]
    config = config_module.load(None, [f"model.name_or_path={FIXTURES / 'model_configs' / model}",
                                       f"finetune.method={method}", "data.max_seq_length=2048",
                                       "train.global_batch_size=8"], check_paths=False)
    plan = make_plan(config, Target(gpus, 80 * GIB, f"{gpus} x H100"))
    assert plan.total_params == total
    assert plan.experts.startswith(f"{routed} routed, {per_token} per token")
    assert plan.active_params < total // 3
    assert plan.fits or plan.remedies or plan.smallest_hardware


def test_the_planner_stands_in_for_a_layer_it_cannot_trace(monkeypatch):
    from sft_play.planner.simulate import predict as prediction
    from sft_play.planner.simulate import trace

    real = trace.layer_trace

    def fails_on_the_real_layer(spec, seq_len, batched=True):
        if not spec.stand_in:
            raise RuntimeError("an op the tracer does not know")
        return real(spec, seq_len, batched)

    monkeypatch.setattr(prediction, "layer_trace", fails_on_the_real_layer)
    monkeypatch.setattr(prediction, "_CACHE", {})
    monkeypatch.setattr(prediction, "_UNTRACEABLE", {})
    plan = make_plan(load("tiny-qwen3-moe", "finetune.method=lora"), Target(1, 80 * GIB, "1 x H100"))
    assert plan.fits
    assert any("could not be traced (RuntimeError: an op the tracer does not know)" in w for w in plan.warnings)
    # said too where the weights and what lives outside the allocator alone exceed the budget
    beyond = make_plan(load("tiny-qwen3-moe", "finetune.method=lora"), Target(1, 0.75 * GIB, "1 x 0.75 GiB"),
                       options=WITHOUT_REMEDIES)
    assert not beyond.fits
    assert any("could not be traced (RuntimeError: an op the tracer does not know)" in w for w in beyond.warnings)


def _train_args(root, model: str, method: str, steps: int = 6) -> tuple:
    return ("train_distributed.py", "--config", "configs/run_tiny.yaml", f"train.output_dir={root}",
            "train.run_name=run", *PINNED, f"finetune.method={method}", f"train.max_steps={steps}",
            "train.logging_steps=2", "train.learning_rate=5e-3", f"model.name_or_path={FIXTURES / 'model_configs' / model}",
            "model.tokenizer_name_or_path=configs/tiny_model")


# The training processes of this module, started together (tests/conftest.run_scripts_together):
# a Qwen3-MoE LoRA run that several tests read, and each family from the entry script...
ENTRY_RUNS = [("tiny-qwen3-moe", "lora"), ("tiny-mixtral", "full"), ("tiny-bamba", "lora"), ("tiny-lfm2", "lora"),
              ("tiny-qwen3-next", "full")]


# ... and a Qwen3-MoE on 2 CPU processes: LoRA under DDP and under ZeRO-3 (the fused experts
# partitioned and gathered), full fine-tuning under FSDP2
DISTRIBUTED_RUNS = [("ddp", "accelerate", "lora"), ("fsdp2", "accelerate", "full"),
                    ("deepspeed_zero3", "torchrun", "lora")]


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-runs")
    commands = [_train_args(root / f"{model}-{method}", model, method) for model, method in ENTRY_RUNS]
    for strategy, launcher, method in DISTRIBUTED_RUNS:
        commands.append(("launch.py", "--launcher", launcher, "--cpu", "--num-gpus", "2", "--config",
                         "configs/run_tiny.yaml", f"train.output_dir={root / strategy}", "train.run_name=run", *TWO_RANKS,
                         f"finetune.method={method}", f"distributed.strategy={strategy}",
                         f"model.name_or_path={FIXTURES / 'model_configs' / 'tiny-qwen3-moe'}",
                         "model.tokenizer_name_or_path=configs/tiny_model"))
    results = run_scripts_together(*commands)
    runs = {}
    for (model, method), result in zip(ENTRY_RUNS + [(strategy, method) for strategy, _, method in DISTRIBUTED_RUNS],
                                       results):
        assert result.returncode == 0, f"{model} {method}:\n" + result.stderr[-3000:]
        assert "Traceback" not in result.stderr
        folder = root / f"{model}-{method}" if (model, method) in ENTRY_RUNS else root / model
        runs[model, method] = (folder / "run", result)
    return runs


@pytest.fixture(scope="module")
def moe_lora_run(moe_runs):
    return moe_runs["tiny-qwen3-moe", "lora"][0]


def _loss_falls(run_dir) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["last_loss"] < summary["first_loss"] - 0.5
    return summary


@pytest.mark.slow
def test_a_tiny_qwen3_moe_trains_with_lora_on_attention_and_experts(moe_lora_run):
    summary = _loss_falls(moe_lora_run)
    recorded = json.loads((moe_lora_run / "run.json").read_text())
    assert recorded["kernels"]["experts"] == "grouped_mm" and recorded["lora"]["dropout"] == 0.0
    adapter = json.loads((moe_lora_run / "model" / "adapter_config.json").read_text())
    assert adapter.get("target_parameters"), "LoRA reaches the fused expert weights"
    assert summary["losses"] and summary["global_step"] == 6


@pytest.mark.slow
def test_the_expert_load_is_logged_per_layer(moe_lora_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(moe_lora_run / "tensorboard"))
    board.Reload()
    tags = board.Tags()["scalars"]
    assert {f"train/expert_load/layer_{i}" for i in range(4)} <= set(tags) and "train/expert_load/max" in tags
    loads = [event.value for event in board.Scalars("train/expert_load/max")]
    assert all(1.0 <= value <= 8 / 2 for value in loads)  # even .. every token to the same 2 of 8 experts


@pytest.mark.slow
@pytest.mark.parametrize("model, method", [("tiny-mixtral", "full"), ("tiny-bamba", "lora"), ("tiny-lfm2", "lora"),
                                           ("tiny-qwen3-next", "full")])
def test_moe_and_hybrid_models_train_from_the_entry_script(moe_runs, model, method):
    _loss_falls(moe_runs[model, method][0])


@pytest.mark.slow
def test_an_moe_model_trains_under_ddp_on_two_processes_like_a_dense_one(moe_runs):
    run_dir, result = moe_runs["ddp", "lora"]
    output = result.stdout + result.stderr
    assert "2 process(es) on 1 node(s), DistributedType.MULTI_CPU" in output
    check_two_rank_run(run_dir, output)  # identical weights, disjoint rows, checkpoints, one report
    recorded = json.loads((run_dir / "run.json").read_text())
    assert recorded["kernels"]["experts"] == "grouped_mm" and recorded["parallel"]["world_size"] == 2
    adapter = json.loads((run_dir / "model" / "adapter_config.json").read_text())
    assert adapter.get("target_parameters"), "LoRA reaches the fused expert weights on every rank"


@pytest.mark.slow
def test_an_moe_model_trains_with_lora_under_zero3_on_two_processes(moe_runs):
    run_dir, result = moe_runs["deepspeed_zero3", "lora"]
    output = result.stdout + result.stderr
    assert "(torchrun, deepspeed_zero3, rendezvous a free loopback port)" in output and "DistributedType.DEEPSPEED" in output
    # loaded partitioned (the training arguments, and DeepSpeed's config, exist before the model loads)
    assert "model loaded under DeepSpeed's zero.Init: each process holds only its partition" in output
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_step"] == 4  # (ranks hold shards: no weights check)
    assert not rows_seen(run_dir, 0) & rows_seen(run_dir, 1), "the ranks saw the same rows"
    assert output.count("Run folder:") == 1 and (run_dir / "model" / "adapter_model.safetensors").is_file()
    for step in (2, 4):
        assert checkpoints.written_by(run_dir / "checkpoints" / f"checkpoint-{step}") == (2, "deepspeed_zero3")
    adapter = json.loads((run_dir / "model" / "adapter_config.json").read_text())
    assert adapter.get("target_parameters"), "LoRA reaches the fused expert weights under ZeRO-3 too"


@pytest.mark.slow
def test_an_moe_model_is_fully_fine_tuned_under_fsdp2_and_saved_whole(moe_runs):
    run_dir, result = moe_runs["fsdp2", "full"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_step"] == 4 and summary["distributed_type"] == "FSDP"
    assert summary["last_loss"] < summary["first_loss"]
    assert checkpoints.written_by(run_dir / "checkpoints" / "checkpoint-4") == (2, "fsdp2")
    # whole tensors, written as transformers saves an MoE (one tensor per expert, as on the hub):
    # every expert of every layer, none of them a shard
    saved = load_file(run_dir / "model" / "model.safetensors")
    config = json.loads((run_dir / "model" / "config.json").read_text())
    for layer in range(config["num_hidden_layers"]):
        for expert in range(config["num_local_experts"]):
            up = saved[f"model.layers.{layer}.mlp.experts.{expert}.up_proj.weight"]
            assert tuple(up.shape) == (config["moe_intermediate_size"], config["hidden_size"])


@pytest.mark.slow
def test_an_moe_run_folder_generates_and_evaluates(moe_lora_run):
    generated, evaluated = run_scripts_together(
        ("generate.py", "--run", str(moe_lora_run), "--max-new-tokens", "6"),
        ("evaluate.py", "--run", str(moe_lora_run), "--count", "2", "--max-new-tokens", "6"))
    assert generated.returncode == 0 and "Traceback" not in generated.stderr, generated.stderr[-3000:]
    assert "after:" in generated.stdout
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    saved = json.loads((moe_lora_run / "eval.json").read_text())
    assert saved["loss"] > 0 and len(saved["generations"]) == 2


@pytest.mark.slow
def test_an_moe_adapter_merges_into_the_fused_experts(moe_lora_run):
    from sft_play import export

    merged_dir = export.merge(moe_lora_run)
    trained, _, _ = export.load_trained(moe_lora_run, device="cpu")
    merged, _, _ = export.load_trained(merged_dir, device="cpu")
    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, trained(input_ids=ids).logits, rtol=1e-4, atol=1e-4)


def test_dora_on_fused_experts_is_one_clear_error_and_dora_on_named_linears_plans():
    from sft_play.errors import UserError

    gpu = Target(1, 80 * 2**30, "1 x 80 GiB")
    with pytest.raises(UserError, match="lora.use_dora=true cannot adapt this mixture-of-experts model's fused expert"):
        make_plan(load("tiny-qwen3-moe", "finetune.method=lora", "lora.use_dora=true"), gpu, options=WITHOUT_REMEDIES)
    named = load("tiny-qwen3-moe", "finetune.method=lora", "lora.use_dora=true", "lora.target_modules=[q_proj,v_proj]")
    assert make_plan(named, gpu, options=WITHOUT_REMEDIES).fits


# Families all-linear left half-adapted or broke (a tiny config of each, as transformers builds it)
_BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=32, max_position_embeddings=512, tie_word_embeddings=False)
FAMILIES = {
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=32,
                    layer_types=["sliding_attention", "full_attention"]),  # experts frozen; sdpa chosen, unsupported
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2),  # experts frozen; TRL's aux loss crashed
    "phimoe": dict(num_local_experts=4, num_experts_per_tok=2),  # its router (a Linear returning a tuple) wrapped
    "llama4_text": dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=128,
                        interleave_moe_layer_step=1),  # its router (a Linear returning a tuple) wrapped
    "jamba": dict(num_experts=4, num_experts_per_tok=2, expert_layer_period=1, expert_layer_offset=0,
                  attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                  use_mamba_kernels=False),  # experts frozen
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64),
    "falcon_h1": dict(mamba_n_heads=2, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=16, mamba_chunk_size=64,
                      mamba_expand=2, mamba_d_ssm=64),  # peft refused its mixers' out_proj: a traceback
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_all_linear_adapts_every_familys_experts_and_leaves_what_peft_cannot_wrap(family, tmp_path):
    from peft import get_peft_model
    from transformers import AutoConfig

    from sft_play.adapters import peft_config
    from sft_play.model import name_the_experts
    from sft_play.planner import model_shape
    from sft_play.run import resolve

    model_config = AutoConfig.for_model(family, **_BASE, **FAMILIES[family])
    model_config.save_pretrained(tmp_path)
    config = config_module.load(None, [f"model.name_or_path={tmp_path}", "finetune.method=lora"], check_paths=False)
    # the adapter as a run resolves it, from the model's config and from the planner's shape alike
    spec = resolve(config, on_cuda=False, bf16_supported=False, world_size=1).lora
    assert resolve(config, on_cuda=False, bf16_supported=False, world_size=1, model_facts=model_shape(config).facts).lora == spec
    model = get_peft_model(build_meta_model(model_config), peft_config(spec, initialise=False), low_cpu_mem_usage=True)
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    fused = [name for name, p in model.named_parameters() if p.ndim == 3 and ".experts." in name]
    for layer in {name.split(".experts.")[0] for name in fused}:  # each fused weight of a layer, its own adapter
        adapters = [t for t in trained if t.startswith(f"{layer}.experts.") and "lora_A" in t]
        assert len(adapters) == len([f for f in fused if f.startswith(f"{layer}.experts.")]), (family, adapters)
    assert bool(fused) == (family != "falcon_h1")
    assert any("attn" in name for name in trained) and not any("router" in name for name in trained)
    from sft_play.architecture import attention_eager_only

    assert attention_eager_only(model_config) == (family == "gpt_oss")  # its attention sinks: no SDPA path
    if family == "granitemoe":
        name_the_experts(model_config)
        assert model_config.num_experts == 4


def test_the_plan_names_the_linears_all_linear_leaves_frozen(tmp_path):
    """DeepSeek's dense first layer and shared experts trained nothing under all-linear, unsaid (peft
    maps the names gate/up/down_proj onto the routed experts' fused weights for that family)."""
    from transformers import AutoConfig

    AutoConfig.for_model("deepseek_v3", **{**_BASE, "head_dim": 16}, n_routed_experts=4, num_experts_per_tok=2,
                         n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1,
                         kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=32,
                         v_head_dim=32).save_pretrained(tmp_path)
    config = config_module.load(None, [f"model.name_or_path={tmp_path}", "finetune.method=lora"], check_paths=False)
    cpu = Target(1, 8 * 2**30, "CPU", bf16_supported=False, on_cuda=False)
    plan = make_plan(config, cpu, None)
    assert any(w.startswith("LoRA all-linear leaves these linears of the layers without an adapter: mlp.down_proj, "
                            "mlp.gate_proj, mlp.shared_experts.down_proj") for w in plan.warnings), plan.warnings
    qwen = config_module.load(None, [f"model.name_or_path={FIXTURES / 'model_configs' / 'tiny-qwen3-moe'}",
                                     "finetune.method=lora"], check_paths=False)
    assert not any("all-linear leaves" in w for w in make_plan(qwen, cpu, None).warnings)
