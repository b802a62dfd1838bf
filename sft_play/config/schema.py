"""The run config's schema: one typed section per YAML section, their defaults and meanings,
and the rules between values that the schema alone cannot state (:func:`consistency_problems`).

Imports nothing heavy (no torch, no transformers): every script uses it, ``make check`` too,
before the stack is known to import.
"""

from __future__ import annotations

import difflib
import re
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from sft_play.parallelism import Strategy, StrategyName

Auto = Literal["auto"]
# A run folder's name: one path component, nothing a shell or a path would read as more
RUN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")


class ConfigError(ValueError):
    """A run config with one or more problems; ``problems`` holds one message per problem."""

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = problems
        self.source = source
        where = f" in {source}" if source else ""
        lines = [f"{len(problems)} problem(s){where}:"] + [f"  - {p}" for p in problems]
        super().__init__("\n".join(lines))


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True, validate_assignment=True, allow_inf_nan=False)


class ModelConfig(_Section):
    """Which model to fine-tune and how to load it."""

    name_or_path: str = Field(
        "configs/tiny_model",
        description="Hub id (org/name) or local folder. A folder holding only config.json gets "
        "weights initialised from the config with `init_seed`.",
    )
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit).")
    tokenizer_name_or_path: str | None = Field(
        None, description="Tokenizer location; defaults to `name_or_path`."
    )
    torch_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Storage dtype of the base weights. auto: the mixed-precision dtype for the "
        "frozen base of LoRA/QLoRA, float32 master weights for full fine-tuning.",
    )
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2", "flex_attention"] = Field(
        "auto",
        description="Attention kernel. auto: flash_attention_2 when installed on CUDA, else sdpa. "
        "flex_attention runs packed rows with a block mask built from the position ids (no s x s mask).",
    )
    trust_remote_code: bool = Field(
        False, description="Run Python code shipped with a hub model. Off unless you trust the source."
    )
    init_seed: int = Field(0, ge=0, le=2**32 - 1, description="Seed for weights initialised from config.json alone.")
    build_with: str | None = Field(
        None, description="A run config that trains this model first when model.name_or_path (a run's model "
        "folder, <output_dir>/<run_name>/model) does not exist yet: the preference default trains its SFT model so.")


class FinetuneConfig(_Section):
    """What is trained."""

    method: Literal["full", "lora", "qlora"] = Field(
        "lora", description="full: every weight; lora: adapters on a 16-bit base; qlora: adapters on a 4-bit base."
    )
    train_vision_tower: bool = Field(
        False, description="Vision-language models: train the vision encoder too (full: its weights; lora: adapters "
        "on its linears); false keeps it frozen, as LLaMA-Factory and Unsloth do by default.")
    train_projector: bool = Field(
        False, description="Vision-language models: train the projector that maps image features into the language "
        "model (its weights, under LoRA and QLoRA too: beside the adapters, in their dtype); false keeps it frozen.")
    objective: Literal["sft", "dpo", "kto", "orpo", "simpo"] = Field(
        "sft", description="sft: supervised fine-tuning on answers; dpo: preference tuning on chosen/rejected pairs "
        "against a reference (TRL's DPOTrainer); kto: answers each labelled desirable or not, no pairing needed "
        "(TRL's KTOTrainer; pairs are split into a desirable and an undesirable answer); orpo: the chosen answers' "
        "NLL plus an odds-ratio term, no reference (ORPO, which can start from the base model); simpo: a margin "
        "between the answers' average log-probs, no reference (SimPO). The preference section; docs/PREFERENCE.md. "
        "Start dpo, kto and simpo from an SFT run's model: model.name_or_path=runs/<sft>/model.")


class PreferenceConfig(_Section):
    """Preference tuning (``finetune.objective: dpo``, ``kto``, ``orpo`` or ``simpo``): the loss and the
    reference model."""

    beta: float = Field(0.1, gt=0, description="dpo and kto: how far the policy may move from the reference (the "
                        "reward is beta x (policy log-prob - reference log-prob) of an answer); orpo: the odds-ratio term's "
                        "weight beside the NLL (lambda; 0.1 as TRL's ORPOConfig); simpo: the scale of the average "
                        "log-prob reward (SimPO's authors use 2-2.5; 0.1 is TRL's CPOConfig default).")
    simpo_gamma: float = Field(0.5, ge=0, description="simpo: the margin the chosen answer's reward must exceed the "
                               "rejected one's by (TRL's simpo_gamma).")
    loss_type: Union[str, list[str], None] = Field(
        None, description="dpo: TRL's DPO loss(es): sigmoid (DPO), ipo, hinge, robust, exo_pair, bco_pair, nca_pair, "
        "sppo_hard, aot, aot_unpaired, apo_zero, apo_down, discopop, sigmoid_norm, sft; a list sums them "
        "(with loss_weights). kto: kto, or apo_zero_unpaired (no KL estimate). null: sigmoid for dpo, kto for kto.")
    loss_weights: list[float] | None = Field(None, description="One weight per loss_type entry; null: all 1.")
    sft_weight: float = Field(
        0.0, ge=0, description="Adds TRL's sft loss (the chosen answers' NLL) at this weight beside the preference "
        "loss (RPO; LLaMA-Factory's pref_ftx; under simpo CPO-SimPO's cpo_alpha); keeps the chosen answers likely. "
        "0: off. ORPO's loss has its NLL built in.")
    desirable_weight: float = Field(1.0, gt=0, description="kto: the weight of a desirable answer's loss (raise "
                                    "it when desirable answers are the fewer: KTO's paper keeps weight x count "
                                    "of each side within 1-4/3 of the other's).")
    undesirable_weight: float = Field(1.0, gt=0, description="kto: the weight of an undesirable answer's loss.")
    label_smoothing: float = Field(0.0, ge=0, lt=1, description="Conservative DPO / robust / exo_pair: the assumed "
                                   "share of pairs labelled the wrong way round.")
    reference: Literal["auto", "adapters_off", "copy", "precomputed"] = Field(
        "auto", description="Where the reference log-probs come from. adapters_off: the base under LoRA/QLoRA with "
        "the adapters switched off (no memory); copy: a frozen second copy of the weights (full fine-tuning); "
        "precomputed: one forward pass over the data before training, no reference in memory while training. "
        "auto: adapters_off for lora/qlora, copy for full (orpo and simpo use no reference: leave it at auto).")
    max_prompt_length: int | None = Field(
        None, gt=0, description="Prompts longer than this many tokens keep their last ones (cut from the left), so "
        "that the answers fit data.max_seq_length; null: prompts are not cut.")
    precompute_batch_size: int | None = Field(
        None, gt=0, description="reference=precomputed: pairs (kto: answers) per forward of the precompute pass; "
        "null: the micro-batch.")


