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
from tests.conftest import run_script

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tiny_lora_run, tiny_full_run, tiny_qlora_run):
    return {"lora": tiny_lora_run[0], "qlora": tiny_qlora_run[0], "full": tiny_full_run[0]}


def logits(model, tokenizer, text="Reverse the letters: a b c"):
    ids = tokenizer(text, return_tensors="pt").to(model.device)
    with torch.no_grad():
        return model(**ids).logits.float()


def test_merged_lora_matches_the_adapter_model(runs):
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
    umask = os.umask(0)
    os.umask(umask)
    assert (merged_dir / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask  # shareable, not 0600


def test_merged_qlora_is_the_dequantised_base_plus_adapter(runs):
    merged_dir = export.merge(runs["qlora"])
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sft_play import config as config_module

    config = config_module.load(runs["qlora"] / "config.yaml")
    dequantised = export._base_model(config, "cpu", torch.float32, quantized=True).dequantize()
    reference = PeftModel.from_pretrained(dequantised, runs["qlora"] / "model").eval()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(merged_dir)
    torch.testing.assert_close(logits(merged, tokenizer), logits(reference, tokenizer), rtol=1e-3, atol=1e-3)


def test_merging_a_full_model_says_there_is_nothing_to_merge(runs):
    with pytest.raises(UserError, match="full model already"):
        export.merge(runs["full"])


def test_eval_writes_loss_perplexity_and_generations(runs):
    result = run_script("evaluate.py", "--run", str(runs["lora"]), "--count", "2", "--max-new-tokens", "12")
    assert result.returncode == 0, result.stderr[-3000:]
    saved = json.loads((runs["lora"] / "eval.json").read_text())
    assert 0 < saved["loss"] < 10 and saved["perplexity"] == pytest.approx(2.718281828 ** saved["loss"], rel=1e-6)
    assert saved["loss_tokens"] > 1000 and len(saved["generations"]) == 2
    assert "validation loss" in result.stdout
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


@pytest.mark.parametrize("which", ["merged", "full"])
def test_generate_works_for_merged_and_full_models(runs, which):
    folder = runs["lora"] / "merged" if which == "merged" else runs["full"]
    if which == "merged" and not folder.exists():
        export.merge(runs["lora"])
    result = run_script("generate.py", "--run", str(folder), "--prompt", "Reverse the letters: a b c",
                        "--max-new-tokens", "8")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "after:" in result.stdout and "before:" in result.stdout


def test_chat_answers_each_line_and_keeps_the_history(runs):
    process = subprocess.run([sys.executable, "scripts/chat.py", "--run", str(runs["lora"]), "--max-new-tokens", "8"],
                             cwd=REPO, input="Reverse the letters: a b c\n/reset\nWhich letter comes after d?\n/exit\n",
                             capture_output=True, text=True, timeout=300)
    assert process.returncode == 0, process.stderr[-3000:]
    assert process.stdout.count("model> ") == 2
