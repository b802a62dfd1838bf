"""What data preparation produces, pinned byte for byte before it is rebuilt (issue 47: Arrow
tables, every core, streaming): the tokens, labels and packed rows of every fixture format, with
and without packing, each train_on, hashed. A rebuild that changes any of them changes a hash
here; if a change is meant, say why in the commit and update the hash with it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from sft_play import config as config_module
from sft_play.data import build

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "fixtures" / "data"

# (file, extra data settings) -> sha256 of the training rows as JSON (data.max_seq_length 128, the
# tiny tokenizer), computed on the pipeline of commit 28b5931 (lists of Python records, one core)
GOLDEN = {
    ("messages.jsonl", ()): "f741ba6bf0f7fae033fe036409ad0b0d36f3da02bf23ed00f83fc30a106a3278",
    ("messages.jsonl", ("data.packing=false",)): "7358f90434b38f65cc16d02cdc46e38bdd77c5a5a8089a609d492791eac223a2",
    # two processes (a number is taken as it is, however few the records): the same bytes as one
    ("messages.jsonl", ("data.num_proc=2",)): "f741ba6bf0f7fae033fe036409ad0b0d36f3da02bf23ed00f83fc30a106a3278",
    ("messages.jsonl", ("data.num_proc=1",)): "f741ba6bf0f7fae033fe036409ad0b0d36f3da02bf23ed00f83fc30a106a3278",
    ("messages.jsonl", ("data.train_on=last",)): "b60b61fdf4aa777e74c5bcb8908d65a615b0480dfac8a4738cf3a947473af57f",
    ("sharegpt.json", ()): "0bf3ea94f38aa345e30c14efb481537a8cffc022f5b2c0cb2a9fb49262ff7cb7",
    ("alpaca.csv", ()): "594701a4db0606b9fb22d69bffb48575832908a5cb3600651780fe8d8191f006",
    ("prompt_completion.parquet", ()): "36fef13d9a1411d74dd9d3dfee11560db42fd101a3610fdf8b98da9cb1ecb1da",
    ("prompt_completion.parquet", ("data.train_on=all", "data.packing=false")): "752410830e5c9b7bc161ea7d5c6c5ca46631ae29b414212fbf6ac15cc73b01a7",
    ("text.jsonl", ()): "1b39ba9e17270f7e6f8064fb944020de3a5cd0963acaec33b886b56817a2655a",
    # 24,000 records: data.num_proc auto tokenises them in a process per usable core (one on one core)
    ("../../../data/tiny/train.jsonl", ()): "c93de00e01c66a92fc4c6f7961fc82847d5010a20bacc378ac8902c9c4c0a5fd",
}


def rows_digest(rows) -> str:
    """The rows' columns, in order, as JSON, hashed."""
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps({k: row[k] for k in sorted(row)}, sort_keys=True).encode())
    return digest.hexdigest()


@pytest.mark.parametrize("file, settings", list(GOLDEN), ids=[f"{f}{''.join(s)}" for f, s in GOLDEN])
def test_preparation_produces_the_pinned_rows(file, settings, tiny_tokenizer):
    cfg = config_module.load(None, [f"data.path={DATA / file}", "data.validation_path=null", "data.max_seq_length=128",
                                    "data.cache=false", *settings], check_paths=False).data
    assert rows_digest(build(cfg, tiny_tokenizer, seed=0).train) == GOLDEN[(file, settings)]


def test_a_weighted_mixture_with_held_out_rows_is_the_pinned_one(tiny_tokenizer):
    """Mixing by weight (repeats and a random remainder) and holding out each source's share
    before mixing: the training and validation rows, hashed (pinned as GOLDEN's are)."""
    paths = [str(DATA / "messages.jsonl"), str(DATA / "alpaca.csv"), str(DATA / "text.jsonl")]
    cfg = config_module.load(None, [f"data.path={json.dumps(paths)}", "data.weights=[3,1,2]", "data.validation_path=null",
                                    "data.validation_fraction=0.3", "data.max_seq_length=128", "data.packing=false",
                                    "data.cache=false"], check_paths=False).data
    bundle = build(cfg, tiny_tokenizer, seed=3)
    assert (rows_digest(bundle.train), rows_digest(bundle.validation)) == (
        "7f633798992fde50027696bb763f1cd604b06009e5dbece65297c6a1334a0b7d",
        "4669a7ed5db7799f02ac337d8d1c1dbc21e45493e48dadb1e2f93d68eab8caeb")
