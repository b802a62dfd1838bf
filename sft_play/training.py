"""Building TRL's ``SFTTrainer`` from the run config and the plan; behaviour we add goes in as
callbacks. No training loop lives here: the trainer runs it.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from sft_play import architecture, checkpoints, planner
from sft_play.callbacks import LogLines, PrintedLogLines, max_over_ranks
from sft_play.config import RunConfig
from sft_play.errors import OutOfMemory, UserError
from sft_play.model import lora_config, score_labelled_positions_only
from sft_play.planner import calibrate as calibration
from sft_play.planner import memory
from sft_play.planner.predict import recipe_for
from sft_play.run import BatchSplit, Run

logger = logging.getLogger(__name__)


def deepspeed_config(config: RunConfig, run: Run) -> dict | None:
    """The DeepSpeed config for a ``deepspeed_*`` strategy: ``distributed.deepspeed_config`` (JSON
    whose ``auto`` values the trainer fills from its arguments, i.e. from the plan and the run
    config: micro-batch, accumulation, clipping, precision, bucket sizes), switched to stage 3
    for ``deepspeed_zero3`` and with optimizer states in CPU memory for
    ``distributed.offload_optimizer``. None for DDP."""
    if not run.parallel.deepspeed:
        return None
    ds = json.loads(Path(config.distributed.deepspeed_config).read_text())
    zero = ds.setdefault("zero_optimization", {})
    if run.parallel.strategy.zero3:
        zero["stage"] = 3
        for key in ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
            zero.setdefault(key, "auto")
        zero.setdefault("stage3_gather_16bit_weights_on_model_save", True)
    if run.parallel.offload_parameters:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if run.parallel.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        # ZeRO-Offload steps on the CPU with DeepSpeed's own Adam; the trainer fills the "auto"s
        ds["optimizer"] = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                     "weight_decay": "auto"}}
    if "optimizer" in ds and run.loraplus_lr_ratio:
        # DeepSpeed then builds the optimizer itself, from this block, without LoRA+'s groups
        raise UserError(f"lora.loraplus_lr_ratio needs the optimizer the trainer makes, and DeepSpeed builds its own "
                        f"here ({'optimizer offload' if run.parallel.offload_optimizer else 'the optimizer block of ' + config.distributed.deepspeed_config}): "
                        "leave LoRA+ out, or train without optimizer offload (and without an optimizer block)")
    return ds


def skip_deepspeed_inference_comm() -> None:
    """DeepSpeed on the CPU compiles a shared-memory all-reduce op when its communication backend
    starts (``deepspeed.comm.torch.build_shm_op``: ~40 s of C++ build on 2 cores, on the first
    run in each TORCH_EXTENSIONS_DIR). Only ``inference_all_reduce`` uses it; training's
    collectives go through torch.distributed (gloo). Marking it incompatible skips the build."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def pin_mixed_precision(run: Run) -> None:
    """Say the run's precision (and whether it shards with FSDP) to accelerate and transformers
    through the environment too.

    ``accelerate launch`` exports ``ACCELERATE_MIXED_PRECISION`` from its config file, and
    transformers' arguments (and accelerate's state) take it whenever ``bf16`` and ``fp16`` are
    both off: an accelerate config written for bf16 GPUs would turn ``train.mixed_precision=no``
    into bf16 autocast behind the plan's back."""
    os.environ["ACCELERATE_MIXED_PRECISION"] = run.precision.mixed
    # The same for FSDP: an accelerate config file that says FSDP exports ACCELERATE_USE_FSDP,
    # which turns FSDP on for a ddp run; an fsdp2 run passes its own plugin (fsdp_settings)
    os.environ["ACCELERATE_USE_FSDP"] = "true" if run.parallel.fsdp else "false"


def fsdp_settings(run: Run, layer_classes: list[str]) -> dict[str, Any] | None:
    """transformers' ``fsdp_config`` for an ``fsdp2`` run: each decoder layer (`layer_classes`,
    found in the loaded model) one FSDP unit (accelerate adds its own units for an untied
    embedding and for the final norm with the head; the root holds the rest); parameters resharded
    after the forward as the run says; activation checkpointing by FSDP's own wrapper where the
    run says (:attr:`Run.fsdp_checkpointing`: a checkpoint per layer without the extra
    all-gather that checkpointing outside FSDP costs, but without the random state either);
    sharded checkpoints (``torch.distributed.checkpoint``: every rank writes its own shard);
    parameters, gradients and optimizer states in CPU memory with
    ``offload_parameters``."""
    if not run.parallel.fsdp:
        return None
    return {
        "version": 2,
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "transformer_layer_cls_to_wrap": layer_classes,
        "reshard_after_forward": run.parallel.reshard_after_forward,
        "activation_checkpointing": run.fsdp_checkpointing,
        "cpu_offload": run.parallel.offload_parameters,
        "state_dict_type": "SHARDED_STATE_DICT",
    }