class LoraConfig(_Section):
    """LoRA adapters (used by `lora` and `qlora`)."""

    r: int = Field(16, gt=0, description="Adapter rank.")
    alpha: float = Field(32, gt=0, description="Scaling numerator: the update is scaled by alpha / r.")
    dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the adapter input.")
    target_modules: Union[Literal["all-linear"], list[str]] = Field(
        "all-linear",
        description="Module names to adapt; all-linear means every linear layer except the output head.",
    )
    bias: Literal["none", "all", "lora_only"] = Field("none", description="Which biases are trained.")
    modules_to_save: list[str] = Field(
        default_factory=list, description="Extra modules trained in full and saved with the adapter."
    )
    use_dora: bool = Field(
        False, description="Weight-decomposed LoRA (DoRA): a trained magnitude per output feature besides the "
        "adapter; each adapted layer also builds its full weight in every step (more memory and time, planned).",
    )
    use_rslora: bool = Field(
        False, description="Rank-stabilised LoRA: the update is scaled by alpha / sqrt(r) instead of alpha / r.",
    )
    loraplus_lr_ratio: float | None = Field(
        None, ge=1, description="LoRA+: the B matrices (and 1-D trained tensors) learn at this multiple of "
        "train.learning_rate, the A matrices at it (peft's create_loraplus_optimizer; 16 is the paper's choice, with "
        "a learning rate about half plain LoRA's); null: off.",
    )


class QuantizationConfig(_Section):
    """4-bit base weights for QLoRA (bitsandbytes)."""

    quant_type: Literal["nf4", "fp4"] = Field("nf4", description="4-bit data type.")
    double_quant: bool = Field(True, description="Quantise the quantisation constants too (saves ~0.37 bit/param).")
    quant_storage: Literal["uint8", "bfloat16", "float16", "float32"] = Field(
        "uint8", description="Storage dtype of packed 4-bit weights; set to the compute dtype for ZeRO-3/FSDP."
    )


# The fields a record is read from, each from the column of that name unless data.columns maps it
DATA_FIELDS = ("messages", "conversations", "tools", "images", "image", "instruction", "input", "output", "system",
               "history", "prompt", "completion", "text", "chosen", "rejected", "label")

DataFormat = Literal["auto", "messages", "sharegpt", "alpaca", "prompt_completion", "text", "preference", "pairwise",
                     "unpaired"]


class DataConfig(_Section):
    """Where the data comes from and how it becomes tokens."""

    path: Union[str, list[str]] = Field(
        "data/tiny/train.jsonl", description="File, folder, glob or hub dataset name, or a list of them."
    )
    weights: list[float] | None = Field(
        None, description="With a list in data.path: mix the datasets in these proportions (same length as the list)."
    )
    format: DataFormat = Field("auto", description="Record format; auto detects it from the first rows.")
    columns: dict[str, str] = Field(
        default_factory=dict, description="Map from our field names to the file's columns: " + ", ".join(DATA_FIELDS)
        + " (history: Alpaca's earlier [instruction, answer] pairs; tools: a chat's tool definitions).",
    )
    split: str = Field("train", description="Split to train on (hub datasets, save_to_disk folders, and folders "
                       "whose files or subfolders are named for splits).")
    validation_path: Union[str, list[str], None] = Field(
        None, description="Held-out data; when unset, `validation_fraction` of the training data is carved off."
    )
    validation_fraction: float = Field(0.0, ge=0, lt=1, description="Share of training rows held out.")
    max_seq_length: int = Field(1024, gt=0, description="Longest sequence in tokens (the packed row length).")
    packing: bool = Field(True, description="Join examples into rows of max_seq_length without cross-attention "
                          "(preference pairs are never packed: false for them).")
    beyond_model_positions: bool = Field(
        False, description="Allow data.max_seq_length beyond the positions the model was trained on "
        "(max_position_embeddings): for a model whose context you extend (rope_scaling), or packed rows of examples "
        "that each fit."
    )
    overlong: Literal["truncate", "drop"] = Field("truncate", description="What happens to longer examples.")
    train_on: Literal["completion", "last", "all"] = Field(
        "completion", description="completion: loss on assistant turns / completions only; last: on the last "
        "assistant turn of each chat only (LLaMA-Factory's mask_history); all: every token."
    )
    chat_template: str | None = Field(
        None, description="The chat template, instead of the tokenizer's: a name (chatml; plain, what a tokenizer "
        "without one gets; or a model's as TRL ships it: llama3, qwen2_5, qwen3, gemma3, phi3...; an unknown "
        "name is answered with the list), a .jinja file or inline Jinja. The run's tokenizer is saved with it.",
    )
    system_prompt: str | None = Field(
        None, description="A system message for every chat record that has none (LLaMA-Factory's default_system); "
        "make generate and make chat start with it too. Text records have no chat to give it: said once a source.",
    )
    on_invalid: Literal["error", "skip"] = Field("error", description="Bad rows stop the run, or are skipped and counted.")
    special_tokens_in_text: Literal["keep", "escape", "refuse"] = Field(
        "keep", description="A special token of the tokenizer written in a record's text (<|im_start|>, <|eot_id|> "
        "in a user's message): keep reads it as the token (a user's text can open a turn; make check and make "
        "data-stats count such rows), escape reads it as text (a WORD JOINER after its first character), refuse "
        "refuses the row (skipped and counted with data.on_invalid: skip).")
    num_proc: Union[Annotated[int, Field(gt=0)], Literal["auto"], None] = Field(
        "auto", description="Processes that tokenise: auto uses this machine's usable cores for 10,000 records or "
        "more (fewer: one process), or a number; the rows are the same bytes whatever it is.")
    cache: bool = Field(True, description="Reuse preprocessed data keyed by the data, tokenizer and settings ($SFT_PLAY_CACHE).")
    streaming: bool = Field(
        False, description="Read, tokenise and pack the training data as training consumes it (corpora larger than "
        "the disk or memory; needs train.max_steps); the planner reads statistics of a sample.")
    sample_rows: int = Field(10_000, gt=0, description="With streaming: the first records whose statistics the "
                             "planner reads.")
    image_max_pixels: int | None = Field(
        None, gt=0, description="Vision-language models: the most pixels an image keeps (larger ones are scaled down, "
        "as the model's processor does); for processors that size images by area or edge (Qwen-VL, Idefics3/SmolVLM) it "
        "sets the image tokens an example costs; null: the processor's own. Fixed-size processors (Gemma-3, LLaVA) "
        "ignore it.")
    image_min_pixels: int | None = Field(
        None, gt=0, description="Vision-language models: the fewest pixels an image is given (smaller ones are scaled "
        "up), for processors that size images by area (Qwen-VL); null: the processor's own.")


