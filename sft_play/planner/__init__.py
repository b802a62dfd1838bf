"""The resource-aware planner: before any weight loads, decide the micro-batch and accumulation
that reach the configured global batch as fast as possible without running out of memory on
any GPU, and say why.

  shapes.py   exact parameter counts on the meta device
  memory.py   one pure function per term of a GPU's peak
  choose.py   budget, micro-batch, accumulation
  report.py   table, JSON, plot

:func:`make_plan` ties them together; ``scripts/plan.py`` and the training entry call it.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from sft_play.config import RunConfig
from sft_play.planner import memory
from sft_play.planner.choose import BatchSplit, budget_bytes, choose_split, largest_fitting_micro, split_global_batch
from sft_play.planner.shapes import ModelShape
from sft_play.precision import DTYPE_BYTES, Precision, resolve_optimizer, resolve_precision

GIB = 1024**3


@dataclass
class Target:
    """The hardware a plan is for: how many GPUs, and the free memory of the smallest."""

    world_size: int
    free_bytes: int
    device_name: str
    bf16_supported: bool = True
    on_cuda: bool = True
    source: str = "detected"


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
    remedies: list[dict[str, Any]] = field(default_factory=list)
    candidates: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    plan_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def split(self) -> BatchSplit:
        return BatchSplit(self.micro_batch_size, self.gradient_accumulation_steps, self.world_size,
                          self.requested_global_batch_size)

    def describe(self) -> str:
        """The start-up line: ``global 64 = micro 4 x accum 2 x world 8; predicted peak 61.2 GiB of 79.1 GiB``."""
        return (
            f"{self.split.describe()}; predicted peak {self.peak_bytes_per_gpu / GIB:.1f} GiB of "
            f"{self.budget_bytes_per_gpu / GIB:.1f} GiB"
        )


@dataclass(frozen=True)
class SequenceLength:
    tokens: int
    source: str
    loss_token_share: float = 1.0


def sequence_length(config: RunConfig, data_stats: Any | None) -> SequenceLength:
    """The sequence length the plan budgets for, and where it came from.

    Packed rows are filled up to ``data.max_seq_length``; without packing a batch pads to its
    longest example, so the longest example in the data bounds it. Without a tokenizer or data
    at hand, ``data.max_seq_length`` is the assumption.
    """
    limit = config.data.max_seq_length
    if data_stats is None or not data_stats.examples:
        return SequenceLength(limit, "data.max_seq_length (no tokenizer or data at hand: assumed full length)")
    share = data_stats.loss_token_share or 1.0
    if config.data.packing:
        return SequenceLength(limit, f"data.max_seq_length (packed rows; {data_stats.examples} examples, "
                              f"p95 {data_stats.tokens_p95} tokens)", share)
    longest = min(limit, data_stats.tokens_max)
    return SequenceLength(longest, f"longest example in the data ({data_stats.tokens_max} tokens, packing off; "
                          f"p50 {data_stats.tokens_p50}, p95 {data_stats.tokens_p95})", share)


def attention_kind(config: RunConfig, precision: Precision, on_cuda: bool, softcapping: bool = False) -> str:
    """The attention kernel training will use (mirrors :func:`sft_play.model.attention_implementation`)."""
    choice = config.model.attn_implementation
    if choice != "auto":
        return choice
    flash = importlib.util.find_spec("flash_attn") is not None
    if on_cuda and flash and precision.compute_dtype != "float32":
        return "flash_attention_2"
    return "eager" if softcapping else "sdpa"


def recipe_for(config: RunConfig, precision: Precision, world_size: int, on_cuda: bool = True) -> memory.Recipe:
    """The memory model's view of the run: dtypes from the precision recipe, split from the strategy."""
    method = config.finetune.method
    return memory.Recipe(
        method=method,
        weight_bytes=DTYPE_BYTES[precision.weights_dtype],
        compute_bytes=DTYPE_BYTES[precision.compute_dtype],
        mixed_precision=precision.mixed != "no",
        optimizer=resolve_optimizer(config, on_cuda),
        world_size=world_size,
        strategy=config.distributed.strategy,
        offload_optimizer=config.distributed.offload_optimizer,
        double_quant=config.quantization.double_quant,
        lora_dropout=config.lora.dropout > 0,
        lora_rank=config.lora.r,
        adapter_bytes=2 if method == "qlora" else 4,
    )


