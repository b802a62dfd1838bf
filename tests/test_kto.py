"""KTO (finetune.objective: kto): the config's refusals, KTO's unpaired format and pairs split into
labelled answers, tokens identical to TRL's KTOTrainer preparation, the planner's step (one row an
answer, the forwards of the mismatched rows, at least two answers a micro-batch), an out-of-memory
backoff that stops at two, and a real run through the entry script evaluated on held-out answers."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

from sft_play import config as config_module
from sft_play.data import DataStats
from sft_play.data.formats import InvalidRows
from sft_play.errors import UserError
from tests.conftest import REPO, run_script
from tests.test_preference import A, U, _pairs, _planned_dpo, _scalars, write


def kto_config(*overrides: str):
    return config_module.load(None, ["finetune.objective=kto", *overrides], check_paths=False)


def unpaired_file(path: Path, pairs: int, source: str = "train.jsonl") -> str:
    """The first `pairs` upper-case pairs of data/tiny_pref as KTO's labelled answers."""
    rows = []
    for line in (REPO / "data" / "tiny_pref" / source).read_text().splitlines()[:pairs]:
        pair = json.loads(line)
        rows += [{"prompt": pair["prompt"], "completion": pair["chosen"], "label": True},
                 {"prompt": pair["prompt"], "completion": pair["rejected"], "label": False}]
    return write(path, rows)


# ------------------------------------------------------------------------------------------------
# The config


def test_what_kto_takes():
    config = kto_config("preference.desirable_weight=1.33", "preference.reference=precomputed")
    assert schema_losses(config) == ["kto"] and schema_kl(config)
    alone = kto_config("preference.loss_type=apo_zero_unpaired", "train.micro_batch_size=1")
    assert not schema_kl(alone)  # no KL estimate: one answer a micro-batch is enough
    assert schema_losses(config_module.load(None, ["finetune.objective=dpo"], check_paths=False)) == ["sigmoid"]


def schema_losses(config) -> list[str]:
    return config_module.loss_types(config.preference, config.finetune.objective)


def schema_kl(config) -> bool:
    return config_module.kto_estimates_kl(config)


# ------------------------------------------------------------------------------------------------
# Data


def test_unpaired_rows_read_into_trl_shape_and_bad_ones_are_named(tmp_path):
    path = write(tmp_path / "kto.jsonl", [
        {"prompt": U("q"), "completion": A("B"), "label": True},
        {"prompt": "Q: ", "completion": "no", "label": 0},
        {"prompt": U("q"), "completion": A("b"), "label": "yes"},
        {"prompt": U("q"), "completion": A("  "), "label": False},
        {"prompt": U("q"), "completion": A("b")},
    ])
    stats = DataStats()
    with pytest.raises(InvalidRows) as caught:
        _pairs(path, kto_config().data, stats)
    said = str(caught.value)
    for row, words in ((3, "field 'label': expected true (a desirable answer) or false, got 'yes'"),
                       (4, "field 'completion[0].content': empty answer"), (5, "field 'label': missing")):
        assert f"kto.jsonl, row {row}, {words}" in said, said
    kept = _pairs(path, kto_config("data.on_invalid=skip").data, stats)
    assert kept == [{"prompt": U("q"), "completion": A("B"), "label": True},
                    {"prompt": "Q: ", "completion": "no", "label": False}]
    assert stats.formats == {path: "unpaired"}


def test_pairs_split_into_labelled_answers_and_labelled_answers_are_refused_to_dpo(tiny_tokenizer, tmp_path):
    from sft_play.data.preference import build_pairs, unpaired

    pairs = [{"prompt": U(f"q{i}"), "chosen": A("B"), "rejected": A("b"), "_row": f"f:{i}"} for i in range(4)]
    answers = unpaired(pairs, seed=0)
    assert sorted((a["prompt"][0]["content"], a["label"]) for a in answers) == sorted(
        (f"q{i}", label) for i in range(4) for label in (True, False))
    assert answers == unpaired(pairs, seed=0) and answers != unpaired(pairs, seed=1)  # shuffled by the seed
    assert {a["_row"] for a in answers if a["prompt"] == U("q2")} == {"f:2"}
    path = unpaired_file(tmp_path / "kto.jsonl", 3)
    dpo = config_module.load(None, ["finetune.objective=dpo", f"data.path={path}", "data.cache=false"],
                             check_paths=False)
    with pytest.raises(UserError, match="kto.jsonl holds answers labelled one by one .* set finetune.objective=kto"):
        build_pairs(dpo.data, dpo.preference, tiny_tokenizer)
    kto = kto_config(f"data.path={path}", "data.cache=false")
    stats = build_pairs(kto.data, kto.preference, tiny_tokenizer, objective="kto").stats
    assert stats.answers == stats.examples == 6 and stats.desirable == 3 and stats.pairs == 0


