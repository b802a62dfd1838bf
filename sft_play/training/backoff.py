"""What changes the batch split once training is under way: calibration (two measured steps
refit the plan) and the out-of-memory backoff (half the micro-batch, twice the accumulation)."""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sft_play import checkpoints, planner
from sft_play.callbacks import AlreadyTrained, max_over_ranks
from sft_play.config import RunConfig
from sft_play.errors import OutOfMemory
from sft_play.planner.choose import calibrate as calibration
from sft_play.planner.simulate import memory
from sft_play.run import BatchSplit, Run

logger = logging.getLogger("sft_play.training")


def measure_peaks(make_trainer: Callable[..., Any], run: Run, micros: tuple[int, ...] = (1, 2),
                  steps: int = 2) -> dict[int, int]:
    """The real peak GPU memory of `steps` training steps at each micro-batch in `micros`
    (``torch.cuda.max_memory_reserved`` plus the CUDA context as the planner counts it, the
    largest over all ranks). Learning rate 0, nothing saved or logged: the model is unchanged."""
    import torch

    peaks = {}
    for micro in micros:
        world = run.parallel.data_parallel
        trainer = make_trainer(BatchSplit(micro, 1, world, micro * world), max_steps=steps, learning_rate=0.0,
                               save_strategy="no", report_to="none", logging_strategy="no", eval_strategy="no")
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        trainer.train()
        peaks[micro] = max_over_ranks(torch.cuda.max_memory_reserved())
        del trainer
    return peaks


def calibrate(plan: Any, make_trainer: Callable[..., Any], config: RunConfig, run: Run, shape: Any) -> Any:
    """`plan` re-decided from two measured steps (``planner.calibrate``; GPU only): peaks at
    micro-batches 1 and 2, fitted as fixed + per-sample, compared with the predictions for the
    same run; the split is then decided by the planner's own rule
    (:func:`sft_play.planner.choose.split.decide_split`)."""
    outside = memory.outside_allocator_bytes(run, on_cuda=True, measured=run.outside_allocator_measured)
    measured = {m: peak + outside for m, peak in measure_peaks(make_trainer, run).items()}
    predicted = {m: planner.peak_at(shape, run, m) for m in measured}
    return calibration.calibrated_plan(plan, measured, predicted, config.train, config.planner)


def _no_backoff(trainer: Any, split: BatchSplit, smallest: int) -> str | None:
    """Why an out-of-memory step cannot continue at half the micro-batch, or None where it can:
    nothing left to halve, or several processes (or a model DeepSpeed or FSDP2 has wrapped in
    place), where one rank cannot change its batch alone and the run restarts instead."""
    if split.micro_batch_size // 2 < smallest:
        return (f"out of memory at micro-batch {split.micro_batch_size}: nothing left to halve"
                + (" (KTO estimates its KL term from the other answers of a micro-batch: it needs 2)"
                   if smallest > 1 else "")
                + ". `make plan` lists what would fit (gradient checkpointing, QLoRA, ZeRO-2, shorter sequences, "
                "more GPUs)")
    if (trainer.args.world_size > 1 or getattr(trainer, "is_deepspeed_enabled", False)
            or getattr(trainer, "is_fsdp_enabled", False)):
        return (f"out of memory at micro-batch {split.micro_batch_size} on one of {trainer.args.world_size} "
                f"processes; restart with train.micro_batch_size={split.micro_batch_size // 2} "
                "(and RESUME=auto to continue)")
    return None


def train_with_backoff(
    make_trainer: Callable[..., Any],
    split: BatchSplit,
    resume_from_checkpoint: str | None = None,
    on_backoff: Callable[[BatchSplit, BatchSplit, int], None] | None = None,
    smallest: int = 1,
) -> tuple[Any, BatchSplit]:
    """Train; when a step runs out of memory, halve the micro-batch, double the accumulation and
    continue from where training was.

    The global batch and the data order stay the same: the step that failed had not updated the
    weights, so its state is saved as a checkpoint and a trainer with the new split resumes from
    it (the trainer skips the ``step x accumulation`` micro-batches already seen, of the new size,
    so exactly the same samples are skipped).

    Kept rather than accelerate's ``find_executable_batch_size``, which retries the whole
    function from the start with a smaller batch: that changes the global batch and repeats
    the steps already taken.

    Args:
        make_trainer: builds a trainer at a batch split (:func:`sft_play.training.trainer.trainer_factory`).
        split: the batch split to start at (the plan's, or calibration's).
        resume_from_checkpoint: a checkpoint to start from.
        on_backoff: told (split before, split after, step continued from) at each backoff, for
            the run folder's events.
        smallest: the smallest micro-batch the run can train at (KTO's KL estimate needs 2).

    Returns:
        The trainer that finished, and the batch split it trained at last.

    Raises:
        OutOfMemory: out of memory at micro-batch 1, or with several processes (where one rank
            cannot change its batch alone).
    """
    import torch
    from accelerate.utils.memory import should_reduce_batch_size

    while True:
        trainer = make_trainer(split)
        try:
            trainer.train(resume_from_checkpoint=resume_from_checkpoint)
            return trainer, split
        except AlreadyTrained as done:
            logger.info("resumed at step %s, the run's last: nothing left to train, only the final save", done)
            return trainer, split
        except RuntimeError as error:
            if not should_reduce_batch_size(error):
                raise
            refused = _no_backoff(trainer, split, smallest)
            if refused:
                raise OutOfMemory(refused, split) from error
            step = trainer.state.global_step
            trainer.optimizer.zero_grad(set_to_none=True)
            # the state before the failed step, as the trainer writes it at a save step (it has no
            # public call that writes a resumable checkpoint outside its loop)
            trainer._save_checkpoint(trainer.model, trial=None)
            resume_from_checkpoint = str(Path(trainer.args.output_dir) / f"checkpoint-{step}")
            checkpoints.write_marker(Path(resume_from_checkpoint), step)
        smaller = split.halved()
        logger.warning(
            "out of memory at micro-batch %d (step %d): continuing from step %d with %s",
            split.micro_batch_size, step + 1, step, smaller.describe(),
        )
        if on_backoff is not None:
            on_backoff(split, smaller, step)
        del trainer
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        split = smaller
