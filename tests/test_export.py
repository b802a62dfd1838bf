"""Using a finished run: merge (LoRA and QLoRA), evaluate, generate and chat with adapters,
merged and full models."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sft_play import export
from sft_play.errors import UserError
from tests.conftest import FORKED, printed_answers, run_scripts_together

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tiny_lora_run, tiny_full_run, tiny_qlora_run):
    return {"lora": tiny_lora_run[0], "qlora": tiny_qlora_run[0], "full": tiny_full_run[0]}


def logits(model, tokenizer, text="Reverse the letters: a b c"):
    ids = tokenizer(text, return_tensors="pt").to(model.device)
    with torch.no_grad():
        return model(**ids).logits.float()


def test_merged_lora_matches_the_adapter_model(runs, tmp_path):
    merged_dir = export.merge(runs["lora"])
    assert merged_dir == runs["lora"] / "merged"
    assert (merged_dir / "model.safetensors").is_file() and (merged_dir / "tokenizer.json").is_file()
    assert not list(merged_dir.glob("*.bin"))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(merged_dir)
    adapter_model, _, _ = export.load_trained(runs["lora"], device="cpu")
    torch.testing.assert_close(logits(merged, tokenizer), logits(adapter_model, tokenizer), rtol=1e-4, atol=1e-4)
    assert json.loads((merged_dir / "sft_play_merge.json").read_text())["method"] == "lora"
    # the model cards: what trained and how to load it, not peft's "More Information Needed" template
    card, merged_card = (runs["lora"] / "model" / "README.md").read_text(), (merged_dir / "README.md").read_text()
    assert "library_name: peft" in card and "An adapter: LoRA r 32, alpha 64" in card and "More Information" not in card
    assert "| training loss |" in card and "24 optimizer steps" in card
    # its "Use" snippet loads the trained model, run as written from another folder (the base is a
    # config-only folder, relative to the workspace: AutoPeftModel looked for weights in neither)
    snippet = card.split("## Use", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    assert "initialised from its config.json, kept in SFT-Play's cache" in snippet
    here = os.getcwd()
    os.chdir(tmp_path)
    try:
        namespace: dict = {}
        exec(snippet, namespace)
    finally:
        os.chdir(here)
    torch.testing.assert_close(logits(namespace["model"].eval(), namespace["tokenizer"]),
                               logits(adapter_model, tokenizer), rtol=1e-4, atol=1e-4)
    assert "name_or_path: configs/tiny_model" in card  # the run's config.yaml, whole
    assert "library_name: transformers" in merged_card and "merged into its base" in merged_card
    assert f"FOLDER = '{merged_dir}'" in merged_card
    umask = os.umask(0)
    os.umask(umask)
    assert (merged_dir / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask  # shareable, not 0600


def test_merged_qlora_is_the_dequantised_base_plus_adapter(runs):
    """Each merged linear is the 4-bit base the adapter trained against, de-quantised by
    bitsandbytes itself, plus scale x B @ A from the saved adapter: a reference built without the
    merge's code (transformers' own 4-bit load, bitsandbytes' de-quantisation, the adapter file)."""
    merged_dir = export.merge(runs["qlora"])
    import bitsandbytes as bnb
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from sft_play import config as config_module
    from sft_play.model import weights_location

    config = config_module.load(runs["qlora"] / "config.yaml")
    quant = config.quantization
    four_bit = AutoModelForCausalLM.from_pretrained(weights_location(config), quantization_config=BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=quant.quant_type, bnb_4bit_use_double_quant=quant.double_quant,
        bnb_4bit_compute_dtype=torch.float32), dtype=torch.float32, device_map={"": "cpu"})
    adapter = load_file(runs["qlora"] / "model" / "adapter_model.safetensors")
    adapter_config = json.loads((runs["qlora"] / "model" / "adapter_config.json").read_text())
    scale = adapter_config["lora_alpha"] / adapter_config["r"]
    merged = dict(AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).named_parameters())
    checked = 0
    for name, module in four_bit.named_modules():
        if not isinstance(module, bnb.nn.Linear4bit):
            continue
        base = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state).float()
        lora_a = adapter[f"base_model.model.{name}.lora_A.weight"].float()
        lora_b = adapter[f"base_model.model.{name}.lora_B.weight"].float()
        torch.testing.assert_close(merged[f"{name}.weight"], base + scale * lora_b @ lora_a, rtol=1e-5, atol=1e-5)
        checked += 1
    assert checked == 4 * 7, "every adapted linear of the 4 layers (q, k, v, o, gate, up, down)"


