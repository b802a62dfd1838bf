"""Preference tuning beside TRL's own trainers, on this machine: the same starting weights, pairs,
steps, batch, learning rate and loss through SFT-Play (`make train CONFIG=configs/run_tiny_dpo.yaml`
as it runs, with the objective set) and through TRL's trainer for that objective, built as TRL's
own scripts build theirs (the model loaded from the folder, the pairs by ``datasets.load_dataset``
of data/tiny_pref, TRL's own preparation): ``DPOTrainer`` as ``trl.scripts.dpo.main``; for ORPO and
SimPO, ``ORPOTrainer`` and ``CPOTrainer`` with ``loss_type="simpo"`` (``trl.experimental``); for
KTO, ``KTOTrainer`` on the pairs split into labelled answers in SFT-Play's order (each pair's chosen
and rejected answer, shuffled with the seed: TRL's trainer reads its rows in order, and TRL's own
``unpair_preference_dataset`` would put a thousand desirable answers before their undesirable
ones). Writes pairs (KTO: answers) per second of the trainer's own runtime, the losses at each
logged step and the peak resident memory of each process to docs/reports/preference.md.

Both sides: full fine-tuning, the loss alone (beta 0.1, TRL's default for each; DPO's reference a
frozen copy; the default's SFT term off, TRL's scripts have none; SimPO's gamma 0.5, no NLL beside
it), fp32, global batch 16 pairs in one micro-batch, learning rate 5e-4 with the default's schedule,
seed 42, no evaluation. The starting weights are the tiny model's initialised ones
(configs/tiny_model, seed 0), or the SFT model `--sft` names.

With --default it also times `make train CONFIG=configs/run_tiny_dpo.yaml` as a new user runs it
(the SFT model trained first when missing), and scores the result (make eval: held-out reward
accuracy; greedy answers against the chosen ones).

Usage: python bench/preference.py [--objectives dpo kto orpo simpo] [--steps 100] [--sft runs/tiny-sft/model]
       [--default] [--out docs/reports/preference.md]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO, REPORTS, run_python, versions, worker_env
from tiny_default import hardware_line

PAIRS_PER_STEP = 16
LEARNING_RATE = 5e-4


def logging_steps(steps: int) -> int:
    """Every step of a short run logged, every tenth of a long one (both sides alike)."""
    return 1 if steps < 20 else 10


def starting_weights(folder: Path, sft: str | None) -> str:
    """The folder both sides start from: the SFT model given, or the tiny model initialised as
    SFT-Play initialises it (configs/tiny_model, model.init_seed 0), saved with its tokenizer."""
    if sft:
        return sft
    from sft_play import config as config_module
    from sft_play import model
    from sft_play.run import resolve

    config = config_module.load(REPO / "configs" / "run_tiny.yaml", ["train.mixed_precision=no"])
    run = resolve(config, on_cuda=False, bf16_supported=False, world_size=1)
    model.load_model(config, run, device="cpu").save_pretrained(folder)
    model.load_tokenizer(config).save_pretrained(folder)
    return str(folder)


OBJECTIVES = ("dpo", "kto", "orpo", "simpo")


def ours_worker(weights: str, folder: Path, steps: int, objective: str = "dpo") -> dict:
    """SFT-Play's entry script in this process, as make train runs it; its summary and peak RSS."""
    import runpy

    sys.argv = ["scripts/train_distributed.py", "--config", "configs/run_tiny_dpo.yaml",
                f"model.name_or_path={weights}", "model.build_with=null", "preference.sft_weight=0",
                f"finetune.objective={objective}",
                f"train.max_steps={steps}", "train.eval_steps=0", "train.tensorboard=false", f"train.logging_steps={logging_steps(steps)}",
                "train.mixed_precision=no", f"train.micro_batch_size={PAIRS_PER_STEP}",
                f"train.global_batch_size={PAIRS_PER_STEP}", f"train.learning_rate={LEARNING_RATE}",
                f"train.output_dir={folder}", "train.run_name=ours"]
    try:
        runpy.run_path(str(REPO / "scripts" / "train_distributed.py"), run_name="__main__")
    except SystemExit as exit_:
        if exit_.code:
            raise
    summary = json.loads((folder / "ours" / "summary.json").read_text())
    return {"runtime_s": summary["train_runtime_s"], "losses": [round(loss, 4) for _, loss in summary["losses"]],
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def trl_worker(weights: str, folder: Path, steps: int, objective: str = "dpo") -> dict:
    """TRL's trainer for `objective` as its script builds it (trl/scripts/dpo.py's main() for DPO),
    with the same settings."""
    import warnings

    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (that trl.experimental's APIs may change)
        from trl.experimental.cpo import CPOConfig, CPOTrainer
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    common = dict(output_dir=str(folder / "trl"), use_cpu=True, bf16=False, report_to="none", seed=42,
                  per_device_train_batch_size=PAIRS_PER_STEP, gradient_accumulation_steps=1, max_steps=steps,
                  learning_rate=LEARNING_RATE, lr_scheduler_type="cosine", warmup_steps=0.05,
                  logging_steps=logging_steps(steps), logging_first_step=True, max_length=64, beta=0.1,
                  save_strategy="no", optim="adamw_torch")
    if objective == "dpo":
        trainer_class, args = DPOTrainer, DPOConfig(**common, activation_checkpointing=False, loss_type=["sigmoid"])
    elif objective == "kto":
        trainer_class, args = KTOTrainer, KTOConfig(**common, activation_checkpointing=False, loss_type="kto")
    elif objective == "orpo":
        trainer_class, args = ORPOTrainer, ORPOConfig(**common)
    else:
        trainer_class, args = CPOTrainer, CPOConfig(**common, loss_type="simpo", cpo_alpha=0.0, simpo_gamma=0.5)
    model = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(weights)
    dataset = load_dataset(str(REPO / "data" / "tiny_pref"))["train"]
    if objective == "kto":
        from datasets import Dataset

        from sft_play.data.preference import unpaired

        dataset = Dataset.from_list([{key: answer[key] for key in ("prompt", "completion", "label")}
                                     for answer in unpaired(list(dataset), seed=42)])
    trainer = trainer_class(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    output = trainer.train()
    losses = [round(e["loss"], 4) for e in trainer.state.log_history if "loss" in e]
    return {"runtime_s": output.metrics["train_runtime"], "losses": losses,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def side(name: str, weights: str, folder: Path, steps: int, objective: str = "dpo") -> dict:
    started = time.monotonic()
    result = run_python([__file__, f"--{name}-worker", weights, folder, "--steps", steps, "--objective", objective],
                        cwd=REPO, env=worker_env())
    line = next((line for line in reversed(result.stdout.splitlines()) if line.startswith("{")), None)
    if result.returncode != 0 or line is None:
        raise SystemExit(f"{name} failed:\n{result.stderr[-3000:]}")
    row = json.loads(line)
    return {**row, "wall_s": time.monotonic() - started, "pairs_per_s": steps * PAIRS_PER_STEP / row["runtime_s"]}


def the_default(folder: Path) -> dict:
    """`make train CONFIG=configs/run_tiny_dpo.yaml` from a clean state (its SFT model trained
    first), then make eval; the wall time of each stage."""
    started = time.monotonic()
    sft_model = folder / "tiny-sft" / "model"
    train = run_python(["scripts/train_distributed.py", "--config", "configs/run_tiny_dpo.yaml",
                        f"model.name_or_path={sft_model}", f"train.output_dir={folder}", "train.run_name=dpo"],
                       cwd=REPO)
    wall = time.monotonic() - started
    if train.returncode != 0:
        raise SystemExit(f"the default failed:\n{train.stderr[-3000:]}")
    sft = json.loads((folder / "tiny-sft" / "summary.json").read_text())
    dpo = json.loads((folder / "dpo" / "summary.json").read_text())
    evaluated = run_python(["scripts/evaluate.py", "--run", folder / "dpo", "--count", "5"], cwd=REPO)
    if evaluated.returncode != 0:
        raise SystemExit(f"make eval failed:\n{evaluated.stderr[-3000:]}")
    result = json.loads((folder / "dpo" / "eval.json").read_text())
    return {"wall_s": wall, "sft_train_s": sft["train_runtime_s"], "dpo_train_s": dpo["train_runtime_s"],
            "reward_accuracy": result["reward_accuracy"], "margin_mean": result["margin_mean"],
            "preference_accuracy": result["preference_accuracy"],
            "preference_accuracy_before": result["preference_accuracy_before"],
            "chosen": sum(g["matches_chosen"] for g in result["generations"]), "of": len(result["generations"])}


# What each objective's sides run, as the report says it
RUNS = {
    "dpo": ("DPO", "TRL's DPOTrainer", "sigmoid DPO with a frozen reference copy"),
    "kto": ("KTO", "TRL's KTOTrainer", "KTO (desirable and undesirable weights 1) with a frozen reference copy, on "
            "the pairs split into 8,000 labelled answers; the rows are answers, not pairs"),
    "orpo": ("ORPO", "TRL's ORPOTrainer (trl.experimental)", "ORPO (the chosen answers' NLL plus beta x the odds "
             "ratio), no reference"),
    "simpo": ("SimPO", "TRL's CPOTrainer with loss_type simpo (trl.experimental)", "SimPO (gamma 0.5, no NLL), no "
              "reference"),
}


def report(sections: dict[str, dict], steps: int, start: str, default: dict | None) -> str:
    """`sections`: each objective's rows, side by side."""
    lines = [
        "# Preference tuning: SFT-Play beside TRL's own trainers",
        "",
        "Written by `python bench/preference.py` (its docstring says what each side runs). The same starting",
        f"weights ({start}), pairs (data/tiny_pref), {steps} steps of {PAIRS_PER_STEP} pairs, learning rate",
        f"{LEARNING_RATE:g}, beta 0.1, fp32, one process each; pairs per second of the trainer's own runtime, peak",
        "resident memory of the whole process.",
        "",
        f"- machine: {hardware_line()} (no GPU)",
        f"- software: {versions()}",
    ]
    for objective, rows in sections.items():
        title, peer, loss = RUNS[objective]
        ours, theirs = rows["SFT-Play"], rows["TRL"]
        lines += ["", f"## {title}: SFT-Play beside {peer}", "", f"The loss: {loss}.", "",
                  f"| side | pairs/s | runtime (s) | process wall (s) | peak RSS (GiB) | losses (every "
                  f"{logging_steps(steps)} step(s)) |", "|---|---|---|---|---|---|"]
        for name, row in rows.items():
            lines.append(f"| {name} | {row['pairs_per_s']:.1f} | {row['runtime_s']:.1f} | {row['wall_s']:.1f} | "
                         f"{row['peak_rss_gib']:.2f} | {', '.join(f'{x:g}' for x in row['losses'])} |")
        same = ours["losses"] == theirs["losses"]
        lines += ["", f"Ratio of pairs/s, SFT-Play to TRL: **{ours['pairs_per_s'] / theirs['pairs_per_s']:.2f}**; "
                  f"losses {'identical at every logged step' if same else 'differ (see the table)'}."]
        if objective in ("orpo", "simpo"):
            lines += ["", f"TRL's {title} trainer tokenises the pairs' text itself and ends each answer with one more "
                      "end-of-sequence token than the chat template (the DPO trainer's tokens, which SFT-Play's side "
                      "uses): its answers are a token longer, so the losses are close, not equal. The loss computed "
                      "both ways from the same tokens is equal (tests/test_preference.py)."]
    if default is not None:
        lines += ["", "## The embedded default as a new user runs it", "",
                  "`make train CONFIG=configs/run_tiny_dpo.yaml` from a clean state (the SFT model trained first), then",
                  "`make eval` on the 90 held-out pairs:", "",
                  f"- wall time {default['wall_s']:.0f} s (SFT training {default['sft_train_s']:.0f} s, DPO training "
                  f"{default['dpo_train_s']:.0f} s, the rest start-up, planning and saving)",
                  f"- held-out reward accuracy {default['reward_accuracy']:.3f}, margin mean {default['margin_mean']:.2f}; "
                  f"the model prefers the chosen answer in {default['preference_accuracy']:.3f} of the pairs "
                  f"({default['preference_accuracy_before']:.3f} before: the SFT model)",
                  f"- greedy answers equal to the chosen (upper-case) ones: {default['chosen']} of {default['of']}"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--objectives", nargs="+", choices=OBJECTIVES, default=list(OBJECTIVES))
    parser.add_argument("--objective", choices=OBJECTIVES, default="dpo", help=argparse.SUPPRESS)  # (a worker's)
    parser.add_argument("--sft", help="the SFT model both sides start from (default: the tiny model initialised)")
    parser.add_argument("--default", action="store_true", help="also time and score make train of the default")
    parser.add_argument("--out", type=Path, default=REPORTS / "preference.md")
    parser.add_argument("--ours-worker", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--trl-worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name, worker in (("ours_worker", ours_worker), ("trl_worker", trl_worker)):
        given = getattr(args, name)
        if given:
            print(json.dumps(worker(given[0], Path(given[1]), args.steps, args.objective)))
            return 0
    with tempfile.TemporaryDirectory(prefix="sft-play-preference-") as folder:
        root = Path(folder)
        weights = starting_weights(root / "start", args.sft)
        sections = {objective: {"SFT-Play": side("ours", weights, root / objective, args.steps, objective),
                                "TRL": side("trl", weights, root / objective, args.steps, objective)}
                    for objective in args.objectives}
        default = the_default(root / "default") if args.default else None
    start = args.sft or "the tiny model initialised, configs/tiny_model seed 0"
    args.out.write_text(report(sections, args.steps, start, default))
    print(args.out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