def workload_for(config: RunConfig, micro: int, seq: SequenceLength, attention: str) -> memory.Workload:
    masked = attention != "flash_attention_2" and (config.data.packing or micro > 1)
    return memory.Workload(
        micro_batch=micro,
        seq_len=seq.tokens,
        gradient_checkpointing=config.train.gradient_checkpointing,
        attention=attention,  # type: ignore[arg-type]
        masked=masked,
        loss_token_share=seq.loss_token_share,
    )


def model_shape(config: RunConfig) -> ModelShape:
    """Exact sizes of the configured model and method (config.json only, no weights)."""
    targets = config.lora.target_modules
    return _model_shape(
        config.model.name_or_path, config.model.revision, config.model.trust_remote_code, config.finetune.method,
        config.lora.r, targets if isinstance(targets, str) else tuple(targets), tuple(config.lora.modules_to_save),
        config.lora.bias,
    )


def _model_shape(name_or_path: str, revision: str | None, trust_remote_code: bool, method: str, rank: int,
                 targets: str | tuple[str, ...], modules_to_save: tuple[str, ...], bias: str) -> ModelShape:
    from sft_play.planner.shapes import with_method

    base = _base_shape(name_or_path, revision, trust_remote_code)
    if method == "full":
        return with_method(base, method)
    lora = _lora_counts(name_or_path, revision, trust_remote_code, rank, targets, modules_to_save, bias)
    return with_method(base, method, lora)


# Remedies plan other methods of the same model: the model and each adapter are counted once
@functools.lru_cache(maxsize=16)
def _base_shape(name_or_path: str, revision: str | None, trust_remote_code: bool) -> ModelShape:
    from sft_play.planner.shapes import base_shape, load_model_config

    return base_shape(load_model_config(name_or_path, revision, trust_remote_code), trust_remote_code)


@functools.lru_cache(maxsize=16)
def _lora_counts(name_or_path: str, revision: str | None, trust_remote_code: bool, rank: int,
                 targets: str | tuple[str, ...], modules_to_save: tuple[str, ...], bias: str):
    from peft import LoraConfig

    from sft_play.planner.shapes import load_model_config, lora_counts_for_config

    lora = LoraConfig(task_type="CAUSAL_LM", r=rank, target_modules=targets if isinstance(targets, str) else list(targets),
                      modules_to_save=list(modules_to_save) or None, bias=bias)
    return lora_counts_for_config(load_model_config(name_or_path, revision, trust_remote_code), lora, trust_remote_code)


# Remedies, cheapest change first: what it costs the user (speed, fidelity, money) grows down the list.
_REMEDIES: list[tuple[str, str, list[str]]] = [
    ("gradient checkpointing", "recompute activations in backward (about 30% slower)", ["train.gradient_checkpointing=true"]),
    ("8-bit AdamW", "optimizer states in 8 bits (bitsandbytes)", ["train.optimizer=adamw_8bit"]),
    ("bf16 weights", "train bf16 weights directly, without fp32 masters (half the model state)",
     ["model.torch_dtype=bfloat16"]),
    ("ZeRO-2", "shard gradients and optimizer states across the GPUs", ["distributed.strategy=deepspeed_zero2"]),
    ("optimizer offload", "ZeRO-2 with optimizer states in CPU memory (slower steps)",
     ["distributed.strategy=deepspeed_zero2", "distributed.offload_optimizer=true"]),
    ("ZeRO-3", "shard the parameters too (DeepSpeed stage 3)", ["distributed.strategy=deepspeed_zero3"]),
    ("LoRA instead of full", "train adapters on a 16-bit base", ["finetune.method=lora"]),
    ("QLoRA instead of LoRA", "adapters on a 4-bit base", ["finetune.method=qlora"]),
    ("shorter sequences", "halve data.max_seq_length", []),
    ("more GPUs", "twice the GPUs with ZeRO-2 sharding", ["distributed.strategy=deepspeed_zero2"]),
]