def test_merging_a_full_model_says_there_is_nothing_to_merge(runs):
    with pytest.raises(UserError, match="full model already"):
        export.merge(runs["full"])


def test_a_run_whose_base_model_cannot_be_found_says_so_in_one_error(runs, tmp_path, monkeypatch):
    """make generate/chat/eval/merge on a run whose base is gone (a relative folder read from
    elsewhere, a hub model not cached offline): one clear error, not the hub client's retries and
    a traceback."""
    import shutil

    import huggingface_hub.constants
    import yaml

    from sft_play import hub

    copy = tmp_path / "run"
    shutil.copytree(runs["lora"], copy, ignore=shutil.ignore_patterns("checkpoints", "merged"))
    saved = yaml.safe_load((copy / "config.yaml").read_text())
    saved["model"]["name_or_path"] = "no-such-org/no-such-model"
    (copy / "config.yaml").write_text(yaml.safe_dump(saved))
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):  # restored after the test, as is what the client reads
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "reachable", lambda: False)  # an offline node: the run goes offline at once
    with pytest.raises(UserError, match="cannot load the model 'no-such-org/no-such-model'"):
        export.load_trained(copy, device="cpu")
    assert huggingface_hub.constants.HF_HUB_OFFLINE  # read offline, without the hub client's minute of retries


PROMPT = "Reverse the letters: a b c"


@pytest.fixture(scope="module")
def commands(runs):
    """make eval on the LoRA run, and make generate on its merged model and on the full run,
    started together (conftest.run_scripts_together)."""
    merged = runs["lora"] / "merged"
    if not merged.exists():
        export.merge(runs["lora"])
    results = run_scripts_together(
        ("evaluate.py", "--run", str(runs["lora"]), "--count", "2", "--max-new-tokens", "12"),
        *[("generate.py", "--run", str(folder), "--prompt", PROMPT, "--max-new-tokens", "8")
          for folder in (merged, runs["full"])])
    return dict(zip(["eval", "merged", "full"], results))


def test_eval_writes_loss_perplexity_and_generations(runs, commands):
    result = commands["eval"]
    assert result.returncode == 0, result.stderr[-3000:]
    saved = json.loads((runs["lora"] / "eval.json").read_text())
    assert 0 < saved["loss"] < 10 and saved["perplexity"] == pytest.approx(2.718281828 ** saved["loss"], rel=1e-6)
    assert saved["loss_tokens"] > 1000 and len(saved["generations"]) == 2
    assert "validation loss" in result.stdout
    # the examples are what was held out, not the packed rows they fill ("(4 rows)" read as examples lost)
    validation = len((REPO / "data" / "tiny" / "validation.jsonl").read_text().splitlines())
    assert saved["validation_examples"] == validation > saved["validation_rows"]
    assert f"({validation} examples, packed into {saved['validation_rows']} rows)" in result.stdout
    # the chunked head gives the loss full logits would
    from sft_play import data
    from sft_play.data.collate import make_collator
    from sft_play.model import load_tokenizer

    model, tokenizer, config = export.load_trained(runs["lora"], device="cpu")
    rows = data.build(config.data, load_tokenizer(config), seed=config.train.seed).validation
    batch = make_collator(tokenizer.pad_token_id, "packed_rows")([rows[i] for i in range(len(rows))])
    labels = batch.pop("labels")
    with torch.no_grad():
        full = model(**batch, use_cache=False).logits.float()
    reference = torch.nn.functional.cross_entropy(full[:, :-1].reshape(-1, full.size(-1)), labels[:, 1:].reshape(-1),
                                                  ignore_index=-100)
    assert saved["loss"] == pytest.approx(float(reference), rel=1e-4)


