"""Building TRL's ``SFTTrainer`` for the run; behaviour we add goes in as callbacks. No training
loop lives here: the trainer runs it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from sft_play import architecture, patches
from sft_play.callbacks import LogLines, PrintedLogLines
from sft_play.config import RunConfig
from sft_play.model import lora_config
from sft_play.run import BatchSplit, Run
from sft_play.training.arguments import trainer_arguments, shard_on_cpu


def trainer_factory(
    config: RunConfig,
    run: Run,
    run_dir: Path,
    model: Any,
    tokenizer: Any,
    train_dataset: Any,
    eval_dataset: Any | None,
    data_collator: Any = None,
    callbacks: list[TrainerCallback] | None = None,
    reference: Any = None,
) -> Callable[..., Any]:
    """A function that builds the run's TRL ``SFTTrainer`` (over already tokenised, and with
    packing already packed, data) at a batch split: the run's own (``make()``), or another one
    (``make(split)``), which is what :func:`sft_play.training.backoff.train_with_backoff` and
    calibration pass. The first trainer wraps the model with the run's adapter
    (:func:`sft_play.model.lora_config`); later ones reuse the wrapped model. The TensorBoard
    callback is moved behind ours, so that what our callbacks add to a log line
    (:class:`sft_play.callbacks.TokenThroughput`) reaches TensorBoard too, and the printed log
    lines are ours (:class:`sft_play.callbacks.LogLines`). A preference run builds TRL's
    ``DPOTrainer`` instead (:mod:`sft_play.training.preference`), with `reference`, the frozen
    copy of the weights, where the run keeps one (None: the adapters switched off, or log-probs
    precomputed)."""
    from transformers import set_seed

    patches.labelled_positions_on_cpu()  # TRL's loss head, on a CPU too
    if run.preference is not None:
        from sft_play.training import preference

        trainer_class = preference.trainer_class(config)
    else:
        trainer_class = _trainer_class(architecture.hidden_size(model.config) if run.offload_activations else None,
                                       run.parallel.sequence_parallel)
    held = {"model": model, "peft_config": lora_config(run), "train_dataset": train_dataset,
            "eval_dataset": eval_dataset}
    layers = architecture.decoder_layers(model, architecture.num_layers(model.config)) if run.parallel.fsdp else None
    layer_classes = sorted({type(layer).__name__ for layer in layers}) if layers is not None else []

    def make(split: BatchSplit | None = None, **overrides: Any) -> Any:
        if run.parallel.splits_sequence:
            if run.kernels.attention == "sdpa":  # (FlashAttention finds the examples itself, with no mask)
                from sft_play.long_rows import attend_by_example

                patches.sdpa_by_example(attend_by_example)
            patches.skip_split_loaders()
        args = trainer_arguments(config, run, run_dir, has_validation=eval_dataset is not None,
                                 layer_classes=layer_classes, batch=split, **overrides)
        shard_on_cpu(args, run)
        if held["peft_config"] is not None:
            # The adapter is created inside the trainer, before it seeds: seed it here, alike on
            # every rank. DDP would copy rank 0's adapter to the others anyway; FSDP2 shards each
            # rank's own, which must therefore be the same.
            set_seed(config.train.seed)
        loraplus = (LoraPlus, {"args": args, "ratio": run.loraplus_lr_ratio}) if run.loraplus_lr_ratio else None
        common = dict(model=held["model"], args=args, data_collator=data_collator,
                      train_dataset=held["train_dataset"],
                      eval_dataset=held["eval_dataset"] if args.eval_strategy != "no" else None,
                      processing_class=tokenizer, peft_config=held["peft_config"], callbacks=callbacks)
        if run.preference is not None:
            # (DPOTrainer takes no optimizer_cls_and_kwargs; the trainer reads the attribute when it
            # creates the optimizer)
            trainer = trainer_class(**common, ref_model=reference, own_adapter=run.method != "full")
            trainer.optimizer_cls_and_kwargs = loraplus
            # a rebuild scores nothing again: the reference log-probs precomputed before training
            held.update(train_dataset=trainer.train_dataset, eval_dataset=trainer.eval_dataset or held["eval_dataset"])
        else:
            trainer = trainer_class(**common, optimizer_cls_and_kwargs=loraplus)
        _log_lines_ours(trainer)
        if run.upcasts_whole_copies:
            in_adapter_dtype(trainer.model, run.adapter_dtype)
        held.update(model=trainer.model, peft_config=None)
        return trainer

    return make


def _log_lines_ours(trainer: Any) -> None:
    """TensorBoard's callback moved behind ours (what they add to a log line reaches it), and the
    progress bar's and printer's log lines replaced by ours."""
    from transformers.integrations import TensorBoardCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    board = trainer.pop_callback(TensorBoardCallback)
    if board is not None:
        trainer.add_callback(board)
    for default, ours in ((ProgressCallback, LogLines), (PrinterCallback, PrintedLogLines)):
        if trainer.pop_callback(default) is not None:
            trainer.add_callback(ours)


def in_adapter_dtype(model: Any, dtype: str) -> None:
    """Cast every parameter `model` trains to `dtype`, in place (:attr:`Run.upcasts_whole_copies`):
    peft upcasts its adapters of a 16-bit base but copies ``lora.modules_to_save`` as they are,
    which AdamW would then step in bf16 with bf16 states. LLaMA-Factory casts its trainable
    parameters to fp32 likewise.

    Args:
        model: the model the trainer trains (peft's, wrapped).
        dtype: a torch dtype's name (the run's ``adapter_dtype``).
    """
    import torch

    wanted = getattr(torch, dtype)
    for parameter in model.parameters():
        if parameter.requires_grad and parameter.is_floating_point() and parameter.dtype != wanted:
            parameter.data = parameter.data.to(wanted)


def _trainer_class(offload_hidden_size: int | None = None, sequence_parallel: int = 1) -> type:
    """TRL's SFTTrainer as the run uses it; with `offload_hidden_size`, the hidden states saved for
    backward are kept in host memory (:class:`sft_play.long_rows.OffloadedHiddenStates`); with
    `sequence_parallel` above 1, the split sequence's gradient is the one of its loss."""
    from trl import SFTTrainer

    class Trainer(SFTTrainer):
        """TRL's SFTTrainer, without the model card it writes into checkpoints/ at each save (of a
        model named "checkpoints", fine-tuned from "None"): the run's own card goes into model/
        when it finishes (:mod:`sft_play.model_card`)."""

        def create_model_card(self, *args: Any, **kwargs: Any) -> None:
            return None

        def compute_loss_context_manager(self):  # around the forward, where tensors are saved for backward
            stack = super().compute_loss_context_manager()
            if offload_hidden_size is not None and self.model.training:
                from sft_play.long_rows import OffloadedHiddenStates

                stack.enter_context(OffloadedHiddenStates(offload_hidden_size))
            return stack

        def get_batch_samples(self, epoch_iterator, num_batches, device):
            batches, items = super().get_batch_samples(epoch_iterator, num_batches, device)
            if sequence_parallel > 1 and items is None and batches and "shift_labels" in batches[0]:
                # DeepSpeed's loader hands out each process's share of the rows with their labels
                # shifted; the trainer counts none of them. Every labelled token of the step's rows,
                # on every process: each counted once, by the process that holds it
                local = sum((batch["shift_labels"] != -100).sum() for batch in batches).to(device)
                items = self.accelerator.reduce(local, reduction="sum")
            return batches, items

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                          num_items_in_batch=num_items_in_batch)
            if sequence_parallel == 1 or not model.training:
                return result
            loss = result[0] if return_outputs else result
            if num_items_in_batch is not None:
                loss = loss * _share_of_the_step(inputs, num_items_in_batch, self.args.world_size // sequence_parallel,
                                                 self.current_gradient_accumulation_steps)
            # transformers' loss for a split sequence (deepspeed_sp_compute_loss) all-gathers the
            # shards' losses differentiably, whose backward sums each shard's gradient over the
            # processes, and ZeRO then sums them over the processes again instead of averaging
            # (DeepSpeed#5248): every gradient would be `sequence_parallel` times too large. The
            # loss keeps its value; its gradient is divided back.
            loss = loss / sequence_parallel + (loss * (1 - 1 / sequence_parallel)).detach()
            return (loss, result[1]) if return_outputs else loss

    return Trainer


