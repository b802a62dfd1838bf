"""What one decoder layer keeps for backward, measured by running the model's own layer.

The activation memory of a training step is what autograd saves in the forward pass and what
the backward pass holds while it runs. Rather than a formula per architecture, the planner
runs one decoder layer of the real model (transformers' module, with peft's LoRA wrappers,
checkpointing and the precision recipe as configured) on the **meta device**, where tensors
have shapes and dtypes but no memory and every operation costs microseconds, and counts the
bytes of every storage that is alive:

- **saved**: what is left alive after the layer's forward (what backward will read), less
  the layer's output (the next layer's input, counted there if that layer keeps it);
- **forward_extra**: the transient peak above the layer's input while the forward runs;
- **backward_extra**: the peak above (everything saved + the incoming gradient) while the
  layer's backward runs (with checkpointing: the recomputation plus the backward);
- **cast_cache**: the 16-bit copies of fp32 weights that autocast caches until the model's
  forward ends (full fine-tuning under mixed precision).

Each quantity is traced at micro-batch 1 and 2 at the run's sequence length and written as
``const + per_sample x b`` (exact: at a fixed length every activation scales with b), so that
the planner's arithmetic never runs a trace itself. Profiles are cached per (model, method,
precision, kernel, mask, checkpointing, sequence length): one costs about 0.1 s.

What a trace on the meta device cannot see is put in explicitly, each with its source:

- **autocast**: the meta device has no autocast, so :class:`_Autocast` applies CUDA autocast's
  rule (``aten/src/ATen/autocast_mode.cpp``): matmul-like functions take their floating inputs
  in the 16-bit dtype, and fp32 leaf tensors that require grad (weights) are cast once and
  cached for the rest of the forward pass.
- **the attention kernel**: on the meta device SDPA would take its math path and save the
  fp32 s x s probabilities, which CUDA's flash and memory-efficient kernels never keep.
  :class:`_FusedAttention` saves what those kernels save (q, k, v, the output and an fp32
  log-sum-exp per row; the memory-efficient kernel also the additive mask, converted from
  the boolean one per call and padded to 16 columns: ``attention.cpp``
  ``convert_boolean_attn_mask``/``preprocess_mask``), and allocates in backward what their
  backward kernels allocate (dq, dk, dv, an fp32 dq accumulator, dk/dv at query heads for
  grouped-query attention before the group sum: FlashAttention-2 ``mha_bwd``). Eager
  attention runs its own code.
- **dropout**: CUDA's fused dropout keeps a boolean mask for backward; on the meta device
  dropout multiplies by a saved fp32 noise tensor instead (``aten/src/ATen/native/Dropout.cpp``,
  ``is_fused_kernel_acceptable``). :class:`_FusedDropout` keeps the mask.
- **bitsandbytes 4-bit linears** save no activation (``MatMul4Bit`` keeps only the packed
  weight) and de-quantise their weight for each matmul: traced as frozen 16-bit linears
  (which also save nothing but the weight); the de-quantised weight is the planner's
  ``dequantize`` term.

Parameters are never counted here (the planner counts them exactly), nor their gradients.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_FLASH_TRACE = "sft_play_flash_trace"


@dataclass(frozen=True)
class Coefficients:
    """Bytes as ``const + per_sample x b`` at the traced sequence length (exact: at a fixed
    sequence length every activation scales with the micro-batch b)."""

    const: float = 0.0
    per_sample: float = 0.0

    def at(self, micro_batch: int) -> int:
        return int(self.const + self.per_sample * micro_batch)

    @classmethod
    def fit(cls, one: float, two: float) -> Coefficients:
        """From the values at micro-batch 1 and 2."""
        return cls(float(2 * one - two), float(two - one))


@dataclass(frozen=True)
class LayerProfile:
    """What one decoder layer costs in activation memory (see the module docstring)."""

    saved: Coefficients
    forward_extra: Coefficients
    backward_extra: Coefficients
    cast_cache: Coefficients
    final_norm_saved: Coefficients  # the model's final norm (one, not per layer)
    final_norm_backward_extra: Coefficients


@dataclass(frozen=True)
class TraceSpec:
    """Everything a layer's activation memory depends on (hashable: profiles are cached by it)."""

    name_or_path: str
    revision: str | None
    trust_remote_code: bool
    method: str  # full, lora, qlora
    weights_dtype: str  # storage dtype of the (base) weights
    adapter_dtype: str  # LoRA adapters
    compute_dtype: str | None  # autocast dtype; None without autocast
    attention: str  # sdpa, flash_attention_2, eager
    masked: bool  # a 4-D attention mask is passed (packed rows or padding without FlashAttention-2)
    checkpointing: bool
    lora_rank: int = 16
    lora_targets: str | tuple[str, ...] = "all-linear"
    lora_dropout: bool = False


