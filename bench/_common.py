"""What the benchmarks share: workers in fresh processes, and the versions a report names."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "tests" / "fixtures" / "model_configs"


def worker_env() -> dict[str, str]:
    """The caller's environment with the repository importable: its PYTHONPATH entries are kept
    (packages installed there stay visible to the worker) and the repository root appended."""
    entries = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(REPO) not in entries:
        entries.append(str(REPO))
    return {**os.environ, "PYTHONPATH": os.pathsep.join(entries)}


def run_worker(script: str | Path, spec: dict, timeout: int) -> dict:
    """Run `script --worker SPEC` in a fresh process (a clean allocator, and an out-of-memory
    error that cannot poison the next measurement); its last JSON line, or ``{"ok": False,
    "error": ...}``."""
    try:
        result = subprocess.run([sys.executable, str(script), "--worker", json.dumps(spec)], capture_output=True,
                                text=True, timeout=timeout, env=worker_env())
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": "timeout"}
    for line in reversed(result.stdout.splitlines()):
        if line.startswith("{"):  # the worker's report; the trainer's own logs print Python dicts
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    if "out of memory" in result.stderr.lower():
        return {"ok": False, "error": "out of memory"}
    said = (result.stderr.strip().splitlines() or ["no output"])[-1][:300]
    return {"ok": False, "error": f"exit status {result.returncode}: {said}"}


def lean(method: str | None = None) -> None:
    """Skip bitsandbytes in this process unless it trains QLoRA (sft_play.lean_imports: peft
    imports it whenever installed, about 1-2 s of a process's start; planning never needs it).
    Call it before anything imports peft."""
    from sft_play import lean_imports

    if method != "qlora":
        lean_imports.without_bitsandbytes()


def process_gpu_bytes() -> int:
    """What NVML says this process holds on its (first visible) GPU: the CUDA context and
    everything beside torch's allocator, plus what the allocator has reserved; the device's
    used memory where NVML does not list processes."""
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or 0))
    pid = os.getpid()
    for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
        if process.pid == pid:
            return int(process.usedGpuMemory or 0)
    return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)


def versions() -> str:
    import accelerate
    import peft
    import torch
    import transformers
    import trl

    return (f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, "
            f"peft {peft.__version__}, accelerate {accelerate.__version__}, Python {platform.python_version()}")
