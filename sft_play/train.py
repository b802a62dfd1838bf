"""What the process that trains runs, top to bottom. Every rank runs :func:`train`, alone
(``python``), under torchrun, under ``accelerate launch`` and under DeepSpeed:

  config -> placement -> process group -> shared run folder -> tokenizer -> data
    -> decide: run (every decision, once) and plan -> run folder
    -> build: model, collator, callbacks, trainer factory -> calibrated: [calibration]
    -> train_phase: train (with OOM backoff) -> finish: stopped, NaN, or saved

The run is decided once, and completed by its plan (the batch split); what changes after that
(calibration's split, an out-of-memory backoff) is recorded as events beside it, and the split
that trained is in ``summary.json``. The run folder's config, plan, run, events and summary are
written through :mod:`sft_play.run_folder`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import socket
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

from accelerate import PartialState
from accelerate.utils import broadcast_object_list, gather_object

from sft_play import (callbacks, checkpoints, checks, data, hardware, memory_check, model, model_card, patches, planner,
                      run_folder, training)
from sft_play.config import RunConfig, consistency_problems
from sft_play.data import collate
from sft_play.errors import OutOfMemory, UserError
from sft_play.parallelism import Strategy
from sft_play.planner.present import report
from sft_play.run import Placement, Run, allocator_settings, placement
from sft_play.stopping import EXIT_INTERRUPTED, EXIT_LOST_PEER, resume_command

logger = logging.getLogger("sft_play.train")


def train(config: RunConfig, config_path: str) -> int:
    """Train the run `config` describes; returns the exit status (0, or 75 after a stop that
    saved). User errors are raised as :class:`sft_play.errors.UserError`."""
    strategy = Strategy(config.distributed.strategy)
    if strategy.shards_states and "RANK" not in os.environ:  # DeepSpeed and FSDP2 shard over a process group
        raise UserError(f"distributed.strategy={strategy} runs under a launcher: use make {strategy.make_target} "
                        f"CONFIG={config_path} (NUM_GPUS=N; CPU=1 without GPUs), not make train")
    problems = consistency_problems(config, int(os.environ.get("WORLD_SIZE", "1")), not placement(config).on_cuda)
    if problems:
        raise UserError("\n".join(problems))
    # accelerate reads the strategy only from these (`accelerate launch` exports them from its config
    # file): "true" brings the process group up through DeepSpeed, or turns FSDP on; "false" keeps a
    # config file's DeepSpeed or FSDP from overruling the run's strategy (or importing DeepSpeed)
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true" if strategy.deepspeed else "false"
    os.environ["ACCELERATE_USE_FSDP"] = "true" if strategy.fsdp else "false"

    stop = callbacks.GracefulStop()
    stop.install()  # a stop asked for while loading is kept, not lost
    try:
        return _train(config, config_path, stop)
    finally:
        stop.restore()  # the process's own handlers again, however training ended


def _train(config: RunConfig, config_path: str, stop: callbacks.GracefulStop) -> int:
    """The flow itself, top to bottom; :func:`train` holds the stop signals' handlers around it."""
    # A config-only model folder gets its initial weights written now, before the process group
    # exists: once it does, transformers writes model files from rank 0 only.
    base_weights = model.weights_location(config)
    where = placement(config)
    state = start_processes(config, where)
    check_shared_folder(Path(config.train.output_dir))
    facts = shared_hardware(state, where)

    checks.ensure_positions(config)
    tokenizer = model.load_tokenizer(config)
    processor = model.load_processor(config, tokenizer)  # (a vision-language model's; None for text)
    with state.main_process_first():
        bundle = data.build_for_run(config, tokenizer, processor)  # (preference pairs, or SFT examples)

    shape, run, plan = decide(config, state, where, facts, bundle)
    counts = run_folder.data_summary(bundle.stats)
    run_dir, resume_checkpoint = open_run_folder(config, config_path, state, shape, run, counts)
    if state.is_main_process:
        run_folder.write_plan(run_dir, report.to_json(plan))
        run_folder.write_run(run_dir, run, counts, base_weights)
    announce(state, run, plan)

    built = build(config, state, where, run, run_dir, tokenizer, processor, bundle, stop, resume_checkpoint)
    checked = calibrated(config, state, where, run, shape, plan, built.make_trainer, run_dir)
    if callbacks.any_rank(stop.received is not None):
        if state.is_main_process:
            print(f"\nStopped by {stop.received or 'a signal'} before training started: nothing new to save\n"
                  f"  resume: {resume_command()}", flush=True)
        state.wait_for_everyone()
        return EXIT_INTERRUPTED

    trained = train_phase(state, where, run_dir, built, checked, resume_checkpoint)
    if isinstance(trained, int):
        return trained
    trainer, batch = trained
    return finish(config, state, where, facts, run, run_dir, bundle, counts, built, checked, trainer, batch, stop)


