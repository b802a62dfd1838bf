"""What a plan says in words: its notes and warnings about the split, the epochs, the run's kernels
and mask, what lives outside the allocator, mixture-of-experts models and host memory. The
numbers come from the simulation and the choice; only the wording lives here."""

from __future__ import annotations

import json
import math
from typing import Any

from sft_play.config import RunConfig
from sft_play.planner.choose.search import FitSearch
from sft_play.planner.simulate import memory
from sft_play.planner.simulate.predict import Prediction
from sft_play.planner.simulate.shapes import ModelShape
from sft_play.planner.simulate.trace import LIGER_RMS_NORM_MODELS
from sft_play.planner.target import Target
from sft_play.run import BatchSplit, Run
from sft_play.units import GIB


def split_notes(config: RunConfig, search: FitSearch, split: BatchSplit, fitting: int) -> tuple[list[str], list[str]]:
    """What the plan says about the split: a fixed micro-batch or accumulation predicted not to
    fit (warnings), the largest micro-batch that fits, and how the global batch changed (notes)."""
    train = config.train
    notes: list[str] = []
    warnings: list[str] = []
    if isinstance(train.micro_batch_size, int):
        predicted = search.predicted(split.micro_batch_size)
        if not predicted.fits:
            warnings.append(
                f"train.micro_batch_size={split.micro_batch_size} is predicted not to fit "
                f"({predicted.peak_bytes / GIB:.1f} GiB of {search.budget / GIB:.1f} GiB)"
                + (f"; the largest that fits is {fitting}" if fitting else "")
            )
    elif search.fixed_accum is not None:
        if fitting and split.micro_batch_size > fitting:
            warnings.append(f"train.gradient_accumulation_steps={search.fixed_accum} implies micro-batch "
                            f"{split.micro_batch_size}, predicted not to fit; the largest that fits is {fitting}")
    elif fitting and split.micro_batch_size > search.per_process:  # (KTO's KL estimate: two answers at least)
        notes.append(f"micro-batch {split.micro_batch_size}: KTO estimates its KL term from the other answers of a "
                     f"micro-batch, so it takes at least {search.run.smallest_micro_batch}, more than the "
                     f"{search.per_process} each process takes of the global batch")
    elif fitting and fitting >= search.per_process:
        notes.append(f"micro-batch {fitting} is the whole per-process share of the global batch, and it fits: "
                     "memory is not what limits it")
    elif fitting:
        notes.append(micro_batch_reason(search, split, fitting))
    if split.note:  # the global batch changed: a warning when the user fixed the split it follows from
        fixed = isinstance(train.micro_batch_size, int) or isinstance(train.gradient_accumulation_steps, int)
        (warnings if fixed and split.global_batch_size != train.global_batch_size else notes).append(split.note)
    return notes, warnings



def micro_batch_reason(search: FitSearch, split: BatchSplit, fitting: int) -> str:
    """Why the planner's micro-batch is what it is: the largest that fits (and what the next one
    would need), or a smaller one that divides each process's share of the global batch."""
    micro, per_process = split.micro_batch_size, search.per_process
    if micro < fitting:
        if split.global_batch_size == split.requested_global_batch_size:
            return (f"micro-batch {micro}, not {fitting} (the largest that fits): {fitting} does not divide the "
                    f"{per_process} rows each process takes of the global batch, {micro} does (accumulation "
                    f"{split.gradient_accumulation_steps}, the global batch unchanged)")
        return f"micro-batch {micro}, not {fitting} (the largest that fits): the nearest global batch (see below)"
    following = search.tried.get(fitting + 1)
    beyond = (f"; {fitting + 1} is predicted at {following.peak_bytes / GIB:.1f} GiB of {search.budget / GIB:.1f} GiB"
              if following is not None and not following.fits else "")
    return f"micro-batch {micro}: the largest that fits{beyond}"


