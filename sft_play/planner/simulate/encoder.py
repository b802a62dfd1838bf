"""What a vision-language model's vision encoder allocates through a training step, recorded by
running the model's own encoder and projector (``get_image_features``) on the meta device, as
:mod:`sft_play.planner.simulate.trace` records a decoder layer: the same recorder, autocast,
fused attention and dropout, LoRA wrappers, 4-bit matmuls and checkpointing.

The inputs are what the processor gave the data's heaviest example (the most pixel values:
:func:`sft_play.data.vision.encoder_inputs`), or one image sized from the config where the plan
has no data, repeated for every example of the micro-batch as the collator batches them (along
their first dimension). Traced at micro-batch 1 and 2, the sizes are affine in the micro-batch
where both run the same operations (else micro-batch 1 stands alone and 2 and 3 give the rest, as
for the decoder layers); where the encoder loops over images, micro-batch 2's sizes are taken in
proportion to the micro-batch.

The inputs are made on the CPU, with values (integers as the processor gave them: Qwen-VL's
``image_grid_thw``, from which the encoder computes patch positions, windows and each image's
attention span; pixel values and masks as ones: every crop a real one, every patch attended,
where Idefics3 drops all-padding crops), so that what the encoder reads of them it reads; an
operation that meets the meta device's weights takes them there (:class:`_OnMeta`). What the
CPU computes is counted as the GPU would hold it.

A frozen encoder (the default) keeps nothing for backward: what it allocates is its working set,
alive only while it encodes the micro-batch's images, and its features until they are placed at
the image tokens. Where the encoder or the projector trains, what they keep for backward stays
until the end of the backward pass, which ends in theirs. (Qwen3-VL's deepstack features go with
the others when they are placed; the model keeps them through its first layers: not counted.)
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc
import json
import math
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map_only

from sft_play import patches
from sft_play.architecture import config_identity, frozen_parts, in_parts, keep_out_of_backward, vision_parts
from sft_play.planner.simulate import cache
from sft_play.planner.simulate.trace import (_FLASH_TRACE, DTYPES, ModuleEvents, TraceSpec, _Autocast,
                                             _module_events, _one_layer_model, _Recorder,
                                             _register_flash_trace, _Seed, with_method)
from sft_play.run import MASK_FREE_ATTENTION

_NUMPY_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "bool": torch.bool,
                 "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8}


@dataclass(frozen=True)
class EncoderTrace:
    """The encoder's events at micro-batch 1 and, as functions of the micro-batch, from 2 on (as
    :class:`sft_play.planner.simulate.trace.LayerTrace`): each a :class:`ModuleEvents` whose
    ``forward`` runs from the pixels on the GPU to the features, ``after_forward`` drops the
    features once placed, ``backward`` runs from the features' gradient on (empty where nothing
    in the encoder trains) and ``persistent`` names the gradients of what trains; and the bytes
    of one example's pixel inputs as collated."""

    single: ModuleEvents
    batched: ModuleEvents | None  # None: traced at micro-batch 1 only
    input_bytes: int

    def at(self, micro: int) -> ModuleEvents:
        return self.single if micro == 1 else self.batched

    @property
    def trains(self) -> bool:
        return bool(self.single.backward)

    def features_bytes(self, micro: int) -> int:
        """The features' bytes at `micro` (their gradient's too)."""
        events = self.at(micro)
        for event in events.forward:
            if event[0] == "a" and event[1] == events.output:
                return events.size(event, micro)
        return 0


def encoder_trace(spec: TraceSpec, inputs: str, train_tower: bool, train_projector: bool,
                  batched: bool = True) -> EncoderTrace:
    """The vision encoder's allocations for `spec`'s model and method, on `inputs` (the JSON of
    :func:`sft_play.data.vision.encoder_inputs`), with the tower and projector trained as said
    (cached in this process and on disk). Without `batched`, at micro-batch 1 only (``batched``
    None), unless the whole trace was made already."""
    if not train_tower and not train_projector and spec.method in ("lora", "full"):
        # A frozen encoder is the same under LoRA, which keeps its adapters out of it
        # (sft_play.architecture.adapter_parts), as under full fine-tuning: one trace for both
        spec = dataclasses.replace(spec, method="full", lora=None, adapter_dtype=spec.weights_dtype)
    key = (spec, inputs, train_tower, train_projector)
    if not batched and (*key, True) in _TRACES:
        return _TRACES[(*key, True)]
    if (*key, batched) not in _TRACES:
        if len(_TRACES) >= 16:
            _TRACES.clear()
        identity = config_identity(spec.name_or_path, spec.revision, spec.trust_remote_code)
        _TRACES[(*key, batched)] = cache.remembered(
            "encoder" if batched else "encoder-single", (*key, identity),
            lambda: _traced(spec, json.loads(inputs), train_tower, train_projector, batched, key),
            keep=cache.keeps(spec.name_or_path, spec.trust_remote_code))
    return _TRACES[(*key, batched)]