def decide(config: RunConfig, state: PartialState, where: Placement, facts: hardware.HardwareInfo,
           bundle: Any) -> tuple[Any, Run, Any]:
    """Every decision about the run, once (the planner, the loader, the collator, the trainer
    arguments and the disk check all read the run): (model shape, run as planned, plan)."""
    target = planner.target_for(facts if where.on_cuda else facts.without_gpus(), gpus=state.num_processes,
                                allow_cpu=True)
    shape = planner.model_shape(config)
    run = planner.resolve_for(config, target, bundle.stats, shape)
    plan = planner.make_plan(config, target, bundle.stats, shape=shape, run=run)
    if not plan.fits and config.train.micro_batch_size == "auto":
        raise UserError(f"the run is predicted not to fit:\n{report.to_text(plan)}")
    # the run as planned (with the sequence-parallel size the plan chose for auto): nothing replaces it from here on
    run = run.with_changes(batch=plan.split,
                           parallel=dataclasses.replace(run.parallel, sequence_parallel=plan.sequence_parallel))
    if run.parallel.context_parallel > 1 and state.is_main_process:
        logger.info("context parallelism: each row split across %d processes (torch's ring attention)",
                    run.parallel.context_parallel)
    return shape, run, plan


@dataclasses.dataclass
class Built:
    """What training is made of once the model is loaded: the trainer factory (at any batch
    split) and the callbacks the flow reads after training."""

    make_trainer: Any
    past_end: callbacks.NothingPastTheEnd
    guard: callbacks.NonFiniteGuard
    before: float  # the earlier segments' training time, carried on by a resume
    zero3_arguments: Any = None  # kept alive: transformers holds only a weak reference to DeepSpeed's config
    smallest_micro_batch: int = 1  # what an out-of-memory backoff may halve to (Run.smallest_micro_batch)


def build(config: RunConfig, state: PartialState, where: Placement, run: Run, run_dir: Path, tokenizer: Any,
          processor: Any, bundle: Any, stop: callbacks.GracefulStop, resume_checkpoint: str | None) -> Built:
    """The model (and a preference run's reference) loaded, the collator and the callbacks: the
    trainer factory."""
    os.environ["TENSORBOARD_LOGGING_DIR"] = str(run_dir / "tensorboard")  # transformers' TensorBoardCallback reads only this
    # Under ZeRO-3 the training arguments, and DeepSpeed's config with them, exist before the model
    # loads: transformers then loads it under DeepSpeed's zero.Init, each process materialising
    # only its partition, instead of every process holding the whole model in host memory
    zero3_arguments = (training.trainer_arguments(config, run, run_dir, bundle.validation is not None)
                       if run.parallel.strategy.zero3 else None)
    device = f"cuda:{state.local_process_index}" if where.on_cuda else "cpu"
    base = model.load_model(config, run, device=device)
    if zero3_arguments is not None and state.is_main_process:
        partitioned = all(hasattr(p, "ds_id") for p in base.parameters())
        logger.info("model loaded %s", "under DeepSpeed's zero.Init: each process holds only its partition"
                    if partitioned else "whole in each process (not under zero.Init): DeepSpeed partitions it later")
    reference = model.load_reference(config, run, device)  # (None: the adapters off, or log-probs precomputed)
    record_to = run_dir / "samples" / f"rank-{state.process_index}.jsonl" if config.train.record_samples else None
    # (preference pairs: TRL's own collator, chosen rows then rejected ones)
    collator = None if run.preference is not None else collate.make_collator(
        tokenizer.pad_token_id, run.kernels.collator, record_to, split=run.parallel.row_multiple,
        # gloo gathers only equal shapes: every batch at the longest
        length=None if where.on_cuda else config.data.max_seq_length,
        processor=processor if run.images else None,
        # ZeRO-3 gathers the encoder's sharded weights on every process alike: a batch without an
        # image gets a stand-in one
        stand_in=run.images and run.parallel.strategy.zero3)
    guard = callbacks.NonFiniteGuard(
        # (sharded gradients are checked by the clipping's global norm instead, on every rank alike)
        config.train.max_bad_steps,
        watch_gradients=not run.parallel.strategy.shards_states and run.precision.mixed != "fp16",
    )
    faults = [callbacks.FaultInjection(stop)] if os.environ.get(callbacks.FAULTS_ENV) else []  # tests only
    past_end = callbacks.NothingPastTheEnd()
    before = checkpoints.time_before(resume_checkpoint)
    marker = callbacks.CheckpointMarker(keep=config.train.save_total_limit, strategy=run.parallel.strategy.name,
                                        before=before)
    patience = config.train.early_stopping_patience
    early = [callbacks.EarlyStopping(patience)] if patience and bundle.validation is not None else []
    make_trainer = training.trainer_factory(
        # (a vision-language model's processor: TRL trains such a model only with it, and saves it with the model)
        config, run, run_dir, base, processor if run.images else tokenizer, bundle.train, bundle.validation, collator,
        [*faults, past_end, callbacks.LogLastStep(), callbacks.TokenThroughput(),
         callbacks.ExpertLoad(), marker, stop, guard, *early], reference=reference,
    )
    return Built(make_trainer, past_end, guard, before, zero3_arguments, run.smallest_micro_batch)