def epoch_notes(train: Any, rows: int | None, packed: bool, split: BatchSplit) -> tuple[str | None, str | None]:
    """(note, warning) on how the run's steps cover the data: how many epochs ``train.max_steps``
    runs, and the warning that data smaller than one global batch makes every step an epoch
    of fewer rows than the batch the plan is for."""
    if not rows:
        return None, None
    kind = ("packed row" if packed else "example") + ("s" if rows != 1 else "")
    if rows < split.global_batch_size:
        return None, (f"the training data is {rows:,} {kind}, fewer than one global batch of {split.global_batch_size}: "
                      f"every optimizer step is a whole epoch, and each step sees {rows:,} {kind}, not "
                      f"{split.global_batch_size}; set train.global_batch_size to at most {rows:,}, or add data")
    per_epoch = math.ceil(rows / split.global_batch_size)
    if train.max_steps > 0:
        return (f"one epoch is {rows:,} {kind}, {per_epoch:,} steps of {split.global_batch_size}: "
                f"train.max_steps={train.max_steps:,} covers {train.max_steps / per_epoch:.2f} epochs"), None
    return None, None



def run_notes(config: RunConfig, run: Run, target: Target, shape: ModelShape, masked: bool, sliding: bool = False,
              prediction: Prediction | None = None) -> tuple[list[str], list[str]]:
    """What the plan says about the run it planned (notes, warnings): the attention kernel and its
    mask, the kernel switches, what lives outside the allocator, a layer planned by a stand-in,
    and what a mixture-of-experts model changes."""
    notes: list[str] = []
    warnings: list[str] = []
    if run.kernels.attention == "sdpa" and masked and target.on_cuda:
        rows = "packed rows" if run.kernels.collator == "packed_rows" else "rows padded to the batch's longest"
        notes.append(f"SDPA with {rows} uses the memory-efficient kernel with an s x s mask per layer; installing "
                     f"flash-attn, or model.attn_implementation=flex_attention, lets {rows} run mask-free")
    elif sliding and target.on_cuda:
        subject, verb = ("its sliding-window layers", "get") if shape.attention_masks > 1 else ("every layer", "gets")
        notes.append(f"SDPA has no sliding window: at {run.sequence.tokens} tokens {subject} of this model "
                     f"({shape.sliding_window}-token window) {verb} an s x s mask, and with it the memory-efficient "
                     "kernel, which keeps the mask for backward (planned); installing flash-attn, or "
                     "model.attn_implementation=flex_attention, runs the window without one")
    notes.extend(kernel_notes(config, run))
    if target.on_cuda and target.source == "detected":
        outside, source = memory.outside_allocator(run.parallel.world_size, True, run.outside_allocator_measured)
        notes.append(f"outside PyTorch's allocator: {outside / GIB:.2f} GiB per process, {source}")
    if config.model.attn_implementation == "auto" and target.source not in ("detected", "host memory") \
            and run.kernels.attention == "sdpa" and run.on_cuda:
        notes.append("model.attn_implementation=auto on hardware described, not this machine's: planned as SDPA; "
                     "where flash-attn is installed, plan with model.attn_implementation=flash_attention_2")
    if prediction is not None and prediction.stand_in:
        warnings.append(f"the layers of {config.model.name_or_path} could not be traced ({prediction.stand_in}):"
                        " planned as Llama-shaped layers of its widths, which is not a bound proven for this "
                        "architecture; training goes ahead with the out-of-memory backoff as the safety net")
    if run.lora is not None and shape.lora_unadapted:
        left = shape.lora_unadapted
        warnings.append(f"LoRA all-linear leaves these linears of the layers without an adapter: "
                        f"{', '.join(left[:6])}{' ...' if len(left) > 6 else ''} (peft gives this family's gate/up/"
                        "down_proj names to the routed experts' fused weights, so the dense and shared-expert "
                        "projections of those names stay frozen); the rest, the experts included, train")
    if run.lora is not None and run.lora.dropout != config.lora.dropout and run.preference is not None:
        notes.append(f"lora.dropout={config.lora.dropout:g} is off: TRL's preference trainers switch dropout off "
                     "(disable_dropout), so that the log-probs a loss compares are not drawn from different masks")
    elif run.lora is not None and run.lora.dropout != config.lora.dropout:
        warnings.append(f"lora.dropout={config.lora.dropout:g} is off for this mixture-of-experts model: peft cannot "
                        "apply dropout to LoRA on fused expert weights")
    if run.lora is not None:
        outside = shape.lora_params - sum(memory.linear_adapter_tensors(shape)) * shape.num_layers
        parts = ([f"whole copies of lora.modules_to_save ({', '.join(run.lora.modules_to_save)})"]
                 if run.lora.modules_to_save else [])
        parts += ["DoRA's magnitudes"] if run.lora.dora else []
        parts += ["the adapters of the fused experts"] if shape.num_experts else []
        if outside > 0 and parts:
            notes.append(f"{outside:,} of the {shape.trainable_params:,} trainable parameters are outside the linears' "
                         f"r={run.lora.r} adapters: {', '.join(parts)}")
    if shape.num_experts and run.method == "qlora":
        notes.append(f"QLoRA quantises the linear layers only: the {shape.expert_params:,} parameters of the fused "
                     f"experts (3-D tensors bitsandbytes does not quantise) stay in {run.precision.weights_dtype}")
    if shape.num_experts and run.parallel.world_size > 1:
        notes.append("experts are replicated (DDP) or sharded like any weight (ZeRO); expert parallelism is not "
                     "offered: for a model whose experts do not fit, ZeRO-3 shards them")
    return notes, warnings



