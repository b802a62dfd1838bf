"""Planning a run: simulate, choose, present.

:func:`make_plan` reads top to bottom: it resolves the run (:mod:`sft_play.run`) for the hardware
(:mod:`sft_play.planner.target`), searches the micro-batches that fit one GPU's budget
(:mod:`sft_play.planner.choose.search`, over the simulation's predictions,
:mod:`sft_play.planner.simulate.predict`), decides the split (:mod:`sft_play.planner.choose.split`),
plans the remedies when nothing fits (:mod:`sft_play.planner.choose.remedies`), predicts the time
(:mod:`sft_play.planner.simulate.timing`), and says what the plan means
(:mod:`sft_play.planner.present.notes`). :mod:`sft_play.planner.present.report` renders it.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Any

from sft_play import patches
from sft_play.config import RunConfig, consistency_problems, sequence_split_problem
from sft_play.errors import UserError
from sft_play.parallelism import Strategy
from sft_play.planner.choose import remedies as remedy_catalogue
from sft_play.planner.choose.search import FitSearch
from sft_play.planner.choose.split import budget_bytes, decide_split, safety_fraction
from sft_play.planner.present.notes import epoch_notes, host_memory, run_notes, split_notes, vision_notes
from sft_play.planner.present.evidence import evidence
from sft_play.planner.simulate.predict import REPLAYS, predict, static_lower_bound
from sft_play.planner.simulate.shapes import ModelShape, model_shape
from sft_play.planner.simulate.timing import PEAK_BF16, predict_time, total_steps
from sft_play.planner.target import Target
from sft_play.run import BatchSplit, Run, facts_of, resolve
from sft_play.units import GIB


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
    world_size: int  # processes; the rows of a step are split among world_size / sequence_parallel of them
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
    sequence_parallel: int = 1  # processes each row is split across (distributed.sequence_parallel, as resolved)
    context_parallel: int = 1  # the same with torch's ring attention (distributed.context_parallel)
    # what the memory figures rest on: GPU measurements of runs of this kind, rules checked on CPU
    # steps, what neither covered (present/evidence.py)
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def split(self) -> BatchSplit:
        return BatchSplit(self.micro_batch_size, self.gradient_accumulation_steps,
                          self.world_size // (self.sequence_parallel * self.context_parallel),
                          self.requested_global_batch_size)

    def describe(self) -> str:
        """The start-up line: ``global 64 = micro 4 x accum 2 x world 8; predicted peak 61.2 GiB of 79.1 GiB``."""
        peak, budget = self.peak_bytes_per_gpu / GIB, self.budget_bytes_per_gpu / GIB
        digits = 1 if f"{peak:.1f}" != f"{budget:.1f}" else 2  # "23.3 of 23.3 GiB" read as no room at all
        shards, kind = ((self.sequence_parallel, "sequence parallel") if self.sequence_parallel > 1
                        else (self.context_parallel, "context parallel"))
        split = f" ({self.world_size} processes, each row split across {shards}: {kind})" if shards > 1 else ""
        return f"{self.split.describe()}{split}; predicted peak {peak:.{digits}f} GiB of {budget:.{digits}f} GiB"


def resolve_for(config: RunConfig, target: Target, data_stats: Any | None = None,
                shape: ModelShape | None = None) -> Run:
    """The run `config` makes on `target` (see :func:`sft_play.run.resolve`); a UserError listing
    why, where it cannot train there (:func:`sft_play.config.consistency_problems`, asked with the
    target's processes and devices, the model and the attention kernel the run resolved)."""
    # the processes and devices first: the run groups the processes as the config says
    problems = consistency_problems(config, target.world_size, not target.on_cuda)
    if problems:
        raise UserError("\n".join(problems))
    facts = shape.facts if shape is not None else facts_of(config)
    run = resolve(config, on_cuda=target.on_cuda, bf16_supported=target.bf16_supported,
                  world_size=target.world_size, data_stats=data_stats, model_facts=facts,
                  local=target.source in ("detected", "host memory"),
                  outside_allocator_measured=target.outside_allocator_measured,
                  cuda_capability=target.compute_capability)
    problems = consistency_problems(config, target.world_size, not target.on_cuda, facts, run.kernels.attention,
                                    run.images)
    if problems:
        raise UserError("\n".join(problems))
    return run


def plan_budget(config: RunConfig, target: Target, run: Run) -> tuple[int, float, str | None]:
    """The bytes a process of `run` may hold on each GPU of `target` (its free memory less the
    configured margin and fraction), the fraction, and the note that explains the fraction."""
    fraction, margin_note = safety_fraction(config.planner.safety_fraction, run.kernels.attention, target.on_cuda)
    return budget_bytes(target.free_bytes, config.planner.safety_margin_gib, fraction), fraction, margin_note


@dataclass(frozen=True)
class PlanOptions:
    """What a plan covers besides the run as configured.

    Attributes:
        remedies: when nothing fits, plan the remedies and the smallest hardware.
        shorter_rows: report the envelope over shorter rows and smaller batches
            (:meth:`sft_play.planner.choose.search.FitSearch.envelope`); the remedy search's quick
            plans do without (each remedy is a plan of its own once it runs).
    """

    remedies: bool = True
    shorter_rows: bool = True


WITHOUT_REMEDIES = PlanOptions(remedies=False)
QUICK = PlanOptions(remedies=False, shorter_rows=False)  # whether something fits, for the remedy search


@dataclass
class _Fit:
    """What fits one run on the budget: the search, the split it chose and the peak it reports."""

    run: Run
    search: FitSearch
    split: BatchSplit
    chosen: Any  # the split's micro-batch's Prediction
    peak: int
    breakdown: dict[str, int]
    fits: bool
    notes: list[str]
    warnings: list[str]
    split_note: str = ""  # distributed.sequence_parallel=auto: which size, and why


@dataclass
class _Remedies:
    offered: list[dict[str, Any]] = field(default_factory=list)
    smallest: str | None = None
    note: str | None = None


def make_plan(config: RunConfig, target: Target, data_stats: Any | None = None, shape: ModelShape | None = None,
              options: PlanOptions = PlanOptions(), run: Run | None = None) -> Plan:
    """Plan `config` on `target`, in three steps: the fit search and the split (:func:`_fit_run`),
    the remedies when nothing fits (:func:`remedies_for`, each a plan of its own without remedies),
    then the time and what the plan says (:func:`_finished`).

    Args:
        config: the run config (micro-batch and accumulation may be ``auto`` or fixed).
        target: the GPUs (or, for a CPU run, the host memory) to plan for.
        data_stats: the tokenised data's statistics, when the data was read (sequence lengths,
            whether rows need a mask).
        shape: the model shape, when already computed (otherwise read from the config).
        options: what the plan covers besides the run (:class:`PlanOptions`).
        run: the resolved run, when the caller already has it (otherwise resolved here).
    """
    started, started_cpu, replays_before = time.perf_counter(), time.process_time(), REPLAYS[0]
    with patches.meta_kernels_kept():  # (one switch of torch's meta kernels for every trace of the plan)
        shape = shape or model_shape(config)
        fit = _fit_run(config, target, shape, options, run or resolve_for(config, target, data_stats, shape))
        remedies = remedies_for(config, target, data_stats) if not fit.fits and options.remedies else _Remedies()
        plan = _finished(config, target, data_stats, shape, fit, remedies)
    plan.plan_seconds = round(time.perf_counter() - started, 4)
    plan.plan_cpu_seconds = round(time.process_time() - started_cpu, 4)
    plan.replays = REPLAYS[0] - replays_before
    return plan


def _planned(config: RunConfig, target: Target, data_stats: Any | None, options: PlanOptions) -> Plan:
    """A plan without remedies (what the remedy search plans for each change it tries)."""
    shape = model_shape(config)
    fit = _fit_run(config, target, shape, options, resolve_for(config, target, data_stats, shape))
    return _finished(config, target, data_stats, shape, fit, _Remedies())


def _fit_run(config: RunConfig, target: Target, shape: ModelShape, options: PlanOptions, run: Run) -> _Fit:
    """The fit of `run`; under ``distributed.sequence_parallel: auto``, of the run that splits each
    row across the fewest processes that fit it (fewer all-to-alls, more rows in parallel), or
    where none fits, across the most."""
    if config.distributed.sequence_parallel != "auto":
        return _fit(config, target, shape, options, run)
    sizes = split_sizes(shape, run)
    for position, size in enumerate(sizes):
        last = position == len(sizes) - 1
        fit = _fit(config, target, shape, options,
                   run.with_changes(parallel=dataclasses.replace(run.parallel, sequence_parallel=size)),
                   settle=last)
        # fitting here is the plan's: the node's host memory too
        fits = fit is not None and fit.fits and not _beyond_host(shape, fit.run, target, fit.split.micro_batch_size)
        if fits or last:
            fit.split_note = (f"distributed.sequence_parallel=auto: {size} "
                              + ("(the fewest processes per row that fit" if fits else "(none fits; the most")
                              + f"; possible here: {', '.join(map(str, sizes))})")
            return fit
    raise AssertionError("unreachable: the last size returns")


def _fit(config: RunConfig, target: Target, shape: ModelShape, options: PlanOptions, run: Run,
         settle: bool = True) -> _Fit | None:
    """The micro-batches that fit `run` on the budget, the split chosen from them, and the peak the
    plan reports for it. Without `settle`, None where one replay shows nothing fits (a size
    ``sequence_parallel: auto`` passes over, whose report no one reads)."""
    train = config.train
    budget, fraction, margin_note = plan_budget(config, target, run)
    if budget <= 0 and target.source != "candidate":  # (the remedies' candidate sizes may be too small)
        raise UserError(
            f"the safety margin leaves nothing to plan with: {target.free_bytes / GIB:.2f} GiB free per "
            f"{'GPU' if target.on_cuda else 'process'}, less planner.safety_margin_gib={config.planner.safety_margin_gib:g} "
            f"or planner.safety_fraction={fraction:g} of it; lower the margin, or plan for more memory (VRAM_GIB)")
    search = FitSearch(shape, run, budget,
                       per_process=max(1, -(-train.global_batch_size // run.parallel.data_parallel)),
                       fixed_accum=None if train.gradient_accumulation_steps == "auto"
                       else train.gradient_accumulation_steps, shorter_rows=options.shorter_rows)
    rejected = not settle and search.cannot_fit()
    fitting = 0 if rejected else search.largest_fitting()
    split = decide_split(train.global_batch_size, run.parallel.data_parallel, train.micro_batch_size,
                         train.gradient_accumulation_steps, fitting, run.smallest_micro_batch)
    if split.micro_batch_size < run.smallest_micro_batch:
        raise UserError(f"KTO estimates its KL term from the other answers of a micro-batch, so each process needs "
                        f"at least {run.smallest_micro_batch} a micro-batch: train.global_batch_size="
                        f"{train.global_batch_size} over {run.parallel.data_parallel} process(es) gives "
                        f"{split.micro_batch_size}; raise train.global_batch_size, or set "
                        "preference.loss_type=apo_zero_unpaired (no KL estimate)")
    if rejected:
        return None
    notes, warnings = split_notes(config, search, split, fitting)
    if margin_note:
        notes.append(margin_note)
    reported = search.reported(split)
    return _Fit(run, search, split, reported.chosen, reported.peak_bytes, reported.breakdown, reported.fits, notes,
                warnings)


def _beyond_host(shape: ModelShape, run: Run, target: Target, micro: int) -> bool:
    """Whether the node cannot hold what `run` keeps in host memory (known only for a detected node)."""
    return bool(target.host_bytes) and host_memory(shape, run, target, micro)[0] > target.host_bytes


def _timed(train: Any, target: Target, shape: ModelShape, run: Run, split: BatchSplit,
           rows: int | None) -> tuple[Any, list[str]]:
    """The predicted time of `split` (None where the GPU's peak is unknown) and what the plan says
    it leaves out."""
    step_time = predict_time(shape, run, split.global_batch_size * run.rows_per_example * run.sequence.tokens,
                             target.gpu_model or target.device_name, target.interconnect, target.gpus_per_node,
                             total_steps(train.max_steps, train.num_epochs, rows, split.global_batch_size),
                             split.gradient_accumulation_steps,
                             run.masked(split.micro_batch_size * run.rows_per_example))
    notes = []
    if step_time is None and run.on_cuda:
        notes.append(f"no time: the planner has no peak FLOP/s for '{target.gpu_model or target.device_name}' (it "
                     f"knows {', '.join(sorted(PEAK_BF16))}); GPU_MODEL=<one of them> times the plan as that GPU")
    if step_time and not step_time.wall_seconds:
        notes.append(f"no total time: the run's length is {train.num_epochs:g} epoch(s) of rows that were not counted "
                     "(the data was not read); train.max_steps, or data this machine can read, gives one")
    return step_time, notes


def _positions_warning(shape: ModelShape, data_stats: Any | None) -> list[str]:
    """What the plan says where an example is longer than the positions the model was trained on."""
    longest = getattr(data_stats, "tokens_max", 0) or 0  # an example's positions start at 0 in a packed row too
    if not shape.max_positions or longest <= shape.max_positions:
        return []
    return [f"the longest example is {longest:,} tokens, longer than the {shape.max_positions:,} positions "
            "the model was trained on (max_position_embeddings): positions past them were never seen, "
            "and a model with learned position embeddings cannot take them; lower data.max_seq_length "
            f"to {shape.max_positions:,}, or extend the context (rope_scaling in the model's config)"]


def _finished(config: RunConfig, target: Target, data_stats: Any | None, shape: ModelShape, fit: _Fit,
              remedies: _Remedies) -> Plan:
    """The plan of `fit`: its time, what it says about the run and the data, and the remedies."""
    run, search, split, chosen, train = fit.run, fit.search, fit.split, fit.chosen, config.train
    notes, warnings, fits = list(fit.notes), list(fit.warnings), fit.fits
    if remedies.note:
        notes.append(remedies.note)
    rows = getattr(data_stats, "packed_rows", None) or getattr(data_stats, "examples", None)
    if getattr(data_stats, "sampled", 0):
        rows = None  # a stream's rows are not counted: train.max_steps is the run's length
        notes.append(f"the data is streamed: its lengths are those of its first {data_stats.sampled:,} records "
                     "(data.sample_rows), and train.max_steps sets the run's length")
    step_time, time_notes = _timed(train, target, shape, run, split, rows)
    notes += time_notes
    epoch_note, epoch_warning = epoch_notes(train, rows, getattr(data_stats, "packed_rows", None) is not None, split)
    notes += [epoch_note] if epoch_note else []
    warnings += [epoch_warning] if epoch_warning else []
    warnings += _positions_warning(shape, data_stats)
    masked = run.masked(split.micro_batch_size)
    sliding = run.sliding_mask(split.micro_batch_size, shape.sliding_window)
    more_notes, more_warnings = run_notes(config, run, target, shape, masked, sliding, chosen)
    seen_notes, seen_warnings = vision_notes(config, run, shape, data_stats, chosen)
    more_notes += seen_notes
    more_warnings += seen_warnings
    host_bytes, host_note = host_memory(shape, run, target, split.micro_batch_size)
    if host_note:
        more_notes.append(host_note)
    if _beyond_host(shape, run, target, split.micro_batch_size):
        fits = False  # the node cannot hold what the run keeps in host memory
        more_warnings.append(f"the node needs {host_bytes / GIB:.1f} GiB of host memory for this run and has "
                             f"{target.host_bytes / GIB:.1f} GiB available")
    notes += more_notes
    warnings += more_warnings
    if fit.split_note:
        notes.insert(0, fit.split_note)
    return Plan(
        model=config.model.name_or_path,
        method=config.finetune.method,
        strategy=config.distributed.strategy,
        total_params=shape.total_params,
        trainable_params=shape.trainable_params,
        active_params=shape.active_params,
        experts=(f"{shape.num_experts} routed, {shape.experts_per_token} per token, "
                 + ("per-expert loop (eager)" if run.kernels.experts == "eager" else f"{run.kernels.experts} kernel")
                 if shape.num_experts else None),
        params_by_kind=shape.params_by_kind,
        micro_batch_size=split.micro_batch_size,
        gradient_accumulation_steps=split.gradient_accumulation_steps,
        world_size=target.world_size,
        global_batch_size=split.global_batch_size,
        requested_global_batch_size=train.global_batch_size,
        sequence_length=run.sequence.tokens,
        sequence_length_source=run.sequence.source,
        peak_bytes_per_gpu=fit.peak,
        budget_bytes_per_gpu=search.budget,
        free_bytes_per_gpu=target.free_bytes,
        device=target.device_name,
        fits=fits,
        breakdown=fit.breakdown,
        precision={"mixed": run.precision.mixed, "weights": run.precision.weights_dtype,
                   "compute": run.precision.compute_dtype, "adapters": run.adapter_dtype},
        attention=run.kernels.attention,
        gradient_checkpointing=run.gradient_checkpointing,
        allocated_bytes_per_gpu=chosen.allocated_bytes,
        attention_mask=masked,
        sliding_window_mask=sliding,
        on_cuda=target.on_cuda,
        host_bytes_per_node=host_bytes,
        time=step_time.to_dict() if step_time else None,
        remedies=remedies.offered,
        smallest_hardware=remedies.smallest,
        candidates=search.candidates(),
        notes=notes,
        warnings=warnings,
        sequence_parallel=run.parallel.sequence_parallel,
        context_parallel=run.parallel.context_parallel,
        evidence=evidence(run, shape),
    )


def split_sizes(shape: ModelShape, run: Run) -> list[int]:
    """The sequence-parallel sizes `run` can take on its processes, fewest first: 1, and under
    DeepSpeed each divisor of the processes that the model's heads and attention allow
    (:func:`sft_play.config.sequence_split_problem`); 1 only where rows hold images, whose tokens
    a split would part from each other (as :func:`sft_play.config.consistency_problems` refuses)."""
    world = run.parallel.world_size
    if not run.parallel.deepspeed or run.images:
        return [1]
    return [n for n in range(1, world + 1) if world % n == 0
            and (n == 1 or sequence_split_problem(shape.facts, n, run.kernels.attention, world) is None)]


def largest_split(config: RunConfig, target: Target, shape: ModelShape) -> int:
    """The most processes a row of `config` can be split across on `target` (under DeepSpeed,
    ZeRO-2 where the config has another strategy; 1 on one GPU)."""
    if target.world_size == 1 or config.model.attn_implementation in ("eager", "flex_attention"):
        return 1
    zero = [] if Strategy(config.distributed.strategy).deepspeed else ["distributed.strategy=deepspeed_zero2"]
    deepspeed = remedy_catalogue.with_overrides(config, [*zero, "distributed.sequence_parallel=1",
                                                         "distributed.context_parallel=1"])
    return max(split_sizes(shape, resolve_for(deepspeed, target, None, shape)))


def lower_bound_plan(config: RunConfig, target: Target, data_stats: Any | None = None) -> Any | None:
    """Where what `config` holds on each GPU of `target` before any activation (parameters,
    optimizer states, buffers: :func:`sft_play.planner.simulate.predict.static_lower_bound`)
    alone exceeds the budget, a plan of that bound, without a replay: it does not fit, and its
    peak is at least the bound (``peak_is_lower_bound``); None where it may fit. :func:`make_plan`
    would say the same after replaying the whole step, which the remedy search does without (most
    remedies, smallest-hardware candidates and combinations of a model far beyond the hardware)."""
    shape = model_shape(config)
    run = resolve_for(config, target, data_stats, shape)
    bound = static_lower_bound(shape, run)
    budget = plan_budget(config, target, run)[0]
    if bound <= budget:
        return None
    return SimpleNamespace(fits=False, peak_bytes_per_gpu=bound, peak_is_lower_bound=True, budget_bytes_per_gpu=budget,
                           micro_batch_size=0, time=None, host_bytes_per_node=host_memory(shape, run, target)[0])


def beyond_budget(config: RunConfig, target: Target, data_stats: Any | None = None) -> bool:
    """Whether no plan of `config` can fit on `target`: its weights and states alone exceed the
    budget (:func:`lower_bound_plan`)."""
    return lower_bound_plan(config, target, data_stats) is not None


def remedies_for(config: RunConfig, target: Target, data_stats: Any | None) -> _Remedies:
    """When nothing fits: the remedies, each planned as a plan of its own (without remedies), and
    when none fits either, the smallest hardware that would, with the note that says so. What does
    not fit is planned without covering shorter rows (three to five times fewer replays); what
    fits and is offered is planned again as the run will plan it, covering them (the combination
    search decides on the quicker plans: remedies.plan_remedies; the long-row levers split rows
    across as many processes as make plan LONGEST=1 does)."""
    def plan_without_remedies(changed: RunConfig, changed_target: Target, as_run: bool = True) -> Any:
        """A Plan, or where the weights and states alone exceed the budget, a plan of that bound
        (:func:`lower_bound_plan`, no replay); with `as_run` False, a quick Plan (no shorter rows)."""
        bound = lower_bound_plan(changed, changed_target, data_stats)
        if bound is not None:
            return bound
        quick = _planned(changed, changed_target, data_stats, QUICK)
        if not quick.fits or not as_run:
            return quick
        # what fits is planned as the run will plan it, so that what is offered is what runs
        return _planned(changed, changed_target, data_stats, WITHOUT_REMEDIES)

    offered = remedy_catalogue.plan_remedies(config, target, plan_without_remedies,
                                             largest_split(config, target, model_shape(config)))
    if any(r["fits"] for r in offered):
        return _Remedies(offered)
    smallest = remedy_catalogue.smallest_hardware(
        config, target, lambda c, t: plan_without_remedies(c, t).fits)
    return _Remedies(offered, smallest, f"nothing fits on {target.device_name}: "
                     + (f"the smallest hardware that would is {smallest}" if smallest else
                        "not even 64 GPUs of 141 GiB would (shorter sequences or a smaller model)"))


def peak_at(shape: ModelShape, run: Run, micro: int) -> int:
    """The predicted peak of one GPU at micro-batch `micro` (what calibration compares against)."""
    return predict(shape, run, micro).peak_bytes
