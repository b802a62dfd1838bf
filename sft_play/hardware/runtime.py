"""What a GPU process holds outside PyTorch's allocator (the CUDA context, cuBLAS, NCCL),
measured on this machine's GPUs and remembered for the plans that follow (``info`` is a
:class:`sft_play.hardware.HardwareInfo`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from sft_play.hardware.gpu_models import gpu_computes_bf16
from sft_play.paths import cache_dir

# What lives outside PyTorch's allocator on a GPU is the runtime's (the CUDA context with its
# lazily loaded kernels, cuBLAS and cuDNN handles, NCCL's communicator buffers), different for
# every GPU, driver and CUDA build: it is measured, not assumed, wherever a GPU is present. A
# training run measures it at its end (NVML's figure for the process less the allocator's
# reservation), by its number of processes; ``make gpu-info`` probes it once when no run has
# ("probe": a first step's kernels, fewer than a whole run loads). Kept per GPU model, driver,
# CUDA runtime and torch, in $SFT_PLAY_CACHE/cuda_runtime.json (delete it to measure afresh).
RUNTIME_RECORD = "cuda_runtime.json"


PROBE = "probe"


def _runtime_record_path() -> Path:
    return cache_dir() / RUNTIME_RECORD


def runtime_key(info: Any) -> str | None:
    """The GPU, driver, CUDA runtime and torch a measurement of the runtime's memory holds for
    (None without a GPU)."""
    if not info.gpus:
        return None
    return (f"{info.gpus[0].name} | driver {info.driver_version or '?'} | CUDA {info.cuda_runtime_version or '?'} | "
            f"torch {info.torch_version or '?'}")


def _read_runtime_record() -> dict[str, Any]:
    try:
        record = json.loads(_runtime_record_path().read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def remembered_outside_allocator(info: Any) -> dict[str, int]:
    """What a process was measured to hold outside the allocator on this machine's GPUs: by the
    number of processes of the run that measured it ("1", "2", "8", ...) and by make gpu-info's
    probe ("probe"); empty where nothing was measured. An unreadable record counts as none."""
    return _measurements(_read_runtime_record().get(runtime_key(info) or ""))


def _measurements(entry: Any) -> dict[str, int]:
    """The well-formed measurements of one record entry (anything else in it is ignored)."""
    if not isinstance(entry, dict):
        return {}
    return {k: v for k, v in entry.items()
            if (k == PROBE or k.isdigit()) and isinstance(v, int) and not isinstance(v, bool) and v > 0}


def remember_outside_allocator(info: Any, kind: str, measured_bytes: int) -> None:
    """Keep a measurement of what a process held outside the allocator, `kind` being the number
    of processes of the run that measured it (or :data:`PROBE`); the largest seen for this GPU,
    driver and build is kept (kernels load lazily, so a longer run can only have loaded more).
    Never fails a run: a record that cannot be read or written is rewritten or skipped. Only one
    process of a run writes; two runs ending at once may keep only one of their figures."""
    key = runtime_key(info)
    if key is None or measured_bytes <= 0:
        return
    path = _runtime_record_path()
    try:
        record = _read_runtime_record()
        entry = _measurements(record.get(key))
        if measured_bytes <= entry.get(kind, 0):
            return
        record[key] = {**entry, kind: int(measured_bytes)}
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}")
        temporary.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        os.replace(temporary, path)  # readers see the old record or the new one, never half of one
    except (OSError, TypeError, ValueError):
        return


def process_gpu_bytes(device_index: int = 0) -> int | None:
    """What NVML says this process holds on CUDA device `device_index` (None where NVML cannot
    say: no driver, a container without process accounting, a device named by UUID or MIG id)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        physical = int(visible.split(",")[device_index]) if visible and visible.split(",")[0].isdigit() else device_index
        handle = pynvml.nvmlDeviceGetHandleByIndex(physical)
        for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if process.pid == os.getpid():
                return int(process.usedGpuMemory or 0)
    except Exception:  # noqa: BLE001 - NVML missing or unreadable
        return None
    return None


def measure_outside_allocator(device_index: int = 0) -> int | None:
    """Measure, in this process, what one training process holds on a GPU outside PyTorch's
    allocator: create the CUDA context, load the kernels a training step uses first (a cuBLAS
    matmul and its backward, softmax, SDPA) in the GPU's 16-bit dtype, and take NVML's figure for
    the process less the allocator's reservation. None where NVML cannot say."""
    import torch

    device = torch.device("cuda", device_index)
    dtype = torch.bfloat16 if gpu_computes_bf16(torch.cuda.get_device_capability(device)) else torch.float16
    weight = torch.randn(128, 128, device=device, dtype=dtype, requires_grad=True)
    x = torch.randn(4, 2, 128, 64, device=device, dtype=dtype)  # (batch, heads, tokens, head dim)
    attended = torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True)
    out = attended.transpose(1, 2).flatten(2) @ weight  # (batch, tokens, heads x head dim)
    out.float().softmax(-1).sum().backward()
    torch.cuda.synchronize(device)
    del weight, x, out
    torch.cuda.empty_cache()
    process = process_gpu_bytes(device_index)
    if process is None:
        return None
    return max(0, process - torch.cuda.memory_reserved(device))