def vision_notes(config: RunConfig, run: Run, shape: ModelShape, data_stats: Any | None,
                 prediction: Prediction | None = None) -> tuple[list[str], list[str]]:
    """What the plan says about a vision-language model (notes, warnings): what its images cost in
    tokens (read from the data), which of its vision parts train, and what its encoder is traced on."""
    notes: list[str] = []
    warnings: list[str] = []
    if not shape.vision_towers:
        return notes, warnings
    images = getattr(data_stats, "images", 0) or 0
    if images:
        examples = max(1, data_stats.examples)
        notes.append(f"images: {images / examples:.2f} per example (at most {data_stats.images_max}), "
                     f"{data_stats.image_tokens / images:,.0f} tokens each on average: "
                     f"{100 * data_stats.image_tokens / max(1, data_stats.tokens_total):.0f}% of the tokens the "
                     "sequence length is planned from; where the processor sizes images by pixels (Qwen-VL, Idefics3, "
                     "SmolVLM), data.image_max_pixels sets how many")
    elif data_stats is None:
        from sft_play.architecture import image_tokens, load_model_config

        known = image_tokens(load_model_config(config.model.name_or_path, config.model.revision,
                                               config.model.trust_remote_code), config.data.image_max_pixels)
        cost = f"an image costs up to {known[0]:,} tokens besides its marks ({known[1]})" if known else \
            "what an image costs is the processor's to say (the data, read with it, tells)"
        notes.append(f"a vision-language model planned without its data: the sequence length is data.max_seq_length, "
                     f"image tokens included; {cost}")
        if known and known[0] >= config.data.max_seq_length:
            warnings.append(f"data.max_seq_length={config.data.max_seq_length} cannot hold one image ({known[0]:,} "
                            "tokens): every example with an image would be left out (image tokens are never cut); "
                            "raise it, or lower data.image_max_pixels where the processor sizes images by pixels")
    if config.data.image_max_pixels or config.data.image_min_pixels:
        from sft_play.architecture import image_tokens, load_model_config

        fixed = image_tokens(load_model_config(config.model.name_or_path, config.model.revision,
                                               config.model.trust_remote_code))
        if fixed:  # the count is the model's whatever the budget: a setting that changes nothing is said
            notes.append(f"data.image_max_pixels/image_min_pixels change nothing for {config.model.name_or_path}: "
                         f"every image costs {fixed[0]:,} tokens whatever its size ({fixed[1]})")
    full = run.method == "full"
    parts = []
    for name, count, trained in (("vision encoder", shape.vision_params, config.finetune.train_vision_tower),
                                 ("projector", shape.projector_params, config.finetune.train_projector)):
        how = ("trains" if full else "trains with adapters" if name == "vision encoder" else "trains in full") \
            if trained else "frozen"
        parts.append(f"{name} {count:,} parameters, {how}")
    notes.append("; ".join(parts) + " (finetune.train_vision_tower, finetune.train_projector)")
    traced = _traced_on(run)
    untraced = prediction.encoder_untraced if prediction is not None else ""
    if untraced:
        warnings.append(f"the vision encoder of {config.model.name_or_path} could not be traced ({untraced}): its "
                        "activations are not in this plan; the out-of-memory backoff is the safety net")
    elif traced:
        kept = ("keeps for backward what its training parts need, to the end of the backward pass"
                if run.train_vision_tower or run.train_projector else
                "keeps nothing for backward: its working set lasts while it encodes the micro-batch's images")
        notes.append(f"the vision encoder is traced on {traced}, once per example of the micro-batch: it {kept}")
    elif data_stats is None or images:
        warnings.append("the vision encoder's activations are not in this plan: the config alone does not say what "
                        "the processor makes of an image; plan with the data (make plan reads it), or, where the "
                        "processor sizes images by pixels (Qwen-VL), set data.image_max_pixels")
    return notes, warnings


