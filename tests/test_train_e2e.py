"""The real entry script end to end on the embedded default: LoRA (the loss falls, the adapter,
tokenizer and TensorBoard events are written, the adapter reloads), full fine-tuning and QLoRA."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import printed_answers, run_script

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lora_run(tiny_lora_run):
    return tiny_lora_run


def test_lora_run_lowers_the_loss(lora_run):
    run_dir, result = lora_run
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["global_step"] == 24
    assert summary["last_loss"] < 0.7 * summary["first_loss"], summary["losses"]
    assert f"Run folder: {run_dir}" in result.stdout
    assert "global 8 = micro 8 x accum 1 x world 1" in result.stderr


def test_lora_run_writes_adapter_tokenizer_config_and_events(lora_run):
    run_dir, _ = lora_run
    model_dir = run_dir / "model"
    for name in ("adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (model_dir / name).is_file(), name
    assert not list(model_dir.glob("*.bin")), "only safetensors weights are written"
    adapter_config = json.loads((model_dir / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == "configs/tiny_model"
    assert adapter_config["r"] == 32
    from sft_play import config as config_module

    saved = config_module.load(run_dir / "config.yaml")
    assert saved.train.run_name == "lora" and saved.train.max_steps == 24

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert events
    accumulator = EventAccumulator(str(run_dir / "tensorboard"))
    accumulator.Reload()
    tags = accumulator.Tags()["scalars"]
    for tag in ("train/loss", "train/learning_rate", "train/grad_norm", "train/train_tokens_per_second"):
        assert tag in tags, tags
    losses = [e.value for e in accumulator.Scalars("train/loss")]
    assert losses[-1] < losses[0]


def test_adapter_reloads_and_changes_the_model(lora_run):
    from sft_play import export

    run_dir, _ = lora_run
    trained, tokenizer, config = export.load_trained(run_dir, device="cpu")
    assert type(trained).__name__ == "PeftModelForCausalLM"
    ids = tokenizer("Reverse the letters: a b c", return_tensors="pt")
    with torch.no_grad():
        after = trained(**ids).logits
        with export.base_model_of(trained, config) as base:
            before = base(**ids).logits
    assert not torch.allclose(after, before)
    answer = export.generate(trained, tokenizer, [{"role": "user", "content": "Reverse the letters: a b c"}], 8)
    # only the reply: no prompt, no template markers, at most the 8 new tokens
    assert answer and "Reverse" not in answer and "<|" not in answer
    assert len(tokenizer(answer, add_special_tokens=False)["input_ids"]) <= 8


def test_generate_script_answers_held_out_prompts(lora_run):
    from sft_play import export

    run_dir, _ = lora_run
    result = run_script("generate.py", "--run", str(run_dir), "--count", "2", "--max-new-tokens", "12")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("prompt:") == 2
    assert "reference:" in result.stdout and "before:" in result.stdout
    # the answers are the trained model's own to the first two held-out prompts, and the score counts them
    model, tokenizer, config = export.load_trained(run_dir, device="cpu")
    prompts = export.held_out_prompts(config, 2)
    expected = [export.generate(model, tokenizer, p, 12) for p in prompts]
    assert printed_answers(result.stdout) == expected
    right = sum(a == p.reference for a, p in zip(expected, prompts))
    assert f"exact matches after training: {right}/2" in result.stdout


def test_full_fine_tuning_runs_and_saves_a_loadable_model(tiny_full_run):
    run_dir, result = tiny_full_run
    assert "planner.calibrate needs a GPU to measure; planning analytically" in result.stderr
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(run_dir / "model")
    assert sum(p.numel() for p in loaded.parameters()) == 918_656  # configs/tiny_model: 4 layers, 128 wide
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["global_step"] == 3 and summary["last_loss"] < summary["first_loss"]


def test_qlora_runs_on_cpu_with_a_4bit_base(tiny_qlora_run):
    run_dir, result = tiny_qlora_run
    assert (run_dir / "model" / "adapter_model.safetensors").is_file()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["global_step"] == 3 and summary["last_loss"] < summary["first_loss"]


def test_bad_config_exits_2_with_the_problems_and_no_traceback(tmp_path):
    result = run_script("train_distributed.py", "--config", "configs/run_tiny.yaml", "train.learning_rat=1",
                        "finetune.method=lorra")
    assert result.returncode == 2
    assert "did you mean 'train.learning_rate'" in result.stderr
    assert "'full', 'lora', 'qlora'" in result.stderr
    assert "Traceback" not in result.stderr


def test_random_weights_are_built_in_the_runs_storage_dtype():
    from sft_play import config as config_module
    from sft_play.precision import init_weights_dtype

    def dtype(*overrides):
        return init_weights_dtype(config_module.load(None, list(overrides), check_paths=False))

    assert dtype("finetune.method=lora") == dtype("finetune.method=qlora") == "bfloat16"
    assert dtype("finetune.method=full") == "float32"  # full fine-tuning trains fp32 masters
    assert dtype("finetune.method=lora", "train.mixed_precision=fp16") == "float16"
    assert dtype("finetune.method=full", "model.torch_dtype=bfloat16") == "bfloat16"


def test_a_config_only_70b_is_refused_before_memory_is_spent(tmp_path, monkeypatch):
    import shutil
    from types import SimpleNamespace

    import psutil

    from sft_play import config as config_module
    from sft_play.errors import UserError
    from sft_play.model import weights_location
    from tests.conftest import FIXTURES

    shutil.copy(FIXTURES / "model_configs" / "llama-3-70b" / "config.json", tmp_path)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=64 * 1024**3))
    config = config_module.load(None, [f"model.name_or_path={tmp_path}", "finetune.method=qlora"], check_paths=False)
    with pytest.raises(UserError, match=r"needs 131\.4 GiB of host memory"):
        weights_location(config)


def test_dora_rslora_and_neftune_train_with_the_parameters_the_planner_counts(tmp_path):
    # DoRA: a trained magnitude per output feature of every adapted linear, besides A and B;
    # rsLoRA: the update scaled by alpha / sqrt(r); NEFTune: noise on the input embeddings in training
    import math

    from safetensors.torch import load_file
    from transformers import TrainerCallback

    from sft_play import config as config_module
    from sft_play import training
    from sft_play.planner import model_shape
    from sft_play.run import BatchSplit
    from tests.conftest import REPO, tiny_trainer_factory

    class Noise(TrainerCallback):
        """Whether the input embeddings add noise during the steps (NEFTune's forward hook)."""

        seen: list = []

        def on_step_end(self, args, state, control, model=None, **kwargs):
            embeddings = model.get_input_embeddings()
            ids = torch.tensor([[5, 6, 7, 8]])
            self.seen.append((args.neftune_noise_alpha, not torch.equal(embeddings(ids), embeddings(ids))))

    overrides = ("lora.use_dora=true", "lora.use_rslora=true", "lora.r=16", "lora.alpha=8", "train.neftune_noise_alpha=5")
    make = tiny_trainer_factory(tmp_path, [Noise()], *overrides)
    trainer, _ = training.train_with_backoff(make, BatchSplit(4, 2, 1, 8))
    assert Noise.seen and all(seen == (5, True) for seen in Noise.seen)
    model = trainer.model
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    planned = model_shape(config_module.load(REPO / "configs" / "run_tiny.yaml", ["finetune.method=lora", *overrides]))
    assert trained == planned.trainable_params
    adapted = [m for m in model.modules() if hasattr(m, "lora_magnitude_vector") and m.lora_magnitude_vector]
    assert adapted and all(m.scaling["default"] == pytest.approx(8 / math.sqrt(16)) for m in adapted)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert losses[-1] < losses[0]
    trainer.save_model(str(tmp_path / "saved"))
    saved = json.loads((tmp_path / "saved" / "adapter_config.json").read_text())
    assert saved["use_dora"] and saved["use_rslora"]
    assert any("lora_magnitude_vector" in key for key in load_file(tmp_path / "saved" / "adapter_model.safetensors"))


def test_loraplus_trains_the_b_matrices_at_their_own_learning_rate(tmp_path):
    """lora.loraplus_lr_ratio: peft's LoRA+ groups in the optimizer the trainer makes (B matrices
    at ratio x the learning rate, A matrices and full copies at it), and the run still learns."""
    from sft_play import training
    from sft_play.run import BatchSplit
    from tests.conftest import tiny_trainer_factory

    make = tiny_trainer_factory(tmp_path, [], "lora.loraplus_lr_ratio=16", "train.learning_rate=1e-3")
    assert make.run.loraplus_lr_ratio == 16
    trainer, _ = training.train_with_backoff(make, BatchSplit(4, 2, 1, 8))
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    rates: dict[str, set] = {"lora_A": set(), "lora_B": set(), "other": set()}
    for group in trainer.optimizer.param_groups:
        for param in group["params"]:
            kind = next((k for k in ("lora_A", "lora_B") if k in names[id(param)]), "other")
            rates[kind].add(group["initial_lr"])
    assert rates == {"lora_A": {1e-3}, "lora_B": {16e-3}, "other": {1e-3}}
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert losses[-1] < losses[0]
    # DeepSpeed's optimizer offload builds its own optimizer, without the groups: refused, not ignored
    from sft_play import config as config_module

    with pytest.raises(config_module.ConfigError, match="lora.loraplus_lr_ratio: with distributed.offload_optimizer"):
        config_module.load(None, ["finetune.method=lora", "lora.loraplus_lr_ratio=16",
                                  "distributed.strategy=deepspeed_zero2", "distributed.offload_optimizer=true"],
                           check_paths=False)


def test_lora_trains_its_whole_copies_in_the_adapters_dtype_on_a_16_bit_base_under_autocast(tmp_path):
    """peft upcasts its adapters of a bf16 base but copies lora.modules_to_save (here the embedding
    and the head) in bf16: under autocast the trainer keeps every trained tensor, and so its
    gradient and AdamW states, in the adapters' fp32, as the plan counts them. Without autocast the
    copies stay in the base's dtype (an fp32 embedding would feed fp32 into the bf16 linears)."""
    import torch

    from sft_play import training
    from sft_play.run import BatchSplit
    from tests.conftest import tiny_trainer_factory

    make = tiny_trainer_factory(tmp_path / "autocast", [], "train.mixed_precision=bf16", "train.max_steps=1")
    assert make.run.precision.weights_dtype == "bfloat16" and make.run.upcasts_whole_copies
    trainer, _ = training.train_with_backoff(make, BatchSplit(2, 1, 1, 2))
    trained = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert any("modules_to_save" in n for n in trained) and {p.dtype for p in trained.values()} == {torch.float32}
    assert {p.dtype for p in trainer.model.parameters() if not p.requires_grad} == {torch.bfloat16}
    states = [s for state in trainer.optimizer.state.values() for s in state.values() if torch.is_tensor(s) and s.dim()]
    assert states and {s.dtype for s in states} == {torch.float32}

    make = tiny_trainer_factory(tmp_path / "plain", [], "model.torch_dtype=bfloat16", "train.max_steps=1")
    assert make.run.precision.weights_dtype == "bfloat16" and not make.run.upcasts_whole_copies
    trainer, _ = training.train_with_backoff(make, BatchSplit(2, 1, 1, 2))
    copies = [p for n, p in trainer.model.named_parameters() if "modules_to_save" in n]
    assert copies and {p.dtype for p in copies} == {torch.bfloat16} and trainer.state.global_step == 1


def test_a_cosine_schedule_with_a_floor_ends_at_its_share_of_the_learning_rate(tmp_path):
    from sft_play import config as config_module
    from sft_play import training
    from sft_play.run import BatchSplit
    from tests.conftest import tiny_trainer_factory

    make = tiny_trainer_factory(tmp_path, [], "train.min_lr_ratio=0.1", "train.learning_rate=1e-3",
                                "train.warmup_ratio=0")
    trainer, _ = training.train_with_backoff(make, BatchSplit(4, 2, 1, 8))
    assert trainer.lr_scheduler.get_last_lr()[0] == pytest.approx(1e-4)  # 4 steps of 4: the floor, not 0
    with pytest.raises(config_module.ConfigError, match="train.min_lr_ratio: a floor for the cosine schedule only"):
        config_module.load(None, ["train.min_lr_ratio=0.1", "train.lr_scheduler=linear"], check_paths=False)


def test_a_run_shorter_than_its_logging_interval_logs_its_last_step(tmp_path):
    # 3 steps at train.logging_steps=10 printed "loss: 6.421 -> 6.421": only step 1 had been logged
    from sft_play import callbacks, run_folder, training
    from sft_play.run import BatchSplit
    from tests.conftest import tiny_trainer_factory

    make = tiny_trainer_factory(tmp_path, [callbacks.LogLastStep()], "train.max_steps=3", "train.logging_steps=10")
    trainer, _ = training.train_with_backoff(make, BatchSplit(4, 2, 1, 8))
    logged = training.loss_history(trainer)
    assert [step for step, _ in logged] == [1, 3]
    assert run_folder.write_summary(tmp_path, training.summary_of(trainer, {}))["last_loss"] == logged[-1][1] != logged[0][1]


def test_a_log_line_is_one_readable_line_without_duplicates():
    """The trainer printed {'loss': '6.526', ..., 'num_tokens': 2927, 'num_input_tokens_seen': 2927,
    'train_tokens_per_second': '2974', 'tokens_per_second': '2974'}: strings, and each count twice."""
    from sft_play.callbacks import log_line

    step = {"loss": 5.0913, "grad_norm": 0.9256, "learning_rate": 0.001245, "entropy": 5.434,
            "mean_token_accuracy": 0.1627, "num_tokens": 29532, "epoch": 0.04184, "num_input_tokens_seen": 29532,
            "train_runtime": 3.171, "train_tokens_per_second": 9315.0, "tokens_per_second": 12170.4,
            "expert_load/max": 1.25}
    assert log_line(step, 10, 500) == ("step 10/500  loss 5.091  grad_norm 0.9256  lr 0.001245  accuracy 0.1627  "
                                       "entropy 5.434  expert_load/max 1.25  tokens 29,532  12,170 tok/s  epoch 0.04184")
    evaluation = {"eval_loss": 4.231, "eval_runtime": 0.0862, "eval_samples_per_second": 116.0,
                  "eval_steps_per_second": 11.6, "eval_entropy": 5.074, "eval_mean_token_accuracy": 0.1941,
                  "eval_num_tokens": 2560.0, "epoch": 0.04184}
    assert log_line(evaluation, 10, 500) == ("eval at step 10/500  loss 4.231  accuracy 0.1941  entropy 5.074  "
                                             "tokens 2,560  epoch 0.04184  in 0.0862 s")
    end = {"train_runtime": 3.021, "train_samples_per_second": 79.4, "train_steps_per_second": 6.62,
           "train_loss": 4.596, "epoch": 0.08368, "num_input_tokens_seen": 59081}
    assert log_line(end, 20, 20) == "trained to step 20 in 3.021 s (6.62 steps/s); mean loss over this run 4.596"
    assert log_line({"loss": float("nan"), "learning_rate": 2e-5}, 3, 5) == "step 3/5  loss nan  lr 2e-05"


def test_the_summary_says_what_a_step_took_when_the_data_is_smaller_than_a_batch():
    """One packed row of data trained as 'global 12 = micro 12 x accum 1' in summary.json and the card."""
    from types import SimpleNamespace

    from sft_play.run import BatchSplit
    from sft_play.train import batch_record

    run = SimpleNamespace(batch=BatchSplit(12, 1, 1, 12))
    small = batch_record(run, run.batch, 1)
    assert small["batch"] == "global 12 = micro 12 x accum 1 x world 1; the data is 1 row, so each step took 1"
    assert batch_record(run, run.batch, 2858)["batch"] == "global 12 = micro 12 x accum 1 x world 1"
    assert small["batch_planned"] == small["batch_trained"] == run.batch.to_dict()
