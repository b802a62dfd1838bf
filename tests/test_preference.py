"""Preference tuning (finetune.objective: dpo, orpo, simpo): the config's refusals, the pair formats and their
bad rows, tokens identical to TRL's DPOTrainer preparation, the pairs' statistics and cache, the
planner's step of two rows per pair with its reference, and real DPO runs through the entry script."""

from __future__ import annotations

import json
import logging
import types
from pathlib import Path

import pytest

from sft_play import config as config_module
from sft_play.config import schema
from sft_play.data import DataStats, load_records
from sft_play.data.formats import InvalidRows, UnknownFormat
from tests.conftest import FORKED, REPO, run_script

U = lambda text: [{"role": "user", "content": text}]  # noqa: E731
A = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731


def dpo_config(*overrides: str):
    return config_module.load(None, ["finetune.objective=dpo", *overrides], check_paths=False)


def write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _pairs(path: str, cfg, stats: DataStats | None = None) -> list[dict]:
    from sft_play.data.pipeline import ORIGIN, iter_records

    return [{k: v for k, v in r.items() if k != ORIGIN} for r in iter_records(path, cfg, stats or DataStats(),
                                                                                pairs=True)]


# ------------------------------------------------------------------------------------------------
# The config


def test_sft_configs_are_unchanged_and_a_stray_preference_section_is_named():
    assert schema.consistency_problems(config_module.load(REPO / "configs" / "run_tiny.yaml", [])) == []
    with pytest.raises(config_module.ConfigError) as caught:
        config_module.load(None, ["preference.beta=0.2"], check_paths=False)
    assert caught.value.problems == ["preference: set, but finetune.objective is sft (it would be ignored); set "
                                     "finetune.objective to dpo, kto, orpo or simpo to train on preference data"]
    # the run folder's config.yaml holds every section at its defaults: read back, it says nothing
    saved = config_module.RunConfig().to_yaml()
    assert schema.consistency_problems(config_module.RunConfig.model_validate(__import__("yaml").safe_load(saved))) == []
    dpo = dpo_config("data.packing=true")
    assert not dpo.data.packing  # pairs are never packed; the run folder's config reads back the same
    assert config_module.RunConfig.model_validate(__import__("yaml").safe_load(dpo.to_yaml())) == dpo


def test_the_losses_take_the_sft_term_at_its_weight():
    assert schema.preference_losses(dpo_config()) == (["sigmoid"], None)
    assert schema.preference_losses(dpo_config("preference.sft_weight=0.2")) == (["sigmoid", "sft"], [1.0, 0.2])
    assert schema.preference_losses(dpo_config('preference.loss_type=["ipo","hinge"]', "preference.loss_weights=[1,2]",
                                               "preference.sft_weight=0.5")) == (["ipo", "hinge", "sft"], [1, 2, 0.5])


# ------------------------------------------------------------------------------------------------
# Formats and bad rows