class TrainConfig(_Section):
    """The optimisation itself."""

    output_dir: str = Field("runs", description="Parent folder of run folders.")
    run_name: str | None = Field(
        None, description="Run folder name inside output_dir (letters, digits, '.', '_', '-'); default "
        "<config name>-<timestamp>."
    )
    global_batch_size: int = Field(16, gt=0, description="Sequences per optimizer step, across all GPUs.")
    micro_batch_size: Union[int, Auto] = Field("auto", description="Sequences per GPU per forward; auto: the planner's.")
    gradient_accumulation_steps: Union[int, Auto] = Field(
        "auto", description="Micro-batches per optimizer step; auto: global / (micro x world)."
    )
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
    offload_activations: bool = Field(
        False, description="Keep the hidden states gradient checkpointing saves (one [rows, tokens, hidden] per layer) in "
        "host memory until backward instead of on the GPU: for long rows (needs train.gradient_checkpointing).",
    )
    tiled_mlp: bool = Field(
        False, description="Compute each layer's MLP in tiles of about hidden_size tokens, forward and backward, so its "
        "intermediates exist for one tile at a time: for long rows (DeepSpeed's TiledMLP; one process or ZeRO).",
    )
    learning_rate: float = Field(2e-4, gt=0, description="Peak learning rate.")
    lr_scheduler: Literal["cosine", "linear", "constant", "constant_with_warmup"] = Field(
        "cosine", description="Learning-rate schedule after warm-up."
    )
    warmup_ratio: float = Field(0.03, ge=0, lt=1, description="Share of steps spent warming up.")
    warmup_steps: int | None = Field(
        None, ge=0, description="Steps spent warming up, instead of warmup_ratio; null: warmup_ratio decides."
    )
    min_lr_ratio: float = Field(
        0.0, ge=0, lt=1, description="cosine: the floor the learning rate decays to, as a share of train.learning_rate "
        "(0.1 is common; transformers' cosine_with_min_lr); 0: down to zero.",
    )
    weight_decay: float = Field(0.0, ge=0, description="Decoupled weight decay.")
    max_grad_norm: float = Field(1.0, ge=0, description="Gradient clipping norm (0 turns clipping off).")
    neftune_noise_alpha: float | None = Field(
        None, gt=0, description="NEFTune: uniform noise of scale alpha / sqrt(tokens x hidden) added to the input "
        "embeddings while training (5 is the paper's choice); null: off.",
    )
    optimizer: Literal["auto", "adamw_torch", "adamw_torch_fused", "adamw_8bit", "paged_adamw_8bit", "sgd", "adafactor"] = (
        Field("auto", description="Optimizer; auto: fused AdamW on CUDA, AdamW elsewhere; 8-bit variants come from bitsandbytes.")
    )
    max_steps: int = Field(-1, description="Optimizer steps; -1 means use num_epochs.")
    num_epochs: float = Field(1.0, gt=0, description="Passes over the training data (when max_steps is -1).")
    mixed_precision: Literal["auto", "bf16", "fp16", "no"] = Field(
        "auto", description="Compute precision; auto: bf16 where the devices compute it natively (Ampere+ GPUs; CPUs "
        "with AMX, AVX512-BF16 or Arm BF16), fp16 on older GPUs, no (fp32) on other CPUs."
    )
    seed: int = Field(42, ge=0, le=2**32 - 1, description="Seed for data order, dropout and adapter initialisation.")
    deterministic: bool = Field(False, description="Deterministic kernels (slower), for debugging run differences.")
    torch_compile: bool = Field(
        False, description="Compile each decoder layer with torch.compile (the first steps are slower while it compiles)."
    )
    liger_kernels: bool = Field(
        False, description="Liger's Triton kernels for RMSNorm, RoPE and SwiGLU (pip install liger-kernel; CUDA only)."
    )
    expandable_segments: bool = Field(
        False, description="CUDA caching allocator with expandable segments (less fragmentation; CUDA only)."
    )
    logging_steps: int = Field(10, gt=0, description="Optimizer steps between log lines.")
    save_steps: int = Field(0, ge=0, description="Optimizer steps between checkpoints; 0: none but the one a stop signal "
                            "writes (the finished model goes to model/ either way).")
    save_total_limit: int = Field(2, gt=0, description="Checkpoints kept; the newest is never deleted.")
    eval_steps: int = Field(0, ge=0, description="Optimizer steps between evaluations; 0: none during training.")
    early_stopping_patience: int | None = Field(
        None, gt=0, description="Stop when the validation loss has not improved for this many evaluations in a row "
        "(needs validation data and train.eval_steps); the final model is the last step's. null: off.",
    )
    tensorboard: bool = Field(True, description="Write TensorBoard event files into the run folder.")
    report_to: list[Literal["wandb", "mlflow", "trackio", "comet_ml", "swanlab", "clearml"]] = Field(
        default_factory=list, description="Experiment trackers to log to as well, through transformers' integrations "
        "(their package installed and logged in: WANDB_PROJECT, MLFLOW_TRACKING_URI... as they document).",
    )
    resume_from: str | None = Field(
        None, description="auto: continue the newest complete checkpoint (of train.run_name, or of this config's "
        "newest run); or a checkpoint folder. RESUME=auto on make targets."
    )
    max_bad_steps: int = Field(
        3, gt=0, description="Consecutive steps with NaN/inf gradients or loss before the run stops (their updates are skipped)."
    )
    router_aux_loss_coef: float | None = Field(
        None, ge=0,
        description="Mixture-of-experts models: weight of the routers' load-balancing loss; null: the model's own "
        "(router_aux_loss_coef in its config.json), 0: off. Per-layer expert load goes to TensorBoard either way.",
    )
    record_samples: bool = Field(
        False, description="Debug: write a fingerprint of every row each rank trains on to <run>/samples/rank-N.jsonl."
    )


