"""One GPU's memory through training steps: every allocation and release of the step, in order,
replayed through the caching allocator (:mod:`sft_play.planner.simulate.allocator`).

The step is assembled from what is known exactly and what was traced:

- parameters, adapters, optimizer states, DDP buckets and ZeRO partitions from the exact
  shape (:mod:`sft_play.planner.simulate.shapes`) and the terms of :mod:`sft_play.planner.simulate.memory`;
- each decoder layer's and the final norm's allocations from the meta-device trace
  (:mod:`sft_play.planner.simulate.trace`), chained layer to layer: a layer's output is the next layer's
  input, the gradient it produces for its input is the incoming gradient of the layer below;
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

import itertools
from dataclasses import dataclass, field

from sft_play.planner.simulate import memory
from sft_play.planner.simulate.allocator import CachingAllocator, OutOfMemory
from sft_play.planner.simulate.shapes import ModelShape
from sft_play.planner.simulate.trace import GRAD_IN, INPUT, LayerTrace, ModuleEvents
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


@dataclass(frozen=True)
class StepSpec:
    """What the replay needs besides the shape and the trace."""

    recipe: memory.Recipe
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
    steps: int = 2


@dataclass
class _Replay:
    """The allocator plus names for the tensors of the step."""

    allocator: CachingAllocator
    counter: itertools.count = field(default_factory=itertools.count)

    def new(self, size: float, category: str) -> tuple:
        handle = ("t", next(self.counter))
        self.allocator.malloc(handle, max(0, int(size)), category)
        return handle

    def free(self, *handles) -> None:
        for handle in handles:
            if handle is not None:
                self.allocator.free(handle)


def replay(shape: ModelShape, trace: LayerTrace, spec: StepSpec, capacity: int | None = None,
           log: list | None = None) -> StepMemory:
    """Replay `spec.steps` optimizer steps; `capacity` (bytes the allocator may reserve) None is
    unlimited. An allocation that fails even after the cache is released ends the replay with
    ``out_of_memory``. `log`, a list, receives every allocation and free in order."""
    allocator = CachingAllocator(capacity=capacity, log=log)
    run = _Replay(allocator)
    try:
        _replay(run, shape, trace, spec)
        oom = False
    except OutOfMemory:
        oom = True
    return StepMemory(allocator.peak_reserved, allocator.peak_allocated, dict(allocator.at_peak), oom,
                      allocator.releases, dict(allocator.at_peak_allocated))


def _replay(run: _Replay, shape: ModelShape, trace: LayerTrace, spec: StepSpec) -> None:
    recipe = spec.recipe
    _static(run, shape, recipe)
    if spec.on_cuda:
        run.new(spec.cublas_workspace, "cuda_runtime")
    _optimizer_states(run, shape, recipe)
    for _ in range(spec.steps):
        # With accumulation, every micro-batch after the first runs with the gradients alive (and
        # adds its own into them): replay that one
        held = _held_gradients(run, shape, recipe) if spec.accumulating else []
        grads = _forward_backward(run, shape, trace, spec, keep_grads=not held)
        _optimizer_step(run, shape, recipe)
        run.free(*held, *grads)  # zero_grad(set_to_none=True)


# ---------------------------------------------------------------------------------------------
# Static state


def _static(run: _Replay, shape: ModelShape, recipe: memory.Recipe) -> None:
    """Parameters as loaded, adapters, and the buffers distributed training allocates up front."""
    base_bytes = recipe.stored_bytes
    shards = recipe.parallel.weight_shards
    if not recipe.parallel.offload_parameters:
        for numel in shape.other_tensors:  # QLoRA too: what is not quantised loads in the run's weights dtype
            run.new(numel * base_bytes / shards, "weights")
        for index in range(shape.num_layers):
            for numel, quantizable in shape.tensors_of_layer(index):
                if recipe.method == "qlora" and quantizable:
                    run.new(numel / 2 / shards, "weights")  # packed NF4
                    run.new(memory.nf4_constants_bytes(-(-numel // memory.NF4_BLOCK), recipe.double_quant), "weights")
                else:
                    run.new(numel * base_bytes / shards, "weights")
    adapter_shards = shards if recipe.parallel.fsdp else 1
    for numel in memory.adapter_tensors(shape):
        run.new(numel * recipe.trainable_bytes / adapter_shards, "weights")
    gathered = memory.layers_gathered(shape, recipe)  # ZeRO-3 and FSDP2 gather a layer's parameters for its passes
    if gathered:
        layer_bytes = memory.gathered_layer_bytes(shape, recipe)
        for _ in range(gathered):
            run.new(layer_bytes, "weights")
        if recipe.parallel.fsdp:  # the head and final norm (the tied embedding too), gathered for the whole step
            for numel in memory.fsdp_step_gathered_tensors(shape):
                run.new(numel * recipe.gathered_bytes, "weights")
    if recipe.parallel.fsdp:
        _chunked(run, memory.gradient_bytes(shape, recipe), "gradients")  # this rank's shard
        _chunked(run, memory.fsdp_buffer_bytes(shape, recipe), "fsdp_buffers")
    if recipe.parallel.deepspeed:
        _chunked(run, memory.master_weights_bytes(shape, recipe), "master_weights")
        _chunked(run, memory.gradient_bytes(shape, recipe), "gradients")  # this rank's averaged partition
        _chunked(run, memory.zero_buffer_bytes(shape, recipe), "zero_buffers")
    _chunked(run, memory.ddp_bucket_bytes(shape, recipe), "ddp_buckets", DDP_BUCKET_BYTES)


def _chunked(run: _Replay, total: int, category: str, chunk: int | None = None) -> None:
    chunk = chunk or max(1, total)
    while total > 0:
        run.new(min(chunk, total), category)
        total -= chunk


def _optimizer_states(run: _Replay, shape: ModelShape, recipe: memory.Recipe) -> None:
    """torch AdamW's exp_avg and exp_avg_sq per trainable tensor (``zeros_like``); DeepSpeed's fp32
    states for this rank's partition."""
    total = memory.optimizer_state_bytes(shape, recipe)
    if not total:
        return
    if recipe.parallel.deepspeed:
        _chunked(run, total, "optimizer_states")
        return
    tensors = memory.trainable_tensors(shape, recipe)
    per_element = total / max(1, sum(tensors))
    for numel in tensors:
        for _ in range(2):
            run.new(numel * per_element / 2, "optimizer_states")


