"""What stops training: a signal (finish the step, save, stop), NaN or infinite steps, and
early stopping on the validation loss."""

from __future__ import annotations

import logging
import math
import signal
import threading
import time

import torch
from transformers import TrainerCallback

from sft_play.callbacks.ranks import any_rank
# A signal that arrives again within this window is the same request delivered twice (a terminal
# or a cluster signals every process, and the launcher passes it on as well)
from sft_play.stopping import DUPLICATE_SIGNAL_WINDOW_S, LAUNCHER_GONE

logger = logging.getLogger("sft_play.callbacks")


def _say(message: str, *args) -> None:
    """Log from a signal handler, on a thread of its own. The handler may run inside a write to the
    same stream (a write blocked on a full pipe runs pending handlers): logging from there raised
    "reentrant call inside BufferedWriter", printed a traceback and lost the message. The thread
    waits for that write to finish instead."""
    threading.Thread(target=logger.warning, args=(message, *args), name="stop-message").start()


class GracefulStop(TrainerCallback):
    """On SIGTERM, SIGINT or SIGHUP, finish the current step, save a checkpoint, and stop.

    A second signal more than :data:`DUPLICATE_SIGNAL_WINDOW_S` after the first stops at once
    (SIGINT raises KeyboardInterrupt); one within it is the same request delivered twice (by the
    terminal or the cluster to every process, and by the launcher) and changes nothing. After
    training, ``received`` names the signal and ``stopped_at`` the step, for the entry script's
    message. :meth:`install` may be called before training, so that a signal during start-up
    is not lost.
    """

    # SIGHUP: the terminal or ssh session closed; LAUNCHER_GONE: the launcher ended (stopping.die_with_parent)
    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, LAUNCHER_GONE)

    def __init__(self) -> None:
        self.received: str | None = None
        self.stopped_at: int | None = None
        self.final_save = False  # set while the final model is saved: a stop lets it finish
        self._first_at = 0.0
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame):
        now = time.monotonic()
        if self.received is not None:
            if now - self._first_at < DUPLICATE_SIGNAL_WINDOW_S or signum == LAUNCHER_GONE:
                return  # the same request again, or the launcher's end while a stop is under way
            previous = self._previous.get(signum)  # asked twice: stop now
            self.restore()
            if callable(previous):
                previous(signum, frame)
            raise KeyboardInterrupt
        self.received = "the end of its launcher" if signum == LAUNCHER_GONE else signal.Signals(signum).name
        self._first_at = now
        if self.final_save:
            _say("received %s during the final save: it finishes first (send it again to stop at once)",
                 self.received)
        else:
            _say("received %s: finishing this step, saving a checkpoint, then stopping "
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
        self.restore()

    def restore(self) -> None:
        """The handlers there were before :meth:`install` (or nothing, where it did not install)."""
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


class AlreadyTrained(Exception):
    """Training resumed from a checkpoint of its last step: nothing is left to train."""


class NothingPastTheEnd(TrainerCallback):
    """Resumed from a checkpoint of the run's last step (killed before its final save), the trainer
    would train one step more than the run has (step 21 of 20). This stops it before that step,
    with the checkpoint's weights and history loaded, so that the run only saves; ``reached`` then
    holds that step."""

    reached: int | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.max_steps > 0 and state.global_step >= state.max_steps:
            self.reached = state.global_step
            raise AlreadyTrained(state.global_step)
