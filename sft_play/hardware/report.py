"""``make gpu-info``'s report: the facts :func:`sft_play.hardware.detect` read, in plain text."""

from __future__ import annotations

from sft_play.hardware.machine import HardwareInfo
from sft_play.hardware.runtime import PROBE
from sft_play.units import GIB

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
            lines.append("  links: " + "; ".join(f"{link.a}-{link.b}: {link.kind}" for link in info.links))
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
