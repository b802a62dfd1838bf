"""Planning a run: the hardware it is for, the micro-batch and accumulation it takes, why, and
what to change when it does not fit.

:func:`make_plan` reads top to bottom: it resolves the run (:mod:`sft_play.run`), searches the
micro-batches that fit one GPU's budget (:mod:`sft_play.planner.search`, over the predictions of
:mod:`sft_play.planner.predict`), decides the split (:mod:`sft_play.planner.choose`), plans the
remedies when nothing fits (:mod:`sft_play.planner.remedies`), predicts the time
(:mod:`sft_play.planner.timing`), and says what the plan means (:func:`split_notes`,
:func:`run_notes`). :mod:`sft_play.planner.report` renders it.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Any

from sft_play.config import RunConfig
from sft_play.errors import UserError
from sft_play.hardware import GPU_CAPABILITY, gpu_model_for_memory
from sft_play.planner import memory
from sft_play.planner import remedies as remedy_catalogue
from sft_play.planner.choose import budget_bytes, decide_split, safety_fraction
from sft_play.planner.predict import REPLAYS, STAND_INS, predict, recipe_for, static_lower_bound
from sft_play.planner.search import FitSearch
from sft_play.planner.shapes import ModelShape, model_shape
from sft_play.planner.timing import GPUS_PER_NODE, PEAK_BF16, gpu_model as known_gpu_model, predict_time, total_steps
from sft_play.run import BatchSplit, Run, resolve
from sft_play.units import GIB


@dataclass
class Target:
    """The hardware a plan is for: how many GPUs, and the free memory of the smallest."""

    world_size: int
    free_bytes: int
    device_name: str
    bf16_supported: bool = True
    on_cuda: bool = True
    source: str = "detected"
    gpu_model: str = ""  # the GPU's name, for its peak FLOP/s (the time prediction)
    interconnect: str = "nvlink"  # between the GPUs of a node: nvlink or pcie
    gpus_per_node: int = 8
    # What processes were measured to hold outside PyTorch's allocator on these GPUs
    # (hardware.HardwareInfo.outside_allocator; empty for hardware described, not detected)
    outside_allocator_measured: dict[str, int] = field(default_factory=dict)
    compute_capability: tuple[int, int] | None = None  # the GPUs' (None: unknown, or no GPU)


@dataclass
class Plan:
    """A plan and why: the JSON document of ``scripts/plan.py --json``."""

    model: str
    method: str
    strategy: str
    total_params: int
    trainable_params: int
    params_by_kind: dict[str, int]
    micro_batch_size: int
    gradient_accumulation_steps: int
    world_size: int
    global_batch_size: int
    requested_global_batch_size: int
    sequence_length: int
    sequence_length_source: str
    peak_bytes_per_gpu: int
    budget_bytes_per_gpu: int
    free_bytes_per_gpu: int
    device: str
    fits: bool
    breakdown: dict[str, int]
    precision: dict[str, str]
    attention: str
    gradient_checkpointing: bool
    allocated_bytes_per_gpu: int = 0
    active_params: int = 0  # per token: a mixture-of-experts model's total less the experts a token skips
    experts: str | None = None  # "8 routed, 2 per token, grouped_mm": the MoE shape and its kernel
    attention_mask: bool = False
    sliding_window_mask: bool = False  # only the sliding-window layers get a mask (run.sliding_mask)
    on_cuda: bool = True  # planned for GPUs (else for host memory: a CPU run)
    host_bytes_per_node: int = 0  # host memory one node's processes need, loading or training (memory.host_bytes_per_node)
    time: dict[str, Any] | None = None
    remedies: list[dict[str, Any]] = field(default_factory=list)
    smallest_hardware: str | None = None
    candidates: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    plan_seconds: float = 0.0  # wall clock
    plan_cpu_seconds: float = 0.0  # this process's CPU time: what planning costs, whatever else runs
    replays: int = 0  # training steps replayed through the allocator (remedies' plans included)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def split(self) -> BatchSplit:
        return BatchSplit(self.micro_batch_size, self.gradient_accumulation_steps, self.world_size,
                          self.requested_global_batch_size)

    def describe(self) -> str:
        """The start-up line: ``global 64 = micro 4 x accum 2 x world 8; predicted peak 61.2 GiB of 79.1 GiB``."""
        peak, budget = self.peak_bytes_per_gpu / GIB, self.budget_bytes_per_gpu / GIB
        digits = 1 if f"{peak:.1f}" != f"{budget:.1f}" else 2  # "23.3 of 23.3 GiB" read as no room at all
        return f"{self.split.describe()}; predicted peak {peak:.{digits}f} GiB of {budget:.{digits}f} GiB"


def resolve_for(config: RunConfig, target: Target, data_stats: Any | None = None,
                shape: ModelShape | None = None) -> Run:
    """The run `config` makes on `target` (see :func:`sft_play.run.resolve`)."""
    return resolve(config, on_cuda=target.on_cuda, bf16_supported=target.bf16_supported,
                   world_size=target.world_size, data_stats=data_stats, model_facts=shape,
                   local=target.source in ("detected", "host memory"),
                   outside_allocator_measured=target.outside_allocator_measured,
                   cuda_capability=target.compute_capability)


def plan_budget(config: RunConfig, target: Target, run: Run) -> tuple[int, float, str | None]:
    """The bytes a process of `run` may hold on each GPU of `target` (its free memory less the
    configured margin and fraction), the fraction, and the note that explains the fraction."""
    fraction, margin_note = safety_fraction(config.planner.safety_fraction, run.attention, target.on_cuda)
    return budget_bytes(target.free_bytes, config.planner.safety_margin_gib, fraction), fraction, margin_note


def make_plan(
    config: RunConfig,
    target: Target,
    data_stats: Any | None = None,
    shape: ModelShape | None = None,
    with_remedies: bool = True,
    run: Run | None = None,
    shorter_rows: bool = True,
) -> Plan:
    """Plan `config` on `target`: the fit search, the split, the remedies when nothing fits, the
    time, and what the plan says about them, in that order.

    Args:
        config: the run config (micro-batch and accumulation may be ``auto`` or fixed).
        target: the GPUs (or, for a CPU run, the host memory) to plan for.
        data_stats: the tokenised data's statistics, when the data was read (sequence lengths,
            whether rows need a mask).
        shape: the model shape, when already computed (otherwise read from the config).
        with_remedies: when nothing fits, also plan the remedies and the smallest hardware.
        run: the resolved run, when the caller already has it (otherwise resolved here).
        shorter_rows: cover rows of the ladder's shorter lengths (:mod:`sft_play.planner.search`);
            the remedy search does not: each remedy is a plan of its own once it runs.
    """
    started, started_cpu, replays_before = time.perf_counter(), time.process_time(), REPLAYS[0]
    shape = shape or model_shape(config)
    run = run or resolve_for(config, target, data_stats, shape)
    train = config.train

    budget, fraction, margin_note = plan_budget(config, target, run)
    if budget <= 0 and target.source != "candidate":  # (the remedies' candidate sizes may be too small)
        raise UserError(
            f"the safety margin leaves nothing to plan with: {target.free_bytes / GIB:.2f} GiB free per "
            f"{'GPU' if target.on_cuda else 'process'}, less planner.safety_margin_gib={config.planner.safety_margin_gib:g} "
            f"or planner.safety_fraction={fraction:g} of it; lower the margin, or plan for more memory (VRAM_GIB)")
    search = FitSearch(shape, run, budget,
                       per_process=max(1, -(-train.global_batch_size // target.world_size)),
                       fixed_accum=None if train.gradient_accumulation_steps == "auto"
                       else train.gradient_accumulation_steps, shorter_rows=shorter_rows)
    fitting = search.largest_fitting()
    split = decide_split(train.global_batch_size, target.world_size, train.micro_batch_size,
                         train.gradient_accumulation_steps, fitting)
    # rows shorter than planned, for the micro-batches this split trains (rare: the cache's swing at
    # a shorter length): the largest that fits is then below them, and the split is chosen again
    rows_fitting = search.shorter_rows_fitting(min(split.micro_batch_size, fitting))
    if rows_fitting < min(split.micro_batch_size, fitting):
        fitting = rows_fitting
        split = decide_split(train.global_batch_size, target.world_size, train.micro_batch_size,
                             train.gradient_accumulation_steps, fitting)
    notes, warnings = split_notes(config, search, split, fitting)
    if margin_note:
        notes.append(margin_note)
    chosen, peak, breakdown = search.reported(split)
    fits = bool(chosen.fits) and peak <= search.budget

    remedies: list[dict[str, Any]] = []
    smallest = None
    if not fits and with_remedies:
        remedies, smallest, note = remedies_for(config, target, data_stats)
        if note:
            notes.append(note)
    rows = getattr(data_stats, "packed_rows", None) or getattr(data_stats, "examples", None)
    step_time = predict_time(shape, run, split.global_batch_size * run.sequence.tokens,
                             target.gpu_model or target.device_name, target.interconnect, target.gpus_per_node,
                             total_steps(train.max_steps, train.num_epochs, rows, split.global_batch_size),
                             split.gradient_accumulation_steps)
    if step_time is None and run.on_cuda:
        notes.append(f"no time: the planner has no peak FLOP/s for '{target.gpu_model or target.device_name}' (it "
                     f"knows {', '.join(sorted(PEAK_BF16))}); GPU_MODEL=<one of them> times the plan as that GPU")
    if step_time and not step_time.wall_seconds:
        notes.append(f"no total time: the run's length is {train.num_epochs:g} epoch(s) of rows that were not counted "
                     "(the data was not read); train.max_steps, or data this machine can read, gives one")
    epoch_note, epoch_warning = epoch_notes(train, rows, getattr(data_stats, "packed_rows", None) is not None, split)
    notes += [epoch_note] if epoch_note else []
    warnings += [epoch_warning] if epoch_warning else []
    longest = getattr(data_stats, "tokens_max", 0) or 0  # an example's positions start at 0 in a packed row too
    if shape.max_positions and longest > shape.max_positions:
        warnings.append(f"the longest example is {longest:,} tokens, longer than the {shape.max_positions:,} positions "
                        "the model was trained on (max_position_embeddings): positions past them were never seen, "
                        "and a model with learned position embeddings cannot take them; lower data.max_seq_length "
                        f"to {shape.max_positions:,}, or extend the context (rope_scaling in the model's config)")
    masked = run.masked(split.micro_batch_size)
    sliding = run.sliding_mask(split.micro_batch_size, shape.sliding_window)
    more_notes, more_warnings = run_notes(config, run, target, shape, masked, sliding)
    host_bytes, host_note = host_memory(shape, run, target)
    if host_note:
        more_notes.append(host_note)
    notes += more_notes
    warnings += more_warnings
    return Plan(
        model=config.model.name_or_path,
        method=config.finetune.method,
        strategy=config.distributed.strategy,
        total_params=shape.total_params,
        trainable_params=shape.trainable_params,
        active_params=shape.active_params,
        experts=(f"{shape.num_experts} routed, {shape.experts_per_token} per token, "
                 + ("per-expert loop (eager)" if run.experts == "eager" else f"{run.experts} kernel")
                 if shape.num_experts else None),
        params_by_kind=shape.params_by_kind,
        micro_batch_size=split.micro_batch_size,
        gradient_accumulation_steps=split.gradient_accumulation_steps,
        world_size=target.world_size,
        global_batch_size=split.global_batch_size,
        requested_global_batch_size=train.global_batch_size,
        sequence_length=run.sequence.tokens,
        sequence_length_source=run.sequence.source,
        peak_bytes_per_gpu=peak,
        budget_bytes_per_gpu=search.budget,
        free_bytes_per_gpu=target.free_bytes,
        device=target.device_name,
        fits=fits,
        breakdown=breakdown,
        precision={"mixed": run.precision.mixed, "weights": run.precision.weights_dtype,
                   "compute": run.precision.compute_dtype, "adapters": run.adapter_dtype},
        attention=run.attention,
        gradient_checkpointing=run.gradient_checkpointing,
        allocated_bytes_per_gpu=chosen.allocated_bytes,
        attention_mask=masked,
        sliding_window_mask=sliding,
        on_cuda=target.on_cuda,
        host_bytes_per_node=host_bytes,
        time=step_time.to_dict() if step_time else None,
        remedies=remedies,
        smallest_hardware=smallest,
        candidates=search.candidates(),
        notes=notes,
        warnings=warnings,
        plan_seconds=round(time.perf_counter() - started, 4),
        plan_cpu_seconds=round(time.process_time() - started_cpu, 4),
        replays=REPLAYS[0] - replays_before,
    )


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
    elif fitting and fitting >= search.per_process:
        notes.append(f"micro-batch {fitting} is the whole per-process share of the global batch, and it fits: "
                     "memory is not what limits it")
    elif fitting:
        notes.append(f"largest micro-batch that fits: {fitting}")
    if split.note:  # the global batch changed: a warning when the user fixed the split it follows from
        fixed = isinstance(train.micro_batch_size, int) or isinstance(train.gradient_accumulation_steps, int)
        (warnings if fixed and split.global_batch_size != train.global_batch_size else notes).append(split.note)
    return notes, warnings


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


# What a fit-only question gets where the weights and optimizer states alone exceed the budget
_NOTHING_FITS: Any = SimpleNamespace(fits=False)


def beyond_budget(config: RunConfig, target: Target, data_stats: Any | None = None) -> bool:
    """Whether what `config` holds on each GPU of `target` before any activation (parameters,
    optimizer states, buffers: :func:`sft_play.planner.predict.static_lower_bound`) alone exceeds
    the budget, so that no plan of it fits: :func:`make_plan` would say so after a replay of the
    whole step, which the remedy search, asking only whether something fits, does without (most
    of the smallest-hardware candidates and of the combinations it tries are such)."""
    shape = model_shape(config)
    run = resolve_for(config, target, data_stats, shape)
    return static_lower_bound(shape, run) > plan_budget(config, target, run)[0]


def remedies_for(config: RunConfig, target: Target,
                 data_stats: Any | None) -> tuple[list[dict[str, Any]], str | None, str | None]:
    """When nothing fits: the remedies, each planned as a plan of its own (without remedies), and
    when none fits either, the smallest hardware that would, with the note that says so. What does
    not fit is planned without covering shorter rows (three to five times fewer replays); what
    fits and is offered is planned again as the run will plan it, covering them (the combination
    search decides on the quicker plans: remedies.plan_remedies)."""
    def plan_without_remedies(changed: RunConfig, changed_target: Target, as_run: bool = True) -> Any:
        """A Plan; with `as_run` False, something whose `fits` says whether it fits (a quick Plan)."""
        if not as_run and beyond_budget(changed, changed_target, data_stats):
            return _NOTHING_FITS  # whether it fits is all the combination search asks: no replay
        quick = make_plan(changed, changed_target, data_stats, None, with_remedies=False, shorter_rows=False)
        if not quick.fits or not as_run:
            return quick
        # what fits is planned as the run will plan it, so that what is offered is what runs
        return make_plan(changed, changed_target, data_stats, None, with_remedies=False)

    remedies = remedy_catalogue.plan_remedies(config, target, plan_without_remedies)
    if any(r["fits"] for r in remedies):
        return remedies, None, None
    smallest = remedy_catalogue.smallest_hardware(
        config, target, lambda c, t: not beyond_budget(c, t, data_stats) and plan_without_remedies(c, t).fits)
    return remedies, smallest, (f"nothing fits on {target.device_name}: "
                                + (f"the smallest hardware that would is {smallest}" if smallest else
                                   "not even 64 GPUs of 141 GiB would (shorter sequences or a smaller model)"))


def run_notes(config: RunConfig, run: Run, target: Target, shape: ModelShape,
              masked: bool, sliding: bool = False) -> tuple[list[str], list[str]]:
    """What the plan says about the run it planned (notes, warnings): the attention kernel and its
    mask, the kernel switches, what lives outside the allocator, a layer planned by a stand-in,
    and what a mixture-of-experts model changes."""
    notes: list[str] = []
    warnings: list[str] = []
    if run.attention == "sdpa" and masked and target.on_cuda:
        notes.append("SDPA with packed rows uses the memory-efficient kernel with an s x s mask per layer; "
                     "installing flash-attn, or model.attn_implementation=flex_attention, lets packing run mask-free")
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
            and run.attention == "sdpa" and run.on_cuda:
        notes.append("model.attn_implementation=auto on hardware described, not this machine's: planned as SDPA; "
                     "where flash-attn is installed, plan with model.attn_implementation=flash_attention_2")
    if config.model.name_or_path in STAND_INS:
        warnings.append(f"the layers of {config.model.name_or_path} could not be traced ({STAND_INS[config.model.name_or_path]}):"
                        " planned as Llama-shaped layers of its widths, which is not a bound proven for this "
                        "architecture; training goes ahead with the out-of-memory backoff as the safety net")
    if run.lora is not None and shape.lora_unadapted:
        left = shape.lora_unadapted
        warnings.append(f"LoRA all-linear leaves these linears of the layers without an adapter: "
                        f"{', '.join(left[:6])}{' ...' if len(left) > 6 else ''} (peft gives this family's gate/up/"
                        "down_proj names to the routed experts' fused weights, so the dense and shared-expert "
                        "projections of those names stay frozen); the rest, the experts included, train")
    if run.lora is not None and run.lora.dropout != config.lora.dropout:
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


def host_memory(shape: ModelShape, run: Run, target: Target) -> tuple[int, str | None]:
    """The host memory one node needs on a GPU run (the larger of loading and training) and the
    note that says what for (:func:`sft_play.planner.memory.host_bytes_per_node`)."""
    if not target.on_cuda:
        return 0, None
    processes = min(target.world_size, target.gpus_per_node)
    recipe = recipe_for(run)
    loading, training = memory.host_bytes_per_node(shape, recipe, processes)
    parts = []
    if loading:
        parts.append(f"{loading / GIB:.1f} GiB while its {processes} process(es) load the model under ZeRO-3's "
                     "zero.Init (a layer at a time)")
    if training:
        parts.append(f"{training / GIB:.1f} GiB offloaded while training")
    if not parts:
        return 0, None
    allowance = " (DeepSpeed's own estimators allow 1.5x that)" if recipe.parallel.deepspeed else ""
    return max(loading, training), "host memory per node: " + "; ".join(parts) + allowance


def peak_at(shape: ModelShape, run: Run, micro: int) -> int:
    """The predicted peak of one GPU at micro-batch `micro` (what calibration compares against)."""
    return predict(shape, run, micro).peak_bytes


# GPUs linked by NVLink in the servers they usually come in (SXM boards); the others talk over PCIe
NVLINK_GPUS = frozenset({"H100", "H200", "B200", "A100"})


def target_for(hardware: Any, gpus: int | None = None, vram_gib: float | None = None,
               allow_cpu: bool = False, gpu_model: str | None = None, nodes: int | None = None) -> Target:
    """The hardware to plan for: given (``--gpus``/``--vram-gib``), else detected.

    Args:
        hardware: :class:`sft_play.hardware.HardwareInfo` of this machine.
        gpus: number of GPUs (all nodes); defaults to the visible ones.
        vram_gib: free memory per GPU to plan for, in GiB; plans for hardware you do not have.
        allow_cpu: on a machine without a GPU, plan against host memory instead of refusing.
        gpu_model: the GPU model described hardware has (for the time prediction); by default the
            one its memory size most often means (80 GiB: H100).
        nodes: nodes of `gpus` GPUs each (as ``make train-distributed`` reads NNODES and NUM_GPUS);
            without it `gpus` counts every GPU, eight to a node.

    Raises:
        ValueError: no GPU here and none described, or a count or size that is not positive.
    """
    if gpus is not None and gpus < 1:
        raise ValueError(f"the number of GPUs must be at least 1 (got {gpus}): NUM_GPUS=8 or --gpus 8")
    if vram_gib is not None and vram_gib <= 0:
        raise ValueError(f"the GPU memory must be positive (got {vram_gib:g} GiB): VRAM_GIB=80 or --vram-gib 80")
    if gpu_model is not None and known_gpu_model(gpu_model) is None:
        raise ValueError(f"GPU model '{gpu_model}' is not one the planner can time (it knows "
                         f"{', '.join(sorted(PEAK_BF16))}; GPU_MODEL=\"RTX 4090\" with the quotes for a name with a "
                         "space): leave GPU_MODEL out to time the plan as the GPU the memory size most often means")
    if nodes is not None and nodes < 1:
        raise ValueError(f"the number of nodes must be at least 1 (got {nodes}): NNODES=2 or --nodes 2")
    if vram_gib is not None:
        # NUM_GPUS alone: all GPUs together, 8 to a node; with NNODES: GPUs per node, as training reads it
        per_node = (gpus or 1) if nodes else min(gpus or 1, GPUS_PER_NODE)
        count = (gpus or 1) * (nodes or 1)
        model = known_gpu_model(gpu_model) if gpu_model else gpu_model_for_memory(vram_gib)
        where = f"{nodes} node(s) x {per_node}" if nodes else f"{count}"
        linked = known_gpu_model(model or "") in NVLINK_GPUS
        return Target(count, int(vram_gib * GIB),
                      f"{where} x {vram_gib:g} GiB (as given; timed as {model or '?'}, "
                      f"{'NVLink' if linked else 'PCIe'} within a node of {per_node})",
                      source="--vram-gib", gpu_model=model, interconnect="nvlink" if linked else "pcie",
                      gpus_per_node=per_node, compute_capability=GPU_CAPABILITY.get(known_gpu_model(model or "") or ""))
    if hardware.gpus:
        count = (gpus or len(hardware.gpus)) * (nodes or 1)
        local = hardware.gpus[: min(count, len(hardware.gpus))]
        smallest = min(local, key=lambda g: g.free_bytes)
        note = "" if count <= len(hardware.gpus) else " (other nodes assumed alike)"
        linked = all(g.nvlinks_active for g in local) if len(local) > 1 else True
        return Target(count, smallest.free_bytes, f"{count} x {smallest.name}{note}",
                      bf16_supported=all(g.bf16_supported for g in local),
                      gpu_model=(known_gpu_model(gpu_model) if gpu_model else None) or smallest.name,
                      interconnect="nvlink" if linked else "pcie", gpus_per_node=len(hardware.gpus),
                      outside_allocator_measured=dict(hardware.outside_allocator),
                      compute_capability=tuple(smallest.compute_capability))
    if allow_cpu:
        count = gpus or 1
        # Processes on one host share its memory
        return Target(count, hardware.ram_available_bytes // count, f"CPU (host memory / {count} process(es))",
                      bf16_supported=hardware.cpu_bf16, on_cuda=False, source="host memory")
    raise ValueError("no CUDA GPU on this machine: say what to plan for with NUM_GPUS=N VRAM_GIB=G "
                     "(e.g. make plan NUM_GPUS=8 VRAM_GIB=80; scripts/plan.py takes --gpus 8 --vram-gib 80)")


def kernel_notes(config: RunConfig, run: Run) -> list[str]:
    """What the plan says about the kernel switches: where one is off, and that the memory they
    save is not predicted (the plan stays an upper bound for them; none is measured yet)."""
    notes = []
    if config.train.liger_kernels and not run.liger:
        notes.append("train.liger_kernels: off without CUDA (Triton kernels)")
    if config.train.expandable_segments and not run.expandable_segments:
        notes.append("train.expandable_segments: off without CUDA")
    saving = [name for name, on in (("Liger kernels", run.liger), ("compiled layers", run.compile_layers),
                                    ("expandable segments", run.expandable_segments)) if on]
    if saving:
        notes.append(f"{', '.join(saving)}: planned without the memory they may save (not yet measured), "
                     "so the plan is an upper bound for them")
    if run.attention == "flex_attention":
        notes.append("flex attention: planned as a fused kernel without a mask, like FlashAttention-2 (not yet "
                     "measured)")
    return notes