def test_each_pair_format_reads_into_trl_shape(tmp_path, caplog):
    trl_chat = write(tmp_path / "trl.jsonl", [{"prompt": U("q"), "chosen": A("B"), "rejected": A("b")}])
    trl_text = write(tmp_path / "text.jsonl", [{"prompt": "Q: ", "chosen": "yes", "rejected": "no"}])
    implicit = write(tmp_path / "implicit.jsonl", [{"chosen": U("q") + A("B"), "rejected": U("q") + A("b")}])
    hh = write(tmp_path / "hh.jsonl", [{"chosen": "\n\nHuman: hi\n\nAssistant: Hello!",
                                        "rejected": "\n\nHuman: hi\n\nAssistant: Go away."}])
    sharegpt = write(tmp_path / "llamafactory.jsonl", [{
        "conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "q"}],
        "chosen": {"from": "gpt", "value": "B"}, "rejected": {"from": "gpt", "value": "b"}}])
    alpaca = write(tmp_path / "alpaca.jsonl", [{"instruction": "q", "input": "x", "chosen": "B", "rejected": "b"}])
    intel = write(tmp_path / "intel.jsonl", [{"question": "Q: ", "chosen": "yes", "rejected": "no"}])

    stats = DataStats()
    assert _pairs(trl_chat, dpo_config().data, stats) == [{"prompt": U("q"), "chosen": A("B"), "rejected": A("b")}]
    assert stats.formats == {trl_chat: "preference"}
    assert _pairs(trl_text, dpo_config().data) == [{"prompt": "Q: ", "chosen": "yes", "rejected": "no"}]
    assert _pairs(implicit, dpo_config().data) == [{"prompt": U("q"), "chosen": A("B"), "rejected": A("b")}]
    # (TRL's extract_prompt: the shared text up to the last whitespace before they differ)
    assert _pairs(hh, dpo_config().data) == [{"prompt": "\n\nHuman: hi\n\nAssistant:", "chosen": " Hello!",
                                              "rejected": " Go away."}]
    stats = DataStats()
    assert _pairs(sharegpt, dpo_config().data, stats) == [
        {"prompt": [{"role": "system", "content": "S"}, *U("q")], "chosen": A("B"), "rejected": A("b")}]
    assert stats.formats == {sharegpt: "pairwise"}
    assert _pairs(alpaca, dpo_config().data) == [{"prompt": U("q\n\nx"), "chosen": A("B"), "rejected": A("b")}]
    assert _pairs(intel, dpo_config("data.columns.prompt=question").data) == [
        {"prompt": "Q: ", "chosen": "yes", "rejected": "no"}]
    assert _pairs(trl_chat, dpo_config("data.system_prompt=Be brief.").data)[0]["prompt"] == [
        {"role": "system", "content": "Be brief."}, *U("q")]
    # text pairs have no chat to give it: said once, not silently dropped
    write(Path(trl_text), [{"prompt": "Q: ", "chosen": "yes", "rejected": "no"}] * 3)
    with caplog.at_level(logging.WARNING, logger="sft_play.data"):
        assert _pairs(trl_text, dpo_config("data.system_prompt=Be brief.").data)[0]["prompt"] == "Q: "
    said = [r.getMessage() for r in caplog.records if "data.system_prompt" in r.getMessage()]
    assert said == [f"data.system_prompt: {trl_text} holds text, not conversations: there is no chat to give a "
                    "system message, so the setting changes nothing for its pairs"]


def test_a_prompt_column_wins_over_the_chosen_conversation_beside_it(tmp_path):
    """UltraFeedback's pairs carry prompt, chosen, rejected and the chosen conversation as messages:
    read as TRL's preference format, not as a pairwise conversation (which would repeat the answer);
    a pairwise conversation that ends with an assistant turn is refused by row, and SFT still reads
    messages beside chosen/rejected as chats."""
    ultra = write(tmp_path / "ultra.jsonl", [{"prompt": "q", "chosen": U("q") + A("B"), "rejected": U("q") + A("b"),
                                              "messages": U("q") + A("B")}])
    stats = DataStats()
    assert _pairs(ultra, dpo_config().data, stats) == [{"prompt": U("q"), "chosen": A("B"), "rejected": A("b")}]
    assert stats.formats == {ultra: "preference"}
    answered = write(tmp_path / "answered.jsonl", [{"conversations": [{"from": "human", "value": "q"},
                                                                      {"from": "gpt", "value": "a"}],
                                                    "chosen": {"from": "gpt", "value": "B"},
                                                    "rejected": {"from": "gpt", "value": "b"}}])
    with pytest.raises(InvalidRows, match="row 1, field 'conversations': the conversation before the answers ends"):
        _pairs(answered, dpo_config().data)
    assert load_records(ultra, config_module.load(None, [], check_paths=False).data, DataStats())[0]["messages"] == \
        U("q") + A("B")


def test_bad_pairs_are_named_by_file_and_row(tmp_path):
    path = write(tmp_path / "bad.jsonl", [
        {"prompt": U("q"), "chosen": A("B"), "rejected": A("b")},
        {"prompt": U("q"), "chosen": A("same"), "rejected": A("same")},
        {"prompt": U("q"), "chosen": A("  "), "rejected": A("b")},
        {"prompt": U("q"), "chosen": A("B")},
        {"chosen": U("a") + A("B"), "rejected": U("b") + A("b")},
        {"prompt": U("q"), "chosen": A("B"), "rejected": U("b")},
    ])
    with pytest.raises(InvalidRows) as caught:
        _pairs(path, dpo_config().data)
    said = str(caught.value)
    assert "5 bad row(s)" in said
    for row, words in ((2, "field 'rejected': chosen equal to rejected"), (3, "field 'chosen[0].content': empty answer"),
                       (4, "field 'rejected': missing"), (5, "field 'chosen': no prompt: chosen and rejected share no turn"),
                       (6, "field 'rejected': no assistant turn to learn from")):
        assert f"bad.jsonl, row {row}, {words}" in said, said
    stats = DataStats()
    assert len(_pairs(path, dpo_config("data.on_invalid=skip").data, stats)) == 1
    assert sum(stats.skipped.values()) == 5


