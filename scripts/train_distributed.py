"""Train: the entry point every launch target calls.

Runs alone (python), under torchrun, under accelerate launch and under deepspeed; every rank
runs this same main():

  config -> hardware -> tokenizer -> data -> plan -> model -> SFTTrainer -> train -> save

Usage: python scripts/train_distributed.py --config configs/run_tiny.yaml [key=value ...]
"""

from __future__ import annotations

import logging
import os
import sys
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sft_play import cli  # noqa: E402

logger = logging.getLogger("sft_play.train")


def run_name(config_path: str, explicit: str | None) -> str:
    if explicit:
        return explicit
    return f"{Path(config_path).stem}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def main() -> int:
    args = cli.config_parser(__doc__.splitlines()[0]).parse_args()
    cli.setup_logging()

    from sft_play import config as config_module

    config = config_module.load(args.config, args.overrides)
    from sft_play.launch import sanitized_cuda_arch_list

    if os.environ.get("TORCH_CUDA_ARCH_LIST"):  # before DeepSpeed is imported: it cannot parse "9.0a"
        os.environ["TORCH_CUDA_ARCH_LIST"] = sanitized_cuda_arch_list(os.environ["TORCH_CUDA_ARCH_LIST"])
    if config.distributed.strategy.startswith("deepspeed"):
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # the process group comes up through DeepSpeed

    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list, gather_object

    from sft_play import data, hardware, model, planner, training

    # A config-only model folder gets its initial weights written now, before the process group
    # exists: once it does, transformers writes model files from rank 0 only.
    model.weights_location(config)
    from sft_play.data import collate
    from sft_play.planner import report
    from sft_play.precision import resolve_precision

    state = PartialState(cpu=training.use_cpu_processes(config), backend=training.process_group_backend(config))
    facts = hardware.detect()
    on_gpu = state.device.type == "cuda"
    precision = resolve_precision(
        config, has_gpu=on_gpu, bf16_supported=on_gpu and all(g.bf16_supported for g in facts.gpus)
    )

    tokenizer = model.load_tokenizer(config)
    with state.main_process_first():
        bundle = data.build(config.data, tokenizer, seed=config.train.seed)

    target = planner.target_for(facts, gpus=state.num_processes, allow_cpu=True)
    plan = planner.make_plan(config, target, bundle.stats)
    if not plan.fits and config.train.micro_batch_size == "auto":
        raise cli.UserError(f"the run is predicted not to fit:\n{report.to_text(plan)}")
    split = plan.split

    name = [run_name(args.config, config.train.run_name)]
    broadcast_object_list(name)  # every rank writes into the folder rank 0 named
    run_dir = Path(config.train.output_dir) / name[0]
    if state.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        config.train.run_name = name[0]
        (run_dir / "config.yaml").write_text(config.to_yaml())
        (run_dir / "plan.json").write_text(report.to_json(plan) + "\n")
    devices = gather_object([f"rank {state.process_index}: {state.device}"])
    if state.is_main_process:
        nodes = state.num_processes // int(os.environ.get("LOCAL_WORLD_SIZE", state.num_processes))
        logger.info(
            "%d process(es) on %d node(s), %s, mixed precision %s, weights %s",
            state.num_processes, nodes, state.distributed_type, precision.mixed, precision.weights_dtype,
        )
        logger.info("%s", plan.describe())
        for line in plan.notes + plan.warnings:
            logger.info("plan: %s", line)
        logger.info("devices: %s", "; ".join(devices))

    os.environ["TENSORBOARD_LOGGING_DIR"] = str(run_dir / "tensorboard")
    device = f"cuda:{state.local_process_index}" if on_gpu else "cpu"
    base = model.load_model(config, precision, device=device)
    record_to = run_dir / "samples" / f"rank-{state.process_index}.jsonl" if config.train.record_samples else None
    collator = collate.make_collator(
        tokenizer.pad_token_id, config.data.packing, model.attention_implementation(config, precision), record_to
    )
    make_trainer = training.trainer_factory(
        config, precision, run_dir, base, model.lora_config(config), tokenizer, bundle.train, bundle.validation,
        collator,
    )
    trainer, split = training.train_with_backoff(make_trainer, split)
    state.wait_for_everyone()
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
