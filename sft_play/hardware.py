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
import json
import os
import platform
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from sft_play.paths import cache_dir
from sft_play.units import GIB

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


# The GPU a memory size most often means, when hardware is described by its memory alone
GPU_BY_MEMORY_GIB = {24: "A10G", 40: "A100", 48: "L40S", 80: "H100", 94: "H100", 141: "H200", 180: "B200"}


# Compute capability of the GPU models the planner names (described hardware: no device to ask)
GPU_CAPABILITY = {"H100": (9, 0), "H100 PCIe": (9, 0), "H200": (9, 0), "B200": (10, 0), "A100": (8, 0),
                  "L40S": (8, 9), "A10G": (8, 6), "L4": (8, 9), "RTX 4090": (8, 9), "A6000": (8, 6)}


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


def runtime_key(info: HardwareInfo) -> str | None:
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


def remembered_outside_allocator(info: HardwareInfo) -> dict[str, int]:
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


def remember_outside_allocator(info: HardwareInfo, kind: str, measured_bytes: int) -> None:
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


def format_report(info: HardwareInfo) -> str:
    """A plain-text report of :func:`detect`'s facts, as ``make gpu-info`` prints it."""
    lines = []
    if info.gpus:
        lines.append(f"CUDA GPUs: {len(info.gpus)} (memory read through {info.gpu_source})")
        lines.append(f"  {'idx':>3}  {'name':<28} {'total GiB':>9} {'free GiB':>9}  {'cc':>4}  bf16  nvlinks")
        for g in info.gpus:
            nvl = "-" if g.nvlinks_active is None else str(g.nvlinks_active)
            lines.append(
                f"  {g.index:>3}  {g.name[:28]:<28} {g.total_bytes / GIB:>9.2f} {g.free_bytes / GIB:>9.2f}  "
                f"{g.compute_capability[0]}.{g.compute_capability[1]:<2}  {'yes' if g.bf16_supported else 'no ':<4}  {nvl}"
            )
        lines.append(
            f"  driver {info.driver_version or 'unknown'}, CUDA driver {info.cuda_driver_version or 'unknown'}, "
            f"CUDA runtime (torch) {info.cuda_runtime_version or 'unknown'}, NCCL {info.nccl_version or 'unknown'}"
        )
        if info.links:
            lines.append("  links: " + "; ".join(f"{l.a}-{l.b}: {l.kind}" for l in info.links))
        if info.outside_allocator:
            lines.append("  outside PyTorch's allocator, per training process (measured here; the planner uses it): "
                         + ", ".join(f"{v / GIB:.2f} GiB " + ("(make gpu-info's probe)" if k == PROBE else
                                                              f"(a run of {k} process(es))")
                                     for k, v in sorted(info.outside_allocator.items())))
    else:
        reason = "torch is not installed" if info.torch_version is None else "torch sees no CUDA device"
        lines.append(f"No CUDA GPU found ({reason}). Training runs on the CPU; make plan plans that CPU run, or GPUs you describe: NUM_GPUS=8 VRAM_GIB=80.")
    physical = info.cpu_physical_cores if info.cpu_physical_cores is not None else "?"
    lines.append(
        f"CPU: {info.cpu_model or 'unknown model'}, {physical} physical / {info.cpu_logical_cores} logical cores "
        f"({info.cpu_usable_cores} usable by this process); RAM {info.ram_total_bytes / GIB:.1f} GiB total, "
        f"{info.ram_available_bytes / GIB:.1f} GiB available"
    )
    if info.torch_version is not None:
        lines.append(f"  vector instructions {info.cpu_capability or 'unknown'}; native bf16: "
                     f"{'yes' if info.cpu_bf16 else 'no'} ({info.cpu_bf16_evidence})")
    lines.append(f"Python {info.python_version}, torch {info.torch_version or 'not installed'}, {info.platform}")
    return "\n".join(lines)


def sanitized_cuda_arch_list(value: str | None) -> str | None:
    """``TORCH_CUDA_ARCH_LIST`` without architecture suffixes (``9.0a`` -> ``9.0``): DeepSpeed
    0.19 parses each entry as numbers and fails on ``9.0a`` ("invalid literal for int()")."""
    if not value:
        return value
    return re.sub(r"(\d+\.\d+)[a-z]+", r"\1", value)
