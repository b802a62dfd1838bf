"""Recipes for the embedded default: how near each comes to answering every letter puzzle, and how
much margin its answers have; writes docs/reports/tiny_recipes.md.

Each recipe is `configs/run_tiny.yaml` with a few changes (overrides, a reshaped model config, or
another mix of training puzzles), trained with each seed of --seeds (42 unless given) in a fresh process on
the fp32 path a CPU without native bf16 takes (oneDNN and ATen capped at AVX2, as
`bench/tiny_default.py`'s without-bf16 path), or with `--path auto` on the path this CPU takes (bf16
where it is native), or `--path fp32` in fp32 on this CPU's own kernels. Two runs train at once with one thread each, so the times compare recipes
with one another, not with `make train`. The recipes that change LoRA pin it (`LORA`: the default
is full fine-tuning).

Scoring, per puzzle: the answer is fed to the model after its question (teacher forcing) and the
puzzle counts as answered when every answer token, the end-of-answer token included, is the
model's top choice; greedy decoding then writes exactly that answer, so this is the exact match of
`make eval`, in one forward pass per 64 puzzles. The margin of a puzzle is the smallest gap, over
its answer tokens, between the right token's logit and the best other one: an answer whose margin
is near 0 flips under another CPU's arithmetic (the same sums in another order). Puzzles: the 200
held-out ones (`make generate` shows the first five) and 1000 fresh ones drawn by
`sft_play.tiny_puzzles`, the generator `scripts/build_tiny_default.py` uses, with another seed.

Usage: python bench/tiny_recipes.py [--recipes NAME ...] [--seeds N ...] [--path auto|without-bf16|fp32]
       [--steps N] [--fresh N] [--out docs/reports/tiny_recipes.md]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _common import REPO, REPORTS, margins, run_python, versions, worker_env
from tiny_default import CAPPED, hardware_line

from sft_play import tiny_puzzles


FRESH_SEED = 999

# The LoRA recipe make train shipped until full fine-tuning became the default
LORA = ["finetune.method=lora", "train.learning_rate=3e-3"]

# name: (what it changes, run overrides, model config changes, data mix)
RECIPES: dict[str, tuple[str, list[str], dict, str | None]] = {
    "default": ("configs/run_tiny.yaml as it ships (full fine-tuning, lr 2e-3)", [], {}, None),
    "lora": ("LoRA r 32 on every linear, embeddings and head in full, lr 3e-3 (the default before)", LORA, {}, None),
    "heads-4": ("LoRA; 4 heads of 32, 2 KV heads (the same parameters)", LORA,
                {"num_attention_heads": 4, "head_dim": 32, "num_key_value_heads": 2}, None),
    "heads-8": ("LoRA; 8 heads of 16, 4 KV heads (the same parameters)", LORA,
                {"num_attention_heads": 8, "head_dim": 16, "num_key_value_heads": 4}, None),
    "layers-6": ("LoRA; 6 layers, MLP 256 wide (about 1.1x the step)", LORA,
                 {"num_hidden_layers": 6, "intermediate_size": 256}, None),
    "batch-6": ("LoRA; global batch 6, 1000 steps (the same rows, twice the updates)",
                [*LORA, "train.global_batch_size=6", "train.max_steps=1000"], {}, None),
    "more-sorting": ("LoRA; 3,239 one-question records of 'Which letter' and 'Uppercase' made sorting ones",
                     LORA, {}, "more-sorting"),
    "rank-64": ("LoRA r 64, alpha 128", [*LORA, "lora.r=64", "lora.alpha=128"], {}, None),
    "rank-16": ("LoRA r 16, alpha 32", [*LORA, "lora.r=16", "lora.alpha=32"], {}, None),
    "lr-2e-3": ("LoRA at learning rate 2e-3", ["finetune.method=lora", "train.learning_rate=2e-3"], {}, None),
    "lr-5e-3": ("LoRA at learning rate 5e-3", ["finetune.method=lora", "train.learning_rate=5e-3"], {}, None),
    "full-1e-3": ("full fine-tuning, learning rate 1e-3", ["finetune.method=full", "train.learning_rate=1e-3"], {}, None),
    "full-2e-3": ("full fine-tuning, learning rate 2e-3", ["finetune.method=full", "train.learning_rate=2e-3"], {}, None),
    "full-more-sorting": ("full fine-tuning, lr 2e-3, more sorting in the mix",
                          ["finetune.method=full", "train.learning_rate=2e-3"], {}, "more-sorting"),
    "full-layers-6-more-sorting": ("full fine-tuning, lr 2e-3, 6 layers with MLP 256, more sorting",
                                   ["finetune.method=full", "train.learning_rate=2e-3"],
                                   {"num_hidden_layers": 6, "intermediate_size": 256}, "more-sorting"),
    "full-layers-6-more-repeats": ("full fine-tuning, lr 2e-3, 6 layers with MLP 256, more sorting of letters that repeat",
                                   ["finetune.method=full", "train.learning_rate=2e-3"],
                                   {"num_hidden_layers": 6, "intermediate_size": 256}, "more-repeats"),
    "full-layers-8-more-repeats": ("full fine-tuning, lr 2e-3, 8 layers with MLP 256, more sorting of letters that repeat",
                                   ["finetune.method=full", "train.learning_rate=2e-3"],
                                   {"num_hidden_layers": 8, "intermediate_size": 256}, "more-repeats"),
    "full-layers-6-more-repeats-600": ("the same with 6 layers, 600 steps",
                                       ["finetune.method=full", "train.learning_rate=2e-3", "train.max_steps=600"],
                                       {"num_hidden_layers": 6, "intermediate_size": 256}, "more-repeats"),
    "layers-6-more-repeats": ("LoRA, 6 layers with MLP 256, more sorting of letters that repeat", LORA,
                              {"num_hidden_layers": 6, "intermediate_size": 256}, "more-repeats"),
}


def more_sorting(out: Path, repeats: bool = False) -> Path:
    """The training puzzles with 60 % of the one-question 'Which letter' and 'Uppercase' records
    replaced by sorting ones (sorting is what the default gets wrong); with `repeats`, sorting
    ones whose letters repeat (what it gets wrong in sorting)."""
    rng = random.Random(7)
    rows = []
    for line in (REPO / "data" / "tiny" / "train.jsonl").read_text().splitlines():
        record = json.loads(line)
        first = record["messages"][0]["content"]
        if len(record["messages"]) == 2 and first.startswith(("Which", "Uppercase")) and rng.random() < 0.6:
            seq = (tiny_puzzles.repeating_letters if repeats else tiny_puzzles.letters)(rng)
            question, answer = tiny_puzzles.puzzle("Sort", seq)
            record = {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}
        rows.append(json.dumps(record))
    out.write_text("\n".join(rows) + "\n")
    return out


def command(name: str, root: Path, steps: int | None, seed: int = 42, path: str = "without-bf16") -> tuple[list, dict]:
    """The training command of recipe `name` (its reshaped model folder and its mix of puzzles
    written into `root`) and its environment."""
    _, overrides, shape, mix = RECIPES[name]
    overrides = list(overrides)
    if shape:
        folder = root / f"model-{name}"
        shutil.copytree(REPO / "configs" / "tiny_model", folder)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **shape}, indent=2))
        overrides.append(f"model.name_or_path={folder}")
    if mix in ("more-sorting", "more-repeats"):
        overrides.append(f"data.path={more_sorting(root / f'{name}-{seed}.jsonl', repeats=mix == 'more-repeats')}")
    if steps:
        overrides.append(f"train.max_steps={steps}")
    env = {**worker_env(), **(CAPPED if path == "without-bf16" else {}), "OMP_NUM_THREADS": "1"}
    if path == "fp32":  # this CPU's own fp32 kernels (AVX512 here): a CPU with AVX512 but no native bf16
        overrides.append("train.mixed_precision=no")
    return ["scripts/train_distributed.py", "--config", "configs/run_tiny.yaml", f"train.seed={seed}",
            f"train.output_dir={root}", f"train.run_name={name}-{seed}", "train.tensorboard=false", *overrides], env


def train(name: str, root: Path, steps: int | None, seed: int = 42, path: str = "without-bf16") -> dict:
    started = time.monotonic()
    result = run_python(*command(name, root, steps, seed, path), cwd=REPO)
    if result.returncode != 0:
        raise SystemExit(f"{name} failed:\n{result.stderr[-3000:]}")
    return trained(name, seed, path, root / f"{name}-{seed}", time.monotonic() - started)


def trained(name: str, seed: int, path: str, run: Path, wall: float) -> dict:
    """Recipe `name`'s finished run as a row of the report (before its scores)."""
    summary = json.loads((run / "summary.json").read_text())
    return {"recipe": name, "seed": seed, "path": path, "what": RECIPES[name][0], "run": str(run), "wall_s": wall,
            "train_s": summary["train_runtime_s"], "last_loss": summary["last_loss"]}


