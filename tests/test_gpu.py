"""What a session with a GPU runs (skipped without one): the embedded default trains on the GPU
in the precision auto picks there, QLoRA trains on bitsandbytes' CUDA kernels, and a run folder
generates on the GPU."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import run_script

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

STEPS = ("train.max_steps=6", "train.logging_steps=1", "train.global_batch_size=8")


def train(tmp_path, name: str, *overrides: str):
    result = run_script("train_distributed.py", "--config", "configs/run_tiny.yaml", f"train.output_dir={tmp_path}",
                        f"train.run_name={name}", *STEPS, *overrides)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return tmp_path / name, result


def test_the_default_trains_on_the_gpu_in_the_precision_auto_picks(tmp_path):
    run_dir, result = train(tmp_path, "auto", "train.mixed_precision=auto")
    expected = "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"
    assert f"mixed precision {expected} (auto: " in result.stderr
    assert "devices: rank 0: cuda:0" in result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["global_step"] == 6 and summary["last_loss"] < summary["first_loss"]
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["device"].endswith(torch.cuda.get_device_name(0)) or torch.cuda.get_device_name(0) in plan["device"]


def test_qlora_trains_on_the_gpu(tmp_path):
    run_dir, _ = train(tmp_path, "qlora", "finetune.method=qlora")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["global_step"] == 6 and summary["last_loss"] < summary["first_loss"]
    result = run_script("generate.py", "--run", str(run_dir), "--count", "2", "--max-new-tokens", "8")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("after:") == 2


def test_a_run_measures_what_lives_outside_the_allocator_and_the_next_plan_uses_it(tmp_path, monkeypatch):
    from sft_play import hardware

    measured = hardware.measure_outside_allocator(0)
    if measured is None:
        pytest.skip("NVML cannot see this process's memory here (a container without process accounting)")
    assert 100 * 2**20 < measured < 4 * 2**30
    monkeypatch.setenv("SFT_PLAY_CACHE", str(tmp_path / "cache"))
    run_dir, _ = train(tmp_path, "measured", "train.mixed_precision=auto")
    check = json.loads((run_dir / "memory_check.json").read_text())
    if "outside_allocator_bytes" in check["ranks"][0]:
        remembered = hardware.detect().outside_allocator
        assert remembered["1"] == check["ranks"][0]["outside_allocator_bytes"]
        planned = run_script("plan.py", "--config", "configs/run_tiny.yaml", "--json", env={"SFT_PLAY_CACHE": str(tmp_path / "cache")})
        assert "measured on these GPUs" in planned.stdout