class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of every storage created by an operation while it is alive (weak
    references to the storages), except storages named in `ignore` (parameters, inputs)."""

    def __init__(self, ignore: set[int]):
        super().__init__()
        self.current = 0
        self.peak = 0
        self.ignore = ignore
        self._alive: dict[int, Any] = {}

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self.ignore or key in self._alive:
            return
        size = storage.nbytes()
        self.current += size
        self.peak = max(self.peak, self.current)

        def released(_ref: Any, key: int = key, size: int = size) -> None:
            self.current -= size
            self._alive.pop(key, None)

        self._alive[key] = weakref.ref(storage, released)

    def reset_peak(self) -> None:
        self.peak = self.current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self._track, result)
        return result


def _pad(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class _FusedAttention(torch.autograd.Function):
    """Stands in for CUDA's fused attention kernels: saves and allocates what they do (module
    docstring). Inputs and output are in SDPA's layout, [batch, heads, seq, head_dim]."""

    @staticmethod
    def forward(ctx, query, key, value, bias):
        b, heads, s, d = query.shape
        out = torch.empty((b, s, heads, d), dtype=query.dtype, device=query.device).transpose(1, 2)
        # The memory-efficient kernel (taken with a mask) pads the log-sum-exp rows to 32
        lse = torch.empty((b, heads, _pad(s, 32) if bias is not None else s), dtype=torch.float32, device=query.device)
        ctx.save_for_backward(query, key, value, out, lse, bias)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, _out, _lse, _bias = ctx.saved_tensors
        b, heads, s, d = query.shape
        device = query.device
        _delta = torch.empty((b, heads, _pad(s, 32)), dtype=torch.float32, device=device)
        _dq_accumulator = torch.empty((b, s, heads, d), dtype=torch.float32, device=device)
        if key.shape[1] != heads:  # grouped-query attention: dk, dv at query heads, then summed
            _dk_expanded = torch.empty((b, s, heads, d), dtype=key.dtype, device=device)
            _dv_expanded = torch.empty((b, s, heads, d), dtype=value.dtype, device=device)
        return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), None


def _fused_sdpa(query, key, value, attn_mask=None, **_ignored):
    """``F.scaled_dot_product_attention`` as CUDA runs it for training (flash without a mask,
    memory-efficient with one)."""
    bias = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:  # convert_boolean_attn_mask: where(~mask, -inf, 0) in q's dtype
            zero = torch.zeros((), dtype=query.dtype, device=query.device)
            attn_mask = torch.where(attn_mask.logical_not(), float("-inf"), zero).to(query.dtype)
        columns = attn_mask.shape[-1]
        if columns % 16:  # preprocess_mask -> pad_bias<16>
            attn_mask = F.pad(attn_mask, (0, 16 - columns % 16))[..., :columns]
        bias = attn_mask
    return _FusedAttention.apply(query, key, value, bias)


class _FusedDropout(torch.autograd.Function):
    """Dropout as CUDA runs it (``native_dropout``): the backward keeps a boolean mask. (On the
    CPU and meta devices ``dropout`` multiplies by a saved fp32 noise tensor instead.)"""

    @staticmethod
    def forward(ctx, input):
        ctx.save_for_backward(torch.empty(input.shape, dtype=torch.bool, device=input.device))
        return torch.empty_like(input)

    @staticmethod
    def backward(ctx, grad):
        return torch.empty_like(grad)