_TRACES: dict[tuple, EncoderTrace] = {}
_ONE_EXAMPLE: dict[tuple, dict[str, Any]] = {}  # the raw events at micro-batch 1, for the whole trace


def _traced(spec: TraceSpec, inputs: dict[str, Any], train_tower: bool, train_projector: bool,
            batched: bool = True, key: tuple | None = None) -> EncoderTrace:
    _register_flash_trace()
    with warnings.catch_warnings(), patches.meta_compatible():
        warnings.simplefilter("ignore")
        model = _prepared_encoder(spec, train_tower, train_projector)
        # (kept for a whole trace of the same encoder: a plan asks for micro-batch 1 first)
        one = _ONE_EXAMPLE.pop(key, None) or _record_encoder(model, spec, _batched(inputs, 1))
        if not batched:
            if key is not None:
                if len(_ONE_EXAMPLE) >= 4:
                    _ONE_EXAMPLE.clear()
                _ONE_EXAMPLE[key] = one
            return EncoderTrace(_module_events(one, one, 1), None, input_bytes(inputs))
        two = _record_encoder(model, spec, _batched(inputs, 2))
        try:  # the same operations for one example and two: one description for every micro-batch
            scaled = _module_events(one, two, 1)
            return EncoderTrace(scaled, scaled, input_bytes(inputs))
        except ValueError:  # (a single row skips some copies: micro-batch 1 on its own, as for the layers)
            three = _record_encoder(model, spec, _batched(inputs, 3))
    single = _module_events(one, one, 1)
    try:
        batched_events = _module_events(two, three, 2)
    except ValueError:  # image by image: sizes in proportion to the images, from two examples' (exact there)
        batched_events = _proportional(_module_events(two, two, 2), 2)
    return EncoderTrace(single, batched_events, input_bytes(inputs))


def input_bytes(inputs: dict[str, Any]) -> int:
    """The bytes of one example's encoder inputs as the collator hands them over (the small integer
    ones by their values, as int64)."""
    total = 0
    for described in inputs.values():
        if "values" in described:
            total += 8 * max(1, len(tree_flatten(described["values"])[0]))
        else:
            total += math.prod(described["shape"]) * _NUMPY_DTYPES.get(described["dtype"], torch.float32).itemsize
    return total


def _batched(inputs: dict[str, Any], micro: int) -> dict[str, torch.Tensor]:
    """`inputs` for `micro` examples alike, as the collator batches them, on the CPU: the small
    integer ones with their values, the others as ones (every pixel value non-zero, every mask
    entry set: no crop is padding, every patch is attended). The encoder reads what values it
    reads from them; its weights are on the meta device, where the heavy work goes
    (:class:`_OnMeta`)."""
    batch = {}
    for key, described in inputs.items():
        if "values" in described:
            values = torch.tensor(described["values"])
            batch[key] = torch.cat([values] * micro) if values.dim() else values
        else:
            shape = list(described["shape"])
            shape[0] *= micro
            batch[key] = torch.ones(shape, dtype=_NUMPY_DTYPES.get(described["dtype"], torch.float32))
    return batch


def _prepared_encoder(spec: TraceSpec, train_tower: bool, train_projector: bool) -> Any:
    """The model (one decoder layer, the whole vision encoder and projector) on the meta device,
    trained as the run trains it."""
    model = copy.deepcopy(_one_layer_model(spec.name_or_path, spec.revision, spec.trust_remote_code))
    towers, projectors = vision_parts(model)
    # (a training projector is left 16-bit under QLoRA: architecture.unquantised)
    model = with_method(model, spec, projectors if train_projector else ())
    if spec.method == "full":
        frozen, inside = frozen_parts(towers, projectors, train_tower, train_projector)
        for name, param in model.named_parameters():
            param.requires_grad_(not in_parts(name, frozen) or in_parts(name, inside))
    if not train_tower:
        keep_out_of_backward(model, towers)
    model.train()
    # The encoder's attention as a fused kernel runs it, in one variable-length call over the
    # images' patches: what the kernels keep is the same whether they run image by image and
    # window by window (Qwen-VL's SDPA path) or at once, and the trace stays one call per layer.
    # Eager attention (where the run needs it) runs its own code.
    text = model.config.get_text_config()
    text._attn_implementation = _FLASH_TRACE if spec.attention in MASK_FREE_ATTENTION else spec.attention
    vision = getattr(model.config, "vision_config", None)
    if vision is not None:
        vision._attn_implementation = "eager" if spec.attention == "eager" else _FLASH_TRACE
    if spec.checkpointing:
        recompute = functools.partial(_Autocast, DTYPES[spec.compute_dtype] if spec.compute_dtype else None, False)
        model.activation_checkpointing_enable(
            {"use_reentrant": False, "context_fn": lambda: (contextlib.nullcontext(), recompute())})
    return model


