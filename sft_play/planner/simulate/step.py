"""One GPU's memory through training steps: every allocation and release of the step, in order,
replayed through the caching allocator (:mod:`sft_play.planner.simulate.allocator`).

The step is assembled from what is known exactly and what was traced:

- parameters, adapters, optimizer states, DDP buckets and ZeRO partitions from the exact
  shape (:mod:`sft_play.planner.simulate.shapes`) and the terms of :mod:`sft_play.planner.simulate.memory`;
- each decoder layer's and the final norm's allocations from the meta-device trace
  (:mod:`sft_play.planner.simulate.trace`), chained layer to layer: a layer's output is the next layer's
  input, the gradient it produces for its input is the incoming gradient of the layer below;
- a vision-language model's vision encoder on the micro-batch's images, from its own trace
  (:mod:`sft_play.planner.simulate.encoder`), its features placed at the image tokens;
- what the backbone allocates around the layers (the batch, the embedding output, the
  attention mask, the rotary tables) and TRL's chunked loss head, from their code (cited where
  they are replayed);
- the optimizer step and ``zero_grad`` (gradients freed).

The optimizer states are created before the first step (torch creates them lazily at the first
``optimizer.step()``; replaying that order, with a third step, moved the predictions for the
measured H100 rows by -0.4 to +3.7 points, away from the measurements, and costs half as much
again), then two optimizer steps are replayed (the second runs with the first step's cached
blocks). With gradient accumulation each is replayed as a later micro-batch of its step: with
the gradients of the earlier micro-batches alive, its own added into them.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from sft_play.planner.simulate import compiled, memory
from sft_play.planner.simulate.allocator import CachingAllocator, HostMemory, OutOfMemory
from sft_play.planner.simulate.encoder import EncoderTrace
from sft_play.planner.simulate.shapes import ModelShape
from sft_play.planner.simulate.trace import GRAD_IN, INPUT, LayerTrace, ModuleEvents
from sft_play.run import Run
from sft_play.units import MIB

FUSED_HEAD_TOKENS = 4096  # TRL's chunked log-prob: token rows per tile (trl/kernels/chunked_logprob.py)
FUSED_HEAD_VOCAB = 32768  # ... vocabulary columns per tile (trl.trainer.utils, _CHUNKED_LOGPROB_CHUNK_SIZE)
DDP_BUCKET_BYTES = 25 * MIB  # DistributedDataParallel bucket_cap_mb


@dataclass
class StepMemory:
    """What the replay found: the allocator's peaks and the live bytes by category at the peak."""

    peak_reserved: int
    peak_allocated: int
    at_peak: dict[str, int]
    out_of_memory: bool = False
    cache_releases: int = 0
    at_peak_allocated: dict[str, int] = field(default_factory=dict)  # live bytes by category at the allocated peak
    # host memory only: the live bytes at the step's named points (POINTS), as the last step passed them
    points: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class StepSpec:
    """What the replay needs besides the shape and the trace."""

    run: Run
    micro_batch: int
    seq_len: int
    checkpointing: bool
    masked: bool  # a 4-D mask is built for the batch (packed rows or padding, without FlashAttention-2)
    eager_mask: bool = False  # eager attention takes a float mask instead of a boolean one
    sliding_mask: bool = False  # unmasked rows reach the sliding window: a [b, 1, s, s] mask for those layers
    loss_token_share: float = 1.0
    accumulating: bool = False  # gradient accumulation: the next micro-batch runs with gradients alive
    on_cuda: bool = True  # CUDA: a cuBLAS workspace and Triton's head; elsewhere the head's torch fold
    cublas_workspace: int = 32 * MIB  # taken from the allocator on CUDA (Run.cublas_workspace_bytes)
    neftune: bool = False  # NEFTune's noise, drawn and added to the embedding output (a transient)
    offload_hidden: bool = False  # the hidden states checkpointing keeps live in host memory (sft_play.long_rows)
    encoder: EncoderTrace | None = None  # the vision encoder on each example's images (None: none planned)
    # preference tuning: the reference's forward without gradients, after the policy's (whose saved
    # tensors are alive), before backward (TRL's DPOTrainer._compute_loss)
    reference_forward: bool = False
    # KTO's KL estimate: the policy's forward without gradients over the mismatched rows before its
    # training forward, and the reference's over them beside its own (TRL's KTOTrainer._compute_loss)
    kl_forward: bool = False
    steps: int = 2


# Where in a step the live bytes are compared with a real step's (bench/cpu_ground_truth.py): as
# the model's forward returns (the loss computed), as the optimizer step starts (backward and the
# gradients' clipping done), and as it ends (before zero_grad); and as each decoder layer's backward
# is done (layer_backward_point)
POINTS = ("after_forward", "after_backward", "after_step")


def layer_backward_point(layer: int) -> str:
    """The named point as decoder layer `layer`'s backward is done: its input's gradient whole,
    its saved (or recomputed) tensors gone, its weights' gradients kept or reduced."""
    return f"layer {layer} backward"


_OWN_HANDLES = 1 << 62  # the replay's own tensors; traced ones are _handle_base(layer) + event id


@dataclass
class _Replay:
    """The allocator (or the recorder of a compiled replay, :class:`_Events`) plus names for the
    tensors of the step."""

    allocator: CachingAllocator | HostMemory | _Events
    counter: itertools.count = field(default_factory=lambda: itertools.count(_OWN_HANDLES))

    def new(self, size: float, category: str) -> int:
        handle = next(self.counter)
        self.allocator.malloc(handle, max(0, int(size)), category)
        return handle

    def malloc(self, handle: int, size: int, category: str) -> None:
        self.allocator.malloc(handle, size, category)

    def free(self, *handles) -> None:
        if isinstance(self.allocator, _Events):
            self.allocator.free_all(handles)
            return
        for handle in handles:
            if handle is not None:
                self.allocator.free(handle)

    def mark(self, point: str) -> None:
        """A named point of the step (:data:`POINTS`), where host memory records its live bytes."""
        self.allocator.mark(point)


