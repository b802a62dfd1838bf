"""The run, resolved once: every decision about how a run executes, made in one place from the
config, the hardware and the data, and read everywhere else.

The planner predicts the memory of the run the loader, the collator and the trainer then build;
each of them reads the same :class:`Run` instead of deciding again, so that the plan cannot
describe a different run from the one that trains:

| decision | read by |
|---|---|
| precision (weights, compute, adapters) | loader, trainer arguments, planner, disk check |
| optimizer | trainer arguments, planner, disk check |
| kernels (:class:`Kernels`: attention, its collator, the experts' kernel, compiled layers, Liger, expandable segments) | loader, collator, trainer arguments, planner |
| batch layout and whether attention gets a mask | collator, planner |
| parallelism (:class:`sft_play.parallelism.Parallelism`: strategy, world size, offload, ZeRO buckets and reuse distance, FSDP2 resharding) | trainer arguments, planner |
| sequence length the memory is planned for | planner |
| gradient checkpointing | trainer arguments, planner |
| the LoRA adapter (:class:`sft_play.adapters.LoraSpec`) | loader, planner counts and trace |
| micro-batch and accumulation (``batch``: as planned; what trained is in ``summary.json``, changes are events) | trainer, run folder |

Where the processes train (:func:`placement`: CUDA, or CPU processes) is decided before the
process group forms, from the environment alone, and the run carries it (``on_cuda``).

:func:`resolve` builds it; nothing here loads weights: what it needs of the model is one
:class:`sft_play.architecture.ModelFacts` (the planner's shape carries them; otherwise they are read
from its ``config.json``, a mixture-of-experts model built on the meta device to find what LoRA
all-linear reaches).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from sft_play import architecture, hardware
from sft_play.architecture import ModelFacts, adapter_parts
from sft_play.adapters import LoraSpec
from sft_play.config import REFERENCE_FREE, RunConfig, kto_estimates_kl
from sft_play.parallelism import Parallelism, Strategy
from sft_play.precision import DTYPE_BYTES, Precision, resolve_optimizer, resolve_precision

CPU_ENV = "SFT_PLAY_CPU"  # "1": train in CPU processes even where GPUs are visible (the launchers' CPU=1)

Collator = Literal["padded", "packed_rows", "padding_free"]


@dataclass(frozen=True)
class BatchSplit:
    """How the global batch is made: ``global = micro x accum x world``."""

    micro_batch_size: int
    gradient_accumulation_steps: int
    world_size: int
    requested_global_batch_size: int
    note: str = ""

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps * self.world_size

    def describe(self) -> str:
        return (
            f"global {self.global_batch_size} = micro {self.micro_batch_size} x accum "
            f"{self.gradient_accumulation_steps} x world {self.world_size}"
        )

    def to_dict(self) -> dict[str, int]:
        return {"micro_batch_size": self.micro_batch_size, "gradient_accumulation_steps": self.gradient_accumulation_steps,
                "world_size": self.world_size, "global_batch_size": self.global_batch_size}

    def halved(self) -> BatchSplit:
        """Half the micro-batch, twice the accumulation: the same global batch, less memory."""
        if self.micro_batch_size <= 1:
            raise ValueError("the micro-batch is already 1")
        micro = self.micro_batch_size // 2
        accum = self.gradient_accumulation_steps * self.micro_batch_size // micro
        return BatchSplit(micro, accum, self.world_size, self.requested_global_batch_size, self.note)


@dataclass(frozen=True)
class Placement:
    """Where the training processes run, decided before the process group forms."""

    on_cuda: bool
    strategy: Strategy = Strategy()
    offload_parameters: bool = False  # FSDP2: parameters, gradients and states in CPU memory

    @property
    def fsdp_on_cpu(self) -> bool:
        """FSDP2 in CPU processes: accelerate turns FSDP on only for GPU-type processes, so the
        trainer configures it (:func:`sft_play.training.shard_on_cpu`)."""
        return not self.on_cuda and self.strategy.fsdp

    @property
    def cpu_processes(self) -> bool:
        """accelerate's ``cpu`` (gloo DDP without CUDA). DeepSpeed brings its own CPU accelerator
        (``DS_ACCELERATOR=cpu``) and must not be told."""
        return not self.on_cuda and not self.strategy.deepspeed

    @property
    def deepspeed_on_cpu(self) -> bool:
        return not self.on_cuda and self.strategy.deepspeed

    @property
    def backend(self) -> str | None:
        """The process group's backend: gloo for DeepSpeed on CPU (accelerate finds none there);
        NCCL with gloo beside it for FSDP2 offloading to the CPU on GPUs (its offloaded gradients
        are CPU tensors, whose norm for clipping is all-reduced over gloo); otherwise
        accelerate's choice (nccl on GPUs, gloo on CPUs)."""
        if self.deepspeed_on_cpu:
            return "gloo"
        if self.on_cuda and self.strategy.fsdp and self.offload_parameters:
            return "cuda:nccl,cpu:gloo"
        return None


