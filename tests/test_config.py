"""The run config: every shipped config validates; bad input gives the promised messages."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sft_play import config as config_module
from sft_play.config import ConfigError

REPO = Path(__file__).resolve().parents[1]
RUN_CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("path", RUN_CONFIGS, ids=lambda p: p.name)
def test_every_shipped_run_config_validates(path):
    config = config_module.load(path)
    assert config.model.name_or_path
    header = path.read_text().splitlines()[0]
    assert header.startswith("#"), f"{path.name} must start with a comment saying what it is for"
    assert "make " in path.read_text().split("\n\n")[0], f"{path.name}'s header must give the make command"


def test_required_keys_exist():
    keys = set(config_module.valid_keys())
    for key in [
        "model.name_or_path", "finetune.method", "lora.r", "lora.alpha", "lora.dropout", "lora.target_modules",
        "data.max_seq_length", "train.global_batch_size", "train.micro_batch_size",
        "train.gradient_accumulation_steps", "train.gradient_checkpointing", "train.learning_rate",
        "train.max_steps", "train.num_epochs", "train.output_dir", "train.mixed_precision", "distributed.strategy",
    ]:
        assert key in keys, key


def test_defaults_match_the_documented_meanings():
    config = config_module.load(None, check_paths=False)
    assert config.lora.target_modules == "all-linear"
    assert config.train.micro_batch_size == "auto"
    assert config.train.gradient_accumulation_steps == "auto"
    assert config.model.trust_remote_code is False


def test_unknown_key_names_the_nearest_valid_key(tmp_path):
    path = write(tmp_path, "train:\n  learning_rat: 0.001\n")
    with pytest.raises(ConfigError, match=r"unknown key 'train.learning_rat'; did you mean 'train.learning_rate'\?"):
        config_module.load(path)


def test_key_in_the_wrong_section_points_to_the_right_one(tmp_path):
    path = write(tmp_path, "train:\n  method: full\n")
    with pytest.raises(ConfigError, match=r"did you mean 'finetune.method'"):
        config_module.load(path)


def test_unknown_section_names_the_nearest(tmp_path):
    path = write(tmp_path, "trian:\n  max_steps: 3\n")
    with pytest.raises(ConfigError, match=r"unknown section 'trian'; did you mean 'train'"):
        config_module.load(path)


def test_bad_choice_names_the_allowed_values(tmp_path):
    path = write(tmp_path, "finetune:\n  method: lorra\n")
    with pytest.raises(ConfigError, match=r"finetune.method: got 'lorra'; expected one of 'full', 'lora', 'qlora'"):
        config_module.load(path)


def test_bad_type_says_what_is_expected(tmp_path):
    path = write(tmp_path, "train:\n  micro_batch_size: big\n")
    with pytest.raises(ConfigError, match=r"train.micro_batch_size: got 'big'; expected an integer or 'auto'"):
        config_module.load(path)


def test_missing_files_name_the_path(tmp_path):
    path = write(tmp_path, "model:\n  name_or_path: ./no/such/model\ndata:\n  path: nowhere/train.jsonl\n")
    with pytest.raises(ConfigError) as caught:
        config_module.load(path)
    text = str(caught.value)
    assert "model.name_or_path: folder './no/such/model' does not exist" in text
    assert "data.path: file 'nowhere/train.jsonl' does not exist" in text


def test_every_problem_is_reported_at_once(tmp_path):
    path = write(
        tmp_path,
        "finetune:\n  method: lorra\ntrain:\n  learning_rat: 1\n  global_batch_size: 0\n"
        "data:\n  path: nowhere.jsonl\n",
    )
    with pytest.raises(ConfigError) as caught:
        config_module.load(path, ["lora.rr=3"])
    problems = caught.value.problems
    assert len(problems) == 5, problems
    assert any("lora.rr" in p and "'lora.r'" in p for p in problems)
    assert any("train.global_batch_size: got 0; must be greater than 0" in p for p in problems)
    assert any("data.path" in p for p in problems)


def test_overrides_use_dotted_names_and_yaml_values():
    config = config_module.load(
        None,
        ["train.learning_rate=1e-4", "train.micro_batch_size=4", "train.gradient_checkpointing=true",
         "lora.target_modules=[q_proj, v_proj]", "data.path=[a.jsonl, b.jsonl]"],
        check_paths=False,
    )
    assert config.train.learning_rate == pytest.approx(1e-4)
    assert config.train.micro_batch_size == 4
    assert config.train.gradient_checkpointing is True
    assert config.lora.target_modules == ["q_proj", "v_proj"]
    assert config.data.path == ["a.jsonl", "b.jsonl"]


def test_override_without_equals_is_an_error():
    with pytest.raises(ConfigError, match="not of the form section.key=value"):
        config_module.load(None, ["train.max_steps"], check_paths=False)


def test_yaml_is_read_safely(tmp_path):
    path = write(tmp_path, "train: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        config_module.load(path)


def test_a_key_given_twice_is_refused(tmp_path):
    """YAML keeps the second of two keys silently: a config with two learning rates trained with the second."""
    path = write(tmp_path, "train:\n  learning_rate: 1.0e-3\n  max_steps: 5\n  learning_rate: 2.0e-3\n")
    with pytest.raises(ConfigError, match=r"'learning_rate' is given twice in one section \(lines 2 and 4\)"):
        config_module.load(path)
    assert config_module.load(write(tmp_path, "train:\n  learning_rate: 1.0e-3\nlora:\n  r: 8\n"),
                              check_paths=False).train.learning_rate == 1e-3  # the same key in two sections is fine
    # YAML's merge keys still work, a key overriding a merged one included
    merged = write(tmp_path, "base: &base\n  learning_rate: 1.0e-3\n  max_steps: 5\n"
                             "train:\n  <<: *base\n  learning_rate: 2.0e-3\n")
    import yaml

    from sft_play.config.loading import _UniqueKeyLoader

    assert yaml.load(merged.read_text(), Loader=_UniqueKeyLoader)["train"] == {"learning_rate": 2e-3, "max_steps": 5}
    with pytest.raises(ConfigError, match="not valid YAML"):  # an unhashable key: one clear error, no traceback
        config_module.load(write(tmp_path, "train:\n  ? [a, b]\n  : 1\n"), check_paths=False)


def test_resolved_config_round_trips(tmp_path):
    config = config_module.load(REPO / "configs" / "run_tiny.yaml", ["train.max_steps=7"])
    saved = tmp_path / "config.yaml"
    saved.write_text(config.to_yaml())
    assert config_module.load(saved) == config


def test_inconsistent_settings_are_reported():
    with pytest.raises(ConfigError, match="quant_storage"):
        config_module.load(None, ["finetune.method=qlora", "distributed.strategy=deepspeed_zero3"], check_paths=False)
    with pytest.raises(ConfigError, match="larger than train.global_batch_size"):
        config_module.load(None, ["train.micro_batch_size=32", "train.global_batch_size=8"], check_paths=False)


def test_config_reference_doc_is_current():
    assert (REPO / "docs" / "CONFIG.md").read_text() == config_module.reference_markdown(), (
        "docs/CONFIG.md is out of date: run python scripts/config_reference.py"
    )


def test_text_fields_keep_yaml_like_words_as_text():
    config = config_module.load(None, ["train.run_name=off", "model.revision=1234", "data.split=no"], check_paths=False)
    assert config.train.run_name == "off" and config.model.revision == "1234" and config.data.split == "no"
    with pytest.raises(ConfigError, match="train.gradient_checkpointing: got 'sometimes'; expected true or false"):
        config_module.load(None, ["train.gradient_checkpointing=sometimes"], check_paths=False)


def test_settings_the_run_does_not_use_are_said_once(caplog):
    import logging

    from sft_play.config.loading import unused_overrides

    full = config_module.load(None, ["finetune.method=full", "lora.use_dora=true", "lora.r=8"], check_paths=False)
    assert unused_overrides(full, ["lora.use_dora=true", "lora.r=8"]) == [
        "lora.r, lora.use_dora have no effect: finetune.method is full (set finetune.method=lora to train adapters)"]
    lora = config_module.load(None, ["finetune.method=lora", "quantization.quant_type=fp4"], check_paths=False)
    assert unused_overrides(lora, ["quantization.quant_type=fp4", "lora.r=8"]) == [
        "quantization.quant_type has no effect: finetune.method is lora (set finetune.method=qlora to train on a 4-bit base)"]
    qlora = config_module.load(None, ["finetune.method=qlora"], check_paths=False)
    assert unused_overrides(qlora, ["quantization.quant_type=fp4", "lora.r=8"]) == []
    # evaluations without validation data, set in the file or an override: never run, unsaid
    blind = config_module.load(None, ["train.eval_steps=5", "data.validation_path=null"], check_paths=False)
    assert unused_overrides(blind, []) == ["train.eval_steps=5 has no effect: there is no validation data (set "
                                           "data.validation_path, or data.validation_fraction to hold some out)"]
    with caplog.at_level(logging.WARNING, logger="sft_play"):
        for _ in range(2):
            config_module.load(None, ["finetune.method=full", "lora.alpha=7"], check_paths=False)
    assert caplog.text.count("lora.alpha has no effect: finetune.method is full") == 1


@pytest.mark.parametrize("typed, said", [
    ("train.warmup_steps=10", None),  # ours now
    ("train.bf16=true", "did you mean 'train.mixed_precision'"),
    ("data.cutoff_len=512", "did you mean 'data.max_seq_length'"),
    ("cutoff_len=512", "unknown key 'cutoff_len'; did you mean 'data.max_seq_length'"),  # where their configs put it
    ("train.train_on_inputs=false", "did you mean 'data.train_on'"),
    ("train.push_to_hub=true", "a run does not upload; when it ends, `hf upload <repo id> RUN/model`"),
    ("train.report_to=[wandb]", None),  # ours now (the package check aside)
    ("lora.lora_target=[q_proj]", "did you mean 'lora.target_modules'"),
    ("train=5", "'train' is a section, not a key: set one of its keys, e.g. train."),
])
def test_keys_other_tools_use_point_to_ours_not_to_a_near_spelling(typed, said):
    """train.warmup_steps was offered as train.max_steps, train.report_to as train.warmup_ratio."""
    if said is None:
        try:
            config_module.load(None, [typed])
        except ConfigError as exc:
            assert "unknown key" not in str(exc)
        return
    with pytest.raises(ConfigError, match=re.escape(said)):
        config_module.load(None, [typed])


def test_a_column_mapping_of_a_field_we_do_not_read_is_refused_with_the_nearest():
    with pytest.raises(ConfigError, match=r"data.columns.promt: no such field; did you mean data.columns.prompt\? The "
                                          r"fields: messages, conversations, .*history"):
        config_module.load(None, ["data.columns.promt=question", "data.columns.completion=answer"])


def test_a_list_of_strings_is_said_in_english():
    with pytest.raises(ConfigError, match="expected 'all-linear' or a list of strings"):
        config_module.load(None, ["lora.target_modules=5"])


def test_warmup_steps_and_trackers_reach_the_trainer(tmp_path):
    from sft_play import training
    from sft_play.run import BatchSplit, resolve

    config = config_module.load(None, ["train.warmup_steps=7", "train.max_steps=20", f"train.output_dir={tmp_path}"])
    run = resolve(config, on_cuda=False, bf16_supported=False, world_size=1).with_changes(batch=BatchSplit(8, 1, 1, 8))
    arguments = training.trainer_arguments(config, run, tmp_path, False)
    assert arguments.get_warmup_steps(20) == 7 and arguments.report_to == ["tensorboard"]
    config = config_module.load(None, ["train.tensorboard=false", f"train.output_dir={tmp_path}"])
    assert training.trainer_arguments(config, run, tmp_path, False).get_warmup_steps(100) == 3  # warmup_ratio 0.03
    from sft_play.config import environment

    real = environment._installed
    try:  # wandb as absent, whether this machine has it or not
        environment._installed = lambda package: package != "wandb" and real(package)
        with pytest.raises(ConfigError, match=r"train.report_to: wandb needs its package \(pip install wandb"):
            config_module.load(None, ["train.report_to=[wandb]"])
    finally:
        environment._installed = real


def test_a_package_a_process_hides_from_itself_is_still_installed(monkeypatch):
    """make plan hides bitsandbytes (it runs no kernel), and then refused QLoRA: 'needs bitsandbytes'."""
    import sys

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # what lean_imports.without_bitsandbytes does
    assert config_module.load(None, ["finetune.method=qlora"]).finetune.method == "qlora"


def test_an_adapter_or_run_folder_as_the_model_says_what_it_is_and_how_to_start_from_it(tmp_path):
    """'has no config.json' was all a user starting from their last adapter learned."""
    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    (run / "run.json").write_text("{}")
    (run / "model" / "adapter_config.json").write_text('{"base_model_name_or_path": "org/base"}')
    with pytest.raises(ConfigError, match=re.escape(f"'{run / 'model'}' has no config.json: it is a LoRA adapter of "
                                                    f"'org/base'. To fine-tune on from it, merge it into its base "
                                                    f"(make merge RUN={run}) and set model.name_or_path={run / 'merged'}")):
        config_module.load(None, [f"model.name_or_path={run / 'model'}"])
    with pytest.raises(ConfigError, match=re.escape(f"it is a run folder; its model is in {run / 'model'} (an adapter")):
        config_module.load(None, [f"model.name_or_path={run}"])


def test_early_stopping_stops_after_patience_evaluations_without_a_better_loss():
    from types import SimpleNamespace

    from sft_play.callbacks import EarlyStopping

    stopper, control = EarlyStopping(2), SimpleNamespace(should_training_stop=False)
    for step, loss in ((2, 5.0), (4, 4.0), (6, 4.5), (8, 3.9), (10, 4.0), (12, 4.1)):
        stopper.on_evaluate(None, SimpleNamespace(global_step=step), control, metrics={"eval_loss": loss})
        assert control.should_training_stop == (step == 12), step  # 6 then 8 improved: the count starts over
    assert (stopper.stopped_at, stopper.best, stopper.best_step) == (12, 3.9, 8)
    for without in (["train.eval_steps=0"], ["train.eval_steps=10", "data.validation_path=null",
                                              "data.validation_fraction=0"]):  # no evaluations, or nothing to evaluate
        with pytest.raises(ConfigError, match=r"train.early_stopping_patience=3 counts evaluations: set train.eval_steps"):
            config_module.load(None, ["train.early_stopping_patience=3", *without])
    tiny = Path(__file__).resolve().parents[1] / "configs" / "run_tiny.yaml"  # it has validation data
    assert config_module.load(tiny, ["train.early_stopping_patience=3", "train.eval_steps=10"]).train.eval_steps == 10


def test_a_folder_given_as_the_config_is_said_with_the_files_in_it(tmp_path):
    """make plan CONFIG=configs: a folder, said as one, with what it holds."""
    (tmp_path / "run.yaml").write_text("train:\n  max_steps: 3\n")
    with pytest.raises(ConfigError, match=r"is a folder: name a YAML file in it \(run.yaml\)"):
        config_module.load(tmp_path)
    with pytest.raises(ConfigError, match=r"does not exist"):
        config_module.load(tmp_path / "missing.yaml")