def test_pairs_under_sft_and_sft_data_under_dpo_are_refused_by_name(tmp_path):
    pairs = write(tmp_path / "pairs.jsonl", [{"prompt": "q", "chosen": "B", "rejected": "b"}])
    with pytest.raises(UnknownFormat, match="finetune.objective=dpo"):
        load_records(pairs, config_module.load(None, [], check_paths=False).data, DataStats())
    chats = write(tmp_path / "chats.jsonl", [{"messages": U("q") + A("a")}])
    with pytest.raises(UnknownFormat, match="cannot read preference data"):
        _pairs(chats, dpo_config().data)


# ------------------------------------------------------------------------------------------------
# Tokens, statistics, cache


def test_tokens_are_trls_own(tiny_tokenizer, tmp_path):
    """Our preparation against DPOTrainer._prepare_dataset (TRL 1.16's map: prompt extraction, the
    EOS of standard answers, the chat template, the common prefix), pair by pair."""
    import datasets
    from trl import DPOConfig, DPOTrainer

    from sft_play.data.preference import tokenize_pair

    rows = [{"prompt": U("Reverse the letters: z s b"), "chosen": A("B S Z"), "rejected": A("b s z")},
            {"prompt": [{"role": "system", "content": "S"}, *U("q"), *A("a"), *U("q2")], "chosen": A("X"),
             "rejected": A("x y")},
            {"prompt": "Hello ", "chosen": "world", "rejected": "there"},
            {"prompt": "Q:", "chosen": " yes<|im_end|>", "rejected": " no"}]
    args = DPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", max_length=64)
    trainer = types.SimpleNamespace(_tokenizer=tiny_tokenizer)
    for row in rows:
        theirs = DPOTrainer._prepare_dataset(trainer, datasets.Dataset.from_list([row]), tiny_tokenizer, args, "t")[0]
        ours = tokenize_pair(row, tiny_tokenizer)
        assert {k: theirs[k] for k in ours} == ours


def test_pair_statistics_cuts_and_drops(tiny_tokenizer, tmp_path):
    from sft_play.data.preference import build_pairs, prompt_fills_reason

    long_prompt = " ".join("abcdefghij") * 4
    path = write(tmp_path / "pairs.jsonl", [
        {"prompt": U("Reverse the letters: z s b"), "chosen": A("B S Z"), "rejected": A("b s z")},
        {"prompt": U(long_prompt), "chosen": A("B"), "rejected": A("b")},
        {"prompt": U("q"), "chosen": A(" ".join("ABCDEFGHIJKLMNOPQRSTUVWXYZ" * 2)), "rejected": A("b")},
    ])
    config = dpo_config(f"data.path={path}", "data.max_seq_length=40", "data.cache=false")
    bundle = build_pairs(config.data, config.preference, tiny_tokenizer)
    stats = bundle.stats
    assert stats.pairs == stats.examples == 2 and len(bundle.train) == 2
    assert stats.skipped_rows == {prompt_fills_reason(40): [f"{path}:2"]}
    assert stats.truncated == 1 and stats.dropped_overlong == 0  # the long answer is cut when batched
    assert stats.answer_tokens_max == len(bundle.train[1]["chosen_ids"]) > stats.answer_tokens_p95 - 1
    first = bundle.train[0]
    assert stats.loss_tokens == sum(len(bundle.train[i][side]) for i in range(2) for side in ("chosen_ids", "rejected_ids"))
    assert tiny_tokenizer.decode(first["chosen_ids"]).startswith("B S Z")

    dropped = dpo_config(f"data.path={path}", "data.max_seq_length=40", "data.cache=false", "data.overlong=drop",
                         "preference.max_prompt_length=16")
    stats = build_pairs(dropped.data, dropped.preference, tiny_tokenizer).stats
    assert stats.prompts_cut == 1 and stats.prompt_tokens_max == 16
    assert stats.pairs == 2 and stats.dropped_overlong == 1  # the long answer; the cut prompt now fits