class DistributedConfig(_Section):
    """How work is shared between processes."""

    strategy: StrategyName = Field(
        "ddp", description="ddp: replicate; deepspeed_zero2: shard gradients and optimizer states; deepspeed_zero3: "
        "shard the parameters too (deepspeed_* run with make train-deepspeed); fsdp2: PyTorch's own full "
        "sharding of parameters, gradients and optimizer states, per decoder layer (make train-distributed)."
    )
    offload_optimizer: bool = Field(False, description="DeepSpeed: keep optimizer states in CPU memory.")
    offload_parameters: bool = Field(
        False, description="DeepSpeed ZeRO-3 or FSDP2: keep the parameters in CPU memory too (FSDP2 keeps their "
        "gradients and optimizer states there as well; much slower; for models that fit no other way)."
    )
    reshard_after_forward: bool = Field(
        True, description="FSDP2: free each layer's gathered parameters after its forward and gather them again "
        "for backward (full shard); false keeps them from forward to backward (less communication, more memory)."
    )
    sequence_parallel: Union[int, Auto] = Field(
        1, description="Split each row's tokens across this many processes (DeepSpeed Ulysses: each holds 1/N of "
        "the sequence and all-to-alls attention's heads); for rows too long for one GPU. Needs deepspeed_zero2/3, "
        "a number of processes divisible by it and SDPA or FlashAttention; auto: the fewest that fit (the planner; 1 "
        "where rows cannot be split)."
    )
    context_parallel: int = Field(
        1, ge=1, description="Split each row's tokens across this many processes with torch's ring attention "
        "(context parallelism through accelerate): FSDP2, SDPA, unpacked rows, CUDA GPUs only. Sequence "
        "parallelism is the one to reach for first (docs/LONG_ROWS.md says when this one serves better)."
    )
    deepspeed_config: str = Field("configs/deepspeed_z2.json", description="DeepSpeed JSON whose 'auto' values we fill.")
    timeout_minutes: float = Field(
        30, gt=0, description="How long a process waits for the others in a collective (the process-group "
        "timeout) before the run fails: above the longest pause of one rank, e.g. rank 0 preparing the data."
    )
    rendezvous_timeout_minutes: float = Field(
        10, gt=0, description="How long the nodes of a multi-node run wait for each other at start before "
        "stopping with an error."
    )
    stop_timeout_minutes: float = Field(
        15, gt=0, description="After a stop signal, how long the launcher lets the processes finish the step "
        "and save before killing them: above the longest step plus checkpoint save."
    )


class PlannerConfig(_Section):
    """The resource-aware planner."""

    safety_margin_gib: float = Field(0.5, ge=0, description="Memory kept free on each GPU beyond the prediction.")
    safety_fraction: float = Field(
        0.03, ge=0, lt=1, description="Share of free memory kept free as well (the prediction's measured error; docs/PLANNER.md)."
    )
    calibrate: bool = Field(False, description="Measure two short steps on the GPU and fit the plan to them.")


class RunConfig(_Section):
    """A whole run: one field per YAML section."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    finetune: FinetuneConfig = Field(default_factory=FinetuneConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    preference: PreferenceConfig = Field(default_factory=PreferenceConfig)
    quantization: QuantizationConfig = Field(default_factory=QuantizationConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    planner: PlannerConfig = Field(default_factory=PlannerConfig)

    @model_validator(mode="after")
    def _pairs_unpacked(self) -> RunConfig:
        """Preference pairs are never packed (each is a chosen and a rejected row, padded, as TRL's
        collator batches them): data.packing reads false for them, and the run folder's config says so."""
        if self.finetune.objective != "sft" and self.data.packing:
            self.data.packing = False
        return self

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as plain data, in section order."""
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        """The resolved config as YAML, loadable by :func:`load`."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


SECTIONS: dict[str, type[_Section]] = {
    name: field.annotation for name, field in RunConfig.model_fields.items()  # type: ignore[misc]
}


def valid_keys() -> list[str]:
    """Every dotted key a config or override may set, e.g. ``train.learning_rate``."""
    return [f"{section}.{key}" for section, cls in SECTIONS.items() for key in cls.model_fields]


def _tiling_problem(config: RunConfig, processes: int = 1) -> str | None:
    """Why ``train.tiled_mlp`` cannot train under the strategy on `processes` processes: DeepSpeed's
    TiledMLP produces a weight's gradient tile by tile, which ZeRO waits for and DDP (on several
    processes) and FSDP2 reduce at the first tile."""
    strategy = Strategy(config.distributed.strategy)
    if not config.train.tiled_mlp or strategy.deepspeed:
        return None
    if strategy.fsdp:
        return (f"train.tiled_mlp: {strategy.label} reduces a weight's gradient at the first tile's backward; tiled "
                "MLPs train in one process or under DeepSpeed ZeRO (distributed.strategy=deepspeed_zero2)")
    if processes > 1:
        return ("train.tiled_mlp: DDP reduces a weight's gradient at the first tile's backward; several processes "
                "train tiled MLPs under DeepSpeed ZeRO: make train-deepspeed")
    return None


