"""The memory model: one pure function per term of a GPU's peak, in bytes.

Every function takes the exact model shape (:mod:`sft_play.planner.shapes`), the recipe (what
dtype each thing is in our training path, and how work is split) and, for the activation terms,
the workload (micro-batch, sequence length, checkpointing, attention kernel). No torch calls:
the arithmetic runs in microseconds and can be tested term by term. docs/PLANNER.md gives each
formula's derivation, source and assumptions.

Notation: b micro-batch, s sequence length, h hidden size, I MLP intermediate size, L layers,
V vocabulary, q = heads x head_dim, kv = kv_heads x head_dim; c bytes of the compute dtype,
r bytes of the residual stream (the dtype the base weights are stored in).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sft_play.planner.shapes import ModelShape

MIB = 1024**2
GIB = 1024**3

NF4_BLOCK = 64  # bitsandbytes 4-bit block size: one absmax constant per 64 weights
DOUBLE_QUANT_BLOCK = 256  # with double quantisation the absmax constants are quantised in blocks of 256
FUSED_HEAD_TOKENS = 4096  # TRL's chunked log-prob: token rows per tile (trl.kernels.chunked_logprob)
FUSED_HEAD_VOCAB = 32768  # ... and vocabulary columns per tile (trl.trainer.utils)
CUDA_CONTEXT_BYTES = 512 * MIB  # CUDA context + kernels loaded lazily (CUDA 12/13, Hopper), per process
CUBLAS_WORKSPACE_BYTES = 64 * MIB  # cuBLAS/cuBLASLt workspaces on Hopper
NCCL_BYTES = 320 * MIB  # NCCL communicator buffers, only with more than one process
FRAGMENTATION = 0.08  # caching-allocator reserve beyond live tensors, as a share of the dynamic peak
DDP_BUCKET_CAP = 25 * MIB

Strategy = Literal["ddp", "deepspeed_zero2", "deepspeed_zero3"]
Attention = Literal["flash_attention_2", "sdpa", "eager"]


@dataclass(frozen=True)
class Recipe:
    """What dtype each piece of state is in, and how state is split across processes.

    Built from the config and the precision recipe by :func:`sft_play.planner.recipe_for`.
    """

    method: Literal["full", "lora", "qlora"]
    weight_bytes: int  # storage bytes of the (base) weights: 4 fp32, 2 bf16/fp16
    compute_bytes: int  # bytes of activations under autocast (2) or in fp32 (4)
    mixed_precision: bool  # autocast on
    optimizer: str
    world_size: int = 1
    strategy: Strategy = "ddp"
    offload_optimizer: bool = False
    double_quant: bool = True
    lora_dropout: bool = False
    lora_rank: int = 0
    adapter_bytes: int = 4  # peft keeps LoRA weights in fp32; TRL casts QLoRA's to bf16

    @property
    def trainable_bytes(self) -> int:
        """Bytes per trainable parameter as held on the GPU (and per gradient element).

        DDP: the parameter's own dtype (fp32 full fine-tuning, fp32 LoRA adapters, bf16 QLoRA
        adapters). DeepSpeed casts the module to the 16-bit compute dtype and keeps fp32 masters
        in its optimizer instead.
        """
        if self.deepspeed:
            return self.compute_bytes
        return self.weight_bytes if self.method == "full" else self.adapter_bytes

    @property
    def deepspeed(self) -> bool:
        return self.strategy.startswith("deepspeed")

    @property
    def shards(self) -> int:
        """How many ways ZeRO splits gradients and optimizer states (1 under DDP)."""
        return self.world_size if self.deepspeed else 1

    @property
    def weight_shards(self) -> int:
        """How many ways the parameters themselves are split (ZeRO-3 only)."""
        return self.world_size if self.strategy == "deepspeed_zero3" else 1


@dataclass(frozen=True)
class Workload:
    """One micro-batch as the GPU sees it."""

    micro_batch: int
    seq_len: int
    gradient_checkpointing: bool
    attention: Attention
    masked: bool  # a 4-D attention mask is materialised (packing or padding without FlashAttention)
    loss_token_share: float = 1.0  # share of positions with a label (TRL's head only projects those on CUDA)

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len


# ---------------------------------------------------------------------------------------------
# Model states


def weights_bytes(shape: ModelShape, recipe: Recipe) -> int:
    """Parameters as stored on the GPU.

    full / lora: every parameter in the storage dtype (under DeepSpeed the 16-bit compute dtype,
    its fp32 masters being counted in :func:`master_weights_bytes`), LoRA adapters in theirs.
    qlora: the quantised linears at 4 bits (0.5 byte) plus their constants
    (:func:`quantization_constants_bytes`), everything else in the 16-bit storage dtype.
    ZeRO-3 keeps 1/world of them, plus the two largest layers gathered at a time.
    """
    base_bytes = recipe.compute_bytes if recipe.deepspeed else recipe.weight_bytes
    adapters = shape.lora_params * recipe.trainable_bytes
    if recipe.method == "qlora":
        rest = shape.total_params - shape.quantized_params
        stored = shape.quantized_params // 2 + quantization_constants_bytes(shape, recipe) + rest * recipe.weight_bytes
    else:
        stored = shape.total_params * base_bytes
    if recipe.weight_shards > 1:
        per_layer = (stored - shape.params_by_kind["embeddings"] * base_bytes) // max(1, shape.num_layers)
        stored = stored // recipe.weight_shards + 2 * per_layer
    return stored + adapters


def quantization_constants_bytes(shape: ModelShape, recipe: Recipe) -> int:
    """NF4 absmax constants: one fp32 per 64-weight block; with double quantisation one byte per
    block plus one fp32 scale (and a shared offset) per 256 blocks (Dettmers et al. 2023, QLoRA §3;
    bitsandbytes ``quantize_4bit``)."""
    blocks = shape.quantized_blocks
    if recipe.method != "qlora":
        return 0
    if recipe.double_quant:
        return blocks + 4 * -(-blocks // DOUBLE_QUANT_BLOCK)
    return 4 * blocks


def gradient_bytes(shape: ModelShape, recipe: Recipe) -> int:
    """Gradients of the trainable parameters, in their dtype; ZeRO-2/3 keep only this rank's
    partition (plus the buckets of :func:`zero_buffer_bytes`)."""
    return shape.trainable_params * recipe.trainable_bytes // recipe.shards


def optimizer_state_bytes(shape: ModelShape, recipe: Recipe) -> int:
    """Optimizer states per trainable parameter.

    torch AdamW keeps exp_avg and exp_avg_sq in the parameter's dtype (2 x 4 bytes for fp32,
    2 x 2 for bf16 adapters); DeepSpeed keeps them in fp32. bitsandbytes 8-bit AdamW: one byte
    each plus an fp32 absmax per 256-value block (Dettmers et al. 2022, 8-bit optimizers).
    SGD without momentum: none. Adafactor: factored second moments, about 4 bytes x (rows +
    columns) per matrix, taken as 4 bytes x trainable / h. Offloaded to the CPU: none on the GPU.
    """
    if recipe.offload_optimizer and recipe.deepspeed:
        return 0
    n = shape.trainable_params
    state = 4 if recipe.deepspeed else recipe.trainable_bytes
    per_param = {
        "adamw_torch": 2 * state,
        "adamw_torch_fused": 2 * state,
        "adamw_8bit": 2 + 8 / 256,
        "paged_adamw_8bit": 2 + 8 / 256,
        "sgd": 0,
    }.get(recipe.optimizer)
    if per_param is None:  # adafactor
        return 4 * n // max(1, shape.hidden_size) // recipe.shards
    return int(n * per_param) // recipe.shards


def master_weights_bytes(shape: ModelShape, recipe: Recipe) -> int:
    """fp32 master copy of the trainable parameters. Our DDP recipe has none (full fine-tuning
    trains fp32 weights directly; adapters are their own masters); DeepSpeed keeps one in its
    optimizer, partitioned across ranks (and in CPU memory with offload)."""
    if not recipe.deepspeed or (recipe.offload_optimizer and recipe.deepspeed):
        return 0
    return shape.trainable_params * 4 // recipe.shards


def optimizer_step_bytes(shape: ModelShape, recipe: Recipe) -> int:
    """Temporaries while the optimizer steps. torch's foreach AdamW (``_multi_tensor_adam``)
    builds one state-sized intermediate for a parameter group (``_foreach_sqrt`` of exp_avg_sq,
    then updated in place); the fused kernel works in place; DeepSpeed converts this rank's
    gradient partition to fp32 first."""
    n = shape.trainable_params // recipe.shards
    if recipe.deepspeed:
        return 0 if recipe.offload_optimizer else 4 * n
    if recipe.optimizer == "adamw_torch":
        return n * recipe.trainable_bytes
    return 0


# ---------------------------------------------------------------------------------------------
# Activations


def _residual_bytes(recipe: Recipe) -> int:
    # The residual stream has the dtype of the embedding output, i.e. of the stored weights.
    return 2 if recipe.method == "qlora" else recipe.weight_bytes


def layer_activation_bytes_per_token(shape: ModelShape, recipe: Recipe, workload: Workload) -> float:
    """Tensors one decoder layer saves for backward, per token (Llama-style block: RMSNorm,
    attention, RMSNorm, gated MLP), counted tensor by tensor from what autograd keeps
    (after Korthikanti et al. 2022, "Reducing Activation Recomputation", §4.1, redone for
    RMSNorm, rotary embeddings, GQA, SwiGLU, no dropout and fused attention kernels):

    - each RMSNorm: its fp32 input (4h), the normalised tensor cast back (r h) and the output
      the next linear reads, as autocast's copy (c h): 2 x (4 + r + c) h
    - attention: rotated q and k, v and the kernel output (saved by the kernel), the output made
      contiguous for o_proj, and fp32 log-sum-exp per head: c (3q + 2kv) + 4 heads; where the
      kernel cannot take GQA (a mask is passed), k and v are repeated to q heads first
    - MLP: gate output, its SiLU, up output and their product: 4 c I
    - LoRA: :func:`lora_activation_bytes_per_token`
    """
    h, c, r = shape.hidden_size, recipe.compute_bytes, _residual_bytes(recipe)
    q = shape.num_attention_heads * shape.head_dim
    kv = shape.num_key_value_heads * shape.head_dim
    if workload.masked or workload.attention == "eager":
        kv = q  # repeat_kv: sdpa gets no enable_gqa when a mask is passed; eager always repeats
    norms = 2 * (4 + r + c) * h
    attention = c * (3 * q + 2 * kv) + 4 * shape.num_attention_heads
    mlp = 4 * c * shape.intermediate_size
    return norms + attention + mlp + lora_activation_bytes_per_token(shape, recipe)


def lora_activation_bytes_per_token(shape: ModelShape, recipe: Recipe) -> float:
    """What the adapters of one layer save, per token: for each adapted linear (in, out), the
    input of lora_A as autocast's 16-bit copy of peft's cast to the adapter dtype (c x in, only
    when adapter and activation dtypes differ), the dropout mask (1 byte x in, with dropout), and
    lora_A's output kept for lora_B (c x r)."""
    if recipe.method == "full" or not shape.lora_in_out:
        return 0
    c = recipe.compute_bytes
    cast_copy = recipe.mixed_precision and recipe.adapter_bytes != c
    total = 0.0
    for in_features, _out in shape.lora_in_out:
        total += (c * in_features if cast_copy else 0) + (in_features if recipe.lora_dropout else 0)
        total += c * recipe.lora_rank
    return total