def _held_gradients(run: _Replay, shape: ModelShape, recipe: memory.Recipe) -> list:
    """The gradients earlier micro-batches of the step left (ZeRO and FSDP2 keep only their
    shard, already counted)."""
    if recipe.parallel.strategy.shards_states:
        return []
    return [run.new(numel * recipe.trainable_bytes, "gradients") for numel in memory.trainable_tensors(shape, recipe)]


def _optimizer_step(run: _Replay, shape: ModelShape, recipe: memory.Recipe) -> None:
    """Temporaries of the step itself: foreach AdamW's state-sized intermediate, DeepSpeed's fp32
    copy of the gradient partition (fused AdamW and 8-bit optimizers work in place)."""
    size = memory.optimizer_step_bytes(shape, recipe)
    if size:
        run.free(run.new(size, "optimizer_step"))


# ---------------------------------------------------------------------------------------------
# Forward and backward


def _forward_backward(run: _Replay, shape: ModelShape, trace: LayerTrace, spec: StepSpec, keep_grads: bool) -> list:
    """One micro-batch; returns the handles of parameter gradients it created (alive until the
    optimizer step's ``zero_grad``)."""
    recipe = spec.recipe
    b, s, h = spec.micro_batch, spec.seq_len, shape.hidden_size
    residual = 2 if recipe.method == "qlora" else (
        recipe.compute_bytes if recipe.parallel.deepspeed else recipe.gathered_bytes if recipe.parallel.fsdp else recipe.weight_bytes)
    _, norm = trace.at(b)
    layers = trace.layers_at(b, shape.num_layers)  # each layer's kind (hybrid models mix them)
    grads: list = []

    # The collated batch (input_ids, labels, position_ids: int64), moved to the GPU
    batch = [run.new(8 * b * s, "inputs") for _ in range(3)]
    gathered_embedding = _gather_embedding(run, shape, recipe)
    embeddings = run.new(b * s * h * residual, "activations")
    run.free(gathered_embedding)  # an untied embedding is its own FSDP2 unit, resharded after its forward
    if spec.neftune:  # transformers' hook: output + zeros_like(output).uniform_(); neither is kept for backward
        noise = run.new(b * s * h * residual, "activations")
        noised = run.new(b * s * h * residual, "activations")
        run.free(noise, embeddings)
        embeddings = noised
    # Rotary tables (cos, sin) in the residual dtype; the boolean (or, for eager, float) masks, one
    # per attention kind of the layers (masking_utils: create_causal_mask, create_sliding_window_causal_mask)
    rotary = [run.new(b * s * shape.head_dim * residual, "inputs") for _ in range(2)]
    masks = [run.new(b * s * s * (residual if spec.eager_mask else 1), "inputs")
             for _ in range(shape.attention_masks)] if spec.masked else []
    if spec.sliding_mask:  # the sliding-window layers' boolean mask (run.sliding_mask)
        masks.append(run.new(b * s * s, "inputs"))

    # Layers forward: the input of layer i is the output of layer i - 1
    previous = embeddings
    outputs = []
    for i, layer in enumerate(layers):
        names = {INPUT: previous}
        _play(run, layer, layer.forward, i, names, b, "activations")
        if i > 0:
            _play(run, layer, layer.after_forward, i, names, b, "activations")
        previous = _name(names, layer.output, i)
        outputs.append(names)
    last_hidden = previous
    norm_names = {INPUT: last_hidden}
    if norm is not None:
        _play(run, norm, norm.forward, "norm", norm_names, b, "activations")
        _play(run, norm, norm.after_forward, "norm", norm_names, b, "activations")
        last_hidden = _name(norm_names, norm.output, "norm")
    # The backbone returns: `inputs_embeds` and the masks go unless kept for backward
    if not layers[0].input_kept:
        run.free(embeddings)
    if not spec.checkpointing:
        run.free(*masks)
        masks = []

    head = _head_forward(run, shape, spec, last_hidden, residual)
    for i, names in enumerate(outputs):  # autocast's weight cache is cleared as the forward ends
        _play(run, layers[i], layers[i].cache_release, i, names, b, "activations")

    # Backward: the head, the final norm, then the layers from the top
    incoming = _head_backward(run, shape, spec, head, residual, grads, keep_grads)
    if norm is not None:
        norm_names[GRAD_IN] = incoming
        _play(run, norm, norm.backward, "norm", norm_names, b, "backward_working")
        incoming = _name(norm_names, norm.input_grad, "norm")
    for i in reversed(range(shape.num_layers)):
        names, layer = outputs[i], layers[i]
        names[GRAD_IN] = incoming
        _play(run, layer, layer.backward, i, names, b, "backward_working", gradients=layer.persistent)
        incoming = _name(names, layer.input_grad, i)
        parameter_grads = [_name(names, g, i) for g in layer.persistent]
        if recipe.parallel.strategy.shards_states or not keep_grads:
            # ZeRO copies them into its reduction bucket, FSDP2 reduce-scatters them into its
            # shard; a later micro-batch adds them into the gradients of the first: either way
            # they go as the layer finishes
            run.free(*parameter_grads)
        else:
            grads += parameter_grads
    run.free(incoming)
    if recipe.method == "full" and not recipe.parallel.deepspeed:
        # The embedding's dense gradient; tied to the head's, it is added into it (a transient);
        # FSDP2 gathers an untied embedding again for its backward and reduce-scatters the
        # gradient (transients in its param_dtype)
        gathered_embedding = _gather_embedding(run, shape, recipe)
        embedding = run.new(shape.vocab_size * h * (recipe.gathered_bytes if recipe.parallel.fsdp else recipe.trainable_bytes),
                            "gradients")
        run.free(gathered_embedding)
        if shape.tie_word_embeddings or recipe.parallel.fsdp:
            run.free(embedding)
        else:
            grads.append(embedding)
    run.free(*rotary, *masks, *batch)
    if layers[0].input_kept:
        run.free(embeddings)
    if recipe.parallel.fsdp:  # the head unit's gradients are reduce-scattered as backward ends
        run.free(*grads)
        return []
    return grads