def _flash_attention_2(module, query, key, value, attention_mask, **_kwargs):
    """transformers' ``flash_attention_2`` interface (flash-attn's variable-length kernel, no mask,
    grouped-query heads native), as registered for traces; returns [batch, seq, heads, dim]."""
    return _FusedAttention.apply(query, key, value, None).transpose(1, 2), None


class _Autocast(TorchFunctionMode):
    """CUDA autocast's rule, applied above autograd so that the casts are what autograd saves.

    Matmul-like functions (autocast's lower-precision list) take floating fp32 inputs in
    `dtype`; an fp32 leaf that requires grad (a trainable weight) is cast once per forward pass
    and the copy is cached (``cached_cast``), which keeps it alive until the forward ends.
    SDPA is replaced by :func:`_fused_sdpa`.
    """

    _LOWER = {F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.mm,
              torch.baddbmm, torch.addmm, torch.einsum, F.conv1d}

    def __init__(self, dtype: torch.dtype | None, cache: bool = True):
        super().__init__()
        self.dtype = dtype
        self.cache: dict[int, torch.Tensor] | None = {} if cache else None

    def _cast(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.dtype is None or tensor.dtype != torch.float32:
            return tensor
        if self.cache is not None and tensor.is_leaf and tensor.requires_grad:
            if id(tensor) not in self.cache:
                self.cache[id(tensor)] = tensor.to(self.dtype)
            return self.cache[id(tensor)]
        return tensor.to(self.dtype)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout:
            training = kwargs.get("training", args[2] if len(args) > 2 else True)
            probability = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            return _FusedDropout.apply(args[0]) if training and probability > 0 else args[0]
        if func is F.scaled_dot_product_attention:
            query, key, value = (self._cast(t) for t in args[:3])
            return _fused_sdpa(query, key, value, kwargs.get("attn_mask", args[3] if len(args) > 3 else None))
        if func in self._LOWER and self.dtype is not None:
            args = tree_map_only(torch.Tensor, self._cast, args)
            kwargs = tree_map_only(torch.Tensor, self._cast, kwargs)
        return func(*args, **kwargs)

    def cached_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in (self.cache or {}).values())


@functools.lru_cache(maxsize=8)
def _one_layer_model(name_or_path: str, revision: str | None, trust_remote_code: bool) -> Any:
    """The model with a single decoder layer, on the meta device."""
    from sft_play.planner.shapes import build_meta_model, load_model_config, with_layers

    return build_meta_model(with_layers(load_model_config(name_or_path, revision, trust_remote_code), 1),
                            trust_remote_code)