def attention_score_bytes(shape: ModelShape, recipe: Recipe, workload: Workload) -> int:
    """The s x s terms. Eager attention saves, per layer, the fp32 softmax output and its cast
    copy: b heads s^2 (4 + c). SDPA with a mask (packed rows or padding) converts the boolean
    mask to an additive one per call and the memory-efficient kernel saves it for backward:
    b s^2 c per layer. FlashAttention-2 (variable length, no mask) and unmasked SDPA save none.
    With gradient checkpointing only the layer being recomputed holds them."""
    b, s, c = workload.micro_batch, workload.seq_len, recipe.compute_bytes
    layers = 1 if workload.gradient_checkpointing else shape.num_layers
    if workload.attention == "eager":
        return b * shape.num_attention_heads * s * s * (4 + c) * layers + b * s * s * c
    if workload.attention == "sdpa" and workload.masked:
        s_aligned = -(-s // 16) * 16  # the memory-efficient kernel pads the bias to multiples of 16
        return b * s * s_aligned * c * layers + b * s * s  # plus the boolean mask built once
    return 0


def activation_bytes(shape: ModelShape, recipe: Recipe, workload: Workload) -> int:
    """Activations saved through the forward pass, all layers.

    Without checkpointing: every layer's :func:`layer_activation_bytes_per_token` x b x s.
    With checkpointing (non-reentrant, per decoder layer): each layer keeps only its input
    (r h per token) and one layer's activations exist at a time, during its recomputation.
    Plus the final norm (as one RMSNorm above) and the embedding output it reads.
    """
    tokens = workload.tokens
    h = shape.hidden_size
    per_layer = layer_activation_bytes_per_token(shape, recipe, workload) * tokens
    final_norm = (4 + _residual_bytes(recipe) + recipe.compute_bytes) * h * tokens
    if workload.gradient_checkpointing:
        kept = shape.num_layers * _residual_bytes(recipe) * h * tokens
        return int(kept + per_layer + final_norm)
    return int(shape.num_layers * per_layer + final_norm)


def backward_working_bytes(shape: ModelShape, recipe: Recipe, workload: Workload) -> int:
    """Gradients of activations in flight while one layer runs backward: the residual-stream
    gradient, accumulated in fp32 by the fused head (4h) and carried in the residual dtype (r h),
    and the MLP's intermediate gradients (2 c I), per token."""
    c, r = recipe.compute_bytes, _residual_bytes(recipe)
    return int(workload.tokens * ((4 + r) * shape.hidden_size + 2 * c * shape.intermediate_size))


def logits_loss_bytes(shape: ModelShape, recipe: Recipe, workload: Workload, on_cuda: bool = True) -> int:
    """The output head and loss under TRL's chunked log-prob (``fused_lm_head``), which never
    materialises the b x s x V logits (nor their fp32 upcast): it saves the hidden states of the
    positions that carry a label (N = b s x share on CUDA, every position elsewhere), seven fp32
    statistics per position, and works through a [min(N, 4096), 32768] tile in the compute dtype
    (allocated at full tile width even for small vocabularies), in forward and backward. Backward
    accumulates the hidden-state gradient in fp32 (N h 4), and for a trained head (full
    fine-tuning) the head's gradient in fp32 (V h 4) before casting it back."""
    share = workload.loss_token_share if on_cuda else 1.0
    n = max(1, int(workload.tokens * share))
    h, c, r = shape.hidden_size, recipe.compute_bytes, _residual_bytes(recipe)
    saved = n * h * r + 7 * 4 * n
    tile = min(n, FUSED_HEAD_TOKENS) * FUSED_HEAD_VOCAB * c
    weight_chunk = min(shape.vocab_size, FUSED_HEAD_VOCAB) * h * c if recipe.weight_bytes != c else 0
    grads = n * h * (4 + r)
    if recipe.method == "full":
        grads += shape.vocab_size * h * 4
    return saved + tile + weight_chunk + grads


def dequantize_bytes(shape: ModelShape, recipe: Recipe) -> int:
    """QLoRA: bitsandbytes de-quantises a 4-bit weight to the compute dtype for each matmul, in
    forward and again in backward; the largest linear's weight is the transient."""
    if recipe.method != "qlora":
        return 0
    largest = max(shape.hidden_size * shape.intermediate_size, shape.hidden_size * shape.num_attention_heads * shape.head_dim)
    return largest * recipe.compute_bytes


# ---------------------------------------------------------------------------------------------
# Communication and runtime


def ddp_bucket_bytes(shape: ModelShape, recipe: Recipe) -> int:
    """DDP's reducer keeps flat gradient buckets covering every trainable parameter (a second copy
    of the gradients, since transformers leaves ``gradient_as_bucket_view`` off); one process
    needs none (PyTorch ``DistributedDataParallel``, ``reducer.cpp``)."""
    if recipe.world_size <= 1 or recipe.deepspeed:
        return 0
    return shape.trainable_params * recipe.trainable_bytes


def zero_buffer_bytes(shape: ModelShape, recipe: Recipe) -> int:
    """DeepSpeed ZeRO-2 bucket buffers: the gradient-reduction bucket, double-buffered
    (``reduce_bucket_size``, filled as h^2 from our 'auto') and the all-gather bucket for the
    updated parameters (``allgather_bucket_size``), in the 16-bit dtype
    (deepspeed/runtime/zero/stage_1_and_2.py)."""
    if not recipe.deepspeed:
        return 0
    reduce_bucket = shape.hidden_size * shape.hidden_size
    allgather_bucket = min(2 * 10**8, shape.trainable_params)
    return 2 * (2 * reduce_bucket) + 2 * allgather_bucket


def runtime_bytes(recipe: Recipe) -> int:
    """CUDA context and library workspaces in every process; NCCL's buffers with several."""
    return CUDA_CONTEXT_BYTES + CUBLAS_WORKSPACE_BYTES + (NCCL_BYTES if recipe.world_size > 1 else 0)


# ---------------------------------------------------------------------------------------------
# The peak


def breakdown(shape: ModelShape, recipe: Recipe, workload: Workload, on_cuda: bool = True) -> dict[str, int]:
    """Every term of one GPU's peak, in bytes; the values sum to the predicted peak.

    The peak is the static state (weights, gradients, optimizer states, buffers, runtime) plus the
    larger of the forward/backward working set and the optimizer step's temporaries, plus the
    allocator's fragmentation on the dynamic part.
    """
    static = {
        "weights": weights_bytes(shape, recipe),
        "gradients": gradient_bytes(shape, recipe),
        "optimizer_states": optimizer_state_bytes(shape, recipe),
        "master_weights": master_weights_bytes(shape, recipe),
        "ddp_buckets": ddp_bucket_bytes(shape, recipe),
        "zero_buffers": zero_buffer_bytes(shape, recipe),
        "cuda_runtime": runtime_bytes(recipe),
    }
    forward_backward = {
        "activations": activation_bytes(shape, recipe, workload),
        "attention_scores": attention_score_bytes(shape, recipe, workload),
        "logits_loss": logits_loss_bytes(shape, recipe, workload, on_cuda),
        "backward_working": backward_working_bytes(shape, recipe, workload),
        "dequantize": dequantize_bytes(shape, recipe),
    }
    step = optimizer_step_bytes(shape, recipe)
    dynamic = sum(forward_backward.values())
    if step > dynamic:  # the optimizer step is the peak: activations are gone by then
        forward_backward = dict.fromkeys(forward_backward, 0)
        dynamic = step
    else:
        step = 0
    terms = {**static, **forward_backward, "optimizer_step": step}
    terms["fragmentation"] = int(FRAGMENTATION * dynamic)
    return terms


def peak_bytes(shape: ModelShape, recipe: Recipe, workload: Workload, on_cuda: bool = True) -> int:
    """The predicted peak of one GPU (``torch.cuda.max_memory_reserved`` plus the context)."""
    return sum(breakdown(shape, recipe, workload, on_cuda).values())