def _sequence_parallel_problem(config: RunConfig, processes: int | None = None) -> str | None:
    """Why ``distributed.sequence_parallel`` cannot train as configured on `processes` processes
    (None: not known yet). What depends on the model (its heads, its attention): :func:`sequence_split_problem`."""
    size = config.distributed.sequence_parallel
    if size == 1 or size == "auto":  # auto: the planner's choice, 1 where rows cannot be split
        return None
    if isinstance(size, int) and size < 1:
        return f"distributed.sequence_parallel: got {size}; use a positive number of processes, or auto"
    strategy = Strategy(config.distributed.strategy)
    if not strategy.deepspeed:
        return (f"distributed.sequence_parallel: DeepSpeed's Ulysses runs under ZeRO; set "
                f"distributed.strategy=deepspeed_zero2 (or deepspeed_zero3) and use make train-deepspeed, not {strategy.label}")
    if config.model.attn_implementation in ("eager", "flex_attention"):
        return (f"distributed.sequence_parallel: model.attn_implementation={config.model.attn_implementation} cannot "
                "run on a split sequence (Ulysses drops the mask it builds); use sdpa or flash_attention_2 (or auto)")
    if processes is not None and isinstance(size, int) and processes % size:
        return (f"distributed.sequence_parallel={size} splits each row across {size} processes, and {processes} "
                f"process(es) cannot be grouped so: use a number of processes (NUM_GPUS x NNODES) divisible by {size}")
    return None


def _context_parallel_problem(config: RunConfig, processes: int | None = None, on_cpu: bool = False) -> str | None:
    """Why ``distributed.context_parallel`` cannot train as configured on `processes` processes
    (None: not known yet), in CPU processes where `on_cpu`."""
    size = config.distributed.context_parallel
    if size == 1:
        return None
    key = f"distributed.context_parallel={size}"
    strategy = Strategy(config.distributed.strategy)
    if config.distributed.sequence_parallel != 1:
        return f"{key}: rows are split by distributed.sequence_parallel already; use one of the two"
    if not strategy.fsdp:
        return (f"{key}: torch's context parallelism runs under FSDP2 (distributed.strategy=fsdp2, make "
                f"train-distributed); under {strategy.label} split rows with distributed.sequence_parallel")
    if config.model.attn_implementation not in ("auto", "sdpa"):
        return (f"{key}: torch's ring attention shards SDPA only, not {config.model.attn_implementation}; set "
                "model.attn_implementation=sdpa, or split rows with distributed.sequence_parallel (DeepSpeed)")
    if config.data.packing:
        return (f"{key}: the ring attends causally over the whole row without a mask, so packed examples would "
                "attend to each other; set data.packing=false, or split packed rows with "
                "distributed.sequence_parallel (DeepSpeed Ulysses, which attends by example)")
    if processes is not None and processes % size:
        return (f"{key} splits each row across {size} processes, and {processes} process(es) cannot be grouped so: "
                f"use a number of processes divisible by {size}")
    if on_cpu:
        return (f"{key}: context parallelism runs on CUDA GPUs only (torch has no sharding rule for the CPU's SDPA "
                "kernel); in CPU processes split rows with distributed.sequence_parallel under deepspeed_zero2")
    return None


# TRL's DPO losses (trl/trainer/dpo_config.py, DPOConfig.loss_type)
KTO_LOSSES = ("kto", "apo_zero_unpaired")  # the second estimates no KL term
DPO_LOSSES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
              "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")


def loss_types(pref: PreferenceConfig, objective: str = "dpo") -> list[str]:
    """``preference.loss_type`` as a list, null as the objective's own loss (DPO's sigmoid, KTO's kto)."""
    if pref.loss_type is None:
        return ["kto" if objective == "kto" else "sigmoid"]
    return [pref.loss_type] if isinstance(pref.loss_type, str) else list(pref.loss_type)


def kto_estimates_kl(config: RunConfig) -> bool:
    """Whether a KTO step also scores mismatched answers for its KL estimate (every KTO loss but
    apo_zero_unpaired): a forward more of the policy and of the reference, and at least two rows
    a micro-batch (TRL's KTOTrainer)."""
    return config.finetune.objective == "kto" and loss_types(config.preference, "kto") != ["apo_zero_unpaired"]


def preference_losses(config: RunConfig) -> tuple[list[str], list[float] | None]:
    """TRL's ``loss_type`` and ``loss_weights`` for the run: the preference section's, with the
    sft term appended at ``preference.sft_weight``."""
    pref = config.preference
    losses = loss_types(pref)
    weights = list(pref.loss_weights) if pref.loss_weights is not None else None
    if pref.sft_weight:
        weights = (weights or [1.0] * len(losses)) + [pref.sft_weight]
        losses.append("sft")
    return losses, weights


# Preference objectives that score the policy alone: no reference model, forward or pass
REFERENCE_FREE = ("orpo", "simpo")


def preference_problems(config: RunConfig) -> list[str]:
    """What cannot go together with preference tuning, one message each (none for SFT unless the
    preference section is set: it would be ignored)."""
    pref, method, data = config.preference, config.finetune.method, config.data
    objective = config.finetune.objective
    if objective == "sft":
        return ((["preference: set, but finetune.objective is sft (it would be ignored); set finetune.objective to "
                  "dpo, kto, orpo or simpo to train on preference data"] if pref != PreferenceConfig() else [])
                + ([f"data.format={data.format} is preference data: set finetune.objective to "
                    f"{'kto' if data.format == 'unpaired' else 'dpo, kto, orpo or simpo'} to train on it"]
                   if data.format in ("preference", "pairwise", "unpaired") else []))
    if objective in REFERENCE_FREE:
        return _reference_free_problems(config) + _pair_problems(config)
    problems = _kto_problems(config) if objective == "kto" else _dpo_loss_problems(config)
    if pref.reference == "adapters_off" and method == "full":
        problems.append("preference.reference=adapters_off: full fine-tuning has no adapters to switch off; use copy "
                        "(a frozen copy of the weights) or precomputed (one pass before training)")
    if pref.reference == "copy" and method != "full":
        problems.append(f"preference.reference=copy under {method}: the base with its adapters switched off is the "
                        "same model at no memory; use adapters_off (or auto)")
    if pref.reference == "precomputed" and method == "full" and Strategy(config.distributed.strategy).fsdp:
        problems.append("preference.reference=precomputed under FSDP2 with full fine-tuning: TRL then loads a "
                        "reference of its own from the model's name, without model.revision or initialised weights; "
                        "use preference.reference=copy, or deepspeed_zero3")
    if pref.reference == "precomputed" and data.streaming:
        problems.append("preference.reference=precomputed: a stream cannot be scored before training; set "
                        "data.streaming=false, or use another preference.reference")
    return problems + _pair_problems(config)


