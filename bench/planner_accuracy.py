"""Planner accuracy: predicted against measured peak memory over a grid of real training steps,
and the largest micro-batch that really fits against the one the planner picks.

Each measurement runs in its own process (a clean allocator, and an out-of-memory error that
cannot poison the next one): the worker trains a few steps through SFT-Play's own path
(model loading, peft, TRL's SFTTrainer, the packed-rows collator) on random packed rows with
random weights built from a public model config, and reports ``torch.cuda.max_memory_reserved``
plus the CUDA context (NVML's view of the process minus what torch reserved). On a machine
without a GPU the same code runs a tiny shape on the CPU against host memory (peak RSS), so
that the script cannot rot; the report then says plainly that no GPU figure exists.

Usage:
  python bench/planner_accuracy.py [--grid default|quick|cpu] [--output docs/planner_accuracy.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CONFIGS = REPO / "tests" / "fixtures" / "model_configs"
GIB = 1024**3


@dataclass(frozen=True)
class Case:
    """One row of the grid: a model shape, a method and a workload."""

    model: str
    method: str
    seq_len: int
    checkpointing: bool
    micro_batches: tuple[int, ...]

    def overrides(self, micro: int, output_dir: str) -> list[str]:
        return [
            f"model.name_or_path={self.model}",
            f"finetune.method={self.method}",
            f"data.max_seq_length={self.seq_len}",
            f"train.gradient_checkpointing={str(self.checkpointing).lower()}",
            f"train.micro_batch_size={micro}",
            f"train.global_batch_size={micro}",
            "train.gradient_accumulation_steps=1",
            "train.max_steps=3",
            "train.logging_steps=1",
            "train.tensorboard=false",
            f"train.output_dir={output_dir}",
            "lora.r=16",
        ]


GRIDS = {
    "default": [
        Case(str(CONFIGS / "qwen2.5-0.5b"), method, seq, ckpt, (1, 2, 4, 8))
        for method in ("full", "lora", "qlora") for seq in (1024, 4096) for ckpt in (False, True)
    ] + [
        Case(str(CONFIGS / "llama-3.1-8b"), method, 2048, ckpt, (1, 2, 4))
        for method in ("lora", "qlora") for ckpt in (False, True)
    ],
    "quick": [
        Case(str(CONFIGS / "qwen2.5-0.5b"), method, 2048, ckpt, (1, 4))
        for method in ("full", "lora", "qlora") for ckpt in (False, True)
    ],
    "cpu": [Case(str(REPO / "configs" / "tiny_model"), "lora", 128, False, (1, 4))],
}


def _worker(case: Case, micro: int, output_dir: str) -> dict:
    """Train a few steps of `case` at `micro` in this process and report the peak."""
    import datasets
    import torch

    from sft_play import config as config_module
    from sft_play import model, training
    from sft_play.data import collate
    from sft_play.planner.choose import BatchSplit
    from sft_play.precision import resolve_precision

    on_cuda = torch.cuda.is_available()
    config = config_module.load(None, case.overrides(micro, output_dir), check_paths=False)
    import psutil

    host_baseline = psutil.Process().memory_info().rss  # imports done, nothing of the run allocated
    context = 0
    if on_cuda:
        torch.cuda.init()
        torch.empty(1, device="cuda")
        context = _process_gpu_bytes() - torch.cuda.memory_reserved()
    precision = resolve_precision(config, has_gpu=on_cuda, bf16_supported=on_cuda)
    tokenizer_dir = REPO / "configs" / "tiny_model"
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    base = model.load_model(config, precision, device="cuda:0" if on_cuda else "cpu")
    vocab = base.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    rows = 3 * micro
    ids = torch.randint(3, vocab, (rows, case.seq_len), generator=generator).tolist()
    dataset = datasets.Dataset.from_dict({"input_ids": ids, "labels": ids, "seq_lengths": [[case.seq_len]] * rows})
    attention = model.attention_implementation(config, precision)
    collator = collate.make_collator(tokenizer.pad_token_id, True, attention)
    make = training.trainer_factory(config, precision, Path(output_dir), base, model.lora_config(config), tokenizer,
                                    dataset, None, collator)
    trainer = make(BatchSplit(micro, 1, 1, micro))
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    if on_cuda:
        peak = torch.cuda.max_memory_reserved() + context
    else:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - host_baseline
    return {"ok": True, "peak_bytes": int(peak), "context_bytes": int(context)}


def _process_gpu_bytes() -> int:
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or 0))
    pid = os.getpid()
    for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
        if process.pid == pid:
            return int(process.usedGpuMemory or 0)
    return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)


def measure(case: Case, micro: int, timeout: int) -> dict:
    """Run the worker for one (case, micro) in a fresh process."""
    import tempfile

    with tempfile.TemporaryDirectory() as output_dir:
        spec = json.dumps({"case": asdict(case), "micro": micro, "output_dir": output_dir})
        try:
            result = subprocess.run([sys.executable, __file__, "--worker", spec], capture_output=True, text=True,
                                    timeout=timeout, env={**os.environ, "PYTHONPATH": str(REPO)})
        except subprocess.TimeoutExpired:
            return {"ok": False, "error": "timeout"}
    for line in reversed(result.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    error = "out of memory" if "out of memory" in result.stderr.lower() else result.stderr.strip().splitlines()[-1:]
    return {"ok": False, "error": error}


def predict(case: Case, micro: int, target) -> tuple[int, int]:
    """The planner's peak at `micro`, and the micro-batch it would pick for this case."""
    from sft_play import config as config_module
    from sft_play.planner import make_plan

    config = config_module.load(None, case.overrides(micro, "/tmp/unused"), check_paths=False)
    fixed = make_plan(config, target, with_remedies=False)
    config_auto = config_module.load(
        None, case.overrides(micro, "/tmp/unused") + ["train.micro_batch_size=auto",
                                                       f"train.global_batch_size={max(case.micro_batches) * 8}"],
        check_paths=False,
    )
    chosen = make_plan(config_auto, target, with_remedies=False).micro_batch_size
    return fixed.peak_bytes_per_gpu, chosen