def _gather_embedding(run: _Replay, shape: ModelShape, recipe: memory.Recipe):
    """FSDP2 (accelerate's units): an untied input embedding is a unit of its own, gathered
    around its own passes only. None otherwise."""
    if not recipe.parallel.fsdp or shape.tie_word_embeddings:
        return None
    return run.new(shape.params_by_kind.get("embeddings", 0) * recipe.gathered_bytes, "weights")


def _name(names: dict, event_id: int, layer):
    return names[event_id] if event_id < 0 else _handle_base(layer) + event_id


def _handle_base(layer) -> int:
    """Integer handles for traced tensors: layer i's event k is (i + 2) << 24 | k; the final norm's
    1 << 24 | k; tensors the replay names itself are tuples."""
    return (1 if layer == "norm" else layer + 2) << 24


def _play(run: _Replay, module: ModuleEvents, events, layer, names: dict, micro: int, category: str,
          gradients=frozenset()) -> None:
    """Replay `events` of `module` as layer `layer`, sizes at micro-batch `micro`."""
    malloc, free = run.allocator.malloc, run.allocator.free
    base = _handle_base(layer)
    for is_alloc, event_id, size in _sized(module, events, micro):
        handle = names[event_id] if event_id < 0 else base + event_id
        if is_alloc:
            malloc(handle, size, "gradients" if event_id in gradients else category)
        else:
            free(handle)


