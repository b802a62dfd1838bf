"""What this machine has: CUDA GPUs (NVML where present, else torch.cuda), the CPU (cores, vector
instructions, whether it computes bf16 natively) and RAM.

``detect()`` is the one source of hardware facts for ``make gpu-info``, ``make check`` and the
planner. It only reads facts; decisions live elsewhere. GPU indices are the ones CUDA uses in
this process (they honour ``CUDA_VISIBLE_DEVICES``); free memory is read through NVML, matched
to CUDA devices by UUID, so that asking does not create a CUDA context on every GPU. (Only
``measure_outside_allocator``, which ``make gpu-info`` runs once per GPU model and driver, creates
one, on the first GPU.)
"""

from __future__ import annotations

import dataclasses
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from sft_play.hardware.gpu_models import gpu_computes_bf16
from sft_play.hardware.runtime import remembered_outside_allocator

# NVML topology levels, nearest first (nvidia-smi topo -m spells them the same way).
_TOPOLOGY_NAMES = {0: "internal", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}


@dataclass
class GpuInfo:
    """One CUDA device as this process sees it."""

    index: int
    name: str
    total_bytes: int
    free_bytes: int
    compute_capability: tuple[int, int]
    bf16_supported: bool
    uuid: str = ""
    nvlinks_active: int | None = None


@dataclass
class GpuLink:
    """How two GPUs connect: NVLink count, or the PCIe/CPU level their paths meet at."""

    a: int
    b: int
    kind: str


@dataclass
class HardwareInfo:
    """GPUs, CPU and memory of this machine."""

    gpus: list[GpuInfo] = field(default_factory=list)
    links: list[GpuLink] = field(default_factory=list)
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    cuda_runtime_version: str | None = None
    nccl_version: str | None = None
    gpu_source: str = "none"
    cpu_physical_cores: int | None = None
    cpu_logical_cores: int = 1
    cpu_usable_cores: int = 1
    cpu_model: str = ""
    cpu_capability: str | None = None  # the vector instructions PyTorch's CPU kernels use (AVX2, AVX512, ...)
    cpu_bf16: bool = False  # the CPU computes bf16 matmuls in hardware (AMX, AVX512-BF16, Arm BF16)
    cpu_bf16_evidence: str = ""  # why cpu_bf16 is what it is
    ram_total_bytes: int = 0
    ram_available_bytes: int = 0
    python_version: str = ""
    torch_version: str | None = None
    platform: str = ""
    # What one training process held on these GPUs outside PyTorch's allocator (CUDA context,
    # kernels, libraries; NCCL's buffers with several processes), measured on this machine with
    # this driver and torch: bytes by the number of processes of the run that measured it ("1",
    # "8") and by make gpu-info's probe ("probe"), each where measured (remembered_outside_allocator)
    outside_allocator: dict[str, int] = field(default_factory=dict)

    @property
    def has_gpu(self) -> bool:
        return bool(self.gpus)

    def bf16_supported(self, on_gpu: bool) -> bool:
        """Whether the devices that train compute bf16 natively: every GPU (compute capability 8.0
        or newer) when training on GPUs, else this CPU."""
        return all(g.bf16_supported for g in self.gpus) if on_gpu and self.gpus else self.cpu_bf16

    def without_gpus(self) -> HardwareInfo:
        """This machine as processes that train on the CPU see it."""
        return dataclasses.replace(self, gpus=[], links=[])

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["has_gpu"] = self.has_gpu
        return data


