"""The hardware a plan is for: detected (this machine's GPUs, or its host memory), or described
(``NUM_GPUS``, ``VRAM_GIB``, ``GPU_MODEL``, ``NNODES``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sft_play.hardware import GPU_CAPABILITY, MEMORY_GIB_BY_GPU, gpu_model_for_memory, memory_gib_in_name
from sft_play.planner.simulate.timing import GPUS_PER_NODE, PEAK_BF16, gpu_model as known_gpu_model
from sft_play.units import GIB


@dataclass
class Target:
    """The hardware a plan is for: how many GPUs, and the free memory of the smallest."""

    world_size: int
    free_bytes: int
    device_name: str
    bf16_supported: bool = True
    on_cuda: bool = True
    source: str = "detected"
    gpu_model: str = ""  # the GPU's name, for its peak FLOP/s (the time prediction)
    interconnect: str = "nvlink"  # between the GPUs of a node: nvlink or pcie
    gpus_per_node: int = 8
    # What processes were measured to hold outside PyTorch's allocator on these GPUs
    # (hardware.HardwareInfo.outside_allocator; empty for hardware described, not detected)
    outside_allocator_measured: dict[str, int] = field(default_factory=dict)
    compute_capability: tuple[int, int] | None = None  # the GPUs' (None: unknown, or no GPU)
    host_bytes: int | None = None  # a node's host memory available (None: not known, for hardware described)


# GPUs linked by NVLink in the servers they usually come in (SXM boards); the others talk over PCIe
NVLINK_GPUS = frozenset({"H100", "H200", "B200", "A100"})



def target_for(hardware: Any, gpus: int | None = None, vram_gib: float | None = None,
               allow_cpu: bool = False, gpu_model: str | None = None, nodes: int | None = None) -> Target:
    """The hardware to plan for: given (``--gpus``/``--vram-gib``), else detected.

    Args:
        hardware: :class:`sft_play.hardware.HardwareInfo` of this machine.
        gpus: number of GPUs (all nodes); defaults to the visible ones.
        vram_gib: free memory per GPU to plan for, in GiB; plans for hardware you do not have.
        allow_cpu: on a machine without a GPU, plan against host memory instead of refusing.
        gpu_model: the GPU model described hardware has (for the time prediction); by default the
            one its memory size most often means (80 GiB: H100).
        nodes: nodes of `gpus` GPUs each (as ``make train-distributed`` reads NNODES and NUM_GPUS);
            without it `gpus` counts every GPU, eight to a node.

    Raises:
        ValueError: no GPU here and none described, or a count or size that is not positive.
    """
    if gpus is not None and gpus < 1:
        raise ValueError(f"the number of GPUs must be at least 1 (got {gpus}): NUM_GPUS=8 or --gpus 8")
    if vram_gib is not None and vram_gib <= 0:
        raise ValueError(f"the GPU memory must be positive (got {vram_gib:g} GiB): VRAM_GIB=80 or --vram-gib 80")
    if gpu_model is not None and known_gpu_model(gpu_model) is None:
        raise ValueError(f"GPU model '{gpu_model}' is not one the planner can time (it knows "
                         f"{', '.join(sorted(PEAK_BF16))}; GPU_MODEL=\"RTX 4090\" with the quotes for a name with a "
                         "space): leave GPU_MODEL out to time the plan as the GPU the memory size most often means")
    if nodes is not None and nodes < 1:
        raise ValueError(f"the number of nodes must be at least 1 (got {nodes}): NNODES=2 or --nodes 2")
    if gpu_model is not None and vram_gib is None and not hardware.gpus:
        # a GPU named on a machine without one describes it: its memory is the one its name gives, else the model's
        vram_gib = memory_gib_in_name(gpu_model) or MEMORY_GIB_BY_GPU.get(known_gpu_model(gpu_model))
        if vram_gib is None:
            raise ValueError(f"GPU_MODEL={gpu_model} comes with more than one memory size: say which with "
                             f"VRAM_GIB (e.g. make plan NUM_GPUS={gpus or 1} GPU_MODEL=\"{gpu_model}\" VRAM_GIB=80)")
    if vram_gib is not None:
        # NUM_GPUS alone: all GPUs together, 8 to a node; with NNODES: GPUs per node, as training reads it
        per_node = (gpus or 1) if nodes else min(gpus or 1, GPUS_PER_NODE)
        count = (gpus or 1) * (nodes or 1)
        model = known_gpu_model(gpu_model) if gpu_model else gpu_model_for_memory(vram_gib)
        where = f"{nodes} node(s) x {per_node}" if nodes else f"{count}"
        linked = known_gpu_model(model or "") in NVLINK_GPUS
        return Target(count, int(vram_gib * GIB),
                      f"{where} x {vram_gib:g} GiB (as given; timed as {model or '?'}, "
                      f"{'NVLink' if linked else 'PCIe'} within a node of {per_node})",
                      source="--vram-gib", gpu_model=model, interconnect="nvlink" if linked else "pcie",
                      gpus_per_node=per_node, compute_capability=GPU_CAPABILITY.get(known_gpu_model(model or "") or ""))
    if hardware.gpus:
        count = (gpus or len(hardware.gpus)) * (nodes or 1)
        local = hardware.gpus[: min(count, len(hardware.gpus))]
        smallest = min(local, key=lambda g: g.free_bytes)
        note = "" if count <= len(hardware.gpus) else " (other nodes assumed alike)"
        linked = all(g.nvlinks_active for g in local) if len(local) > 1 else True
        return Target(count, smallest.free_bytes, f"{count} x {smallest.name}{note}",
                      bf16_supported=all(g.bf16_supported for g in local),
                      gpu_model=(known_gpu_model(gpu_model) if gpu_model else None) or smallest.name,
                      interconnect="nvlink" if linked else "pcie", gpus_per_node=len(hardware.gpus),
                      outside_allocator_measured=dict(hardware.outside_allocator),
                      compute_capability=tuple(smallest.compute_capability),
                      host_bytes=hardware.ram_available_bytes or None)
    if allow_cpu:
        count = gpus or 1
        # Processes on one host share its memory
        return Target(count, hardware.ram_available_bytes // count, f"CPU (host memory / {count} process(es))",
                      bf16_supported=hardware.cpu_bf16, on_cuda=False, source="host memory")
    raise ValueError("no CUDA GPU on this machine: say what to plan for with NUM_GPUS=N VRAM_GIB=G "
                     "(e.g. make plan NUM_GPUS=8 VRAM_GIB=80; scripts/plan.py takes --gpus 8 --vram-gib 80)")
