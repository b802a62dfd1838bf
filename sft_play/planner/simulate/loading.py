"""One GPU's memory as a sharded run starts, before its first step: the model loaded whole on every
GPU, then sharded.

FSDP2: :func:`sft_play.model.load_model` places every weight on the process's own GPU (no
``zero.Init``, no rank-0-only loading), so each GPU holds the whole model until accelerate's
``fsdp2_prepare_model`` shards it as training starts. That function first upcasts the trainable
parameters to fp32 where the run computes under mixed precision (not QLoRA's), then takes the
model's ``state_dict`` and calls ``fully_shard`` unit by unit: each parameter's shard is made
while the state dict still holds the whole tensor, which it releases only as it returns. A
preference run's reference copy (``preference.reference: copy``) is loaded whole too, after the
policy, and sharded by TRL's ``prepare_fsdp`` as its trainer is built, before the policy is.

ZeRO-3 with QLoRA: transformers loads a quantised model outside ``zero.Init``
(``is_deepspeed_zero3_enabled() and not is_quantized``) and bitsandbytes places it on the
process's GPU, so the packed model is whole on every GPU until DeepSpeed partitions it,
parameter by parameter (each one's partition made, then its whole data freed). Other ZeRO-3 runs
load partitioned, under ``zero.Init``; other strategies keep the weights as they load.
"""

from __future__ import annotations

import itertools

from sft_play.planner.simulate import memory
from sft_play.planner.simulate.allocator import CachingAllocator, HostMemory, OutOfMemory
from sft_play.planner.simulate.shapes import ModelShape
from sft_play.planner.simulate.step import StepMemory
from sft_play.run import Run


def replay_start(shape: ModelShape, run: Run, on_cuda: bool, capacity: int | None = None) -> StepMemory | None:
    """The allocations of a sharded run's start (the module's docstring says which) through the
    allocator; None where the weights load as they train. The whole tensors are counted as
    ``loading``, the shards as ``weights``."""
    if not (run.parallel.fsdp or (run.parallel.strategy.zero3 and run.method == "qlora")):
        return None
    allocator = CachingAllocator(capacity=capacity) if on_cuda else HostMemory(capacity, None)
    handles = itertools.count(1)

    def new(size: float, category: str) -> int:
        handle = next(handles)
        allocator.malloc(handle, max(0, int(size)), category)
        return handle

    try:
        (_fsdp_start if run.parallel.fsdp else _zero3_start)(shape, run, new, allocator.free)
        oom = False
    except OutOfMemory:
        oom = True
    return StepMemory(allocator.peak_reserved, allocator.peak_allocated, dict(allocator.at_peak), oom,
                      allocator.releases, dict(allocator.at_peak_allocated))


def _fsdp_start(shape: ModelShape, run: Run, new, free) -> None:
    shards = run.parallel.world_size
    policy = [(new(size, "loading"), size, kind) for size, kind in memory.loaded_tensors(shape, run)]
    if run.preference is not None and run.preference.reference == "copy":  # (loaded in the compute dtype)
        reference = [(new(numel * run.precision.compute_bytes, "loading"), numel)  # (a copy: full fine-tuning)
                     for numel in memory.trainable_tensors(shape, run)]
        for _, numel in reference:  # (one fully_shard call: the whole tensors freed as it returns)
            new(numel * run.precision.compute_bytes / shards, "reference")
        for handle, _ in reference:
            free(handle)
    upcast = memory.trainable_bytes(run) == 4 and run.precision.autocast and run.method != "qlora"
    whole = []
    for handle, size, kind in policy:  # accelerate's upcast: param.data replaced, the old freed
        if kind == "trainable" and upcast and _loaded_bytes(run) < 4:
            size = size / _loaded_bytes(run) * 4
            handle, _ = new(size, "loading"), free(handle)
        whole.append((handle, size, kind))
    for _, size, kind in whole:  # (with parameter offload the shards go to host memory)
        if kind != "kept" and not run.parallel.offload_parameters:
            new(size / shards, "weights")
    for handle, _, kind in whole:  # the state dict released as fsdp2_prepare_model returns
        if kind != "kept":
            free(handle)


def _zero3_start(shape: ModelShape, run: Run, new, free) -> None:
    loaded = [(new(size, "loading"), size) for size, _ in memory.loaded_tensors(shape, run)]
    for handle, size in loaded:  # (with parameter offload the partitions go to host memory)
        if not run.parallel.offload_parameters:
            new(size / run.parallel.world_size, "weights")
        free(handle)


def _loaded_bytes(run: Run) -> int:
    """Bytes per trainable element as loaded: the weights' dtype, or a LoRA adapter's own."""
    return run.precision.weight_bytes if run.method == "full" else run.adapter_bytes