def test_tokens_are_trls_own(tiny_tokenizer, tmp_path):
    """Our preparation against KTOTrainer._prepare_dataset (TRL 1.16's map: the EOS of standard
    answers, the chat template, the common prefix), answer by answer."""
    import datasets
    from trl import KTOConfig, KTOTrainer

    from sft_play.data.preference import tokenize_answer

    rows = [{"prompt": U("Reverse the letters: z s b"), "completion": A("B S Z"), "label": True},
            {"prompt": [{"role": "system", "content": "S"}, *U("q"), *A("a"), *U("q2")], "completion": A("x y"),
             "label": False},
            {"prompt": "Hello ", "completion": "world", "label": True},
            {"prompt": "Q:", "completion": " yes<|im_end|>", "label": False}]
    args = KTOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", max_length=64)
    trainer = types.SimpleNamespace(_tokenizer=tiny_tokenizer, calculate_KL=False)
    for row in rows:
        theirs = KTOTrainer._prepare_dataset(trainer, datasets.Dataset.from_list([row]), tiny_tokenizer, args, "t")[0]
        ours = tokenize_answer(row, tiny_tokenizer)
        assert {k: theirs[k] for k in ours} == ours


# ------------------------------------------------------------------------------------------------
# The plan


def test_the_plan_counts_one_row_an_answer_and_the_mismatched_rows_forwards():
    """An answer is one row through the policy; estimating the KL term adds the policy's forward of
    the mismatched rows (before its training forward) and the reference's (beside its own): never
    less memory than without, and three forwards' FLOPs more than SFT with a copied reference."""
    from sft_play.planner.choose.split import choose_split
    from sft_play.planner.simulate import memory, predict, timing

    shape, kto = _planned_dpo("finetune.objective=kto", "preference.sft_weight=0")
    _, alone = _planned_dpo("finetune.objective=kto", "preference.sft_weight=0", "preference.loss_type=apo_zero_unpaired")
    assert kto.rows_per_example == 1 and kto.preference.kl and kto.smallest_micro_batch == 2
    assert not alone.preference.kl and alone.smallest_micro_batch == 1
    # (loaded in the compute dtype: bf16 where this CPU computes it natively, else fp32)
    assert kto.preference.reference == "copy"
    assert memory.reference_bytes(shape, kto) == shape.total_params * kto.precision.compute_bytes > 0
    sft = kto.with_changes(preference=None)
    for micro in (2, 4):
        with_kl, without = predict.predict(shape, kto, micro).peak_bytes, predict.predict(shape, alone, micro).peak_bytes
        assert with_kl >= without >= predict.predict(shape, sft, micro).peak_bytes + memory.reference_bytes(shape, kto)
    for run, forwards in ((kto, {"kl_forward": 1, "reference_forward": 2}), (alone, {"reference_forward": 1})):
        log: list = []
        predict.replay_step(shape, run, 2, False, None, log)
        # each forward without gradients feeds its labels first: one allocation of 8 bytes a token
        labels = [event[3] for event in log if event[0] == "a" and event[2] == 8 * 2 * kto.sequence.tokens
                  and event[3] in ("kl_forward", "reference_forward")]
        assert {c: labels.count(c) for c in set(labels)} == {c: n * 2 for c, n in forwards.items()}  # two steps
    n = shape.active_params
    assert timing.flops_per_token(shape, kto) - timing.flops_per_token(shape, sft) == pytest.approx(6.0 * n)
    assert timing.flops_per_token(shape, alone) - timing.flops_per_token(shape, sft) == pytest.approx(2.0 * n)
    # the split never takes one answer a micro-batch, even where only one would fit or divide
    assert choose_split(6, 1, 1, smallest=2).micro_batch_size == 2
    assert choose_split(15, 1, 4, smallest=2).micro_batch_size >= 2


def test_a_plan_takes_two_answers_a_process_or_says_it_cannot():
    """One answer a process: the nearest global batch of two a process, said; fewer answers than
    processes: one line, not TRL's refusal once the run has started."""
    from sft_play import hardware, planner

    config = config_module.load(REPO / "configs" / "run_tiny_dpo.yaml", [
        "model.name_or_path=configs/tiny_model", "finetune.objective=kto", "preference.sft_weight=0",
        "train.global_batch_size=2", "train.mixed_precision=no"], check_paths=False)
    stats = DataStats(examples=100, answers=100, tokens_max=26, tokens_p95=26, tokens_p50=26, tokens_total=2600,
                      loss_tokens=800)
    two = planner.target_for(hardware.detect().without_gpus(), gpus=2, allow_cpu=True)
    plan = planner.make_plan(config, two, stats, options=planner.QUICK)
    assert (plan.micro_batch_size, plan.global_batch_size) == (2, 4)
    assert any("using the nearest, 4" in note for note in plan.notes), plan.notes
    four = planner.target_for(hardware.detect().without_gpus(), gpus=4, allow_cpu=True)
    with pytest.raises(UserError, match="train.global_batch_size=2 over 4 process"):
        planner.make_plan(config, four, stats, options=planner.QUICK)


# ------------------------------------------------------------------------------------------------
# Real runs