def _dpo_loss_problems(config: RunConfig) -> list[str]:
    """DPO's loss settings that do not go together, and KTO's given to DPO."""
    pref = config.preference
    losses = loss_types(pref)
    problems = []
    unknown = [name for name in losses if name not in DPO_LOSSES]
    if unknown or not losses:
        problems.append(f"preference.loss_type: {', '.join(map(repr, unknown)) or 'an empty list'}; TRL's DPO losses "
                        f"are {', '.join(DPO_LOSSES)}" + ("; kto and apo_zero_unpaired are KTO's: set "
                                                          "finetune.objective=kto" if set(unknown) & set(KTO_LOSSES) else ""))
    if pref.loss_weights is not None and len(pref.loss_weights) != len(losses):
        problems.append(f"preference.loss_weights: {len(pref.loss_weights)} weight(s) for {len(losses)} loss type(s); "
                        "give one per entry of preference.loss_type")
    if "exo_pair" in losses and pref.label_smoothing == 0:
        problems.append("preference.loss_type=exo_pair needs preference.label_smoothing above 0 (1e-3 is EXO's)")
    if "robust" in losses and pref.label_smoothing >= 0.5:
        problems.append("preference.loss_type=robust: preference.label_smoothing must be below 0.5")
    if "sft" in losses and pref.sft_weight:
        problems.append("preference.sft_weight adds the sft loss, which preference.loss_type names already: give it "
                        "once (its weight in preference.loss_weights, or preference.sft_weight)")
    if pref.simpo_gamma != PreferenceConfig().simpo_gamma:
        problems.append("preference.simpo_gamma is SimPO's margin: set finetune.objective=simpo, or leave it out")
    return problems + _not_kto_problems(config)


def _not_kto_problems(config: RunConfig) -> list[str]:
    pref, default = config.preference, PreferenceConfig()
    return [f"preference.{key} weighs KTO's labelled answers: set finetune.objective=kto, or leave it out"
            for key in ("desirable_weight", "undesirable_weight") if getattr(pref, key) != getattr(default, key)]


def _kto_problems(config: RunConfig) -> list[str]:
    """What a KTO run cannot take: DPO's pair settings, a loss TRL's KTOTrainer lacks, one row a
    micro-batch where the KL term is estimated."""
    pref, default = config.preference, PreferenceConfig()
    problems = []
    if isinstance(pref.loss_type, list) or loss_types(pref, "kto")[0] not in KTO_LOSSES:
        problems.append(f"preference.loss_type={pref.loss_type}: TRL's KTO losses are {', '.join(KTO_LOSSES)} (one)")
    problems += [f"preference.{key}: {what}; finetune.objective=kto takes no such setting, leave it out"
                 for key, what in (("loss_weights", "DPO's loss weights"), ("label_smoothing", "DPO's label smoothing"),
                                   ("sft_weight", "an sft term beside DPO's loss"), ("simpo_gamma", "SimPO's margin"))
                 if getattr(pref, key) != getattr(default, key)]
    micro = config.train.micro_batch_size
    if kto_estimates_kl(config) and isinstance(micro, int) and micro < 2:
        problems.append(f"train.micro_batch_size={micro}: KTO estimates its KL term from the other answers of the "
                        "micro-batch, so it needs at least 2 (or preference.loss_type=apo_zero_unpaired, which "
                        "estimates none)")
    return problems


def _reference_free_problems(config: RunConfig) -> list[str]:
    """What an ORPO or SimPO run cannot take: a reference, and the DPO loss's own settings."""
    pref, objective = config.preference, config.finetune.objective
    default = PreferenceConfig()
    problems = [f"preference.{key}: {what}; finetune.objective={objective} scores the policy alone (no reference), "
                "leave it out" for key, what in (
                    ("reference", f"{pref.reference}"), ("precompute_batch_size", "a reference pass's batch"),
                    ("loss_type", "a reference loss"), ("loss_weights", "DPO's loss weights"))
                if getattr(pref, key) != getattr(default, key)] + _not_kto_problems(config)
    if objective == "orpo":
        problems += [f"preference.{key}: {what} (ORPO's loss is the chosen answers' NLL plus beta x its odds-ratio "
                     "term); leave it out" for key, what in (
                         ("sft_weight", "the NLL is part of ORPO already"),
                         ("label_smoothing", "TRL's ORPO has none"), ("simpo_gamma", "SimPO's margin"))
                     if getattr(pref, key) != getattr(default, key)]
    return problems


def _pair_problems(config: RunConfig) -> list[str]:
    """What no preference objective takes: the data settings and SFT levers pairs do not fit."""
    data, train = config.data, config.train
    problems = []
    if data.special_tokens_in_text != "keep":
        problems.append(f"data.special_tokens_in_text={data.special_tokens_in_text}: pairs are tokenised as TRL's "
                        "DPOTrainer tokenises them, which reads special tokens written in the text as the tokens; "
                        "leave it at keep")
    if data.train_on != "completion":
        problems.append(f"data.train_on={data.train_on}: preference tuning scores the answers (what follows the "
                        "prompt) only; leave data.train_on at completion")
    if data.format not in ("auto", "preference", "pairwise", "unpaired"):
        problems.append(f"data.format={data.format} is an SFT format; preference data is preference (prompt/chosen/"
                        "rejected), pairwise (a conversation plus chosen/rejected), unpaired (KTO's prompt/"
                        "completion/label), or auto")
    if data.format == "unpaired" and config.finetune.objective != "kto":
        problems.append(f"data.format=unpaired: answers labelled one by one have no pairs for "
                        f"finetune.objective={config.finetune.objective}; use finetune.objective=kto")
    if config.distributed.sequence_parallel != 1 or config.distributed.context_parallel != 1:
        problems.append("distributed.sequence_parallel / context_parallel: rows are not split across processes for "
                        "preference tuning; leave them at 1")
    for key, on in (("tiled_mlp", train.tiled_mlp), ("offload_activations", train.offload_activations),
                    ("neftune_noise_alpha", train.neftune_noise_alpha)):
        if on:
            problems.append(f"train.{key}: an SFT lever, not applied to preference tuning; leave it out")
    return problems