def _decode(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _nvml_facts(uuids: list[str]) -> tuple[dict[str, dict[str, Any]], list[GpuLink], dict[str, str]]:
    """Free memory and NVLink counts by UUID, the links between them, and driver versions."""
    try:
        import pynvml
    except ImportError:
        return {}, [], {}
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver, or NVML absent in a container
        return {}, [], {}
    try:
        handles: dict[str, Any] = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            handles[_decode(pynvml.nvmlDeviceGetUUID(handle))] = handle
        facts: dict[str, dict[str, Any]] = {}
        for uuid in uuids:
            handle = handles.get(uuid)
            if handle is None:
                continue
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            active = 0
            for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
                try:
                    active += int(pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED)
                except pynvml.NVMLError:
                    break
            facts[uuid] = {"free": int(memory.free), "total": int(memory.total), "nvlinks": active}
        links = []
        for a, ua in enumerate(uuids):
            for b in range(a + 1, len(uuids)):
                ub = uuids[b]
                if ua not in handles or ub not in handles:
                    continue
                try:
                    level = pynvml.nvmlDeviceGetTopologyCommonAncestor(handles[ua], handles[ub])
                    kind = _TOPOLOGY_NAMES.get(int(level), str(level))
                except pynvml.NVMLError:
                    kind = "unknown"
                if facts.get(ua, {}).get("nvlinks") and facts.get(ub, {}).get("nvlinks"):
                    kind = f"NVLink ({kind} otherwise)"
                links.append(GpuLink(a, b, kind))
        versions = {"driver": _decode(pynvml.nvmlSystemGetDriverVersion())}
        cuda = pynvml.nvmlSystemGetCudaDriverVersion()
        versions["cuda_driver"] = f"{cuda // 1000}.{(cuda % 1000) // 10}"
        return facts, links, versions
    except Exception:
        return {}, [], {}
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


# CPU flags (Linux /proc/cpuinfo) that mean bf16 matrix arithmetic in hardware, and their names
NATIVE_BF16_FLAGS = {"amx_bf16": "AMX", "avx512_bf16": "AVX512-BF16", "bf16": "Arm BF16"}


def _cpuinfo() -> dict[str, str] | None:
    """The first processor's fields in /proc/cpuinfo (None where there is no such file)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def _cpu_flags_and_model() -> tuple[set[str] | None, str]:
    """The CPU's feature flags and model name from /proc/cpuinfo (None and the platform's
    processor string where there is no such file)."""
    fields = _cpuinfo()
    if fields is None:
        return None, platform.processor()
    flags = fields.get("flags", fields.get("Features"))
    return (None if flags is None else set(flags.split())), fields.get("model name") or platform.processor()


def cpu_family_and_model() -> str:
    """"CPU family 25, model 1" (x86's /proc/cpuinfo): which generation a CPU is where its model
    name does not say (a virtual machine's "AMD EPYC"); empty where it is not known."""
    fields = _cpuinfo() or {}
    if "cpu family" not in fields or "model" not in fields:
        return ""
    return f"CPU family {fields['cpu family']}, model {fields['model']}"


def native_bf16(flags: set[str] | None, torch_reports_bf16: bool) -> tuple[bool, str]:
    """Whether a CPU computes bf16 matmuls in hardware, and the evidence.

    PyTorch's report (``torch.ops.mkldnn._is_mkldnn_bf16_supported()``) is necessary but not
    enough: oneDNN also says yes on AVX512 CPUs without AVX512-BF16, where it emulates bf16 at
    a fraction of fp32's speed; on an AVX2-only CPU bf16 autocast is ~25x slower than fp32. So
    bf16 counts as native where PyTorch reports it and the CPU has AMX, AVX512-BF16 or Arm's
    BF16 extension (PyTorch's word alone where the flags cannot be read).

    Args:
        flags: the CPU's feature flags (``/proc/cpuinfo``), or None where unknown.
        torch_reports_bf16: what PyTorch's oneDNN reports.
    """
    if not torch_reports_bf16:
        return False, "PyTorch reports no bf16 support on this CPU"
    if flags is None:
        return True, "PyTorch reports bf16 support (CPU flags unreadable)"
    native = [name for flag, name in NATIVE_BF16_FLAGS.items() if flag in flags]
    if native:
        return True, " and ".join(native)
    return False, "no AMX, AVX512-BF16 or Arm BF16: bf16 would be emulated"


def cuda_device_bf16(device: str) -> bool:
    """Whether the CUDA device `device` (``cuda`` or ``cuda:N``) computes bf16 natively."""
    import torch

    return gpu_computes_bf16(torch.cuda.get_device_capability(torch.device(device)))


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity; all logical cores where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _cpu_and_memory(info: HardwareInfo) -> None:
    info.cpu_physical_cores = psutil.cpu_count(logical=False)
    info.cpu_logical_cores = psutil.cpu_count(logical=True) or 1
    info.cpu_usable_cores = usable_cores()
    memory = psutil.virtual_memory()
    info.ram_total_bytes = int(memory.total)
    info.ram_available_bytes = int(memory.available)


def detect() -> HardwareInfo:
    """Read this machine's GPUs, CPU and memory.

    Returns:
        A :class:`HardwareInfo`; ``gpus`` is empty on a machine without a usable CUDA GPU.
    """
    info = HardwareInfo(python_version=platform.python_version(), platform=platform.platform())
    _cpu_and_memory(info)
    try:
        import torch
    except ImportError:
        return info
    info.torch_version = torch.__version__
    info.cuda_runtime_version = torch.version.cuda
    flags, info.cpu_model = _cpu_flags_and_model()
    try:
        info.cpu_capability = torch.backends.cpu.get_cpu_capability()
        reported = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN
        reported = False
    info.cpu_bf16, info.cpu_bf16_evidence = native_bf16(flags, reported)
    if not torch.cuda.is_available():
        return info
    count = torch.cuda.device_count()
    props = [torch.cuda.get_device_properties(i) for i in range(count)]
    uuids = [f"GPU-{p.uuid}" if hasattr(p, "uuid") else "" for p in props]
    nvml, links, versions = _nvml_facts(uuids)
    info.gpu_source = "nvml" if nvml else "torch"
    info.links = links
    info.driver_version = versions.get("driver")
    info.cuda_driver_version = versions.get("cuda_driver")
    try:
        nccl = torch.cuda.nccl.version()
        info.nccl_version = ".".join(str(v) for v in nccl) if isinstance(nccl, tuple) else str(nccl)
    except Exception:
        info.nccl_version = None
    for i, p in enumerate(props):
        facts = nvml.get(uuids[i])
        if facts is not None:
            free, total, nvlinks = facts["free"], facts["total"], facts["nvlinks"]
        else:
            free, total = torch.cuda.mem_get_info(i)
            nvlinks = None
        info.gpus.append(
            GpuInfo(
                index=i,
                name=p.name,
                total_bytes=int(total),
                free_bytes=int(free),
                compute_capability=(p.major, p.minor),
                bf16_supported=gpu_computes_bf16((p.major, p.minor)),
                uuid=uuids[i],
                nvlinks_active=nvlinks,
            )
        )
    info.outside_allocator = remembered_outside_allocator(info)
    return info