def test_an_out_of_memory_backoff_stops_at_two_answers_and_keeps_the_mismatched_rows(tmp_path):
    """Out of memory at 4 answers a micro-batch: the rebuilt trainer at 2 keeps the first one's KL
    rows (those its reference's log-probs would be scored on); out of memory again at 2, nothing is
    left to halve: one line that says why, not TRL's refusal of one answer."""
    from transformers import TrainerCallback

    from sft_play import training
    from sft_play.run import BatchSplit
    from sft_play.training.backoff import OutOfMemory
    from tests.test_preference import _dpo_factory

    class InjectOutOfMemory(TrainerCallback):
        micro_batches: list[int] = []

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 2:
                InjectOutOfMemory.micro_batches.append(args.per_device_train_batch_size)
                raise __import__("torch").OutOfMemoryError("CUDA out of memory. (injected)")

    make = _dpo_factory(tmp_path, [InjectOutOfMemory()], "finetune.objective=kto", "preference.sft_weight=0",
                        "finetune.method=lora")
    with pytest.raises(OutOfMemory, match="nothing left to halve .KTO estimates its KL term"):
        training.train_with_backoff(make, BatchSplit(4, 1, 1, 4), smallest=2)
    assert InjectOutOfMemory.micro_batches == [4, 2]
    trainer = make(BatchSplit(2, 2, 1, 4))
    rotated = trainer.train_dataset  # (TRL's rotation at 4: each answer's KL row is the previous one's answer)
    assert rotated[1]["KL_completion_ids"] == rotated[0]["completion_ids"]
    assert rotated[0]["KL_completion_ids"] == rotated[3]["completion_ids"]


def test_kto_trains_on_labelled_answers_and_make_eval_scores_them(tmp_path):
    """Six steps on labelled answers from the tiny model's initial weights, LoRA (the reference the
    base with the adapter off): the loss starts at KTO's 0.5 and falls, the rewards and the KL
    estimate reach TensorBoard; make eval scores the held-out answers by their label."""
    train = unpaired_file(tmp_path / "train.jsonl", 400)
    held = unpaired_file(tmp_path / "validation.jsonl", 20, "validation.jsonl")
    result = run_script("train_distributed.py", "--config", "configs/run_tiny_dpo.yaml",
                        "model.name_or_path=configs/tiny_model", f"train.output_dir={tmp_path}", "train.run_name=kto",
                        "train.max_steps=6", "train.logging_steps=1", "train.eval_steps=6", "train.mixed_precision=no",
                        "data.num_proc=1", "preference.sft_weight=0", "finetune.objective=kto",
                        "finetune.method=lora", "train.learning_rate=3e-3", f"data.path={train}",
                        f"data.validation_path={held}")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    run_dir = tmp_path / "kto"
    scalars = _scalars(run_dir)
    losses = scalars["train/loss"]
    assert losses[0] == pytest.approx(0.5, abs=1e-3) and losses[-1] < losses[0] - 0.02, losses
    for tag in ("train/kl", "train/rewards/chosen", "train/rewards/rejected", "eval/rewards/margins"):
        assert tag in scalars, sorted(scalars)
    run = json.loads((run_dir / "run.json").read_text())
    assert run["preference"] == {"objective": "kto", "reference": "adapters_off", "precompute_batch_size": None,
                                 "kl": True}
    result = run_script("evaluate.py", "--run", str(run_dir), "--count", "2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    written = json.loads((run_dir / "eval.json").read_text())
    assert written["answers"] == 40 and written["desirable"] == 20
    assert written["desirable_reward"] > written["undesirable_reward"]  # six steps prefer upper case already
    assert 0.5 < written["reward_accuracy"] <= 1.0
    assert [g["label"] for g in written["generations"]] in ([True, False], [False, True], [True, True], [False, False])
    assert "reward accuracy" in result.stdout and "answers, 20 desirable" in result.stdout


def test_the_plan_says_why_its_micro_batch_exceeds_each_processs_share_and_why_dropout_is_off():
    """One answer a process (global batch 4 on 4 GPUs): the plan's micro-batch is 2, and it said
    "micro-batch 1 is the whole per-process share ... and it fits"; LoRA's dropout, which TRL's
    preference trainers switch off, was blamed on a mixture-of-experts model that Llama is not."""
    from sft_play import planner
    from tests.conftest import FIXTURES

    config = config_module.load(REPO / "configs" / "run_tiny_dpo.yaml", [
        f"model.name_or_path={FIXTURES / 'model_configs' / 'llama-3.1-8b'}", "finetune.method=lora",
        "finetune.objective=kto", "preference.sft_weight=0", "train.global_batch_size=4", "data.max_seq_length=2048",
        "lora.dropout=0.05"], check_paths=False)
    plan = planner.make_plan(config, planner.Target(4, 80 * 1024**3, "4 x H100", gpu_model="H100"),
                             options=planner.WITHOUT_REMEDIES)
    assert plan.fits and plan.micro_batch_size == 2 and plan.global_batch_size == 8
    assert ("micro-batch 2: KTO estimates its KL term from the other answers of a micro-batch, so it takes at "
            "least 2, more than the 1 each process takes of the global batch") in plan.notes
    assert not any("whole per-process share" in note for note in plan.notes)
    assert any(note.startswith("lora.dropout=0.05 is off: TRL's preference trainers") for note in plan.notes)
    assert not any("mixture-of-experts" in warning for warning in plan.warnings)
