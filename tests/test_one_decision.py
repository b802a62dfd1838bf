"""The run that trains is the run that was planned: the decisions other layers used to make
again (precision through an accelerate config, the device under CPU=1, the export dtype) are
read from one place, and the run folder says what trained."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from sft_play import config as config_module
from sft_play import export, launch, training
from sft_play.run import BatchSplit, CPU_ENV, Placement, placement, resolve
from tests.conftest import LORA, REPO, run_script


def load(*overrides: str):
    return config_module.load(REPO / "configs" / "run_tiny.yaml", [*LORA, *overrides], check_paths=False)


# --- precision: an accelerate config cannot change it ------------------------------------------

def test_an_accelerate_config_that_says_bf16_does_not_turn_fp32_into_bf16(monkeypatch, tmp_path):
    # What `accelerate launch --config_file local.yaml` exports when the file says bf16
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    config = load("train.mixed_precision=no")
    run = resolve(config, on_cuda=False, bf16_supported=True, world_size=1).with_changes(batch=BatchSplit(2, 1, 1, 2))
    args = training.trainer_arguments(config, run, tmp_path, False)
    assert not args.bf16 and not args.fp16
    assert args.mixed_precision == "no"  # what the trainer's accelerator is built with


def test_a_real_run_under_an_accelerate_bf16_environment_trains_as_planned(tiny_lora_run):
    run_dir, _ = tiny_lora_run  # trained with ACCELERATE_MIXED_PRECISION=bf16 in its environment (conftest)
    summary = json.loads((run_dir / "summary.json").read_text())
    recorded = json.loads((run_dir / "run.json").read_text())
    assert recorded["precision"]["mixed"] == "no"
    assert summary["mixed_precision"] == "no"  # the trainer's accelerator, not the banner


def test_setup_accelerate_leaves_precision_to_the_run(tmp_path):
    result = run_script("setup_accelerate.py", "--auto", "--output", str(tmp_path / "local.yaml"))
    assert result.returncode == 0, result.stderr
    assert "mixed_precision: 'no'" in (tmp_path / "local.yaml").read_text()
    assert "mixed precision from the run config" in result.stdout


# --- device: CPU=1 means CPU processes even beside a GPU ---------------------------------------

def test_cpu_processes_beside_a_visible_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU, faked
    monkeypatch.delenv(CPU_ENV, raising=False)
    assert placement(load()).on_cuda

    topology, _ = launch.resolve_topology(2, None, 1, 0, None, None, cpu=True, visible_gpus=1, oversubscribe=True)
    env = launch.child_env(topology)
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env[CPU_ENV] == "1" and env["DS_ACCELERATOR"] == "cpu"
    monkeypatch.setenv(CPU_ENV, "1")  # what the training processes see
    ddp, zero2 = placement(load()), placement(load("distributed.strategy=deepspeed_zero2"))
    assert ddp == Placement(on_cuda=False) and ddp.cpu_processes and ddp.backend is None
    assert not zero2.on_cuda and zero2.deepspeed_on_cpu and zero2.backend == "gloo" and not zero2.cpu_processes
    # and what the trainer is told follows from it
    config = load()
    run = resolve(config, on_cuda=ddp.on_cuda, bf16_supported=False, world_size=2).with_changes(
        batch=BatchSplit(2, 1, 2, 4))
    args = training.trainer_arguments(config, run, REPO / "unused", False)
    assert args.use_cpu and not args.dataloader_pin_memory


def test_a_gpu_launch_without_cpu_leaves_the_gpus_visible(monkeypatch):
    for name in ("CUDA_VISIBLE_DEVICES", CPU_ENV):  # as a user's shell has them
        monkeypatch.delenv(name, raising=False)
    topology, _ = launch.resolve_topology(2, None, 1, 0, None, None, cpu=False, visible_gpus=2)
    env = launch.child_env(topology)
    assert "CUDA_VISIBLE_DEVICES" not in env and CPU_ENV not in env


# --- export: merge and eval in the dtype training used on that GPU -----------------------------

@pytest.mark.parametrize("capability, expected", [((7, 0), torch.float16), ((7, 5), torch.float16),
                                                  ((8, 0), torch.bfloat16), ((9, 0), torch.bfloat16)])
def test_the_export_dtype_follows_the_gpu(monkeypatch, capability, expected):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert export.loading_dtype(load("train.mixed_precision=auto"), "cuda") == expected
    assert export.loading_dtype(load("train.mixed_precision=auto"), "cpu") == torch.float32
    assert export.loading_dtype(load("train.mixed_precision=no"), "cuda") == torch.float32


class Loaded(Exception):
    """Raised by the faked loader with what it was asked for."""


def _fake_pre_ampere_gpu(monkeypatch):
    from transformers import AutoModelForCausalLM

    asked = []

    def from_pretrained(*args, **kwargs):
        asked.append(kwargs)
        raise Loaded

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))  # a V100
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", from_pretrained)
    return asked


def test_merge_and_eval_on_a_pre_ampere_gpu_load_fp16(monkeypatch, tiny_lora_run, tiny_qlora_run):
    lora_dir, _ = tiny_lora_run
    qlora_dir, _ = tiny_qlora_run
    for folder in (lora_dir, qlora_dir):  # the runs trained with mixed_precision=no: say auto, as on a GPU box
        text = (folder / "config.yaml").read_text()
        assert "mixed_precision: 'no'" in text or "mixed_precision: no" in text
    asked = _fake_pre_ampere_gpu(monkeypatch)
    monkeypatch.setattr(export, "_locate", lambda path: (path / "model", load(
        "train.mixed_precision=auto", *(["finetune.method=qlora"] if path == qlora_dir else []))))
    with pytest.raises(Loaded):
        export.merge(lora_dir, lora_dir / "unused")
    assert asked[-1]["dtype"] == torch.float16
    with pytest.raises(Loaded):
        export.merge(qlora_dir, qlora_dir / "unused")
    assert asked[-1]["dtype"] == torch.float16
    assert asked[-1]["quantization_config"].bnb_4bit_compute_dtype == torch.float16
    with pytest.raises(Loaded):
        export.evaluate(lora_dir)  # loads the run first
    assert asked[-1]["dtype"] == torch.float16


# --- the run folder says what trained ----------------------------------------------------------

def test_the_run_folder_records_the_resolved_run_and_the_batch_as_planned_and_trained(tiny_lora_run):
    run_dir, _ = tiny_lora_run
    recorded = json.loads((run_dir / "run.json").read_text())
    plan = json.loads((run_dir / "plan.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert recorded["batch"]["micro_batch_size"] == plan["micro_batch_size"] == 8
    assert summary["batch_planned"] == recorded["batch"]
    assert summary["batch_trained"] == summary["batch_planned"]  # no backoff in this run
    assert not (run_dir / "events.jsonl").exists()  # nothing changed while it trained
    assert recorded["precision"]["mixed"] == plan["precision"]["mixed"] == "no"
    assert recorded["lora"]["r"] == 32 and recorded["kernels"]["attention"] == plan["attention"]


def test_a_training_process_imports_deepspeed_only_for_a_deepspeed_strategy(monkeypatch):
    # accelerate imports DeepSpeed in every training process where it is installed (SFTTrainer ->
    # is_peft_model -> extract_model_from_parallel): the run's strategy decides whether it may
    import importlib.util

    from sft_play import lean_imports

    for strategy, hidden in (("ddp", True), ("fsdp2", True), ("deepspeed_zero2", False), ("deepspeed_zero3", False)):
        monkeypatch.delitem(sys.modules, "deepspeed", raising=False)
        config = config_module.load(REPO / "configs" / "run_tiny.yaml", [f"distributed.strategy={strategy}"])
        lean_imports.for_training(config)
        assert (sys.modules.get("deepspeed", "unset") is None) == hidden, strategy
        assert (importlib.util.find_spec("deepspeed") is None) == hidden, strategy  # what accelerate asks