class _Events:
    """A step's allocations and frees in order, as arrays for the compiled replay
    (:mod:`sft_play.planner.simulate.compiled`): a traced module's events are added as one block
    of arrays (:meth:`play`), the replay's own one at a time. Categories are numbered in the order
    an allocation first names them, as the reference allocator's breakdown orders them."""

    def __init__(self):
        self.blocks: list[tuple[np.ndarray, ...]] = []
        self.kinds: list[int] = []
        self.handles: list[int] = []
        self.sizes: list[int] = []
        self.category_ids: list[int] = []
        self.categories: dict[str, int] = {}

    def _category(self, name: str) -> int:
        found = self.categories.get(name)
        if found is None:
            found = self.categories[name] = len(self.categories)
        return found

    def malloc(self, handle: int, size: int, category: str) -> None:
        self.kinds.append(1)
        self.handles.append(handle)
        self.sizes.append(size)
        self.category_ids.append(self._category(category))

    def mark(self, point: str) -> None:  # (a compiled replay is a GPU's: no named points)
        pass

    def free(self, handle: int) -> None:
        self.kinds.append(0)
        self.handles.append(handle)
        self.sizes.append(0)
        self.category_ids.append(0)

    def free_all(self, handles) -> None:
        """:meth:`free` of each of `handles` but None, in order."""
        handles = [handle for handle in handles if handle is not None]
        self.kinds += [0] * len(handles)
        self.handles += handles
        self.sizes += [0] * len(handles)
        self.category_ids += [0] * len(handles)

    def _flush(self) -> None:
        if self.kinds:
            self.blocks.append((np.array(self.kinds, np.int64), np.array(self.handles, np.int64),
                                np.array(self.sizes, np.int64), np.array(self.category_ids, np.int64)))
            self.kinds, self.handles, self.sizes, self.category_ids = [], [], [], []

    def play(self, template: _Template, base: int, names: dict, category: str) -> None:
        self._flush()
        handles = template.ids + base
        for event_id, positions in template.named:
            handles[positions] = names[event_id]
        # numbered in the order the block's allocations first name them (frees name none)
        first = sorted((position, name) for position, name in ((template.first_gradient, "gradients"),
                                                               (template.first_other, category)) if position is not None)
        numbers = {name: self._category(name) for _, name in first}
        categories = np.where(template.gradient, numbers.get("gradients", 0), numbers.get(category, 0))
        self.blocks.append((template.kinds, handles, template.sizes, categories))

    def begin_with(self, recorded: _Recorded) -> None:
        """`recorded`'s events as this replay's first ones."""
        assert not self.blocks and not self.kinds, "recorded events begin a replay"
        numbers = np.array([self._category(name) for name in recorded.categories] or [0], np.int64)
        self.blocks.append((recorded.kinds, recorded.offsets + _OWN_HANDLES, recorded.sizes,
                            np.where(recorded.kinds == 1, numbers[recorded.category_ids], 0)))

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str], np.ndarray]:
        self._flush()
        columns = zip(*self.blocks) if self.blocks else [[np.zeros(0, np.int64)]] * 4
        kinds, handles, sizes, categories = (np.concatenate(column) for column in columns)
        return kinds, handles, sizes, list(self.categories), categories


@dataclass(frozen=True)
class _Template:
    """A module's events at one micro-batch as arrays: what :meth:`_Events.play` adds, less the
    handles' base and the names of tensors made elsewhere (negative ids: the input, the incoming
    gradient)."""

    kinds: np.ndarray
    ids: np.ndarray
    sizes: np.ndarray
    named: tuple[tuple[int, np.ndarray], ...]  # (negative id, its positions)
    gradient: np.ndarray  # allocations of parameter gradients (category "gradients")
    first_gradient: int | None  # the first such allocation's position (None: none)
    first_other: int | None


def replay(shape: ModelShape, trace: LayerTrace, spec: StepSpec, capacity: int | None = None,
           log: list | None = None) -> StepMemory:
    """Replay `spec.steps` optimizer steps; `capacity` (bytes the allocator may reserve) None is
    unlimited. An allocation that fails even after the cache is released ends the replay with
    ``out_of_memory``. `log`, a list, receives every allocation and free in order (through the
    reference allocator); without one the step is replayed compiled where it can be
    (:mod:`sft_play.planner.simulate.compiled`), with the same result."""
    if spec.on_cuda and log is None and (compiled.loaded() or _events_per_step(shape, trace, spec) >= COMPILED_FROM
                                         and compiled.available()):
        events = _Events()
        _replay(_Replay(events), shape, trace, spec)
        kinds, handles, sizes, categories, category_ids = events.arrays()
        found = compiled.replay(kinds, handles, sizes, categories, category_ids, capacity)
        return StepMemory(found["peak_reserved"], found["peak_allocated"], found["at_peak"], found["out_of_memory"],
                          found["releases"], found["at_peak_allocated"])
    # (host memory, a CPU run's: no caching allocator to simulate)
    allocator = CachingAllocator(capacity=capacity, log=log) if spec.on_cuda else HostMemory(capacity, log)
    gpu = _Replay(allocator)
    try:
        _replay(gpu, shape, trace, spec)
        oom = False
    except OutOfMemory:
        oom = True
    return StepMemory(allocator.peak_reserved, allocator.peak_allocated, dict(allocator.at_peak), oom,
                      allocator.releases, dict(allocator.at_peak_allocated), dict(allocator.points))


def replay_reference_pass(shape: ModelShape, trace: LayerTrace, spec: StepSpec, capacity: int | None = None) -> StepMemory:
    """TRL's reference pass before training (``precompute_ref_log_probs``): the weights as loaded
    and one forward of `spec.micro_batch` rows without gradients (:func:`_reference_forward`),
    before the optimizer's states exist; its tensors counted as ``precompute_pass``. TRL scores
    as its trainer is built, before accelerate shards the model for FSDP2: there the whole
    model as loaded (:func:`memory.loaded_tensors`), none of it gathered."""
    allocator = CachingAllocator(capacity=capacity) if spec.on_cuda else HostMemory(capacity, None)
    gpu = _Replay(allocator)
    try:
        if spec.run.parallel.fsdp:
            for size, _ in memory.loaded_tensors(shape, spec.run):
                gpu.new(size, "weights")
        else:
            _static(gpu, shape, spec.run)
        if spec.on_cuda:
            gpu.new(spec.cublas_workspace, "cuda_runtime")
        _reference_forward(gpu, shape, trace, spec, memory.residual_bytes(spec.run), "precompute_pass")
        oom = False
    except OutOfMemory:
        oom = True
    return StepMemory(allocator.peak_reserved, allocator.peak_allocated, dict(allocator.at_peak), oom,
                      allocator.releases, dict(allocator.at_peak_allocated))


# Replays of fewer events than this run through the reference allocator until the process has loaded
# the compiled code: a tiny model's step (hundreds of events) takes milliseconds there, less than
# loading it (about half a second, and numba's import) would cost the process
COMPILED_FROM = 20_000


def _events_per_step(shape: ModelShape, trace: LayerTrace, spec: StepSpec) -> int:
    """About how many allocations and frees the replay makes: its layers' traced events."""
    layer, _ = trace.at(spec.micro_batch)
    traced = len(layer.forward) + len(layer.after_forward) + len(layer.cache_release) + len(layer.backward)
    return traced * shape.num_layers * spec.steps


def _replay(gpu: _Replay, shape: ModelShape, trace: LayerTrace, spec: StepSpec) -> None:
    run = spec.run
    if isinstance(gpu.allocator, _Events):
        recorded = _before_steps_recorded(shape, spec)
        gpu.allocator.begin_with(recorded)
        gpu.counter = itertools.count(_OWN_HANDLES + recorded.handles_used)  # (its own handles counted on past them)
    else:
        _before_steps(gpu, shape, spec)
    for _ in range(spec.steps):
        # With accumulation, every micro-batch after the first runs with the gradients alive (and
        # adds its own into them): replay that one
        held = _held_gradients(gpu, shape, run) if spec.accumulating else []
        grads = _forward_backward(gpu, shape, trace, spec, keep_grads=not held)
        gpu.mark("after_backward")
        _optimizer_step(gpu, shape, run)
        gpu.mark("after_step")
        gpu.free(*held, *grads)  # zero_grad(set_to_none=True)


