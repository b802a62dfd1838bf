"""Behaviour added to the trainer as callbacks: completeness markers and rotation of checkpoints,
a clean stop on SIGTERM/SIGINT, a guard against NaN or infinite losses and gradients, and the
true token count and throughput in the logs.

Every decision that stops training is agreed across ranks (an all-reduce of one number per
step), so that all processes stop at the same step and none waits forever in a collective.

``SFT_PLAY_FAULTS`` (tests only) injects faults at chosen steps, see :func:`injected_faults`.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from sft_play import checkpoints

# A signal that arrives again within this window is the same request delivered twice (a terminal
# or a cluster signals every process, and the launcher passes it on as well)
from sft_play.stopping import DUPLICATE_SIGNAL_WINDOW_S

logger = logging.getLogger(__name__)

FAULTS_ENV = "SFT_PLAY_FAULTS"


def _distributed():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else None


def any_rank(flag: bool) -> bool:
    """True on every rank if `flag` is true on any rank (no-op without a process group)."""
    return bool(max_over_ranks(1 if flag else 0))


def max_over_ranks(value: int) -> int:
    """The largest `value` of all ranks (itself without a process group)."""
    dist = _distributed()
    if dist is None:
        return value
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    tensor = torch.tensor([value], device=device, dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def lost_another_rank(error: BaseException) -> bool:
    """Whether `error` is a collective failing because another process of the run went away
    (it crashed, was killed, or its node failed): that process's own error, or the launcher's
    report of it, says why."""
    import torch.distributed as dist

    text = str(error)
    return isinstance(error, dist.DistError) or any(
        sign in text for sign in ("Connection closed by peer", "Connection reset by peer", "remote worker",
                                  "NCCL communicator was aborted"))


def _barrier() -> None:
    dist = _distributed()
    if dist is not None:
        dist.barrier()


def _rank_and_world() -> tuple[int, int]:
    dist = _distributed()
    return (dist.get_rank(), dist.get_world_size()) if dist is not None else (0, 1)


# --- fault injection (tests) -------------------------------------------------------------------


def injected_faults() -> dict[str, tuple[int, ...]]:
    """Faults asked for in ``SFT_PLAY_FAULTS`` (for tests: a real process must be killed or made
    slow at a chosen point), e.g. ``slow_step=2:35,kill_before_marker=6:1``:

    - ``slow_step=S:SECONDS``: step S takes SECONDS longer on every rank (before its checkpoint
      decision), as a long step would;
    - ``hold_step=S``: step S ends only once this process has received a stop signal (at most
      :data:`HOLD_LIMIT_S` later), so that a test's signal lands in step S however slow the
      machine, with no window to hit;
    - ``kill_before_marker=S:RANK``: that rank (default 0) is killed (SIGKILL) once it has written
      its part of checkpoint S, before the ranks agree that the checkpoint is whole and mark it.
    """
    faults = {}
    for item in filter(None, (part.strip() for part in os.environ.get(FAULTS_ENV, "").split(","))):
        name, _, values = item.partition("=")
        faults[name.strip()] = tuple(int(v) for v in values.split(":") if v.strip())
    return faults


def kill_if_injected(name: str, step: int, rank: int = 0) -> None:
    """SIGKILL this process if ``SFT_PLAY_FAULTS`` asks for fault `name` at `step` on `rank`."""
    values = injected_faults().get(name)
    if values and values[0] == step and (values[1] if len(values) > 1 else 0) == rank:
        logger.warning("fault injection (%s): killing rank %d at step %d", name, rank, step)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)


HOLD_LIMIT_S = 300  # hold_step's guard against a test that never sends its signal


class FaultInjection(TrainerCallback):
    """``slow_step`` and ``hold_step`` of :func:`injected_faults`; added (first) only when
    ``SFT_PLAY_FAULTS`` is set. `stop` is the run's :class:`GracefulStop`, whose signal ends a hold."""

    def __init__(self, stop: GracefulStop | None = None) -> None:
        self.stop = stop

    def on_step_end(self, args, state, control, **kwargs):
        faults = injected_faults()
        slow, hold = faults.get("slow_step"), faults.get("hold_step")
        if slow and slow[0] == state.global_step:
            logger.warning("fault injection (slow_step): step %d takes %d s longer", state.global_step, slow[1])
            deadline = time.monotonic() + slow[1]
            while (left := deadline - time.monotonic()) > 0:
                time.sleep(min(left, 1.0))  # signals are handled between naps
        if hold and hold[0] == state.global_step and self.stop is not None:
            logger.warning("fault injection (hold_step): step %d waits for a stop signal", state.global_step)
            deadline = time.monotonic() + HOLD_LIMIT_S
            while self.stop.received is None and time.monotonic() < deadline:
                time.sleep(0.05)  # the signal's handler runs between naps