def test_eval_on_other_data_scores_it_as_the_run_read_its_own(runs, commands, tmp_path):
    """make eval on a held-out test set after training was refused (a finished run's settings)."""
    assert commands["eval"].returncode == 0, commands["eval"].stderr[-3000:]
    own = json.loads((runs["lora"] / "eval.json").read_text())
    test = tmp_path / "test.jsonl"  # the run's validation file under another name: the same score
    test.write_bytes((REPO / "data" / "tiny" / "validation.jsonl").read_bytes())
    result = export.evaluate(runs["lora"], 2, 8, data_path=str(test))
    assert result["loss"] == pytest.approx(own["loss"], rel=1e-6) and result["data"] == str(test)
    assert json.loads((runs["lora"] / "eval-test.json").read_text())["loss_tokens"] == own["loss_tokens"]
    assert json.loads((runs["lora"] / "eval.json").read_text()) == own  # the run's own evaluation is kept
    # a test set with a bad row: refused as the run would have, or scored without it where asked
    # (make eval DATA=... ARGS=data.on_invalid=skip: the one setting of the run's own a test set takes)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(test.read_text() + '{"messages": [{"role": "user"}]}\n')
    with pytest.raises(Exception, match="1 bad row"):
        export.evaluate(runs["lora"], 2, 8, data_path=str(bad))
    assert export.evaluate(runs["lora"], 2, 8, data_path=str(bad), on_invalid="skip")["loss"] == pytest.approx(
        own["loss"], rel=1e-6)
    from argparse import Namespace

    from sft_play import cli

    asked = Namespace(overrides=["data.on_invalid=skip"], config=None, run=str(runs["lora"]))
    assert cli.chosen_run(asked, also=("data.on_invalid",)) == runs["lora"]
    with pytest.raises(UserError, match="data.on_invalid=skip: a finished run is used with the settings"):
        cli.chosen_run(asked)  # (without DATA: the run's own data, read as it was)
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"messages": [{"role": "user", "content": "no answer"}]}) + "\n")
    with pytest.raises(Exception, match="no assistant turn|no usable example"):
        export.evaluate(runs["lora"], 2, 8, data_path=str(empty))


@pytest.mark.parametrize("which", ["merged", "full"])
def test_generate_works_for_merged_and_full_models(runs, commands, which):
    folder = runs["lora"] / "merged" if which == "merged" else runs["full"]
    prompt, result = PROMPT, commands[which]
    assert result.returncode == 0, result.stderr[-3000:]
    assert "before:" in result.stdout
    model, tokenizer, _ = export.load_trained(folder, device="cpu")
    expected = export.generate(model, tokenizer, [{"role": "user", "content": prompt}], 8)
    assert printed_answers(result.stdout) == [expected], "the script prints this model's greedy answer"


def test_chat_answers_each_line_and_keeps_the_history(runs):
    process = subprocess.run([sys.executable, "scripts/chat.py", "--run", str(runs["lora"]), "--max-new-tokens", "8"],
                             cwd=REPO, input="Reverse the letters: a b c\n/reset\nWhich letter comes after d?\n/exit\n",
                             capture_output=True, text=True, timeout=300, env={**os.environ, **FORKED})
    assert process.returncode == 0, process.stderr[-3000:]
    assert process.stdout.count("model> ") == 2
    model, tokenizer, _ = export.load_trained(runs["lora"], device="cpu")
    fresh = export.generate(model, tokenizer, [{"role": "user", "content": "Which letter comes after d?"}], 8)
    assert f"model> {fresh}" in process.stdout, "after /reset the model sees the new question alone"