def test_pairs_come_from_the_cache_the_second_time(tiny_tokenizer, tmp_path, caplog, monkeypatch):
    from sft_play.data.preference import build_pairs

    monkeypatch.setenv("SFT_PLAY_CACHE", str(tmp_path / "cache"))
    path = write(tmp_path / "pairs.jsonl", [{"prompt": U("q"), "chosen": A("B"), "rejected": A("b")}] * 3)
    config = dpo_config(f"data.path={path}")
    with caplog.at_level(logging.INFO, logger="sft_play.data.preference"):
        first = build_pairs(config.data, config.preference, tiny_tokenizer)
        assert "from the cache" not in caplog.text
        second = build_pairs(config.data, config.preference, tiny_tokenizer)
        assert "from the cache" in caplog.text
    assert second.train.to_dict() == first.train.to_dict() and second.stats == first.stats
    caplog.clear()
    cut = dpo_config(f"data.path={path}", "preference.max_prompt_length=2")
    with caplog.at_level(logging.INFO, logger="sft_play.data.preference"):
        build_pairs(cut.data, cut.preference, tiny_tokenizer)
    assert "from the cache" not in caplog.text  # another prompt cut: other tokens


# ------------------------------------------------------------------------------------------------
# The plan


def _planned_dpo(*overrides: str):
    """(model shape, resolved run) of the DPO default on the tiny model, one CPU process, for pairs
    of 26 tokens."""
    from sft_play import hardware, planner

    config = config_module.load(REPO / "configs" / "run_tiny_dpo.yaml",
                                ["model.name_or_path=configs/tiny_model", *overrides], check_paths=False)
    stats = DataStats(examples=100, pairs=100, tokens_max=26, tokens_p95=26, tokens_p50=26, tokens_total=5000,
                      loss_tokens=1600)
    target = planner.target_for(hardware.detect().without_gpus(), gpus=1, allow_cpu=True)
    shape = planner.model_shape(config)
    return shape, planner.resolve_for(config, target, stats, shape)


def test_the_plan_counts_two_rows_a_pair_the_reference_forward_and_its_copy():
    """A pair is two rows through the policy: its step at micro-batch m replays the SFT step of 2m
    rows plus the reference's forward (precomputed: none) and, for a copy, the reference's weights."""
    from sft_play.planner.simulate import memory, predict

    shape, copy = _planned_dpo()
    _, precomputed = _planned_dpo("preference.reference=precomputed")
    assert copy.rows_per_example == 2 and copy.preference.reference == "copy" and copy.sequence.tokens == 26
    # (loaded in the compute dtype: bf16 where this CPU computes it natively, else fp32)
    assert memory.reference_bytes(shape, copy) == shape.total_params * copy.precision.compute_bytes > 0
    assert memory.reference_bytes(shape, precomputed) == 0
    sft = copy.with_changes(preference=None)
    for micro in (1, 2, 4):
        with_copy = predict.predict(shape, copy, micro).peak_bytes
        scored_before = predict.predict(shape, precomputed, micro).peak_bytes
        as_sft = predict.predict(shape, sft, 2 * micro).peak_bytes
        assert scored_before >= as_sft  # two rows a pair, and the labels
        assert with_copy > scored_before + memory.reference_bytes(shape, copy) - 1
    assert [predict.predict(shape, copy, m).peak_bytes for m in (1, 2, 4)] == sorted(
        predict.predict(shape, copy, m).peak_bytes for m in (1, 2, 4))
    # ORPO and SimPO score the policy alone: no reference forward, no copy, the precomputed run's step
    for objective in ("orpo", "simpo"):
        _, alone = _planned_dpo(f"finetune.objective={objective}", "preference.sft_weight=0")
        assert alone.preference.reference == "none" and memory.reference_bytes(shape, alone) == 0
        assert not alone.preference.reference_forward and alone.rows_per_example == 2
        assert [predict.predict(shape, alone, m).peak_bytes for m in (1, 2, 4)] == [
            predict.predict(shape, precomputed, m).peak_bytes for m in (1, 2, 4)]


def test_a_reference_pass_larger_than_the_step_is_the_plans_peak():
    """precomputed: TRL scores every pair before training, preference.precompute_batch_size pairs
    a forward without gradients and before the optimizer's states exist. At the micro-batch that
    pass is below a training step; far larger, it is the run's peak, and the plan says so."""
    from sft_play.planner.simulate import predict

    shape, run = _planned_dpo("preference.reference=precomputed")
    step = predict.predict(shape, run, 2)
    assert "precompute_pass" not in step.breakdown  # the pass at the micro-batch: below the step
    _, larger = _planned_dpo("preference.reference=precomputed", "preference.precompute_batch_size=512")
    scored = predict.predict(shape, larger, 2)
    assert scored.peak_bytes > step.peak_bytes and scored.breakdown.get("precompute_pass", 0) > 0
    assert scored.peak_bytes == sum(scored.breakdown.values())
    # the pass has no optimizer states and no gradients: its peak is the weights and the forward's
    assert "optimizer_states" not in scored.breakdown and "gradients" not in scored.breakdown
    assert predict.predict(shape, larger, 2).peak_bytes < predict.predict(shape, larger.with_changes(
        preference=None), 2 * 512).peak_bytes  # (no backward's working set kept either)