def _share_of_the_step(inputs: dict, tokens_in_step: Any, data_parallel: int, accumulation: int) -> Any:
    """What a split micro-batch's loss is weighed by so that the step's gradient is its tokens'
    mean, as it is for whole rows (the trainer's ``num_items_in_batch``): transformers' loss for a
    split micro-batch is the mean over its own labelled tokens (on every process of its split), and
    the trainer divides it by the accumulation; the micro-batch's tokens are `tokens_in_step`'s
    share, and ZeRO averages the data-parallel groups' gradients."""
    import torch
    from deepspeed.utils import groups

    tokens = (inputs["shift_labels"] != -100).sum()
    torch.distributed.all_reduce(tokens, group=groups._get_sequence_parallel_group())
    return (tokens * data_parallel * accumulation / tokens_in_step).detach()


class LoraPlus:
    """LoRA+ (``lora.loraplus_lr_ratio``): the run's optimizer (``train.optimizer`` as the trainer
    makes it) with peft's parameter groups, the B matrices at `ratio` times the learning rate.
    A factory the trainer calls when it creates the optimizer (``optimizer_cls_and_kwargs``), so
    that the groups hold the parameters as they are then (after FSDP2 has sharded them)."""

    def __call__(self, model: Any, *, args: Any, ratio: float) -> Any:
        from peft.optimizers import create_loraplus_optimizer
        from transformers import Trainer

        optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
        optimizer = create_loraplus_optimizer(model, optimizer_cls, loraplus_lr_ratio=ratio,
                                              loraplus_weight_decay=args.weight_decay, **kwargs)
        if kwargs.get("optim_bits") == 8:  # as the trainer does for 8-bit optimizers: embeddings' states in 32 bits
            import bitsandbytes
            from torch import nn

            manager = bitsandbytes.optim.GlobalOptimManager.get_instance()
            for module in model.modules():
                if isinstance(module, nn.Embedding):
                    manager.register_module_override(module, "weight", {"optim_bits": 32})
        return optimizer