# --- checkpoints -------------------------------------------------------------------------------


class CheckpointMarker(TrainerCallback):
    """Marks each checkpoint complete once every rank has finished writing it, then deletes the
    complete checkpoints beyond the newest `keep` (the trainer's own rotation, which deletes
    before the new checkpoint is known to be whole, stays off: ``save_total_limit=None``).

    The marker lists every file with its size and SHA-256 digest (the ranks hash a share of the
    files each) and is withheld when a rank's files are missing.
    """

    def __init__(self, keep: int | None = None, strategy: str | None = None) -> None:
        self.keep = keep
        self.strategy = strategy

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        rank, world = _rank_and_world()
        kill_if_injected("kill_before_marker", state.global_step, rank)
        _barrier()  # every rank has written its part
        names = [checkpoints.checkpoint_files(folder) if rank == 0 and folder.is_dir() else []]
        dist = _distributed()
        if dist is not None:
            dist.broadcast_object_list(names, src=0)
        mine = {}
        for name in names[0][rank::world]:
            try:
                mine[name] = checkpoints.file_digest(folder / name)
            except OSError:  # not visible from this node: rank 0 hashes it
                pass
        shares = [mine] if dist is None else [None] * world
        if dist is not None:
            dist.all_gather_object(shares, mine)
        if rank == 0 and folder.is_dir():
            missing = checkpoints.missing_rank_files(folder, world)
            if missing:
                logger.error("%s is not marked complete: %s missing (a rank did not finish saving, or a node writes "
                             "into a folder the others cannot see: train.output_dir must be shared by every node)",
                             folder, ", ".join(missing))
            else:
                merged = {name: digest for share in shares for name, digest in (share or {}).items()}
                checkpoints.write_marker(folder, state.global_step, world, self.strategy, merged)
                if self.keep:
                    checkpoints.rotate(folder.parent, self.keep)
        _barrier()


# --- stopping ----------------------------------------------------------------------------------


class GracefulStop(TrainerCallback):
    """On SIGTERM or SIGINT, finish the current step, save a checkpoint, and stop.

    A second signal more than :data:`DUPLICATE_SIGNAL_WINDOW_S` after the first stops at once
    (SIGINT raises KeyboardInterrupt); one within it is the same request delivered twice (by the
    terminal or the cluster to every process, and by the launcher) and changes nothing. After
    training, ``received`` names the signal and ``stopped_at`` the step, for the entry script's
    message. :meth:`install` may be called before training, so that a signal during start-up
    is not lost.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: str | None = None
        self.stopped_at: int | None = None
        self._first_at = 0.0
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame):
        now = time.monotonic()
        if self.received is not None:
            if now - self._first_at < DUPLICATE_SIGNAL_WINDOW_S:
                return
            previous = self._previous.get(signum)  # asked twice: stop now
            self._restore()
            if callable(previous):
                previous(signum, frame)
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name
        self._first_at = now
        logger.warning("received %s: finishing this step, saving a checkpoint, then stopping "
                       "(send it again to stop at once)", self.received)

    def install(self) -> None:
        """Handle SIGTERM and SIGINT from now on (main thread only; once)."""
        if threading.current_thread() is threading.main_thread() and not self._previous:
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

    def on_train_begin(self, args, state, control, **kwargs):
        self.install()

    def on_step_end(self, args, state, control, **kwargs):
        if any_rank(self.received is not None):
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
        if any_rank(not finite):
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


# --- logs --------------------------------------------------------------------------------------


class LogLastStep(TrainerCallback):
    """Logs the last step, whatever ``train.logging_steps`` is: the run's final loss (the summary's
    ``last_loss``, the ``loss: a -> b`` line) is then its end's, not its first step's when the
    run is shorter than one logging interval."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.max_steps and state.global_step >= state.max_steps:
            control.should_log = True