def test_no_remedy_offers_a_reference_to_a_run_that_has_none():
    from sft_play.planner import Target
    from sft_play.planner.choose import remedies
    from sft_play.units import GIB

    target = Target(1, 24 * GIB, "1 x 24 GiB")
    offered = {objective: [r.name for r in remedies.REMEDIES if r.applies(config, target)] for objective, config in (
        ("dpo", dpo_config("finetune.method=full")),
        ("orpo", dpo_config("finetune.objective=orpo", "finetune.method=full")),
        ("simpo", dpo_config("finetune.objective=simpo")))}
    assert "precomputed reference" in offered["dpo"]
    assert "precomputed reference" not in offered["orpo"] + offered["simpo"]


@pytest.mark.parametrize("objective", ["orpo", "simpo"])
def test_the_reference_free_losses_are_trls_own_from_the_full_logits(objective):
    """ORPO's and SimPO's loss here (TRL's fused head, average log-prob per answer) against TRL's
    ORPOTrainer / CPOTrainer computation from the full b x s x V logits of the same model and pairs:
    its get_batch_logps, its cross-entropy NLL of the chosen answers, its loss function."""
    import collections
    import warnings

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from trl.trainer.dpo_trainer import DataCollatorForPreference
    from trl.trainer.utils import add_fused_lm_head

    from sft_play.data import preference
    from sft_play import patches
    from sft_play.model import load_tokenizer
    from sft_play.training.preference import reference_free_loss

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.experimental.cpo import CPOTrainer
        from trl.experimental.orpo import ORPOTrainer

    config = dpo_config(f"finetune.objective={objective}", "data.max_seq_length=64",
                        *(["preference.beta=2", "preference.simpo_gamma=0.8", "preference.sft_weight=0.3",
                           "preference.label_smoothing=0.1"] if objective == "simpo" else ["preference.beta=0.3"]))
    tokenizer = load_tokenizer(config_module.load(None, ["model.name_or_path=configs/tiny_model"], check_paths=False))
    pairs = preference.pairs_of(str(REPO / "data" / "tiny_pref" / "validation.jsonl"), config.data, config.preference,
                                tokenizer)[:6]
    batch = DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id, max_length=64)(
        [{c: p[c] for c in preference.PAIR_COLUMNS} for p in pairs])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "configs" / "tiny_model"))
    pref = config.preference
    accelerator = types.SimpleNamespace(gather_for_metrics=lambda t: t, device=torch.device("cpu"))
    trainer = types.SimpleNamespace(
        model=model, accelerator=accelerator, beta=pref.beta, label_smoothing=pref.label_smoothing,
        loss_type="simpo", simpo_gamma=pref.simpo_gamma, alpha=0.0, cpo_alpha=pref.sft_weight,
        aux_loss_enabled=False, _metrics=collections.defaultdict(lambda: collections.defaultdict(list)),
        _total_train_tokens=0, _tp_size=1)
    patches.labelled_positions_on_cpu()
    add_fused_lm_head(model)
    ours = reference_free_loss(trainer, objective, model, dict(batch), False)

    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    half = len(pairs)
    average = ORPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
    nll = torch.nn.functional.cross_entropy(logits[:half, :-1].reshape(-1, logits.shape[-1]), labels[:half, 1:].reshape(-1))
    if objective == "orpo":
        losses = ORPOTrainer.odds_ratio_loss(trainer, average[:half], average[half:])[0]
        theirs = nll - losses.mean()
    else:
        losses = CPOTrainer.cpo_loss(trainer, average[:half], average[half:])[0]
        theirs = losses.mean() + pref.sft_weight * nll
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6), (float(ours), float(theirs))
    logged = trainer._metrics["train"]
    assert logged["rewards/accuracies"] and logged["nll_loss"][0] == pytest.approx(float(nll.detach()), rel=1e-5)


# ------------------------------------------------------------------------------------------------
# Real runs


