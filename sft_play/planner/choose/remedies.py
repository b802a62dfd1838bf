"""What to change when a run does not fit: remedies as data, each with the config overrides it
applies, the make target that runs it, and when it applies; and the smallest hardware that
would run the config when nothing on the given hardware does.

A remedy is planned like the run itself (the same prediction), so each one shown comes with
its predicted peak and whether it fits; those that fit are ranked as a careful engineer picks
(:func:`rank`: the hardware at hand, the same training, room to spare, then speed).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from sft_play.architecture import config_identity, is_vision_language, load_model_config, sizes_by_pixels
from sft_play.config import REFERENCE_FREE, RunConfig, parse_override
from sft_play.config.schema import consistency_problems
from sft_play.hardware import gpu_model_for_memory
from sft_play.parallelism import Strategy
from sft_play.planner import progress
from sft_play.planner.simulate import cache
from sft_play.planner.simulate.predict import side_by_side
from sft_play.planner.simulate.timing import GPUS_PER_NODE
from sft_play.precision import resolve_precision
from sft_play.units import GIB

# What a remedy needs to know about the hardware: how many GPUs (a Target)
Applies = Callable[[RunConfig, Any], bool]
# Plans a config on a target without remedies; the flag: planned as the run will plan it (see plan_remedies)
PlanFor = Callable[[RunConfig, Any, bool], Any]


# What a remedy does to the trained model: nothing (the same arithmetic, or sharded or moved
# elsewhere), nearly nothing (rounding or regularisation changes), or the model itself (precision,
# method, data)
SAME, CLOSE, CHANGED = 0, 1, 2
RESULT = {SAME: "the same training", CLOSE: "nearly the same training", CHANGED: "changes what is trained"}
# A plan that fits with less than this share of its budget left is tight: a careful engineer takes
# a remedy with room to spare before a faster one without
TIGHT_HEADROOM = 0.05


@dataclass(frozen=True)
class Remedy:
    """One change that lowers the memory of a run.

    Attributes:
        name: a short label.
        description: what it does and what it costs.
        overrides: the ``key=value`` overrides it applies.
        make_target: the make target that runs the changed config.
        applies: whether it changes anything for a config on a target.
        gpu_factor: multiplies the number of GPUs (more hardware).
        halve_sequence: halves ``data.max_seq_length``.
        halve_pixels: halves ``data.image_max_pixels`` (:func:`smaller_pixel_budget`).
        unsplit: the description where its rows are not split (a vision-language model's), if it differs.
        result: what it does to the trained model (:data:`SAME`, :data:`CLOSE`, :data:`CHANGED`).
    """

    name: str
    description: str
    overrides: tuple[str, ...]
    make_target: str
    applies: Applies
    gpu_factor: int = 1
    halve_sequence: bool = False
    halve_pixels: bool = False
    result: int = SAME
    unsplit: str = ""

    def overrides_for(self, config: RunConfig) -> tuple[str, ...]:
        """The overrides and, where they leave QLoRA's packed weights sharded (ZeRO-3, FSDP2) but
        stored as bytes, which cannot be, the float storage that can (the weights' 16-bit dtype).
        A vision-language model's rows are never split (an image's tokens stay with its pixels):
        no sequence parallelism for it."""
        overrides = self.overrides
        if _unsplit(config):
            overrides = tuple(o for o in overrides if not o.startswith("distributed.sequence_parallel="))
        changed = with_overrides(config, overrides)
        if changed.finetune.method != "full" and changed.preference.reference == "copy":  # (adapters: the base is free)
            overrides = (*overrides, "preference.reference=adapters_off")
        if (changed.finetune.method == "qlora" and Strategy(changed.distributed.strategy).shards_parameters
                and changed.quantization.quant_storage == "uint8"):
            storage = "float16" if changed.model.torch_dtype == "float16" else "bfloat16"
            return (*overrides, f"quantization.quant_storage={storage}")
        return overrides

    def description_for(self, config: RunConfig) -> str:
        """The description, or where :meth:`overrides_for` splits no row for `config` (a
        vision-language model, preference pairs), :attr:`unsplit`."""
        return self.unsplit if self.unsplit and _unsplit(config) else self.description

    def config_for(self, config: RunConfig) -> RunConfig:
        changed = with_overrides(config, self.overrides_for(config))
        if self.halve_sequence:
            changed.data.max_seq_length = config.data.max_seq_length // 2
        if self.halve_pixels:
            changed.data.image_max_pixels = smaller_pixel_budget(config)
        return changed

    def target_for(self, target: Any) -> Any:
        if self.gpu_factor == 1:
            return target
        return type(target)(**{**asdict(target), "world_size": target.world_size * self.gpu_factor})

    def change_text(self, config: RunConfig, target: Any) -> list[str]:
        """The overrides as the user types them (plus ``NUM_GPUS=N``, make's variable, for more GPUs)."""
        changes = list(self.overrides_for(config))
        if self.halve_sequence:
            changes.append(f"data.max_seq_length={config.data.max_seq_length // 2}")
        if self.halve_pixels:
            changes.append(f"data.image_max_pixels={smaller_pixel_budget(config)}")
        if self.gpu_factor > 1:
            changes.insert(0, gpus_text(target.world_size * self.gpu_factor))
        return changes


def with_overrides(config: RunConfig, overrides: tuple[str, ...] | list[str]) -> RunConfig:
    """A copy of `config` with ``section.key=value`` `overrides` applied, later ones winning."""
    changed = copy.deepcopy(config)
    for text in overrides:
        key, value = parse_override(text)
        section, attribute = key.split(".")
        setattr(getattr(changed, section), attribute, value)
    return changed


def gpus_text(world: int) -> str:
    """`world` GPUs as ``make train-distributed`` takes them: NUM_GPUS per node, NNODES nodes of
    eight beyond one node."""
    if world > GPUS_PER_NODE and world % GPUS_PER_NODE == 0:
        return f"NNODES={world // GPUS_PER_NODE} NUM_GPUS={GPUS_PER_NODE}"
    return f"NUM_GPUS={world}"


def _full(config: RunConfig) -> bool:
    return config.finetune.method == "full"


def _multi_gpu(target: Any) -> bool:
    return target.world_size > 1


def _strategy(config: RunConfig) -> Strategy:
    return Strategy(config.distributed.strategy)


def _splittable(config: RunConfig, target: Any) -> bool:
    """Long rows, several GPUs, not split yet, and an attention kernel a split sequence runs on
    (the model's own limits are the plan's: sft_play.config.sequence_split_problem)."""
    return (_multi_gpu(target) and _sft(config) and config.distributed.sequence_parallel == 1
            and config.data.max_seq_length >= 8192
            and config.model.attn_implementation not in ("eager", "flex_attention") and not _strategy(config).fsdp
            and not _vision_language(config))


def _vision_language(config: RunConfig) -> bool:
    return _vision_facts(config.model.name_or_path, config.model.revision, config.model.trust_remote_code)[0]


def _unsplit(config: RunConfig) -> bool:
    """Rows that are never split across processes: a vision-language model's (an image's tokens
    stay with its pixels), and preference pairs (TRL's DPO step is not split)."""
    return _vision_language(config) or config.finetune.objective != "sft"


def _sft(config: RunConfig) -> bool:
    return config.finetune.objective == "sft"


def _reference_kept(config: RunConfig) -> bool:
    """A DPO run whose reference log-probs come from a forward in each step (not precomputed; ORPO
    and SimPO have no reference)."""
    return (config.finetune.objective not in REFERENCE_FREE and not _sft(config)
            and config.preference.reference != "precomputed" and not config.data.streaming)


@functools.lru_cache(maxsize=32)
def _vision_facts(name_or_path: str, revision: str | None, trust_remote_code: bool) -> tuple[bool, bool]:
    """(whether the model sees images, whether its processor sizes them by a pixel budget), read
    from the model's config once and kept on disk beside its shape: a warm plan's remedies then
    import no transformers (two seconds of a plan otherwise)."""
    keeps = cache.keeps(name_or_path, trust_remote_code)
    key = (config_identity(name_or_path, revision, trust_remote_code),)
    kept = cache.kept("vision", key) if keeps else None
    if kept is not None and {"sees_images", "sizes_by_pixels"} <= set(kept):
        return bool(kept["sees_images"]), bool(kept["sizes_by_pixels"])
    model_config = load_model_config(name_or_path, revision, trust_remote_code)
    facts = {"sees_images": is_vision_language(model_config), "sizes_by_pixels": sizes_by_pixels(model_config)}
    if keeps:
        cache.keep("vision", key, facts)
    return facts["sees_images"], facts["sizes_by_pixels"]


def _masked_sdpa(config: RunConfig, target: Any) -> bool:
    """Packed rows under SDPA on CUDA, whole rows: an s x s mask a mask-free kernel does without."""
    return (target.on_cuda and config.data.packing and config.model.attn_implementation in ("auto", "sdpa")
            and config.distributed.sequence_parallel == 1 and config.distributed.context_parallel == 1)


def _shardable(config: RunConfig) -> bool:
    """FSDP2 takes the config: not a LoRA run training a copy of lm_head (refused under FSDP2)."""
    return _full(config) or "lm_head" not in (config.lora.modules_to_save or [])


# The budget when none is set: 1,280 tokens of 28x28 pixels, Qwen2.5-VL's model card's advice (the
# processor's own allows 16,384; where it allows fewer, the plan of this budget is the run's own and
# does not fit either); below 256 such tokens an image keeps too little to halve again
FIRST_PIXEL_BUDGET = 1280 * 28 * 28
LEAST_PIXEL_BUDGET = 256 * 28 * 28


def smaller_pixel_budget(config: RunConfig) -> int:
    """The pixel budget the "smaller images" remedy sets: half the configured one, or
    :data:`FIRST_PIXEL_BUDGET` where none is."""
    budget = config.data.image_max_pixels
    return max(LEAST_PIXEL_BUDGET, budget // 2) if budget else FIRST_PIXEL_BUDGET


def _pixel_budgeted(config: RunConfig, target: Any) -> bool:
    """Images sized by a pixel budget (Qwen-VL) that can be halved."""
    budget = config.data.image_max_pixels
    if budget and budget <= LEAST_PIXEL_BUDGET:
        return False
    return _vision_facts(config.model.name_or_path, config.model.revision, config.model.trust_remote_code)[1]


def _large_optimizer_states(config: RunConfig) -> bool:
    """Optimizer states worth shrinking: every weight's (full), or whole copies of modules beside the adapters."""
    return _full(config) or bool(config.lora.modules_to_save)


# Cheapest change first: what a remedy costs the user (speed, fidelity, money) grows down the list
REMEDIES: tuple[Remedy, ...] = (
    Remedy("planner's micro-batch", "the micro-batch that fits, with more accumulation for the same global batch",
           ("train.micro_batch_size=auto", "train.gradient_accumulation_steps=auto"), "train",
           lambda c, t: isinstance(c.train.micro_batch_size, int) or isinstance(c.train.gradient_accumulation_steps, int)),
    Remedy("precomputed reference", "the reference's log-probs computed in one pass over the data before training: "
           "no reference forward in the steps, no copy of the weights kept (TRL's precompute_ref_log_probs)",
           ("preference.reference=precomputed",), "train", lambda c, t: _reference_kept(c)),
    Remedy("gradient checkpointing", "recompute activations in backward (about 30% slower)",
           ("train.gradient_checkpointing=true",), "train",
           lambda c, t: not c.train.gradient_checkpointing),
    Remedy("flex attention", "torch's flex attention: packed rows attend within their own examples without an s x s "
           "mask (CUDA; nothing to install; compiled on its first step)", ("model.attn_implementation=flex_attention",),
           "train", _masked_sdpa),
    Remedy("FlashAttention-2", "packed rows attend within their own examples without an s x s mask (pip install "
           "flash-attn; CUDA), and faster", ("model.attn_implementation=flash_attention_2",), "train", _masked_sdpa),
    Remedy("Liger kernels", "Liger's fused RMSNorm, RoPE and SwiGLU (pip install liger-kernel; CUDA): the norms keep no "
           "fp32 copies of the hidden states, and faster", ("train.liger_kernels=true",), "train",
           lambda c, t: t.on_cuda and not c.train.liger_kernels and c.data.max_seq_length >= 8192),
    Remedy("tiled MLP", "each layer's MLP in tiles of about hidden_size tokens (its intermediates one tile at a "
           "time; the MLP's forward runs once more; LoRA dropout off)", ("train.tiled_mlp=true", "lora.dropout=0"),
           "train", lambda c, t: not c.train.tiled_mlp and c.data.max_seq_length >= 8192 and _sft(c)
           and (t.world_size == 1 or _strategy(c).deepspeed), result=CLOSE),  # one process, or ZeRO (sft_play.long_rows)
    Remedy("activation offload", "the hidden states checkpointing keeps, one per layer, in host memory until backward "
           "(host memory and PCIe transfers)", ("train.gradient_checkpointing=true", "train.offload_activations=true"),
           "train", lambda c, t: not c.train.offload_activations and c.data.max_seq_length >= 8192 and _sft(c)),
    Remedy("8-bit AdamW", "optimizer states in 8 bits (bitsandbytes; its block-wise rounding of the states)",
           ("train.optimizer=adamw_8bit",), "train",
           lambda c, t: _large_optimizer_states(c) and c.train.optimizer in ("auto", "adamw_torch", "adamw_torch_fused"),
           result=CLOSE),
    Remedy("bf16 weights", "train bf16 weights directly, without fp32 master copies: half the model state, but updates "
           "smaller than bf16's precision round away",
           ("model.torch_dtype=bfloat16",), "train",
           lambda c, t: _full(c) and c.model.torch_dtype in ("auto", "float32") and _trains_bf16(c, t), result=CHANGED),
    Remedy("ZeRO-2", "shard gradients and optimizer states across the GPUs", ("distributed.strategy=deepspeed_zero2",),
           "train-deepspeed", lambda c, t: _multi_gpu(t) and not _strategy(c).shards_states),
    Remedy("sequence parallelism", "split each row across the GPUs (DeepSpeed Ulysses: the fewest that fit; all-to-alls "
           "in every layer's attention, fewer rows in parallel)", ("distributed.sequence_parallel=auto",),
           "train-deepspeed", lambda c, t: _splittable(c, t) and _strategy(c).deepspeed),
    Remedy("ZeRO-2 with sequence parallelism", "shard gradients and optimizer states, and split each row across the "
           "GPUs (DeepSpeed Ulysses)", ("distributed.strategy=deepspeed_zero2", "distributed.sequence_parallel=auto"),
           "train-deepspeed", lambda c, t: _splittable(c, t) and not _strategy(c).deepspeed),
    Remedy("optimizer offload", "ZeRO-2 with optimizer states in CPU memory (slower steps)",
           ("distributed.strategy=deepspeed_zero2", "distributed.offload_optimizer=true"), "train-deepspeed",
           lambda c, t: _full(c) and not c.distributed.offload_optimizer),
    Remedy("ZeRO-3", "shard the parameters too (DeepSpeed stage 3)", ("distributed.strategy=deepspeed_zero3",), "train-deepspeed",
           lambda c, t: _multi_gpu(t) and not _strategy(c).zero3),
    Remedy("FSDP2", "shard parameters, gradients and optimizer states with PyTorch's FSDP2 (no DeepSpeed)", ("distributed.strategy=fsdp2",),
           "train-distributed", lambda c, t: _multi_gpu(t) and not _strategy(c).fsdp and _shardable(c)),
    Remedy("parameter offload", "ZeRO-3 with parameters and optimizer states in CPU memory (much slower; "
           "needs CPU memory for them)",
           ("distributed.strategy=deepspeed_zero3", "distributed.offload_optimizer=true",
            "distributed.offload_parameters=true"), "train-deepspeed",
           lambda c, t: not c.distributed.offload_parameters),
    Remedy("FSDP2 with offload", "FSDP2 with parameters, gradients and optimizer states in CPU memory (much slower; "
           "needs CPU memory for them)", ("distributed.strategy=fsdp2", "distributed.offload_parameters=true"),
           "train-distributed", lambda c, t: t.on_cuda and not c.distributed.offload_parameters and _shardable(c)),
    Remedy("frozen vision encoder", "keep the vision encoder frozen, as released (no gradients or optimizer states for "
           "it; the text model and projector still learn to read it)", ("finetune.train_vision_tower=false",), "train",
           lambda c, t: c.finetune.train_vision_tower, result=CHANGED),
    Remedy("smaller images", "halve the pixels each image keeps (Qwen-VL: a token per 28x28 pixels, Qwen3-VL's "
           "32x32): fewer image tokens, a lighter vision encoder, less detail seen", (), "train", _pixel_budgeted, halve_pixels=True,
           result=CHANGED),
    Remedy("LoRA instead of full", "train adapters on a 16-bit base", ("finetune.method=lora",), "train",
           lambda c, t: _full(c), result=CHANGED),
    Remedy("QLoRA instead of LoRA", "adapters on a 4-bit base", ("finetune.method=qlora",), "train",
           lambda c, t: c.finetune.method == "lora", result=CHANGED),
    # (not for a vision-language model: an example is never cut before its last image token, and
    # would be left out; smaller images are its shorter rows)
    Remedy("shorter sequences", "halve data.max_seq_length", (), "train",
           lambda c, t: c.data.max_seq_length > 256 and not _vision_language(c), halve_sequence=True, result=CHANGED),
    Remedy("more GPUs", "twice the GPUs with ZeRO-2 sharding (each row split across them where only that fits: "
           "sequence parallelism)", ("distributed.strategy=deepspeed_zero2", "distributed.sequence_parallel=auto"),
           "train-deepspeed", lambda c, t: not _strategy(c).shards_states, gpu_factor=2,
           unsplit="twice the GPUs with ZeRO-2 sharding"),
)
_COST = {remedy.name: i for i, remedy in enumerate(REMEDIES)}


def command(remedies: list[Remedy], target: Any, changes: list[str], config_path: str | None = None,
            overrides: list[str] | tuple[str, ...] = ()) -> str:
    """The make command that runs the changed config: the make target the remedies need, the
    GPUs, the config file and the user's own overrides followed by the remedies' (which win)."""
    make_target, world, arguments = _launch(remedies, target, changes, overrides)
    launched = world > 1 or make_target != "train"  # (a launcher target starts every GPU here unless told)
    return _make_line(make_target, config_path, gpus_text(world) if launched else "", arguments)


def plan_command(remedies: list[Remedy], target: Any, changes: list[str], config_path: str | None = None,
                 overrides: list[str] | tuple[str, ...] = (), hardware: str = "") -> str:
    """The ``make plan`` command that plans what :func:`command` runs, on the hardware planned for:
    its GPUs (as the remedies change them) and `hardware`, the other variables that described it
    (``VRAM_GIB=80 GPU_MODEL=H100``; none for this machine's own)."""
    _, world, arguments = _launch(remedies, target, changes, overrides)  # (NUM_GPUS=1 too: not every GPU here)
    # (this machine's CPU is what make plan plans without NUM_GPUS, which there asks for a GPU's memory)
    gpus = gpus_text(world) if target.on_cuda or world > 1 else ""
    return _make_line("plan", config_path, " ".join(part for part in (gpus, hardware) if part), arguments)


def _launch(remedies: list[Remedy], target: Any, changes: list[str],
            overrides: list[str] | tuple[str, ...]) -> tuple[str, int, list[str]]:
    """(make target, GPUs, overrides) of the run the remedies change: the last strategy set is the
    one that runs; the user's overrides first, the remedies' after (they win)."""
    launching = [r.make_target for r in remedies if r.make_target != "train"]
    make_target = launching[-1] if launching else "train"
    world = target.world_size
    for remedy in remedies:
        world *= remedy.gpu_factor
    if make_target == "train" and world > 1:
        make_target = "train-distributed"
    changed_keys = {c.split("=", 1)[0] for c in changes}
    kept = [o for o in overrides if o.split("=", 1)[0] not in changed_keys]
    return make_target, world, kept + [c for c in changes if not c.startswith(("NUM_GPUS=", "NNODES="))]


def _make_line(make_target: str, config_path: str | None, hardware: str, arguments: list[str]) -> str:
    parts = [f"make {make_target}"]
    if config_path:
        parts.append(f"CONFIG={config_path}")
    if hardware:
        parts.append(hardware)
    if arguments:
        parts.append(f'ARGS="{" ".join(arguments)}"')
    return " ".join(parts)


def plan_remedies(config: RunConfig, target: Any, plan_for: PlanFor, split: int = 1) -> list[dict[str, Any]]:
    """Each applicable remedy planned on its own, then, when none before the first that fits alone
    does (in :func:`search_order`: on this hardware, keeping the result, cheapest), the first
    combination of those before it that fits: added in that order until the plan fits, then any
    that are not needed taken out again; and when nothing fits on this hardware with the training
    kept, the long-row levers stacked as ``make plan LONGEST=1`` stacks them (:func:`long_row_levers`,
    rows split across `split` processes, each lever taken where LONGEST takes it), so that a length
    LONGEST carries is never one of which this search finds nothing. Ranked by :func:`rank`.
    `plan_for(config, target, as_run)` plans without remedies: with `as_run` False it only answers whether something fits (its `fits`
    is all that is read), and may leave out what only narrows a plan that fits (the shorter rows'
    coverage) or, where the weights alone do not fit, the plan itself; what is offered is planned
    with `as_run` True."""
    # (a remedy whose settings the run would refuse on the target it makes is none)
    applicable = search_order([r for r in REMEDIES if r.applies(config, target) and _consistent(config, target, [r])])
    entries = side_by_side([functools.partial(_planned_alone, remedy, number, len(applicable), config, target, plan_for)
                          for number, remedy in enumerate(applicable, 1)])
    first_fit = next((i for i, e in enumerate(entries) if e["fits"]), len(entries))
    before = [r for r in applicable[:first_fit] if r.gpu_factor == 1]
    if len(before) >= 2:  # two or more remedies ahead of the first that fits, none of which fits alone
        combination = _fitting_combination(config, target, before, plan_for)
        if combination is not None:
            chosen, plan = combination
            entries.append(_entry(chosen, config, target, plan))
    if not any(e["fits"] and not e["more_gpus"] and e["result"] != CHANGED for e in entries):
        stacked = _stacked_levers(config, target, long_row_levers(config, target, split), plan_for)
        if stacked is not None:
            levers, plan = stacked
            if all(e["remedies"] != [r.name for r in levers] for e in entries):
                entries.append(_entry(levers, config, target, plan))
    entries.sort(key=rank)
    return entries


def _planned_alone(remedy: Remedy, number: int, count: int, config: RunConfig, target: Any,
                   plan_for: PlanFor) -> dict[str, Any]:
    with progress.doing(f"remedy {number} of {count}: {remedy.name}"):
        return _entry([remedy], config, target, plan_for(remedy.config_for(config), remedy.target_for(target), True))


# The remedies that carry rows further, cheapest first (on several GPUs ZeRO-3 before them):
# make plan LONGEST=1 adds them one at a time, and the remedy search stacks them the same way
LEVERS = ("gradient checkpointing", "FlashAttention-2", "Liger kernels", "tiled MLP", "activation offload",
          "sequence parallelism", "parameter offload")
LONG_ROWS = 1 << 20  # a length every long-row remedy applies to


def long_row_levers(config: RunConfig, target: Any, split: int = 1) -> list[Remedy]:
    """The remedies of :data:`LEVERS` (and ZeRO on several GPUs) that apply to long rows, each on
    top of those before it. Sequence parallelism splits each row across `split` processes,
    the most the model allows on the target (:func:`sft_play.planner.plan.largest_split`): the
    longest row needs them all."""
    catalogue = {remedy.name: remedy for remedy in REMEDIES}
    names = list(LEVERS)
    if target.world_size > 1 and config.distributed.strategy in ("ddp", "deepspeed_zero2"):
        names.insert(0, "ZeRO-3")
    elif ("parameter offload" in names and config.finetune.method != "full"
          and not Strategy(config.distributed.strategy).deepspeed):
        # On one GPU, parameter offload brings DeepSpeed, which computes in bf16 adapters (fp32
        # masters in its optimizer) where peft keeps fp32 ones and casts every adapted linear's
        # input to fp32 (two fp32 copies of a hidden state in the backward's working set): ZeRO-3
        # alone first, so that each is credited with what it changes
        names.insert(names.index("parameter offload"), "ZeRO-3")
    levers: list[Remedy] = []
    so_far = config
    for name in names:
        remedy = catalogue[name]
        if name == "ZeRO-3" and target.world_size == 1:  # (a remedy on several GPUs; a lever on one)
            remedy = dataclasses.replace(remedy, applies=lambda c, t: not Strategy(c.distributed.strategy).zero3)
        if name == "sequence parallelism":
            if split <= 1:
                continue
            remedy = dataclasses.replace(remedy, overrides=(f"distributed.sequence_parallel={split}",))
        if remedy.applies(with_overrides(so_far, [f"data.max_seq_length={LONG_ROWS}"]), target):
            # as applied to the levers before it (QLoRA sharded: its packed weights' storage)
            levers.append(dataclasses.replace(remedy, overrides=remedy.overrides_for(so_far)))
            so_far = remedy.config_for(so_far)
    return levers


def search_order(remedies: list[Remedy]) -> list[Remedy]:
    """Remedies in the order they are combined: on the hardware at hand before more GPUs, then by
    what they do to the trained model, then cheapest first."""
    return sorted(remedies, key=lambda r: (r.gpu_factor > 1, r.result, _COST[r.name]))


def rank(entry: dict[str, Any]) -> tuple:
    """How a careful engineer picks among remedies: those that fit first, on the hardware at hand
    before more GPUs, then the safest result (:data:`RESULT`), then room to spare (less than
    :data:`TIGHT_HEADROOM` of the budget left is tight), then the fastest predicted step (where
    time is predicted), then the cheapest change; those that do not fit after them, cheapest first."""
    cost = max(_COST[name] for name in entry["remedies"])
    if not entry["fits"]:
        return (True, cost)
    seconds = entry["seconds_per_step"]
    return (False, entry["more_gpus"], entry["result"], entry["tight"], seconds if seconds is not None else 0.0, cost)


def _apply(config: RunConfig, target: Any, remedies: list[Remedy]) -> tuple[RunConfig, Any]:
    for remedy in remedies:
        config, target = remedy.config_for(config), remedy.target_for(target)
    return config, target


def _fitting_combination(config: RunConfig, target: Any, applicable: list[Remedy], plan_for: PlanFor):
    """The cheapest combination of two or more of `applicable` that fits, and its plan as the run
    plans it; None when none does. Remedies are added in cost order until a quick plan
    (``as_run`` False) fits, then trimmed (:func:`_trimmed`); when nothing trimmed fits as the run
    plans it, the next remedy is added and the search goes on. Only combinations whose
    settings are consistent (:func:`sft_play.config.schema.consistency_problems`: optimizer
    offload under FSDP2 is not) are taken for fitting: a remedy whose settings contradict those
    of some already added takes their place (it costs more, and does more)."""
    chosen: list[Remedy] = []
    for remedy in applicable:
        if not _consistent(config, target, chosen + [remedy]):
            kept = [r for r in chosen if _consistent(config, target, [r, remedy])]
            if not _consistent(config, target, kept + [remedy]):
                continue
            chosen = kept
        chosen.append(remedy)
        with progress.doing("remedies combined: " + " + ".join(r.name for r in chosen)):
            if not _fits(config, target, chosen, plan_for):
                continue
        found = _trimmed(config, target, chosen, plan_for)
        if found is not None:
            return found
    return None


def _stacked_levers(config: RunConfig, target: Any, levers: list[Remedy], plan_for: PlanFor):
    """The long-row levers each on top of those before (as ``make plan LONGEST=1`` stacks them,
    leaving out one whose settings contradict those before it), until a quick plan fits, then
    trimmed (:func:`_trimmed`); None when not even all of them fit."""
    stack: list[Remedy] = []
    for lever in levers:
        if not _consistent(config, target, stack + [lever]):
            continue
        stack.append(lever)
        with progress.doing("long-row levers stacked: " + " + ".join(r.name for r in stack)):
            if not _fits(config, target, stack, plan_for):
                continue
        return _trimmed(config, target, stack, plan_for, least=1)
    return None


def _trimmed(config: RunConfig, target: Any, chosen: list[Remedy], plan_for: PlanFor, least: int = 2):
    """`chosen` (which fits as a quick plan) less each remedy that a later, bigger change made
    unnecessary, and its plan as the run plans it: should that plan not fit (the shorter rows it
    also covers), the combination before the last removal, and so on; None when none of `least`
    or more remedies does (a combination's remedies were each planned alone as the run plans them)."""
    found = [list(chosen)]
    for dropped in reversed(chosen[:-1]):
        trial = [r for r in found[-1] if r is not dropped]
        if _fits(config, target, trial, plan_for):
            found.append(trial)
    for remedies in reversed(found):
        if len(remedies) < least:
            continue
        plan = plan_for(*_apply(config, target, remedies), True)
        if plan.fits:
            return remedies, plan
    return None


def _consistent(config: RunConfig, target: Any, remedies: list[Remedy]) -> bool:
    """Whether a run would take `remedies` together on the target they make (none it refuses)."""
    changed, changed_target = _apply(config, target, remedies)
    return not consistency_problems(changed, changed_target.world_size, not changed_target.on_cuda)


def _fits(config: RunConfig, target: Any, remedies: list[Remedy], plan_for: PlanFor) -> bool:
    """Whether `remedies` together make consistent settings whose quick plan fits."""
    changed, changed_target = _apply(config, target, remedies)
    return _consistent(config, target, remedies) and bool(plan_for(changed, changed_target, False).fits)


def _entry(remedies: list[Remedy], config: RunConfig, target: Any, plan: Any) -> dict[str, Any]:
    final: dict[str, str] = {}  # a later change of the same key wins, as it did in the plan
    current = config
    for remedy in remedies:
        for change in remedy.change_text(current, target):
            key = change.split("=", 1)[0] if "=" in change else change.split(" ", 1)[0]
            final[key] = change
        current = remedy.config_for(current)
    changes = sorted(final.values())
    headroom = plan.budget_bytes_per_gpu - plan.peak_bytes_per_gpu
    result = max(r.result for r in remedies)
    return {
        "name": " + ".join(r.name for r in remedies),
        "description": "; ".join(r.description_for(config) if len(remedies) == 1 else
                                 f"{r.name}: {r.description_for(config)}" for r in remedies),
        "change": changes,
        "make_target": remedies[-1].make_target,
        "remedies": [r.name for r in remedies],
        "command": command(remedies, target, changes),
        "peak_bytes": plan.peak_bytes_per_gpu,
        "peak_is_lower_bound": getattr(plan, "peak_is_lower_bound", False),  # weights and states alone: no replay
        "fits": plan.fits,
        "micro_batch_size": plan.micro_batch_size if plan.fits else None,
        "host_bytes_per_node": plan.host_bytes_per_node,
        "result": result,
        "result_text": RESULT[result],
        "more_gpus": any(r.gpu_factor > 1 for r in remedies),
        "headroom_bytes": headroom,
        "tight": headroom < TIGHT_HEADROOM * plan.budget_bytes_per_gpu,
        "seconds_per_step": plan.time["seconds_per_step"] if plan.time else None,
    }


def _trains_bf16(config: RunConfig, target: Any) -> bool:
    """Whether the run computes in bf16 on `target`, by the rule training uses."""
    return resolve_precision(config, has_gpu=target.on_cuda, bf16_supported=target.bf16_supported).mixed == "bf16"


# The smallest hardware: GPU memory sizes sold today, and counts up to a large node group
GPU_SIZES_GIB = (24, 40, 48, 80, 96, 141)
GPU_COUNTS = (1, 2, 4, 8, 16, 32, 64)


def smallest_hardware(config: RunConfig, target: Any, fits_on: Callable[[RunConfig, Any], bool]) -> str | None:
    """The hardware with the least GPU memory in total (fewer GPUs on a tie) on which `config`
    fits at micro-batch 1, with checkpointing on and, on several GPUs, ZeRO-3 (QLoRA's 4-bit
    weights packed in a 16-bit storage dtype to be sharded); None when nothing up to 64 x 141 GiB does.
    `fits_on(config, target)` answers for one candidate, planned as a CUDA GPU of today (bf16,
    whatever machine the plan is made on)."""
    base = copy.deepcopy(config)
    base.train.gradient_checkpointing = True
    options = sorted(((n * size, n, size) for n in GPU_COUNTS for size in GPU_SIZES_GIB))
    for _total, count, size in options:
        candidate = copy.deepcopy(base)
        if count > 1:
            candidate = REMEDIES[_COST["ZeRO-3"]].config_for(candidate)
        hardware = type(target)(**{**asdict(target), "world_size": count, "free_bytes": int(size * GIB),
                                   "device_name": f"{count} x {size} GiB", "on_cuda": True, "bf16_supported": True,
                                   "gpu_model": gpu_model_for_memory(size), "source": "candidate"})
        with progress.doing(f"the smallest hardware: {count} x {size} GiB"):
            fits = fits_on(candidate, hardware)
        if fits:
            changes = (["ZeRO-3"] if count > 1 else []) + (
                [] if config.train.gradient_checkpointing else ["gradient checkpointing"])
            return f"{count} x {size} GiB GPU(s)" + (f" with {' and '.join(changes)}" if changes else "")
    return None
