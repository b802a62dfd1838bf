"""Long rows as the planner sees them: Llama-3.1-8B LoRA (r 16, packed rows) on 80 GiB GPUs, at 8k
to 131k tokens on one GPU with each long-row lever (FlashAttention-2, Liger's kernels, tiled MLPs,
offloaded hidden states) and all of them, at 131k to 4M tokens on eight with each row split
across them (sequence parallelism), and the longest row that fits (``make plan LONGEST=1``) on 1
and 8 GPUs.

Planning is CPU work: nothing here ran on a GPU, and the figures are the planner's predictions,
not measurements. Its accuracy at these lengths awaits a GPU (the plan's memory was checked
within 2.8 % on 21 H100 rows of 512-4096 tokens, docs/reports/planner_accuracy.md). The
public config is the test fixture's; the report says the machine and the time it took.

Usage:
  python bench/long_rows.py [--output docs/reports/long_rows.md]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from _common import CONFIGS, REPORTS, versions  # bench/ is the script's folder
from tiny_default import hardware_line

from sft_play import config as config_module
from sft_play.planner import WITHOUT_REMEDIES, Target, make_plan, model_shape
from sft_play.planner.choose import longest
from sft_play.planner.plan import largest_split
from sft_play.units import GIB

MODEL = "llama-3.1-8b"
BASE = ["finetune.method=lora", "lora.r=16", "lora.modules_to_save=[]", "train.gradient_checkpointing=true",
        "data.packing=true", "train.global_batch_size=8"]
LENGTHS = [8192, 16384, 32768, 65536, 131072]
FLASH = ["model.attn_implementation=flash_attention_2"]
LIGER = [*FLASH, "train.liger_kernels=true"]
TILED = [*LIGER, "train.tiled_mlp=true", "lora.dropout=0"]
OFFLOAD = [*TILED, "train.offload_activations=true"]
LEVERS = [
    ("SDPA with a mask (as the issue planned)", []),
    ("FlashAttention-2", FLASH),
    ("+ Liger kernels", LIGER),
    ("+ tiled MLP", TILED),
    ("+ activation offload", OFFLOAD),
]
SPLIT_LENGTHS = [131072, 524288, 1048576, 2097152, 4194304]
SPLIT = [*OFFLOAD, "distributed.strategy=deepspeed_zero3", "distributed.sequence_parallel=8"]
H100 = Target(1, 80 * GIB, "1 x 80 GiB (H100)", gpu_model="H100")
EIGHT = Target(8, 80 * GIB, "8 x 80 GiB (H100)", gpu_model="H100")


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
        rows.append([name] + [cell(make_plan(config(*overrides, f"data.max_seq_length={s}"), H100, options=WITHOUT_REMEDIES))
                              for s in LENGTHS])
    split_row = [cell(make_plan(config(*SPLIT, f"data.max_seq_length={s}"), EIGHT, options=WITHOUT_REMEDIES))
                 for s in SPLIT_LENGTHS]
    answers = {}
    for target in (H100, EIGHT):
        answers[target.world_size] = longest.longest_rows(
            config(), target, lambda c, t: make_plan(c, t, None, options=WITHOUT_REMEDIES), 131072,
            split=largest_split(config(), target, model_shape(config())))
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
        "Eight GPUs, all the levers above, ZeRO-3, each row split across the eight (`distributed.sequence_parallel=8`;",
        "a cell's micro-batch is rows per group of eight):",
        "",
        "| levers | " + " | ".join(f"{s:,}" for s in SPLIT_LENGTHS) + " |",
        "|---|" + "---|" * len(SPLIT_LENGTHS),
        "| + sequence parallelism (8) | " + " | ".join(split_row) + " |",
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
        "H100 and 3.7M on eight (Ulysses sequence parallelism, tiled MLP and loss, checkpoints offloaded to host",
        "memory, weights and optimizer offloaded with ZeRO-3); Unsloth reports ~342K for QLoRA with offloaded",
        "checkpointing. The plan goes further than ALST's figures on both, for reasons it can name: this is LoRA",
        "(no gradients or optimizer states for the 8B weights, where ALST trains them all), and the plan counts",
        "host memory without a limit unless told the node's (`HOST_GIB`): its longest rows need the host memory in",
        "the last column, more than many nodes have. Each row of a LONGEST answer adds its lever to those above;",
        "without parameter offload, the plan stops where one layer's backward working set (q, k, v, the attention",
        "output and their gradients, the adapters' inputs, [tokens / split, 4096] each)",
        "no longer fits beside the weights. None of these lengths has been measured on a GPU yet.",
        "",
    ]
    Path(args.output).write_text("\n".join(lines))
    print(f"wrote {args.output} in {minutes:.1f} min")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