def _dpo_run(tmp_path: Path, name: str, *overrides: str):
    result = run_script("train_distributed.py", "--config", "configs/run_tiny_dpo.yaml",
                        "model.name_or_path=configs/tiny_model", f"train.output_dir={tmp_path}",
                        f"train.run_name={name}", "train.max_steps=6", "train.logging_steps=1", "train.eval_steps=6",
                        "train.mixed_precision=no", "data.num_proc=1", "preference.sft_weight=0", *overrides)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return tmp_path / name, result


def _first_pairs(path: Path, count: int) -> str:
    """The default's first `count` training pairs, in a file of their own."""
    path.write_text("".join((REPO / "data" / "tiny_pref" / "train.jsonl").read_text().splitlines(True)[:count]))
    return str(path)


def _scalars(run_dir: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found: dict[str, list[float]] = {}
    for events in (run_dir / "tensorboard").rglob("events.out.tfevents*"):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            found.setdefault(tag, []).extend(e.value for e in accumulator.Scalars(tag))
    return found


@pytest.fixture(scope="module")
def dpo_default_run(tmp_path_factory):
    """The DPO default's six steps (full fine-tuning, the reference a copy), which make eval scores too."""
    return _dpo_run(tmp_path_factory.mktemp("dpo"), "full-auto", "finetune.method=full", "preference.reference=auto",
                    "train.learning_rate=3e-3")


@pytest.mark.parametrize("method, reference", [("full", "auto"), ("lora", "auto"), ("full", "precomputed")])
def test_dpo_trains_and_logs_rewards(tmp_path, request, method, reference):
    """Six steps on the upper-case pairs from the tiny model's initial weights: the loss starts at
    log 2 (the policy is its reference), falls, and the rewards reach TensorBoard; the reference is
    what was asked for (a copy, the adapters off, a pass before training)."""
    if (method, reference) == ("full", "auto"):
        run_dir, result = request.getfixturevalue("dpo_default_run")
    else:
        # (a pass before training scores every pair: 400 of them, not the default's 4,000)
        subset = [f"data.path={_first_pairs(tmp_path / 'pairs.jsonl', 400)}"] if reference == "precomputed" else []
        run_dir, result = _dpo_run(tmp_path, f"{method}-{reference}", f"finetune.method={method}",
                                   f"preference.reference={reference}", "train.learning_rate=3e-3", *subset)
    scalars = _scalars(run_dir)
    losses = scalars["train/loss"]
    assert abs(losses[0] - 0.6931) < 1e-3 and losses[-1] < losses[0] - 0.05, losses
    for tag in ("train/rewards/chosen", "train/rewards/margins", "train/rewards/accuracies", "eval/rewards/accuracies"):
        assert tag in scalars, sorted(scalars)
    assert scalars["train/rewards/margins"][-1] > 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["global_step"] == 6
    run = json.loads((run_dir / "run.json").read_text())
    assert run["preference"]["reference"] == {"auto": "copy" if method == "full" else "adapters_off"}.get(
        reference, reference)
    if method == "lora":
        saved = json.loads((run_dir / "model" / "adapter_config.json").read_text())
        assert saved["r"] == 16 and not (run_dir / "model" / "ref").exists()  # the run's own adapter only


@pytest.mark.parametrize("objective, method", [("orpo", "full"), ("simpo", "lora")])
def test_orpo_and_simpo_train_without_a_reference(tmp_path, objective, method):
    """Six steps of each reference-free objective through the entry script: the loss falls, the
    chosen answers' reward (beta x their average log-prob) pulls ahead of the rejected ones', and
    the run keeps no reference."""
    run_dir, _ = _dpo_run(tmp_path, objective, f"finetune.objective={objective}", f"finetune.method={method}",
                          "train.learning_rate=3e-3", *(["preference.beta=2"] if objective == "simpo" else []))
    scalars = _scalars(run_dir)
    losses = scalars["train/loss"]
    assert losses[-1] < losses[0] - 0.1, losses
    assert scalars["train/rewards/margins"][-1] > scalars["train/rewards/margins"][0]
    assert scalars["eval/rewards/accuracies"][-1] > 0.9 and "train/nll_loss" in scalars
    if objective == "orpo":
        assert "train/log_odds_ratio" in scalars
    run = json.loads((run_dir / "run.json").read_text())
    assert run["preference"] == {"objective": objective, "reference": "none", "precompute_batch_size": None,
                                 "kl": False}


@pytest.mark.parametrize("objective", ["dpo", "kto"])
def test_a_streamed_preference_run_trains_from_statistics_of_its_sample(tmp_path, objective):
    """data.streaming: the pairs (KTO: the answers, shuffled in a buffer) read and tokenised as
    training consumes them; the plan reads the statistics of the first data.sample_rows records,
    and a bad row past them is skipped and said when the pass ends, not a stopped run."""
    rows = (REPO / "data" / "tiny_pref" / "train.jsonl").read_text().splitlines(True)[:40]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(rows[:20]) + json.dumps({"prompt": U("q"), "chosen": A("same"), "rejected": A("same")})
                    + "\n" + "".join(rows[20:]))
    run_dir, result = _dpo_run(tmp_path, objective, f"finetune.objective={objective}", "finetune.method=lora",
                               f"data.path={path}", "data.streaming=true", "data.sample_rows=10",
                               "train.learning_rate=3e-3", "train.global_batch_size=8", "train.max_steps=12")
    said = result.stdout + result.stderr
    assert "the planner reads the statistics of its first 10 records" in said
    assert f"data (streamed): skipped 1 rows: rejected: chosen equal to rejected x1 ({path}:21)" in said, said[-3000:]
    losses = _scalars(run_dir)["train/loss"]
    assert len(losses) == 12 and losses[-1] < losses[0], losses


