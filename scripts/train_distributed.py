"""Train: the entry point every launch target calls.

Runs alone (python), under torchrun, under accelerate launch and under deepspeed; every rank
runs this same main():

  config -> hardware -> tokenizer -> data -> plan -> model -> SFTTrainer -> train -> save

Usage: python scripts/train_distributed.py --config configs/run_tiny.yaml [key=value ...]
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from datetime import timedelta
from pathlib import Path

from sft_play import cli
from sft_play import config as config_module
from sft_play.launch import EXIT_INTERRUPTED  # 75: stopped by a signal after saving

logger = logging.getLogger("sft_play.train")


def main() -> int:
    args = cli.config_parser(__doc__.splitlines()[0]).parse_args()
    cli.setup_logging()

    config = config_module.load(args.config, args.overrides)
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):  # before DeepSpeed is imported: it cannot parse "9.0a"
        from sft_play.launch import sanitized_cuda_arch_list

        os.environ["TORCH_CUDA_ARCH_LIST"] = sanitized_cuda_arch_list(os.environ["TORCH_CUDA_ARCH_LIST"])
    if config.distributed.strategy.startswith("deepspeed"):
        if "RANK" not in os.environ:  # DeepSpeed needs a launcher to form its process group
            raise cli.UserError(
                f"distributed.strategy={config.distributed.strategy} runs under a launcher: use "
                f"make train-deepspeed CONFIG={args.config} (NUM_GPUS=N; CPU=1 without GPUs), not make train"
            )
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # the process group comes up through DeepSpeed

    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list, gather_object

    from sft_play import callbacks, checkpoints, checks, data, hardware, launch, model, planner, training
    from sft_play.data import collate
    from sft_play.planner import report

    stop = callbacks.GracefulStop()
    stop.install()  # a stop asked for while loading is kept, not lost
    # A config-only model folder gets its initial weights written now, before the process group
    # exists: once it does, transformers writes model files from rank 0 only.
    model.weights_location(config)
    if training.deepspeed_on_cpu(config):
        training.skip_deepspeed_inference_comm()
    state = PartialState(cpu=training.use_cpu_processes(config), backend=training.process_group_backend(config),
                         timeout=timedelta(minutes=config.distributed.timeout_minutes))
    # Every node writes its part of each checkpoint into the run folder: it must be one folder
    output_dir = Path(config.train.output_dir)
    token = [checkpoints.mark_shared(output_dir) if state.is_main_process else None]
    broadcast_object_list(token)
    sight = gather_object([(socket.gethostname(), checkpoints.sees_shared_mark(output_dir, token[0]))])
    if state.is_main_process:
        checkpoints.unmark_shared(output_dir, token[0])
    blind = sorted({host for host, seen in sight if not seen})
    if blind:
        raise cli.UserError(checkpoints.unshared_message(output_dir, blind))
    facts = hardware.detect()
    on_gpu = state.device.type == "cuda"

    tokenizer = model.load_tokenizer(config)
    with state.main_process_first():
        bundle = data.build(config.data, tokenizer, seed=config.train.seed)

    # Every decision about the run, once: the planner, the loader, the collator, the trainer
    # arguments and the disk check all read `run`
    target = planner.target_for(facts if on_gpu else facts.without_gpus(), gpus=state.num_processes, allow_cpu=True)
    shape = planner.model_shape(config)
    run = planner.resolve_for(config, target, bundle.stats, shape)
    precision = run.precision
    plan = planner.make_plan(config, target, bundle.stats, shape=shape, run=run)
    if not plan.fits and config.train.micro_batch_size == "auto":
        raise cli.UserError(f"the run is predicted not to fit:\n{report.to_text(plan)}")
    split = plan.split

    # Rank 0 decides the run folder (new, or the one being resumed) and checks its disk; every
    # rank learns the outcome, so that a refusal stops them all instead of leaving some waiting
    decision: list = [None, None, None, None]
    if state.is_main_process:
        try:
            name, resume_checkpoint, message = checkpoints.choose_run_folder(config, args.config, state.num_processes)
            checks.ensure_disk_room(config, Path(config.train.output_dir), shape, run)
            decision = [name, resume_checkpoint, message, None]
        except (ValueError, cli.UserError) as exc:
            decision = [None, None, None, str(exc)]
    broadcast_object_list(decision)
    name, resume_checkpoint, message, refusal = decision
    if refusal:
        raise cli.UserError(refusal)
    run_dir = output_dir / name
    if state.is_main_process:
        if message:
            logger.info("%s", message)
        run_dir.mkdir(parents=True, exist_ok=True)
        config.train.run_name = name
        (run_dir / "config.yaml").write_text(config.to_yaml())
        (run_dir / "plan.json").write_text(report.to_json(plan) + "\n")
    devices = gather_object([f"rank {state.process_index}: {state.device}"])
    if state.is_main_process:
        nodes = state.num_processes // int(os.environ.get("LOCAL_WORLD_SIZE", state.num_processes))
        logger.info(
            "%d process(es) on %d node(s), %s, mixed precision %s (%s), weights %s, attention %s, optimizer %s",
            state.num_processes, nodes, state.distributed_type, precision.mixed, precision.reason,
            precision.weights_dtype, run.attention, run.optimizer,
        )
        if precision.warning:
            logger.warning("%s", precision.warning)
        logger.info("%s", plan.describe())
        for line in plan.notes + plan.warnings:
            logger.info("plan: %s", line)
        logger.info("devices: %s", "; ".join(devices))

    os.environ["TENSORBOARD_LOGGING_DIR"] = str(run_dir / "tensorboard")
    device = f"cuda:{state.local_process_index}" if on_gpu else "cpu"
    base = model.load_model(config, run, device=device)
    record_to = run_dir / "samples" / f"rank-{state.process_index}.jsonl" if config.train.record_samples else None
    collator = collate.make_collator(tokenizer.pad_token_id, run.collator, record_to)
    guard = callbacks.NonFiniteGuard(
        config.train.max_bad_steps, watch_gradients=not run.deepspeed and precision.mixed != "fp16",
    )
    faults = [callbacks.FaultInjection(stop)] if os.environ.get(callbacks.FAULTS_ENV) else []  # tests only
    marker = callbacks.CheckpointMarker(keep=config.train.save_total_limit, strategy=config.distributed.strategy)
    make_trainer = training.trainer_factory(
        config, run, run_dir, base, model.lora_config(config), tokenizer, bundle.train, bundle.validation,
        collator, [*faults, callbacks.TokenThroughput(), marker, stop, guard],
    )
    if config.planner.calibrate and config.train.micro_batch_size == "auto":
        if on_gpu:
            plan = training.calibrate(plan, make_trainer, config, target, bundle.stats, run)
            split = plan.split
            if state.is_main_process:
                logger.info("%s", plan.describe())
                for line in plan.notes[-2:]:
                    logger.info("plan: %s", line)
                (run_dir / "plan.json").write_text(report.to_json(plan) + "\n")
        elif state.is_main_process:
            logger.warning("planner.calibrate needs a GPU to measure; planning analytically")
    if callbacks.any_rank(stop.received is not None):
        if state.is_main_process:
            print(f"\nStopped by {stop.received or 'a signal'} before training started: nothing new to save\n"
                  f"  resume: {launch.resume_command()}", flush=True)
        state.wait_for_everyone()
        return EXIT_INTERRUPTED
    try:
        trainer, split = training.train_with_backoff(make_trainer, split, resume_checkpoint)
    except RuntimeError as error:
        if state.num_processes == 1 or not callbacks.lost_another_rank(error):
            raise
        print(f"[rank {state.process_index}] error: lost contact with another process of this run (it stopped, "
              f"or its node failed): {str(error).splitlines()[0][:300]}", file=sys.stderr, flush=True)
        return 1
    state.wait_for_everyone()
    if guard.stopped_at is not None:
        last = checkpoints.newest_complete(run_dir / "checkpoints")
        raise cli.UserError(
            f"stopped at step {guard.stopped_at}: gradients or loss were NaN or infinite for "
            f"{config.train.max_bad_steps} steps in a row (their updates were skipped). "
            + (f"The last good checkpoint is {last} (train.resume_from={last}). " if last else "No checkpoint was kept. ")
            + "Lower train.learning_rate, keep train.max_grad_norm on, use bf16 rather than fp16, and check the data."
        )
    if stop.received:
        if state.is_main_process:
            last = checkpoints.newest_complete(run_dir / "checkpoints")
            training.write_summary(trainer, run_dir, {"interrupted": stop.received, "batch": split.describe()})
            print(f"\nStopped by {stop.received} at step {stop.stopped_at}; "
                  + (f"checkpoint saved: {last}" if last else "no complete checkpoint could be saved")
                  + f"\n  resume: {launch.resume_command()}"
                  + (f"\n  (or continue exactly this checkpoint: train.resume_from={last})" if last else ""),
                  flush=True)
        state.wait_for_everyone()  # every rank exits after rank 0 has written and said everything
        return EXIT_INTERRUPTED
    fingerprints = gather_object([training.weights_fingerprint(trainer.model)])
    training.save_final_model(trainer, run_dir / "model")
    if state.is_main_process:
        in_step = len(set(fingerprints)) == 1
        if config.distributed.strategy != "deepspeed_zero3":  # ZeRO-3 ranks hold only their shards
            logger.log(logging.INFO if in_step else logging.ERROR, "final weights %s on all %d rank(s): %s",
                       "identical" if in_step else "DIFFER", len(fingerprints), ", ".join(fingerprints))
        summary = training.write_summary(
            trainer, run_dir, {"batch": split.describe(), "data": bundle.stats.to_dict(),
                               "world_size": state.num_processes, "weights_fingerprints": fingerprints}
        )
        print(
            f"\nRun folder: {run_dir}\n  model: {run_dir / 'model'}\n  loss: {summary['first_loss']:.3f} -> "
            f"{summary['last_loss']:.3f} in {summary['global_step']} steps\n"
            f"  next: make generate RUN={run_dir}   |   make tensorboard RUN={run_dir}"
        )
    return 0


if __name__ == "__main__":
    cli.run(main)