def _before_steps(gpu: _Replay, shape: ModelShape, spec: StepSpec) -> None:
    """What is allocated before the first step: the static state, cuBLAS's workspace, the
    optimizer's states."""
    _static(gpu, shape, spec.run)
    if spec.on_cuda:
        gpu.new(spec.cublas_workspace, "cuda_runtime")
    _optimizer_states(gpu, shape, spec.run)


class _Recorded(NamedTuple):
    """Events recorded from a fresh :class:`_Replay`: its own handles as offsets from the first."""

    kinds: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray
    categories: list[str]
    category_ids: np.ndarray
    handles_used: int


# :func:`_before_steps`' events for a compiled replay, by the shape's id and what decides them: the
# same for every micro-batch, budget and length a plan asks about (thousands of tensors, one
# Python call each, were a third of a replay's own work)
_BEFORE_STEPS: dict = {}


def _before_steps_recorded(shape: ModelShape, spec: StepSpec) -> _Recorded:
    key = (id(shape), spec.run, spec.on_cuda, spec.cublas_workspace)
    found = _BEFORE_STEPS.get(key)
    if found is None or found[0] is not shape:
        if len(_BEFORE_STEPS) > 64:
            _BEFORE_STEPS.clear()
        recorder = _Replay(_Events())
        _before_steps(recorder, shape, spec)
        kinds, handles, sizes, categories, category_ids = recorder.allocator.arrays()
        found = _BEFORE_STEPS[key] = (shape, _Recorded(kinds, handles - _OWN_HANDLES, sizes, categories, category_ids,
                                                       next(recorder.counter) - _OWN_HANDLES))
    return found[1]


# ---------------------------------------------------------------------------------------------
# Static state


