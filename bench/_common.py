"""What the benchmarks share: workers in fresh processes, and the versions a report names."""

from __future__ import annotations

import importlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "tests" / "fixtures" / "model_configs"
REPORTS = REPO / "docs" / "reports"  # where every bench writes its report by default


def worker_env() -> dict[str, str]:
    """The caller's environment with the repository importable: its PYTHONPATH entries are kept
    (packages installed there stay visible to the worker) and the repository root appended."""
    entries = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(REPO) not in entries:
        entries.append(str(REPO))
    return {**os.environ, "PYTHONPATH": os.pathsep.join(entries)}


def run_python(args: list, env: dict | None = None, timeout: float | None = None,
               cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """``python ARGS`` in a fresh process (the caller's environment with the repository importable,
    unless `env`), its output captured as text. The benches start their processes here, so that
    their tests can start them from an interpreter that has already imported torch (the imports
    are most of a small run's CPU)."""
    return subprocess.run([sys.executable, *map(str, args)], check=False, capture_output=True, text=True,
                          timeout=timeout, env=env or worker_env(), cwd=cwd)


def run_worker(script: str | Path, spec: dict, timeout: int) -> dict:
    """Run `script --worker SPEC` in a fresh process (a clean allocator, and an out-of-memory
    error that cannot poison the next measurement); its last JSON line, or ``{"ok": False,
    "error": ...}``."""
    try:
        result = run_python([script, "--worker", json.dumps(spec)], timeout=timeout)
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


def import_training_stack() -> None:
    """Import what a measured training uses, with Python's garbage collector paused and what the
    imports made frozen after (:func:`sft_play.cli.importing`, about 1 s of a worker's CPU
    otherwise). Call it after :func:`lean`."""
    from sft_play import cli

    with cli.importing():
        for name in ("torch", "transformers", "datasets", "accelerate", "peft", "trl"):
            importlib.import_module(name)


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


def margins(model, tokenizer, puzzles: list[tuple[list[dict], str]]) -> list[float]:
    """Each (messages, answer) puzzle's margin: the answer is fed after its question (teacher forcing,
    one forward pass per 64 puzzles) and the margin is the smallest gap, over the answer's tokens and
    its end-of-answer token, between the right token's logit and the best other one. Above 0 exactly
    when greedy decoding writes the answer; near 0, another CPU's arithmetic (the same sums in another
    order) can flip it."""
    import torch

    found = []
    for start in range(0, len(puzzles), 64):
        batch = puzzles[start:start + 64]
        rows, spans = [], []
        for messages, answer in batch:
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
            whole = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": answer}],
                                                  return_dict=True)["input_ids"]
            assert whole[:len(prompt)] == prompt, "the answer does not extend the prompt's tokens"
            end = whole.index(tokenizer.eos_token_id, len(prompt)) + 1
            rows.append(whole[:end])
            spans.append((len(prompt), end))
        ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(rows):
            ids[i, :len(row)] = torch.tensor(row)
            mask[i, :len(row)] = 1
        with torch.no_grad():
            logits = model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device)).logits.float().cpu()
        for i, (first, end) in enumerate(spans):
            step = logits[i, first - 1:end - 1]
            target = ids[i, first:end, None]
            right = step.gather(1, target)[:, 0]
            found.append((right - step.scatter(1, target, float("-inf")).max(1).values).min().item())
    return found