def _applies(name: str, config: RunConfig, target: Target) -> bool:
    if name == "gradient checkpointing":
        return not config.train.gradient_checkpointing
    if name == "8-bit AdamW":
        return config.train.optimizer in ("auto", "adamw_torch", "adamw_torch_fused") and config.finetune.method == "full"
    if name == "bf16 weights":
        return (config.finetune.method == "full" and config.model.torch_dtype in ("auto", "float32")
                and target.bf16_supported and config.train.mixed_precision in ("auto", "bf16"))
    if name == "ZeRO-2":
        return target.world_size > 1 and config.distributed.strategy == "ddp"
    if name == "optimizer offload":
        return not config.distributed.offload_optimizer and config.finetune.method == "full"
    if name == "ZeRO-3":
        return target.world_size > 1 and config.distributed.strategy != "deepspeed_zero3" and config.finetune.method != "qlora"
    if name == "LoRA instead of full":
        return config.finetune.method == "full"
    if name == "QLoRA instead of LoRA":
        return config.finetune.method == "lora"
    if name == "shorter sequences":
        return config.data.max_seq_length > 256
    return True


def _changed(config: RunConfig, name: str, overrides: list[str]) -> RunConfig:
    from sft_play.config import parse_override

    changed = copy.deepcopy(config)
    for text in overrides:
        key, value = parse_override(text)
        section, attribute = key.split(".")
        setattr(getattr(changed, section), attribute, value)
    if name == "shorter sequences":
        changed.data.max_seq_length = config.data.max_seq_length // 2
    return changed