def _prepared_layer(spec: TraceSpec) -> tuple[Any, Any, Any, torch.dtype]:
    """(decoder layer, final norm, text config, residual dtype) for `spec`, ready to trace."""
    from sft_play.planner.shapes import decoder_layers

    model = copy.deepcopy(_one_layer_model(spec.name_or_path, spec.revision, spec.trust_remote_code))
    weights = DTYPES[spec.weights_dtype]
    model.to(weights)
    if spec.method != "full":
        from peft import LoraConfig, get_peft_model

        targets = spec.lora_targets if isinstance(spec.lora_targets, str) else list(spec.lora_targets)
        lora = LoraConfig(task_type="CAUSAL_LM", r=spec.lora_rank, target_modules=targets, init_lora_weights=False,
                          lora_dropout=0.1 if spec.lora_dropout else 0.0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = get_peft_model(model, lora, low_cpu_mem_usage=True).get_base_model()
        adapter = DTYPES[spec.adapter_dtype]
        for param in model.parameters():
            if param.requires_grad:
                param.data = torch.empty(param.shape, dtype=adapter, device="meta")
    else:
        model.requires_grad_(True)
    model.train()
    text = model.config.get_text_config()
    text._attn_implementation = _FLASH_TRACE if spec.attention == "flash_attention_2" else spec.attention
    if spec.checkpointing:
        recompute = functools.partial(_Autocast, DTYPES[spec.compute_dtype] if spec.compute_dtype else None, False)
        model.activation_checkpointing_enable(
            {"use_reentrant": False, "context_fn": lambda: (contextlib.nullcontext(), recompute())})
    layers = decoder_layers(model, 1)
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")
    norm = _final_norm(model, layers[0])
    return layers[0], norm, text, weights


def _final_norm(model: Any, layer: Any) -> Any | None:
    """The norm applied to the last hidden state: the last module of the backbone outside the
    decoder layers whose name ends in 'norm'."""
    inside = {id(m) for m in layer.modules()}
    norms = [m for name, m in model.named_modules()
             if id(m) not in inside and name.split(".")[-1] in ("norm", "final_layernorm", "ln_f", "norm_f")]
    return norms[-1] if norms else None


def _head_dim(text: Any) -> int:
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


def _trace_once(spec: TraceSpec, prepared: tuple, micro_batch: int, seq_len: int) -> dict[str, int]:
    layer, norm, text, residual = prepared
    layer.zero_grad(set_to_none=True)
    params = {t.untyped_storage()._cdata for t in [*layer.parameters(), *layer.buffers()]}
    if norm is not None:
        params |= {t.untyped_storage()._cdata for t in [*norm.parameters(), *norm.buffers()]}
    device = "meta"
    b, s, h = micro_batch, seq_len, text.hidden_size
    leaf = torch.empty(b, s, h, dtype=residual, device=device, requires_grad=True)
    positions = torch.arange(s, device=device).expand(b, s)
    cos = torch.empty(b, s, _head_dim(text), dtype=residual, device=device)
    sin = torch.empty_like(cos)
    mask = None
    if spec.masked and spec.attention != "flash_attention_2":
        # transformers builds a boolean [b, 1, s, s] mask for SDPA, a float one for eager attention
        mask = torch.empty(b, 1, s, s, dtype=torch.bool if spec.attention == "sdpa" else residual, device=device)
    inputs = [t for t in (leaf, cos, sin, positions, mask) if t is not None]
    tracker = _LiveBytes(params | {t.untyped_storage()._cdata for t in inputs})
    compute = DTYPES[spec.compute_dtype] if spec.compute_dtype else None
    autocast = _Autocast(compute)
    result: dict[str, int] = {}
    with tracker:
        with autocast:
            hidden = leaf * 1  # a non-leaf input: kept only if the layer saves it
            start = tracker.current
            out = layer(hidden, attention_mask=mask, position_embeddings=(cos, sin), position_ids=positions)
            out = out[0] if isinstance(out, tuple) else out
        result["forward_extra"] = tracker.peak - start
        result["cast_cache"] = autocast.cached_bytes()
        autocast.cache = None  # autocast's cache is cleared when the forward pass ends
        del hidden
        result["saved"] = tracker.current - out.untyped_storage().nbytes()
        incoming = torch.empty_like(out)
        tracker.reset_peak()
        start = tracker.current
        torch.autograd.backward(out, incoming)
        result["backward_extra"] = tracker.peak - start
        del out, incoming
        if norm is not None:
            before = tracker.current
            last = leaf * 1
            with _Autocast(compute):
                normed = norm(last)
            del last
            result["final_norm_saved"] = tracker.current - before - normed.untyped_storage().nbytes()
            grad = torch.empty_like(normed)
            tracker.reset_peak()
            start = tracker.current
            torch.autograd.backward(normed, grad)
            result["final_norm_backward_extra"] = tracker.peak - start
    return result


@functools.lru_cache(maxsize=64)
def layer_profile(spec: TraceSpec, seq_len: int) -> LayerProfile:
    """The activation profile of one decoder layer for `spec` at `seq_len` tokens per row (cached)."""
    _register_flash_trace()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = _prepared_layer(spec)
        one, two = (_trace_once(spec, prepared, micro, seq_len) for micro in (1, 2))
    fitted = {key: Coefficients.fit(one[key], two[key]) for key in one}
    zero = Coefficients()
    return LayerProfile(
        saved=fitted["saved"],
        forward_extra=fitted["forward_extra"],
        backward_extra=fitted["backward_extra"],
        cast_cache=fitted["cast_cache"],
        final_norm_saved=fitted.get("final_norm_saved", zero),
        final_norm_backward_extra=fitted.get("final_norm_backward_extra", zero),
    )


@functools.cache
def _register_flash_trace() -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS[_FLASH_TRACE] = _flash_attention_2
