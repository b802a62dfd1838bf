"""The planner's answers to the questions people ask before renting GPUs (issue 46's seven), as
``make plan`` gives them: does it fit, and if not, which remedy does, with its command.

Each question is a public model config from the test fixtures (exact parameter counts, checked by
tests/test_planner.py), a method, a batch and the hardware it is planned for. Nothing here is
fitted to them: every remedy shown is offered because the planner's own prediction says it
fits. Planning is CPU work; the report names the machine that planned and the hardware planned
for. tests/test_planner_questions.py asserts the same answers.

Usage: python bench/planner_questions.py [--only NAME ...] [--out docs/reports/planner_questions.md]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from _common import CONFIGS, REPORTS, lean, versions  # bench/ is the script's folder


@dataclass(frozen=True)
class Question:
    name: str
    asked: str
    model: str
    overrides: tuple[str, ...]
    gpus: int
    vram_gib: float
    gpu_model: str | None = None
    with_remedies: bool = True

    def config(self):
        from sft_play import config as config_module

        return config_module.load(None, [f"model.name_or_path={CONFIGS / self.model}", "lora.modules_to_save=[]",
                                         *self.overrides], check_paths=False)

    def target(self):
        from types import SimpleNamespace

        from sft_play.planner import target_for

        return target_for(SimpleNamespace(gpus=[]), self.gpus, self.vram_gib, gpu_model=self.gpu_model)

    def command_line(self) -> str:
        """The ``make plan`` that asks it."""
        overrides = " ".join(self.overrides)
        model = f"model.name_or_path=tests/fixtures/model_configs/{self.model} lora.modules_to_save=[]"
        return (f'make plan NUM_GPUS={self.gpus} VRAM_GIB={self.vram_gib:g}'
                + (f' GPU_MODEL="{self.gpu_model}"' if self.gpu_model else "") + f' ARGS="{model} {overrides} --no-data"')


QUESTIONS = (
    Question("70b-qlora-2x24", "Llama-3-70B QLoRA on 2 x 24 GiB (\"70B on two 4090s\")", "llama-3-70b",
             ("finetune.method=qlora", "data.max_seq_length=2048", "train.global_batch_size=16"), 2, 24, "RTX 4090"),
    Question("mixtral-qlora-8x80", "Mixtral-8x7B QLoRA, 8 x 80 GiB, seq 2048, global 64", "mixtral-8x7b",
             ("finetune.method=qlora", "data.max_seq_length=2048", "train.global_batch_size=64",
              "train.gradient_checkpointing=true"), 8, 80),
    Question("8b-qlora-98k", "Llama-3.1-8B QLoRA at 98,304 tokens on 1 x 80 GiB", "llama-3.1-8b",
             ("finetune.method=qlora", "data.max_seq_length=98304", "train.global_batch_size=8",
              "train.gradient_checkpointing=true"), 1, 80),
    Question("70b-qlora-offload-host", "the 70B QLoRA plan with parameter offload: host memory", "llama-3-70b",
             ("finetune.method=qlora", "data.max_seq_length=2048", "train.global_batch_size=16",
              "train.gradient_checkpointing=true", "distributed.strategy=fsdp2", "quantization.quant_storage=bfloat16",
              "distributed.offload_parameters=true"), 2, 24, "RTX 4090", with_remedies=False),
    Question("70b-qlora-fsdp2-traffic", "70B QLoRA on 8 x 80 GiB under FSDP2: communication", "llama-3-70b",
             ("finetune.method=qlora", "data.max_seq_length=2048", "train.global_batch_size=64",
              "train.gradient_checkpointing=true", "distributed.strategy=fsdp2", "quantization.quant_storage=bfloat16"),
             8, 80, with_remedies=False),
    Question("70b-qlora-zero3-traffic", "the same under ZeRO-3: communication", "llama-3-70b",
             ("finetune.method=qlora", "data.max_seq_length=2048", "train.global_batch_size=64",
              "train.gradient_checkpointing=true", "distributed.strategy=deepspeed_zero3",
              "quantization.quant_storage=bfloat16"), 8, 80, with_remedies=False),
    Question("fits-micro", "a plan that fits: how to run it, and why this micro-batch", "llama-3.1-8b",
             ("finetune.method=qlora", "data.max_seq_length=2048", "train.global_batch_size=16",
              "train.gradient_checkpointing=true"), 2, 11, with_remedies=False),
    Question("qwen-7b-full-8x80", "Qwen2.5-7B full fine-tuning on 8 x 80 GiB", "qwen2.5-7b",
             ("finetune.method=full", "data.max_seq_length=2048", "train.global_batch_size=64"), 8, 80),
)


def plan(question: Question):
    """The plan ``make plan`` makes for `question` (the data not read: full-length rows)."""
    from sft_play.planner import PlanOptions, make_plan

    return make_plan(question.config(), question.target(), None, options=PlanOptions(remedies=question.with_remedies))


def answer(question: Question, made) -> dict:
    """What the plan says, in the report's words: the plan's line, the first remedy that fits
    (with its command), and the lines on communication, host memory and the micro-batch."""
    from sft_play.planner.present.report import run_command

    gib = 1 << 30
    fitting = [r for r in made.remedies if r["fits"]]
    said = [s for s in (made.time or {}).get("sources", []) if s.startswith("communication:")]
    said += [n for n in made.notes if n.startswith(("host memory per node:", "micro-batch "))]
    return {
        "plan": f"{made.describe()} {'FITS' if made.fits else 'DOES NOT FIT'}",
        "run": run_command(made, None, [f"model.name_or_path=tests/fixtures/model_configs/{question.model}",
                                        "lora.modules_to_save=[]", *question.overrides]) if made.fits else "",
        "remedy": (f"{fitting[0]['name']}: {fitting[0]['peak_bytes'] / gib:.1f} GiB, micro {fitting[0]['micro_batch_size']} "
                   f"({fitting[0]['result_text']}); `{' '.join(fitting[0]['change'])}`") if fitting else "",
        "others": [r["name"] for r in fitting[1:]],
        "said": said,
        "seconds": made.plan_seconds,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", help="the questions to ask, by name (default: all)")
    parser.add_argument("--out", default=str(REPORTS / "planner_questions.md"))
    args = parser.parse_args()
    lean()
    from tiny_default import hardware_line

    unknown = set(args.only or ()) - {q.name for q in QUESTIONS}
    if unknown:
        parser.error(f"unknown question(s) {', '.join(sorted(unknown))}; known: {', '.join(q.name for q in QUESTIONS)}")
    asked = [q for q in QUESTIONS if not args.only or q.name in args.only]
    started = time.perf_counter()
    lines = ["# The planner's answers to the questions asked before renting GPUs", "",
             "`python bench/planner_questions.py` plans each question as `make plan` does (the data not read: rows of "
             "data.max_seq_length), on hardware described, not detected. Every remedy is offered because the planner's "
             "own prediction says it fits; remedies that fit are ranked on the hardware at hand first, then by what "
             "they do to the trained model, then room to spare, then the predicted step time (docs/PLANNER.md). "
             "The plans are predictions; the measured accuracy of the planner is in planner_accuracy.md and "
             "gpu_lease.md.", "", f"Planned on: {hardware_line()}. {versions()}.", ""]
    answers = [(question, answer(question, plan(question))) for question in asked]
    lines += ["| question | hardware | the plan | the first remedy that fits |", "|---|---|---|---|"]
    for question, said in answers:
        first = said["remedy"].split(";")[0] if said["remedy"] else ("fits as configured" if said["run"] else "none")
        lines.append(f"| {question.asked} | {question.gpus} x {question.vram_gib:g} GiB | {said['plan']} | {first} |")
    lines.append("")
    for question, said in answers:
        lines += [f"## {question.asked}", "", f"`{question.command_line()}`", "", f"- plan: {said['plan']}"]
        if said["run"]:
            lines.append(f"- run: `{said['run']}`")
        if said["remedy"]:
            lines.append(f"- first remedy: {said['remedy']}")
        if said["others"]:
            lines.append(f"- also fitting: {', '.join(said['others'])}")
        lines += [f"- {line}" for line in said["said"]]
        lines += [f"- planned in {said['seconds']:.1f} s", ""]
    lines.append(f"All planned in {time.perf_counter() - started:.0f} s.")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
