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
    return {"ok": False, "error": (result.stderr.strip().splitlines() or ["no output"])[-1][:300]}


def versions() -> str:
    import accelerate
    import peft
    import torch
    import transformers
    import trl

    return (f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, "
            f"peft {peft.__version__}, accelerate {accelerate.__version__}, Python {platform.python_version()}")