class EarlyStopping(TrainerCallback):
    """Stops training when the validation loss has not improved for `patience` evaluations in a
    row (each rank sees the same gathered loss, so all stop at the same step); ``stopped_at`` and
    the best loss and its step say what happened. transformers' own callback needs
    ``load_best_model_at_end``, which would keep checkpoints our marker rotates."""

    def __init__(self, patience: int):
        self.patience = patience
        self.best: float | None = None
        self.best_step = 0
        self.waited = 0
        self.stopped_at: int | None = None

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        loss = (metrics or {}).get("eval_loss")
        if loss is None or not math.isfinite(loss):
            return
        if self.best is None or loss < self.best:
            self.best, self.best_step, self.waited = loss, state.global_step, 0
            return
        self.waited += 1
        if self.waited >= self.patience:
            self.stopped_at = state.global_step
            control.should_training_stop = True
            logger.info("early stop at step %d: the validation loss has not improved for %d evaluations (best %.4f "
                        "at step %d)", state.global_step, self.waited, self.best, self.best_step)


class TokenThroughput(TrainerCallback):
    """Logs the tokens trained on so far as ``num_tokens`` (every rank's non-padding tokens, the
    trainer's ``num_input_tokens_seen``) and ``tokens_per_second`` since the previous log line.

    TRL's own ``num_tokens`` counts one row's length per batch when batches carry position ids
    and no attention mask, as our packed rows do; this callback overwrites it. It must run before
    the TensorBoard callback (see :func:`sft_play.training.trainer_factory`).
    """

    def __init__(self) -> None:
        self._tokens = 0
        self._time = time.monotonic()

    def on_train_begin(self, args, state, control, **kwargs):
        self._tokens, self._time = state.num_input_tokens_seen, time.monotonic()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs:
            return
        now, tokens = time.monotonic(), state.num_input_tokens_seen
        rate = (tokens - self._tokens) / max(now - self._time, 1e-6)
        counts = {"num_tokens": tokens, "tokens_per_second": round(rate, 1)}
        logs.update(counts)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(counts)
        self._tokens, self._time = tokens, now


# Log keys the printed line leaves out: duplicates of what it shows (TokenThroughput's num_tokens
# is the trainer's num_input_tokens_seen; its tokens_per_second is over the last interval, the
# trainer's train_tokens_per_second since the start) and what says nothing to a reader. All of
# them still reach TensorBoard.
_UNPRINTED = {"num_input_tokens_seen", "train_tokens_per_second", "total_flos", "train_runtime"}
_NAMES = {"learning_rate": "lr", "mean_token_accuracy": "accuracy", "num_tokens": "tokens"}


_FIRST = ("loss", "grad_norm", "learning_rate", "mean_token_accuracy", "entropy")
_LAST = ("num_tokens", "tokens_per_second", "epoch", "runtime")


def _number(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) or (math.isfinite(value) and value.is_integer() and abs(value) >= 1000):
        return f"{int(value):,}"
    return f"{value:.4g}"