def _record_encoder(model: Any, spec: TraceSpec, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The raw events of encoding `batch`, forward and backward, by phase (the form
    :func:`sft_play.planner.simulate.trace._numbered` reads)."""
    model.zero_grad(set_to_none=True)  # (each trace's gradients its own, not added into the last's)
    ignore = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers(), *batch.values()]}
    recorder = _Recorder(ignore)
    autocast = _Autocast(DTYPES[spec.compute_dtype] if spec.compute_dtype else None)
    collecting = gc.isenabled()
    gc.disable()  # releases must follow reference counts alone
    try:
        with recorder:
            recorder.cut()
            with _OnMeta(), autocast:
                result = model.get_image_features(**batch)
            features = _features(result)
            del result
            forward = recorder.cut()
            # The features' gradient (the replay's GRAD_IN); the encoder hands none to anything
            # before it (input_grad None: see trace._numbered)
            keys = {"input": -1, "output": features[0].untyped_storage()._cdata, "grad_in": None, "input_grad": None}
            seeds = [_Seed.apply(f) for f in features if f.requires_grad]  # the trace's own scaffolding
            recorder.cut()
            autocast.cache = None  # autocast clears its cache when the model's forward pass ends
            cache_release = recorder.cut()
            del features
            after_forward = recorder.cut()
            backward: list = []
            if seeds:
                torch.autograd.backward(seeds, [torch.ones((), device="meta") for _ in seeds])
                backward = recorder.cut()
                keys["grad_in"] = seeds[0].grad_fn.seeded  # the features' (first seeded: features[0]'s)
                first = next(i for i, (kind, key, _) in enumerate(backward) if kind == "a" and key == keys["grad_in"])
                backward[first] = ("bind", *backward[first][1:])
    finally:
        if collecting:
            gc.enable()
    return {"forward": forward, "cache_release": cache_release, "after_forward": after_forward,
            "backward": backward, "keys": keys}


def _features(result: Any) -> list[torch.Tensor]:
    """The tensors the language model takes from ``get_image_features``' answer: the projected
    features (``pooler_output`` in transformers' outputs, or the answer itself), and the deepstack
    features where the model adds them to its first layers (Qwen3-VL)."""
    main = getattr(result, "pooler_output", None)
    if main is None and not isinstance(result, torch.Tensor) and hasattr(result, "last_hidden_state"):
        main = result.last_hidden_state
    if main is None:
        main = result
    found = tree_flatten((main, getattr(result, "deepstack_features", None)))[0]
    tensors, seen = [], set()
    for tensor in found:
        if isinstance(tensor, torch.Tensor) and tensor.untyped_storage()._cdata not in seen:
            seen.add(tensor.untyped_storage()._cdata)
            tensors.append(tensor)
    if not tensors:
        raise ValueError(f"get_image_features returned no tensor ({type(result).__name__})")
    return tensors


def _proportional(events: ModuleEvents, base: int) -> ModuleEvents:
    """`events` (at micro-batch `base`) with every size but the parameters' gradients in proportion
    to the micro-batch."""
    def scaled(phase):  # (a parameter's gradient is the same at every micro-batch)
        return tuple((kind, i, size, 0.0 if i in events.persistent else size / base) for kind, i, size, _ in phase)

    return ModuleEvents(scaled(events.forward), scaled(events.after_forward), scaled(events.cache_release),
                        scaled(events.backward), events.output, events.input_grad, events.input_kept,
                        events.persistent, base)


class _OnMeta(TorchFunctionMode):
    """Runs an operation that mixes CPU tensors with meta ones (the model's weights) on the meta
    device; a CPU tensor asked to move there (``.to(device)``, the device of the model's
    activations) stays on the CPU with its values until an operation mixes it so. The meta copy
    of a CPU tensor is that tensor moved, not a new one: it is made unrecorded, and keeps the CPU
    tensor (whose allocation was recorded, unless it is an input) alive for as long as it lives."""

    def __init__(self):
        super().__init__()
        self._sources: dict[int, torch.Tensor] = {}

    def _moved(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "cpu":
            return tensor
        with _disable_current_modes():
            moved = tensor.to("meta")
        key = moved.untyped_storage()._cdata
        self._sources[key] = tensor
        weakref.finalize(moved.untyped_storage(), self._sources.pop, key, None)
        return moved

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to and args[0].device.type == "cpu" and _to_meta(args[1:], kwargs):
            dtype = kwargs.get("dtype") or next((a for a in args[1:] if isinstance(a, torch.dtype)), None)
            return args[0].to(dtype) if dtype is not None else args[0]
        leaves = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if any(t.device.type == "meta" for t in leaves) and any(t.device.type == "cpu" and t.dim() for t in leaves):
            args, kwargs = tree_map_only(torch.Tensor, self._moved, (args, kwargs))
        return func(*args, **kwargs)


def _to_meta(args: tuple, kwargs: dict) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` moves a tensor to the meta device."""
    for target in (*args, kwargs.get("device"), kwargs.get("other")):
        if isinstance(target, torch.Tensor):
            target = target.device
        if isinstance(target, (str, torch.device)) and torch.device(target).type == "meta":
            return True
    return False
