"""The trainer's arguments, from the resolved run: TRL's ``SFTConfig``, DeepSpeed's config (the
JSON of ``distributed.deepspeed_config`` with the run's stage and offload), FSDP2's settings and
mixed-precision policy, and what accelerate is told."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sft_play import patches
from sft_play.config import RunConfig
from sft_play.errors import UserError
from sft_play.run import BatchSplit, Run


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


def trainer_arguments(config: RunConfig, run: Run, run_dir: Path, has_validation: bool,
                      layer_classes: list[str] | None = None, batch: BatchSplit | None = None, **overrides: Any) -> Any:
    """TRL's ``SFTConfig`` for the run (``DPOConfig`` or ``KTOConfig`` for preference tuning); every value comes
    from the run config or the resolved run.
    `batch` is the split to train at (default the run's, as planned; calibration and backoff
    pass theirs). `layer_classes` names the model's decoder layer classes (FSDP2's units).
    `overrides` replace any of them, e.g. for calibration steps. (Long by design: one table of
    every argument, each beside its reason, read top to bottom.)"""
    from trl import SFTConfig

    batch = batch or run.batch
    if batch is None:
        raise ValueError("the run has no batch split yet: plan it first (run.with_changes(batch=plan.split))")
    precision = run.precision
    train, data = config.train, config.data
    evaluate = has_validation and train.eval_steps > 0
    settings = dict(
        output_dir=str(run_dir / "checkpoints"),
        per_device_train_batch_size=batch.micro_batch_size,
        per_device_eval_batch_size=batch.micro_batch_size,
        gradient_accumulation_steps=batch.gradient_accumulation_steps,
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
        use_liger_kernel=run.kernels.liger,
        # the trainer binds Liger's SwiGLU over each MLP's forward when it trains, which would undo
        # the tiles (sft_play.long_rows.tile_mlps): tiled MLPs keep their own
        liger_kernel_config={"swiglu": False} if run.kernels.liger and run.kernels.tiled_mlp else None,
        max_length=data.max_seq_length,
        # MoE: the load-balancing loss, with the model's own coefficient unless the config says
        router_aux_loss_coef=train.router_aux_loss_coef,
        packing=False,  # the data arrives packed (sft_play.data) and batched by our collator
        # ...tokenised, truncated and labelled too: TRL's preparation would map and filter every row again
        dataset_kwargs={"skip_prepare_dataset": True},
        dataset_num_proc=data.num_proc if isinstance(data.num_proc, int) else None,
        # Every adapter/parameter gets a gradient each step (non-reentrant checkpointing keeps it so),
        # but a vision encoder or projector that trains gets none from a batch without images
        ddp_find_unused_parameters=run.vision and (config.finetune.train_vision_tower or config.finetune.train_projector),
        # the rows' image references and token types reach the collator (the trainer keeps only the
        # columns the model's forward names)
        remove_unused_columns=not run.images,
        ddp_timeout=max(1, round(config.distributed.timeout_minutes * 60)),
        dataloader_pin_memory=run.on_cuda,
        use_cpu=run.placement.cpu_processes,
        deepspeed=deepspeed_config(config, run),
        fsdp=True if run.parallel.fsdp else None,
        fsdp_config=fsdp_settings(run, layer_classes or []),
        accelerator_config=accelerator_settings(run),
        parallelism_config=sequence_parallelism(run) or context_parallelism(run),
    )
    if run.preference is not None:
        from trl import DPOConfig, KTOConfig

        from sft_play.training.preference import dpo_settings, kto_settings

        for sft_only in ("packing", "dataset_kwargs", "neftune_noise_alpha"):
            del settings[sft_only]
        settings["remove_unused_columns"] = True  # the pairs' ids reach TRL's collator, their file:row does not
        if run.preference.objective == "kto":
            arguments = KTOConfig(**{**settings, **kto_settings(config, run, batch), **overrides})
        else:
            arguments = DPOConfig(**{**settings, **dpo_settings(config, run, batch), **overrides})
    else:
        arguments = SFTConfig(**{**settings, **overrides})
    # With bf16 and fp16 both off, transformers takes the autocast mode from ACCELERATE_MIXED_PRECISION,
    # which `accelerate launch` exports from its config file: the run's precision wins
    arguments.mixed_precision = run.precision.mixed
    policy = fsdp_mixed_precision(run, config.quantization.quant_storage)
    if policy and arguments.fsdp_plugin_args is not None:  # transformers has no argument for it
        arguments.fsdp_plugin_args["mixed_precision_policy"] = policy
    return arguments


def sequence_parallelism(run: Run) -> Any:
    """accelerate's ``ParallelismConfig`` for a run that splits each row across processes
    (DeepSpeed Ulysses, which accelerate sets up when it prepares the model under DeepSpeed): the
    groups of ``sequence_parallel`` processes, the data-parallel groups of the rest, and the
    model's attention kernel, which Ulysses wraps. Rows may differ in length from batch to batch
    (the collator pads each to a multiple of the split). None without a split."""
    if not run.parallel.splits_sequence:
        return None
    from accelerate.utils import DeepSpeedSequenceParallelConfig, ParallelismConfig

    return ParallelismConfig(
        sp_size=run.parallel.sequence_parallel, sp_backend="deepspeed", dp_replicate_size=run.parallel.data_parallel,
        sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True,
                                                   sp_attn_implementation=run.kernels.attention))


def context_parallelism(run: Run) -> Any:
    """accelerate's ``ParallelismConfig`` for torch's context parallelism under FSDP2: rows split
    across ``context_parallel`` processes (ring attention over SDPA, the K/V chunks all-gathered),
    the parameters sharded over the rest. The trainer shards each batch's tokens and shifts the
    labels itself (``Trainer._prepare_context_parallel_inputs``). None without it."""
    if run.parallel.context_parallel == 1:
        return None
    from accelerate.utils import ParallelismConfig, TorchContextParallelConfig

    return ParallelismConfig(cp_size=run.parallel.context_parallel, cp_backend="torch",
                             dp_shard_size=run.parallel.data_parallel,
                             cp_handler=TorchContextParallelConfig(cp_comm_strategy="allgather"))


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
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(**arguments.fsdp_plugin_args)
    if run.precision.mixed != "no":
        plugin.set_mixed_precision(run.precision.mixed)
    state = Accelerator(cpu=True, mixed_precision=run.precision.mixed).state
    state.fsdp_plugin = plugin
    patches.fsdp_on_cpu()
