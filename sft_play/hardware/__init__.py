"""What the machine has, and what GPUs are:

  machine.py     detect(): GPUs (NVML, else torch.cuda), the CPU (vector instructions, native bf16), RAM
  gpu_models.py  GPU models by name: the one a memory size means, compute capability, cuBLAS workspace
  runtime.py     what a GPU process holds outside PyTorch's allocator, measured and remembered
  report.py      make gpu-info's text

It only reads facts; decisions live elsewhere (:mod:`sft_play.run`, the planner).
"""

from sft_play.hardware.gpu_models import (GPU_BY_MEMORY_GIB, GPU_CAPABILITY, MEMORY_GIB_BY_GPU, cublas_workspace_bytes,
                                          gpu_computes_bf16, gpu_model_for_memory, memory_gib_in_name)
from sft_play.hardware.machine import (GpuInfo, GpuLink, HardwareInfo, cpu_family_and_model, cuda_device_bf16, detect,
                                       native_bf16, usable_cores)
from sft_play.hardware.report import format_report
from sft_play.hardware.runtime import (PROBE, RUNTIME_RECORD, measure_outside_allocator, process_gpu_bytes,
                                       remember_outside_allocator, remembered_outside_allocator, runtime_key)

__all__ = [
    "GPU_BY_MEMORY_GIB", "GPU_CAPABILITY", "MEMORY_GIB_BY_GPU", "PROBE", "RUNTIME_RECORD", "GpuInfo", "GpuLink",
    "HardwareInfo",
    "cpu_family_and_model", "cublas_workspace_bytes", "cuda_device_bf16", "detect", "format_report",
    "gpu_computes_bf16", "gpu_model_for_memory", "measure_outside_allocator", "memory_gib_in_name", "native_bf16",
    "process_gpu_bytes",
    "remember_outside_allocator", "remembered_outside_allocator", "runtime_key", "usable_cores",
]
