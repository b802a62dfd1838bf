"""Plans of public model configs, kept as they came out, so that a change made for speed can be
shown to change no prediction (tests/test_plan_snapshots.py; bench/planner_speed.py).

Each case is a ``make plan`` a user types (the config, its overrides and the hardware described,
without the data); its snapshot is the plan's JSON document less what measures the planning itself
(seconds, replays). ``LONGEST=1`` cases keep their answers.

Usage: python tests/plan_snapshots.py [--write] [--only NAME ...] [--out PATH]
  (without --write: plan every case and report which differ from tests/fixtures/plan_snapshots.json)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "tests" / "fixtures" / "model_configs"
SNAPSHOTS = REPO / "tests" / "fixtures" / "plan_snapshots.json"
# What measures the planning, not the plan
UNSTABLE = ("plan_seconds", "plan_cpu_seconds", "replays")


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    overrides: tuple[str, ...]
    gpus: int
    vram_gib: float
    gpu_model: str | None = None
    longest: bool = False
    config: str = "configs/run_distributed.yaml"
    quick: bool = True  # planned by the suite's test (the others by bench/planner_speed.py and --write)

    def load(self, repo: Path = REPO):
        from sft_play import config as config_module

        return config_module.load(repo / self.config, [f"model.name_or_path={MODELS / self.model}", *self.overrides],
                                  check_paths=False, check_packages=False)

    def target(self):
        from types import SimpleNamespace

        from sft_play.planner import target_for

        return target_for(SimpleNamespace(gpus=[]), self.gpus, self.vram_gib, gpu_model=self.gpu_model)

    def make_args(self) -> list[str]:
        """scripts/plan.py's arguments for this case."""
        return (["--config", self.config, f"model.name_or_path={MODELS / self.model}", *self.overrides,
                 "--gpus", str(self.gpus), "--vram-gib", f"{self.vram_gib:g}", "--no-data"]
                + (["--gpu-model", self.gpu_model] if self.gpu_model else []) + (["--longest"] if self.longest else []))


# The five plans of issue 62 first (a fit, then remedies of growing cost), then other shapes
CASES = (
    Case("llama8b-lora-1x80", "llama-3.1-8b", ("finetune.method=lora",), 1, 80),
    Case("gemma9b-qlora-1x24", "gemma-2-9b", ("finetune.method=qlora",), 1, 24, quick=False),
    Case("mixtral-lora-8x80", "mixtral-8x7b", ("finetune.method=lora",), 8, 80, quick=False),
    Case("qwen14b-full-1x80", "qwen2.5-14b", ("finetune.method=full",), 1, 80, quick=False),
    Case("llama70b-qlora-2x24", "llama-3-70b", ("finetune.method=qlora", "train.global_batch_size=16"), 2, 24,
         "RTX 4090", quick=False),
    Case("llama8b-lora-1x24-nockpt", "llama-3.1-8b", ("finetune.method=lora",), 1, 24, quick=False),
    Case("qwen05b-full-1x24", "qwen2.5-0.5b", ("finetune.method=full", "train.gradient_checkpointing=true"), 1, 24),
    Case("qwen7b-full-8x80-zero3", "qwen2.5-7b", ("finetune.method=full", "distributed.strategy=deepspeed_zero3",
                                                   "train.gradient_checkpointing=true"), 8, 80),
    Case("llama8b-qlora-fsdp2-2x24", "llama-3.1-8b", ("finetune.method=qlora", "distributed.strategy=fsdp2",
                                                      "quantization.quant_storage=bfloat16",
                                                      "train.gradient_checkpointing=true"), 2, 24),
    Case("qwen3moe-lora-1x80", "qwen3-30b-a3b", ("finetune.method=lora", "train.gradient_checkpointing=true"), 1, 80),
    # (fp16 mixed precision, as on a GPU without bf16: QLoRA's base in fp16 beside bf16 adapters)
    Case("llama8b-qlora-fp16-1x16", "llama-3.1-8b", ("finetune.method=qlora", "train.mixed_precision=fp16",
                                                     "train.gradient_checkpointing=true"), 1, 16),
    Case("qwenvl-lora-1x80", "qwen2.5-vl-7b", ("finetune.method=lora", "data.packing=false",
                                               "data.image_max_pixels=401408", "train.gradient_checkpointing=true"), 1, 80,
         quick=False),
    Case("llama8b-lora-131k-1x80", "llama-3.1-8b", ("finetune.method=lora", "data.max_seq_length=131072",
                                                   "train.global_batch_size=1", "train.gradient_checkpointing=true"),
         1, 80, quick=False),
    Case("llama8b-sp-auto-1m-8x80", "llama-3.1-8b", ("finetune.method=lora", "data.max_seq_length=1048576",
                                                    "train.global_batch_size=8", "train.gradient_checkpointing=true",
                                                    "distributed.strategy=deepspeed_zero3",
                                                    "distributed.sequence_parallel=auto"), 8, 80, quick=False),
    Case("llama8b-longest-1x80", "llama-3.1-8b", ("finetune.method=lora",), 1, 80, longest=True, quick=False),
    Case("llama8b-longest-8x80", "llama-3.1-8b", ("finetune.method=lora",), 8, 80, longest=True, quick=False),
)


def snapshot(case: Case) -> dict:
    """The case planned in this process: the plan's document less :data:`UNSTABLE`, or for a
    ``LONGEST=1`` case its answers on each target."""
    import dataclasses

    from sft_play.planner import WITHOUT_REMEDIES, make_plan, model_shape

    config, target = case.load(), case.target()
    if case.longest:
        from sft_play.planner.choose import longest as question
        from sft_play.planner.plan import largest_split

        shape = model_shape(config)
        targets = [target] if target.world_size == 1 else [dataclasses.replace(target, world_size=1), target]
        return {"longest": [question.longest_rows(config, each,
                                                  lambda c, t: make_plan(c, t, None, options=WITHOUT_REMEDIES),
                                                  shape.max_positions, case.config, case.overrides,
                                                  split=largest_split(config, each, shape)) for each in targets]}
    document = make_plan(config, target).to_dict()
    return {k: v for k, v in document.items() if k not in UNSTABLE}


def canonical(value) -> str:
    """`value` as sorted JSON, the repository's folder left out of paths (a clone anywhere says the same)."""
    return json.dumps(value, sort_keys=True, default=str).replace(f"{REPO}/", "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="write the snapshots instead of comparing")
    parser.add_argument("--only", nargs="*", help="these cases only")
    parser.add_argument("--out", type=Path, default=SNAPSHOTS)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from sft_play import cli, lean_imports

    lean_imports.without_bitsandbytes()
    with cli.importing():
        import sft_play.planner  # noqa: F401
    kept = json.loads(args.out.read_text()) if args.out.exists() else {}
    differ = []
    for case in CASES:
        if args.only and case.name not in args.only:
            continue
        started = time.perf_counter()
        result = json.loads(canonical(snapshot(case)))
        same = kept.get(case.name) == result
        print(f"{case.name:<28} {time.perf_counter() - started:7.2f} s  "
              + ("written" if args.write else "same" if same else "DIFFERS"), flush=True)
        if args.write:
            kept[case.name] = result
        elif not same:
            differ.append(case.name)
    if args.write:
        args.out.write_text(json.dumps(kept, indent=1, sort_keys=True) + "\n")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
