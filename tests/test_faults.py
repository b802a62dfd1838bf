"""Faults on the CPU, injected for real: signals to a training process, half-written
checkpoints, a full disk, NaN losses. Nothing already saved may be lost."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

from sft_play import callbacks, checkpoints, checks, training
from sft_play import config as config_module
from sft_play.errors import UserError
from sft_play.planner.choose import BatchSplit
from tests.conftest import tiny_trainer_factory as build

REPO = Path(__file__).resolve().parents[1]


def train_process(*overrides: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "scripts/train_distributed.py", "--config", "configs/run_tiny.yaml",
                             *overrides], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def run_to_end(*overrides: str) -> str:
    process = train_process(*overrides)
    output = process.communicate(timeout=600)[0]
    assert process.returncode == 0, output[-4000:]
    return output


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_resume_ends_like_an_uninterrupted_run(tmp_path):
    common = ["train.max_steps=24", "train.logging_steps=4", "train.save_steps=100", f"train.output_dir={tmp_path}"]
    process = train_process(*common, "train.run_name=interrupted")
    seen: list[str] = []

    def read():
        for line in process.stdout:
            seen.append(line)

    reader = threading.Thread(target=read)
    reader.start()
    while process.poll() is None and sum("'loss'" in line for line in seen) < 3:  # a few steps in
        threading.Event().wait(0.2)
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=300)
    reader.join()
    output = "".join(seen)
    assert process.returncode == 75, output[-4000:]
    assert "received SIGTERM: finishing this step, saving a checkpoint" in output
    assert "resume: make train CONFIG=configs/run_tiny.yaml RESUME=auto" in output
    run = tmp_path / "interrupted"
    saved = checkpoints.newest_complete(run / "checkpoints")
    assert saved is not None and 0 < int(saved.name.split("-")[1]) < 24
    assert not (run / "model").exists(), "an interrupted run has no final model"

    resumed = run_to_end(*common, "train.run_name=interrupted", "train.resume_from=auto")
    assert f"resuming {run} from {saved.name}" in resumed
    run_to_end(*common, "train.run_name=reference")
    ours = json.loads((run / "summary.json").read_text())
    theirs = json.loads((tmp_path / "reference" / "summary.json").read_text())
    assert ours["global_step"] == theirs["global_step"] == 24
    assert ours["last_loss"] == pytest.approx(theirs["last_loss"], rel=1e-4)


def test_sigint_in_process_stops_at_the_step_boundary_with_a_checkpoint(tmp_path):
    class Interrupt(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1:
                os.kill(os.getpid(), signal.SIGINT)

    stop = callbacks.GracefulStop()
    make = build(tmp_path, [callbacks.CheckpointMarker(), stop, Interrupt()])
    trainer, _ = training.train_with_backoff(make, BatchSplit(8, 1, 1, 8))
    assert stop.received == "SIGINT" and stop.stopped_at == 2 and trainer.state.global_step == 2
    assert checkpoints.is_complete(tmp_path / "checkpoints" / "checkpoint-2")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers restored


def test_nan_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
    class Poison(TrainerCallback):  # from the third step on, the adapters produce NaN
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if state.global_step == 2:
                for name, param in model.named_parameters():
                    if "lora_B" in name:
                        param.data.fill_(float("nan"))

    guard = callbacks.NonFiniteGuard(patience=2)
    make = build(tmp_path, [callbacks.CheckpointMarker(), guard, Poison()], "train.save_steps=1")
    trainer, _ = training.train_with_backoff(make, BatchSplit(8, 1, 1, 8))
    assert guard.stopped_at == 3 and guard.bad_steps == 2 and trainer.state.global_step == 4
    kept = checkpoints.checkpoints(tmp_path / "checkpoints")
    assert [p.name for p in kept] == ["checkpoint-1", "checkpoint-2"], "no checkpoint after the NaN"
    from safetensors.torch import load_file

    last = load_file(kept[-1] / "adapter_model.safetensors")
    assert all(torch.isfinite(t).all() for t in last.values())


def test_nan_guard_leaves_weights_alone_and_does_not_save(tmp_path):
    checkpoint_steps = []

    class Saves(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            checkpoint_steps.append(state.global_step)

    class Poison(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if state.global_step == 2:
                model.base_model.model.model.embed_tokens.weight.data[:, 0] = float("nan")

    guard = callbacks.NonFiniteGuard(patience=2)
    make = build(tmp_path, [guard, Poison(), Saves()])
    trainer, _ = training.train_with_backoff(make, BatchSplit(8, 1, 1, 8))
    lora = [p for n, p in trainer.model.named_parameters() if "lora_" in n]
    assert all(torch.isfinite(p).all() for p in lora), "skipped steps must not write NaN into the adapters"
    assert guard.stopped_at == 3 and checkpoint_steps == []


def test_checkpoint_markers_detect_half_written_folders(tmp_path):
    good = tmp_path / "checkpoints" / "checkpoint-2"
    good.mkdir(parents=True)
    (good / "adapter_model.safetensors").write_bytes(b"x" * 100)
    (good / "optimizer.pt").write_bytes(b"y" * 50)
    checkpoints.write_marker(good, 2)
    assert checkpoints.is_complete(good)
    newer = tmp_path / "checkpoints" / "checkpoint-4"
    shutil.copytree(good, newer)
    (newer / "optimizer.pt").write_bytes(b"y" * 10)  # truncated: the disk filled up
    no_marker = tmp_path / "checkpoints" / "checkpoint-6"
    no_marker.mkdir()
    (no_marker / "adapter_model.safetensors").write_bytes(b"x")  # killed while saving
    assert not checkpoints.is_complete(newer) and not checkpoints.is_complete(no_marker)
    assert checkpoints.newest_complete(tmp_path / "checkpoints") == good
    moved = checkpoints.set_aside_incomplete(tmp_path / "checkpoints")
    assert sorted(p.name for p in moved) == ["checkpoint-4", "checkpoint-6"]
    assert [p.name for p in checkpoints.checkpoints(tmp_path / "checkpoints")] == ["checkpoint-2"]
    assert (tmp_path / "incomplete-checkpoints" / "checkpoint-4" / "optimizer.pt").is_file()


def test_resume_from_a_half_written_checkpoint_is_refused(tmp_path):
    (tmp_path / "run" / "checkpoints" / "checkpoint-3").mkdir(parents=True)
    (tmp_path / "run" / "config.yaml").write_text("{}")
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        checkpoints.resolve_resume(str(tmp_path / "run" / "checkpoints" / "checkpoint-3"), tmp_path, None, "run")
    run, checkpoint, message = checkpoints.resolve_resume("auto", tmp_path / "nothing", None, "run_tiny")
    assert run is None and checkpoint is None and "starting fresh" in message


def test_resume_with_other_settings_is_refused():
    saved = config_module.load(None, ["lora.r=8"], check_paths=False).to_dict()
    current = config_module.load(None, ["lora.r=16", "train.max_steps=99"], check_paths=False).to_dict()
    assert checkpoints.differences(saved, current) == ["lora.r: 8 in the run, 16 now"]


@pytest.mark.slow
def test_save_total_limit_keeps_the_newest_checkpoints(tmp_path):
    run_to_end("train.max_steps=5", "train.save_steps=1", "train.save_total_limit=2", "train.logging_steps=5",
               f"train.output_dir={tmp_path}", "train.run_name=limited")
    kept = checkpoints.checkpoints(tmp_path / "limited" / "checkpoints")
    assert [p.name for p in kept] == ["checkpoint-4", "checkpoint-5"]
    assert all(checkpoints.is_complete(p) for p in kept)


def test_a_full_disk_is_refused_before_training(tmp_path, monkeypatch):
    from sft_play.planner import model_shape
    from sft_play.run import resolve

    config = config_module.load(None, ["train.save_steps=10", f"train.output_dir={tmp_path}"])
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(checks.shutil, "disk_usage", lambda _: usage._replace(free=1000))
    run = resolve(config, on_cuda=False, bf16_supported=False, world_size=1)
    with pytest.raises(UserError, match="not enough disk for this run: 0.0 GiB free, checkpoints need about"):
        checks.ensure_disk_room(config, tmp_path, model_shape(config), run)
    monkeypatch.setattr(checks.shutil, "disk_usage", lambda _: usage._replace(free=10**12))
    checks.ensure_disk_room(config, tmp_path, model_shape(config), run)


@pytest.mark.slow
def test_secrets_stay_out_of_logs_and_saved_files(tmp_path):
    secret = "hf_SECRETtoken1234567890"
    process = subprocess.run([sys.executable, "scripts/train_distributed.py", "--config", "configs/run_tiny.yaml",
                              "train.max_steps=2", "train.save_steps=2", f"train.output_dir={tmp_path}",
                              "train.run_name=secret"], cwd=REPO, capture_output=True, text=True,
                             env={**os.environ, "HF_TOKEN": secret, "HUGGING_FACE_HUB_TOKEN": secret}, timeout=600)
    assert process.returncode == 0, process.stderr[-3000:]
    assert secret not in process.stdout + process.stderr
    files = [path for path in (tmp_path / "secret").rglob("*") if path.is_file()]
    assert any(path.name == "adapter_model.safetensors" for path in files)
    for path in files:
        assert secret.encode() not in path.read_bytes(), path