def consistency_problems(config: RunConfig, processes: int | None = None, on_cpu: bool | None = None,
                         facts: Any = None, attention: str | None = None, images: bool = False) -> list[str]:
    """Every reason `config` cannot train as given, one message each: the one place a combination of
    settings is refused (what does not fit in memory, KTO's micro-batch among it, is the plan's to say).

    The values alone (each valid, not together or not in range: the preference objective's, the
    data's, the training's, the strategy's); with `processes` (how many train; None: not known
    yet) and `on_cpu` (whether they are CPU processes) known, what those rule out; with the model's
    `facts` (:class:`sft_play.architecture.ModelFacts`), the `attention` kernel the run resolved and
    whether the data shows `images`, the model's limits on a split row. Loading a config asks it of
    the values alone, the launcher and the training process with their processes and devices, the
    planner (``make plan``, ``make check``, a run's own plan) with the model too, and the remedy
    search and LONGEST to leave out what a run would refuse."""
    found = (preference_problems(config) + _column_problems(config) + _schedule_problems(config)
             + _precision_and_lever_problems(config, processes, on_cpu)
             + _distributed_problems(config, on_cpu) + _batch_and_data_problems(config))
    if facts is not None:
        found += _model_problems(config, facts, attention or "sdpa", images)
    return found


def _model_problems(config: RunConfig, facts: Any, attention: str, images: bool) -> list[str]:
    """What the model cannot do as configured: split its rows (its heads, its mixers, its attention),
    or split rows that hold images."""
    split = config.distributed.sequence_parallel if isinstance(config.distributed.sequence_parallel, int) else 1
    if images and (split > 1 or config.distributed.context_parallel > 1):
        return ["the data shows images, and a row split across processes would part an image's tokens from its "
                "pixels: leave distributed.sequence_parallel and context_parallel at 1 for vision-language data"]
    problem = _split_model_problem(facts, split, attention) if split > 1 else None
    return [problem] if problem else []


def sequence_split_problem(facts: Any, size: int, attention: str, world_size: int) -> str | None:
    """Why the model (`facts`: :class:`sft_play.architecture.ModelFacts`) cannot train with each row
    split across `size` of `world_size` processes (DeepSpeed Ulysses,
    ``deepspeed.runtime.sequence_parallel.ulysses_sp``), or None; the planner asks it of each size
    it may choose (``distributed.sequence_parallel: auto``)."""
    if world_size % size:
        return (f"distributed.sequence_parallel={size} splits each row across {size} processes, and {world_size} "
                f"process(es) cannot be grouped so: use a number of processes divisible by {size}")
    return _split_model_problem(facts, size, attention)


def _split_model_problem(facts: Any, size: int, attention: str) -> str | None:
    """Each process attends with 1/size of the heads over the whole row, so the query heads must
    divide among them (the key/value heads too, or be copied to them); the mask is dropped, so a
    sliding window needs a kernel that takes it itself."""
    key = f"distributed.sequence_parallel={size}"
    if facts.sequential_mixers:
        return (f"{key}: this model's {', '.join(facts.sequential_mixers)} layers carry a state along the sequence, "
                "which a split sequence would restart on every process (wrong gradients, no error); train it "
                "without sequence parallelism")
    if attention not in ("sdpa", "flash_attention_2", "flash_attention_3"):
        why = "this model needs eager attention" if facts.attention_eager_only else f"attention is {attention}"
        return (f"{key}: {why}, and a split sequence runs on SDPA or FlashAttention only (Ulysses drops the "
                "mask eager attention builds); train it without sequence parallelism")
    heads, kv = facts.attention_heads, facts.kv_heads or facts.attention_heads
    if heads and heads % size:
        return (f"{key}: each process attends with 1/{size} of the {heads} attention heads, which do not divide by "
                f"{size}; use a divisor of {heads}")
    if heads and kv % size and size % kv:
        return (f"{key}: the {kv} key/value heads neither divide among {size} processes nor copy evenly to them; "
                f"use a divisor or a multiple of {kv}")
    if facts.sliding_window and attention == "sdpa":
        return (f"{key}: this model's layers attend through a {facts.sliding_window:,}-token window, which SDPA "
                "takes only as a mask, and a split sequence drops masks; use model.attn_implementation="
                "flash_attention_2 (GPUs), or train without sequence parallelism")
    return None


def _column_problems(config: RunConfig) -> list[str]:
    problems = []
    for ours in config.data.columns:
        if ours not in DATA_FIELDS:
            near = difflib.get_close_matches(ours, DATA_FIELDS, n=1)
            problems.append(f"data.columns.{ours}: no such field" + (f"; did you mean data.columns.{near[0]}?" if near
                            else "") + f" The fields: {', '.join(DATA_FIELDS)}")
    return problems


def _schedule_problems(config: RunConfig) -> list[str]:
    """How long the run trains, and on what: steps, evaluations, a stream, images."""
    train, data = config.train, config.data
    problems = []
    if train.early_stopping_patience and not (train.eval_steps and (data.validation_path
                                                                   or data.validation_fraction > 0)):
        problems.append(f"train.early_stopping_patience={train.early_stopping_patience} counts evaluations: set "
                        "train.eval_steps and validation data (data.validation_path or data.validation_fraction)")
    for key in ("micro_batch_size", "gradient_accumulation_steps"):
        value = getattr(train, key)
        if isinstance(value, int) and value < 1:
            problems.append(f"train.{key}: got {value}; use a positive number, or auto for the planner's choice")
    if train.max_steps == 0 or train.max_steps < -1:
        problems.append(f"train.max_steps: got {train.max_steps}; use a positive number of steps, or -1 for num_epochs")
    if data.streaming and train.max_steps < 1:
        problems.append("data.streaming: a stream's length is not known before it is read; set train.max_steps (the "
                        "run's optimizer steps)")
    if data.streaming and data.validation_fraction > 0:
        problems.append("data.streaming: a stream has no records to hold out before training; set "
                        "data.validation_path to held-out data (prepared whole), and data.validation_fraction=0")
    if data.image_max_pixels and data.image_min_pixels and data.image_min_pixels > data.image_max_pixels:
        problems.append(f"data.image_min_pixels={data.image_min_pixels} is above data.image_max_pixels="
                        f"{data.image_max_pixels}: an image cannot be given more pixels than it may keep")
    return problems


