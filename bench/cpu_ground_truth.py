"""The planner's memory simulation against PyTorch's own count, on real training steps on the CPU.

Each cell trains the embedded default's model (configs/tiny_model: a Llama 128 wide, 4 layers, a
512-token vocabulary) for two steps through the real trainer (TRL's ``SFTTrainer`` as the run
builds it, AdamW, fp32, one process), under ``torch.profiler`` with ``profile_memory=True``.
PyTorch's memory profile (``torch.profiler._memory_profiler.MemoryProfile``, what
``export_memory_timeline`` draws) lists every tensor created and destroyed, with its category
(parameter, optimizer state, input, activation, gradient, temporary, autograd detail); the live
bytes at the step's peak are the base weights made before the steps plus the largest sum of
what was created during them and was still alive. The planner predicts the same run on the CPU
(``sft_play.planner.simulate.predict``: the same trace and replay as on a GPU, counted as host
memory: each tensor's bytes as asked, without the CUDA allocator's rounding, blocks and cache).

The cells: full fine-tuning and LoRA x gradient checkpointing off and on x micro-batches 1 and 2,
rows of 256 tokens (the default's), and one row of 1,024 (each of the four) and of 2,048 (full with
checkpointing); full fine-tuning, LoRA and QLoRA in bf16 mixed precision, as a GPU trains (QLoRA's
4-bit linears through bitsandbytes' CPU kernels), QLoRA in fp32 too, and the same model with a
vocabulary of 65,600 (the loss head's tiles over three slices of it); and DPO steps (configs/run_tiny_dpo.yaml, TRL's DPOTrainer) with
a frozen reference copy, precomputed reference log-probs and LoRA's adapters switched off, two
pairs a step (four rows of one shape), and one whose reference pass before training takes all
16 pairs a forward; ORPO (full) and SimPO (LoRA) steps on them, without a reference; and KTO steps
(TRL's KTOTrainer) on their answers, two a step, with the forwards of the mismatched rows, against a
frozen copy (full) and the adapters switched off (LoRA); and SFT steps with tiled MLPs (full and LoRA,
without checkpointing, where the MLPs' intermediates are most of the activations); and SFT steps of tiny
models of other families (mixtures of experts: Qwen3-MoE, Mixtral; hybrids: LFM2, Bamba, Qwen3-Next),
full with checkpointing and LoRA without; and SFT steps on two gloo processes under DDP, ZeRO-2, ZeRO-3
and FSDP2 (full with checkpointing and LoRA without; three steps, each rank its own rows), and under
ZeRO-2 and ZeRO-3 with each row split across both (DeepSpeed's Ulysses: a step trains one rank's rows, each
process its half of every row, as DeepSpeed's loader adapter hands them out), each rank
measured by the allocator's own count (:func:`allocator_count`: the memory profile's analysis cannot
follow DDP's and gloo's operations), which the single-process cells check against the profile. The
report puts each term of the plan beside the profile's category at the peak.

The first step is left out of the measured peak (the plan is of a step with the optimizer's states),
and the SFT cells are also compared at the last step's named points: as the model's forward returns,
as each decoder layer's backward is done, as the optimizer step starts and as it ends
(``sft_play.planner.simulate.step.POINTS``, ``layer_backward_point``; marks put in the profile by a
trainer callback and a hook on each layer's input). What this does not cover (issue 61's matrix):
offloaded activations (on a CPU the host is where they already are).

Usage:
  python bench/cpu_ground_truth.py [--output docs/reports/cpu_ground_truth.md]  (and its .json: every cell's record)
  python bench/cpu_ground_truth.py --worker '{"method": "lora", "checkpointing": true, "micro": 2, "seq": 256}'
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import dataclasses
import itertools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO, REPORTS, run_python, run_worker, versions, worker_env  # bench/ is the script's folder
from tiny_default import hardware_line

CELLS = [{"method": method, "checkpointing": checkpointing, "micro": micro, "seq": 256}
         for method in ("full", "lora") for checkpointing in (False, True) for micro in (1, 2)]
# Longer rows (the tiny data packed to the length): four and eight times the activations, the same weights
CELLS += [{"method": method, "checkpointing": checkpointing, "micro": 1, "seq": 1024}
          for method in ("full", "lora") for checkpointing in (False, True)]
CELLS += [{"method": "full", "checkpointing": True, "micro": 1, "seq": 2048}]
# Preference tuning (DPO, configs/run_tiny_dpo.yaml): pairs of one shape, "micro" in pairs (twice the rows)
CELLS += [{"method": method, "checkpointing": checkpointing, "micro": 2, "seq": 64, "reference": reference}
          for method, reference in (("full", "copy"), ("full", "precomputed"), ("lora", "adapters_off"))
          for checkpointing in (False, True)]
# TRL's reference pass before training at 8 times the micro-batch (all 16 pairs a forward): the run's peak
CELLS += [{"method": "full", "checkpointing": True, "micro": 2, "seq": 64, "reference": "precomputed",
           "precompute": 16}]
# ORPO and SimPO: the same step without a reference (their loss from its log-probs)
CELLS += [{"method": method, "checkpointing": checkpointing, "micro": 2, "seq": 64, "reference": "none",
           "objective": objective} for method, objective in (("full", "orpo"), ("lora", "simpo"))
          for checkpointing in (False, True)]
# KTO: an answer a row, two a step; the policy's and the reference's forwards of the mismatched rows
CELLS += [{"method": method, "checkpointing": checkpointing, "micro": 2, "seq": 64, "reference": reference,
           "objective": "kto"} for method, reference, checkpointing in (("full", "copy", False),
                                                                       ("lora", "adapters_off", True))]
# Tiled MLPs (DeepSpeed's TiledMLP, as sft_play.long_rows binds it): each MLP's intermediates one tile
# at a time in backward's recompute, where without checkpointing they are the activations' most
CELLS += [{"method": method, "checkpointing": False, "micro": 2, "seq": 256, "tiled": True} for method in ("full", "lora")]
# Other families' layers (tests/fixtures/model_configs: their shape rules at tiny widths): mixtures of
# experts (Qwen3-MoE's fused experts, Mixtral's), hybrids (LFM2's convolutions, Bamba's Mamba-2,
# Qwen3-Next's linear attention), full with checkpointing and LoRA without
# Across processes: two gloo ranks, each measured by the allocator's count (the memory profile's analysis
# cannot follow DDP's and gloo's operations)
STRATEGIES = ("ddp", "deepspeed_zero2", "deepspeed_zero3", "fsdp2")
STRATEGY_NAMES = {"ddp": "DDP", "deepspeed_zero2": "ZeRO-2", "deepspeed_zero3": "ZeRO-3", "fsdp2": "FSDP2"}
CELLS += [{"method": method, "checkpointing": checkpointing, "micro": 2, "seq": 256, "strategy": strategy}
          for strategy in STRATEGIES for method, checkpointing in (("full", True), ("lora", False))]
# An FSDP2 run's start, from before the model loads to the first step: the whole model and every shard
# at once (full fine-tuning: a LoRA run's frozen base is not allocated through PyTorch's CPU allocator)
CELLS += [{"method": "full", "checkpointing": True, "micro": 2, "seq": 256, "strategy": "fsdp2", "start": True}]
# Rows split across the two processes (DeepSpeed Ulysses under ZeRO-2 and ZeRO-3): each holds half of
# every row's tokens, and attention's all-to-alls exchange the heads
CELLS += [{"method": method, "checkpointing": checkpointing, "micro": 2, "seq": 256, "strategy": strategy,
           "sequence_parallel": 2} for strategy in ("deepspeed_zero2", "deepspeed_zero3")
          for method, checkpointing in (("full", True), ("lora", False))]
FAMILIES = ("tiny-qwen3-moe", "tiny-mixtral", "tiny-lfm2", "tiny-bamba", "tiny-qwen3-next")
CELLS += [{"method": method, "checkpointing": checkpointing, "micro": 2, "seq": 256, "model": family}
          for family in FAMILIES for method, checkpointing in (("full", True), ("lora", False))]
# bf16 mixed precision, as GPUs train (the rest of the matrix is fp32): the weights fp32 for full fine-tuning,
# bf16 under LoRA with its adapters and trained copies in fp32, QLoRA's 4-bit linears computing in bf16
# through bitsandbytes' CPU kernels; a CPU without native bf16 computes the same tensors, slowly
CELLS += [{"method": method, "checkpointing": checkpointing, "micro": 2, "seq": 256, "precision": "bf16"}
          for method in ("full", "lora", "qlora") for checkpointing in (False, True)]
# QLoRA computing in fp32 (as `auto` trains on a CPU without native bf16): the base's other weights
# fp32, its adapters and trained copies bf16 (TRL's cast), each input cast to them (peft's _cast_input_dtype)
CELLS += [{"method": "qlora", "checkpointing": checkpointing, "micro": 2, "seq": 256} for checkpointing in (False, True)]
# A vocabulary of real size (65,600: three of the loss head's 32,768-row slices, where the tiny
# model's 512 is one): the head's slices cast to bf16 one after another, each bound until the next
CELLS += [{"method": method, "checkpointing": checkpointing, "micro": 2, "seq": 256, "precision": "bf16",
           "model": "tiny-llama-wide-vocab"} for method, checkpointing in (("full", True), ("lora", False))]

# The share of the allocator's count the memory profile's analysis may miss before a cell is measured
# by the allocator's count instead (issue 61's target for a peak: 1 %)
PROFILE_LOSS = 0.01

# What names a cell (the rest of a measurement's record is what it measured)
CELL_KEYS = sorted({key for cell in CELLS for key in cell})

# The plan's terms, and the profile's categories they count (the rest of the profile: unnamed)
TERMS = {
    "weights": ("PARAMETER",),
    "optimizer_states": ("OPTIMIZER_STATE",),
    "inputs": ("INPUT",),
    "activations": ("ACTIVATION",),
    "gradients": ("GRADIENT",),
    "logits_loss": ("TEMPORARY",),
}


def _model_folder(cell: dict) -> Path:
    """The cell's model: the embedded tiny Llama, or a tiny model of another family's shape rules
    (tests/fixtures/model_configs/tiny-*, the embedded tokenizer's vocabulary)."""
    family = cell.get("model")
    return REPO / "tests" / "fixtures" / "model_configs" / family if family else REPO / "configs" / "tiny_model"


def _split(cell: dict) -> int:
    """The processes each row is split across (DeepSpeed Ulysses; 1: none)."""
    return cell.get("sequence_parallel", 1)


def _batch_run(run, split, rows: int, tokens: int, labelled: int):
    """`run` as the plan of one recorded batch: `rows` of `tokens`, `labelled` positions in the
    share of each row this process holds (the plan's head projects those alone)."""
    run = run.with_changes(batch=split, sequence=dataclasses.replace(run.sequence, tokens=tokens))
    return run.with_changes(sequence=dataclasses.replace(
        run.sequence, loss_token_share=(labelled + 0.5) / (rows * (run.local_tokens - 1))))


def _processes(cell: dict) -> int:
    """The processes a cell trains on: two gloo ranks under a strategy across processes, else one."""
    return 2 if cell.get("strategy") else 1


FIRST_STEP = ("first_step_begins", "first_step_ends")
MARK = "ground_truth::"  # the profile's name of a mark: this, then the point's or the first step's


def _marks_callback(shares: list | None = None, split: int = 1):
    """A trainer callback that marks in the profile (:func:`_mark`) the first optimizer step's
    start and end, and the step's named points (``sft_play.planner.simulate.step.POINTS``): as the
    model's forward returns, as each decoder layer's backward is done (a hook on the layer's input
    fires as its gradient is whole), as the optimizer step starts (backward and clipping done) and
    as it ends (before ``zero_grad``). The first step is left out of the measured peak, as the plan is of
    the steps that hold the optimizer's states (a rank's first batch may be its longest); a
    preference run's reference pass comes before it, and counts. With `shares`, each training
    forward's rows, their whole length (its share's, `split` times) and the labelled positions of
    the share it gets are appended there (rows split across processes: DeepSpeed's ``UlyssesSPDataLoaderAdapter`` hands
    each process its share of one process's batch a step, the shifted labels with it)."""
    import torch
    from transformers import TrainerCallback

    from sft_play.architecture import decoder_layers, num_layers
    from sft_play.planner.simulate.step import layer_backward_point

    def record(module, args, kwargs):
        labels = kwargs.get("shift_labels")
        if module.training and labels is not None:
            shares.append((labels.shape[0], labels.shape[1] * split, int((labels != -100).sum())))

    def watch_backward(module, args, kwargs):  # as the layer's input gets its whole gradient: its backward is done
        hidden = args[0] if args else kwargs.get("hidden_states")
        if module.training and torch.is_grad_enabled() and hidden is not None and hidden.requires_grad:
            hidden.register_hook(lambda _, i=module.ground_truth_index: _mark(layer_backward_point(i)))

    class Marks(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            model.register_forward_hook(lambda *_: _mark("after_forward"))
            # (first of the layer's hooks: on the input FSDP2's own hook then wraps, so that under FSDP2
            # the mark comes after the layer's post-backward, wrapped for checkpointing or not)
            for i, layer in enumerate(decoder_layers(model, num_layers(model.config))):
                layer.ground_truth_index = i
                layer.register_forward_pre_hook(watch_backward, with_kwargs=True, prepend=True)
            if shares is not None:
                model.register_forward_pre_hook(record, with_kwargs=True)

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 0:
                _mark(FIRST_STEP[0])

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            _mark("after_backward")

        def on_optimizer_step(self, args, state, control, **kwargs):
            _mark("after_step")

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                _mark(FIRST_STEP[1])

    return Marks()


def _mark(name: str) -> None:
    import torch

    with torch.profiler.record_function(MARK + name):
        pass


def _marks(prof) -> dict[str, list[int]]:
    """Each mark's times in the profile's clock (nanoseconds), in order."""
    from torch._C._profiler import _EventType

    times: dict[str, list[int]] = {}
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.typed[0] == _EventType.TorchOp and event.name.startswith(MARK):
            times.setdefault(event.name[len(MARK):], []).append(event.start_time_ns)
    return {name: sorted(found) for name, found in times.items()}


def _first_step_window(marks: dict[str, list[int]]) -> tuple[int, int]:
    """The first step's start and end (nanoseconds; (0, 0): not marked)."""
    begins, ends = marks.get(FIRST_STEP[0]), marks.get(FIRST_STEP[1])
    return (begins[0], ends[0]) if begins and ends else (0, 0)


def cell_config(folder: Path, cell: dict):
    """The run config a cell trains (its folder: where it writes, and a preference cell's pairs)."""
    from sft_play import config as config_module

    if cell.get("reference"):
        objective = cell.get("objective", "dpo")
        preference = ([f"preference.reference={cell['reference']}"] if objective == "dpo" else
                      [f"finetune.objective={objective}", "preference.sft_weight=0"]
                      + ([f"preference.reference={cell['reference']}"] if objective == "kto" else []))
        if cell.get("precompute"):
            preference.append(f"preference.precompute_batch_size={cell['precompute']}")
        return config_module.load(REPO / "configs" / "run_tiny_dpo.yaml", [
            f"finetune.method={cell['method']}", f"train.gradient_checkpointing={str(cell['checkpointing']).lower()}",
            *preference, "train.max_steps=2", "train.logging_steps=1",
            "train.eval_steps=0", "train.tensorboard=false", "train.mixed_precision=no", "data.num_proc=1",
            f"train.global_batch_size={cell['micro']}", f"train.output_dir={folder}",
            f"model.name_or_path={REPO / 'configs' / 'tiny_model'}", "model.build_with=null",
            f"data.path={folder / 'pairs.jsonl'}", "data.validation_path=null", "data.cache=false"], check_paths=False)
    return config_module.load(REPO / "configs" / "run_tiny.yaml", [
        f"finetune.method={cell['method']}", f"train.gradient_checkpointing={str(cell['checkpointing']).lower()}",
        f"data.max_seq_length={cell['seq']}", f"train.max_steps={1 + _processes(cell)}", "train.logging_steps=1",
        "train.tensorboard=false",
        f"train.mixed_precision={cell.get('precision', 'no')}", "data.num_proc=1",
        f"train.global_batch_size={cell['micro'] * _processes(cell) // _split(cell)}",
        f"train.output_dir={folder}", f"model.name_or_path={_model_folder(cell)}",
        *([f"distributed.strategy={cell['strategy']}"] if cell.get("strategy") else []),
        *([f"distributed.sequence_parallel={_split(cell)}"] if _split(cell) > 1 else []),
        f"model.tokenizer_name_or_path={REPO / 'configs' / 'tiny_model'}",
        f"data.path={REPO / 'data' / 'tiny' / 'train.jsonl'}",
        f"data.validation_path={REPO / 'data' / 'tiny' / 'validation.jsonl'}",
        *(["train.tiled_mlp=true", "lora.dropout=0"] if cell.get("tiled") else []),
        # (FSDP2 refuses a trainable copy of the head: each rank's shard would keep its own gradient)
        *(["lora.modules_to_save=[]"] if cell.get("strategy") == "fsdp2" and cell["method"] == "lora" else [])])


def _resolved(config, cell: dict, stats):
    """The run the planner plans for the cell, from its data's statistics (a DataStats, or the dict
    a measurement recorded)."""
    from sft_play.data.stats import DataStats
    from sft_play.run import resolve

    if isinstance(stats, dict):
        stats = DataStats(**{k: v for k, v in stats.items() if k in DataStats.__dataclass_fields__})
    return resolve(config, on_cuda=False, bf16_supported=cell.get("precision") == "bf16", world_size=_processes(cell),
                   data_stats=stats)


def tiny_trainer(folder: Path, cell: dict):
    """The trainer factory the entry script builds for the embedded default, as the cell sets it,
    the list its collator records each batch's shape in, and the data's statistics."""
    from sft_play import data, model, training
    from sft_play.data import collate

    config = cell_config(folder, cell)
    if _processes(cell) > 1:  # the process group and the strategy's accelerator state, as the entry script starts them
        from sft_play.parallelism import Strategy
        from sft_play.train import placement, start_processes

        strategy = Strategy(config.distributed.strategy)
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true" if strategy.deepspeed else "false"
        os.environ["ACCELERATE_USE_FSDP"] = "true" if strategy.fsdp else "false"
        start_processes(config, placement(config))
    tokenizer = model.load_tokenizer(config)
    bundle = data.build(config.data, tokenizer, seed=config.train.seed)
    run = _resolved(config, cell, bundle.stats)
    base = model.load_model(config, run, device="cpu")
    # (split rows: padded for the split and, as gloo gathers only equal shapes, to the longest, as the run does)
    split = _split(cell)
    collator = collate.make_collator(tokenizer.pad_token_id, run.kernels.collator, split=run.parallel.row_multiple,
                                     length=config.data.max_seq_length if split > 1 else None)
    batches: list[tuple[int, int, int]] = []

    def recorded(features):  # each batch's rows, tokens per row and labelled positions, as the step sees them
        batch = collator(features)
        labels = batch["labels"]
        if split == 1:  # (split rows: each step's share, as the model gets it)
            batches.append((labels.shape[0], labels.shape[1], int((labels[:, 1:] != -100).sum())))
        return batch

    make = training.trainer_factory(config, run, folder, base, tokenizer, bundle.train, None, recorded,
                                    [_marks_callback(batches if split > 1 else None, split)])
    return config, run, make, batches, bundle.stats


def dpo_trainer(folder: Path, cell: dict):
    """:func:`tiny_trainer` for preference tuning: the DPO default (configs/run_tiny_dpo.yaml) from
    the tiny model's initial weights, its pairs through TRL's collator (each batch recorded)."""
    from sft_play import data, model, training

    # pairs of one shape (Reverse puzzles of five letters): the step the profile peaks in (the second,
    # with the optimizer's states) is then the longest one, which the plan is of
    with open(REPO / "data" / "tiny_pref" / "train.jsonl") as source, open(folder / "pairs.jsonl", "w") as out:
        out.writelines(itertools.islice((line for line in source if '"Reverse the letters: ' in line
                                         and len(json.loads(line)["chosen"][0]["content"]) == 9), 16))
    objective = cell.get("objective", "dpo")
    config = cell_config(folder, cell)
    tokenizer = model.load_tokenizer(config)
    bundle = data.build_for_run(config, tokenizer)
    run = _resolved(config, cell, bundle.stats)
    base = model.load_model(config, run, device="cpu")
    from trl.trainer.dpo_trainer import DataCollatorForPreference
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

    collator = (DataCollatorForUnpairedPreference if objective == "kto" else DataCollatorForPreference)(
        pad_token_id=tokenizer.pad_token_id, max_length=config.data.max_seq_length)
    batches: list[tuple[int, int, int]] = []

    def recorded(features):
        batch = collator(features)
        mask = batch["completion_mask"]
        batches.append((mask.shape[0], mask.shape[1], int(mask[:, 1:].sum())))
        return batch

    make = training.trainer_factory(config, run, folder, base, tokenizer, bundle.train, None, recorded, [_marks_callback()],
                                    reference=model.load_reference(config, run, device="cpu"))
    return config, run, make, batches, bundle.stats


def measure(cell: dict, folder: Path, categories: bool = True) -> dict:
    """Train the cell's two steps under the profiler; the live bytes at their peak by category,
    and the planner's prediction of the same run by term. Without `categories`, the peak's bytes
    alone, by the allocator's count (:func:`allocator_count`): the profiler then records neither
    shapes nor stacks, which the memory profile's analysis needs (a step several times faster)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from sft_play import training
    from sft_play.planner import model_shape
    from sft_play.planner.simulate.step import POINTS, layer_backward_point

    config, run, make, batches, stats = (dpo_trainer if cell.get("reference") else tiny_trainer)(folder, cell)
    shape = model_shape(config)
    with every_thread_counted(), profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                                         record_shapes=categories, with_stack=categories) as prof:
        trainer, _ = training.train_with_backoff(make, _split_of(cell))
    # (the trainer's ZeRO-3 config would have transformers build the planner's meta-device layers
    # under zero.Init, which cannot initialise them)
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    # The base weights were made before the steps (the adapters and the copies LoRA trains, inside)
    # (and a preference run's frozen reference copy, loaded before them too)
    reference = getattr(trainer, "ref_model", None)
    kept = [*trainer.model.parameters(), *trainer.model.buffers(),
            *([*reference.parameters(), *reference.buffers()] if reference is not None else [])]
    parameters = {p.untyped_storage()._cdata: p for p in kept}
    marks = _marks(prof)
    first_step = _first_step_window(marks)
    # (the points of the last step, which the plan is compared at)
    named_points = [*POINTS, *(layer_backward_point(i) for i in range(shape.num_layers))]
    points = {point: marks[point][-1] for point in named_points if marks.get(point)} if _has_points(cell) else {}
    allocated, made, at_points = allocator_count(prof, first_step, points)
    # (a sharded weight's storage is its rank's shard: FSDP2's DTensor holds it as its local tensor)
    storages = [(p.to_local() if hasattr(p, "to_local") else p).untyped_storage() for p in parameters.values()]
    before = sum(s.nbytes() for s in storages if s.nbytes() and s.data_ptr() not in made)
    counted = {"allocator_bytes": allocated + before, "rank": int(os.environ.get("RANK", "0")), "torch": torch.__version__}
    # (the memory profile's analysis fails on DDP's and gloo's operations, and needs the stacks)
    if _processes(cell) > 1 or not categories:
        measured_bytes, measured = allocated + before, {}
    else:
        measured_bytes, measured = _profiled(prof, parameters, first_step)
        if measured_bytes < (1 - PROFILE_LOSS) * (allocated + before):
            # the profile's analysis lost tensors the allocator counted (full fine-tuning in bf16 with
            # checkpointing: a third of the peak): the allocator's count then, without categories
            counted["profile_bytes"] = measured_bytes
            measured_bytes, measured = allocated + before, {}
    # (not a reference pass's batch, nor the one the loader had ready after the last step)
    steps = [b for b in batches if b[0] == cell["micro"] * run.rows_per_example][:trainer.state.global_step]
    # (and the reference pass's first batch, before training, where the cell precomputes one)
    passes = [b for b in batches if cell.get("precompute") and b[0] == cell["precompute"] * run.rows_per_example]
    pass_batch = passes[0] if passes else None
    prediction, planned_points = _planned(shape, run, cell, steps, bool(at_points), pass_batch)
    named = {point: (at_points[point] + before, planned_points[point]) for point in at_points}
    return {**cell, "ok": True, "measured_bytes": measured_bytes, "measured": measured,
            "predicted_bytes": prediction.peak_bytes, "predicted": prediction.breakdown,
            "batches": steps, "pass_batch": pass_batch, "points": named, "stats": stats.to_dict(), **counted}


def _split_of(cell: dict):
    """The cell's batch split: its micro-batch on each of its processes (of one row's share each,
    with rows split across them)."""
    from sft_play.run import BatchSplit

    world = _processes(cell)
    return BatchSplit(cell["micro"], 1, world // _split(cell), cell["micro"] * world // _split(cell))


def _planned(shape, run, cell: dict, steps: list, with_points: bool, pass_batch: tuple | None = None):
    """The planner's prediction of the cell's measured steps, and the live bytes its replay of the
    last step has at each named point (with `with_points`; else {}).

    The plan of each step's batch as it came (rows of its length, its labelled positions): the
    rules compared, not the data's statistics (a plan assumes full rows and the data's share); of
    the steps after the first, which hold the optimizer's states from the start as a plan's step does
    (a rank's first batch may be its longest: two steps after it across processes); and of the
    reference pass before training on its first batch (`pass_batch`), where the cell precomputes."""
    from sft_play.planner.simulate.predict import predict, reference_pass, replay_step

    split = _split_of(cell)
    stepping = run
    if pass_batch is not None:  # (the steps' plans without the pass, which is planned on its own batch)
        stepping = run.with_changes(preference=dataclasses.replace(run.preference, precompute_batch_size=None))
    # (a preference batch's rows are its pairs' chosen and rejected rows: the plan counts pairs)
    prediction = max((predict(shape, _batch_run(stepping, split, rows, tokens, labelled),
                              rows // run.rows_per_example) for rows, tokens, labelled in steps[1:]),
                     key=lambda p: p.peak_bytes)
    if pass_batch is not None:
        before = reference_pass(shape, _batch_run(run, split, *pass_batch), cell["micro"], None)
        if before.peak_allocated > prediction.peak_bytes:
            prediction = dataclasses.replace(prediction, peak_bytes=before.peak_allocated,
                                             allocated_bytes=before.peak_allocated,
                                             breakdown=dict(before.at_peak_allocated))
    if not with_points:
        return prediction, {}
    rows, tokens, labelled = steps[-1]
    return prediction, replay_step(shape, _batch_run(run, split, rows, tokens, labelled),
                                   rows // run.rows_per_example, False, None).points


def replan(result: dict) -> dict:
    """A measured cell planned again by the planner as it is now, without training: its recorded
    batches and data statistics (a cell's ``measure`` result, as cpu_ground_truth.json keeps it).
    Returns ``predicted_bytes`` and the planned ``points`` beside the measured ones."""
    from sft_play.planner import model_shape
    from sft_play.planner.simulate.loading import replay_start

    cell = {key: result[key] for key in CELL_KEYS if key in result}
    with tempfile.TemporaryDirectory(prefix="sft-play-ground-truth-") as folder:
        config = cell_config(Path(folder), cell)
    run = _resolved(config, cell, result["stats"])
    shape = model_shape(config)
    if cell.get("start"):
        return {"predicted_bytes": replay_start(shape, run, on_cuda=False).peak_allocated, "points": {}}
    pass_batch = tuple(result["pass_batch"]) if result.get("pass_batch") else None
    prediction, planned = _planned(shape, run, cell, [tuple(b) for b in result["batches"]], bool(result["points"]),
                                   pass_batch)
    return {"predicted_bytes": prediction.peak_bytes,
            "points": {point: (measured, planned[point]) for point, (measured, _) in result["points"].items()}}


def measure_start(cell: dict, folder: Path) -> dict:
    """An FSDP2 cell's start, on each of its ranks: PyTorch's count of the bytes alive at once
    from before the model loads until the first step begins (the model loaded whole, then sharded
    by accelerate's ``fsdp2_prepare_model``), against the planner's replay of that start
    (:func:`sft_play.planner.simulate.loading.replay_start`). Full fine-tuning only: the
    profiler counts 400 bytes through a LoRA run's load on this CPU (the frozen base is not
    allocated through PyTorch's CPU allocator, which a GPU's copy of every weight is)."""
    from torch.profiler import ProfilerActivity, profile

    from sft_play import training
    from sft_play.planner import model_shape
    from sft_play.planner.simulate.loading import replay_start

    with every_thread_counted(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        config, run, make, _, stats = tiny_trainer(folder, cell)
        trainer, _ = training.train_with_backoff(make, _split_of(cell))
    counted, made, _ = allocator_count(prof, (_marks(prof)[FIRST_STEP[0]][0], 1 << 62))
    planned = replay_start(model_shape(config), run, on_cuda=False)
    return {**cell, "ok": True, "rank": int(os.environ.get("RANK", "0")), "measured_bytes": counted,
            "predicted_bytes": planned.peak_allocated, "predicted": planned.at_peak_allocated, "points": {},
            "stats": stats.to_dict()}


def _has_points(cell: dict) -> bool:
    """Whether the cell's named points are compared: SFT steps, where the model's forward is the
    policy's one forward and the optimizer steps after backward (DeepSpeed steps inside its
    ``backward``, before the trainer's callbacks)."""
    return not cell.get("reference") and "deepspeed" not in cell.get("strategy", "")


@contextlib.contextmanager
def every_thread_counted():
    """Within this block PyTorch's CPU allocator keeps its running total of live bytes on every
    thread (c10's ``caffe2_report_cpu_memory_usage``; the profiler alone counts only the threads
    it profiles). gloo drops its references to a collective's tensors on its own threads, so the
    last owner of an all-to-all's buffers or a reduced gradient often frees them there: the
    profiler records their allocation but not their free (the address is allocated again without
    one), and a count by address holds them until then. c10 has no Python setter for its flags:
    the flag is set in libc10 itself, where the symbol is exported."""
    import torch

    try:
        library = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libc10.so"))
        flag = ctypes.c_bool.in_dll(library, "FLAGS_caffe2_report_cpu_memory_usage")
    except (OSError, ValueError):  # another build (not Linux's libc10.so): say so, as frees on other threads go uncounted
        print("warning: c10's caffe2_report_cpu_memory_usage could not be set: frees on threads the profiler "
              "does not profile (gloo's) are not counted, so cells across processes read high", file=sys.stderr)
        yield
        return
    before, flag.value = flag.value, True
    try:
        yield
    finally:
        flag.value = before


def allocator_count(prof, skipped: tuple[int, int] = (0, 0),
                    points: dict[str, int] | None = None) -> tuple[int, set[int], dict[str, int]]:
    """The most bytes alive at once among those allocated during the profile, outside the
    `skipped` span of its clock (:func:`_first_step_window`); the addresses allocated; and the
    bytes alive at each of the `points` (name: time): PyTorch's count without the memory profile's
    analysis, which the single-process cells check it against (tests/test_cpu_ground_truth.py).
    The bytes alive are the CPU allocator's running total that each record of an allocation or a
    free carries, which counts frees on every thread (:func:`every_thread_counted`), less what it
    held before the profile's first record; and by address, what was mapped into memory from a
    file (safetensors' tensors: a record of the mapping's own, its total reserved, none allocated)."""
    from torch._C._profiler import _EventType

    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.typed[0] == _EventType.Allocation and event.typed[1].device.type == "cpu":
            typed = event.typed[1]
            events.append((event.start_time_ns, typed.ptr, typed.alloc_size, typed.total_allocated,
                           typed.total_reserved))
    events.sort()
    mapped: dict[int, int] = {}  # by address
    # (a mapping's free reports no totals: neither it nor one of a mapping made before the profile moves the total)
    counted = [e for e in events if not e[4] and not (e[2] < 0 and e[3] == 0)]
    total = start = counted[0][3] - counted[0][2] if counted else 0
    now = peak = 0
    waiting = sorted(((time, point) for point, time in (points or {}).items()), reverse=True)
    at_points = {}
    for time_ns, address, size, after, reserved in events:
        while waiting and waiting[-1][0] < time_ns:
            at_points[waiting.pop()[1]] = now
        if reserved and size > 0:
            mapped[address] = size
        elif reserved or address in mapped:
            mapped.pop(address, None)
        elif not (size < 0 and after == 0):
            total = after
        now = total - start + sum(mapped.values())
        if not skipped[0] <= time_ns <= skipped[1]:
            peak = max(peak, now)
    at_points.update((point, now) for _, point in waiting)
    return peak, {address for _, address, size, _, _ in events if size > 0}, at_points


def _profiled(prof, parameters: dict, skipped: tuple[int, int] = (0, 0)) -> tuple[int, dict[str, int]]:
    """The live bytes at the steps' peak (outside the `skipped` span) by PyTorch's memory profile,
    and by category."""
    from torch.profiler._memory_profiler import Action, MemoryProfile

    memory = MemoryProfile(prof.profiler.kineto_results)
    live: dict = {}
    now = peak = 0
    at_peak: dict = {}
    for time_ns, action, (key, version), size in memory.timeline:
        if key.device.type != "cpu" or action == Action.PREEXISTING:
            continue
        if action == Action.CREATE:  # (a storage the profile saw made again counts once)
            now += size - (live[key][0] if key in live else 0)
            live[key] = (size, version)
        elif action == Action.DESTROY and key in live:
            now -= live.pop(key)[0]
        elif action == Action.INCREMENT_VERSION and key in live:
            live[key] = (live[key][0], version)
        if now > peak and not skipped[0] <= time_ns <= skipped[1]:
            peak, at_peak = now, dict(live)
    measured = collections.Counter()
    for key, (size, version) in at_peak.items():
        category = memory._categories.get(key, version)
        measured[category.name if category is not None else "UNKNOWN"] += size
    made_before = sum(p.untyped_storage().nbytes() for p in parameters.values()) - measured["PARAMETER"]
    measured["PARAMETER"] += made_before
    return peak + made_before, dict(measured)


def _step_name(r: dict) -> str:
    return (f"KTO, reference {r['reference']}" if r.get("objective") == "kto" else
            f"{r['objective'].upper().replace('SIMPO', 'SimPO')}, no reference" if r.get("objective") else
            f"DPO, reference {r['reference']}" + (f" ({r['precompute']} pairs a pass)" if r.get("precompute") else "")
            if r.get("reference") else "SFT, tiled MLP" if r.get("tiled") else
            f"SFT, {r['model']}" + (", bf16 mixed precision" if r.get("precision") == "bf16" else "") if r.get("model") else
            f"SFT, {STRATEGY_NAMES[r['strategy']]} on 2 processes" + (", its start" if r.get("start") else "")
            + (f", each row split across {_split(r)}" if _split(r) > 1 else "") + f", rank {r.get('rank', 0)}"
            if r.get("strategy") else "SFT, bf16 mixed precision" if r.get("precision") == "bf16"
            else "SFT" + (f", {r['seq']} tokens" if r["seq"] != 256 else ""))


def table(results: list[dict]) -> list[str]:
    lines = ["| step | method | checkpointing | micro | measured | planned | error | by term: planned - measured (bytes) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        step = _step_name(r)
        if not r.get("ok"):
            lines.append(f"| {step} | {r['method']} | {r['checkpointing']} | {r['micro']} | failed: {r.get('error')} "
                         "| | | |")
            continue
        error = 100 * (r["predicted_bytes"] / r["measured_bytes"] - 1)
        if r.get("strategy"):  # (the allocator's count has no categories: the plan's own terms)
            terms = "; ".join(f"{term} {size:,}" for term, size in r["predicted"].items())
            lines.append(f"| {step} | {r['method']} | {'on' if r['checkpointing'] else 'off'} | {r['micro']} | "
                         f"{r['measured_bytes']:,} | {r['predicted_bytes']:,} | {error:+.2f} % | planned: {terms} |")
            continue
        measured, predicted = collections.Counter(r["measured"]), collections.Counter(r["predicted"])
        # (PyTorch counts a reference copy's weights as parameters, beside the policy's)
        predicted["weights"] += predicted.pop("reference", 0) if r.get("reference") == "copy" else 0
        differences = []
        for term, categories in TERMS.items():
            difference = predicted[term] - sum(measured[c] for c in categories)
            if difference:
                differences.append(f"{term} {difference:+,}")
        named = {c for categories in TERMS.values() for c in categories}
        unnamed = sum(size for category, size in measured.items() if category not in named)
        other = sum(size for term, size in predicted.items() if term not in TERMS)
        if unnamed or other:
            differences.append(f"other {other - unnamed:+,}")
        lines.append(f"| {step} | {r['method']} | {'on' if r['checkpointing'] else 'off'} | {r['micro']} | "
                     f"{r['measured_bytes']:,} | {r['predicted_bytes']:,} | {error:+.2f} % | {'; '.join(differences)} |")
    return lines


def points_table(results: list[dict]) -> list[str]:
    """The live bytes at the last step's named points, measured and planned (the cells that have them):
    the step's own, and as each decoder layer's backward is done (the worst of them in a column)."""
    from sft_play.planner.simulate.step import POINTS

    rows = [r for r in results if r.get("ok") and r.get("points")]
    if not rows:
        return []
    header = [f"{POINTS[0].replace('_', ' ')}: measured, planned, error", "each layer's backward: the worst error",
              *(f"{p.replace('_', ' ')}: measured, planned, error" for p in POINTS[1:])]
    lines = ["The last step's named points (SFT cells; DeepSpeed steps inside its backward, before the trainer's "
             "callbacks): the live bytes as the model's forward returns, as each decoder layer's backward is done (its "
             "input's gradient whole), as the optimizer step starts (backward and clipping done) and as it ends (before "
             "zero_grad), measured by the allocator's count and planned by the replay of that step's batch.", "",
             "| step | method | checkpointing | micro | " + " | ".join(header) + " |",
             "|---|---|---|---|" + "---|" * len(header)]
    for r in rows:
        cells = []
        for point in POINTS:
            measured, planned = r["points"].get(point, (0, 0))
            cells.append(f"{measured:,}, {planned:,}, {100 * (planned / measured - 1):+.2f} %" if measured else "")
        layers = [(abs(planned / measured - 1), planned / measured - 1, point) for point, (measured, planned)
                  in r["points"].items() if point not in POINTS and measured]
        worst = max(layers, default=None)
        cells.insert(1, f"{100 * worst[1]:+.2f} % ({worst[2]}; {len(layers)} layers)" if worst else "")
        lines.append(f"| {_step_name(r)} | {r['method']} | {'on' if r['checkpointing'] else 'off'} | {r['micro']} | "
                     + " | ".join(cells) + " |")
    worst = max(((abs(planned / measured - 1), f"{_step_name(r)}, {r['method']}, checkpointing "
                  f"{'on' if r['checkpointing'] else 'off'}, micro {r['micro']}", point) for r in rows
                 for point, (measured, planned) in r["points"].items() if measured), default=None)
    if worst:
        lines += ["", f"Worst named point: {100 * worst[0]:.2f} % ({worst[1]}, {worst[2].replace('_', ' ')})."]
    return lines


def allocator_check(results: list[dict]) -> list[str]:
    """The allocator's count (what the cells across processes are measured by) against the memory
    profile, on every single-process cell."""
    single = [r for r in results if r.get("ok") and not r.get("strategy") and "allocator_bytes" in r]
    pairs = [(r["allocator_bytes"] - r["measured_bytes"], r["measured_bytes"]) for r in single if "profile_bytes" not in r]
    lost = [r for r in single if "profile_bytes" in r]
    if not pairs:
        return []
    worst = max(pairs, key=lambda pair: abs(pair[0]) / pair[1])
    lines = [f"The cells across processes are measured by the allocator's own count (its running total of live bytes, "
             f"kept on every thread: gloo frees a collective's tensors on its own, where the profiler records no free; "
             f"files mapped into memory by address), which the memory profile's analysis cannot follow through DDP's and "
             f"gloo's operations. On {len(pairs)} of the {len(single)} single-process cells the two counts differ by at "
             f"most {abs(worst[0]):,} bytes ({abs(worst[0]) / worst[1] * 100:.3f} % of that cell's peak)."]
    for r in lost:
        lines[0] += (f" On {_step_name(r)} ({r['method']}, checkpointing {'on' if r['checkpointing'] else 'off'}) the profile's analysis "
                     f"lost tensors the allocator counted ({r['profile_bytes']:,} bytes at its peak of "
                     f"{r['allocator_bytes']:,}): that cell is measured by the allocator's count, without categories.")
    return lines


def _ranks(cell: dict) -> list[dict]:
    """A cell across processes: its ranks started by torchrun on gloo, each measuring its own steps."""
    import socket

    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    processes = _processes(cell)
    finished = run_python(["-m", "torch.distributed.run", "--nproc-per-node", processes, "--master-addr", "127.0.0.1",
                           "--master-port", port, __file__, "--worker", json.dumps(cell)],
                          env={**worker_env(), "OMP_NUM_THREADS": "1"}, timeout=900, cwd=REPO)
    found = sorted((json.loads(line) for line in finished.stdout.splitlines() if line.startswith('{"')),
                   key=lambda r: r["rank"])
    if len(found) == processes:
        return found
    said = (finished.stderr.strip().splitlines() or ["no output"])[-1][:300]
    return [{**cell, "ok": False, "error": f"exit status {finished.returncode}: {said}"}]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=REPORTS / "cpu_ground_truth.md")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        cell = json.loads(args.worker)
        with tempfile.TemporaryDirectory(prefix="sft-play-ground-truth-") as folder:
            result = json.dumps((measure_start if cell.get("start") else measure)(cell, Path(folder)))
            sys.stdout.write(result + "\n")  # one write, whole (print writes its newline apart: ranks share a pipe)
            sys.stdout.flush()
        return 0
    started = time.time()
    # one process a cell, as many at once as there are cores (live bytes do not depend on the
    # neighbours); then the cells across processes, one at a time
    import concurrent.futures

    alone = [cell for cell in CELLS if _processes(cell) == 1]
    with concurrent.futures.ThreadPoolExecutor(max(1, len(os.sched_getaffinity(0)))) as pool:
        measured = dict(zip(map(json.dumps, alone), pool.map(lambda c: run_worker(__file__, c, timeout=900), alone)))
    results = [result for cell in CELLS for result in (_ranks(cell) if _processes(cell) > 1
                                                       else [{**cell, **measured[json.dumps(cell)]}])]
    lines = [
        "# The planner's memory against PyTorch's own count, on CPU training steps",
        "",
        "Written by `python bench/cpu_ground_truth.py` (its docstring says how each cell is measured). Each cell is",
        "two real training steps of the embedded default's model through the trainer, fp32 (bf16 mixed precision",
        "where it says so: QLoRA's cells too), one process, rows of 256 tokens unless it says otherwise; *measured* is the live bytes at the peak of the steps after the first",
        "(which the plan is of: the optimizer's states exist) by PyTorch's memory profile, *planned* the",
        "planner's prediction of the same run on the CPU. By term: the plan's term less the profile's category at",
        "the peak (weights: PARAMETER; optimizer_states: OPTIMIZER_STATE; inputs: INPUT; activations: ACTIVATION;",
        "gradients: GRADIENT; logits_loss: TEMPORARY; other: the rest of either). DPO cells: TRL's DPOTrainer on",
        "pairs of one shape, micro in pairs (twice the rows, 24 tokens), rows of the copy's weights counted as weights;",
        "ORPO and SimPO cells: the same trainer's step without a reference, their loss from its log-probs. KTO cells:",
        "TRL's KTOTrainer on the same pairs split into labelled answers, micro in answers (one row each, and the",
        "mismatched rows' forwards without gradients). Cells that name a model: a tiny model of that family's",
        "configuration (tests/fixtures/model_configs), the embedded tokenizer. Cells on 2 processes: gloo, three",
        "steps, each rank its own rows (with each row split across both, DeepSpeed's Ulysses: each step trains one",
        "rank's rows, each process its half of every row). The families, methods and strategies whose every cell",
        "is within the error the plans' evidence states are in it (sft_play/planner/present/evidence.json, copied",
        "by hand from this table). Each rank's record (its batches, its data's statistics, what was measured) is in",
        "cpu_ground_truth.json, from which the suite plans every cell again (tests/test_cpu_ground_truth.py).",
        "",
        f"- machine: {hardware_line()}",
        f"- software: {versions()}",
        f"- wall time: {time.time() - started:.0f} s",
        "",
        *table(results),
        "",
        *points_table(results),
        "",
        *allocator_check(results),
        "",
    ]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n".join(lines))
    # every cell's record, which the suite plans again (tests/test_cpu_ground_truth.py): its batches and
    # data statistics (less the files' names, which are this machine's paths), what was measured
    records = [{**r, "stats": {k: v for k, v in r["stats"].items() if k != "formats"}} if "stats" in r else r
               for r in results]
    args.output.with_suffix(".json").write_text(json.dumps(
        {"machine": hardware_line(), "software": versions(), "cells": records}, indent=1) + "\n")
    print("\n".join(lines))
    return 0 if all(r.get("ok") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