def calibrated(config: RunConfig, state: PartialState, where: Placement, run: Run, shape: Any, plan: Any,
               make_trainer: Any, run_dir: Path) -> Any:
    """The plan training starts from: calibration's (``planner.calibrate``, measured on the GPU),
    or the plan itself. Its split is the batch training starts at; memory_check.json compares the
    run's peak with its prediction."""
    if not config.planner.calibrate or config.train.micro_batch_size != "auto":
        return plan
    # calibration builds several trainers on one model: FSDP2 shards it in place, and DeepSpeed's
    # sequence-parallel groups and attention wrapper are set up once per process
    if run.parallel.fsdp or run.parallel.splits_sequence:
        if state.is_main_process:
            logger.warning("planner.calibrate is not done under %s; planning analytically",
                           "FSDP2 (it shards the model in place)" if run.parallel.fsdp else "sequence parallelism")
        return plan
    if not where.on_cuda:
        if state.is_main_process:
            logger.warning("planner.calibrate needs a GPU to measure; planning analytically")
        return plan
    checked = training.calibrate(plan, make_trainer, config, run, shape)
    if state.is_main_process:
        added = [line for line in checked.notes if line not in plan.notes]
        logger.info("%s", checked.describe())
        for line in added:
            logger.info("plan: %s", line)
        run_folder.record_event(run_dir, "calibrated", batch=checked.split.to_dict(),
                                peak_bytes_per_gpu=checked.peak_bytes_per_gpu, notes=added)
    return checked


def train_phase(state: PartialState, where: Placement, run_dir: Path, built: Built, checked: Any,
                resume_checkpoint: str | None) -> tuple[Any, Any] | int:
    """Train from `checked`'s split, halving the micro-batch where memory runs out: (the trainer
    that finished, the split it ended at), or the exit code of a run that lost another rank."""
    def backed_off(before: Any, after: Any, step: int) -> None:
        if state.is_main_process:
            run_folder.record_event(run_dir, "out_of_memory", failed_step=step + 1, continued_from_step=step,
                                    batch_before=before.to_dict(), batch=after.to_dict())

    try:
        return training.train_with_backoff(built.make_trainer, checked.split, resume_checkpoint,
                                           on_backoff=backed_off, smallest=built.smallest_micro_batch)
    except OutOfMemory as error:
        if state.is_main_process:  # the planner's miss, on record (this rank's own measurements)
            check = memory_check.record(run_dir, checked, error.split or checked.split,
                                        [memory_check.measure_here(where.on_cuda)], "out_of_memory")
            logger.error("%s", memory_check.line(check))
        raise
    except Exception as error:
        reason = training.write_failure(error)
        if reason is not None:
            raise UserError(unwritten(run_dir, f"a checkpoint into {run_dir / 'checkpoints'}", reason)) from None
        if not isinstance(error, RuntimeError) or state.num_processes == 1 or not callbacks.lost_another_rank(error):
            raise
        print(f"[rank {state.process_index}] error: lost contact with another process of this run (it stopped, "
              f"or its node failed): {str(error).splitlines()[0][:300]}", file=sys.stderr, flush=True)
        return EXIT_LOST_PEER


