"""Are the planner's fit decisions and reported peaks monotone, on every public model config?

For each real model's config among the test fixtures, each method (full, LoRA, QLoRA) and
checkpointing on and off, plans one 80 GiB GPU at micro-batches 1-4 and rows of 512-4096 tokens
(the micro-batch and accumulation fixed, so that the plan reports that shape) and checks:

- the reported peak never falls as the micro-batch grows (at each length) or as the rows grow
  (at each micro-batch);
- under a budget between the smallest and the largest peak of a row (or a column), the shapes
  that fit form a prefix of it;
- the breakdown's terms add up to the peak.

And at every length, not only the ladder's: for three models (LoRA and QLoRA, checkpointing, one
row), rows of 1,024 to 59,392 tokens 512 apart (115 lengths), how often the replay of the planned
batch alone falls as the rows grow, how often the plan's reported peak does (never: the envelope
between powers of two is the line between theirs, sft_play/planner/choose/search.py), and how far
the plan lies from its own replay.

Planning is CPU work: the result does not depend on a GPU. `tests/test_planner_monotone.py`
asserts the same on the cases that broke before the envelope; this sweeps them all (minutes on 2
cores; the report gives the time). Each combination's result is kept in
`docs/reports/planner_monotone.json` as it comes, with a hash of the planner's code: a second call
goes on where the first stopped, and starts over when the code changed.

Usage:
  python bench/planner_monotone.py [--output docs/reports/planner_monotone.md] [--fresh]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

from _common import CONFIGS, REPO, REPORTS, versions  # bench/ is the script's folder
from tiny_default import hardware_line

from sft_play import config as config_module
from sft_play.planner import WITHOUT_REMEDIES, Target, make_plan
from sft_play.units import GIB

PUBLIC = ["gemma-2-9b", "llama-3-70b", "llama-3.1-8b", "llama-3.2-3b", "mistral-7b-v0.1", "mixtral-8x7b",
          "qwen2.5-0.5b", "qwen2.5-14b", "qwen3-30b-a3b"]
METHODS = ["full", "lora", "qlora"]
MICROS = [1, 2, 3, 4]
LENGTHS = [512, 1024, 2048, 4096]
FREE = 80 * GIB
EVERY = [("qwen2.5-0.5b", "lora"), ("llama-3.1-8b", "lora"), ("gemma-2-9b", "qlora")]
EVERY_LENGTHS = list(range(1024, 59393, 512))


def plan(model: str, method: str, checkpointing: bool, seq: int, micro: int, free: int = FREE):
    config = config_module.load(None, [
        f"model.name_or_path={CONFIGS / model}", f"finetune.method={method}",
        f"train.gradient_checkpointing={str(checkpointing).lower()}", f"data.max_seq_length={seq}",
        f"train.micro_batch_size={micro}", f"train.global_batch_size={micro}", "train.gradient_accumulation_steps=1",
    ], check_paths=False)
    return make_plan(config, Target(1, free, "1 x GPU"), options=WITHOUT_REMEDIES)


def check(model: str, method: str, checkpointing: bool) -> list[str]:
    """What is not monotone for one model, method and checkpointing choice (empty: all is)."""
    peaks = {(m, s): plan(model, method, checkpointing, s, m) for m in MICROS for s in LENGTHS}
    problems = [f"terms do not add up at micro {m}, {s} tokens" for (m, s), p in peaks.items()
                if sum(p.breakdown.values()) != p.peak_bytes_per_gpu]
    lines = ([("micro", m, [(m, s) for s in LENGTHS]) for m in MICROS]
             + [("tokens", s, [(m, s) for m in MICROS]) for s in LENGTHS])
    for what, at, shapes in lines:
        values = [peaks[shape].peak_bytes_per_gpu for shape in shapes]
        if values != sorted(values):
            problems.append(f"peaks fall along {what} {at}: " + ", ".join(f"{v / GIB:.2f}" for v in values))
            continue
        if values[0] == values[-1]:
            continue
        free = int((values[0] + values[-1]) // 2 / (1 - 0.03)) + 1
        fits = [plan(model, method, checkpointing, s, m, free).fits for m, s in shapes]
        if fits != sorted(fits, reverse=True):
            problems.append(f"fit decisions are not a prefix along {what} {at}: {fits}")
    return problems


def every_length(model: str, method: str) -> dict:
    """One row of each of :data:`EVERY_LENGTHS` with checkpointing, on a GPU with room for all:
    the replay of the planned batch (the search's own prediction) and the peak the plan reports."""
    plans = [plan(model, method, True, seq, 1, 1000 * GIB) for seq in EVERY_LENGTHS]
    replays = [p.candidates[0]["peak_bytes"] for p in plans]
    reported = [p.peak_bytes_per_gpu for p in plans]
    return {"replay_falls": [seq for seq, before, after in zip(EVERY_LENGTHS[1:], replays, replays[1:]) if after < before],
            "plan_falls": [seq for seq, before, after in zip(EVERY_LENGTHS[1:], reported, reported[1:]) if after < before],
            "below_replay": sum(r < own for r, own in zip(reported, replays)),
            "below_replay_pct": max(100 * (own - r) / own for r, own in zip(reported, replays)),
            "above_replay_pct": max(100 * (r - own) / own for r, own in zip(reported, replays))}


def planner_code() -> str:
    """A hash of the code that decides a plan's peaks: kept rows of other code are not reused."""
    digest = hashlib.sha256()
    for path in sorted([*(REPO / "sft_play" / "planner").glob("*.py"), REPO / "sft_play" / "run.py"]):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=REPORTS / "planner_monotone.md")
    parser.add_argument("--fresh", action="store_true", help="discard the rows kept by an earlier call")
    args = parser.parse_args(argv)
    kept_path = args.output.with_suffix(".json")
    code = planner_code()
    kept = json.loads(kept_path.read_text()) if kept_path.is_file() and not args.fresh else {}
    if kept.get("code") != code:
        kept = {"code": code, "rows": {}, "seconds": 0.0}
    rows = []
    for model in PUBLIC:
        for method in METHODS:
            for checkpointing in (True, False):
                name = f"{model} {method} checkpointing={checkpointing}"
                if name not in kept["rows"]:
                    started = time.perf_counter()
                    kept["rows"][name] = check(model, method, checkpointing)
                    kept["seconds"] += time.perf_counter() - started
                    kept_path.write_text(json.dumps(kept, indent=1) + "\n")
                problems = kept["rows"][name]
                rows.append((model, method, checkpointing, problems))
                print(f"{name}: {'; '.join(problems) or 'monotone'}", flush=True)
    every = {}
    for model, method in EVERY:
        name = f"{model} {method} every length"
        if name not in kept["rows"]:
            started = time.perf_counter()
            kept["rows"][name] = every_length(model, method)
            kept["seconds"] += time.perf_counter() - started
            kept_path.write_text(json.dumps(kept, indent=1) + "\n")
        every[(model, method)] = kept["rows"][name]
        print(f"{name}: the plan falls at {len(every[(model, method)]['plan_falls'])} lengths", flush=True)
    failed = [row for row in rows if row[3]] + [key for key, row in every.items() if row["plan_falls"]]
    lines = [
        "# Planner: fit decisions and reported peaks, monotone?",
        "",
        "Written by `python bench/planner_monotone.py` (its docstring says what is checked). Planning is",
        "CPU work; no GPU is involved.",
        "",
        f"- hardware: {hardware_line()}",
        f"- software: {versions()}",
        f"- planner code: {code} (a hash of sft_play/planner/*.py and sft_play/run.py)",
        f"- wall time: {kept['seconds'] / 60:.0f} min, over the calls that made the rows",
        f"- grid: {len(PUBLIC)} public model configs x {', '.join(METHODS)} x checkpointing on/off; "
        f"micro-batches {MICROS[0]}-{MICROS[-1]} x rows of {', '.join(map(str, LENGTHS))} tokens on one 80 GiB GPU",
        f"- result: **{len(rows) - len([r for r in rows if r[3]])} of {len(rows)} monotone** in both the micro-batch "
        "and the sequence length; at every length (below), the plan falls "
        + ("nowhere" if not any(row["plan_falls"] for row in every.values()) else "**somewhere**"),
        "",
        "| model | method | checkpointing | result |",
        "|---|---|---|---|",
    ]
    lines += [f"| {model} | {method} | {'on' if ck else 'off'} | {'; '.join(problems) or 'monotone'} |"
              for model, method, ck, problems in rows]
    lines += [
        "",
        f"## Every length: rows of {EVERY_LENGTHS[0]:,} to {EVERY_LENGTHS[-1]:,} tokens, "
        f"{EVERY_LENGTHS[1] - EVERY_LENGTHS[0]} apart ({len(EVERY_LENGTHS)} lengths)",
        "",
        "One row a step, checkpointing, on a GPU with room for all (the peaks, not the budget). *Replay*: the",
        "planned batch's own prediction, which the plan reported before the envelope covered lengths between the",
        "ladder's; *plan*: the peak it reports now.",
        "",
        "| model | method | replay falls at | plan falls at | plan below its replay | plan above its replay, at most |",
        "|---|---|---|---|---|---|",
    ]
    for (model, method), row in every.items():
        falls = ", ".join(f"{seq:,}" for seq in row["replay_falls"]) or "none"
        lines.append(f"| {model} | {method} | {len(row['replay_falls'])}: {falls} | "
                     f"{len(row['plan_falls']) or 'none'} | {row['below_replay']} lengths, by {row['below_replay_pct']:.1f} % "
                     "at most | "
                     f"{row['above_replay_pct']:.1f} % |")
    args.output.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.output}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
