"""What one decoder layer allocates through a training step, recorded by running the model's
own layer.

Rather than a formula per architecture, the planner runs one decoder layer of the real model
(transformers' module, with peft's LoRA wrappers, checkpointing and the precision recipe as
configured), and the model's final norm, forward and backward on the **meta device**, where
tensors have shapes and dtypes but no memory and every operation costs microseconds. A
dispatch mode records every storage an operation creates and, through weak references, when it
is released: the layer's allocations in order (:class:`ModuleEvents`), which
:mod:`sft_play.planner.simulate.step` chains layer to layer and replays through the caching allocator.

Traces at micro-batch 1 and 2 (and 3 where a single row takes fewer copies) give every
allocation's size as a function of the micro-batch at the run's sequence length, so the planner
never traces per micro-batch; four traces at lengths that are multiples of 1024 give it at every
other such length, where the operations stay the same (:mod:`sft_play.planner.simulate.lengths`).
Traces are cached per (model, method, precision, kernel, mask, checkpointing, sequence length);
three take about 0.1-0.3 s.

What a trace on the meta device cannot see is put in explicitly, each with its source:

- **autocast**: the meta device has no autocast, so :class:`_Autocast` applies CUDA autocast's
  rule (``aten/src/ATen/autocast_mode.cpp``): matmul-like functions take their floating inputs
  in the 16-bit dtype, and fp32 leaf tensors that require grad (weights) are cast once and
  cached for the rest of the forward pass.
- **the attention kernel**: on the meta device SDPA would take its math path and save the
  fp32 s x s probabilities, which CUDA's flash and memory-efficient kernels never keep.
  :class:`_FusedAttention` saves what those kernels save (q, k, v, the output and an fp32
  log-sum-exp per row; the memory-efficient kernel also the additive mask, converted from
  the boolean one per call, rows padded to 8: ``attention.cpp``
  ``convert_boolean_attn_mask``/``preprocess_mask``), and allocates in backward what their
  backward kernels allocate (:class:`_FusedAttention`). Eager attention runs its own code.
- **dropout**: CUDA's fused dropout keeps a boolean mask for backward; on the meta device
  dropout multiplies by a saved fp32 noise tensor instead (``aten/src/ATen/native/Dropout.cpp``,
  ``is_fused_kernel_acceptable``). :class:`_FusedDropout` keeps the mask.
- **bitsandbytes 4-bit linears** save no activation (``MatMul4Bit`` keeps only the packed
  weight) and de-quantise their weight for each matmul, in forward and backward
  (:class:`_FourBitMatmul`).

Parameters are not recorded (the planner counts them exactly); their gradients are.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import itertools
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only

from sft_play import long_rows, patches
from sft_play.adapters import LoraSpec, peft_config
from sft_play.architecture import (build_meta_model, config_identity, config_int, decoder_layers, experts,
                                   in_parts, is_sliding, layer_kinds, load_model_config, quantized_linears,
                                   sliding_window, with_layers)
from sft_play.planner.simulate import cache, lengths
from sft_play.run import MASK_FREE_ATTENTION, sliding_mask

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_FLASH_TRACE = "sft_play_flash_trace"


# An allocation ("a", id, bytes at the base micro-batch, bytes per further sample) or a release ("f", id, 0, 0).
# Ids are numbered in allocation order; INPUT and GRAD_IN name the tensors that exist before.
Event = tuple[str, int, float, float]
INPUT, GRAD_IN = -1, -2


@dataclass(frozen=True)
class ModuleEvents:
    """The allocations of one module (a decoder layer, or the final norm) through a training step.

    - ``forward``: its forward pass, once its input exists;
    - ``after_forward``: the caller dropping its reference to the input (which frees the input
      unless the module kept it for backward: ``input_kept``);
    - ``cache_release``: autocast's cache cleared when the model's forward pass ends;
    - ``backward``: its backward pass from the incoming gradient (``GRAD_IN``) until the gradient
      of its input (``input_grad``) is complete.
    ``output`` is the id of its output; ``persistent`` the ids allocated in backward and still
    alive at its end other than ``input_grad``: parameter gradients.
    """

    forward: tuple[Event, ...]
    after_forward: tuple[Event, ...]
    cache_release: tuple[Event, ...]
    backward: tuple[Event, ...]
    output: int
    input_grad: int
    input_kept: bool
    persistent: frozenset[int]
    base_micro: int = 1  # the micro-batch the sizes are given at

    def size(self, event: Event, micro: int) -> int:
        return int(event[2] + event[3] * (micro - self.base_micro))


@dataclass(frozen=True)
class LayerTrace:
    """The decoder layers' and the final norm's allocations at one sequence length: exactly at
    micro-batch 1, and as functions of the micro-batch from 2 on (at micro-batch 1 some copies
    do not happen: a tensor with a single row counts as contiguous whatever its strides).

    Hybrid models have layers of several kinds (attention, convolution, Mamba, linear
    attention): each kind is traced once, and ``pattern`` says which kind each layer is."""

    single: tuple[ModuleEvents, ModuleEvents | None]  # (the first layer's kind, final norm)
    batched: tuple[ModuleEvents | None, ModuleEvents | None]  # (None, None): traced at micro-batch 1 only
    kinds: tuple[tuple[ModuleEvents, ModuleEvents | None], ...] = ()  # (single, batched) of every kind, in order
    pattern: tuple[int, ...] = ()  # the kind of each layer; empty: every layer is the first's kind
    names: tuple[str, ...] = ()  # the kinds' names (layer_types), for the plan's notes

    def at(self, micro: int) -> tuple[ModuleEvents, ModuleEvents | None]:
        """(first layer's kind, final norm) events to replay at `micro`."""
        return self.single if micro == 1 else self.batched

    def layers_at(self, micro: int, count: int) -> list[ModuleEvents]:
        """The events of each of the `count` layers at `micro`."""
        if not self.pattern:
            return [self.at(micro)[0]] * count
        return [self.kinds[kind][0 if micro == 1 else 1] for kind in self.pattern]


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
    attention: str  # sdpa, flash_attention_2, flex_attention, eager
    masked: bool  # a 4-D attention mask is passed (packed rows or padding without FlashAttention-2)
    checkpointing: bool
    lora: LoraSpec | None = None  # the run's adapter (None for full fine-tuning)
    stand_in: bool = False  # trace a Llama-shaped layer of the model's widths (when its own cannot be traced)
    tiled_mlp: bool = False  # the MLP in tiles along the sequence (sft_play.long_rows.tile_mlps), as training runs it
    sequence_parallel: int = 1  # rows split across this many processes: attention through Ulysses (_ulysses)
    liger: bool = False  # Liger's kernels: its fused RMSNorm where Liger patches the model (_LigerRMSNorm)
    context_parallel: int = 1  # rows split across this many processes: torch's ring attention (_ring)
    residual_dtype: str | None = None  # the hidden states between the layers (None: the weights' dtype)


class _Recorder(TorchDispatchMode):
    """Records every storage an operation creates ("a", key, bytes) and its release ("f", key),
    through weak references to the storages; storages in `ignore` (parameters, inputs) are not
    recorded."""

    def __init__(self, ignore: set[int]):
        super().__init__()
        self.ignore = ignore
        self.events: list[tuple[str, int, int]] = []
        self._alive: dict[int, Any] = {}

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self.ignore or key in self._alive:
            return
        self.events.append(("a", key, storage.nbytes()))

        def released(_ref: Any, key: int = key) -> None:
            self.events.append(("f", key, 0))
            self._alive.pop(key, None)

        self._alive[key] = weakref.ref(storage, released)

    def cut(self) -> list[tuple[str, int, int]]:
        """The events since the last cut."""
        events, self.events = self.events, []
        return events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if isinstance(result, torch.Tensor):
            self._track(result)
        else:  # (a tuple or list of tensors, or none: in order)
            for leaf in tree_leaves(result):
                if isinstance(leaf, torch.Tensor):
                    self._track(leaf)
        return result


class _NotRepeatable(Exception):
    """A tile of DeepSpeed's TiledMLP loop did something its copy would not: trace every tile."""


# The recorder of the module being traced (copied tiles add their events to it), and whether
# tiles are copied (a test traces without, to compare)
_RECORDING: list[_Recorder | None] = [None]
_REPEAT_TILES = [True]
_FRESH_KEYS = itertools.count(1)  # copied storages are named -1, -2, ... (real ones by their address)


@dataclass(frozen=True)
class _TileEvents:
    """The second tile's events, each storage named by its place in the tile's allocations:
    within its call (``inside``; its output allocated at ``output_at``, as slot
    ``output_slot``, laid out as ``layout``) and from its return to the next tile's call
    (``after``: its backward, in the backward pass)."""

    inside: tuple[tuple[str, int, int], ...]
    after: tuple[tuple[str, int, int], ...]
    output_at: int
    output_slot: int
    layout: tuple[torch.Size, tuple[int, ...], torch.dtype]


@dataclass
class _TilePass:
    """One pass of a TiledMLP loop: the forward (tiles without gradients) or the backward."""

    calls: int = 0
    outputs: list[int] = field(default_factory=list)  # the storage each tile returned
    second: tuple | None = None  # (events list, where its call began, where it returned, its tile's shape, layout)
    template: _TileEvents | None = None
    quiet_from: tuple[list, int] | None = None  # (events, position): a copy's end, after which nothing may happen

    def check_quiet(self, recorder: _Recorder, allowed: list | None = None) -> None:
        """Nothing was recorded since the last copy ended but `allowed`."""
        if self.quiet_from is not None:
            events, position = self.quiet_from
            if events is not recorder.events or events[position:] != (allowed or []):
                raise _NotRepeatable("an event between tiles that the copy did not make")
            self.quiet_from = None

    def make_template(self, recorder: _Recorder, grad: bool) -> _TileEvents:
        events, begin, returned, _, layout = self.second
        if events is not recorder.events:
            raise _NotRepeatable("the trace moved on between tiles")
        inside, after = events[begin:returned], events[returned:]
        if after and after[0] == ("f", self.outputs[0], 0):  # the first tile's output, dropped at the second's return
            after = after[1:]
        if after and not grad:
            raise _NotRepeatable("an event between tiles of the forward")
        slots: dict[int, int] = {}  # a storage's address -> its allocation's place (an address can serve again)
        alive: set[int] = set()
        named, output_at, allocated = [], -1, 0
        for position, (kind, key, size) in enumerate(inside + after):
            if kind == "a":
                slots[key], allocated = allocated, allocated + 1
                alive.add(key)
                if key == self.outputs[1] and position < len(inside):
                    output_at = position
            elif key in alive:
                alive.discard(key)
            else:
                raise _NotRepeatable("a tile released what an earlier one made")
            named.append((kind, slots[key], size))
        if output_at < 0 or alive != {self.outputs[1]}:
            raise _NotRepeatable("a tile kept more than its output")
        self.template = _TileEvents(tuple(named[:len(inside)]), tuple(named[len(inside):]), output_at,
                                    slots[self.outputs[1]], layout)
        return self.template


def _emit(recorder: _Recorder, events: tuple[tuple[str, int, int], ...], keys: dict[int, int]) -> None:
    for kind, slot, size in events:
        if kind == "a":
            keys[slot] = -next(_FRESH_KEYS)
        recorder.events.append((kind, keys[slot], size))


def _copied_call(recorder: _Recorder, template: _TileEvents, device: torch.device) -> tuple[torch.Tensor, dict]:
    """The template's events within its call, with a real output allocated where it was."""
    keys: dict[int, int] = {}
    _emit(recorder, template.inside[:template.output_at], keys)
    shape, stride, dtype = template.layout
    output = torch.empty_strided(shape, stride, dtype=dtype, device=device)
    keys[template.output_slot] = output.untyped_storage()._cdata
    if recorder.events[-1] != ("a", keys[template.output_slot], template.inside[template.output_at][2]):
        raise _NotRepeatable("the output's storage differs from the tile's")
    _emit(recorder, template.inside[template.output_at + 1:], keys)
    return output, keys


class _CopiedTile(torch.autograd.Function):
    """A tile of the backward pass, copied: its recomputation's events in forward, its backward's
    in backward (after the previous tile's output was dropped, as the loop drops it)."""

    @staticmethod
    def forward(ctx, tile, loop, template):
        ctx.loop, ctx.template = loop, template
        output, ctx.keys = _copied_call(_RECORDING[0], template, tile.device)
        return output

    @staticmethod
    def backward(ctx, _grad):
        recorder, loop = _RECORDING[0], ctx.loop
        loop.check_quiet(recorder, [("f", loop.outputs[-2], 0)])
        _emit(recorder, ctx.template.after, ctx.keys)
        loop.quiet_from = (recorder.events, len(recorder.events))
        return None, None, None


class _RepeatedTiles:
    """What each tile of one TiledMLP loop calls, for the trace (:func:`long_rows.tile_mlps`'s
    ``per_tile``). DeepSpeed's loop runs every tile without gradients in forward, then each again
    with its backward. The first two tiles of a pass run; a later tile of the second's shape does
    not: the second's events are recorded again under fresh storage names, and a real tensor of
    its output's shape is handed back, so that the loop and autograd go on as they would. A long
    row has hundreds of tiles of hundreds of operations each through the tracer's modes, all
    allocating the same (traced in full, they were most of a long row's planning). Anything the
    copy would not repeat exactly (the second tile keeping more than its output, an event between
    tiles the copy did not make) raises :class:`_NotRepeatable`, and the module is traced again
    with every tile run (:func:`_trace_module`)."""

    def __init__(self, fn: Any, _tiles: int):
        self.fn = fn
        self.passes = {False: _TilePass(), True: _TilePass()}

    def __call__(self, module: Any, tile: torch.Tensor) -> torch.Tensor:
        recorder, grad = _RECORDING[0], torch.is_grad_enabled()
        if recorder is None or not _REPEAT_TILES[0]:
            return self.fn(module, tile)
        loop = self.passes[grad]
        index, loop.calls = loop.calls, loop.calls + 1
        loop.check_quiet(recorder)
        if index < 2 or tile.shape != loop.second[3]:
            begin = len(recorder.events)
            output = self.fn(module, tile)
            loop.outputs.append(output.untyped_storage()._cdata)
            if index == 1:
                loop.second = (recorder.events, begin, len(recorder.events), tile.shape,
                               (output.shape, output.stride(), output.dtype))
            return output
        template = loop.template or loop.make_template(recorder, grad)
        if grad:
            output = _CopiedTile.apply(tile, loop, template)
        else:
            output, _ = _copied_call(recorder, template, tile.device)
        loop.outputs.append(output.untyped_storage()._cdata)
        loop.quiet_from = (recorder.events, len(recorder.events))
        return output


def _pad(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class _FusedAttention(torch.autograd.Function):
    """Stands in for CUDA's fused attention kernels: saves and allocates what they do. Inputs
    and output are in SDPA's layout, [batch, heads, seq, head_dim], stored as [batch, seq, heads,
    head_dim] like the kernels' output.

    Without a bias, FlashAttention-2 (``mha_fwd``/``mha_bwd``, also SDPA's flash backend): saves
    q, k, v (k, v at their own heads), the output and an fp32 log-sum-exp [b, h, s]; backward
    allocates dq, dk, dv, ``softmax_d`` fp32 [b, h, s rounded to 128], ``dq_accum`` fp32 [b, s
    rounded to 128, h, d rounded to 32] and, for grouped-query attention, dk and dv at query
    heads before the group sum. With a bias, the memory-efficient kernel
    (``_efficient_attention_forward``/``_backward``): saves the bias too and a log-sum-exp padded
    to 32 rows; backward allocates dq, dk, dv, ``delta`` fp32 [b, h, s] and an fp32 dq
    accumulator (``kNeedsAccumGradQ``, the size of dq in fp32).
    """

    @staticmethod
    def forward(ctx, query, key, value, bias):
        b, heads, s, d = query.shape
        out = torch.empty((b, s, heads, d), dtype=query.dtype, device=query.device).transpose(1, 2)
        lse = torch.empty((b, heads, _pad(s, 32) if bias is not None else s), dtype=torch.float32, device=query.device)
        ctx.save_for_backward(query, key, value, out, lse, bias)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, _out, _lse, bias = ctx.saved_tensors
        b, heads, s, d = query.shape
        device = query.device
        dq, dk, dv = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
        if bias is not None:
            _delta = torch.empty((b, heads, s), dtype=torch.float32, device=device)
            _accumulator = torch.empty((b, s, heads, d), dtype=torch.float32, device=device)
        else:
            _softmax_d = torch.empty((b, heads, _pad(s, 128)), dtype=torch.float32, device=device)
            _accumulator = torch.empty((b, _pad(s, 128), heads, _pad(d, 32)), dtype=torch.float32, device=device)
            if key.shape[1] != heads:
                _dk_expanded = torch.empty((b, s, heads, d), dtype=key.dtype, device=device)
                _dv_expanded = torch.empty((b, s, heads, d), dtype=value.dtype, device=device)
        return dq, dk, dv, None


def _fused_sdpa(query, key, value, attn_mask=None, **_ignored):
    """``F.scaled_dot_product_attention`` as CUDA runs it for training (flash without a mask,
    memory-efficient with one)."""
    bias = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:  # convert_boolean_attn_mask: where(mask, 0, -inf) in q's dtype
            zero = torch.zeros((), dtype=query.dtype, device=query.device)
            attn_mask = torch.where(attn_mask, zero, float("-inf")).to(query.dtype)
        columns = attn_mask.shape[-1]
        if columns % 8:  # preprocess_mask: pad_bias<8> when the rows are not aligned
            attn_mask = F.pad(attn_mask, (0, 8 - columns % 8))[..., :columns]
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


class _FourBitMatmul(torch.autograd.Function):
    """bitsandbytes' ``MatMul4Bit`` as training runs it on CUDA (many rows): the 4-bit weight is
    de-quantised to the input's dtype for the matmul (``dequantize_4bit`` + ``F.linear``, the
    path ``gemm_4bit`` takes past its custom-kernel sizes) and again in backward; nothing but the
    packed weight is kept."""

    @staticmethod
    def forward(ctx, input, weight):
        ctx.save_for_backward(weight)
        dequantized = torch.empty(weight.shape, dtype=input.dtype, device=input.device)
        return F.linear(input, dequantized)

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        dequantized = torch.empty(weight.shape, dtype=grad.dtype, device=grad.device)
        return grad @ dequantized, None


def _four_bit_linear(linear: Any, input: torch.Tensor) -> torch.Tensor:
    # peft's LoRA wrapper for 4-bit layers clones the base output before adding the adapter
    out = _FourBitMatmul.apply(input, linear.weight)
    return (out + linear.bias if linear.bias is not None else out).clone()


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


@functools.lru_cache(maxsize=8)
def _one_layer_model(name_or_path: str, revision: str | None, trust_remote_code: bool, kind: str | None = None,
                     stand_in: bool = False) -> Any:
    """The model with a single decoder layer (of `kind`, for hybrid models), on the meta device;
    with `stand_in`, a Llama-shaped one of the model's widths (:func:`stand_in_config`)."""
    model_config = load_model_config(name_or_path, revision, trust_remote_code)
    if stand_in:
        return build_meta_model(stand_in_config(model_config))
    return build_meta_model(with_layers(model_config, 1, kind), trust_remote_code)


def stand_in_config(model_config: Any) -> Any:
    """A one-layer Llama config with the model's hidden size, heads, head size and vocabulary,
    and an MLP as wide as what one token passes through in the model's: the intermediate size,
    or for a mixture of experts top-k experts' widths plus the shared expert's."""
    from transformers import LlamaConfig

    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    hidden = config_int(text, "hidden_size", "n_embd", "d_model")
    heads = config_int(text, "num_attention_heads", "n_head", default=1)
    width = config_int(text, "intermediate_size", "n_inner", "ffn_dim", default=4 * hidden)
    routed, per_token = experts(model_config)
    if routed:
        expert = config_int(text, "moe_intermediate_size", "expert_intermediate_size", default=width)
        shared = config_int(text, "shared_expert_intermediate_size", default=0)
        width = per_token * expert + shared
    return LlamaConfig(hidden_size=hidden, intermediate_size=width, num_hidden_layers=1, num_attention_heads=heads,
                       num_key_value_heads=config_int(text, "num_key_value_heads", "num_kv_heads", default=heads),
                       head_dim=config_int(text, "head_dim", default=hidden // max(1, heads)),
                       vocab_size=config_int(text, "vocab_size", default=32000), tie_word_embeddings=False)


def _prepared_layer(spec: TraceSpec, kind: str | None = None) -> tuple[Any, Any, Any, torch.dtype]:
    """(decoder layer, final norm, text config, residual dtype) for `spec`, ready to trace."""
    model = copy.deepcopy(_one_layer_model(spec.name_or_path, spec.revision, spec.trust_remote_code, kind,
                                           spec.stand_in))
    weights = DTYPES[spec.weights_dtype]
    model = with_method(model, spec)
    if spec.method == "full":
        model.requires_grad_(True)
    model.train()
    text = model.config.get_text_config()
    # Experts through transformers' grouped path, whose shapes do not depend on the routing: every
    # token's top-k rows pass through the experts however they are spread (the per-expert loop
    # keeps the same rows for backward). On the meta device the grouped GEMM is transformers'
    # own fallback op, which has a shape function (torch's kernel takes bf16 only).
    if hasattr(text, "_experts_implementation"):
        text._experts_implementation = "grouped_mm"
    # Flex attention is traced as FlashAttention-2: a fused kernel that keeps q, k, v, the output
    # and the log-sum-exp for backward and no s x s mask (its block mask is O((s/128)^2))
    text._attn_implementation = _FLASH_TRACE if spec.attention in MASK_FREE_ATTENTION else spec.attention
    if spec.sequence_parallel > 1:
        text._attn_implementation = _register_split(text._attn_implementation, _ulysses, spec.sequence_parallel)
    elif spec.context_parallel > 1:
        text._attn_implementation = _register_split(text._attn_implementation, _ring, spec.context_parallel)
    if spec.checkpointing:
        recompute = functools.partial(_Autocast, DTYPES[spec.compute_dtype] if spec.compute_dtype else None, False)
        model.activation_checkpointing_enable(
            {"use_reentrant": False, "context_fn": lambda: (contextlib.nullcontext(), recompute())})
    layers = decoder_layers(model, 1)
    if layers is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")
    if spec.tiled_mlp:  # the run's own tiling, traced: each tile's intermediates, forward and backward
        long_rows.tile_mlps(layers, text.hidden_size, _RepeatedTiles)
    norm = _final_norm(model, layers[0])
    if spec.liger and getattr(text, "model_type", None) in LIGER_RMS_NORM_MODELS:
        for module in [*layers[0].modules(), *([norm] if norm is not None else [])]:
            if type(module).__name__.endswith("RMSNorm") and getattr(module, "weight", None) is not None:
                module.forward = functools.partial(_liger_rms_norm, module)
    return layers[0], norm, text, DTYPES[spec.residual_dtype] if spec.residual_dtype else weights


def with_method(model: Any, spec: TraceSpec, unquantised: tuple[str, ...] = ()) -> Any:
    """`model` (on the meta device) as `spec`'s method trains it: in its weights dtype, its linears
    4-bit under QLoRA (but those under the module paths `unquantised`), LoRA's adapters added in
    their dtype; under full fine-tuning the caller says what trains."""
    model.to(DTYPES[spec.weights_dtype])
    if spec.method == "qlora":
        for name, linear in quantized_linears(model):
            if not in_parts(name, unquantised):
                linear.forward = functools.partial(_four_bit_linear, linear)
    if spec.method == "full":
        return model
    from peft import get_peft_model

    lora = peft_config(spec.lora or LoraSpec(16, 32, 0.0, "all-linear"), initialise=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(model, lora, low_cpu_mem_usage=True).get_base_model()
    adapter = DTYPES[spec.adapter_dtype]
    for param in model.parameters():
        if param.requires_grad:
            param.data = torch.empty(param.shape, dtype=adapter, device="meta")
    return model


def _final_norm(model: Any, layer: Any) -> Any | None:
    """The norm applied to the last hidden state: the last module outside the decoder layers
    named as transformers names final norms, else the last whose name ends in 'norm' (LFM2's
    ``embedding_norm``, applied after its layers; GPT-NeoX's ``final_layer_norm``)."""
    inside = {id(m) for m in layer.modules()}
    outside = [(name.split(".")[-1], m) for name, m in model.named_modules() if id(m) not in inside]
    norms = ([m for name, m in outside if name in ("norm", "final_layernorm", "ln_f", "norm_f")]
             or [m for name, m in outside if name.endswith("norm") and not any(True for _ in m.children())])
    return norms[-1] if norms else None


def _head_dim(text: Any) -> int:
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


class _Seed(torch.autograd.Function):
    """Ends a traced module's output in a scalar whose backward creates the incoming gradient, so
    that only autograd holds it (and frees it when it is used, as in the whole model)."""

    @staticmethod
    def forward(ctx, output):
        ctx.like = (output.shape, output.dtype, output.device)
        return output.new_empty(())

    @staticmethod
    def backward(ctx, _grad):
        shape, dtype, device = ctx.like
        grad = torch.empty(shape, dtype=dtype, device=device)
        ctx.seeded = grad.untyped_storage()._cdata
        _SEEDED.append(ctx.seeded)
        return grad


_SEEDED: list[int] = []


def _record(module: Any, call, recorder: _Recorder, autocast: _Autocast, leaf: torch.Tensor) -> dict[str, Any]:
    """Run `call(module, input)` forward and backward under `recorder`; the raw events by phase.
    The input is a copy of `leaf` that only the module can keep alive."""
    hidden = leaf * 1
    input_key = hidden.untyped_storage()._cdata
    fired: dict[str, Any] = {}

    def on_input_grad(grad: torch.Tensor) -> None:
        fired["at"] = len(recorder.events)
        fired["key"] = grad.untyped_storage()._cdata

    hidden.register_hook(on_input_grad)
    recorder.cut()
    with autocast:
        out = call(module, hidden)
    forward = recorder.cut()
    keys = {"input": input_key, "output": out.untyped_storage()._cdata}
    autocast.cache = None  # autocast clears its cache when the forward pass ends
    cache_release = recorder.cut()
    del hidden
    after_forward = recorder.cut()
    seed = _Seed.apply(out)
    del out  # the output's lifetime is the caller's (the next layer's input)
    start = torch.ones((), dtype=seed.dtype, device=seed.device)
    recorder.cut()
    _SEEDED.clear()
    seed.backward(start)
    # What follows the input's gradient is the trace's own scaffolding (the leaf behind the input)
    backward = recorder.cut()[: fired["at"]]
    keys["grad_in"] = _SEEDED[0]
    keys["input_grad"] = fired["key"]
    # The incoming gradient exists before the module's backward: its allocation only names it
    # (only the first: once freed, its address can serve a later allocation)
    first = next(i for i, (kind, key, _) in enumerate(backward) if kind == "a" and key == keys["grad_in"])
    backward[first] = ("bind", *backward[first][1:])
    return {"forward": forward, "cache_release": cache_release, "after_forward": after_forward,
            "backward": backward, "keys": keys}


def _numbered(raw: dict[str, Any]) -> tuple[dict[str, list], dict[str, int], set[int]]:
    """Storage keys replaced by ids in allocation order (the same in every trace of one spec).
    A storage's address can be reused once it is freed, so names are resolved as they occur."""
    ids = {raw["keys"]["input"]: INPUT}
    named: dict[str, int] = {}
    phases: dict[str, list] = {}
    alive: set[int] = set()
    count = 0
    for phase in ("forward", "cache_release", "after_forward", "backward"):
        events = []
        for kind, key, size in raw[phase]:
            if kind == "bind":
                ids[key] = GRAD_IN
                continue
            if kind == "a":
                ids[key] = count
                count += 1
                alive.add(ids[key])
            elif key in ids:
                alive.discard(ids[key])
            else:
                continue
            events.append((kind, ids[key], size))
            if kind == "a" and key == raw["keys"]["input_grad"] and phase == "backward":
                named["input_grad"] = ids[key]
        phases[phase] = events
        if phase == "forward":
            named["output"] = ids.get(raw["keys"]["output"], -3)
    if "input_grad" not in named and raw["keys"]["input_grad"] in (raw["keys"]["grad_in"], None):
        # the gradient passed on in place (Liger's RMSNorm), or none handed on (the vision encoder)
        named["input_grad"] = GRAD_IN
    return phases, named, alive


def _module_events(one: dict[str, Any], two: dict[str, Any], base: int) -> ModuleEvents:
    """Events with sizes affine in the micro-batch, from traces at micro-batch `base` and `base` + 1."""
    (phases1, named, alive), (phases2, _, _) = _numbered(one), _numbered(two)
    merged = {}
    for phase, events in phases1.items():
        other = phases2[phase]
        if [e[:2] for e in events] != [e[:2] for e in other]:
            raise ValueError(f"the {phase} pass differs between micro-batch {base} and {base + 1}: cannot scale it")
        merged[phase] = tuple((kind, i, float(size), float(size2 - size)) for (kind, i, size), (_, _, size2)
                              in zip(events, other))
    forward_ids = {i for kind, i, *_ in merged["forward"] if kind == "a"}
    backward_ids = {i for kind, i, *_ in merged["backward"] if kind == "a"}
    kept = not any(kind == "f" and i == INPUT for kind, i, *_ in merged["after_forward"])
    return ModuleEvents(
        forward=merged["forward"],
        after_forward=merged["after_forward"],
        cache_release=merged["cache_release"],
        backward=merged["backward"],
        output=named["output"],
        input_grad=named["input_grad"],
        input_kept=kept,
        persistent=frozenset((alive & backward_ids) - {named["input_grad"]} - forward_ids),
        base_micro=base,
    )


def _trace_module(spec: TraceSpec, prepared: tuple, micro_batch: int, seq_len: int, which: str,
                  sliding: bool = False) -> dict[str, Any]:
    layer, norm, text, residual = prepared
    for part in (layer, norm):
        if part is not None:
            part.zero_grad(set_to_none=True)
    module = layer if which == "layer" else norm
    ignore = {t.untyped_storage()._cdata for m in (layer, norm) if m is not None
              for t in [*m.parameters(), *m.buffers()]}
    device = "meta"
    b, s, h = micro_batch, seq_len, text.hidden_size
    leaf = torch.empty(b, s, h, dtype=residual, device=device, requires_grad=True)
    positions = torch.arange(s, device=device).expand(b, s)
    cos = torch.empty(b, s, _head_dim(text), dtype=residual, device=device)
    sin = torch.empty_like(cos)
    mask = None
    if spec.masked and spec.attention not in MASK_FREE_ATTENTION and _is_attention_layer(layer):
        # transformers builds a boolean [b, 1, s, s] mask for SDPA, a float one for eager attention
        mask = torch.empty(b, 1, s, s, dtype=torch.bool if spec.attention == "sdpa" else residual, device=device)
    elif sliding and _is_attention_layer(layer):  # the window's boolean mask (run.sliding_mask)
        mask = torch.empty(b, 1, s, s, dtype=torch.bool, device=device)
    ignore |= {t.untyped_storage()._cdata for t in (leaf, cos, sin, positions, mask) if t is not None}
    recorder = _Recorder(ignore)
    compute = DTYPES[spec.compute_dtype] if spec.compute_dtype else None

    def call(module: Any, hidden: torch.Tensor) -> torch.Tensor:
        if which == "norm":
            return module(hidden)
        out = module(hidden, attention_mask=mask, position_embeddings=(cos, sin), position_ids=positions)
        return out[0] if isinstance(out, tuple) else out

    # Releases must follow reference counts alone: no cyclic collection in the middle of a trace
    collecting = gc.isenabled()
    gc.disable()
    _RECORDING[0] = recorder
    try:
        with recorder:
            return _record(module, call, recorder, _Autocast(compute), leaf)
    except _NotRepeatable:
        if not _REPEAT_TILES[0]:
            raise
        _REPEAT_TILES[0] = False
        try:
            return _trace_module(spec, prepared, micro_batch, seq_len, which, sliding)
        finally:
            _REPEAT_TILES[0] = True
    finally:
        _RECORDING[0] = None
        if collecting:
            gc.enable()


def layer_trace(spec: TraceSpec, seq_len: int, batched: bool = True) -> LayerTrace:
    """The allocations of the decoder layers (each kind once) and of the final norm for `spec` at
    `seq_len` tokens per row, with sizes as functions of the micro-batch (cached in this process,
    and on disk: :mod:`sft_play.planner.simulate.cache`), derived from the traces of the same
    layer at other lengths where they fix it (:mod:`sft_play.planner.simulate.lengths`). Without
    `batched`, at micro-batch 1 only: half the tracing, for plans of one row per GPU (``make plan
    LONGEST=1``), unless the whole trace was made already."""
    if not batched and (spec, seq_len, True) in _TRACES:
        return _TRACES[spec, seq_len, True]
    if (spec, seq_len, batched) not in _TRACES:
        if len(_TRACES) >= 64:
            _TRACES.clear()
        identity = config_identity(spec.name_or_path, spec.revision, spec.trust_remote_code)
        layer = (spec, batched, identity)
        found = cache.remembered("trace" if batched else "trace-single", (spec, seq_len, identity),
                                 lambda: _derived(layer, seq_len) or _traced(spec, seq_len, batched),
                                 keep=cache.keeps(spec.name_or_path, spec.trust_remote_code))
        if not spec.tiled_mlp and seq_len % lengths.STEP == 0:
            if len(_AT_LENGTHS) >= 32:
                _AT_LENGTHS.clear()
            _AT_LENGTHS.setdefault(layer, {})[seq_len] = found
        _TRACES[spec, seq_len, batched] = found
    return _TRACES[spec, seq_len, batched]


_TRACES: dict[tuple[TraceSpec, int, bool], LayerTrace] = {}
# This process's traces by length, per (spec, batched, the model config's identity)
_AT_LENGTHS: dict[tuple[TraceSpec, bool, Any], dict[int, LayerTrace]] = {}
_ONE_ROW: dict[tuple, dict[str, Any]] = {}  # the raw events of a module at micro-batch 1, for the whole trace


def _derived(layer: tuple[TraceSpec, bool, Any], seq_len: int) -> LayerTrace | None:
    """The trace at `seq_len` from this process's traces of the same layer at other lengths
    (:func:`sft_play.planner.simulate.lengths.derived`) where they fix it: of the same regime
    (tiled MLPs never: the tiles' count and size move with the length; a window's mask from the
    window's length on)."""
    spec = layer[0]
    if spec.tiled_mlp:
        return None
    regime = _windowed(spec, seq_len)
    known = {s: t for s, t in _AT_LENGTHS.get(layer, {}).items() if _windowed(spec, s) == regime}
    return lengths.derived(known, seq_len)


def _windowed(spec: TraceSpec, seq_len: int) -> bool:
    """Whether the sliding-window layers take a mask of their own at `seq_len` (:func:`_traced`)."""
    if spec.stand_in:
        return False
    window = sliding_window(load_model_config(spec.name_or_path, spec.revision, spec.trust_remote_code))
    return sliding_mask(spec.attention, spec.masked, window, seq_len)


def _traced(spec: TraceSpec, seq_len: int, batched: bool = True) -> LayerTrace:
    _register_flash_trace()
    model_config = load_model_config(spec.name_or_path, spec.revision, spec.trust_remote_code)
    # Sliding-window layers that take a mask the others do not are traced as a kind of their own
    windowed = not spec.stand_in and sliding_mask(spec.attention, spec.masked, sliding_window(model_config), seq_len)
    kinds = [] if spec.stand_in else layer_kinds(model_config, windows=windowed)
    names = tuple(dict.fromkeys(kinds)) if kinds else (None,)
    traced, norm = [], (None, None)
    with warnings.catch_warnings(), patches.meta_compatible():
        warnings.simplefilter("ignore")
        for position, kind in enumerate(names):
            prepared = _prepared_once(spec, kind)
            sliding = windowed and is_sliding(model_config, kind)
            try:
                for which in ("layer", "norm") if position == 0 and prepared[1] is not None else ("layer",):
                    events = _module_traced(spec, prepared, seq_len, kind, which, sliding, batched)
                    if which == "layer":
                        traced.append(events)
                    else:
                        norm = events
            except BaseException:  # (a trace that failed part-way: the layer is made again next time)
                _PREPARED.pop((spec, kind), None)
                raise
    pattern = tuple(names.index(kind) for kind in kinds) if len(names) > 1 else ()
    return LayerTrace((traced[0][0], norm[0]), (traced[0][1], norm[1]), tuple(traced), pattern,
                      tuple(name for name in names if name))


def _module_traced(spec: TraceSpec, prepared: tuple, seq_len: int, kind: str | None, which: str, sliding: bool,
                   batched: bool) -> tuple[ModuleEvents, ModuleEvents | None]:
    """The layer's or the norm's events at one row and, `batched`, at more."""
    # (kept for a whole trace of the same layer: a plan asks for micro-batch 1 first)
    one = _ONE_ROW.pop((spec, seq_len, kind, which), None) or _trace_module(spec, prepared, 1, seq_len, which, sliding)
    if not batched:
        if len(_ONE_ROW) >= 16:
            _ONE_ROW.clear()
        _ONE_ROW[spec, seq_len, kind, which] = one
        return _module_events(one, one, 1), None
    two = _trace_module(spec, prepared, 2, seq_len, which, sliding)
    try:  # the same operations at 1 and 2 rows: one description for every micro-batch
        scaled = _module_events(one, two, 1)
        return scaled, scaled
    except ValueError:
        three = _trace_module(spec, prepared, 3, seq_len, which, sliding)
        return _module_events(one, one, 1), _module_events(two, three, 2)


# This process's layers made ready to trace, by (spec, kind): a plan traces a layer at several
# lengths, and making one (a copy of the one-layer model, peft's adapters) cost about as much as
# tracing it; a trace leaves it as it found it (its gradients are cleared before the next)
_PREPARED: dict[tuple[TraceSpec, str | None], tuple] = {}


def _prepared_once(spec: TraceSpec, kind: str | None) -> tuple[Any, Any, Any, torch.dtype]:
    if (spec, kind) not in _PREPARED:
        if len(_PREPARED) >= 8:
            _PREPARED.clear()
        _PREPARED[spec, kind] = _prepared_layer(spec, kind)
    return _PREPARED[spec, kind]


def _is_attention_layer(layer: Any) -> bool:
    """Whether a decoder layer attends (and so takes the 4-D mask): it holds a module with
    ``q_proj`` (or a fused ``qkv_proj``) and no state-space or convolution mixer in its place."""
    return any(hasattr(module, "q_proj") or hasattr(module, "qkv_proj") or hasattr(module, "c_attn")
               for module in layer.modules())


# The model types whose RMSNorm Liger replaces by its fused kernel with Llama's casting (only the
# inverse RMS in fp32), gradient written over the incoming one: liger_kernel.transformers.monkey_patch's
# MODEL_TYPE_TO_APPLY_LIGER_FN, which transformers' use_liger_kernel applies. Gemma's norms (fp32
# throughout, not in place) and other models are traced as their own: an upper bound there.
LIGER_RMS_NORM_MODELS = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "phi3")
SM_COUNT = 132  # an H100's multiprocessors: Liger's weight-gradient partials are [SMs, hidden] fp32


class _LigerRMSNorm(torch.autograd.Function):
    """Liger's fused RMSNorm (``liger_kernel.ops.rms_norm.LigerRMSNormFunction``) as it allocates:
    in forward the output and an fp32 inverse RMS per row, keeping the input; in backward an fp32
    [SMs, hidden] partial of the weight's gradient, the input's gradient written over the incoming
    one. Where the model's own norm computes in fp32 ([tokens, hidden] fp32 temporaries, several
    alive in backward), this keeps none."""

    @staticmethod
    def forward(ctx, hidden, weight):
        rows = hidden.numel() // hidden.shape[-1]
        ctx.save_for_backward(hidden, weight, torch.empty(rows, dtype=torch.float32, device=hidden.device))
        return torch.empty_like(hidden)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, _inverse_rms = ctx.saved_tensors
        partial = torch.empty((SM_COUNT, hidden.shape[-1]), dtype=torch.float32, device=grad.device)
        weight_grad = partial.sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad, weight_grad


def _liger_rms_norm(norm: Any, hidden: torch.Tensor) -> torch.Tensor:
    return _LigerRMSNorm.apply(hidden, norm.weight)


class _AllToAll(torch.autograd.Function):
    """An all-to-all across the processes that split a row (DeepSpeed's ``_DimZeroAllToAll``): a
    new tensor of its input's size, in forward and again for the gradient in backward."""

    @staticmethod
    def forward(ctx, input):
        return torch.empty_like(input)

    @staticmethod
    def backward(ctx, grad):
        return torch.empty_like(grad)


def _ulysses(core: Any, split: int) -> Any:
    """transformers' attention function `core` as DeepSpeed's Ulysses wraps it for rows split
    across `split` processes (``ulysses_sp.UlyssesSPAttentionHF.forward``), its copies and
    all-to-alls step for step: each process's q, k, v ([rows, heads, tokens / split, head_dim];
    key/value heads repeated up to `split` where they are fewer) become [rows, heads / split,
    tokens, head_dim], `core` attends over the whole row without a mask, and the output returns to
    the process's share of the tokens."""

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        b, heads, local, d = query.shape

        def combine(x: torch.Tensor) -> torch.Tensor:
            x = x.permute(2, 0, 1, 3)  # [local, b, heads, d], a view
            if x.shape[2] < split:  # MQA / GQA: heads copied so that each process gets one
                x = x.repeat_interleave(split // x.shape[2], dim=2)
            x = x.reshape(local, b, split, x.shape[2] // split, d).permute(2, 0, 1, 3, 4).contiguous()
            x = _AllToAll.apply(x).reshape(split * local, b, x.shape[3], d)
            return x.permute(1, 2, 0, 3).contiguous()  # [b, heads / split, tokens, d]

        q, k, v = combine(query), combine(key), combine(value)
        if hasattr(module, "num_key_value_groups"):  # as Ulysses sets it after repeating the heads
            module.num_key_value_groups = q.shape[1] // k.shape[1]
        out, weights = core(module, q, k, v, None, *args, **kwargs)  # [b, tokens, heads / split, d]
        out = out.permute(1, 0, 2, 3).reshape(split, local, b, -1).contiguous()
        out = _AllToAll.apply(out).permute(1, 2, 0, 3).reshape(local, b, -1)
        return out.permute(1, 0, 2).reshape(b, local, -1), weights

    return attention


class _GatherKeys(torch.autograd.Function):
    """Torch's ring attention with the all-gather strategy (``context_parallel``,
    ``cp_comm_strategy="allgather"``): a process's keys or values gathered from every process of
    the ring, [rows, heads, tokens, head_dim], and in backward their gradient reduce-scattered back
    to its share."""

    @staticmethod
    def forward(ctx, share, shards):
        ctx.shards = shards
        b, heads, local, d = share.shape
        return share.new_empty((b, heads, local * shards, d))

    @staticmethod
    def backward(ctx, grad):
        b, heads, tokens, d = grad.shape
        return grad.new_empty((b, heads, tokens // ctx.shards, d)), None


def _ring(core: Any, shards: int) -> Any:
    """transformers' attention function `core` under torch's context parallelism across `shards`
    processes: each process's queries (its share of the tokens) attend, causally and without a
    mask, to the keys and values of the whole row, gathered for the layer and dropped after it."""

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        return core(module, query, _GatherKeys.apply(key, shards), _GatherKeys.apply(value, shards), None,
                    *args, **kwargs)

    return attention


def _register_split(core_name: str, split: Any, shards: int) -> str:
    """Registers `core_name`'s attention as a split row runs it (`split`: :func:`_ulysses` or
    :func:`_ring`, across `shards` processes) for traces (in transformers' public registry); its
    name. The core is transformers' own function: a process that has trained with rows split has
    DeepSpeed's Ulysses in the shared registry's place of it (``register_with_transformers``)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    _register_flash_trace()
    name = f"sft_play{split.__name__}_{shards}_{core_name}"
    if name not in ALL_ATTENTION_FUNCTIONS:
        # (a new interface has no entries of its own: what it finds is what was registered with the
        # class, transformers' functions and the traces' own, not what a process put in its place,
        # DeepSpeed's wrapper or the run's patch for split rows)
        AttentionInterface.register(name, split(AttentionInterface()[core_name], shards))
    return name


@functools.cache
def _register_flash_trace() -> None:
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(_FLASH_TRACE, _flash_attention_2)
