"""Behaviour added to the trainer as callbacks: completeness markers on checkpoints, a clean stop
on SIGTERM/SIGINT, and a guard against NaN or infinite losses and gradients.

Every decision that stops training is agreed across ranks (an all-reduce of one number per
step), so that all processes stop at the same step and none waits forever in a collective.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
from pathlib import Path

import torch
from transformers import TrainerCallback

from sft_play import checkpoints

logger = logging.getLogger(__name__)


def _any_rank(flag: bool) -> bool:
    """True on every rank if `flag` is true on any rank (no-op without a process group)."""

    return bool(max_over_ranks(1 if flag else 0))


def max_over_ranks(value: int) -> int:
    """The largest `value` of all ranks (itself without a process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    tensor = torch.tensor([value], device=device, dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


class CheckpointMarker(TrainerCallback):
    """Marks each checkpoint complete once every rank has finished writing it."""

    def on_save(self, args, state, control, **kwargs):
        _barrier()
        if state.is_world_process_zero:
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if folder.is_dir():
                checkpoints.write_marker(folder, state.global_step)
        _barrier()


class GracefulStop(TrainerCallback):
    """On SIGTERM or SIGINT, finish the current step, save a checkpoint, and stop.

    A second signal stops at once (SIGINT raises KeyboardInterrupt). After training,
    ``received`` names the signal and ``stopped_at`` the step, for the entry script's message.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: str | None = None
        self.stopped_at: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame):
        if self.received is not None:  # asked twice: stop now
            previous = self._previous.get(signum)
            self._restore()
            if callable(previous):
                previous(signum, frame)
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name
        logger.warning("received %s: finishing this step, saving a checkpoint, then stopping "
                       "(send it again to stop at once)", self.received)

    def on_train_begin(self, args, state, control, **kwargs):
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

    def on_step_end(self, args, state, control, **kwargs):
        if _any_rank(self.received is not None):
            control.should_save = True
            control.should_training_stop = True
            self.stopped_at = state.global_step
            self.received = self.received or "a signal on another rank"

    def on_train_end(self, args, state, control, **kwargs):
        self._restore()

    def _restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


class NonFiniteGuard(TrainerCallback):
    """Skips optimizer steps whose gradients are NaN or infinite (their gradients are dropped, so
    the optimizer leaves weights and states untouched), and stops the run after `patience`
    consecutive bad steps, without saving another checkpoint, so that the last good one stays.

    Where gradients cannot be watched (DeepSpeed partitions them away from the parameters; fp16
    leaves infinite gradients to its scaler, which skips those steps itself), a logged loss that
    is NaN or infinite counts as a bad step instead.
    """

    def __init__(self, patience: int, watch_gradients: bool = True) -> None:
        self.patience = patience
        self.watch_gradients = watch_gradients
        self.bad_steps = 0
        self.stopped_at: int | None = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if model is None or not self.watch_gradients:
            return
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        finite = True
        if grads:
            norms = torch._foreach_norm(grads)
            finite = bool(torch.isfinite(torch.stack([n.float() for n in norms])).all())
        if _any_rank(not finite):
            for p in model.parameters():
                p.grad = None  # the optimizer skips parameters without a gradient
            self._bad(state, control, "gradients")
        else:
            self.bad_steps = 0

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.watch_gradients or self.stopped_at is not None:
            return
        loss = (logs or {}).get("loss")
        if loss is not None and not math.isfinite(loss):
            self._bad(state, control, "the loss")
        elif loss is not None:
            self.bad_steps = 0

    def on_step_end(self, args, state, control, **kwargs):
        if self.bad_steps:
            control.should_save = False  # never rotate a good checkpoint out for a state from a bad streak
        if self.stopped_at is not None:
            control.should_training_stop = True

    def _bad(self, state, control, what: str) -> None:
        self.bad_steps += 1
        logger.warning("step %d: %s are NaN or infinite (%d of %d allowed in a row)%s", state.global_step + 1, what,
                       self.bad_steps, self.patience, "; the update is skipped" if self.watch_gradients else "")
        if self.bad_steps >= self.patience:
            self.stopped_at = state.global_step
            control.should_training_stop = True
            control.should_save = False