_SIZED: dict = {}


def _sized(module: ModuleEvents, events, micro: int) -> list[tuple[bool, int, int]]:
    """`events` as (allocation?, id, bytes at `micro`), computed once per micro-batch."""
    key = (id(events), micro)
    if key not in _SIZED or _SIZED[key][0] is not events:
        if len(_SIZED) > 256:
            _SIZED.clear()
        _SIZED[key] = (events, [(kind == "a", i, module.size(e, micro)) for e in events for kind, i in [e[:2]]])
    return _SIZED[key][1]


# ---------------------------------------------------------------------------------------------
# TRL's chunked loss head (trl/kernels/chunked_logprob.py, ChunkedLogProbFunction): the labelled
# positions only, on CUDA by TRL's choice and on a CPU by sft_play.model.score_labelled_positions_only


def _head_forward(run: _Replay, shape: ModelShape, spec: StepSpec, last_hidden, residual: int) -> dict:
    """``_fused_forward`` selects the labelled positions (``hidden_states[mask]``, a copy) and
    their targets, then tiles the projection: seven fp32 statistics per position, one
    [min(N, 4096), 32768] tile in the compute dtype, the hidden chunk cast to it (when the hidden
    states are fp32) and each 32768-row slice of the head weight cast to it (when the weight is
    fp32). It keeps the selected states, the targets, log Z and the entropy for backward."""
    recipe = spec.recipe
    b, s, h, c = spec.micro_batch, spec.seq_len, shape.hidden_size, recipe.compute_bytes
    n = max(1, int(b * (s - 1) * spec.loss_token_share))
    tile_rows = min(n, FUSED_HEAD_TOKENS)
    label_mask = run.new(b * (s - 1), "logits_loss")
    # The labelled positions are gathered (a copy)
    selected = run.new(n * h * residual, "logits_loss")
    targets = run.new(8 * n, "logits_loss")
    run.free(last_hidden)
    statistics = [run.new(4 * n, "logits_loss") for _ in range(7)]
    tile = run.new(tile_rows * FUSED_HEAD_VOCAB * c, "logits_loss")
    if not spec.on_cuda:  # the torch fold: the tile's used columns in fp32 and their exponentials (_forward_tile)
        run.free(*[run.new(tile_rows * min(FUSED_HEAD_VOCAB, shape.vocab_size) * 4, "logits_loss") for _ in range(2)])
    _tile_casts(run, shape, spec, residual, n)
    run.free(tile)
    log_z = run.new(4 * n, "logits_loss")
    log_probs, entropy, top1 = (run.new(size, "logits_loss") for size in (4 * n, 4 * n, n))
    run.free(*statistics)
    # masked_scatter into [b, s - 1] outputs; the loss reads the log-probabilities
    outputs = [run.new(b * (s - 1) * size, "logits_loss") for size in (4, 4, 1)]
    run.free(log_probs, top1, *outputs)
    return {"selected": selected, "targets": targets, "log_z": log_z, "entropy": entropy, "label_mask": label_mask,
            "n": n}


