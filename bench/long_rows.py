"""Long rows as the planner sees them: Llama-3.1-8B LoRA (r 16, packed rows) on 80 GiB GPUs, at 8k
to 131k tokens, with each long-row lever (FlashAttention-2, tiled MLPs, offloaded hidden states)
and all of them, and the longest row that fits (``make plan LONGEST=1``) on 1 and 8 GPUs.

Planning is CPU work: nothing here ran on a GPU, and the figures are the planner's predictions,
not measurements. Its accuracy at these lengths awaits a GPU (the plan's memory was checked
within 2.8 % on 21 H100 rows of 512-4096 tokens, docs/reports/planner_accuracy.md). The
public config is the test fixture's; the report says the machine and the time it took.

Usage:
  python bench/long_rows.py [--output docs/reports/long_rows.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from _common import CONFIGS, REPORTS, versions  # bench/ is the script's folder
from tiny_default import hardware_line

from sft_play import config as config_module
from sft_play.planner import Target, make_plan
from sft_play.planner.choose import longest
from sft_play.units import GIB

MODEL = "llama-3.1-8b"
BASE = ["finetune.method=lora", "lora.r=16", "lora.modules_to_save=[]", "train.gradient_checkpointing=true",
        "data.packing=true", "train.global_batch_size=8"]
LENGTHS = [8192, 16384, 32768, 65536, 131072]
LEVERS = [
    ("SDPA with a mask (as the issue planned)", []),
    ("FlashAttention-2", ["model.attn_implementation=flash_attention_2"]),
    ("+ tiled MLP", ["model.attn_implementation=flash_attention_2", "train.tiled_mlp=true", "lora.dropout=0"]),
    ("+ activation offload", ["model.attn_implementation=flash_attention_2", "train.tiled_mlp=true", "lora.dropout=0",
                              "train.offload_activations=true"]),
]
H100 = Target(1, 80 * GIB, "1 x 80 GiB (H100)", gpu_model="H100")


def config(*overrides: str):
    return config_module.load(None, [f"model.name_or_path={CONFIGS / MODEL}", *BASE, *overrides], check_paths=False,
                              check_packages=False)


def cell(plan) -> str:
    split = f"{plan.micro_batch_size}x{plan.gradient_accumulation_steps}"
    peak = f"{plan.peak_bytes_per_gpu / GIB:.1f}"
    speed = f", {plan.time['tokens_per_second']:,.0f} tok/s" if plan.time else ""
    return f"{split} @ {peak}{speed}" if plan.fits else f"**does not fit: {peak}**"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=str(REPORTS / "long_rows.md"))
    args = parser.parse_args()
    started = time.monotonic()
    rows = []
    for name, overrides in LEVERS:
        rows.append([name] + [cell(make_plan(config(*overrides, f"data.max_seq_length={s}"), H100, with_remedies=False))
                              for s in LENGTHS])
    answers = {}
    for gpus in (1, 8):
        target = dataclasses.replace(H100, world_size=gpus, device_name=f"{gpus} x 80 GiB (H100)")
        answers[gpus] = longest.longest_rows(config(), target, lambda c, t: make_plan(c, t, None, with_remedies=False),
                                             131072)
    minutes = (time.monotonic() - started) / 60
    lines = [
        "# Long rows: what the planner predicts for Llama-3.1-8B LoRA on 80 GiB GPUs",
        "",
        f"Written by `python bench/long_rows.py` on {hardware_line()}, in {minutes:.1f} min ({versions()}).",
        "Planning runs on the CPU; **every figure is a prediction, none a GPU measurement** (the planner's memory",
        "model was checked within 2.8 % on 21 H100 rows of 512-4,096 tokens; these lengths await a GPU).",
        "",
        f"Config: `tests/fixtures/model_configs/{MODEL}` (the public config), {', '.join(f'`{o}`' for o in BASE)};",
        "one GPU of 80 GiB timed as an H100. A cell: micro-batch x accumulation @ predicted peak GiB, and the",
        "predicted tokens/s (attention's FLOPs counted by the keys each token attends to).",
        "",
        "| levers | " + " | ".join(f"{s:,}" for s in LENGTHS) + " |",
        "|---|" + "---|" * len(LENGTHS),
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
        "## The longest row (`make plan LONGEST=1`), one row per GPU",
        "",
        "Each line adds its lever to those above; the next length of the ladder (four an octave) does not fit.",
        "",
    ]
    for gpus, found in answers.items():
        lines += [f"**{gpus} x 80 GiB**", "", "| settings | longest row | peak GiB | host GiB per node |", "|---|---|---|---|"]
        for a in found:
            beyond = " (past the model's 131,072 positions)" if a["beyond_positions"] else ""
            peak = f"{a['peak_bytes'] / GIB:.1f}" if a["peak_bytes"] else "-"
            lines.append(f"| {a['settings']} | {a['tokens']:,}{beyond} | {peak} | "
                         f"{a['host_bytes_per_node'] / GIB:.1f} |")
        lines.append("")
    lines += [
        "## Against what peers publish",
        "",
        "DeepSpeed's Arctic Long Sequence Training (ALST, arXiv 2506.13996) reports 500K tokens for Llama-8B on one",
        "H100 and 3.7M on eight, with Ulysses sequence parallelism, tiled MLP and loss, and checkpoint offload;",
        "Unsloth reports ~342K for QLoRA with offloaded checkpointing. The levers planned here are the single-GPU",
        "ones (tiled MLP, checkpoint offload, a mask-free kernel): on one GPU the plan stops where one layer's",
        "backward working set (its q, k, v, attention output and their gradients, LoRA's saved inputs,",
        "[tokens, 4096] each) no longer fits beside the weights, and on eight GPUs ZeRO shards the weights but",
        "not the sequence, so the rows barely grow. Sequence parallelism (each GPU holding 1/N of the row) is",
        "what carries ALST to 3.7M on eight; it is not yet built here (issue 45 goes on).",
        "",
    ]
    Path(args.output).write_text("\n".join(lines))
    print(f"wrote {args.output} in {minutes:.1f} min")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
