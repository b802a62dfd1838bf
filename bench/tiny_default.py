"""The embedded default on this machine: what `make train` takes and what it learned, for each
seed and each precision path a CPU can take; writes docs/reports/tiny_default.md.

For every seed and path it trains configs/run_tiny.yaml as `make train` does (a fresh process,
timed from start to exit), then scores the run: `make generate`'s five held-out prompts and all
200 held-out puzzles, greedy, exact match (what `make eval ARGS="--count 200"` counts), and the
five's smallest logit margin (`_common.margins`: how far the closest answer is from flipping).

Paths:
  auto           train.mixed_precision=auto as this CPU resolves it (bf16 where it is native)
  without-bf16   the same CPU seen as one without native bf16: oneDNN and ATen capped at AVX2
                 (ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2), so auto resolves to fp32
                 and the matmuls run AVX2 kernels, as on an AVX2-only CPU (whose own clock and
                 memory still differ: a real one is slower)

Usage: python bench/tiny_default.py [--seeds 42 1 2] [--paths auto without-bf16] [--out docs/reports/tiny_default.md]
       [--steps N --count N]   (fewer steps and held-out puzzles: a smoke run, as the tests do)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO, REPORTS, margins, run_python, versions, worker_env

CAPPED = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
PATHS = {"auto": {}, "without-bf16": CAPPED}


def train(seed: int, path: str, root: Path, steps: int | None = None, config: str = "configs/run_tiny.yaml",
          name: str | None = None) -> dict:
    """Train `config` (the default) once in a fresh process, as `make train` does; the run's summary
    plus the wall time."""
    name = name or f"seed{seed}-{path}"
    more = [f"train.max_steps={steps}"] if steps else []
    started = time.monotonic()
    result = run_python(["scripts/train_distributed.py", "--config", config, f"train.seed={seed}",
                         f"train.output_dir={root}", f"train.run_name={name}", "train.tensorboard=false", *more],
                        cwd=REPO, env={**worker_env(), **PATHS[path]})
    wall = time.monotonic() - started
    if result.returncode != 0:
        raise SystemExit(f"{name} failed:\n{result.stderr[-3000:]}")
    return trained(result, root / name, seed, path, wall)


def trained(result: subprocess.CompletedProcess, run: Path, seed: int, path: str, wall: float) -> dict:
    """A finished training's row: its summary, and the precision its start-up line names."""
    summary = json.loads((run / "summary.json").read_text())
    precision = next((line.split("mixed precision ", 1)[1].split(" (")[0] for line in result.stderr.splitlines()
                      if "mixed precision " in line), "?")
    return {"run": str(run), "seed": seed, "path": path, "precision": precision, "wall_s": wall,
            "train_s": summary["train_runtime_s"], "first_loss": summary["first_loss"],
            "last_loss": summary["last_loss"], "steps": summary["global_step"]}


def score(run: str, count: int = 200) -> dict:
    """Greedy answers to the held-out puzzles: the first five (make generate) and the first `count`."""
    from sft_play import export

    model, tokenizer, config = export.load_trained(run, device="cpu")
    prompts = export.held_out_prompts(config, count)
    right = [export.generate(model, tokenizer, p, 32) == p.reference for p in prompts]
    five = margins(model, tokenizer, [(p.messages, p.reference) for p in prompts[:5]])
    return {"first5": sum(right[:5]), "five_margin": min(five), "held_out": sum(right), "held_out_of": len(right)}


def hardware_line() -> str:
    from sft_play import hardware

    facts = hardware.detect()
    generation = hardware.cpu_family_and_model()  # a virtual machine's model name does not say it
    return (f"{facts.cpu_model or 'unknown CPU'}{f' ({generation})' if generation else ''}, "
            f"{facts.cpu_usable_cores} usable cores, vector instructions "
            f"{facts.cpu_capability}, native bf16: {'yes' if facts.cpu_bf16 else 'no'} ({facts.cpu_bf16_evidence})")


def report(rows: list[dict]) -> str:
    lines = [
        "# The embedded default: time and result per seed and precision path",
        "",
        "Written by `python bench/tiny_default.py` (see its docstring for the paths). Each run is",
        "`configs/run_tiny.yaml` trained in a fresh process as `make train` runs it; the wall time is",
        "the process's, start to exit, with the stack already installed; held-out answers are greedy",
        "and scored by exact match.",
        "",
        f"- hardware: {hardware_line()} (no GPU)",
        f"- software: {versions()}",
        "",
        "| seed | path | precision | wall | training | loss | make generate | smallest margin of the five | held-out |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['seed']} | {r['path']} | {r['precision']} | {r['wall_s']:.0f} s | {r['train_s']:.0f} s | "
                     f"{r['first_loss']:.2f} -> {r['last_loss']:.3f} in {r['steps']} | {r['first5']}/5 | {r['five_margin']:.2f} | "
                     f"{r['held_out']} of {r['held_out_of']} |")
    if any(r["path"] == "without-bf16" for r in rows):
        lines += ["", "The without-bf16 rows are this CPU capped at AVX2 (oneDNN and ATen): the arithmetic of a CPU",
                  "without native bf16, at this CPU's speed. A real one, an AMD EPYC of the Zen 3 generation (AVX2",
                  "only), is measured in docs/reports/tiny_default_zen3.md (its `auto` path is fp32)."]
    return "\n".join([*lines, ""])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 1, 2])
    parser.add_argument("--paths", nargs="+", choices=sorted(PATHS), default=["auto", "without-bf16"])
    parser.add_argument("--out", default=str(REPORTS / "tiny_default.md"))
    parser.add_argument("--steps", type=int, help="train this many steps instead of the config's (a smoke run)")
    parser.add_argument("--count", type=int, default=200, help="held-out puzzles to score (default all 200)")
    args = parser.parse_args()
    from sft_play.cli import quiet_libraries

    quiet_libraries()
    rows = []
    with tempfile.TemporaryDirectory(prefix="tiny-default-") as root:
        for seed in args.seeds:
            for path in args.paths:
                row = train(seed, path, Path(root), args.steps)
                row.update(score(row["run"], args.count))
                print(json.dumps(row), flush=True)
                rows.append(row)
    Path(args.out).write_text(report(rows))
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