def fresh_puzzles(count: int) -> list[tuple[list[dict], str]]:
    rng = random.Random(FRESH_SEED)
    return [([{"role": "user", "content": q}], a) for q, a in (tiny_puzzles.task(rng) for _ in range(count))]


def score(run: str, fresh: int) -> dict:
    """Teacher-forced exact match and margins of the held-out and `fresh` fresh puzzles."""
    from sft_play import export

    model, tokenizer, config = export.load_trained(run, device="cpu")
    puzzles = [(p.messages, p.reference) for p in export.held_out_prompts(config, 200)] + fresh_puzzles(fresh)
    margins_ = margins(model, tokenizer, puzzles)
    held, new = margins_[:200], margins_[200:]
    kinds: dict[str, list[int]] = {}
    for (messages, _), margin in zip(puzzles[200:], new):
        kind = kinds.setdefault(messages[0]["content"].split()[0], [0, 0])
        kind[0] += margin > 0
        kind[1] += 1
    missed = [f"{m[-1]['content']} -> {a}" for (m, a), margin in zip(puzzles, margins_) if margin <= 0]
    return {"held_out": sum(m > 0 for m in held), "fresh": sum(m > 0 for m in new), "fresh_of": len(new),
            "kinds": kinds, "five_min_margin": min(held[:5]), "five": [round(m, 2) for m in held[:5]], "p10_margin": sorted(margins_)[len(margins_) // 10],
            "missed": missed}


def report(rows: list[dict], fresh: int) -> str:
    lines = [
        "# Recipes for the embedded default: answers and margins",
        "",
        "Written by `python bench/tiny_recipes.py` (its docstring says how each recipe trains and how",
        "the puzzles are scored). fp32 with the CPU capped at AVX2, two recipes",
        "at once with one thread each: the times compare recipes, they are not `make train`'s.",
        "",
        f"- hardware: {hardware_line()} (no GPU)",
        f"- software: {versions()}",
        "",
        f"| recipe | seed | what changes | training | loss | held-out (200) | fresh ({fresh}) | by puzzle: reverse, "
        "uppercase, sort, next letter | smallest margin of make generate's five | 10th-percentile margin |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        k = r["kinds"]
        by_kind = ", ".join(f"{k[n][0]}/{k[n][1]}" for n in ("Reverse", "Uppercase", "Sort", "Which") if n in k)
        lines.append(f"| {r['recipe']} | {r['seed']} | {r['what']} | {r['train_s']:.0f} s | {r['last_loss']:.3f} | {r['held_out']} | "
                     f"{r['fresh']} | {by_kind} | {r['five_min_margin']:.2f} | {r['p10_margin']:.2f} |")
    lines += ["", "Puzzles the default missed (held-out, then fresh):", ""]
    lines += [f"- {m}" for m in next((r["missed"] for r in rows if r["recipe"] == "default"), [])[:20]]
    lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="+", choices=list(RECIPES), default=list(RECIPES))
    parser.add_argument("--steps", type=int, help="train this many steps instead of the config's (a smoke run)")
    parser.add_argument("--fresh", type=int, default=1000, help="fresh puzzles to score beside the 200 held-out")
    parser.add_argument("--seeds", nargs="+", type=int, default=[42], help="training seeds (default 42); each recipe trains with each")
    parser.add_argument("--path", choices=["without-bf16", "auto", "fp32"], default="without-bf16",
                        help="without-bf16 (default): fp32 capped at AVX2; auto: what this CPU takes (bf16 where native); "
                             "fp32: fp32 on this CPU's own kernels")
    parser.add_argument("--out", default=str(REPORTS / "tiny_recipes.md"))
    args = parser.parse_args()
    from sft_play.cli import quiet_libraries

    quiet_libraries()
    import torch

    torch.set_num_threads(1)  # scoring too: the other recipe trains beside it
    scoring = threading.Lock()  # one model loads at a time (transformers sets process-wide defaults)
    with tempfile.TemporaryDirectory(prefix="tiny-recipes-") as root:
        def one(job: tuple[str, int]) -> dict:
            row = train(job[0], Path(root), args.steps, job[1], args.path)
            with scoring:
                row.update(score(row["run"], args.fresh))
            print(json.dumps({k: v for k, v in row.items() if k != "missed"}), flush=True)
            return row

        with ThreadPoolExecutor(max_workers=2) as pool:
            rows = list(pool.map(one, [(name, seed) for name in args.recipes for seed in args.seeds]))
    Path(args.out).write_text(report(rows, args.fresh))
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