def finish(config: RunConfig, state: PartialState, where: Placement, facts: hardware.HardwareInfo, run: Run,
           run_dir: Path, bundle: Any, counts: dict, built: Built, checked: Any, trainer: Any, batch: Any,
           stop: callbacks.GracefulStop) -> int:
    """The outcome: the memory check recorded, then a NaN stop said, a stop signal's checkpoint
    said (and the exit code for it), or the model saved."""
    state.wait_for_everyone()
    measured = gather_object([memory_check.measure_here(where.on_cuda, state.local_process_index)])
    if state.is_main_process and built.past_end.reached is None:  # a resume that only saves measured loading alone
        outcome = "stopped" if stop.received or built.guard.stopped_at is not None else "finished"
        logger.info("%s", memory_check.line(memory_check.record(run_dir, checked, batch, measured, outcome)))
    if built.guard.stopped_at is not None:
        raise UserError(nan_message(config, built.guard.stopped_at, run_dir))
    if stop.received:
        if state.is_main_process:
            last = checkpoints.newest_complete(run_dir / "checkpoints")
            run_folder.write_summary(run_dir, training.summary_of(trainer, {
                "interrupted": stop.received, **batch_record(run, batch, counts["rows"])}), built.before)
            print(f"\nStopped by {stop.received} at step {stop.stopped_at}; "
                  + (f"checkpoint saved: {last}" if last else "no complete checkpoint could be saved")
                  + f"\n  resume: {resume_command()}"
                  + (f"\n  (or continue exactly this checkpoint: train.resume_from={last})" if last else ""),
                  flush=True)
        state.wait_for_everyone()  # every rank exits after rank 0 has written and said everything
        return EXIT_INTERRUPTED
    stop.final_save = True  # a stop during the final save lets it finish: the model is whole, or not there at all
    stop.install()
    save(trainer, state, run, batch, run_dir, bundle, stop, built.before)
    if state.is_main_process and stop.received:
        print(f"(a stop signal, {stop.received}, came during the final save, which finished first: the run is "
              "complete)", flush=True)
    if state.is_main_process and where.on_cuda and built.past_end.reached is None:  # outside the allocator, for later plans
        memory_check.remember_runtime(facts, run, measured)
    state.wait_for_everyone()  # the same after a finished run (the entry then leaves: cli.leave)
    return 0


def shared_hardware(state: PartialState, where: Placement) -> hardware.HardwareInfo:
    """The hardware every rank plans for, the same on all: rank 0's facts (its measurements of
    what lives outside the allocator among them), with the least free memory any rank saw on its
    GPUs (ranks read at different moments, and other nodes hold other GPUs: plans made from
    different figures could choose different splits, and ranks of different accumulation would
    wait for each other's gradients forever)."""
    facts = hardware.detect()
    if state.num_processes == 1:
        return facts
    own = facts.gpus if where.on_cuda else []
    seen = gather_object([min((g.free_bytes for g in own), default=None)])
    shared = [facts]
    broadcast_object_list(shared)
    facts = shared[0]
    least = min((free for free in seen if free is not None), default=None)
    if least is not None:
        facts.gpus = [dataclasses.replace(g, free_bytes=min(g.free_bytes, least)) for g in facts.gpus]
    return facts


def start_processes(config: RunConfig, where: Placement) -> PartialState:
    """The process group (one process alone forms none), on the devices `where` says; the CUDA
    allocator's settings go into the environment first, as PyTorch reads them at CUDA's start."""
    settings = allocator_settings(config, where.on_cuda)
    if settings:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(
            part for part in (os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), settings) if part)
    if where.deepspeed_on_cpu:
        patches.skip_deepspeed_shm_build()
    return PartialState(cpu=where.cpu_processes, backend=where.backend,
                        timeout=timedelta(minutes=config.distributed.timeout_minutes))