def placement(config: RunConfig) -> Placement:
    """CUDA when torch sees a GPU and the launcher did not ask for CPU processes (``CPU=1`` sets
    ``SFT_PLAY_CPU=1`` and hides the GPUs from the training processes, so that accelerate,
    DeepSpeed and this answer agree)."""
    import torch

    on_cuda = torch.cuda.is_available() and os.environ.get(CPU_ENV) != "1"
    return Placement(on_cuda, Strategy(config.distributed.strategy), config.distributed.offload_parameters)


def allocator_settings(config: RunConfig, on_cuda: bool) -> str | None:
    """The CUDA caching allocator's settings for ``PYTORCH_CUDA_ALLOC_CONF`` (set before CUDA
    starts): expandable segments when ``train.expandable_segments`` and on CUDA."""
    return "expandable_segments:True" if config.train.expandable_segments and on_cuda else None


@dataclass(frozen=True)
class SequenceLength:
    """The tokens per row the memory is planned for, and where the number comes from."""

    tokens: int
    source: str
    loss_token_share: float = 1.0
    example_tokens: float | None = None  # token-weighted mean example length (DataStats.example_tokens); None: a row is one example


@dataclass(frozen=True)
class Kernels:
    """How the run's steps compute: the attention kernel and the collator that feeds it, the
    experts' kernel of a mixture-of-experts model, and the kernel switches."""

    attention: str  # flash_attention_2, flex_attention, sdpa or eager
    collator: Collator
    experts: str | None = None  # MoE experts kernel: grouped_mm or eager (the per-expert loop); None: dense
    compile_layers: bool = False  # torch.compile each decoder layer
    liger: bool = False  # Liger's RMSNorm, RoPE and SwiGLU kernels (CUDA only)
    expandable_segments: bool = False  # the CUDA caching allocator's expandable segments (CUDA only)
    tiled_mlp: bool = False  # each layer's MLP in tiles of about hidden_size tokens (sft_play.long_rows)


@dataclass(frozen=True)
class Preference:
    """A preference-tuning run's step (``finetune.objective``: dpo, kto, orpo or simpo). DPO, ORPO
    and SimPO take pairs: each is two rows, chosen and rejected, through the policy. KTO takes
    answers, one row each, and scores a second, mismatched row for each without gradients (its KL
    estimate: another answer of the micro-batch after the same prompt), through the policy and
    the reference both. The reference's log-probs come from the base with the adapters off (a
    second forward of the same weights), a frozen copy of the weights (a second model in memory
    and a forward through it), or a pass over the data before training; ORPO and SimPO score the
    policy alone (``none``)."""

    objective: str  # dpo, kto, orpo or simpo
    reference: Literal["adapters_off", "copy", "precomputed", "none"]
    precompute_batch_size: int | None = None  # examples per forward of the precompute pass (None: the micro-batch)
    kl: bool = False  # KTO's KL estimate: a forward without gradients of the mismatched rows, policy and reference

    @property
    def reference_forward(self) -> bool:
        """Whether each step runs a reference forward (not precomputed, not reference-free)."""
        return self.reference not in ("precomputed", "none")

    @property
    def rows_per_example(self) -> int:
        """Rows of the training forward per example: a pair is two, a KTO answer one."""
        return 1 if self.objective == "kto" else 2

    @property
    def reference_forwards(self) -> int:
        """The reference's forwards a step (each over the step's rows): KTO's mismatched rows too."""
        return (1 + self.kl) if self.reference_forward else 0

    @property
    def forwards_per_pass(self) -> int:
        """The forwards of each batch of the precompute pass: KTO scores the mismatched rows too."""
        return 1 + self.kl


