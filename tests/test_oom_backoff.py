"""Runtime OOM backoff: an out-of-memory step halves the micro-batch, doubles the accumulation,
and training continues from where it was with the same global batch."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import TrainerCallback

from sft_play import run_folder, training
from sft_play.errors import OutOfMemory
from sft_play.run import BatchSplit
from tests.conftest import tiny_trainer_factory as build


def _train(make, split: BatchSplit, on_backoff=None):
    return training.train_with_backoff(make, split, on_backoff=on_backoff)

pytestmark = pytest.mark.slow


class InjectOutOfMemory(TrainerCallback):
    """Raises CUDA's out-of-memory error at the start of `at_step` while the micro-batch is above `until`."""

    def __init__(self, at_step: int, until: int = 0):
        self.at_step, self.until, self.raised = at_step, until, 0

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.at_step and args.per_device_train_batch_size > self.until:
            self.raised += 1
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")


def test_out_of_memory_halves_the_micro_batch_and_continues(tmp_path, caplog):
    injected = InjectOutOfMemory(at_step=2, until=4)
    make = build(tmp_path / "backoff", [injected])
    backoffs = []
    with caplog.at_level(logging.WARNING, logger="sft_play"):
        trainer, trained = _train(make, BatchSplit(8, 1, 1, 8), lambda *event: backoffs.append(event))
    assert injected.raised == 1
    assert backoffs == [(BatchSplit(8, 1, 1, 8), BatchSplit(4, 2, 1, 8), 2)]  # for the run folder's events
    assert trained == BatchSplit(4, 2, 1, 8)  # same global batch
    assert trainer.state.global_step == 4
    assert (tmp_path / "backoff" / "checkpoints" / "checkpoint-2").is_dir()
    assert "out of memory at micro-batch 8 (step 3): continuing from step 2 with global 8 = micro 4 x accum 2" in caplog.text

    # The same steps as a run that never ran out of memory (the same samples, the same updates)
    reference, _ = _train(build(tmp_path / "reference", []), BatchSplit(8, 1, 1, 8))
    ours = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    theirs = [e["loss"] for e in reference.state.log_history if "loss" in e]
    assert ours[-2:] == pytest.approx(theirs[-2:], rel=1e-3)


def test_events_are_recorded_beside_the_run_oldest_first(tmp_path):
    run_folder.record_event(tmp_path, "out_of_memory", step=3, batch=BatchSplit(4, 2, 1, 8).to_dict())
    run_folder.record_event(tmp_path, "out_of_memory", step=5, batch=BatchSplit(2, 4, 1, 8).to_dict())
    with open(tmp_path / run_folder.EVENTS, "a") as f:
        f.write("{torn line\n")  # a process killed while writing one
    assert [(e["event"], e["step"], e["batch"]["micro_batch_size"]) for e in run_folder.events(tmp_path)] == [
        ("out_of_memory", 3, 4), ("out_of_memory", 5, 2)]


def test_gives_up_with_a_clear_message_at_micro_batch_one(tmp_path):
    make = build(tmp_path, [InjectOutOfMemory(at_step=0)])
    with pytest.raises(OutOfMemory, match="out of memory at micro-batch 1: nothing left to halve") as caught:
        _train(make, BatchSplit(2, 4, 1, 8))
    assert caught.value.split == BatchSplit(1, 8, 1, 8)  # the split it ran out at, for the run's memory check


def test_other_errors_are_not_swallowed(tmp_path):
    class Boom(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            raise RuntimeError("something else broke")

    with pytest.raises(RuntimeError, match="something else broke"):
        _train(build(tmp_path, [Boom()]), BatchSplit(8, 1, 1, 8))