def make_plan(
    config: RunConfig,
    target: Target,
    data_stats: Any | None = None,
    shape: ModelShape | None = None,
    with_remedies: bool = True,
) -> Plan:
    """Plan `config` on `target`.

    Args:
        config: the run config (micro-batch and accumulation may be ``auto`` or fixed).
        target: the GPUs (or, for a CPU run, the host memory) to plan for.
        data_stats: the tokenised data's statistics, when the data was read (sequence lengths).
        shape: the model shape, when already computed (otherwise read from the config).
        with_remedies: when nothing fits, also plan the remedies.
    """
    started = time.perf_counter()
    shape = shape or model_shape(config)
    precision = resolve_precision(config, has_gpu=target.on_cuda, bf16_supported=target.bf16_supported)
    recipe = recipe_for(config, precision, target.world_size, target.on_cuda)
    seq = sequence_length(config, data_stats)
    attention = attention_kind(config, precision, target.on_cuda, shape.attention_softcapping)

    def terms_of(micro: int) -> dict[str, int]:
        return _terms(shape, recipe, workload_for(config, micro, seq, attention), target)

    def peak_of(micro: int) -> int:
        return sum(terms_of(micro).values())

    train = config.train
    budget = budget_bytes(target.free_bytes, config.planner.safety_margin_gib, config.planner.safety_fraction)
    per_process = max(1, -(-train.global_batch_size // target.world_size))
    notes: list[str] = []
    warnings: list[str] = []
    fitting = largest_fitting_micro(peak_of, budget, per_process)

    if isinstance(train.micro_batch_size, int):
        accum = None if train.gradient_accumulation_steps == "auto" else train.gradient_accumulation_steps
        split = split_global_batch(train.global_batch_size, target.world_size, train.micro_batch_size, accum)
        if peak_of(split.micro_batch_size) > budget:
            warnings.append(
                f"train.micro_batch_size={split.micro_batch_size} is predicted not to fit "
                f"({peak_of(split.micro_batch_size) / GIB:.1f} GiB of {budget / GIB:.1f} GiB)"
                + (f"; the largest that fits is {fitting}" if fitting else "")
            )
    elif train.gradient_accumulation_steps != "auto":
        accum = train.gradient_accumulation_steps
        micro = max(1, round(train.global_batch_size / (accum * target.world_size)))
        split = split_global_batch(train.global_batch_size, target.world_size, micro, accum)
        if fitting and micro > fitting:
            warnings.append(f"train.gradient_accumulation_steps={accum} implies micro-batch {micro}, predicted not to "
                            f"fit; the largest that fits is {fitting}")
    else:
        split = choose_split(train.global_batch_size, target.world_size, max(1, fitting))
        if fitting:
            notes.append(f"largest micro-batch that fits: {fitting}")
    if split.note:
        notes.append(split.note)

    micro = split.micro_batch_size
    terms = terms_of(micro)
    peak = sum(terms.values())
    fits = peak <= budget
    remedies = _remedies(config, target, data_stats) if (not fits and with_remedies) else []
    candidates = []
    for m in _candidate_micros(per_process, micro):
        candidate_terms = terms_of(m)
        peak_m = sum(candidate_terms.values())
        candidates.append({"micro_batch_size": m, "peak_bytes": peak_m, "fits": peak_m <= budget,
                           "breakdown": candidate_terms})
    if attention == "sdpa" and workload_for(config, micro, seq, attention).masked and target.on_cuda:
        notes.append("SDPA with packed rows uses a masked kernel (an s x s bias per layer); installing flash-attn "
                     "lets packing run mask-free and faster")
    return Plan(
        model=config.model.name_or_path,
        method=config.finetune.method,
        strategy=config.distributed.strategy,
        total_params=shape.total_params,
        trainable_params=shape.trainable_params,
        params_by_kind=shape.params_by_kind,
        micro_batch_size=split.micro_batch_size,
        gradient_accumulation_steps=split.gradient_accumulation_steps,
        world_size=target.world_size,
        global_batch_size=split.global_batch_size,
        requested_global_batch_size=train.global_batch_size,
        sequence_length=seq.tokens,
        sequence_length_source=seq.source,
        peak_bytes_per_gpu=peak,
        budget_bytes_per_gpu=budget,
        free_bytes_per_gpu=target.free_bytes,
        device=target.device_name,
        fits=fits,
        breakdown=terms,
        precision={"mixed": precision.mixed, "weights": precision.weights_dtype, "compute": precision.compute_dtype},
        attention=attention,
        gradient_checkpointing=train.gradient_checkpointing,
        remedies=remedies,
        candidates=candidates,
        notes=notes,
        warnings=warnings,
        plan_seconds=round(time.perf_counter() - started, 4),
    )


def peak_at(config: RunConfig, target: Target, data_stats: Any | None, micro: int) -> int:
    """The predicted peak of one GPU at micro-batch `micro` (what calibration compares against)."""
    shape = model_shape(config)
    precision = resolve_precision(config, has_gpu=target.on_cuda, bf16_supported=target.bf16_supported)
    seq = sequence_length(config, data_stats)
    attention = attention_kind(config, precision, target.on_cuda, shape.attention_softcapping)
    recipe = recipe_for(config, precision, target.world_size, target.on_cuda)
    return sum(_terms(shape, recipe, workload_for(config, micro, seq, attention), target).values())


def _terms(shape: ModelShape, recipe: memory.Recipe, workload: memory.Workload, target: Target) -> dict[str, int]:
    terms = memory.breakdown(shape, recipe, workload, target.on_cuda)
    if not target.on_cuda:  # host memory: no CUDA context or libraries to hold
        terms.pop("cuda_runtime")
    return terms


def target_for(hardware: Any, gpus: int | None = None, vram_gib: float | None = None,
               allow_cpu: bool = False) -> Target:
    """The hardware to plan for: given (``--gpus``/``--vram-gib``), else detected.

    Args:
        hardware: :class:`sft_play.hardware.HardwareInfo` of this machine.
        gpus: number of GPUs (all nodes); defaults to the visible ones.
        vram_gib: free memory per GPU to plan for, in GiB; plans for hardware you do not have.
        allow_cpu: on a machine without a GPU, plan against host memory instead of refusing.

    Raises:
        ValueError: no GPU here and none described.
    """
    if vram_gib is not None:
        count = gpus or 1
        return Target(count, int(vram_gib * GIB), f"{count} x {vram_gib:g} GiB (as given)", source="--vram-gib")
    if hardware.gpus:
        count = gpus or len(hardware.gpus)
        local = hardware.gpus[: min(count, len(hardware.gpus))]
        smallest = min(local, key=lambda g: g.free_bytes)
        note = "" if count <= len(hardware.gpus) else " (other nodes assumed alike)"
        return Target(count, smallest.free_bytes, f"{count} x {smallest.name}{note}",
                      bf16_supported=all(g.bf16_supported for g in local))
    if allow_cpu:
        count = gpus or 1
        # Processes on one host share its memory
        return Target(count, hardware.ram_available_bytes // count, f"CPU (host memory / {count} process(es))",
                      bf16_supported=False, on_cuda=False, source="host memory")
    raise ValueError("no CUDA GPU on this machine: say what to plan for with --gpus N --vram-gib G "
                     "(e.g. --gpus 8 --vram-gib 80)")


def _candidate_micros(per_process: int, chosen: int) -> list[int]:
    values = {chosen}
    m = 1
    while m <= per_process and len(values) < 12:
        values.add(m)
        m *= 2
    values.add(per_process)
    return sorted(v for v in values if v <= max(per_process, chosen))[:14]


def _remedies(config: RunConfig, target: Target, data_stats: Any | None) -> list[dict[str, Any]]:
    """Each applicable remedy planned on its own; if none fits alone, the cheapest combination
    that fits: remedies added in cost order until the plan fits, then any that are not needed
    taken out again."""
    remedies = []
    applicable = [(n, d, o) for n, d, o in _REMEDIES if _applies(n, config, target)]
    for name, description, overrides in applicable:
        changed = _changed(config, name, overrides)
        changed_target = _more_gpus(target) if name == "more GPUs" else target
        plan = make_plan(changed, changed_target, data_stats, None, with_remedies=False)
        remedies.append(_remedy_entry(name, description, _change_text(name, overrides, changed, changed_target), plan))
    if remedies and not any(r["fits"] for r in remedies):
        combination = _fitting_combination(config, target, data_stats, applicable)
        if combination is not None:
            names, plan, changes = combination
            remedies.append(_remedy_entry(" + ".join(names), "together", changes, plan))
    remedies.sort(key=lambda r: not r["fits"])  # those that work first, each group in cost order
    return remedies


def _more_gpus(target: Target) -> Target:
    return Target(**{**asdict(target), "world_size": target.world_size * 2})


def _change_text(name: str, overrides: list[str], changed: RunConfig, target: Target) -> list[str]:
    if name == "shorter sequences":
        return [f"data.max_seq_length={changed.data.max_seq_length}"]
    if name == "more GPUs":
        return [f"--gpus {target.world_size}", *overrides]
    return list(overrides)


def _apply_all(config: RunConfig, target: Target, chosen: list[tuple[str, str, list[str]]]) -> tuple[RunConfig, Target]:
    for name, _, overrides in chosen:
        config = _changed(config, name, overrides)
        if name == "more GPUs":
            target = _more_gpus(target)
    return config, target


def _fitting_combination(config: RunConfig, target: Target, data_stats: Any | None,
                         applicable: list[tuple[str, str, list[str]]]):
    chosen: list[tuple[str, str, list[str]]] = []
    plan = None
    for remedy in applicable:
        chosen.append(remedy)
        plan = make_plan(*_apply_all(config, target, chosen), data_stats, None, with_remedies=False)
        if plan.fits:
            break
    if plan is None or not plan.fits:
        return None
    for remedy in reversed(chosen[:-1]):  # drop what the later, bigger changes made unnecessary
        trial = [r for r in chosen if r is not remedy]
        trial_plan = make_plan(*_apply_all(config, target, trial), data_stats, None, with_remedies=False)
        if trial_plan.fits:
            chosen, plan = trial, trial_plan
    changed, changed_target = _apply_all(config, target, chosen)
    final: dict[str, str] = {}  # a later change of the same key wins, as it did in the plan
    for name, _, overrides in chosen:
        for change in _change_text(name, overrides, changed, changed_target):
            key, _, value = change.partition("=") if "=" in change else change.partition(" ")
            final[key] = change
    return [name for name, _, _ in chosen], plan, sorted(final.values())


def _remedy_entry(name: str, description: str, change: list[str], plan: Plan) -> dict[str, Any]:
    return {
        "name": name,
        "description": description,
        "change": change,
        "peak_bytes": plan.peak_bytes_per_gpu,
        "fits": plan.fits,
        "micro_batch_size": plan.micro_batch_size if plan.fits else None,
    }