def test_chat_sends_the_whole_conversation_and_reset_forgets_it(monkeypatch, capsys):
    """What chat.py hands the model each turn: every earlier turn (its own answers included), and
    after /reset only what follows (the system message stays)."""
    import importlib.util
    import io

    spec = importlib.util.spec_from_file_location("chat_script", REPO / "scripts" / "chat.py")
    chat = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(chat)
    seen: list[list[dict]] = []

    def answer(model, tokenizer, history, max_new_tokens):
        seen.append([dict(m) for m in history])
        return f"answer {len(seen)}"

    monkeypatch.setattr(export, "load_trained", lambda run: (object(), object(), None))
    monkeypatch.setattr(export, "generate", answer)
    monkeypatch.setattr("sft_play.cli.chosen_run", lambda args: "some-run")
    monkeypatch.setattr(sys, "argv", ["chat.py", "--system", "Be brief."])
    monkeypatch.setattr(sys, "stdin", io.StringIO("first\nsecond\n/reset\nthird\n/exit\n"))
    assert chat.main() == 0
    system = {"role": "system", "content": "Be brief."}
    assert seen == [
        [system, {"role": "user", "content": "first"}],
        [system, {"role": "user", "content": "first"}, {"role": "assistant", "content": "answer 1"},
         {"role": "user", "content": "second"}],
        [system, {"role": "user", "content": "third"}],
    ]
    out = capsys.readouterr().out
    assert "model> answer 1" in out and "model> answer 3" in out
    assert out.index("model> answer 2") < out.index("(conversation cleared)") < out.index("model> answer 3")


def test_a_run_trained_on_plain_prompts_is_prompted_as_it_was_trained(tmp_path, monkeypatch, capsys):
    """make generate PROMPT=... and make chat on a run trained on prompt/completion data (no chat
    template) send the text as it is: through the chat template, a user's "Double 4:" got '' where
    the plain prompt gets the trained answer."""
    import importlib.util
    import io

    plain, chat_run = tmp_path / "plain", tmp_path / "chat"
    for run, fmt in ((plain, "prompt_completion"), (chat_run, "messages")):
        (run / "model").mkdir(parents=True)
        (run / "summary.json").write_text(json.dumps({"data": {"formats": {"data.csv": fmt}}}))
    assert export.trained_on_plain_text(plain) and export.trained_on_plain_text(plain / "model")
    assert not export.trained_on_plain_text(chat_run) and not export.trained_on_plain_text(tmp_path / "unknown")
    assert export.user_prompt(plain, "Double 4:") == export.Prompt(None, "Double 4:", "")
    assert export.user_prompt(chat_run, "hi") == export.Prompt([{"role": "user", "content": "hi"}], None, "")

    spec = importlib.util.spec_from_file_location("chat_script", REPO / "scripts" / "chat.py")
    chat = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(chat)
    seen: list = []
    monkeypatch.setattr(export, "load_trained", lambda run: (object(), object(), None))
    monkeypatch.setattr(export, "generate", lambda model, tokenizer, prompt, tokens: seen.append(prompt) or " 8")
    monkeypatch.setattr("sft_play.cli.chosen_run", lambda args: plain)
    monkeypatch.setattr(sys, "argv", ["chat.py"])
    monkeypatch.setattr(sys, "stdin", io.StringIO("Double 4:\n/help\n/sytem be brief\nDouble 5:\n/exit\n"))
    assert chat.main() == 0
    assert seen == [export.Prompt(None, "Double 4:", ""), export.Prompt(None, "Double 5:", "")]  # no history either
    out = capsys.readouterr().out
    assert "no chat template" in out and "(/reset starts over" in out and "(unknown command /sytem:" in out


def test_commands_on_a_finished_run_refuse_overrides_they_would_ignore(runs, monkeypatch):
    # make eval ARGS="data.validation_path=..." said the run had no validation data: the key it had just set
    from sft_play import cli
    from sft_play.errors import UserError

    parser = cli.run_parser("test")
    args = parser.parse_args([f"train.output_dir={runs['lora'].parent}", "data.validation_path=other.jsonl"])
    with pytest.raises(UserError, match="data.validation_path=other.jsonl: a finished run is used with the settings"):
        cli.chosen_run(args)
    named = parser.parse_args([f"train.output_dir={runs['lora'].parent}", "train.run_name=lora"])
    assert cli.chosen_run(named) == runs["lora"]  # train.run_name chooses the run