def fsdp_mixed_precision(run: Run, quant_storage: str | None = None) -> dict[str, Any] | None:
    """FSDP2's mixed-precision policy: layers gathered and computed in the run's compute dtype,
    gradients reduced in fp32 (accelerate's default reduces in bf16, which DDP and ZeRO do not;
    fp32 keeps FSDP2's loss with theirs). QLoRA gathers in the packed weights' storage dtype
    (`quant_storage`): FSDP2 casts what it gathers to ``param_dtype`` by value, which would
    destroy packed 4-bit weights stored in another dtype."""
    if not run.parallel.fsdp or run.precision.mixed == "no":
        return None
    import torch

    compute = getattr(torch, run.precision.compute_dtype)
    gathered = getattr(torch, quant_storage) if run.method == "qlora" and quant_storage else compute
    return {"param_dtype": gathered, "reduce_dtype": torch.float32, "output_dtype": compute}


def sft_arguments(config: RunConfig, run: Run, run_dir: Path, has_validation: bool,
                  layer_classes: list[str] | None = None, **overrides: Any) -> Any:
    """TRL ``SFTConfig`` for the run; every value comes from the run config or the resolved run
    (its ``batch``: the plan's split, or the one calibration or backoff changed it to).
    `layer_classes` names the model's decoder layer classes (FSDP2's units).
    `overrides` replace any of them, e.g. for calibration steps."""
    from trl import SFTConfig

    if run.batch is None:
        raise ValueError("the run has no batch split yet: plan it first (run.with_changes(batch=plan.split))")
    pin_mixed_precision(run)
    precision = run.precision
    train, data = config.train, config.data
    evaluate = has_validation and train.eval_steps > 0
    settings = dict(
        output_dir=str(run_dir / "checkpoints"),
        per_device_train_batch_size=run.batch.micro_batch_size,
        per_device_eval_batch_size=run.batch.micro_batch_size,
        gradient_accumulation_steps=run.batch.gradient_accumulation_steps,
        learning_rate=train.learning_rate,
        lr_scheduler_type="cosine_with_min_lr" if train.min_lr_ratio else train.lr_scheduler,
        lr_scheduler_kwargs={"min_lr_rate": train.min_lr_ratio} if train.min_lr_ratio else None,
        # a value below 1 is a share of the steps
        warmup_steps=train.warmup_steps if train.warmup_steps is not None else train.warmup_ratio,
        weight_decay=train.weight_decay,
        max_grad_norm=train.max_grad_norm,
        neftune_noise_alpha=train.neftune_noise_alpha,
        optim=run.optimizer,
        num_train_epochs=train.num_epochs,
        max_steps=train.max_steps,
        bf16=precision.mixed == "bf16",
        fp16=precision.mixed == "fp16",
        # FSDP2 checkpoints with its own wrapper where the run says (fsdp_settings)
        activation_checkpointing=run.gradient_checkpointing and not run.fsdp_checkpointing,
        activation_checkpointing_kwargs=({"use_reentrant": False}
                                         if run.gradient_checkpointing and not run.fsdp_checkpointing else None),
        logging_steps=train.logging_steps,
        logging_first_step=True,
        logging_nan_inf_filter=False,  # a NaN loss must show (and stop the run), not be averaged away
        save_strategy="steps" if train.save_steps > 0 else "no",
        save_steps=train.save_steps if train.save_steps > 0 else 500,
        save_total_limit=None,  # CheckpointMarker deletes old checkpoints, once the new one is marked complete
        eval_strategy="steps" if evaluate else "no",
        eval_steps=train.eval_steps if evaluate else None,
        report_to=(["tensorboard"] if train.tensorboard else []) + list(train.report_to) or "none",
        seed=train.seed,
        data_seed=train.seed,
        full_determinism=train.deterministic,
        include_num_input_tokens_seen="non_padding",  # also logs train_tokens_per_second
        # Liger's layer kernels (TRL keeps its own fused, chunked loss head)
        use_liger_kernel=run.liger,
        max_length=data.max_seq_length,
        # MoE: the load-balancing loss, with the model's own coefficient unless the config says
        router_aux_loss_coef=train.router_aux_loss_coef,
        packing=False,  # the data arrives packed (sft_play.data) and batched by our collator
        # ...tokenised, truncated and labelled too: TRL's preparation would map and filter every row again
        dataset_kwargs={"skip_prepare_dataset": True},
        dataset_num_proc=data.num_proc,
        # Every adapter/parameter gets a gradient each step (non-reentrant checkpointing keeps it so)
        ddp_find_unused_parameters=False,
        ddp_timeout=max(1, round(config.distributed.timeout_minutes * 60)),
        dataloader_pin_memory=run.on_cuda,
        use_cpu=run.placement.cpu_processes,
        deepspeed=deepspeed_config(config, run),
        fsdp=True if run.parallel.fsdp else None,
        fsdp_config=fsdp_settings(run, layer_classes or []),
        accelerator_config=accelerator_settings(run),
    )
    arguments = SFTConfig(**{**settings, **overrides})
    policy = fsdp_mixed_precision(run, config.quantization.quant_storage)
    if policy and arguments.fsdp_plugin_args is not None:  # transformers has no argument for it
        arguments.fsdp_plugin_args["mixed_precision_policy"] = policy
    return arguments