def test_make_eval_scores_held_out_pairs(tmp_path, dpo_default_run):
    run_dir, _ = dpo_default_run  # (evaluate.py writes eval*.json beside what the run wrote)
    result = run_script("evaluate.py", "--run", str(run_dir), "--count", "2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    written = json.loads((run_dir / "eval.json").read_text())
    assert written["pairs"] == 90 and 0.0 <= written["reward_accuracy"] <= 1.0
    assert written["margin_mean"] > 0  # six steps already prefer upper case, against the start
    assert len(written["generations"]) == 2 and {"matches_chosen", "matches_rejected"} <= set(written["generations"][0])
    assert "reward accuracy" in result.stdout and "chosen answers:" in result.stdout
    # other pairs (make eval DATA=...): those pairs alone, the run's training pairs neither read nor prepared
    other = tmp_path / "other.jsonl"
    other.write_text("".join((REPO / "data" / "tiny_pref" / "validation.jsonl").read_text().splitlines(True)[:4]))
    cache = tmp_path / "fresh-cache"
    result = run_script("evaluate.py", "--run", str(run_dir), "--count", "1", "--data", str(other),
                        env={"SFT_PLAY_CACHE": str(cache)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    written = json.loads((run_dir / "eval-other.json").read_text())
    assert written["pairs"] == 4 and written["data"] == str(other) and len(written["generations"]) == 1
    assert written["generations"][0]["chosen"] in other.read_text()
    assert not list((cache / "data").glob("*")), "nothing prepared"


# ------------------------------------------------------------------------------------------------
# Run life: an out-of-memory backoff, a stop and a resume


def _dpo_factory(tmp_path: Path, callbacks: list, *overrides: str):
    """The trainer factory the entry script builds for the DPO default (the tiny model's initial
    weights as the SFT model), for tests that drive training in this process."""
    from sft_play import data, model, training
    from sft_play.run import resolve

    config = config_module.load(REPO / "configs" / "run_tiny_dpo.yaml", [
        "model.name_or_path=configs/tiny_model", "train.max_steps=4", "train.logging_steps=1", "train.eval_steps=0",
        f"train.output_dir={tmp_path}", "train.tensorboard=false", "train.global_batch_size=8",
        "train.mixed_precision=no", "data.num_proc=1", "train.learning_rate=3e-3", *overrides], check_paths=False)
    tokenizer = model.load_tokenizer(config)
    bundle = data.build_for_run(config, tokenizer)
    run = resolve(config, on_cuda=False, bf16_supported=False, world_size=1, data_stats=bundle.stats)
    base = model.load_model(config, run, device="cpu")
    return training.trainer_factory(config, run, tmp_path, base, tokenizer, bundle.train, None, None, callbacks,
                                    reference=model.load_reference(config, run, device="cpu"))


@pytest.mark.parametrize("overrides", [("finetune.method=lora",), ("preference.reference=precomputed",),
                                       ("finetune.objective=orpo", "preference.sft_weight=0")],
                         ids=["lora", "precomputed", "orpo"])
def test_an_out_of_memory_backoff_keeps_the_pairs_and_the_reference(tmp_path, overrides):
    """Halving the micro-batch of pairs keeps the global batch of pairs; the trainer rebuilt from
    the checkpoint keeps the run's reference: for LoRA the base with the adapter off (not the copy
    of the trained adapter TRL makes of an adapter it is given), for precomputed log-probs those
    scored before training (not the trained model's). Its losses are an uninterrupted run's."""
    from transformers import TrainerCallback

    from sft_play import training
    from sft_play.run import BatchSplit

    class InjectOutOfMemory(TrainerCallback):
        raised = 0

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 2 and args.per_device_train_batch_size > 4:
                InjectOutOfMemory.raised += 1
                raise __import__("torch").OutOfMemoryError("CUDA out of memory. (injected)")

    if "preference.reference=precomputed" in overrides:  # (scored before training: 400 pairs, not 4,000)
        overrides = (*overrides, f"data.path={_first_pairs(tmp_path / 'pairs.jsonl', 400)}")
    trainer, trained = training.train_with_backoff(_dpo_factory(tmp_path / "backoff", [InjectOutOfMemory()], *overrides),
                                                   BatchSplit(8, 1, 1, 8))
    assert InjectOutOfMemory.raised == 1 and trained == BatchSplit(4, 2, 1, 8)
    assert "ref" not in getattr(trainer.model, "peft_config", {})
    if "preference.reference=precomputed" in overrides:  # scored before training, no model kept for it
        assert trainer.ref_model is None and "ref_chosen_logps" in trainer.train_dataset.column_names
    if "finetune.objective=orpo" in overrides:  # full fine-tuning, and no reference TRL would have loaded
        assert trainer.ref_model is None and "ref_chosen_logps" not in trainer.train_dataset.column_names
    reference, _ = training.train_with_backoff(_dpo_factory(tmp_path / "reference", [], *overrides),
                                               BatchSplit(8, 1, 1, 8))
    ours = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    theirs = [e["loss"] for e in reference.state.log_history if "loss" in e]
    assert ours[-2:] == pytest.approx(theirs[-2:], rel=1e-3)
    margins = [e["rewards/margins"] for e in trainer.state.log_history if "rewards/margins" in e]
    assert margins[-1] == pytest.approx([e["rewards/margins"] for e in reference.state.log_history
                                         if "rewards/margins" in e][-1], rel=1e-3)


@pytest.mark.parametrize("objective", ["dpo", "kto"])
def test_a_stopped_run_resumes_to_the_uninterrupted_runs_weights(tmp_path, objective):
    """A run stopped by SIGTERM after step 2 and resumed ends with the weights of the run never
    stopped: DPO's pairs, and KTO's answers, which its trainer reads in order (the resumed run
    skips exactly the answers seen, and each keeps its KL row)."""
    import os
    import signal
    import subprocess
    import sys
    import threading

    common = ["--config", "configs/run_tiny_dpo.yaml", "model.name_or_path=configs/tiny_model", "train.max_steps=4",
              "train.logging_steps=1", "train.eval_steps=0", f"train.output_dir={tmp_path}",
              "train.mixed_precision=no", "data.num_proc=1", "train.global_batch_size=8",
              f"finetune.objective={objective}", *(["preference.sft_weight=0"] if objective == "kto" else [])]
    env = {**os.environ, **FORKED, "OMP_NUM_THREADS": "1"}

    def start(*args, faults=""):
        return subprocess.Popen([sys.executable, "scripts/train_distributed.py", *common, *args], cwd=REPO, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env={**env, "SFT_PLAY_FAULTS": faults} if faults else env)

    reference = start("train.run_name=reference")
    stopped = start("train.run_name=stopped", faults="hold_step=2")
    seen = []

    def read():
        for line in stopped.stdout:
            seen.append(line)
            if "fault injection (hold_step)" in line:
                stopped.send_signal(signal.SIGTERM)

    reader = threading.Thread(target=read)
    reader.start()
    stopped.wait(timeout=300)
    reader.join()
    assert stopped.returncode == 75, "".join(seen)[-3000:]
    resumed = start("train.run_name=stopped", "train.resume_from=auto")
    output = resumed.communicate(timeout=300)[0]
    assert resumed.returncode == 0 and "from checkpoint-2" in output, output[-3000:]
    assert reference.wait(timeout=300) == 0, reference.stdout.read()[-3000:]
    ours = json.loads((tmp_path / "stopped" / "summary.json").read_text())
    theirs = json.loads((tmp_path / "reference" / "summary.json").read_text())
    assert ours["segments"] == 2 and ours["global_step"] == theirs["global_step"] == 4
    assert ours["weights_fingerprints"] == theirs["weights_fingerprints"]