def _precision_and_lever_problems(config: RunConfig, processes: int | None, on_cpu: bool | None) -> list[str]:
    """The weights' dtype against the precision, and the long-row levers' preconditions."""
    train, method = config.train, config.finetune.method
    problems = []
    if method == "full" and config.model.torch_dtype == "float16" and train.mixed_precision == "fp16":
        problems.append(
            "model.torch_dtype: float16 weights cannot be trained with fp16 mixed precision (the gradient scaler "
            "needs float32 master weights); use torch_dtype float32 or bfloat16"
        )
    if train.offload_activations and not train.gradient_checkpointing:
        problems.append("train.offload_activations keeps the hidden states gradient checkpointing saves in host memory: "
                        "set train.gradient_checkpointing=true too")
    problems += [p for p in (_sequence_parallel_problem(config, processes),
                             _context_parallel_problem(config, processes, on_cpu=bool(on_cpu)),
                             _tiling_problem(config, processes or 1)) if p]
    if train.tiled_mlp and method != "full" and config.lora.dropout > 0:
        problems.append(f"train.tiled_mlp recomputes each tile in backward without replaying its random numbers: LoRA "
                        f"dropout ({config.lora.dropout}) would differ between the passes; set lora.dropout=0")
    return problems


def _distributed_problems(config: RunConfig, on_cpu: bool | None) -> list[str]:
    """What a strategy cannot shard, offload or average as asked (in CPU processes where `on_cpu`)."""
    train, method, distributed = config.train, config.finetune.method, config.distributed
    strategy = Strategy(distributed.strategy)
    problems = []
    if strategy.fsdp and distributed.offload_parameters and on_cpu:
        problems.append("distributed.offload_parameters under FSDP2 moves the shards between CPU and GPU memory "
                        "(pinned), which CPU processes do not have: leave it out with CPU=1, or train on GPUs")
    if method == "qlora" and strategy.shards_parameters and config.quantization.quant_storage == "uint8":
        problems.append(
            f"quantization.quant_storage: QLoRA under {strategy.label} needs "
            "the packed 4-bit weights stored in the compute dtype so they can be sharded; set "
            "quantization.quant_storage=bfloat16"
        )
    if distributed.offload_parameters and not strategy.shards_parameters:
        problems.append(
            "distributed.offload_parameters: parameters are offloaded by ZeRO-3 or FSDP2 only; set "
            "distributed.strategy=deepspeed_zero3 (make train-deepspeed) or fsdp2 (make train-distributed)"
        )
    if strategy.fsdp and method != "full" and "lm_head" in (config.lora.modules_to_save or []):
        problems.append(
            "lora.modules_to_save: under FSDP2 a trainable copy of lm_head is sharded on its own, and TRL's loss "
            "reads its weight outside its forward (gathered by hand), so each rank keeps its own unaveraged "
            "gradient for its shard (measured: grad norm 4.33 against 4.27 for DDP and one process); remove "
            "lm_head from lora.modules_to_save, or use ddp or deepspeed_* for it"
        )
    if distributed.offload_optimizer and not strategy.shards_states:
        problems.append(
            "distributed.offload_optimizer: DDP keeps the optimizer on the GPU (this would be ignored); DeepSpeed "
            "offloads it: set distributed.strategy=deepspeed_zero2 (make train-deepspeed), or FSDP2 with "
            "distributed.offload_parameters=true"
        )
    if train.min_lr_ratio and train.lr_scheduler != "cosine":
        problems.append(f"train.min_lr_ratio: a floor for the cosine schedule only (train.lr_scheduler is "
                        f"{train.lr_scheduler}); set train.lr_scheduler=cosine, or leave min_lr_ratio at 0")
    if method != "full" and config.lora.loraplus_lr_ratio and strategy.deepspeed and distributed.offload_optimizer:
        problems.append(
            "lora.loraplus_lr_ratio: with distributed.offload_optimizer DeepSpeed builds its own optimizer on the "
            "CPU, without LoRA+'s parameter groups; leave one of them out"
        )
    if strategy.fsdp and distributed.offload_optimizer and not distributed.offload_parameters:
        problems.append(
            "distributed.offload_optimizer: FSDP2 offloads parameters, gradients and optimizer states together; "
            "set distributed.offload_parameters=true instead"
        )
    return problems


def _batch_and_data_problems(config: RunConfig) -> list[str]:
    """The batch, the run's name, and the data sources' weights and held-out share."""
    train, data = config.train, config.data
    problems = []
    if isinstance(train.micro_batch_size, int) and train.micro_batch_size > train.global_batch_size:
        problems.append(
            f"train.micro_batch_size: {train.micro_batch_size} is larger than train.global_batch_size "
            f"{train.global_batch_size}"
        )
    if train.run_name is not None and not RUN_NAME.fullmatch(train.run_name):
        problems.append(f"train.run_name: got {train.run_name!r}; a run is one folder inside train.output_dir: use "
                        "letters, digits, '.', '_' and '-' (up to 128, not starting with '.' or '-'), no '/'")
    weights, paths = data.weights, data.path
    if weights is not None and (isinstance(paths, str) or len(weights) != len(paths)):
        problems.append(f"data.weights: {len(weights)} weight(s) for {1 if isinstance(paths, str) else len(paths)} "
                        "data.path entries; give one weight per entry of a data.path list")
    elif weights is not None and (any(w < 0 for w in weights) or not sum(weights)):
        problems.append("data.weights: weights must be >= 0 and not all 0")
    if data.validation_path and data.validation_fraction > 0:
        problems.append("data.validation_fraction: set either data.validation_path or data.validation_fraction, not both")
    return problems