def check_shared_folder(output_dir: Path) -> None:
    """Every node writes its part of each checkpoint into the run folder: it must be one folder.
    Rank 0 leaves a mark in it, and every rank must see it."""
    state = PartialState()
    token: list = [None]
    if state.is_main_process:
        try:
            token[0] = run_folder.mark_shared(output_dir)
        except OSError as exc:  # read-only, immutable, full: every rank says it and stops
            token[0] = OSError(exc.errno, exc.strerror, exc.filename)
    broadcast_object_list(token)
    if isinstance(token[0], OSError):
        raise UserError(f"cannot write into train.output_dir ({output_dir}): {token[0].strerror}")
    sight = gather_object([(socket.gethostname(), run_folder.sees_shared_mark(output_dir, token[0]))])
    if state.is_main_process:
        run_folder.unmark_shared(output_dir, token[0])
    blind = sorted({host for host, seen in sight if not seen})
    if blind:
        raise UserError(run_folder.unshared_message(output_dir, blind))


def open_run_folder(config: RunConfig, config_path: str, state: PartialState, shape: Any,
                    run: Run, counts: dict[str, Any]) -> tuple[Path, str | None]:
    """Rank 0 decides the run folder (new, or the one being resumed) and checks its disk; every
    rank learns the outcome, so that a refusal stops them all instead of leaving some waiting.
    Returns the folder and the checkpoint to resume from (if any)."""
    decision: list = [None, None, None, None]
    if state.is_main_process:
        try:
            name, resume_checkpoint, message = run_folder.choose_run_folder(config, config_path, state.num_processes,
                                                                            counts)
            run_dir = run_folder.folder_of(config.train.output_dir, name, resume_checkpoint)
            try:
                checks.ensure_disk_room(config, run_dir.parent, shape, run)
            except UserError:
                run_folder.discard_if_empty(run_dir)
                raise
            decision = [str(run_dir), resume_checkpoint, message, None]
        except (ValueError, UserError) as exc:
            decision = [None, None, None, str(exc)]
    broadcast_object_list(decision)
    run_dir, resume_checkpoint, message, refusal = decision
    if refusal:
        raise UserError(refusal)
    run_dir = Path(run_dir)
    config.train.output_dir, config.train.run_name = str(run_dir.parent), run_dir.name
    if state.is_main_process:
        for line in (message or "").splitlines():
            if line.startswith("warning: "):
                logger.warning("%s", line.removeprefix("warning: "))
            else:
                logger.info("%s", line)
        run_folder.write_config(run_dir, config)
    return run_dir, resume_checkpoint


def unwritten(run_dir: Path, what: str, reason: str) -> str:
    """What to say when `what` (a checkpoint, the final model) could not be written: no space, no
    permission. The run is not finished; what it kept, and how it goes on."""
    last = checkpoints.newest_complete(run_dir / "checkpoints")
    kept = (f"the checkpoints already written are kept (newest {last.name}); one cut short has no completeness "
            f"marker (set aside on resume). Make room (or make the folder writable) and continue with "
            f"{resume_command()}" if last else
            "no checkpoint is complete (train.save_steps sets how often they are saved): make room and train again")
    return f"could not write {what}: {reason}. Training stopped, the run is not finished; {kept}"


def batch_record(run: Run, trained: Any, rows: int) -> dict[str, Any]:
    """The batch split as the summary and the model card say it (with what the steps really took
    when the data is smaller than one global batch, which the plan warned of), and as planned
    and trained."""
    text = trained.describe()
    if 0 < rows < trained.global_batch_size:
        text += f"; the data is {rows} row{'s' if rows != 1 else ''}, so each step took {rows}"
    return {"batch": text, "batch_planned": run.batch.to_dict(), "batch_trained": trained.to_dict()}


