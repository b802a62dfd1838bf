"""What the logs say: one readable line per logged step, the true token count and throughput,
the last step's loss, and mixture-of-experts load per layer."""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

logger = logging.getLogger("sft_play.callbacks")


class LogLastStep(TrainerCallback):
    """Logs the last step, whatever ``train.logging_steps`` is: the run's final loss (the summary's
    ``last_loss``, the ``loss: a -> b`` line) is then its end's, not its first step's when the
    run is shorter than one logging interval."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.max_steps and state.global_step >= state.max_steps:
            control.should_log = True


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