def _traced_on(run: Run) -> str:
    """What the vision encoder is traced on, in words ("" where nothing is)."""
    if not run.encoder_inputs:
        return ""
    described = json.loads(run.encoder_inputs)
    pixels = described.get("pixel_values", {}).get("shape")
    where = "the example with the most pixels" if run.images else "one image sized from the config"
    return f"{where} (pixel_values {'x'.join(map(str, pixels))})" if pixels else where


def host_memory(shape: ModelShape, run: Run, target: Target, micro_batch: int = 1) -> tuple[int, str | None]:
    """The host memory one node needs on a GPU run (the larger of loading and training) and the
    note that says what for (:func:`sft_play.planner.simulate.memory.host_bytes_per_node`)."""
    if not target.on_cuda:
        return 0, None
    processes = min(target.world_size, target.gpus_per_node)
    loading, training = memory.host_bytes_per_node(shape, run, processes, micro_batch)
    parts = []
    if loading:
        parts.append(f"{loading / GIB:.1f} GiB while its {processes} process(es) load the model under ZeRO-3's "
                     "zero.Init (a layer at a time)")
    if training:
        share = processes / max(1, run.parallel.world_size)
        what = ", ".join(f"{name} {size * share / GIB:.1f}" for name, size in memory.offloaded_bytes(shape, run).items())
        hidden = memory.offloaded_hidden_bytes(shape, run, micro_batch) * processes
        what += f"{', ' if what else ''}checkpointed hidden states {hidden / GIB:.1f}" if hidden else ""
        parts.append(f"{training / GIB:.1f} GiB offloaded while training ({what})")
    if not parts:
        return 0, None
    allowance = " (DeepSpeed's own estimators allow 1.5x that)" if run.parallel.deepspeed else ""
    return max(loading, training), "host memory per node: " + "; ".join(parts) + allowance



def kernel_notes(config: RunConfig, run: Run) -> list[str]:
    """What the plan says about the kernel switches: where one is off, and that the memory they
    save is not predicted (the plan stays an upper bound for them; none is measured yet)."""
    notes = []
    if config.train.liger_kernels and not run.kernels.liger:
        notes.append("train.liger_kernels: off without CUDA (Triton kernels)")
    if config.train.expandable_segments and not run.kernels.expandable_segments:
        notes.append("train.expandable_segments: off without CUDA")
    saving = [name for name, on in (("Liger's RoPE and SwiGLU", run.kernels.liger),
                                    ("compiled layers", run.kernels.compile_layers),
                                    ("expandable segments", run.kernels.expandable_segments)) if on]
    if saving:
        notes.append(f"{', '.join(saving)}: planned without the memory they may save (not yet measured), "
                     "so the plan is an upper bound for them")
    if run.kernels.liger:
        notes.append("Liger's RMSNorm: planned as its fused kernel allocates (no fp32 copies of the hidden states) for "
                     f"the models it patches ({', '.join(LIGER_RMS_NORM_MODELS)}), as the model's own norm elsewhere")
    if run.kernels.attention == "flex_attention":
        notes.append("flex attention: planned as a fused kernel without a mask, like FlashAttention-2 (not yet "
                     "measured)")
    return notes