def largest_real_micro(case: Case, start: int, timeout: int) -> int:
    """The largest micro-batch that really trains, by doubling then bisecting from `start`."""
    low, high = 0, None
    micro = max(1, start)
    while high is None:
        if measure(case, micro, timeout)["ok"]:
            low, micro = micro, micro * 2
            if micro > 4096:
                return low
        else:
            high = micro
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if measure(case, middle, timeout)["ok"] else (low, middle)
    return low


def versions() -> str:
    import accelerate
    import peft
    import torch
    import transformers
    import trl

    return (f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, "
            f"peft {peft.__version__}, accelerate {accelerate.__version__}, Python {platform.python_version()}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", choices=sorted(GRIDS), default=None, help="default on a GPU, cpu without one")
    parser.add_argument("--output", default=str(REPO / "docs" / "planner_accuracy.md"))
    parser.add_argument("--search", action="store_true", help="also search the largest micro-batch that really fits")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per measurement")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        case = Case(**{**spec["case"], "micro_batches": tuple(spec["case"]["micro_batches"])})
        print(json.dumps(_worker(case, spec["micro"], spec["output_dir"])))
        return 0

    import torch

    from sft_play import hardware
    from sft_play.planner import Target, target_for

    on_cuda = torch.cuda.is_available()
    grid = GRIDS[args.grid or ("default" if on_cuda else "cpu")]
    facts = hardware.detect()
    target = target_for(facts, gpus=1, allow_cpu=True)
    if on_cuda:  # plan against the whole device: the measurement is of one process alone on it
        target = Target(1, facts.gpus[0].total_bytes, facts.gpus[0].name)
    started = time.time()
    rows, errors, choices = [], [], []
    for case in grid:
        for micro in case.micro_batches:
            predicted, chosen = predict(case, micro, target)
            result = measure(case, micro, args.timeout)
            measured = result.get("peak_bytes")
            error = (predicted - measured) / measured if measured else None
            if error is not None:
                errors.append(abs(error))
            rows.append((case, micro, predicted, measured, error, result.get("error")))
            print(f"{Path(case.model).name} {case.method} seq {case.seq_len} ckpt {case.checkpointing} micro {micro}: "
                  f"predicted {predicted / GIB:.2f} GiB, measured "
                  f"{measured / GIB if measured else float('nan'):.2f} GiB", flush=True)
        if args.search:
            real = largest_real_micro(case, max(case.micro_batches), args.timeout)
            _, chosen = predict(case, 1, target)
            chosen_ok = measure(case, chosen, args.timeout)["ok"] if chosen else True
            choices.append((case, chosen, real, chosen_ok))
    report = render(rows, errors, choices, facts, on_cuda, args, time.time() - started)
    Path(args.output).write_text(report)
    print(f"wrote {args.output}")
    return 0


def render(rows, errors, choices, facts, on_cuda, args, seconds) -> str:
    device = facts.gpus[0].name if on_cuda else f"CPU ({facts.cpu_logical_cores} cores), host memory"
    command = "python bench/planner_accuracy.py " + " ".join(a for a in sys.argv[1:] if a != "--worker")
    lines = ["# Planner accuracy", ""]
    if not on_cuda:
        lines += [
            "**No GPU figure exists yet.** This report was produced on a machine without a GPU: it ran the",
            "CPU path (a tiny shape against host memory: the process's peak RSS above its RSS after imports),",
            "which checks that the benchmark works, not how accurate the planner is on a GPU. Run the",
            "command below on a GPU (an H100 is the reference) to measure that.",
            "",
        ]
    lines += [
        f"- device: {device}",
        f"- versions: {versions()}",
        f"- command: `{command.strip()}`",
        f"- wall time: {seconds:.0f} s",
        "- measured: `torch.cuda.max_memory_reserved()` after 3 training steps plus the CUDA context "
        "(NVML's per-process usage minus torch's reservation right after initialisation)",
        "- predicted: `make_plan` for the same config on the same device (`peak_bytes_per_gpu`)",
        "",
        "| model | method | seq | ckpt | micro | predicted GiB | measured GiB | error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case, micro, predicted, measured, error, failure in rows:
        measured_text = f"{measured / GIB:.2f}" if measured else f"({failure})"
        error_text = f"{100 * error:+.1f}%" if error is not None else "-"
        lines.append(f"| {Path(case.model).name} | {case.method} | {case.seq_len} | {'on' if case.checkpointing else 'off'} "
                     f"| {micro} | {predicted / GIB:.2f} | {measured_text} | {error_text} |")
    if errors:
        lines += ["", f"Median absolute error {100 * statistics.median(errors):.1f}%, "
                      f"max {100 * max(errors):.1f}% over {len(errors)} measurements."]
    if choices:
        lines += ["", "| model | method | seq | ckpt | planner's micro | largest that trains | ratio | planner's runs |",
                  "|---|---|---|---|---|---|---|---|"]
        for case, chosen, real, ok in choices:
            ratio = chosen / real if real else float("nan")
            lines.append(f"| {Path(case.model).name} | {case.method} | {case.seq_len} | "
                         f"{'on' if case.checkpointing else 'off'} | {chosen} | {real} | {ratio:.2f} | {'yes' if ok else 'OOM'} |")
    lines += ["", "Targets (issue 4): median absolute error <= 3%, max <= 8%, no planned micro-batch that runs out of",
              "memory, planner's micro-batch >= 90% of the largest that really fits."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