def _static(gpu: _Replay, shape: ModelShape, run: Run) -> None:
    """Parameters as loaded, adapters, and the buffers distributed training allocates up front."""
    base_bytes = memory.stored_bytes(run)
    shards = run.parallel.weight_shards
    if not run.parallel.offload_parameters:
        for numel in shape.other_tensors:  # QLoRA too: what is not quantised loads in the run's weights dtype
            gpu.new(numel * base_bytes / shards, "weights")
        for index in range(shape.num_layers):
            for numel, quantizable in shape.tensors_of_layer(index):
                if run.method == "qlora" and quantizable:
                    gpu.new(numel / 2 / shards, "weights")  # packed NF4
                    gpu.new(memory.nf4_constants_bytes(-(-numel // memory.NF4_BLOCK), run.double_quant), "weights")
                else:
                    gpu.new(numel * base_bytes / shards, "weights")
    if memory.resting_adapter_bytes(shape, run):  # (tensor by tensor)
        for numel in memory.adapter_tensors(shape):
            gpu.new(numel * memory.trainable_bytes(run) / shards, "weights")
    gathered = memory.layers_gathered(shape, run)  # ZeRO-3 and FSDP2 gather a layer's parameters for its passes
    if gathered and not _fsdp_gathers_by_pass(run):
        layer_bytes = memory.gathered_layer_bytes(shape, run)
        for _ in range(gathered):
            gpu.new(layer_bytes, "weights")
        if run.parallel.fsdp:  # (FSDP2 not resharding after the forward: the tail too, counted for the whole step)
            for numel in memory.fsdp_step_gathered_tensors(shape):
                gpu.new(numel * memory.gathered_bytes(run), "weights")
    if run.parallel.deepspeed:
        _chunked(gpu, memory.master_weights_bytes(shape, run), "master_weights")
    if run.parallel.strategy.shards_states and not memory.sharded_gradients_in_backward(run):  # (else _sharded_gradients)
        _chunked(gpu, memory.gradient_bytes(shape, run), "gradients")  # this rank's averaged partition
        _chunked(gpu, memory.zero_buffer_bytes(shape, run), "zero_buffers")
    _chunked(gpu, memory.ddp_bucket_bytes(shape, run), "ddp_buckets", DDP_BUCKET_BYTES)
    _chunked(gpu, memory.reference_bytes(shape, run), "reference")  # (a copy's; summed: loaded tensor by tensor)


def _chunked(gpu: _Replay, total: int, category: str, chunk: int | None = None) -> None:
    chunk = chunk or max(1, total)
    while total > 0:
        gpu.new(min(chunk, total), category)
        total -= chunk


def _optimizer_states(gpu: _Replay, shape: ModelShape, run: Run) -> None:
    """torch AdamW's exp_avg and exp_avg_sq per trainable tensor (``zeros_like``); DeepSpeed's fp32
    states for this rank's partition."""
    total = memory.optimizer_state_bytes(shape, run)
    if not total:
        return
    if run.parallel.deepspeed:
        _chunked(gpu, total, "optimizer_states")
        return
    tensors = memory.trainable_tensors(shape, run)
    per_element = total / max(1, sum(tensors))
    for numel in tensors:
        for _ in range(2):
            gpu.new(numel * per_element / 2, "optimizer_states")


def _held_gradients(gpu: _Replay, shape: ModelShape, run: Run) -> list:
    """The gradients earlier micro-batches of the step left: the shard they were accumulated into
    (ZeRO-3's, made for the whole run, already counted)."""
    if memory.sharded_gradients_in_backward(run):
        return [gpu.new(size, "gradients") for size in [memory.gradient_bytes(shape, run)] if size]
    if run.parallel.strategy.shards_states:
        return []
    size = memory.trainable_bytes(run)
    return [gpu.new(numel * size, "gradients") for numel in memory.trainable_tensors(shape, run)]


def _optimizer_step(gpu: _Replay, shape: ModelShape, run: Run) -> None:
    """Temporaries of the step itself: foreach AdamW's state-sized intermediate, DeepSpeed's fp32
    copy of the gradient partition (fused AdamW and 8-bit optimizers work in place). On a CPU,
    torch's AdamW runs tensor by tensor (its foreach kernels are for CUDA and its kin:
    ``torch.utils._foreach_utils``): ``denom = (exp_avg_sq.sqrt() / c).add_(eps)`` makes two
    tensors of the parameter's size, the first freed at once, the last denom when the next is
    assigned."""
    if not run.on_cuda and run.optimizer == "adamw_torch" and not run.parallel.deepspeed \
            and not (run.parallel.fsdp and run.parallel.offload_parameters):
        denom, size = None, memory.trainable_bytes(run)
        for numel in memory.trainable_tensors(shape, run, in_order=True):
            root = gpu.new(numel * size, "optimizer_step")
            quotient = gpu.new(numel * size, "optimizer_step")
            gpu.free(root, denom)
            denom = quotient
        gpu.free(denom)
        return
    size = memory.optimizer_step_bytes(shape, run)
    if size:
        gpu.free(gpu.new(size, "optimizer_step"))


# ---------------------------------------------------------------------------------------------
# Forward and backward


def _forward_backward(gpu: _Replay, shape: ModelShape, trace: LayerTrace, spec: StepSpec, keep_grads: bool) -> list:
    """One micro-batch; returns the handles of parameter gradients it created (alive until the
    optimizer step's ``zero_grad``)."""
    run = spec.run
    b = spec.micro_batch
    residual = memory.residual_bytes(run)
    hidden_bytes = b * spec.seq_len * shape.hidden_size * residual
    _, norm = trace.at(b)
    layers = trace.layers_at(b, shape.num_layers)  # each layer's kind (hybrid models mix them)
    grads: list = []

    # FSDP2: accelerate's tail unit (the final norm and the head) is gathered as its first module's
    # forward starts: with a tied head the embedding's, at once; untied, the final norm's, after the layers
    tied = shape.tie_word_embeddings
    tail = _fsdp_gather(gpu, shape, run, tail=True) if tied else []
    if spec.kl_forward:
        _kl_forward(gpu, shape, trace, spec, residual)
    batch, embeddings, encoded, rotary, masks = _inputs(gpu, shape, spec, residual)
    # (FSDP2: the layers are gathered once an untied embedding, a unit of its own, has done its forward)
    forward_layers = _fsdp_gather(gpu, shape, run, layers=memory.LAYERS_IN_FLIGHT)
    kept = _zero3_kept(gpu, shape, spec)
    outputs, norm_names, last_hidden = _backbone_forward(gpu, spec, layers, norm, embeddings, kept)
    gpu.free(*forward_layers)  # (FSDP2: the top layer is resharded as its forward ends)
    if not tied:  # (as the final norm's forward starts; here after it, which makes nothing of size)
        tail = _fsdp_gather(gpu, shape, run, tail=True)
    # The backbone returns: `inputs_embeds` and the masks go unless kept for backward
    if not layers[0].input_kept:
        gpu.free(embeddings)
    if not spec.checkpointing:
        gpu.free(*masks)
        masks = []

    gathered_head = _zero3_gathered_head(gpu, shape, run, kept)
    head = _head_forward(gpu, shape, spec, last_hidden, residual)
    if spec.reference_forward:
        _reference_forwards(gpu, shape, trace, spec, residual)
    for i, names in enumerate(outputs):  # autocast's weight cache is cleared as the forward ends
        _play(gpu, layers[i], layers[i].cache_release, i, names, b, "activations")
    if encoded is not None:
        _play(gpu, spec.encoder.at(b), spec.encoder.at(b).cache_release, "vision", encoded, b, "activations")
    gpu.mark("after_forward")

    # Backward: the head, the final norm, then the layers from the top. FSDP2's tail unit prefetches
    # the top layer as the head's backward starts; each layer's backward then runs with the layer
    # below prefetched (FSDPParamGroup.pre_backward, _backward_prefetch)
    backward_layers = _fsdp_gather(gpu, shape, run, layers=1)
    incoming = _head_backward(gpu, shape, spec, head, residual, grads, keep_grads)
    gpu.free(gathered_head)
    buckets, shard = _sharded_gradients(gpu, shape, run, keep_grads)
    if norm is not None:
        norm_names[GRAD_IN] = incoming
        if spec.offload_hidden and norm.input_kept:
            gpu.malloc(norm_names[INPUT], hidden_bytes, "activations")
        _play(gpu, norm, norm.backward, "norm", norm_names, b, "backward_working")
        incoming = _name(norm_names, norm.input_grad, "norm")
    if run.parallel.fsdp and not tied:  # the untied tail's backward is done: its gradients reduce-scattered, it resharded
        gpu.free(*grads, *tail)
        grads, tail = [], []
    backward_layers += _fsdp_gather(gpu, shape, run, layers=memory.LAYERS_IN_FLIGHT - 1)
    incoming = _layers_backward(gpu, spec, layers, outputs, kept, incoming, grads, keep_grads, hidden_bytes)
    if encoded is not None and spec.encoder.trains:
        _encoder_backward(gpu, spec, encoded, grads, keep_grads)
    gpu.free(incoming, *buckets, *kept.values())  # (the embedding ZeRO-3 kept: its backward is the last)
    gpu.free(*backward_layers)
    if memory.trains(run, "embed_tokens") and not run.parallel.deepspeed:
        _embedding_gradient(gpu, shape, run, grads)
    gpu.free(*rotary, *masks, *batch)
    if encoded is not None:
        gpu.free(encoded[INPUT])
    if layers[0].input_kept:
        gpu.free(embeddings)
    if run.parallel.fsdp:  # a tied tail's gradients are reduce-scattered as backward ends, and it is resharded
        gpu.free(*grads, *tail)
        grads = []
    return grads + shard


def _kl_forward(gpu: _Replay, shape: ModelShape, trace: LayerTrace, spec: StepSpec, residual: int) -> None:
    """KTO's policy forward over the mismatched rows, without gradients, before its training
    forward (FSDP2: with its own layers gathered)."""
    gathered = _fsdp_gather(gpu, shape, spec.run, layers=memory.LAYERS_IN_FLIGHT)
    _reference_forward(gpu, shape, trace, spec, residual, "kl_forward")
    gpu.free(*gathered)


def _zero3_gathered_head(gpu: _Replay, shape: ModelShape, run: Run, kept: dict):
    """ZeRO-3: TRL's fused head gathers its weight around the loss (``trl.trainer.utils._maybe_gather_params``),
    unless a tied embedding kept gathered holds it already; its handle (None otherwise)."""
    if not run.parallel.strategy.zero3 or not memory.layers_gathered(shape, run) \
            or (shape.tie_word_embeddings and "embedding" in kept):
        return None
    return gpu.new(shape.vocab_size * shape.hidden_size * memory.gathered_bytes(run), "weights")


def _reference_forwards(gpu: _Replay, shape: ModelShape, trace: LayerTrace, spec: StepSpec, residual: int) -> None:
    """The reference's forwards after the policy's (its own, and KTO's over the mismatched rows);
    under FSDP2 with the policy's layers (adapters off), or TRL's copy, one unit whole
    (``trl.models.utils.prepare_fsdp``), gathered in the dtype it was loaded in."""
    run = spec.run
    copy = run.preference.reference == "copy" and _fsdp_gathers_by_pass(run)
    gathered = ([gpu.new(shape.total_params * run.precision.compute_bytes, "reference")] if copy
                else _fsdp_gather(gpu, shape, run, layers=memory.LAYERS_IN_FLIGHT))
    for _ in range(1 + spec.kl_forward):
        _reference_forward(gpu, shape, trace, spec, residual)
    gpu.free(*gathered)


def _layers_backward(gpu: _Replay, spec: StepSpec, layers: list, outputs: list, kept: dict, incoming: int,
                     grads: list, keep_grads: bool, hidden_bytes: int) -> int:
    """The decoder layers' backward from the top, each reading its forward's tensors (`outputs`)
    and the gradient the one above produced (`incoming`), its offloaded input (`hidden_bytes`)
    brought back first; a layer ZeRO-3 kept gathered is released after it. Returns the gradient
    of the first layer's input."""
    run, b = spec.run, spec.micro_batch
    for i in reversed(range(len(layers))):
        names, layer = outputs[i], layers[i]
        names[GRAD_IN] = incoming
        if spec.offload_hidden and layer.input_kept:
            gpu.malloc(names[INPUT], hidden_bytes, "activations")
        _play(gpu, layer, layer.backward, i, names, b, "backward_working", gradients=layer.persistent)
        gpu.free(kept.pop(i, None))
        incoming = _name(names, layer.input_grad, i)
        _keep_or_free(gpu, run, keep_grads, grads, [_name(names, g, i) for g in layer.persistent])
        gpu.mark(layer_backward_point(i))
    return incoming


def _encoder_backward(gpu: _Replay, spec: StepSpec, encoded: dict, grads: list, keep_grads: bool) -> None:
    """The features' gradient (masked_scatter's backward: the image tokens' rows of the embeddings'
    gradient), then the vision encoder's and projector's backward."""
    b = spec.micro_batch
    events = spec.encoder.at(b)
    encoded[GRAD_IN] = gpu.new(spec.encoder.features_bytes(b), "backward_working")
    _play(gpu, events, events.backward, "vision", encoded, b, "backward_working", gradients=events.persistent)
    _keep_or_free(gpu, spec.run, keep_grads, grads, [_name(encoded, g, "vision") for g in events.persistent])


def _fsdp_gathers_by_pass(run: Run) -> bool:
    """FSDP2 resharding each unit after its forward: its layers (and the tail unit, the head's)
    are gathered around their passes (:func:`_fsdp_gather`), none through the optimizer step."""
    return (run.parallel.fsdp and run.parallel.reshard_after_forward
            and (run.parallel.weight_shards > 1 or run.parallel.offload_parameters))


def _fsdp_gather(gpu: _Replay, shape: ModelShape, run: Run, layers: int = 0, tail: bool = False) -> list:
    """Under :func:`_fsdp_gathers_by_pass`, `layers` decoder layers gathered at once, or the tail
    unit (the final norm and the head, with a tied embedding: accelerate's ``fsdp2_prepare_model``
    makes them one unit not resharded after its forward), gathered from its first module's
    forward to the end of its backward; their handles (none otherwise)."""
    if not _fsdp_gathers_by_pass(run):
        return []
    if tail:
        return [gpu.new(numel * memory.gathered_bytes(run), "weights") for numel in memory.fsdp_step_gathered_tensors(shape)]
    return [gpu.new(memory.gathered_layer_bytes(shape, run), "weights") for _ in range(layers)]


def _inputs(gpu: _Replay, shape: ModelShape, spec: StepSpec, residual: int) -> tuple:
    """The micro-batch on the GPU and what the backbone reads besides its layers: the batch's
    tensors, the embeddings (with the images' features placed, NEFTune's noise added), the vision
    encoder's tensors (None: no images), the rotary tables and the attention masks."""
    run = spec.run
    b, s, h = spec.micro_batch, spec.seq_len, shape.hidden_size
    # The collated batch (input_ids, labels, position_ids: int64), moved to the GPU
    batch = [gpu.new(8 * b * s, "inputs") for _ in range(3)]
    gathered_embedding = _gather_embedding(gpu, shape, run)
    embedded = memory.embedding_bytes(run)  # (the first layer widens it to the residual stream's, where that is wider)
    embeddings = gpu.new(b * s * h * embedded, "activations")
    gpu.free(gathered_embedding)  # an untied embedding is its own FSDP2 unit, resharded after its forward
    encoded = _encode_images(gpu, spec.encoder, b) if spec.encoder is not None else None
    if encoded is not None:  # inputs_embeds.masked_scatter(image_mask, features): a new tensor
        placed = gpu.new(b * s * h * embedded, "activations")
        gpu.free(embeddings)
        _play(gpu, spec.encoder.at(b), spec.encoder.at(b).after_forward, "vision", encoded, b, "activations")
        embeddings = placed
    if spec.neftune:  # transformers' hook: output + zeros_like(output).uniform_(); neither is kept for backward
        noise = gpu.new(b * s * h * embedded, "activations")
        noised = gpu.new(b * s * h * embedded, "activations")
        gpu.free(noise, embeddings)
        embeddings = noised
    # Rotary tables (cos, sin) in the embeddings' dtype; the boolean (or, for eager, float) masks, one
    # per attention kind of the layers (masking_utils: create_causal_mask, create_sliding_window_causal_mask)
    rotary = [gpu.new(b * s * shape.head_dim * embedded, "inputs") for _ in range(2)]
    masks = [gpu.new(b * s * s * (embedded if spec.eager_mask else 1), "inputs")
             for _ in range(shape.attention_masks)] if spec.masked else []
    if spec.sliding_mask:  # the sliding-window layers' boolean mask (run.sliding_mask)
        masks.append(gpu.new(b * s * s, "inputs"))
    return batch, embeddings, encoded, rotary, masks


def _zero3_kept(gpu: _Replay, shape: ModelShape, spec: StepSpec) -> dict:
    """What ZeRO-3 keeps gathered beyond the layers in flight (:func:`memory.layers_gathered`)
    from its forward to its backward, where the reuse distance covers the turnaround
    (:func:`memory.zero3_kept_layers`): a trained embedding, gathered here, and the kept layers below
    the top ones in flight, each gathered as its forward ends
    (:func:`_backbone_forward`). Returns the embedding's handle by "embedding" and the layers'
    gathered bytes by index (their handles once gathered)."""
    run = spec.run
    count = memory.zero3_kept_layers(shape, run, spec.checkpointing)
    kept: dict = {i: memory.gathered_layer_bytes(shape, run)
                  for i in range(shape.num_layers - count, shape.num_layers - memory.layers_gathered(shape, run))}
    if memory.zero3_kept_embedding(shape, run, spec.checkpointing):
        kept["embedding"] = gpu.new(shape.params_by_kind.get("embeddings", 0) * memory.gathered_bytes(run), "weights")
    return kept


def _backbone_forward(gpu: _Replay, spec: StepSpec, layers: list, norm: ModuleEvents | None, embeddings: int,
                      kept: dict) -> tuple:
    """The layers forward, each one's input the previous one's output, then the final norm: each
    layer's tensor names (what backward reads), the norm's, and the backbone's output. A layer
    ZeRO-3 keeps gathered to its backward (`kept`: its bytes) is gathered as its forward ends."""
    b = spec.micro_batch
    previous = embeddings
    outputs = []
    for i, layer in enumerate(layers):
        names = {INPUT: previous}
        _play(gpu, layer, layer.forward, i, names, b, "activations")
        if i in kept:
            kept[i] = gpu.new(kept[i], "weights")
        if i > 0:
            _play(gpu, layer, layer.after_forward, i, names, b, "activations")
        if spec.offload_hidden and layer.input_kept:  # copied to host memory; back for the layer's backward
            gpu.free(names[INPUT])
        previous = _name(names, layer.output, i)
        outputs.append(names)
    last_hidden = previous
    norm_names = {INPUT: last_hidden}
    if norm is not None:
        _play(gpu, norm, norm.forward, "norm", norm_names, b, "activations")
        _play(gpu, norm, norm.after_forward, "norm", norm_names, b, "activations")
        if spec.offload_hidden and norm.input_kept:
            gpu.free(norm_names[INPUT])
        last_hidden = _name(norm_names, norm.output, "norm")
    return outputs, norm_names, last_hidden


def _keep_or_free(gpu: _Replay, run: Run, keep_grads: bool, grads: list, parameter_grads: list) -> None:
    """A module's parameter gradients as its backward finishes: kept to the optimizer step, or
    gone at once (ZeRO copies them into its reduction bucket, FSDP2 reduce-scatters them into its
    shard; a later micro-batch adds them into the gradients of the first)."""
    if run.parallel.strategy.shards_states or not keep_grads:
        gpu.free(*parameter_grads)
    else:
        grads += parameter_grads


def _sharded_gradients(gpu: _Replay, shape: ModelShape, run: Run, keep_grads: bool) -> tuple[list, list]:
    """As the head's gradients arrive (the first of backward), where this rank's gradient shard
    lives from there to the step (:func:`memory.sharded_gradients_in_backward`): the buckets that
    reduce into it (ZeRO-1/2's two reduction buckets, FSDP2's reduce-scatter buffers), returned
    first to be freed as backward ends, and the shard, returned second to be kept to the optimizer
    step. A later micro-batch adds into the shard held: FSDP2 in place; ZeRO-1/2 reduce into a new
    partition (``copy_grads_in_partition``, the held one kept in ``all_grad_tensors``) that the
    backward's epilogue adds into it and drops, freed here with the buckets."""
    if not memory.sharded_gradients_in_backward(run):
        return [], []
    size = memory.gradient_bytes(shape, run)  # (none on the GPU under FSDP2's offload)
    shard = [gpu.new(size, "gradients")] if size and (keep_grads or not run.parallel.fsdp) else []
    if run.parallel.fsdp:
        buckets = [gpu.new(memory.fsdp_buffer_bytes(shape, run), "fsdp_buffers")]
    else:
        buckets = [gpu.new(memory.zero_buffer_bytes(shape, run) // 2, "zero_buffers") for _ in range(2)]
    return (buckets, shard) if keep_grads else (buckets + shard, [])


def _embedding_gradient(gpu: _Replay, shape: ModelShape, run: Run, grads: list) -> None:
    """The embedding's dense gradient; tied to the head's, it is added into it (a transient;
    LoRA's copy is a module of its own); FSDP2 gathers an untied embedding again for its backward
    and reduce-scatters the gradient (transients in its param_dtype)."""
    gathered_embedding = _gather_embedding(gpu, shape, run)
    embedding = gpu.new(shape.vocab_size * shape.hidden_size
                        * (memory.gathered_bytes(run) if run.parallel.fsdp else memory.trainable_bytes(run)),
                        "gradients")
    gpu.free(gathered_embedding)
    if (shape.tie_word_embeddings and run.method == "full") or run.parallel.fsdp:
        gpu.free(embedding)
    else:
        grads.append(embedding)


def _reference_forward(gpu: _Replay, shape: ModelShape, trace: LayerTrace, spec: StepSpec, residual: int,
                       category: str = "reference_forward") -> None:
    """The reference's forward under ``no_grad`` (the policy's weights with the adapters off, or
    the frozen copy): the same layers, each layer's tensors freed once its output exists, as
    nothing is kept for a backward; then TRL's fused head, whose kept tensors go too. Replayed from
    the policy's trace, whose layer holds what it saves for backward until it ends: a layer's
    peak here is the training forward's, an upper bound of the no-grad one."""
    b, s, h = spec.micro_batch, spec.seq_len, shape.hidden_size
    _, norm = trace.at(b)
    layers = trace.layers_at(b, shape.num_layers)
    batch = gpu.new(8 * b * s, category)  # the labels: input_ids with the prompt masked
    previous = gpu.new(b * s * h * residual, category)
    rotary = [gpu.new(b * s * shape.head_dim * residual, category) for _ in range(2)]
    masks = [gpu.new(b * s * s * (residual if spec.eager_mask else 1), category)
             for _ in range(shape.attention_masks)] if spec.masked else []
    modules = [(layer, shape.num_layers + 2 + i) for i, layer in enumerate(layers)]
    if norm is not None:
        modules.append((norm, 2 * shape.num_layers + 2))
    for module, where in modules:  # (handles past the policy's layers: both are alive at once)
        names = {INPUT: previous}
        _play(gpu, module, module.forward, where, names, b, category)
        output = _name(names, module.output, where)
        alive: dict[int, None] = {}
        for is_alloc, event_id, _ in _sized(module, module.forward, b):
            if event_id >= 0:
                if is_alloc:
                    alive[event_id] = None
                else:
                    alive.pop(event_id, None)
        gpu.free(*(_name(names, event_id, where) for event_id in alive if event_id != module.output))
        if module.output >= 0 or output != previous:
            gpu.free(previous)
        previous = output
    gpu.free(*rotary, *masks)  # (the backbone's, nothing saving them)
    # TRL's copy of the reference has the fused head's default outputs; the policy (its adapters off,
    # or before training) the trainer's
    head = _head_forward(gpu, shape, spec, previous, residual,
                         top1=spec.run.preference.reference != "copy" and _computes_top1(spec.run))
    gpu.free(head["selected"], head["targets"], head["log_z"], head["entropy"], head["label_mask"], batch)


def _encode_images(gpu: _Replay, encoder: EncoderTrace, micro: int) -> dict:
    """The micro-batch's pixel inputs, collated and moved to the GPU, and the vision encoder's
    forward pass on them (:mod:`sft_play.planner.simulate.encoder`); the names of its tensors."""
    names = {INPUT: gpu.new(encoder.input_bytes * micro, "inputs")}
    _play(gpu, encoder.at(micro), encoder.at(micro).forward, "vision", names, micro, "activations")
    return names


def _gather_embedding(gpu: _Replay, shape: ModelShape, run: Run):
    """FSDP2 (accelerate's units): an untied input embedding is a unit of its own, gathered
    around its own passes only. None otherwise."""
    if not run.parallel.fsdp or shape.tie_word_embeddings:
        return None
    return gpu.new(shape.params_by_kind.get("embeddings", 0) * memory.gathered_bytes(run), "weights")


def _name(names: dict, event_id: int, layer):
    return names[event_id] if event_id < 0 else _handle_base(layer) + event_id


def _handle_base(layer) -> int:
    """Integer handles for traced tensors: layer i's event k is (i + 2) << 24 | k; the final norm's
    1 << 24 | k; the vision encoder's k; tensors the replay names itself count from :data:`_OWN_HANDLES`."""
    return 0 if layer == "vision" else (1 if layer == "norm" else layer + 2) << 24


def _play(gpu: _Replay, module: ModuleEvents, events, layer, names: dict, micro: int, category: str,
          gradients=frozenset()) -> None:
    """Replay `events` of `module` as layer `layer`, sizes at micro-batch `micro`."""
    base = _handle_base(layer)
    if isinstance(gpu.allocator, _Events):
        gpu.allocator.play(_template(module, events, micro, gradients), base, names, category)
        return
    malloc, free = gpu.allocator.malloc, gpu.allocator.free
    for is_alloc, event_id, size in _sized(module, events, micro):
        handle = names[event_id] if event_id < 0 else base + event_id
        if is_alloc:
            malloc(handle, size, "gradients" if event_id in gradients else category)
        else:
            free(handle)


_SIZED: dict = {}
_TEMPLATES: dict = {}


def _sized(module: ModuleEvents, events, micro: int) -> list[tuple[bool, int, int]]:
    """`events` as (allocation?, id, bytes at `micro`), computed once per micro-batch."""
    key = (id(events), micro)
    if key not in _SIZED or _SIZED[key][0] is not events:
        if len(_SIZED) > 256:
            _SIZED.clear()
        _SIZED[key] = (events, [(kind == "a", i, module.size(e, micro)) for e in events for kind, i in [e[:2]]])
    return _SIZED[key][1]


def _template(module: ModuleEvents, events, micro: int, gradients: frozenset) -> _Template:
    """`events` at `micro` as a :class:`_Template`, computed once per micro-batch."""
    key = (id(events), micro, gradients)
    found = _TEMPLATES.get(key)
    if found is not None and found[0] is events:
        return found[1]
    if len(_TEMPLATES) > 256:
        _TEMPLATES.clear()
    sized = _sized(module, events, micro)
    kinds = np.array([1 if is_alloc else 0 for is_alloc, _, _ in sized], np.int64)
    ids = np.array([event_id for _, event_id, _ in sized], np.int64)
    sizes = np.array([size if is_alloc else 0 for is_alloc, _, size in sized], np.int64)
    gradient = (kinds == 1) & np.isin(ids, np.array(sorted(gradients), np.int64))
    other = (kinds == 1) & ~gradient
    named = tuple((int(event_id), np.flatnonzero(ids == event_id)) for event_id in np.unique(ids[ids < 0]))
    template = _Template(kinds, ids, sizes, named, gradient,
                         int(np.argmax(gradient)) if gradient.any() else None,
                         int(np.argmax(other)) if other.any() else None)
    _TEMPLATES[key] = (events, template)
    return template


# ---------------------------------------------------------------------------------------------
# TRL's chunked loss head (trl/kernels/chunked_logprob.py, ChunkedLogProbFunction): the labelled
# positions only, on CUDA by TRL's choice and on a CPU by sft_play.patches.labelled_positions_on_cpu


def _computes_top1(run: Run) -> bool:
    """Whether the policy's fused head computes ``is_top1`` (for the token accuracy): SFTTrainer
    and DPOTrainer (DPO, ORPO, SimPO) ask for it, KTOTrainer does not."""
    return run.preference is None or run.preference.objective != "kto"


def _head_forward(gpu: _Replay, shape: ModelShape, spec: StepSpec, last_hidden, residual: int,
                  top1: bool | None = None) -> dict:
    """``_fused_forward`` selects the labelled positions (``hidden_states[mask]``, a copy) and
    their targets, then tiles the projection (:func:`_head_tiles`): seven fp32 statistics per
    position, one [min(N, 4096), 32768] tile in the compute dtype. It keeps the selected states,
    the targets, log Z and the entropy for backward; the backbone's output goes as it returns
    (``backbone_outputs``). `top1`: whether it computes ``is_top1`` (None: as the policy's does,
    :func:`_computes_top1`)."""
    run = spec.run
    if top1 is None:
        top1 = _computes_top1(run)
    b, s, h, c = spec.micro_batch, spec.seq_len, shape.hidden_size, run.precision.compute_bytes
    n = max(1, int(b * (s - 1) * spec.loss_token_share))
    label_mask = gpu.new(b * (s - 1), "logits_loss")
    # The labelled positions are gathered (a copy)
    selected = gpu.new(n * h * residual, "logits_loss")
    targets = gpu.new(8 * n, "logits_loss")
    statistics = [gpu.new(4 * n, "logits_loss") for _ in range(7)]
    tile = gpu.new(min(n, FUSED_HEAD_TOKENS) * FUSED_HEAD_VOCAB * c, "logits_loss")
    fold = None if spec.on_cuda else functools.partial(_forward_fold, gpu, top1=top1)
    chunks = _head_tiles(gpu, shape, spec, residual, n, fold, backward=False)
    log_z = gpu.new(4 * n, "logits_loss")
    log_probs, entropy, top1_mask = (gpu.new(size, "logits_loss") for size in (4 * n, 4 * n, n))
    gpu.free(tile, *chunks, *statistics)  # (the function's locals, as it returns)
    # masked_scatter into [b, s - 1] outputs; the loss reads the log-probabilities
    outputs = [gpu.new(b * (s - 1) * size, "logits_loss") for size in (4, 4, 1)]
    gpu.free(log_probs, top1_mask, *outputs, last_hidden)
    return {"selected": selected, "targets": targets, "log_z": log_z, "entropy": entropy, "label_mask": label_mask,
            "n": n}


def _head_tiles(gpu: _Replay, shape: ModelShape, spec: StepSpec, residual: int, n: int, fold, backward: bool) -> list:
    """``ChunkedLogProbFunction``'s loops: each chunk of 4096 positions cast to the compute dtype
    (where the states are in another), and for each 32768-row slice of the head weight, its cast
    to it (where stored in another) for the tile's GEMM, then `fold(rows, columns)` (the torch
    fold off CUDA; Triton's kernel makes nothing). The forward casts each slice as a temporary of
    the GEMM; the backward binds it (``w_chunk``) through the fold and the gradients' GEMMs, and a
    variable's next value is made before its last one goes. Returns the casts still bound (the
    function's locals, alive until it returns). The pattern repeats for every token chunk."""
    h, c = shape.hidden_size, spec.run.precision.compute_bytes
    run = spec.run
    # the head's weight as stored: LoRA's and QLoRA's frozen head in the dtype the base was loaded
    # in, as full fine-tuning's (fp32 on a CPU without bf16: then no cast at all); LoRA's trained
    # copy of it in the adapters' fp32 (Run.upcasts_whole_copies), QLoRA's in bf16 (TRL casts what
    # a quantized model trains); DeepSpeed's engine casts the whole module to its compute dtype (fp32
    # without mixed precision)
    weight_bytes = memory.gathered_bytes(run) if run.parallel.fsdp else (
        run.precision.weight_bytes if not run.parallel.deepspeed else c)
    if memory.trains(run, "lm_head") and (run.upcasts_whole_copies or (
            run.method == "qlora" and not run.parallel.computes_in_gathered_copies)):
        weight_bytes = run.adapter_bytes
    chunk = piece = None
    for start in range(0, n, FUSED_HEAD_TOKENS):
        rows = min(FUSED_HEAD_TOKENS, n - start)
        if residual != c:
            chunk = _rebound(gpu, chunk, rows * h * c)
        for vocab_start in range(0, shape.vocab_size, FUSED_HEAD_VOCAB):
            columns = min(FUSED_HEAD_VOCAB, shape.vocab_size - vocab_start)
            if weight_bytes != c:
                piece = _rebound(gpu, piece, columns * h * c)
            if not backward:
                gpu.free(piece)
                piece = None
            if fold is not None:
                fold(rows, columns)
        if start >= FUSED_HEAD_TOKENS:  # the pattern repeats for every token chunk
            break
    return [chunk, piece]


def _rebound(gpu: _Replay, old, size: int) -> int:
    """A variable bound to a new tensor: the new one made before the old one goes."""
    new = gpu.new(size, "logits_loss")
    gpu.free(old)
    return new


def _forward_fold(gpu: _Replay, rows: int, columns: int, top1: bool) -> None:
    """``_forward_tile``, the fold torch runs where there is no Triton (a CPU), on a tile's used
    columns: z, the tile in fp32 and scaled (a 16-bit tile's fp32 copy first); ``is_top1``'s mask
    of the columns before each target (bool), kept to the fold's end; at most three fp32 tensors
    of the tile's size at once (z, ``z - max`` and its exponential; then z, the exponential and
    its product with z). (A final-logit soft cap adds its tanh's tensors: not counted.)"""
    fp32, name = rows * columns * 4, "logits_loss"
    z = gpu.new(fp32, name)
    before_target = gpu.new(rows * columns, name) if top1 else None
    gpu.free(gpu.new(fp32, name), gpu.new(fp32, name), z, before_target)


def _backward_fold(gpu: _Replay, rows: int, columns: int, compute_bytes: int) -> None:
    """``_backward_tile``, the fold torch runs where there is no Triton (a CPU), on a tile's used
    columns, each tensor [rows, columns] in fp32 unless said: the tile in fp32 and scaled (its fp32
    copy first, where the tile is 16-bit), z, log p, p and the zeroed gradient, kept to the end; the
    target mask (bool, from an int64 range of the columns); ``is_target.float() - p`` and its
    product with the incoming gradient, added in place; the gradient scaled twice more, each a new
    tensor, the last copied into the tile. (A final-logit soft cap adds its tanh's tensors: not
    counted.) Checked against PyTorch's memory profile on CPU steps (bench/cpu_ground_truth.py)."""
    fp32, name = rows * columns * 4, "logits_loss"
    upcast = gpu.new(fp32, name) if compute_bytes != 4 else None
    scaled = gpu.new(fp32, name)
    gpu.free(upcast)
    kept = [scaled, *(gpu.new(fp32, name) for _ in range(4))]  # y, z, log p, p, the gradient
    positions = gpu.new(8 * columns, name)
    kept.append(gpu.new(rows * columns, name))  # is_target
    gpu.free(positions)
    as_float = gpu.new(fp32, name)
    difference = gpu.new(fp32, name)
    gpu.free(as_float)
    product = gpu.new(fp32, name)
    gpu.free(difference)
    gpu.free(product)
    again = gpu.new(fp32, name)  # grad * inv_t
    gpu.free(kept.pop(4))
    gpu.free(gpu.new(fp32, name))  # grad * logit_scale, copied into the tile
    gpu.free(again, *kept)


def _head_backward(gpu: _Replay, shape: ModelShape, spec: StepSpec, head: dict, residual: int, grads: list,
                   keep_grads: bool):
    """``ChunkedLogProbFunction.backward``: an fp32 gradient for the selected states, for a trained
    head an fp32 weight gradient, the tile again, then both gradients cast to their tensors' dtypes;
    the gradient is scattered back into [b, s - 1, h] and the slice into [b, s, h] (the final
    norm's incoming gradient). Returns that gradient's handle."""
    run = spec.run
    b, s, h = spec.micro_batch, spec.seq_len, shape.hidden_size
    n = head["n"]
    grad_states = gpu.new(4 * n * h, "logits_loss")
    trained = memory.trains(run, "lm_head")
    head_grad = gpu.new(shape.vocab_size * h * 4, "gradients") if trained else None  # accumulated in fp32
    c = run.precision.compute_bytes
    tile = gpu.new(min(n, FUSED_HEAD_TOKENS) * FUSED_HEAD_VOCAB * c, "logits_loss")
    grad_log_probs = gpu.new(4 * n, "logits_loss")

    def fold(rows: int, columns: int) -> None:
        _backward_fold(gpu, rows, columns, c)
        if c != 4:  # _addmm_fp32 off CUDA: both factors of each gradient's GEMM in fp32, copies of 16-bit ones
            gpu.free(gpu.new(rows * columns * 4, "logits_loss"), gpu.new(columns * h * 4, "logits_loss"))
            if trained:
                gpu.free(gpu.new(rows * columns * 4, "logits_loss"), gpu.new(rows * h * 4, "logits_loss"))

    chunks = _head_tiles(gpu, shape, spec, residual, n, None if spec.on_cuda else fold, backward=True)
    # As it returns, the states' and the head's gradients are cast to their tensors' dtypes (a bf16
    # head's a copy; under FSDP2 the weight is the gathered copy, in its param_dtype) beside the fp32
    # ones, which go with the function's frame
    cast = gpu.new(n * h * residual, "logits_loss") if residual != 4 else None
    grad_bytes = memory.gathered_bytes(run) if run.parallel.fsdp else memory.trainable_bytes(run)
    head_cast = gpu.new(shape.vocab_size * h * grad_bytes, "gradients") if trained and grad_bytes != 4 else None
    gpu.free(tile, grad_log_probs, *chunks)
    if head_cast is not None:
        gpu.free(head_grad)
        head_grad = head_cast
    if cast is not None:
        gpu.free(grad_states)
        grad_states = cast
    gpu.free(head["selected"], head["targets"], head["log_z"], head["entropy"])
    # Then the weight's gradient is kept to the step, or (FSDP2) to its unit's reduce-scatter; added
    # into the one earlier micro-batches left; or (ZeRO) copied into the reduction bucket by its hook
    if trained and (keep_grads or run.parallel.fsdp) and not run.parallel.deepspeed:
        grads.append(head_grad)
    else:
        gpu.free(head_grad)
    scattered = gpu.new(b * (s - 1) * h * residual, "backward_working")
    gpu.free(grad_states, head["label_mask"])
    incoming = gpu.new(b * s * h * residual, "backward_working")
    gpu.free(scattered)
    return incoming
