"""Preference tuning on two CPU processes under every strategy, started by the make targets: DDP
and ZeRO-2 (the reference copy whole in each process: TRL prepares it at ZeRO stage 0), ZeRO-3
(the reference sharded by TRL's prepare_deepspeed, loaded under zero.Init) and FSDP2 (LoRA: the
reference is the base with the adapter off), ORPO under ZeRO-3 (no reference at all) and KTO under
ZeRO-3 (its labelled answers, the reference sharded). The same pairs and reference give the same losses."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from tests.conftest import FORKED, REPO

pytestmark = pytest.mark.slow  # two-process trainings started by the make targets

RUNS = {  # name: (make target, overrides)
    "ddp": ("train-distributed", ()),
    "zero2": ("train-deepspeed", ("distributed.strategy=deepspeed_zero2",)),
    "zero3": ("train-deepspeed", ("distributed.strategy=deepspeed_zero3",)),
    "fsdp2-lora": ("train-distributed", ("distributed.strategy=fsdp2", "finetune.method=lora")),
    # ORPO, full fine-tuning sharded: no reference loaded, none prepared for DeepSpeed
    "orpo-zero3": ("train-deepspeed", ("distributed.strategy=deepspeed_zero3", "finetune.objective=orpo")),
    # KTO, the reference copy sharded as DPO's, four answers a process (the KL estimate needs two)
    "kto-zero3": ("train-deepspeed", ("distributed.strategy=deepspeed_zero3", "finetune.objective=kto")),
}
COMMON = ("model.name_or_path=configs/tiny_model", "train.max_steps=3", "train.logging_steps=1", "train.eval_steps=0",
          "train.global_batch_size=8", "train.mixed_precision=no", "data.num_proc=1", "preference.sft_weight=0")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    done = {}
    for name, (target, overrides) in RUNS.items():  # one after another: two processes each, on two cores
        done[name] = subprocess.run(
            ["make", "--no-print-directory", target, "CPU=1", "NUM_GPUS=2", "CONFIG=configs/run_tiny_dpo.yaml",
             f"ARGS={' '.join([*COMMON, *overrides])} train.output_dir={root} train.run_name={name}"],
            cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, **FORKED})  # (launchers forked)
    return root, done


def _losses(output: str) -> list[float]:
    return [float(x) for x in re.findall(r"step \d+/3  loss ([0-9.]+)", output)]


@pytest.mark.parametrize("name", list(RUNS))
def test_dpo_trains_on_two_processes(runs, name):
    root, done = runs
    result = done[name]
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "2 process(es) on 1 node(s)" in result.stdout + result.stderr
    run = json.loads((root / name / "run.json").read_text())
    assert run["parallel"]["world_size"] == 2 and run["preference"]["reference"] == (
        "none" if "orpo" in name else "adapters_off" if "lora" in name else "copy")
    losses = _losses(result.stdout + result.stderr)
    assert len(losses) == 3, losses
    if "orpo" in name:  # the chosen answers' NLL (about log 512 from random weights) minus beta x the odds term
        assert 5.5 < losses[0] < 7 and losses[-1] < losses[0] and "log_odds_ratio" in result.stdout + result.stderr
    elif "kto" in name:  # the policy is its reference, the KL estimate 0: 1 - sigmoid(0) on each side, halved
        assert losses[0] == pytest.approx(0.5, abs=1e-4) and " kl " in result.stdout + result.stderr, losses
    else:  # the policy is its reference: log 2
        assert losses[0] == pytest.approx(0.6931, abs=1e-4), losses
    if name in ("ddp", "zero2"):  # replicated weights: every rank ends with the same
        assert re.search(r"final weights identical on all 2 rank\(s\)", result.stdout + result.stderr)


def test_every_full_strategy_trains_the_same_steps(runs):
    """The same pairs, reference and global batch of pairs: DDP's losses are ZeRO-2's and ZeRO-3's."""
    _, done = runs
    losses = {name: _losses(done[name].stdout + done[name].stderr) for name in ("ddp", "zero2", "zero3")}
    assert losses["zero2"] == pytest.approx(losses["ddp"], abs=2e-4)
    assert losses["zero3"] == pytest.approx(losses["ddp"], abs=2e-4)
    assert losses["ddp"][-1] < losses["ddp"][0]