def preference_of(config: RunConfig) -> Preference | None:
    """The run's preference step, None for SFT; ``preference.reference: auto`` resolved: the base
    with its adapters off under LoRA and QLoRA (no memory), a frozen copy for full fine-tuning."""
    if config.finetune.objective == "sft":
        return None
    pref = config.preference
    reference = pref.reference
    if config.finetune.objective in REFERENCE_FREE:
        reference = "none"
    elif reference == "auto":
        reference = "copy" if config.finetune.method == "full" else "adapters_off"
    return Preference(config.finetune.objective, reference, pref.precompute_batch_size, kto_estimates_kl(config))


@dataclass(frozen=True)
class Run:
    """How the run executes (see the module docstring for who reads what)."""

    method: Literal["full", "lora", "qlora"]
    precision: Precision
    adapter_dtype: str  # LoRA/QLoRA adapter weights (and their gradients and AdamW states)
    optimizer: str
    kernels: Kernels
    uniform_rows: bool  # every row one example of one length: no packing boundaries, no padding
    parallel: Parallelism
    on_cuda: bool
    gradient_checkpointing: bool
    sequence: SequenceLength
    model: str  # model.name_or_path, with its revision and trust_remote_code
    revision: str | None = None
    trust_remote_code: bool = False
    lora: LoraSpec | None = None  # the adapter (None for full fine-tuning)
    double_quant: bool = True
    batch: BatchSplit | None = None  # set once planned, never replaced (calibration and backoff are events)
    # What was measured on the GPUs that train outside PyTorch's allocator, as pairs of
    # (processes of the measuring run, or "probe"; bytes): hardware.HardwareInfo.outside_allocator.
    # Empty: nothing measured (the planner's constants); planner.memory.outside_allocator decides
    outside_allocator_measured: tuple[tuple[str, int], ...] = ()
    # The cuBLAS workspace each process takes from the caching allocator (hardware.cublas_workspace_bytes:
    # by the GPU's compute capability and CUBLAS_WORKSPACE_CONFIG); 0 off CUDA
    cublas_workspace_bytes: int = 0
    neftune: bool = False  # train.neftune_noise_alpha: noise added to the embeddings' output in training
    loraplus_lr_ratio: float | None = None  # LoRA+: the B matrices' learning rate over the A matrices'
    offload_activations: bool = False  # checkpointed hidden states kept in host memory (sft_play.long_rows)
    images: bool = False  # the data shows images: batches carry their pixels (a vision-language model)
    vision: bool = False  # the model is a vision-language model (it has a vision encoder)
    # What the vision encoder is given for the heaviest example (sft_play.data.vision.encoder_inputs,
    # JSON), or for one image sized from the config without data; "" where it encodes nothing or
    # the config cannot tell. The planner traces the encoder on it.
    encoder_inputs: str = ""
    train_vision_tower: bool = False
    train_projector: bool = False
    preference: Preference | None = None  # preference tuning's step (None: SFT)

    @property
    def rows_per_example(self) -> int:
        """Rows of the forward per example of the micro-batch: a preference pair is two."""
        return self.preference.rows_per_example if self.preference is not None else 1

    @property
    def smallest_micro_batch(self) -> int:
        """The smallest micro-batch the run trains at: KTO's KL estimate takes another answer of
        the micro-batch (TRL's KTOTrainer refuses one)."""
        return 2 if self.preference is not None and self.preference.kl else 1

    @property
    def fsdp_checkpointing(self) -> bool:
        """Activation checkpointing by FSDP's own wrapper (accelerate's: it does not preserve the
        random state, so a recomputed dropout would draw other masks than the forward did);
        with LoRA dropout on, transformers' non-reentrant checkpointing, which preserves it, at
        the cost of one more all-gather per layer in backward."""
        return self.parallel.fsdp and self.gradient_checkpointing and not (self.lora is not None and self.lora.dropout > 0)

    @property
    def adapter_bytes(self) -> int:
        """Bytes per element of the LoRA adapters (peft keeps them in fp32; TRL casts QLoRA's to bf16)."""
        return DTYPE_BYTES[self.adapter_dtype]

    @property
    def upcasts_whole_copies(self) -> bool:
        """Whether LoRA's whole copies (``lora.modules_to_save``), which peft makes in the base's
        16-bit dtype, train in the adapters' fp32 (the trainer casts them:
        :func:`sft_play.training.trainer.in_adapter_dtype`): under autocast, where fp32 inputs meet
        the 16-bit base through its casts; not under DeepSpeed, which casts the module to its compute
        dtype, nor FSDP2, which makes fp32 copies of its own."""
        return (self.method == "lora" and self.precision.autocast and self.precision.weights_dtype != self.adapter_dtype
                and not (self.parallel.deepspeed or self.parallel.fsdp))

    @property
    def placement(self) -> Placement:
        return Placement(self.on_cuda, self.parallel.strategy, self.parallel.offload_parameters)

    def to_dict(self) -> dict[str, Any]:
        """The run as JSON-ready data (``run.json`` in the run folder)."""
        data = dataclasses.asdict(self)
        data["parallel"]["strategy"] = self.parallel.strategy.name
        data["batch"] = self.batch.to_dict() if self.batch else None  # as planned
        data["precision"]["compute_dtype"] = self.precision.compute_dtype
        return data

    @property
    def local_tokens(self) -> int:
        """Tokens of a row each process holds: the whole row, or its share where rows are split
        across processes (the collator pads rows to a multiple of the split)."""
        return -(-self.sequence.tokens // self.parallel.row_shards)

    def masked(self, micro_batch: int) -> bool:
        """Whether attention gets a 4-D mask at `micro_batch`: packed rows hold several examples
        (or are padded to the longest in the batch), and padded batches of unequal lengths need
        one, unless FlashAttention-2 runs them as variable-length sequences. Eager attention always
        gets one: transformers' ``eager_mask`` never skips the causal mask (``allow_is_causal_skip=False``),
        where SDPA runs uniform rows with ``is_causal`` instead. A split sequence gets none: Ulysses
        drops masks, and the run builds none (:func:`sft_play.patches.sdpa_by_example`);
        torch's ring attention runs SDPA causally in its place."""
        if self.kernels.attention in MASK_FREE_ATTENTION or self.parallel.row_shards > 1:
            return False
        if self.kernels.attention == "eager":
            return True
        if self.uniform_rows:
            return False
        return self.kernels.collator == "packed_rows" or micro_batch > 1

    def sliding_mask(self, micro_batch: int, window: int | None) -> bool:
        """Whether the sliding-window layers (of `window` tokens) get a mask where the others get
        none (:func:`sliding_mask`)."""
        return sliding_mask(self.kernels.attention, self.masked(micro_batch), window, self.sequence.tokens)

    def with_changes(self, **changes: Any) -> Run:
        return dataclasses.replace(self, **changes)


# Kernels that take packed rows without an s x s mask: FlashAttention-2 reads the example
# boundaries from the position ids (variable-length kernel); flex attention gets a block mask that
# transformers builds from them (masking_utils.find_packed_sequence_indices), O((s/128)^2) entries.
MASK_FREE_ATTENTION = ("flash_attention_2", "flex_attention")


def sliding_mask(attention: str, masked: bool, window: int | None, tokens: int) -> bool:
    """Whether a model's sliding-window layers take a mask its other layers do not: SDPA runs rows
    without a mask through ``is_causal``, which cannot express a window, so from rows of `window`
    tokens on transformers builds a boolean (rows, 1, tokens, tokens) mask for those layers
    (``masking_utils._ignore_causal_mask_sdpa``; per row, as the collator passes an attention
    mask), and SDPA turns it into an additive bias of that size in each such layer, which the
    memory-efficient kernel keeps for backward. Where every layer is `masked` already, or the
    kernel takes the window itself (FlashAttention-2, flex attention), nothing changes."""
    return attention == "sdpa" and not masked and window is not None and tokens >= window


def attention_kernel(config: RunConfig, precision: Precision, on_cuda: bool, eager_only: bool,
                     local: bool = True) -> str:
    """The attention kernel: the configured one, or for ``auto`` FlashAttention-2 where it is
    installed and usable (CUDA, 16-bit compute; transformers swaps in its own kernel for models with
    attention sinks, gpt-oss), else PyTorch SDPA, or eager attention for models SDPA cannot run
    (Gemma-2's capped logits, gpt-oss's sinks: architecture.attention_eager_only). For hardware described
    rather than this machine's (`local` false) what is installed here says nothing: ``auto``
    plans the kernel that needs no extra package (SDPA), the larger of the two in memory."""
    choice = config.model.attn_implementation
    if choice != "auto":
        return choice
    if config.distributed.context_parallel > 1:  # torch's ring attention shards SDPA only
        return "sdpa"
    installed = local and importlib.util.find_spec("flash_attn") is not None
    if on_cuda and precision.compute_dtype != "float32" and installed:
        return "flash_attention_2"
    return "eager" if eager_only else "sdpa"


def experts_kernel(on_cuda: bool, precision: Precision) -> str:
    """How a mixture-of-experts model runs its experts: torch's grouped GEMM (transformers casts
    the tokens to the weights' dtype) on the CPU, in any dtype, and on CUDA with bf16 weights,
    where its kernel takes bf16 only; transformers' per-expert loop for the fp32 masters of a full
    fine-tune on CUDA. The grouped GEMM is what the planner traces: the loop keeps the same rows
    for backward, but with LoRA on the experts each expert's turn reads the adapted weights again."""
    return "grouped_mm" if not on_cuda or precision.weights_dtype == "bfloat16" else "eager"


def collator_kind(packing: bool, attention: str) -> Collator:
    """Packed rows go to TRL's padding-free collator under FlashAttention-2 (variable-length
    sequences) and to our packed-rows collator otherwise (flex attention included: rows with
    per-example position ids); unpacked data is padded per batch."""
    if not packing:
        return "padded"
    return "padding_free" if attention.startswith("flash_attention") else "packed_rows"


def sequence_length(config: RunConfig, data_stats: Any | None) -> SequenceLength:
    """The sequence length the plan budgets for, and where it came from.

    Packed rows are filled up to ``data.max_seq_length``; without packing a batch pads to its
    longest example, so the longest example in the data bounds it. Without a tokenizer or data
    at hand, ``data.max_seq_length`` is the assumption.
    """
    limit = config.data.max_seq_length
    if data_stats is None or not data_stats.examples:
        return SequenceLength(limit, "data.max_seq_length (the data not read for this plan: assumed full length)")
    share = data_stats.loss_token_share or 1.0
    examples = getattr(data_stats, "example_tokens", None)
    if config.data.packing and config.finetune.objective == "sft":  # (pairs are never packed)
        return SequenceLength(limit, f"data.max_seq_length (packed rows; {data_stats.examples} examples, "
                              f"p95 {data_stats.tokens_p95} tokens)", share, examples)
    longest = min(limit, data_stats.tokens_max)
    source = (f"longest example in the data ({data_stats.tokens_max} tokens, packing off; p50 {data_stats.tokens_p50}, "
              f"p95 {data_stats.tokens_p95})")
    if getattr(data_stats, "pairs", 0):
        source = (f"longest pair in the data (its prompt and longer answer, {data_stats.tokens_max} tokens; p50 "
                  f"{data_stats.tokens_p50}, p95 {data_stats.tokens_p95}): each pair is two rows of it, padded")
    budget = _smaller_pixel_budget(config, data_stats)
    if budget:
        per_image, _ = architecture.image_tokens(_model_config(config), budget)
        bound = data_stats.text_tokens_max + data_stats.images_max * per_image
        if bound < longest:
            longest = bound
            prepared = f"{data_stats.image_max_pixels:,}" if data_stats.image_max_pixels else "the processor's own"
            source = (f"at most {data_stats.text_tokens_max} text tokens and {data_stats.images_max} image(s) of at "
                      f"most {per_image} tokens: data.image_max_pixels={budget:,}, below the budget the data were "
                      f"prepared with ({prepared})")
    return SequenceLength(longest, source, share, examples)


def _smaller_pixel_budget(config: RunConfig, data_stats: Any) -> int | None:
    """``data.image_max_pixels`` where it is below the budget the data's images were prepared with
    and the model's processor sizes images by pixels (a remedy plans it from the same data: image
    tokens and pixels are bounded by it); None otherwise."""
    budget = config.data.image_max_pixels
    prepared = getattr(data_stats, "image_max_pixels", 0)
    if not budget or not getattr(data_stats, "images", 0) or (prepared and budget >= prepared):
        return None
    return budget if architecture.sizes_by_pixels(_model_config(config)) else None


def _model_config(config: RunConfig) -> Any:
    return architecture.load_model_config(config.model.name_or_path, config.model.revision,
                                          config.model.trust_remote_code)


def zero_sizes(config: RunConfig, hidden_size: int) -> tuple[int | None, int | None]:
    """ZeRO's reduce bucket size and ZeRO-3's reuse distance, in elements, as the trainer will
    fill them: transformers replaces ``reduce_bucket_size: "auto"`` by hidden_size^2;
    ``stage3_max_reuse_distance`` is read from the JSON (DeepSpeed's defaults, 5e8 and 1e9, when
    absent)."""
    if not Strategy(config.distributed.strategy).deepspeed:
        return None, None
    try:
        zero = json.loads(Path(config.distributed.deepspeed_config).read_text()).get("zero_optimization", {})
    except (OSError, ValueError):
        zero = {}

    def elements(key: str, auto: int, default: int) -> int:
        value = zero.get(key, default)
        return auto if value == "auto" else int(float(value))

    squared = hidden_size * hidden_size
    return elements("reduce_bucket_size", squared, 5 * 10**8), elements("stage3_max_reuse_distance", 10**9, 10**9)


def resolve(
    config: RunConfig,
    *,
    on_cuda: bool,
    bf16_supported: bool,
    world_size: int,
    data_stats: Any | None = None,
    model_facts: ModelFacts | None = None,
    local: bool = True,
    outside_allocator_measured: dict[str, int] | None = None,
    cuda_capability: tuple[int, int] | None = None,
) -> Run:
    """Every decision about the run, from the config, the hardware and (when read) the data. It
    decides and never refuses: what cannot train is :func:`sft_play.config.consistency_problems`'s
    to say (the planner asks it of every run it resolves).

    Args:
        config: the run config.
        on_cuda: whether the processes train on CUDA GPUs.
        bf16_supported: whether every participating GPU supports bf16.
        world_size: data-parallel processes.
        data_stats: the tokenised data's statistics (:class:`sft_play.data.DataStats`), if read.
        model_facts: what the run needs to know of the model (:class:`sft_play.architecture.ModelFacts`;
            the planner passes its shape's); read from ``config.model``'s config when not given.
        local: whether the processes train on this machine (its installed packages count).
        outside_allocator_measured: what processes were measured to hold on these GPUs outside
            PyTorch's allocator (``hardware.HardwareInfo.outside_allocator``; None: nothing).
        cuda_capability: the training GPUs' compute capability (None: unknown, taken as Hopper's).

    Rows are split across the config's ``distributed.sequence_parallel`` processes (auto: 1 here;
    the planner decides it and replaces the run's parallelism).
    """
    precision = resolve_precision(config, has_gpu=on_cuda, bf16_supported=bf16_supported)
    facts = model_facts if model_facts is not None else facts_of(config)
    attention = attention_kernel(config, precision, on_cuda, facts.attention_eager_only, local)
    configured = config.distributed.sequence_parallel
    split = configured if isinstance(configured, int) else 1
    method = config.finetune.method
    return Run(
        method=method,
        precision=precision,
        adapter_dtype=_adapter_dtype(method, precision),
        optimizer=resolve_optimizer(config, on_cuda),
        kernels=Kernels(
            attention=attention,
            collator=collator_kind(config.data.packing and config.finetune.objective == "sft", attention),
            experts=experts_kernel(on_cuda, precision) if facts.num_experts > 1 else None,
            compile_layers=config.train.torch_compile,
            liger=config.train.liger_kernels and on_cuda,
            expandable_segments=allocator_settings(config, on_cuda) is not None,
            tiled_mlp=config.train.tiled_mlp,
        ),
        uniform_rows=bool(data_stats is not None and getattr(data_stats, "uniform_rows", False)),
        parallel=Parallelism.from_config(config.distributed, world_size, zero_sizes(config, facts.hidden_size),
                                         split),
        on_cuda=on_cuda,
        gradient_checkpointing=config.train.gradient_checkpointing,
        sequence=sequence_length(config, data_stats),
        model=config.model.name_or_path,
        revision=config.model.revision,
        trust_remote_code=config.model.trust_remote_code,
        lora=_lora(config, facts) if method != "full" else None,
        double_quant=config.quantization.double_quant,
        outside_allocator_measured=tuple(sorted((outside_allocator_measured or {}).items())) if on_cuda else (),
        # train.deterministic: transformers' enable_full_determinism sets CUBLAS_WORKSPACE_CONFIG=:16:8
        cublas_workspace_bytes=hardware.cublas_workspace_bytes(
            cuda_capability, ":16:8" if config.train.deterministic else None) if on_cuda else 0,
        neftune=bool(config.train.neftune_noise_alpha),
        loraplus_lr_ratio=config.lora.loraplus_lr_ratio if method != "full" else None,
        offload_activations=config.train.offload_activations,
        images=bool(getattr(data_stats, "images", 0)),
        vision=bool(facts.vision_towers),
        encoder_inputs=_encoder_inputs(config, data_stats) if facts.vision_towers else "",
        train_vision_tower=config.finetune.train_vision_tower and bool(facts.vision_towers),
        train_projector=config.finetune.train_projector and bool(facts.vision_towers),
        preference=preference_of(config),
    )


def _adapter_dtype(method: str, precision: Precision) -> str:
    """The dtype the trained weights are kept in: the weights' own for full fine-tuning."""
    if method == "full":
        return precision.weights_dtype
    if method == "qlora":
        return "bfloat16"  # TRL casts QLoRA adapters to bf16 (QLoRA paper, section 3)
    return "float32"  # peft's autocast_adapter_dtype upcasts adapters of a 16-bit base


def _lora(config: RunConfig, facts: ModelFacts) -> LoraSpec:
    """The adapters the run trains: the config's, on what peft can wrap in this model (its experts,
    what it leaves out, the vision parts as the config trains them). TRL's DPOTrainer switches
    dropout off, LoRA's too: a preference run's adapter is made without it."""
    lora = config.lora if config.finetune.objective == "sft" else config.lora.model_copy(update={"dropout": 0.0})
    return LoraSpec.from_config(lora, facts.expert_parameters, facts.lora_exclude, adapter_parts(
        facts.vision_towers, facts.projectors, config.finetune.train_vision_tower, config.finetune.train_projector))


def _encoder_inputs(config: RunConfig, data_stats: Any | None) -> str:
    """:attr:`Run.encoder_inputs`: the data's heaviest example's, or without data one image's as
    the config tells (architecture.image_inputs)."""
    if data_stats is not None:
        described = getattr(data_stats, "encoder_inputs", None) if getattr(data_stats, "images", 0) else None
        budget = _smaller_pixel_budget(config, data_stats)
        if described and budget:
            described = architecture.within_pixels(_model_config(config), described, budget)
    else:
        described = architecture.image_inputs(_model_config(config), config.data.image_max_pixels)
    return json.dumps(described, sort_keys=True) if described else ""


def facts_of(config: RunConfig) -> ModelFacts:
    """What the run needs to know of `config`'s model (adapters counted where the method trains them)."""
    model_config = architecture.load_model_config(config.model.name_or_path, config.model.revision,
                                                  config.model.trust_remote_code)
    return architecture.model_facts(model_config, config.model.trust_remote_code, config.finetune.method != "full")
