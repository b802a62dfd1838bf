"""The tiny vision-language default beside TRL's own vision path, on this machine: what
`make train CONFIG=configs/run_tiny_vlm.yaml` takes and what it learned, and the same model, data,
steps, batch and learning rate through TRL's ``SFTTrainer`` with its processor and its vision
collator (``DataCollatorForVisionLanguageModeling``: images processed per batch, labels on every
token but padding, as TRL trains a template without generation markers). Writes
docs/reports/tiny_vlm.md.

Both sides start from the same initialised weights (configs/tiny_vlm, model.init_seed 0) with the
vision encoder frozen and the projector training (the config's finetune keys, applied to TRL's
model the same way); each trains in a fresh process, timed from start to exit. Both are scored the
same way: greedy answers to the 32 held-out colour questions (data/tiny_vlm/validation.jsonl), exact
match.

Paths, as bench/tiny_default.py's: ``auto`` (bf16 autocast where this CPU computes bf16 natively) and
``without-bf16`` (oneDNN and ATen capped at AVX2: fp32, as on a CPU without native bf16).

Usage: python bench/tiny_vlm.py [--paths auto without-bf16] [--out docs/reports/tiny_vlm.md]
       [--steps N --count N]   (fewer steps and held-out questions: a smoke run, as the tests do)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO, REPORTS, run_python, versions, worker_env
from tiny_default import PATHS, hardware_line, train

CONFIG = "configs/run_tiny_vlm.yaml"


def ours(path: str, root: Path, steps: int | None) -> dict:
    """`make train CONFIG=configs/run_tiny_vlm.yaml` in a fresh process (bench/tiny_default.py's way)."""
    row = train(42, path, root, steps, config=CONFIG, name=f"sft-play-{path}")
    return {"side": "SFT-Play", "path": path, "precision": row["precision"], "wall_s": row["wall_s"],
            "train_s": row["train_s"], "steps": row["steps"], "model": row["run"]}


def theirs(path: str, root: Path, steps: int | None) -> dict:
    """TRL's vision path in a fresh process (this script's --trl worker)."""
    started = time.monotonic()
    result = run_python([__file__, "--trl", root / f"trl-{path}"] + (["--steps", steps] if steps else []),
                        cwd=REPO, env={**worker_env(), **PATHS[path]})
    wall = time.monotonic() - started
    line = next((line for line in reversed(result.stdout.splitlines()) if line.startswith("{")), None)
    if result.returncode != 0 or line is None:
        raise SystemExit(f"TRL ({path}) failed:\n{result.stderr[-3000:]}")
    return {"side": "TRL", "path": path, "wall_s": wall, **json.loads(line)}


def trl_worker(folder: Path, steps: int | None) -> None:
    """Train with TRL's SFTTrainer and vision collator as its docs show, save model and processor."""
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from trl import SFTConfig, SFTTrainer

    import datasets
    from sft_play import config as config_module
    from sft_play import model as model_module

    config = config_module.load(CONFIG)
    rows = [json.loads(line) for line in (REPO / config.data.path).read_text().splitlines()]
    base = REPO / Path(config.data.path).parent
    examples = [{"images": [Image.open(base / name).convert("RGB") for name in row["images"]],
                 "messages": row["messages"]} for row in rows]
    bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())  # as train.mixed_precision=auto decides on a CPU
    processor = AutoProcessor.from_pretrained(config.model.name_or_path)
    model = AutoModelForImageTextToText.from_pretrained(model_module.weights_location(config), dtype=torch.float32)
    model_module.freeze_vision(model, config)  # the same parts train on both sides
    arguments = SFTConfig(
        output_dir=str(folder / "checkpoints"), per_device_train_batch_size=config.train.global_batch_size,
        gradient_accumulation_steps=1, learning_rate=config.train.learning_rate, lr_scheduler_type="cosine",
        warmup_steps=config.train.warmup_ratio, max_steps=steps or config.train.max_steps, bf16=bf16,
        max_length=None, logging_steps=config.train.logging_steps, save_strategy="no", report_to="none",
        seed=config.train.seed, use_cpu=True, dataloader_num_workers=0)
    trainer = SFTTrainer(model=model, args=arguments, train_dataset=datasets.Dataset.from_list(examples),
                         processing_class=processor)
    started = time.monotonic()
    output = trainer.train()
    trained = time.monotonic() - started
    trainer.save_model(str(folder / "model"))
    processor.save_pretrained(str(folder / "model"))
    print(json.dumps({"precision": "bf16" if bf16 else "no", "train_s": trained, "steps": output.global_step,
                      "model": str(folder / "model")}), flush=True)


def score(model_path: str, count: int = 10_000) -> dict:
    """Exact matches of greedy answers to the first `count` held-out questions (make generate's way)."""
    from sft_play import config as config_module
    from sft_play import export

    model, processor, _ = export.load_trained(model_path, device="cpu")
    prompts = export.held_out_prompts(config_module.load(CONFIG), count)
    right = [export.generate(model, processor, p, 8) == p.reference for p in prompts]
    return {"exact": sum(right), "of": len(right)}


def train_and_score(paths: list[str], root: Path, steps: int | None, count: int) -> list[dict]:
    """Both sides trained on each path into `root`, then scored: the report's rows."""
    rows = []
    for path in paths:
        for side in (ours, theirs):
            row = side(path, root, steps)
            row.update(score(row["model"], count))
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def report(rows: list[dict]) -> str:
    lines = [
        "# The tiny vision-language default beside TRL's vision path",
        "",
        "Written by `python bench/tiny_vlm.py` (see its docstring). Each side trains",
        f"`{CONFIG}`'s model (a 1M-parameter Gemma-3 shape, encoder frozen, projector training) on its 480",
        "colour questions for the same steps, batch and learning rate, from the same initialised weights, in a",
        "fresh process timed start to exit (the stack installed); both are scored by exact match of greedy",
        "answers to the 32 held-out questions. TRL's collator labels every token but padding (its",
        "`assistant_only_loss` needs a template with generation markers, which this one has not), SFT-Play's",
        "the answers only, so their losses are not compared.",
        "",
        f"- hardware: {hardware_line()} (no GPU)",
        f"- software: {versions()}",
        "",
        "| path | side | precision | wall | training | steps | held-out exact |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['path']} | {r['side']} | {r['precision']} | {r['wall_s']:.0f} s | {r['train_s']:.1f} s | "
                     f"{r['steps']} | {r['exact']} of {r['of']} |")
    return "\n".join([*lines, ""])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", nargs="+", choices=sorted(PATHS), default=["auto", "without-bf16"])
    parser.add_argument("--steps", type=int, help="train this many steps instead of the config's (a smoke run)")
    parser.add_argument("--count", type=int, default=10_000, help="held-out questions to score (default all 32)")
    parser.add_argument("--out", default=str(REPORTS / "tiny_vlm.md"))
    parser.add_argument("--trl", help=argparse.SUPPRESS)  # the worker: TRL's side, into this folder
    args = parser.parse_args()
    from sft_play.cli import quiet_libraries

    quiet_libraries()
    if args.trl:
        trl_worker(Path(args.trl), args.steps)
        return 0
    with tempfile.TemporaryDirectory(prefix="tiny-vlm-") as root:
        rows = train_and_score(args.paths, Path(root), args.steps, args.count)
    Path(args.out).write_text(report(rows))
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