def test_a_4bit_model_of_widths_the_fast_cpu_kernel_cannot_take_evaluates(tmp_path):
    """A QLoRA model 96 wide trained on a CPU with AVX512-BF16, then its first evaluation failed
    in bitsandbytes' repacking for that CPU kernel (shape '[96, 1]' is invalid): those linears
    keep the general kernel."""
    from sft_play import config as config_module
    from sft_play import model as model_module
    from sft_play.run import resolve

    config_json = json.loads((REPO / "configs" / "tiny_model" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config_json, "hidden_size": 96, "intermediate_size": 288,
                                                      "head_dim": 48}))
    config = config_module.load(REPO / "configs" / "run_tiny.yaml", [
        f"model.name_or_path={tmp_path}", "model.tokenizer_name_or_path=configs/tiny_model",
        "finetune.method=qlora", "train.mixed_precision=no"], check_paths=False)
    run = resolve(config, on_cuda=False, bf16_supported=False, world_size=1)
    model = model_module.load_model(config, run, device="cpu").eval()
    linears = [m for m in model.modules() if hasattr(m, "support_avx512bf16_for_cpu")]
    assert linears and not any(m.support_avx512bf16_for_cpu for m in linears if m.in_features % 64 or m.out_features % 32)
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.tensor([[1, 5, 9, 3]])).logits).all()


def test_a_model_card_from_a_run_folder_with_only_its_config(tmp_path):
    """Without run.json the card read config.yaml's lora section under run.json's names (a DoRA
    run described as LoRA on all-linear); without summary.json's counts it must not fail."""
    from sft_play import config as config_module
    from sft_play import model_card

    config = config_module.load(None, ["finetune.method=lora", "lora.r=8", "lora.use_dora=true",
                                       "lora.loraplus_lr_ratio=16", "lora.target_modules=[q_proj,v_proj]"],
                                check_paths=False)
    (tmp_path / "config.yaml").write_text(config.to_yaml())
    (tmp_path / "summary.json").write_text(json.dumps({"data": {"tokens_total": 10}}))
    card = model_card.card(tmp_path, tmp_path / "model")
    assert "An adapter: DoRA r 8, alpha 32, LoRA+ (B at 16x the learning rate), on q_proj, v_proj" in card
    (tmp_path / "config.yaml").write_text("train: [unclosed\n")
    assert "# " + tmp_path.name in model_card.card(tmp_path, tmp_path / "model")  # unreadable settings: a card still


def test_a_run_is_used_from_any_folder(runs, tmp_path, monkeypatch):
    """The run's config.yaml keeps the relative paths it trained with (configs/tiny_model,
    data/tiny/...): from another folder an adapter found no base and generate no prompts."""
    monkeypatch.chdir(tmp_path)
    model, tokenizer, config = export.load_trained(runs["lora"], device="cpu")
    assert Path(config.model.name_or_path) == REPO / "configs" / "tiny_model"
    prompts = export.held_out_prompts(config, 2)
    assert len(prompts) == 2 and export.generate(model, tokenizer, prompts[0], max_new_tokens=4) is not None


def test_a_model_card_names_the_processes_and_strategy_the_run_recorded(tmp_path):
    """The card's precision row reads run.json as the run folder writes it (its parallel part)."""
    from sft_play import config as config_module
    from sft_play import model_card, run_folder
    from sft_play.run import resolve

    config = config_module.load(REPO / "configs" / "run_tiny.yaml", ["distributed.strategy=fsdp2"])
    run_folder.write_config(tmp_path, config)
    run_folder.write_run(tmp_path, resolve(config, on_cuda=False, bf16_supported=False, world_size=4))
    assert "4 process(es), fsdp2" in model_card.card(tmp_path, tmp_path / "model")
