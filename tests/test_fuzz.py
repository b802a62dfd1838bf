"""Fuzzing what a user can type and what a data file can hold: every input ends in a config
error or a bad-row error that says what is wrong in one line, never another exception."""

from __future__ import annotations

import copy
import json
import random
import typing

import pytest

from sft_play import config as config_module
from sft_play.config.schema import SECTIONS
from sft_play.data import build
from sft_play.data.formats import InvalidRow
from sft_play.errors import UserError

NUMBERS = ["-1", "0", "1", "-0.5", "1e308", "-1e308", "1e999", "inf", "-inf", "nan", "abc", "", "[]", "{}",
           str(2**63), str(-(2**63)), "0x10", "1_000", "true", "null", "'1'", "1.5"]


def _numeric_keys() -> list[str]:
    keys = []
    for section, cls in SECTIONS.items():
        for key, field in cls.model_fields.items():
            kinds = typing.get_args(field.annotation) or (field.annotation,)
            if any(kind in (int, float) for kind in kinds):
                keys.append(f"{section}.{key}")
    return keys


@pytest.mark.parametrize("key", _numeric_keys())
def test_every_number_a_config_takes_is_taken_or_refused_in_a_line(key):
    assert len(_numeric_keys()) > 30
    for value in NUMBERS:
        try:
            config_module.load(None, [f"{key}={value}"], check_paths=False, check_packages=False)
        except config_module.ConfigError as error:
            assert error.problems and all("\n" not in problem and len(problem) < 400 for problem in error.problems), \
                (key, value, error.problems)


def _malformed_rows(rng: random.Random) -> list[str]:
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    values = [None, 0, -1, 1.5, "", "x" * 50, [], {}, [None], [{}], {"role": 1}, True, "\ud83d", [[[[]]]]]
    rows = []

    def value():
        return copy.deepcopy(rng.choice(values))  # a fresh one each time: a shared list could end up in itself

    for _ in range(200):
        row = json.loads(json.dumps(good))
        for _ in range(rng.randint(1, 3)):
            where = rng.choice(["top", "messages", "turn", "field"])
            if where == "top":
                row = value() if rng.random() < 0.3 else {rng.choice(["messages", "text", "prompt", "conversations",
                                                                      "x"]): value()}
            elif where == "messages" and isinstance(row, dict):
                row["messages"] = value()
            elif where == "turn" and isinstance(row, dict) and isinstance(row.get("messages"), list) and row["messages"]:
                row["messages"][rng.randrange(len(row["messages"]))] = value()
            elif isinstance(row, dict) and isinstance(row.get("messages"), list) and row["messages"] \
                    and isinstance(row["messages"][0], dict):
                row["messages"][0][rng.choice(["role", "content", "tool_calls", "x"])] = value()
        text = json.dumps(row) if rng.random() < 0.9 else json.dumps(row)[: rng.randint(0, 20)]  # or cut short
        rows.append(text)
    rows.append(bytes(rng.randrange(256) for _ in range(64)).decode("latin-1"))
    return rows


def test_malformed_rows_are_bad_rows_named_by_line_never_a_crash(tmp_path, tiny_tokenizer):
    rng = random.Random(0)
    good = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}'
    for attempt in range(3):
        path = tmp_path / f"rows{attempt}.jsonl"
        path.write_text("\n".join([good, *_malformed_rows(rng), good]) + "\n", encoding="utf-8", errors="surrogateescape")
        for on_invalid in ("error", "skip"):
            cfg = config_module.load(None, [f"data.path={path}", "data.validation_path=null",
                                            f"data.on_invalid={on_invalid}"], check_paths=False).data
            try:
                build(cfg, tiny_tokenizer, seed=0)
            except (InvalidRow, UserError) as error:
                lines = str(error).splitlines()
                assert lines and all(len(line) < 1000 for line in lines), lines[:3]


def test_a_bad_record_in_a_json_file_is_one_bad_row_not_a_bad_file(tmp_path, tiny_tokenizer):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    deep = {"messages": json.loads("[" * 40 + "]" * 40)}
    path = tmp_path / "records.json"
    path.write_text(json.dumps([good, deep, good]).replace("]]]]", "]]]]", 1)[:-1]
                    + ', {"messages": [{"role": "user", "content": "\\ud83d"}, {"role": "assistant", "content": "x"}]}]')
    cfg = config_module.load(None, [f"data.path={path}", "data.validation_path=null", "data.on_invalid=skip"],
                             check_paths=False).data
    stats = build(cfg, tiny_tokenizer, seed=0).stats
    assert stats.examples == 2 and sum(stats.skipped.values()) == 2, stats.skipped
