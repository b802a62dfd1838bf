"""What GPU models are, by name: the model a memory size most often means, compute capabilities,
bf16 support and the cuBLAS workspace each takes. Facts for plans of hardware described as well
as detected; nothing here reads this machine."""

from __future__ import annotations

import os
import re

# The GPU a memory size most often means, when hardware is described by its memory alone
GPU_BY_MEMORY_GIB = {24: "A10G", 40: "A100", 48: "L40S", 80: "H100", 94: "H100", 141: "H200", 180: "B200"}


# The memory each GPU model the planner names is sold with, where it comes in one size (the A100
# comes as 40 and 80 GiB: described by its name alone, "A100 80GB" or VRAM_GIB says which)
MEMORY_GIB_BY_GPU = {"H100": 80, "H100 PCIe": 80, "H100 NVL": 94, "H200": 141, "B200": 180, "L40S": 48, "A10G": 24,
                     "L4": 24, "RTX 4090": 24, "A6000": 48}


# Compute capability of the GPU models the planner names (described hardware: no device to ask)
GPU_CAPABILITY = {"H100": (9, 0), "H100 PCIe": (9, 0), "H100 NVL": (9, 0), "H200": (9, 0), "B200": (10, 0),
                  "A100": (8, 0), "L40S": (8, 9), "A10G": (8, 6), "L4": (8, 9), "RTX 4090": (8, 9), "A6000": (8, 6)}


def memory_gib_in_name(name: str) -> float | None:
    """The memory a GPU's name gives, where it gives one ("A100 80GB", "NVIDIA A100-SXM4-40GB":
    the vendors' GB are GiB of HBM here, 81,920 MiB on an A100 80GB)."""
    match = re.search(r"(?<![\d.])(\d+(?:\.\d+)?)\s*GI?B\b", name, re.IGNORECASE)
    return float(match.group(1)) if match else None


def cublas_workspace_bytes(capability: tuple[int, int] | None, config: str | None = None) -> int:
    """The cuBLAS workspace PyTorch takes from its caching allocator for each handle and stream
    (``CublasHandlePool.cpp``, ``parseChosenWorkspaceSize``): `config`, ``CUBLAS_WORKSPACE_CONFIG``
    (``:SIZE_KIB:COUNT`` pairs), where set; else 32 MiB on Hopper (compute capability 9.0 exactly)
    and ``:4096:2:16:8`` (8.125 MiB) on every other GPU, Blackwell included. An unknown GPU is
    taken as Hopper: the larger. cuBLASLt shares it (``TORCH_CUBLASLT_UNIFIED_WORKSPACE`` is on
    by default)."""
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG") if config is None else config
    pairs = re.findall(r":([0-9]+):([0-9]+)", config or "")
    if pairs:
        return sum(int(size) * 1024 * int(count) for size, count in pairs)
    if capability is None or tuple(capability) == (9, 0):
        return 4096 * 8 * 1024
    return 4096 * 1024 * 2 + 16 * 1024 * 8


def gpu_model_for_memory(gib: float) -> str:
    """The GPU model a memory size most often means (80 GiB: H100)."""
    return GPU_BY_MEMORY_GIB[min(GPU_BY_MEMORY_GIB, key=lambda size: abs(size - gib))]


def gpu_computes_bf16(compute_capability: tuple[int, int]) -> bool:
    """bf16 in the tensor cores: Ampere (8.0) and newer. ``torch.cuda.is_bf16_supported()`` also
    says yes on older GPUs, where bf16 is emulated."""
    return compute_capability[0] >= 8