def accelerator_settings(run: Run) -> dict[str, Any] | None:
    settings: dict[str, Any] = {}
    if run.placement.deepspeed_on_cpu or run.placement.fsdp_on_cpu:
        # keep the process group (and, for FSDP2, the state shard_on_cpu configures) the training
        # flow set up: transformers would otherwise re-form it and see one process or plain DDP
        settings["use_configured_state"] = True
    if run.parallel.fsdp:
        # Reduce-scatter every micro-batch: each rank keeps only its gradient shard. Without it
        # accelerate skips the sync between micro-batches, and FSDP2 then holds every layer's
        # unsharded gradient until the step: the whole model's gradients on each GPU.
        settings["gradient_accumulation_kwargs"] = {"sync_each_batch": True}
    return settings or None


def shard_on_cpu(arguments: Any, run: Run) -> None:
    """FSDP2 in CPU processes (tests, GPU-less machines): accelerate turns FSDP on only for
    GPU-type processes (``AcceleratorState``: the FSDP branch sits under the multi-GPU types),
    while ``fully_shard`` itself runs on CPU tensors over gloo. The shared accelerator state is
    set up here as accelerate sets it up on GPUs, and the trainer uses it
    (``use_configured_state``). Nothing is done on GPUs."""
    if not run.placement.fsdp_on_cpu:
        return
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(**arguments.fsdp_plugin_args)
    if run.precision.mixed != "no":
        plugin.set_mixed_precision(run.precision.mixed)
    state = Accelerator(cpu=True, mixed_precision=run.precision.mixed).state
    state.fsdp_plugin = plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # read by both states


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
) -> Callable[..., Any]:
    """A function that builds the run's TRL ``SFTTrainer`` (over already tokenised, and with
    packing already packed, data) for a run: `run` itself, or the same run with another batch
    split (``run.with_changes(batch=...)``), which is what :func:`train_with_backoff` and
    calibration pass. The first trainer wraps the model with the run's adapter
    (:func:`sft_play.model.lora_config`); later ones reuse the wrapped model. The TensorBoard
    callback is moved behind ours, so that what our callbacks add to a log line
    (:class:`sft_play.callbacks.TokenThroughput`) reaches TensorBoard too, and the printed log
    lines are ours (:class:`sft_play.callbacks.LogLines`)."""
    from transformers import set_seed
    from transformers.integrations import TensorBoardCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    score_labelled_positions_only()  # TRL's loss head, on a CPU too
    trainer_class = _trainer_class()
    held = {"model": model, "peft_config": lora_config(run)}
    layers = architecture.decoder_layers(model, architecture.num_layers(model.config)) if run.parallel.fsdp else None
    layer_classes = sorted({type(layer).__name__ for layer in layers}) if layers is not None else []

    def make(this_run: Run, **overrides: Any) -> Any:
        args = sft_arguments(config, this_run, run_dir, has_validation=eval_dataset is not None,
                             layer_classes=layer_classes, **overrides)
        shard_on_cpu(args, this_run)
        if held["peft_config"] is not None:
            # The adapter is created inside the trainer, before it seeds: seed it here, alike on
            # every rank. DDP would copy rank 0's adapter to the others anyway; FSDP2 shards each
            # rank's own, which must therefore be the same.
            set_seed(config.train.seed)
        trainer = trainer_class(
            model=held["model"],
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset if args.eval_strategy != "no" else None,
            processing_class=tokenizer,
            peft_config=held["peft_config"],
            callbacks=callbacks,
            optimizer_cls_and_kwargs=(LoraPlus, {"args": args, "ratio": this_run.loraplus_lr_ratio})
            if this_run.loraplus_lr_ratio else None,
        )
        board = trainer.pop_callback(TensorBoardCallback)
        if board is not None:
            trainer.add_callback(board)
        for default, ours in ((ProgressCallback, LogLines), (PrinterCallback, PrintedLogLines)):
            if trainer.pop_callback(default) is not None:
                trainer.add_callback(ours)
        held.update(model=trainer.model, peft_config=None)
        return trainer

    return make