def announce(state: PartialState, run: Run, plan: Any) -> None:
    """The start-up lines: processes and nodes, the run's decisions and why, the plan."""
    import torch

    device = state.device
    if device.type == "cuda" and device.index is None:  # one process: accelerate names no index
        device = torch.device("cuda", torch.cuda.current_device())
    devices = gather_object([f"rank {state.process_index}: {device}"])
    if not state.is_main_process:
        return
    precision = run.precision
    nodes = state.num_processes // int(os.environ.get("LOCAL_WORLD_SIZE", state.num_processes))
    logger.info(
        "%d process(es) on %d node(s), %s, strategy %s, mixed precision %s (%s), weights %s, attention %s, "
        "optimizer %s",
        state.num_processes, nodes, state.distributed_type, run.parallel.strategy.name, precision.mixed, precision.reason,
        precision.weights_dtype, run.kernels.attention, run.optimizer,
    )
    if precision.warning:
        logger.warning("%s", precision.warning)
    logger.info("%s", plan.describe())
    for line in plan.notes:
        logger.info("plan: %s", line)
    for line in plan.warnings:
        logger.warning("plan: %s", line)
    logger.info("devices: %s", "; ".join(devices))


def nan_message(config: RunConfig, step: int, run_dir: Path) -> str:
    last = checkpoints.newest_complete(run_dir / "checkpoints")
    return (
        f"stopped at step {step}: gradients or loss were NaN or infinite for "
        f"{config.train.max_bad_steps} steps in a row (their updates were skipped). "
        + (f"The last good checkpoint is {last}: train.resume_from={last} continues it (a tighter train.max_grad_norm "
           "may be set then). " if last else "No checkpoint was kept. ")
        + "A lower train.learning_rate needs a new run (a resumed one keeps its learning rate); keep "
        "train.max_grad_norm on, use bf16 rather than fp16, and check the data."
    )


def save(trainer: Any, state: PartialState, run: Run, trained: Any, run_dir: Path, bundle: Any,
         stop: callbacks.GracefulStop, before: tuple[float, int]) -> None:
    """The final model, the weights' agreement across ranks, ``summary.json`` (with `before`, the
    earlier segments' time) and what to do next.

    The model is written into ``model.partial/`` and renamed ``model/`` once whole, and the summary
    that marks the run finished comes after it: a run whose final save was cut short is never
    taken for a finished one, and ``RESUME=auto`` continues it from its last checkpoint."""
    partial, final = run_dir / "model.partial", run_dir / "model"
    if state.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)  # an earlier attempt's, cut short
    fingerprints = gather_object([training.weights_fingerprint(trainer.model)])
    try:
        training.save_final_model(trainer, partial, run.precision.weights_dtype)
    except Exception as error:
        reason = training.write_failure(error)
        if reason is None:
            raise
        shutil.rmtree(partial, ignore_errors=True)  # torn, and the room it takes may be what ran out
        raise UserError(unwritten(run_dir, f"the final model into {partial}", reason)) from None
    if not state.is_main_process:
        return
    if os.environ.get(callbacks.FAULTS_ENV):  # tests only
        callbacks.faults.in_final_save(stop)
    shutil.rmtree(final, ignore_errors=True)  # saved by an attempt cut short before its summary
    partial.rename(final)
    in_step = len(set(fingerprints)) == 1
    if not run.parallel.strategy.shards_parameters:  # their ranks hold different shards
        logger.log(logging.INFO if in_step else logging.ERROR, "final weights %s on all %d rank(s): %s",
                   "identical" if in_step else "DIFFER", len(fingerprints), ", ".join(fingerprints))
    early = next((c for c in trainer.callback_handler.callbacks
                  if isinstance(c, callbacks.EarlyStopping) and c.stopped_at is not None), None)
    rows = run_folder.data_summary(bundle.stats)["rows"]
    summary = run_folder.write_summary(run_dir, training.summary_of(
        trainer, {**batch_record(run, trained, rows), "data": bundle.stats.to_dict(),
                  "world_size": state.num_processes, "weights_fingerprints": fingerprints,
                  **({"early_stopped": {"step": early.stopped_at, "best_eval_loss": early.best,
                                        "best_step": early.best_step}} if early else {})}), before)
    model_card.write(run_dir, run_dir / "model")
    print(
        f"\nRun folder: {run_dir}\n  model: {run_dir / 'model'}\n  loss: {summary['first_loss']:.3f} -> "
        f"{summary['last_loss']:.3f} in {summary['global_step']} steps\n"
        + (f"  stopped early at step {early.stopped_at}: validation loss best {early.best:.4f} at step "
           f"{early.best_step}, none better in the {early.waited} evaluations since\n" if early else "")
        + f"  next: make generate RUN={run_dir}   |   make tensorboard RUN={run_dir}"
    )