def log_line(logs: dict[str, Any], step: int, max_steps: int) -> str:
    """One log entry as the terminal shows it: ``step 10/500  loss 5.73  grad_norm 1.769  lr
    0.00072  accuracy 0.134  entropy 5.781  tokens 29,532  16,453 tok/s  epoch 0.04184`` for a
    training step, ``eval at step 10/500  loss 4.231 ...  in 0.09 s`` for an evaluation, and the
    trainer's summary at the end of training."""
    if "train_loss" in logs:
        rate = logs.get("train_steps_per_second")
        return (f"trained to step {step} in {_number(logs.get('train_runtime', 0.0))} s"
                + (f" ({_number(rate)} steps/s)" if rate is not None else "")
                + f"; mean loss over this run {_number(logs['train_loss'])}")
    evaluation = any(key.startswith("eval_") for key in logs)
    named = {}
    for key, value in logs.items():
        if key in _UNPRINTED or key in ("eval_samples_per_second", "eval_steps_per_second"):
            continue
        named[key[len("eval_"):] if evaluation and key.startswith("eval_") else key] = value
    order = [k for k in _FIRST if k in named] + [k for k in named if k not in _FIRST + _LAST] + \
        [k for k in _LAST if k in named]
    parts = [f"{'eval at ' if evaluation else ''}step {step}/{max_steps}"]
    for name in order:
        value = named[name]
        if name == "tokens_per_second":
            parts.append(f"{value:,.0f} tok/s")
        elif name == "runtime":
            parts.append(f"in {_number(value)} s")
        else:
            parts.append(f"{_NAMES.get(name, name)} {_number(value)}")
    return "  ".join(parts)


class LogLines(ProgressCallback):
    """The progress bar, with each log entry printed as :func:`log_line` writes it rather than as
    the trainer's dict of strings (``{'loss': '6.526', ...}``, with duplicate keys)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            line = log_line(logs, state.global_step, state.max_steps)
            if self.training_bar is not None:
                self.training_bar.write(line)
            else:
                print(line, flush=True)


class PrintedLogLines(PrinterCallback):
    """:class:`LogLines` without a progress bar (``disable_tqdm``)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            print(log_line(logs, state.global_step, state.max_steps), flush=True)


class ExpertLoad(TrainerCallback):
    """How evenly a mixture-of-experts model's routers spread tokens, per MoE layer, logged with
    the loss (and so in TensorBoard): ``expert_load/layer_<i>`` is the busiest expert's share of
    the layer's routed tokens over the share a perfectly even router gives it (1.0: even; the
    number of experts over top-k: every token to the same experts, a collapsed router), and
    ``expert_load/max`` the largest over layers. Counted on this rank, since the last log line,
    from the expert indices each experts module receives. Nothing happens for a dense model."""

    def __init__(self) -> None:
        self._counts: dict[int, Any] = {}
        self._hooks: list = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._remove()
        if model is None:
            return
        experts = [m for m in model.modules() if hasattr(m, "_is_expert_parallel") and hasattr(m, "num_experts")]
        for index, module in enumerate(experts):
            self._hooks.append(module.register_forward_pre_hook(self._counter(index, module.num_experts)))

    def _counter(self, index: int, experts: int):
        def count(_module, inputs):
            if len(inputs) < 2 or not hasattr(inputs[1], "flatten"):
                return
            routed = torch.bincount(inputs[1].detach().flatten().long(), minlength=experts)[:experts].cpu()
            self._counts[index] = routed if index not in self._counts else self._counts[index] + routed

        return count

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs or not self._counts:
            return
        loads = {}
        for index, counts in sorted(self._counts.items()):
            total = float(counts.sum())
            if total:
                loads[f"expert_load/layer_{index}"] = round(float(counts.max()) * len(counts) / total, 3)
        if loads:
            loads["expert_load/max"] = max(loads.values())
            logs.update(loads)
            if state.log_history and state.log_history[-1].get("step") == state.global_step:
                state.log_history[-1].update(loads)
        self._counts.clear()

    def on_train_end(self, args, state, control, **kwargs):
        self._remove()

    def _remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