def _trainer_class() -> type:
    from trl import SFTTrainer

    class Trainer(SFTTrainer):
        """TRL's SFTTrainer, without the model card it writes into checkpoints/ at each save (of a
        model named "checkpoints", fine-tuned from "None"): the run's own card goes into model/
        when it finishes (:mod:`sft_play.model_card`)."""

        def create_model_card(self, *args: Any, **kwargs: Any) -> None:
            return None

    return Trainer


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


def measure_peaks(make_trainer: Callable[..., Any], run: Run, micros: tuple[int, ...] = (1, 2),
                  steps: int = 2) -> dict[int, int]:
    """The real peak GPU memory of `steps` training steps at each micro-batch in `micros`
    (``torch.cuda.max_memory_reserved`` plus the CUDA context as the planner counts it, the
    largest over all ranks). Learning rate 0, nothing saved or logged: the model is unchanged."""
    import torch

    peaks = {}
    for micro in micros:
        trial = run.with_changes(batch=BatchSplit(micro, 1, run.parallel.world_size, micro * run.parallel.world_size))
        trainer = make_trainer(trial, max_steps=steps, learning_rate=0.0,
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
    (:func:`sft_play.planner.choose.decide_split`)."""
    outside = memory.outside_allocator_bytes(recipe_for(run), on_cuda=True, measured=run.outside_allocator_measured)
    measured = {m: peak + outside for m, peak in measure_peaks(make_trainer, run).items()}
    predicted = {m: planner.peak_at(shape, run, m) for m in measured}
    return calibration.calibrated_plan(plan, measured, predicted, config.train, config.planner)


def train_with_backoff(
    make_trainer: Callable[..., Any],
    run: Run,
    resume_from_checkpoint: str | None = None,
) -> tuple[Any, Run]:
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
        make_trainer: builds a trainer for a run (:func:`trainer_factory`).
        run: the resolved run, with the planned batch split.
        resume_from_checkpoint: a checkpoint to start from.

    Returns:
        The trainer that finished, and the run as it trained (its final batch split).

    Raises:
        OutOfMemory: out of memory at micro-batch 1, or with several processes (where one rank
            cannot change its batch alone).
    """
    import torch
    from accelerate.utils.memory import should_reduce_batch_size

    while True:
        split = run.batch
        trainer = make_trainer(run)
        try:
            trainer.train(resume_from_checkpoint=resume_from_checkpoint)
            return trainer, run
        except RuntimeError as error:
            if not should_reduce_batch_size(error):
                raise
            if split.micro_batch_size == 1:
                raise OutOfMemory(
                    "out of memory at micro-batch 1: nothing left to halve. `make plan` lists what would fit "
                    "(gradient checkpointing, QLoRA, ZeRO-2, shorter sequences, more GPUs)"
                ) from error
            # several processes, or a model DeepSpeed or FSDP2 has wrapped in place: restart instead
            if (trainer.args.world_size > 1 or getattr(trainer, "is_deepspeed_enabled", False)
                    or getattr(trainer, "is_fsdp_enabled", False)):
                raise OutOfMemory(
                    f"out of memory at micro-batch {split.micro_batch_size} on one of {trainer.args.world_size} "
                    f"processes; restart with train.micro_batch_size={split.micro_batch_size // 2} "
                    f"(and RESUME=auto to continue)"
                ) from error
            step = trainer.state.global_step
            trainer.optimizer.zero_grad(set_to_none=True)
            trainer._save_checkpoint(trainer.model, trial=None)  # the state before the failed step
            resume_from_checkpoint = str(Path(trainer.args.output_dir) / f"checkpoint-{step}")
            checkpoints.write_marker(Path(resume_from_checkpoint), step)
        smaller = split.halved()
        logger.warning(
            "out of memory at micro-batch %d (step %d): continuing from step %d with %s",
            split.micro_batch_size, step + 1, step, smaller.describe(),
        )
        del trainer
        gc.collect()
        if run.on_cuda:
            torch.cuda.empty_cache()
        run = run.with_changes(batch=smaller)


def weights_fingerprint(model: Any) -> str:
    """A short digest of the trainable parameters' values (per-tensor float64 sums) as this rank
    holds them: equal on every rank when data-parallel training kept the replicas in step; under
    FSDP2, of this rank's shards (equal between runs that trained the same way)."""
    sums = [f"{name}:{_local(param).detach().double().sum().item():.12e}"
            for name, param in sorted(model.named_parameters()) if param.requires_grad]
    return hashlib.sha1(";".join(sums).encode()).hexdigest()[:16]


def _local(param: Any) -> Any:
    """This rank's part of a parameter: FSDP2's are DTensors holding a shard."""
    return param.to_local() if hasattr(param, "to_local") else param


def save_final_model(trainer: Any, model_dir: Path, weights_dtype: str | None = None) -> None:
    """Save the trained model (unwrapped: an adapter, or the full model) and the tokenizer.

    FSDP2's checkpoints are sharded; the model folder holds whole tensors, gathered from every
    rank's shard (collectives) and written by the main process, so that merge, generate and
    eval read it as any other: an adapter's trainable tensors only (not the frozen base, which
    would all land in the main process's memory), or the full model in `weights_dtype` (FSDP2
    trains fp32 copies of 16-bit weights; the folder keeps the dtype the run loaded, as DDP's
    does). The trainer also pickles its arguments beside them; the run's ``config.yaml``
    already says everything they would, and only safetensors and plain text belong in a model
    folder.
    """
    if getattr(trainer, "is_fsdp_enabled", False):
        _save_sharded(trainer, model_dir, weights_dtype)
    else:
        trainer.save_model(str(model_dir))
    if trainer.is_world_process_zero():
        (model_dir / "training_args.bin").unlink(missing_ok=True)


def _save_sharded(trainer: Any, model_dir: Path, weights_dtype: str | None) -> None:
    import torch

    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    if hasattr(unwrapped, "peft_config"):  # an adapter: gather what trained, tensor by tensor
        state_dict = {}
        for name, param in trainer.model.named_parameters():
            if param.requires_grad:
                whole = param.full_tensor() if hasattr(param, "full_tensor") else param
                if trainer.is_world_process_zero():
                    state_dict[name] = whole.detach().cpu()
    else:
        state_dict = trainer.accelerator.get_state_dict(trainer.model)  # whole tensors, in CPU memory
        dtype = getattr(torch, weights_dtype) if weights_dtype else None
        if dtype is not None and state_dict:
            state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
    if trainer.is_world_process_zero():
        trainer._save(str(model_dir), state_dict=state_dict)
        config_file = model_dir / "config.json"
        if weights_dtype and not hasattr(unwrapped, "peft_config") and config_file.is_file():
            # save_pretrained writes the dtype of the fp32 parameters FSDP2 trained, not the tensors' own
            saved = json.loads(config_file.read_text())
            saved["dtype"] = weights_dtype
            config_file.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    trainer.accelerator.wait_for_everyone()


def loss_history(trainer: Any) -> list[tuple[int, float]]:
    """(step, training loss) for every logged step."""
    return [(e["step"], e["loss"]) for e in trainer.state.log_history if "loss" in e and math.isfinite(e["loss"])]


def write_summary(trainer: Any, run_dir: Path, extra: dict[str, Any]) -> dict[str, Any]:
    """What the run did, as ``summary.json`` in the run folder; returns the same mapping."""
    losses = loss_history(trainer)
    final = next((e for e in reversed(trainer.state.log_history) if "train_runtime" in e), {})
    runtime, segments = final.get("train_runtime"), 1
    try:  # a resumed run: the time of the segments before it, which the summary they stopped with kept
        before = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        before = {}
    if before.get("interrupted") and runtime is not None:
        runtime += before.get("train_runtime_s") or 0.0
        segments += before.get("segments", 1)
    summary = {
        "global_step": trainer.state.global_step,
        "first_loss": losses[0][1] if losses else None,
        "last_loss": losses[-1][1] if losses else None,
        "last_eval_loss": next((e["eval_loss"] for e in reversed(trainer.state.log_history) if "eval_loss" in e), None),
        "losses": losses,
        "train_runtime_s": runtime,  # every segment's, a resumed run's too
        "segments": segments,
        "tokens_seen": trainer.state.num_input_tokens_seen,
        "mixed_precision": str(trainer.accelerator.mixed_precision),  # what autocast really ran
        "distributed_type": str(trainer.accelerator.distributed_type).rsplit(".", 1)[-1],  # and how it shared the work
        **extra,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