def _tile_casts(run: _Replay, shape: ModelShape, spec: StepSpec, residual: int, n: int) -> None:
    h, c = shape.hidden_size, spec.recipe.compute_bytes
    recipe = spec.recipe
    weight_bytes = recipe.gathered_bytes if recipe.parallel.fsdp else (
        recipe.weight_bytes if recipe.method == "full" and not recipe.parallel.deepspeed else 2)
    for start in range(0, n, FUSED_HEAD_TOKENS):
        rows = min(FUSED_HEAD_TOKENS, n - start)
        chunk = run.new(rows * h * c, "logits_loss") if residual != c else None
        if weight_bytes != c:
            for vocab_start in range(0, shape.vocab_size, FUSED_HEAD_VOCAB):
                run.free(run.new(min(FUSED_HEAD_VOCAB, shape.vocab_size - vocab_start) * h * c, "logits_loss"))
        run.free(chunk)
        if start >= FUSED_HEAD_TOKENS:  # the pattern repeats for every token chunk
            break


def _head_backward(run: _Replay, shape: ModelShape, spec: StepSpec, head: dict, residual: int, grads: list,
                   keep_grads: bool):
    """``ChunkedLogProbFunction.backward``: an fp32 gradient for the selected states, for a trained
    head an fp32 weight gradient (returned in the weights' dtype), the tile again, then the states' gradient cast to their dtype;
    the gradient is scattered back into [b, s - 1, h] and the slice into [b, s, h] (the final
    norm's incoming gradient). Returns that gradient's handle."""
    recipe = spec.recipe
    b, s, h = spec.micro_batch, spec.seq_len, shape.hidden_size
    n = head["n"]
    grad_states = run.new(4 * n * h, "logits_loss")
    if recipe.method == "full":
        head_grad = run.new(shape.vocab_size * h * 4, "gradients")  # accumulated in fp32 ...
        # ... and returned as `grad_weight.to(weight.dtype)`: a bf16 head keeps a bf16 copy (under
        # FSDP2 the weight is the gathered copy, in its param_dtype)
        grad_bytes = recipe.gathered_bytes if recipe.parallel.fsdp else recipe.trainable_bytes
        if grad_bytes != 4:
            kept = run.new(shape.vocab_size * h * grad_bytes, "gradients")
            run.free(head_grad)
            head_grad = kept
        if keep_grads and not recipe.parallel.deepspeed:
            grads.append(head_grad)
        else:  # accumulated into the existing gradient, or reduced by ZeRO
            run.free(head_grad)
    tile = run.new(min(n, FUSED_HEAD_TOKENS) * FUSED_HEAD_VOCAB * recipe.compute_bytes, "logits_loss")
    if not spec.on_cuda:  # _backward_tile: fp32 logits, probabilities and gradient of the tile's used columns
        run.free(*[run.new(min(n, FUSED_HEAD_TOKENS) * min(FUSED_HEAD_VOCAB, shape.vocab_size) * 4, "logits_loss")
                   for _ in range(3)])
    grad_log_probs = run.new(4 * n, "logits_loss")
    _tile_casts(run, shape, spec, residual, n)
    cast = run.new(n * h * residual, "logits_loss") if residual != 4 else None
    run.free(tile, grad_log_probs)
    if cast is not None:
        run.free(grad_states)
        grad_states = cast
    run.free(head["selected"], head["targets"], head["log_z"], head["entropy"])
    scattered = run.new(b * (s - 1) * h * residual, "backward_working")
    run.free(grad_states, head["label_mask"])
    incoming = run.new(b * s * h * residual, "backward_working")
    run.free(scattered)
    return incoming
