"""Data: formats from fixture files, labels token by token, packing without cross-talk, bad rows."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from sft_play import config as config_module
from sft_play.data import DataStats, build, load_records
from sft_play.data.collate import PackedRowsCollator
from sft_play.data.formats import InvalidRow
from sft_play.data.tokenize import IGNORE_INDEX, encode_chat, encode_prompt_completion, encode_text
from sft_play.errors import UserError

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures" / "data"
# The tiny tokenizer's template without its {% generation %} markers: exercises the span path.
PLAIN_CHATML = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def data_config(**values):
    overrides = [f"data.{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in values.items()]
    return config_module.load(None, overrides, check_paths=False).data


@pytest.mark.parametrize(
    "name, fmt",
    [("messages.jsonl", "messages"), ("sharegpt.json", "sharegpt"), ("alpaca.csv", "alpaca"),
     ("prompt_completion.parquet", "prompt_completion"), ("text.jsonl", "text")],
)
def test_each_format_is_detected_and_loaded(name, fmt):
    stats = DataStats()
    records = load_records(str(FIXTURES / name), data_config(), stats)
    assert stats.formats == {str(FIXTURES / name): fmt}
    assert records
    if fmt in ("messages", "sharegpt", "alpaca"):
        assert all(m["role"] in ("system", "user", "assistant") for r in records for m in r["messages"])
    if fmt == "sharegpt":
        assert records[1]["messages"][0] == {"role": "system", "content": "You solve letter puzzles."}
        assert records[0]["messages"][1] == {"role": "assistant", "content": "X Y"}
    if fmt == "alpaca":
        assert records[0]["messages"][0]["content"] == "Reverse the letters\n\na b c"
        assert records[1]["messages"][0]["content"] == "Which letter comes after k?"


def test_folder_of_files_and_lists_concatenate():
    stats = DataStats()
    records = load_records([str(FIXTURES / "messages.jsonl"), str(FIXTURES / "alpaca.csv")], data_config(), stats)
    assert len(records) == 5
    assert len(load_records(str(FIXTURES), data_config(), DataStats())) == 3 + 2 + 2 + 2 + 2


def test_chat_labels_cover_exactly_the_assistant_turns(tiny_tokenizer):
    messages = [
        {"role": "user", "content": "Which letter comes after d?"},
        {"role": "assistant", "content": "e"},
        {"role": "user", "content": "And after e?"},
        {"role": "assistant", "content": "f"},
    ]
    ids, labels = encode_chat(tiny_tokenizer, messages, tiny_tokenizer.chat_template, "completion")
    learned = [tiny_tokenizer.decode([t]) for t, label in zip(ids, labels) if label != IGNORE_INDEX]
    assert learned == ["e", "<|im_end|>", "f", "<|im_end|>"]
    assert all(label in (IGNORE_INDEX, t) for t, label in zip(ids, labels))


def test_span_path_agrees_with_generation_markers(tiny_tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Reverse the letters: a b c"},
        {"role": "assistant", "content": "c b a"},
        {"role": "user", "content": "Sort the letters: c a b"},
        {"role": "assistant", "content": "a b c"},
    ]
    ids_marked, labels_marked = encode_chat(tiny_tokenizer, messages, tiny_tokenizer.chat_template, "completion")
    ids_spans, labels_spans = encode_chat(tiny_tokenizer, messages, PLAIN_CHATML, "completion")
    assert ids_marked == ids_spans
    # The span path also keeps the newline after <|im_end|>, which the marked template leaves out
    diff = [i for i, (a, b) in enumerate(zip(labels_marked, labels_spans)) if a != b]
    assert all(tiny_tokenizer.decode([ids_spans[i]]) == "\n" for i in diff)
    assert [t for t in labels_marked if t != IGNORE_INDEX] == [
        t for t, i in zip(labels_spans, range(len(labels_spans))) if t != IGNORE_INDEX and i not in diff
    ]


def test_prompt_completion_labels_only_the_completion(tiny_tokenizer):
    ids, labels = encode_prompt_completion(tiny_tokenizer, "Reverse the letters: m n o\nAnswer:", " o n m", "completion")
    completion = tiny_tokenizer(" o n m", add_special_tokens=False)["input_ids"] + [tiny_tokenizer.eos_token_id]
    assert ids[-len(completion):] == completion
    assert labels == [IGNORE_INDEX] * (len(ids) - len(completion)) + completion
    _, all_labels = encode_prompt_completion(tiny_tokenizer, "p", " c", "all")
    assert IGNORE_INDEX not in all_labels


def test_text_is_learned_in_full_and_ends_with_eos(tiny_tokenizer):
    ids, labels = encode_text(tiny_tokenizer, "a b c")
    assert labels == ids and ids[-1] == tiny_tokenizer.eos_token_id


@pytest.mark.parametrize("train_on", ["completion", "all"])
def test_chats_tokenised_together_are_tokenised_as_one_by_one(tiny_tokenizer, train_on):
    """Tokenising builds all chat records of a batch in one call: the same tokens and labels."""
    from sft_play.data.tokenize import encode_chats_with_markers

    conversations = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Reverse: a b c"},
                      {"role": "assistant", "content": "c b a"}],
                     [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                      {"role": "user", "content": "again"}, {"role": "assistant", "content": "hello again"}],
                     [{"role": "user", "content": "x " * 50}, {"role": "assistant", "content": "y"}]]
    template = tiny_tokenizer.chat_template
    assert encode_chats_with_markers(tiny_tokenizer, conversations, template, train_on) == [
        encode_chat(tiny_tokenizer, c, template, train_on) for c in conversations]


def test_train_on_all_keeps_every_token(tiny_tokenizer):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a"}]
    ids, labels = encode_chat(tiny_tokenizer, messages, tiny_tokenizer.chat_template, "all")
    assert labels == ids


def test_overlong_examples_are_truncated_or_dropped(tiny_tokenizer):
    path = str(FIXTURES / "messages.jsonl")
    truncated = build(data_config(path=path, max_seq_length=20, packing=False), tiny_tokenizer)
    assert truncated.stats.truncated >= 1 and truncated.stats.dropped_overlong == 0
    assert max(len(ids) for ids in truncated.train["input_ids"]) <= 20
    dropped = build(data_config(path=path, max_seq_length=20, packing=False, overlong="drop"), tiny_tokenizer)
    assert dropped.stats.dropped_overlong == truncated.stats.truncated + truncated.stats.skipped.get(
        "no answer tokens left after truncation", 0)
    assert dropped.stats.examples == 3 - dropped.stats.dropped_overlong
    # each example left out is named by file and row, as bad rows are
    names = dropped.stats.skipped_rows["longer than data.max_seq_length=20 (data.overlong: drop)"]
    assert len(names) == dropped.stats.dropped_overlong and all(n.startswith(f"{path}:") for n in names)


def test_tokenising_a_long_example_prints_no_library_warning():
    """transformers warned "Token indices sequence length is longer than the specified maximum"
    on every run with a long example, which the data module truncates or drops itself, and says so."""
    import logging

    from transformers import AutoTokenizer

    from sft_play import cli

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    source = logging.getLogger("transformers.tokenization_utils_base")
    source.addHandler(handler)  # what passes the logger's filters reaches its handlers
    try:
        cli.quiet_libraries()
        AutoTokenizer.from_pretrained(str(REPO / "configs" / "tiny_model"))("a " * 5000)  # a fresh one warns once
    finally:
        source.removeHandler(handler)
    assert not [m for m in seen if "Token indices sequence length" in m]


def test_an_example_whose_answer_truncation_cuts_away_is_skipped_by_name_not_counted_truncated(tmp_path, tiny_tokenizer):
    path = tmp_path / "long.jsonl"
    rows = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
            {"messages": [{"role": "user", "content": "x " * 200}, {"role": "assistant", "content": "a"}]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bundle = build(data_config(path=str(path), validation_path=None, max_seq_length=64, packing=False), tiny_tokenizer)
    stats = bundle.stats
    assert stats.examples == 1 and stats.truncated == 0 and stats.skipped == {"no answer tokens left after truncation": 1}
    assert stats.skipped_rows["no answer tokens left after truncation"] == [f"{path}:2"]


def test_stats_describe_the_tokens(tiny_tokenizer):
    bundle = build(data_config(path=str(FIXTURES / "messages.jsonl"), max_seq_length=256), tiny_tokenizer)
    stats = bundle.stats
    assert stats.examples == 3
    lengths = sorted(length for row in bundle.train["seq_lengths"] for length in row)  # per example, from the packing
    assert len(lengths) == 3
    assert stats.tokens_max == lengths[-1] and stats.tokens_total == sum(lengths) and stats.tokens_p50 == lengths[1]
    # what the planner times causal attention by: the length of a token's example, on average over tokens
    assert stats.tokens_squared == sum(n * n for n in lengths)
    assert stats.example_tokens == pytest.approx(sum(n * n for n in lengths) / sum(lengths))
    assert 0 < stats.loss_token_share < 0.5
    assert stats.packed_rows == 1  # three short examples fit one row of 256
    assert not stats.uniform_rows  # one row of three examples: attention needs a mask


def test_packed_rows_give_the_same_per_example_loss_as_single_examples(tiny_tokenizer):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(Path(__file__).resolve().parents[1] / "configs" / "tiny_model"),
        attn_implementation="sdpa",
    ).eval()
    bundle = build(data_config(path=str(FIXTURES / "messages.jsonl"), max_seq_length=256), tiny_tokenizer)
    unpacked = build(
        data_config(path=str(FIXTURES / "messages.jsonl"), max_seq_length=256, packing=False), tiny_tokenizer
    ).train
    batch = PackedRowsCollator(tiny_tokenizer.pad_token_id)([bundle.train[0]])
    assert "attention_mask" not in batch
    with torch.no_grad():
        # use_cache=False as in training: with a cache, transformers ignores the packing boundaries
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
    lengths = bundle.train[0]["seq_lengths"]
    start = 0
    singles = []
    for length in lengths:
        ids = batch["input_ids"][0, start:start + length]
        with torch.no_grad():
            alone = model(input_ids=ids[None]).logits[0]
        torch.testing.assert_close(logits[start:start + length], alone, rtol=1e-4, atol=1e-4)
        singles.append(ids.tolist())
        start += length
    assert sorted(singles) == sorted(unpacked["input_ids"])
    # Labels never ask an example to predict the next example's first token
    positions = batch["position_ids"][0]
    assert (batch["labels"][0][positions == 0] == IGNORE_INDEX).all()


@pytest.mark.parametrize(
    "content, match",
    [
        ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant"}]}\n', r"row 1, field 'messages\[1\].content': missing"),
        ('{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "a"}]}\n', r"messages\[0\].content': expected a string or a list of parts, got int"),
        ('{"messages": []}\n', r"row 1, field 'messages': empty conversation"),
        ('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": " "}]}\n',
         r"row 1, field 'messages\[1\].content': empty answer"),
        ('{"messages": [{"role": "robot", "content": "q"}, {"role": "assistant", "content": "a"}]}\n', r"messages\[0\].role': unknown role 'robot'"),
        (b'{"messages": "caf\xe9"}\n', r"row 1, field '<line>': not valid UTF-8"),
        ("", r"no records \(the file is empty\)"),
    ],
    ids=["missing-field", "wrong-type", "empty-conversation", "empty-answer", "unknown-role", "non-utf8", "empty-file"],
)
def test_bad_rows_name_the_file_row_and_field(tmp_path, content, match):
    path = tmp_path / "bad.jsonl"
    good = '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n'
    if content:
        path.write_bytes(good.encode() + (content if isinstance(content, bytes) else content.encode()))
        match = match.replace("row 1", "row 2")
    else:
        path.write_text("")
    with pytest.raises(InvalidRow, match=match) as caught:
        load_records(str(path), data_config(format="messages"), DataStats())
    assert str(path) in str(caught.value)


@pytest.mark.parametrize("fmt, row, field", [
    ("alpaca", {"instruction": "Add 1 and 1.", "input": "", "output": ""}, "output"),
    ("alpaca", {"instruction": "Add 1 and 1.", "input": "", "output": "   "}, "output"),
    ("sharegpt", {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": ""}]},
     "conversations[1].value"),
    ("prompt_completion", {"prompt": "q", "completion": "\n"}, "completion"),
])
def test_an_empty_answer_is_a_bad_row_in_every_format(tmp_path, fmt, row, field):
    """Empty answers passed for Alpaca, ShareGPT and messages data (and trained the model to stop
    at once) while CSV's were caught."""
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(InvalidRow, match=re.escape(f"row 1, field '{field}': empty answer")):
        load_records(str(path), data_config(format=fmt), DataStats())


@pytest.mark.parametrize("fmt", ["auto", "prompt_completion"])
def test_a_column_mapping_that_names_no_column_says_so(tmp_path, fmt):
    """data.columns.completion=reply on a file whose column is 'answer' was told to map its columns
    with data.columns (auto), or had every row skipped as 'reply: missing' (forced, skip)."""
    from sft_play.data.formats import UnknownFormat

    path = tmp_path / "qa.csv"
    path.write_text("question,answer\nWhat is 1+1?,2\nWhat is 2+2?,4\n")
    cfg = data_config(format=fmt, on_invalid="skip", columns={"prompt": "question", "completion": "reply"})
    with pytest.raises(UnknownFormat, match=re.escape(f"{path}: ") + ".*" + re.escape(
            "data.columns.completion=reply names no column of this file (its columns: ['answer', 'question'])")):
        load_records(str(path), cfg, DataStats())


def test_data_of_which_every_row_is_skipped_is_one_clear_error(tmp_path, tiny_tokenizer):
    from sft_play.data import NoUsableData
    from sft_play.errors import UserError

    path = tmp_path / "chat.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "q"}]}\n' * 3)
    with pytest.raises(NoUsableData, match=rf"no usable training example in {path}: skipped 3 rows: "
                                           "messages: no assistant turn to learn from x3") as caught:
        build(data_config(path=str(path), validation_path=None, on_invalid="skip"), tiny_tokenizer)
    assert isinstance(caught.value, UserError)  # the entry scripts print it as one line, no traceback


def test_a_byte_that_is_not_utf8_in_a_csv_makes_its_row_bad_not_the_file(tmp_path):
    """One such byte rejected the whole file, at an offset inside the decoder's buffer, and
    data.on_invalid=skip could not get past it."""
    path = tmp_path / "qa.csv"
    path.write_bytes(b"question,answer\nWhat is 1+1?,2\nWhat is \xe9 2+2?,4\nOK?,yes\n")
    columns = {"prompt": "question", "completion": "answer"}
    with pytest.raises(InvalidRow, match=re.escape("row 2, field 'question': not valid UTF-8 (byte 0xe9 on line 3)")):
        load_records(str(path), data_config(columns=columns), DataStats())
    stats = DataStats()
    records = load_records(str(path), data_config(columns=columns, on_invalid="skip"), stats)
    assert [r["completion"] for r in records] == ["2", "yes"]
    assert stats.skipped_rows == {"question: not valid UTF-8": [f"{path}:2"]}


def test_a_txt_file_is_text_records_one_per_line(tmp_path):
    """README promised plain text; a .txt file was refused as not a supported data file."""
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"first line\n\nsecond line\r\n\xff bad\nthird\n")
    stats = DataStats()
    records = load_records(str(path), data_config(on_invalid="skip"), stats)
    assert [r["text"] for r in records] == ["first line", "second line", "third"]
    assert stats.formats == {str(path): "text"} and stats.skipped_rows == {"<line>: not valid UTF-8": [f"{path}:4"]}
    # a folder's .txt files are not data (LICENSE.txt, notes): only a path or glob that names them
    (tmp_path / "chat.jsonl").write_text(json.dumps({"text": "from jsonl"}) + "\n")
    assert [r["text"] for r in load_records(str(tmp_path), data_config(on_invalid="skip"), DataStats())] == ["from jsonl"]


def test_bad_rows_are_listed_in_the_files_order(tmp_path):
    """A line that could not be read was listed before the rows with bad fields (rows 42, 43, 41)."""
    path = tmp_path / "mixed.jsonl"
    good = '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n'
    path.write_bytes((good + '{"messages": []}\n' + '{"messages": [\n' + '{"messages": []}\n').encode())
    with pytest.raises(InvalidRow) as caught:
        load_records(str(path), data_config(), DataStats())
    assert [row.row for row in caught.value.rows] == [2, 3, 4]


def test_skipping_bad_rows_counts_them_by_reason(tmp_path):
    path = tmp_path / "mixed.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
        {"messages": []},
        {"messages": [{"role": "robot", "content": "q"}, {"role": "assistant", "content": "a"}]},
        {"messages": [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "b"}]},
    ]
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in rows) + b"\xff\xfe\n")
    stats = DataStats()
    records = load_records(str(path), data_config(on_invalid="skip"), stats)
    assert len(records) == 2
    assert stats.skipped == {
        "messages: empty conversation": 1,
        "messages[].role: unknown role 'robot'": 1,
        "<line>: not valid UTF-8": 1,  # lines with such bytes counted together; each named in skipped_rows
    }
    assert stats.skipped_rows["messages: empty conversation"] == [f"{path}:2"]
    assert stats.skipped_rows["messages[].role: unknown role 'robot'"] == [f"{path}:3"]


def test_the_skip_summary_is_printed_on_every_run_also_from_the_cache(tmp_path, tiny_tokenizer, monkeypatch, caplog):
    monkeypatch.setenv("SFT_PLAY_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "mixed.jsonl"
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    path.write_text("\n".join(json.dumps(r) for r in [good, {"messages": []}, good, {"messages": []}]) + "\n")
    cfg = data_config(path=str(path), on_invalid="skip")
    for attempt in ("fresh", "cached"):
        caplog.clear()
        with caplog.at_level("INFO", logger="sft_play.data"):
            bundle = build(cfg, tiny_tokenizer)
        assert any("from the cache" in r.getMessage() for r in caplog.records) == (attempt == "cached")
        summary = [r.getMessage() for r in caplog.records if "skipped 2 rows" in r.getMessage()]
        said = f"data (train): skipped 2 rows of 4, 50%: messages: empty conversation x2 ({path}:2, {path}:4)"
        assert summary == [said], attempt
        assert bundle.stats.skipped_rows == {"messages: empty conversation": [f"{path}:2", f"{path}:4"]}


def test_undetectable_format_says_how_to_fix_it(tmp_path):
    path = tmp_path / "odd.jsonl"
    path.write_text('{"question": "q", "answer": "a"}\n')
    with pytest.raises(ValueError, match="data.columns"):
        load_records(str(path), data_config(), DataStats())
    mapped = load_records(str(path), data_config(columns={"prompt": "question", "completion": "answer"}), DataStats())
    assert mapped == [{"prompt": "q", "completion": "a", "_row": f"{path}:1"}]  # each record says where it came from


def test_weighted_mixing_keeps_the_total_and_the_proportions():
    from sft_play.data import mix

    a = [{"text": f"a{i}"} for i in range(10)]
    b = [{"text": f"b{i}"} for i in range(30)]
    mixed = mix([a, b], [3, 1], seed=0)
    assert len(mixed) == 40
    assert sum(r["text"].startswith("a") for r in mixed) == 30  # a repeated three times
    assert sum(r["text"].startswith("b") for r in mixed) == 10  # a sample of b
    assert mix([a, b], [3, 1], seed=0) == mixed


def test_the_mix_log_says_what_each_source_gave(tmp_path, caplog):
    from sft_play.data.pipeline import _records

    for name, count in (("a", 10), ("b", 30)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": f"{name}{i}"}) + "\n" for i in range(count)))
    paths = [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]
    with caplog.at_level("INFO", logger="sft_play.data"):
        records, held = _records(data_config(path=paths, weights=[3, 1]), DataStats(), seed=0)
    assert len(records) == 40 and held is None
    assert (f"mixed by weights [3.0, 1.0] into 40 records: {paths[0]}: 30 of its 10 (3.00 passes); "
            f"{paths[1]}: 10 of its 30 (0.33 passes)") in caplog.text


def test_a_validation_fraction_of_mixed_data_holds_out_records_no_copy_of_which_trains(tmp_path):
    """Holding out after mixing put copies of training records (the mix repeats the sources it
    weights up) into the validation set: 9 of 20 there."""
    from sft_play.data.pipeline import _records, decoded, validation_records

    for name in ("a", "b"):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": f"{name}{i}"}) + "\n" for i in range(100)))
    cfg = data_config(path=[str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")], weights=[0.8, 0.2],
                      validation_fraction=0.1)
    records, held = _records(cfg, DataStats(), seed=42)
    trained, validation = {r["text"] for r in records}, [r["text"] for r in held]
    assert len(validation) == 20 == len(set(validation))  # a tenth of each source's own records
    assert sum(t.startswith("a") for t in validation) == 10
    assert not trained & set(validation)
    assert len(records) == 180  # the two sources' remaining 90 + 90, mixed 4:1
    assert sum(t.startswith("a") for t in (r["text"] for r in records)) == 144
    assert [r["text"] for r in validation_records(cfg, 42)] == validation  # the held-out prompts are those
    assert any(t.startswith("b") for t in validation[:5])  # shuffled: make generate's first prompts from both
    # a source too small for a share keeps its records: held out per source, it would leave the mix
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "c0"}) + "\n")
    small = data_config(path=[str(tmp_path / "a.jsonl"), str(tmp_path / "c.jsonl")], weights=[1, 1],
                        validation_fraction=0.05)
    records, held = _records(small, DataStats(), seed=42)
    assert [r["text"] for r in records].count("c0") == 48  # half of 95 + 1
    assert len(held) == 5 and all(r["text"] != "c0" for r in held)
    # one record in all: it trains, and there is no validation set (an empty one would fail evaluation)
    alone = data_config(path=str(tmp_path / "c.jsonl"), validation_fraction=0.1)
    records, held = _records(alone, DataStats(), seed=42)
    assert (decoded(records), held) == ([{"text": "c0", "_row": f"{tmp_path / 'c.jsonl'}:1"}], None)


def test_weights_need_one_per_path():
    with pytest.raises(config_module.ConfigError, match="data.weights: 1 weight"):
        config_module.load(None, ["data.path=[a.jsonl, b.jsonl]", "data.weights=[1]"], check_paths=False)


def test_preprocessing_is_cached_and_invalidated_by_the_data(tmp_path, tiny_tokenizer, monkeypatch):
    monkeypatch.setenv("SFT_PLAY_CACHE", str(tmp_path / "cache"))
    data_file = tmp_path / "chat.jsonl"
    data_file.write_text((FIXTURES / "messages.jsonl").read_text())
    cfg = data_config(path=str(data_file), max_seq_length=64)
    first = build(cfg, tiny_tokenizer)
    cached_dirs = [p for p in (tmp_path / "cache" / "data").iterdir() if not p.name.startswith(".")]  # (work folders)
    assert len(cached_dirs) == 1
    second = build(cfg, tiny_tokenizer)
    assert second.train["input_ids"] == first.train["input_ids"] and second.stats == first.stats
    data_file.write_text(data_file.read_text() + (FIXTURES / "messages.jsonl").read_text().splitlines()[0] + "\n")
    third = build(cfg, tiny_tokenizer)
    assert third.stats.examples == first.stats.examples + 1
    assert len([p for p in (tmp_path / "cache" / "data").iterdir() if not p.name.startswith(".")]) == 2
    changed_setting = build(data_config(path=str(data_file), max_seq_length=32), tiny_tokenizer)
    assert changed_setting.stats.max_seq_length == 32


def test_a_damaged_cache_entry_is_prepared_again_with_one_warning(tmp_path, tiny_tokenizer, monkeypatch, caplog):
    """An Arrow file cut in half ended in a traceback; 572 flipped bytes were trained on silently.
    Each file's size and digest are recorded when it is saved and checked when it is read."""
    monkeypatch.setenv("SFT_PLAY_CACHE", str(tmp_path / "cache"))
    data_file = tmp_path / "chat.jsonl"
    data_file.write_text((FIXTURES / "messages.jsonl").read_text())
    cfg = data_config(path=str(data_file), max_seq_length=64)
    first = build(cfg, tiny_tokenizer)
    rows, stats = first.train["input_ids"][:], first.stats  # read now: the damage below is to these files
    [entry] = [p for p in (tmp_path / "cache" / "data").iterdir() if not p.name.startswith(".")]  # not work folders
    arrow = max(entry.rglob("*.arrow"), key=lambda p: p.stat().st_size)

    def damaged_and_rebuilt(damage) -> str:
        damage(arrow)
        caplog.clear()
        with caplog.at_level("WARNING", logger="sft_play.data.cache"):
            again = build(cfg, tiny_tokenizer)
        assert again.train["input_ids"][:] == rows and again.stats == stats
        [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        return warning

    def cut(path):
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    def flip(path):
        data = bytearray(path.read_bytes())
        data[len(data) // 2: len(data) // 2 + 572] = bytes(b ^ 0xFF for b in data[len(data) // 2: len(data) // 2 + 572])
        path.write_bytes(bytes(data))

    assert "is damaged" in damaged_and_rebuilt(cut) and "bytes, saved as" in damaged_and_rebuilt(cut)
    assert "does not match the digest saved with it" in damaged_and_rebuilt(flip)
    caplog.clear()
    with caplog.at_level("WARNING", logger="sft_play.data.cache"):
        build(cfg, tiny_tokenizer)  # rebuilt whole: read again without a word
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_planning_reads_the_statistics_of_a_build_without_loading_the_tokenizer(tmp_path, monkeypatch):
    """A build keeps its statistics under a key of the data, the settings and the local tokenizer
    folder's files, which planning reads without loading the tokenizer; any of them changed, or a
    tokenizer on the hub, and there is nothing to read."""
    import shutil

    from transformers import AutoTokenizer

    from sft_play.data import remembered_stats

    monkeypatch.setenv("SFT_PLAY_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "tokenizer"
    shutil.copytree(REPO / "configs" / "tiny_model", folder)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    data_file = tmp_path / "chat.jsonl"
    data_file.write_text((FIXTURES / "messages.jsonl").read_text())
    cfg = data_config(path=str(data_file), max_seq_length=64)
    assert remembered_stats(cfg, str(folder), seed=0) is None
    built = build(cfg, tokenizer, seed=0)
    assert remembered_stats(cfg, str(folder), seed=0) == built.stats
    build(cfg, tokenizer, seed=0)  # read back from the cache: kept the same
    assert remembered_stats(cfg, str(folder), seed=0) == built.stats
    assert remembered_stats(data_config(path=str(data_file), max_seq_length=32), str(folder), seed=0) is None
    assert remembered_stats(cfg, str(folder), seed=1) is None
    assert remembered_stats(cfg, "Qwen/Qwen2.5-0.5B", seed=0) is None
    assert remembered_stats(data_config(path=str(data_file), max_seq_length=64, cache=False), str(folder), seed=0) is None
    template = folder / "chat_template.jinja"
    template.write_text(template.read_text() + " ")
    assert remembered_stats(cfg, str(folder), seed=0) is None  # the tokenizer's files changed
    data_file.write_text(data_file.read_text() + (FIXTURES / "messages.jsonl").read_text().splitlines()[0] + "\n")
    assert remembered_stats(cfg, str(folder), seed=0) is None  # the data changed


def test_builds_of_the_same_data_at_once_tokenise_it_once(tmp_path, tiny_tokenizer, monkeypatch):
    """Runs started together (a sweep, the runs of a test module) wait for the first one's
    preparation and read it from the cache instead of each tokenising the same rows."""
    import logging
    import threading

    import sft_play.data.pipeline as data_module

    monkeypatch.setenv("SFT_PLAY_CACHE", str(tmp_path / "cache"))
    cfg = data_config(path=str(FIXTURES / "messages.jsonl"), max_seq_length=64)
    waiting, built = threading.Event(), []

    class Waits(logging.Handler):
        def emit(self, record):
            if "another process is preparing the same data" in record.getMessage():
                waiting.set()

    real = data_module._build

    def first_build(*args, **kwargs):
        built.append(threading.current_thread().name)
        second.start()
        assert waiting.wait(timeout=60), "the second build did not wait for the first"
        return real(*args, **kwargs)

    handler = Waits()
    logging.getLogger("sft_play.data").addHandler(handler)
    monkeypatch.setattr(logging.getLogger("sft_play.data"), "level", logging.INFO)
    monkeypatch.setattr(data_module, "_build", first_build)
    results = {}
    second = threading.Thread(target=lambda: results.update(second=build(cfg, tiny_tokenizer)), name="second")
    try:
        results["first"] = build(cfg, tiny_tokenizer)
        second.join(timeout=60)
    finally:
        logging.getLogger("sft_play.data").removeHandler(handler)
    assert built == ["MainThread"], "tokenised once, by the first"
    assert results["second"].train["input_ids"] == results["first"].train["input_ids"]
    assert results["second"].stats.examples == results["first"].stats.examples
    assert len(list((tmp_path / "cache" / "data").iterdir())) == 1


def test_several_processes_tokenise_the_same(tiny_tokenizer):
    one = build(data_config(path=str(FIXTURES), packing=False, cache=False), tiny_tokenizer)
    two = build(data_config(path=str(FIXTURES), packing=False, cache=False, num_proc=2), tiny_tokenizer)
    assert one.train["input_ids"] == two.train["input_ids"] and one.train["labels"] == two.train["labels"]


def test_data_stats_script_prints_what_the_planner_uses():
    from tests.conftest import run_script

    result = run_script("data_stats.py", "--config", "configs/run_tiny.yaml", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    doc = json.loads(result.stdout)
    train = doc["train"]
    assert train["examples"] == 24000 and train["packed_rows"] > 0
    assert train["tokens_p50"] <= train["tokens_p95"] <= train["tokens_max"] <= 256
    assert 0 < train["loss_token_share"] < 1 and train["truncated_share"] == 0
    assert doc["validation"]["examples"] == 200


def test_the_shipped_puzzles_are_what_the_build_script_writes_with_repeated_letters_drilled(tmp_path):
    """data/tiny is scripts/build_tiny_default.py's output byte for byte; its later records drill
    letters that repeat (what the tiny model gets wrong) and every answer still answers its question."""
    import importlib.util
    import string

    spec = importlib.util.spec_from_file_location("build_tiny_default", REPO / "scripts" / "build_tiny_default.py")
    build_script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_script)
    build_script.build_dataset(tmp_path)
    for name in ("train.jsonl", "validation.jsonl"):
        assert (tmp_path / "data" / "tiny" / name).read_bytes() == (REPO / "data" / "tiny" / name).read_bytes(), name

    solve = {"Reverse": lambda s: s[::-1], "Uppercase": lambda s: [c.upper() for c in s], "Sort": sorted,
             "Which": lambda s: [string.ascii_lowercase[string.ascii_lowercase.index(s[-1].rstrip("?")) + 1]]}

    def repeated_share(records):
        questions = [(m["content"], a["content"]) for r in records for m, a in zip(r["messages"], r["messages"][1:])
                     if m["role"] == "user"]
        for question, answer in questions:
            assert answer.split() == solve[question.split()[0]](question.split(":")[-1].split()), question
        letters = [q.split(":")[1].split() for q, _ in questions if not q.startswith("Which")]
        return sum(len(set(s)) < len(s) for s in letters) / len(letters)

    records = [json.loads(line) for line in (REPO / "data" / "tiny" / "train.jsonl").read_text().splitlines()]
    first, later = repeated_share(records[:build_script.N_TRAIN]), repeated_share(records[build_script.N_TRAIN:])
    assert 0.2 < first < 0.35 and later > first + 0.25, (first, later)


def test_the_held_out_prompts_of_a_validation_fraction_are_the_rows_training_held_out(tmp_path, tiny_tokenizer):
    # make generate and make eval on a run with data.validation_fraction found no held-out prompt
    from sft_play import export
    from sft_play.data import validation_records

    rows = [{"prompt": f"Double {i}:", "completion": f" {2 * i}"} for i in range(40)]
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = config_module.load(None, [f"data.path={path}", "data.validation_fraction=0.1", "data.packing=false",
                                       "data.cache=false", "train.seed=3"], check_paths=False)
    held = validation_records(config.data, config.train.seed)
    bundle = build(config.data, tiny_tokenizer, seed=config.train.seed)
    assert len(held) == len(bundle.validation) == 4 and len(bundle.train) == 36
    decoded = {tiny_tokenizer.decode(row["input_ids"]) for row in bundle.validation}
    assert all(any(record["prompt"] in text for text in decoded) for record in held)  # the same four rows
    prompts = export.held_out_prompts(config, 2)
    assert [p.text for p in prompts] == [r["prompt"] for r in held[:2]] and prompts[0].reference == held[0]["completion"]


def test_a_broken_jsonl_line_is_located_on_its_own_line(tmp_path):
    # a line cut short said "at column 1": the position after its newline
    from sft_play.data.sources import _jsonl_rows

    line = '{"prompt": "a", "completion": "b"'
    path = tmp_path / "cut.jsonl"
    path.write_text(line + "\n")
    ((number, row),) = list(_jsonl_rows(path))
    assert number == 1 and row.reason == f"not valid JSON: Expecting ',' delimiter at column {len(line) + 1}"


@pytest.mark.parametrize("on_invalid", ["error", "skip"])
def test_a_forced_format_that_fits_no_row_says_what_the_rows_look_like(on_invalid):
    """data.format=alpaca on a chat file: one error naming the format the columns show, not every
    row listed as missing 'instruction' (nor, with skip, every row skipped)."""
    from sft_play.data.formats import UnknownFormat

    path = str(FIXTURES / "messages.jsonl")
    with pytest.raises(UnknownFormat, match=r"data.format=alpaca, but none of its rows.*look like 'messages'"):
        load_records(path, data_config(format="alpaca", on_invalid=on_invalid), DataStats())
    # a forced format that fits some rows keeps listing the bad ones
    assert load_records(path, data_config(format="messages"), DataStats())


def test_a_chat_template_named_is_that_template_and_an_unknown_name_is_refused_with_the_names(tiny_tokenizer):
    """data.chat_template=chatml trained every example on the text 'chatml' (taken for Jinja)."""
    from sft_play.chat_templates import CHATML_TEMPLATE, chat_template_names
    from sft_play.data.tokenize import resolve_chat_template

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a b"},
                {"role": "assistant", "content": "b a"}]
    for name in ("chatml", "llama3", "qwen3", "gemma3", "phi3"):
        template = resolve_chat_template(tiny_tokenizer, name)
        ids, labels = encode_chat(tiny_tokenizer, messages, template, "completion")
        learned = tiny_tokenizer.decode([t for t, label in zip(ids, labels) if label != IGNORE_INDEX])
        assert learned.startswith(("b a", "<think>")) and "Be brief" not in learned, (name, learned)
    assert resolve_chat_template(tiny_tokenizer, "chatml") == CHATML_TEMPLATE
    assert "llama3" in chat_template_names() and not any("vl" in name.split("_") for name in chat_template_names())
    with pytest.raises(config_module.ConfigError, match=r"data.chat_template: 'chatlm' is no template name we know.*"
                                                        r"the names: chatml, .*llama3"):
        config_module.load(None, ["data.chat_template=chatlm"])


def test_a_template_that_refuses_a_record_names_it_in_one_error(tmp_path, tiny_tokenizer):
    """Gemma's template raises on a system turn: a jinja2 traceback, no row named."""
    from sft_play.errors import UserError

    path = tmp_path / "chat.jsonl"
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    bad = {"messages": [{"role": "system", "content": "s"}, *good["messages"]]}
    path.write_text("\n".join(json.dumps(r) for r in (good, good, bad)) + "\n")
    for template in ("gemma", PLAIN_CHATML.replace("{%- for", "{%- if messages[0]['role'] == 'system' %}"
                                                   "{{ raise_exception('no system role') }}{%- endif %}{%- for")):
        with pytest.raises(UserError, match=rf"the chat template cannot render {re.escape(str(path))}:3: "
                                            r"(System role not supported|no system role)\. Choose a template"):
            build(data_config(path=str(path), validation_path=None, chat_template=template, cache=False), tiny_tokenizer)


def test_a_tokenizer_without_a_chat_template_is_saved_with_the_one_it_trained_with(tmp_path):
    """make generate on such a run failed: 'tokenizer.chat_template is not set'."""
    import shutil

    from sft_play import model
    from sft_play.chat_templates import DEFAULT_CHAT_TEMPLATE

    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):  # no chat_template.jinja
        shutil.copy(REPO / "configs" / "tiny_model" / name, folder / name)
    config = config_module.load(REPO / "configs" / "run_tiny.yaml", [f"model.name_or_path={folder}"])
    tokenizer = model.load_tokenizer(config)
    assert tokenizer.chat_template == DEFAULT_CHAT_TEMPLATE
    tokenizer.save_pretrained(tmp_path / "saved")
    from transformers import AutoTokenizer

    reloaded = AutoTokenizer.from_pretrained(tmp_path / "saved")
    assert reloaded.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                        add_generation_prompt=True) == "### User:\nhi\n\n### Assistant:\n"


def test_turns_of_either_kind_are_read_from_either_column(tmp_path):
    """`conversations` holding role/content turns was read as ShareGPT: every row 'from' missing."""
    turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    for column, fmt in (("conversations", "messages"), ("messages", "messages")):
        path = tmp_path / f"{column}.jsonl"
        path.write_text(json.dumps({column: turns}) + "\n")
        stats = DataStats()
        assert load_records(str(path), data_config(), stats)[0]["messages"] == turns
        assert stats.formats == {str(path): fmt}
    path = tmp_path / "sharegpt_in_messages.jsonl"
    path.write_text(json.dumps({"messages": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}) + "\n")
    assert load_records(str(path), data_config(), DataStats())[0]["messages"] == turns


def test_alpaca_history_becomes_the_earlier_turns(tmp_path):
    """LLaMA-Factory's alpaca `history` was dropped without a word: only the last pair trained."""
    path = tmp_path / "alpaca.jsonl"
    rows = [{"instruction": "Reverse", "input": "a b c", "output": "c b a", "system": "Be brief.",
             "history": [["Hi", "Hello!"], ["Count to 2", "1 2"]]},
            {"instruction": "Hi", "output": "Hello!", "history": []},
            {"instruction": "Hi", "output": "Hello!", "history": [["only the question"]]}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    stats = DataStats()
    records = load_records(str(path), data_config(on_invalid="skip"), stats)
    assert [m["content"] for m in records[0]["messages"]] == [
        "Be brief.", "Hi", "Hello!", "Count to 2", "1 2", "Reverse\n\na b c", "c b a"]
    assert [m["role"] for m in records[0]["messages"]][1:] == ["user", "assistant"] * 3
    assert len(records[1]["messages"]) == 2 and len(records) == 2
    assert stats.skipped == {"history[]: expected an [instruction, answer] pair of strings": 1}  # grouped by field


def test_a_folder_of_splits_gives_training_its_split_and_validation_the_held_out_one(tmp_path):
    """data.split did nothing for folders: s/test/ trained along with s/train/."""
    chat = '{"messages": [{"role": "user", "content": "%s"}, {"role": "assistant", "content": "a"}]}\n'
    for layout in (("train/a.jsonl", "test/b.jsonl"), ("train.jsonl", "validation.jsonl"), ("a.jsonl", "dev-0.jsonl")):
        root = tmp_path / layout[1].split("/")[0].split(".")[0]
        for name, text in zip(layout, ("trained", "held")):
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(chat % text)
        cfg = data_config(path=str(root), validation_path=str(root))
        assert [r["messages"][0]["content"] for r in load_records(cfg.path, cfg, DataStats())] == ["trained"]
        from sft_play.data.sources import HELD_OUT

        assert [r["messages"][0]["content"] for r in load_records(cfg.path, cfg, DataStats(), HELD_OUT)] == ["held"]
    with pytest.raises(FileNotFoundError, match=r"holds the splits test, train \(by its files' names\), not 'valid"):
        load_records(str(tmp_path / "test"), data_config(split="valid"), DataStats())
    plain = tmp_path / "plain"  # no split in any name: read whole, as before
    plain.mkdir()
    for name in ("x.jsonl", "y.jsonl"):
        (plain / name).write_text(chat % name)
    assert len(load_records(str(plain), data_config(), DataStats())) == 2


def test_a_dataset_saved_by_datasets_is_read_whole_or_by_split(tmp_path):
    """A save_to_disk folder was read as its metadata JSON; its .arrow file was a traceback."""
    import datasets

    rows = [{"instruction": "Reverse", "input": f"a {c}", "output": f"{c} a"} for c in "bcd"]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict(train=datasets.Dataset.from_list(rows),
                         test=datasets.Dataset.from_list(rows[:1])).save_to_disk(str(tmp_path / "two"))
    stats = DataStats()
    assert len(load_records(str(tmp_path / "one"), data_config(), stats)) == 3
    assert stats.formats == {str(tmp_path / "one"): "alpaca"}
    arrow = next((tmp_path / "one").glob("*.arrow"))
    assert len(load_records(str(arrow), data_config(), DataStats())) == 3
    from sft_play.data.sources import HELD_OUT

    assert len(load_records(str(tmp_path / "two"), data_config(), DataStats())) == 3
    assert len(load_records(str(tmp_path / "two"), data_config(), DataStats(), HELD_OUT)) == 1
    with pytest.raises(InvalidRow, match="no split 'valid' in this dataset \\(its splits: train, test\\)"):
        load_records(str(tmp_path / "two"), data_config(split="valid"), DataStats())
    registry = tmp_path / "llamafactory"  # LLaMA-Factory's data folder: dataset_info.json registers its datasets
    registry.mkdir()
    (registry / "dataset_info.json").write_text('{"alpaca_en": {"file_name": "alpaca_en.json"}}')
    from sft_play.errors import UserError

    with pytest.raises(UserError, match="a LLaMA-Factory data folder registers its datasets there; set data.path to "
                                         "the dataset's own file"):
        load_records(str(registry), data_config(), DataStats())


def test_a_hub_dataset_that_cannot_be_had_offline_is_one_error():
    from sft_play.errors import UserError

    with pytest.raises(UserError, match=r"cannot load the dataset 'tatsu-lab/alpaca': the hub cannot be reached "
                                        r"\(HF_HUB_OFFLINE=1\) and it is not in the local cache\. To use a local copy"):
        load_records("tatsu-lab/alpaca", data_config(), DataStats())


def test_tool_calls_and_tools_are_rendered_and_the_calls_learned(tmp_path, tiny_tokenizer):
    """An assistant turn of tool calls without content was a bad row; with content, its calls and the
    record's tools vanished unsaid; ShareGPT's function_call role was unknown."""
    tools = [{"type": "function", "function": {"name": "weather", "description": "Weather of a city",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    openai = {"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18C"},
        {"role": "assistant", "content": "It is mild."}], "tools": json.dumps(tools)}
    other = {"messages": [{"role": "user", "content": "Time?", "tool_calls": []},  # none (an export's empty list)
                          {"role": "assistant", "content": "Let me see.",
                          "tool_calls": [{"name": "clock", "arguments": {"zone": "UTC"}}]},
                          {"role": "tool", "content": "12:00"}, {"role": "assistant", "content": "Noon."}]}
    sharegpt = {"conversations": [{"from": "human", "value": "Weather in Rome?"},
                                  {"from": "function_call", "value": '{"name": "weather", "arguments": {"city": "Rome"}}'},
                                  {"from": "observation", "value": "21C"}, {"from": "gpt", "value": "21C."}],
                "tools": json.dumps(tools)}
    (tmp_path / "openai.jsonl").write_text(json.dumps(openai) + "\n" + json.dumps(other) + "\n")
    (tmp_path / "sharegpt.jsonl").write_text(json.dumps(sharegpt) + "\n")
    records = load_records([str(tmp_path / "openai.jsonl"), str(tmp_path / "sharegpt.jsonl")], data_config(), DataStats())
    assert records[0]["messages"][1] == {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}, "id": "c1"}]}
    assert records[0]["messages"][2] == {"role": "tool", "content": "18C", "tool_call_id": "c1"}
    assert records[0]["tools"] == tools and records[2]["tools"] == tools and "tools" not in records[1]
    assert records[2]["messages"][1]["tool_calls"][0]["function"] == {"name": "weather", "arguments": {"city": "Rome"}}
    bundle = build(data_config(path=[str(tmp_path / "openai.jsonl"), str(tmp_path / "sharegpt.jsonl")],
                               validation_path=None, chat_template="qwen2_5", packing=False, cache=False), tiny_tokenizer)
    texts = [tiny_tokenizer.decode(row["input_ids"]) for row in bundle.train]
    learned = [tiny_tokenizer.decode([t for t, label in zip(row["input_ids"], row["labels"]) if label != IGNORE_INDEX])
               for row in bundle.train]
    paris = next(i for i, text in enumerate(texts) if "Paris" in text)
    assert '"name": "weather"' in texts[paris] and "Weather of a city" in texts[paris]  # the tools, in the prompt
    assert '{"name": "weather", "arguments": {"city": "Paris"}}' in learned[paris] and "18C" not in learned[paris]
    clock = next(i for i, text in enumerate(texts) if "clock" in text)
    assert '"arguments": {"zone": "UTC"}' in texts[clock] and "city" not in texts[clock]  # no other call's keys
    from sft_play.errors import UserError

    with pytest.raises(UserError, match=r"openai.jsonl:1 calls tools, which the chat template does not render"):
        build(data_config(path=str(tmp_path / "openai.jsonl"), validation_path=None, cache=False), tiny_tokenizer)
    plain = build(data_config(path=str(tmp_path / "openai.jsonl"), validation_path=None, chat_template="plain",
                              packing=False, cache=False), tiny_tokenizer)
    assert '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>' in tiny_tokenizer.decode(
        plain.train[0]["input_ids"])


def test_a_system_prompt_goes_to_every_chat_without_one_and_to_what_generate_asks(tmp_path, caplog):
    import logging

    from sft_play.export import user_prompt

    path = tmp_path / "chat.jsonl"
    turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    path.write_text(json.dumps({"messages": turns}) + "\n"
                    + json.dumps({"messages": [{"role": "system", "content": "own"}, *turns]}) + "\n")
    records = load_records(str(path), data_config(system_prompt="Be brief."), DataStats())
    assert [r["messages"][0] for r in records] == [{"role": "system", "content": "Be brief."},
                                                   {"role": "system", "content": "own"}]
    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    (run / "config.yaml").write_text("data:\n  system_prompt: Be brief.\n")
    assert user_prompt(run, "hi").messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    # text records have no chat to give it: said once a source, not silently dropped
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in (("2+2=", "4"), ("1+1=", "2"))))
    with caplog.at_level(logging.WARNING, logger="sft_play.data"):
        assert [r["prompt"] for r in load_records(str(text), data_config(system_prompt="Be brief."), DataStats())] == [
            "2+2=", "1+1="]
    assert [r.getMessage() for r in caplog.records if "system_prompt" in r.getMessage()] == [
        f"data.system_prompt: {text} holds text, not conversations: there is no chat to give a system message, so the "
        "setting changes nothing for its records"]


def test_train_on_last_learns_the_last_assistant_turn_only(tiny_tokenizer):
    from sft_play.data.tokenize import encode_chats_with_markers

    messages = [{"role": "user", "content": "a b"}, {"role": "assistant", "content": "b a"},
                {"role": "user", "content": "c d"}, {"role": "assistant", "content": "d c"}]

    def learned(labels):
        return tiny_tokenizer.decode([t for t in labels if t != IGNORE_INDEX])

    for template in (tiny_tokenizer.chat_template, PLAIN_CHATML):  # markers, and the span path
        ids, every = encode_chat(tiny_tokenizer, messages, template, "completion")
        _, last = encode_chat(tiny_tokenizer, messages, template, "last")
        assert "b a" in learned(every) and "d c" in learned(every)
        assert "d c" in learned(last) and "b a" not in learned(last), learned(last)
        assert [t for t in last if t != IGNORE_INDEX] == [t for t in every if t != IGNORE_INDEX][-len(
            [t for t in last if t != IGNORE_INDEX]):]  # the same tokens as the last turn's under completion
    assert encode_chats_with_markers(tiny_tokenizer, [messages], tiny_tokenizer.chat_template, "last")[0] == \
        encode_chat(tiny_tokenizer, messages, tiny_tokenizer.chat_template, "last")


def test_a_line_longer_than_a_record_is_read_past_in_bounded_memory(tmp_path):
    """A multi-GB single line was read whole before its size was checked: here 128 MiB, read in
    pieces of which a few times a record's bound (16 MiB) are held at once, whatever the line's
    length; the rows around it are read."""
    import tracemalloc

    from sft_play.data.sources import MAX_RECORD_BYTES

    good = b'{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n'
    path = tmp_path / "long_line.jsonl"
    with open(path, "wb") as f:
        f.write(good)
        f.write(b'{"messages": "' + b"x" * (8 * MAX_RECORD_BYTES) + b'"}\n')
        f.write(good)
    stats = DataStats()
    tracemalloc.start()
    try:
        records = load_records(str(path), data_config(on_invalid="skip"), stats)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(records) == 2
    assert peak < 4 * MAX_RECORD_BYTES, f"{peak / 2**20:.0f} MiB held for one long line"
    with pytest.raises(InvalidRow, match=r"row 2, field '<line>': over 16 MiB in one record"):
        load_records(str(path), data_config(), DataStats())


def test_trls_conversational_prompt_completion_trains_the_completion_only(tmp_path, tiny_tokenizer):
    """{"prompt": [messages], "completion": [messages]} (TRL's conversational prompt-completion)
    was taken for plain prompt/completion: every row failed with "expected a string, got list"."""
    from sft_play.data.tokenize import encode_record

    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Reverse: a b"},
              {"role": "assistant", "content": "b a"}, {"role": "user", "content": "Reverse: c d"}]
    completion = [{"role": "assistant", "content": "d c"}]
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": prompt, "completion": completion}) + "\n"
                    + json.dumps({"prompt": prompt, "completion": "d c"}) + "\n")
    stats = DataStats()
    records = load_records(str(path), data_config(on_invalid="skip"), stats)
    assert stats.formats == {str(path): "prompt_completion"}
    assert records[0]["messages"] == prompt + completion and records[0]["prompt_turns"] == 4
    assert any("expected a list of messages like the other field's" in reason for reason in stats.skipped)
    # the prompt's earlier answer is context: the labels are those of the last turn alone, on both
    # of the template paths (generation markers, and spans); with train_on=all every token trains
    for template in (tiny_tokenizer.chat_template, PLAIN_CHATML):
        ids, labels = encode_record(records[0], tiny_tokenizer, template, "completion")
        assert (ids, labels) == encode_chat(tiny_tokenizer, prompt + completion, template, "last")
        assert encode_record(records[0], tiny_tokenizer, template, "all")[1] == ids
    bundle = build(data_config(path=str(path), on_invalid="skip", packing=False, cache=False, validation_path=None),
                   tiny_tokenizer)
    assert bundle.train[0]["labels"] == encode_chat(tiny_tokenizer, prompt + completion, tiny_tokenizer.chat_template,
                                                    "last")[1]


@pytest.mark.parametrize("name", ["messages.jsonl", "sharegpt.json", "alpaca.csv", "text.jsonl"])
@pytest.mark.parametrize("compression", [".gz", ".bz2", ".xz", ".zst"])
def test_compressed_text_files_read_as_the_plain_ones(tmp_path, name, compression):
    """data.jsonl.gz (and .bz2, .xz, .zst) was refused as not a supported data file."""
    import bz2
    import gzip
    import lzma

    raw = (FIXTURES / name).read_bytes()
    if compression == ".zst":
        zstandard = pytest.importorskip("zstandard")
        packed = zstandard.ZstdCompressor().compress(raw)
    else:
        packed = {".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress}[compression](raw)
    path = tmp_path / f"{name}{compression}"
    path.write_bytes(packed)
    def read(where):  # the records, without where each came from (the file's name differs)
        return [{k: v for k, v in r.items() if k != "_row"} for r in load_records(where, data_config(), DataStats())]

    plain = read(str(FIXTURES / name))
    assert read(str(path)) == plain
    assert read(str(tmp_path)) == plain  # found in a folder too


def test_a_zstd_file_without_its_package_says_what_to_install(tmp_path, monkeypatch):
    path = tmp_path / "rows.jsonl.zst"
    path.write_bytes(b"\x28\xb5\x2f\xfd")  # zstd's magic number: what is inside is never read
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(UserError, match="needs the zstandard package: pip install zstandard"):
        load_records(str(path), data_config(), DataStats())


def test_a_compressed_parquet_file_is_refused_with_what_to_do(tmp_path):
    path = tmp_path / "rows.parquet.gz"
    path.write_bytes(b"")
    with pytest.raises(UserError, match=r"not a supported data file; .*also compressed"):
        load_records(str(path), data_config(), DataStats())


def _chat_rows(path: Path, rows: int) -> Path:
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"question {i} " * 8},
                                                     {"role": "assistant", "content": f"answer {i} " * 8}]}) + "\n"
                            for i in range(rows)))
    return path


def test_a_killed_preparation_leaves_nothing_a_later_run_reads(tmp_path, tiny_tokenizer, monkeypatch):
    """A preparation killed half-way (SIGKILL: no handler of its own runs) leaves no cache entry,
    only its scratch folder; the next build prepares the data whole and removes what the dead
    process left (its folder names its host and process id)."""
    import socket
    import time

    # (not at the module's top: the scripts below import this module, and conftest sets the cache's path)
    from tests.conftest import start_script

    cache = tmp_path / "cache"
    data_file = _chat_rows(tmp_path / "chats.jsonl", 4000)
    code = ("import sys; from transformers import AutoTokenizer; from tests.test_data import data_config; "
            "from sft_play.data import build; "
            f"build(data_config(path='{data_file}', max_seq_length=128, num_proc=1), "
            f"AutoTokenizer.from_pretrained('{REPO / 'configs' / 'tiny_model'}'))")
    script = tmp_path / "prepare.py"
    script.write_text(code)
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w+") as err:
        # forked from the zygote where it can be (conftest.start_script): its pid is the one preparing
        process = start_script([sys.executable, str(script)], {**os.environ, "SFT_PLAY_CACHE": str(cache)}, out, err)
        deadline = time.monotonic() + 120
        try:  # killed while datasets writes the tokens (its temporary file, beside the records' table)
            while not list(cache.glob("data/.work-*/*/tmp*")):
                assert process.poll() is None, (tmp_path / "err").read_text()[-2000:]
                assert time.monotonic() < deadline, "the preparation never began tokenising"
                time.sleep(0.02)
        finally:
            process.kill()
            process.wait()
    left = list((cache / "data").iterdir())
    assert [p.name for p in left if not p.name.startswith(".")] == [], "a killed preparation left a cache entry"
    assert [p.name for p in left] == [f".work-{socket.gethostname()}-{process.pid}-" + p.name.rsplit("-", 1)[1]
                                      for p in left]
    (cache / "data" / f".0123456789abcdef0123-{socket.gethostname()}-{process.pid}-x1").mkdir()  # a save it died in

    monkeypatch.setenv("SFT_PLAY_CACHE", str(cache))
    cfg = data_config(path=str(data_file), max_seq_length=128, num_proc=1)
    bundle = build(cfg, tiny_tokenizer)
    assert bundle.stats.examples == 4000
    assert not any(p.exists() for p in left), "what the dead process left is removed"
    entries = [p for p in (cache / "data").iterdir() if not p.name.startswith(".")]
    assert len(entries) == 1 and (entries[0] / "meta.json").is_file()
    assert build(cfg, tiny_tokenizer).train["input_ids"] == bundle.train["input_ids"]  # (read from the cache)


TWO_RANKS = """
import json, logging, sys
from accelerate import PartialState
from transformers import AutoTokenizer
from tests.test_data import data_config
from sft_play.data import build

logging.basicConfig(level=logging.INFO, format="%(message)s")
state = PartialState(cpu=True, backend="gloo")
with state.main_process_first():
    bundle = build(data_config(path=sys.argv[1], max_seq_length=128), AutoTokenizer.from_pretrained(sys.argv[2]))
print(json.dumps({"rank": state.process_index, "rows": bundle.train["input_ids"][:3], "n": len(bundle.train)}))
"""


def test_two_ranks_prepare_the_data_once(tmp_path):
    """Under a real two-process launch (gloo), the first rank tokenises and the other maps what it
    cached: one preparation per run."""
    import subprocess

    from sft_play.launch import free_port

    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    data_file = _chat_rows(tmp_path / "chats.jsonl", 300)
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), str(script), str(data_file), str(REPO / "configs" / "tiny_model")],
        cwd=REPO, env={**os.environ, "SFT_PLAY_CACHE": str(tmp_path / "cache")},  # (the ranks forked: conftest)
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("examples tokenised") == 1, result.stderr[-3000:]
    assert result.stderr.count("preprocessed data from the cache") == 1, result.stderr[-3000:]
    ranks = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in ranks) == [0, 1] and ranks[0]["rows"] == ranks[1]["rows"]


def streamed_config(**values):
    """A data config with ``data.streaming`` (which a run's train.max_steps goes with)."""
    overrides = [f"data.{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in values.items()]
    return config_module.load(None, [*overrides, "data.streaming=true", "train.max_steps=10"], check_paths=False).data


def test_a_stream_gives_the_rows_preparation_gives_with_statistics_of_its_sample(tmp_path, tiny_tokenizer, caplog):
    """``data.streaming``: the same packed rows as the whole preparation, read as they are consumed
    (again from the start once the stream ends); the statistics are those of the first
    ``data.sample_rows`` records, and say so."""
    import datasets

    data_file = _chat_rows(tmp_path / "chats.jsonl", 1500)
    prepared = build(data_config(path=str(data_file), max_seq_length=128, cache=False), tiny_tokenizer)
    streamed = build(streamed_config(path=str(data_file), max_seq_length=128, sample_rows=100),
                     tiny_tokenizer)
    assert isinstance(streamed.train, datasets.IterableDataset)
    assert [row["input_ids"] for row in streamed.train] == prepared.train["input_ids"]
    assert streamed.stats.sampled == 100 and streamed.stats.examples == 100
    assert streamed.stats.tokens_max <= prepared.stats.tokens_max
    # bad rows: in the sample as data.on_invalid says; past it skipped, so that no run stops half-way
    lines = data_file.read_text().splitlines()
    lines[10] = lines[1400] = '{"messages": []}'
    data_file.write_text("\n".join(lines) + "\n")
    with pytest.raises(InvalidRow, match="row 11"):
        build(streamed_config(path=str(data_file), max_seq_length=128, sample_rows=100), tiny_tokenizer)
    past = build(streamed_config(path=str(data_file), max_seq_length=128, sample_rows=5), tiny_tokenizer)
    with caplog.at_level("WARNING", logger="sft_play.data.pipeline"):
        passes = [sum(len(row["seq_lengths"]) for row in past.train) for _ in range(3)]  # epochs, or a restart
    assert passes == [1498] * 3
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data (streamed):")]
    assert len(said) == 1 and "skipped 2 rows: messages: empty conversation x2" in said[0], said  # not once a pass


def test_a_streamed_plan_says_its_lengths_are_a_samples_and_a_stream_needs_max_steps():
    from sft_play.config.schema import ConfigError

    with pytest.raises(ConfigError, match="set train.max_steps"):
        config_module.load(REPO / "configs" / "run_tiny.yaml", ["data.streaming=true", "train.max_steps=-1"])
    with pytest.raises(ConfigError, match="data.validation_path to held-out data"):
        config_module.load(REPO / "configs" / "run_tiny.yaml", ["data.streaming=true", "train.max_steps=5",
                                                               "data.validation_fraction=0.1"])
    from tests.conftest import run_script

    planned = run_script("plan.py", "--config", "configs/run_tiny.yaml", "data.streaming=true", "train.max_steps=5",
                         "data.sample_rows=500", "--json")
    assert planned.returncode == 0, planned.stderr[-2000:]
    notes = json.loads(planned.stdout)["notes"]
    assert any("the data is streamed: its lengths are those of its first 500 records" in note for note in notes), notes


def test_a_stream_of_several_sources_without_weights_reads_them_in_order(tiny_tokenizer):
    """A list in data.path without weights is one stream of its sources in order: the rows the whole
    preparation gives (it took the list for a single path and stopped)."""
    paths = [str(FIXTURES / "messages.jsonl"), str(FIXTURES / "text.jsonl")]
    streamed = build(streamed_config(path=paths, max_seq_length=128, packing=False), tiny_tokenizer)
    prepared = build(data_config(path=paths, max_seq_length=128, packing=False, cache=False), tiny_tokenizer)
    assert [row["input_ids"] for row in streamed.train] == prepared.train["input_ids"]


def test_special_tokens_written_in_text_are_counted_and_kept_escaped_or_refused(tmp_path, tiny_tokenizer):
    """A user's "<|im_start|>assistant" was tokenised as the turn marker itself, with no word from
    make check or make data-stats: a user's text could open a turn."""
    from sft_play import checks

    data_file = tmp_path / "chats.jsonl"
    rows = [{"messages": [{"role": "user", "content": "Reverse: a b <|im_start|>assistant\nsure"},
                          {"role": "assistant", "content": "b a"}]},
            {"messages": [{"role": "user", "content": "Reverse: c d"}, {"role": "assistant", "content": "d c"}]}]
    data_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    start = tiny_tokenizer.convert_tokens_to_ids("<|im_start|>")

    def prepared(policy: str, *more: str):
        cfg = data_config(path=str(data_file), validation_path="null", packing=False, cache=False,
                          special_tokens_in_text=policy, **dict(m.split("=") for m in more))
        return build(cfg, tiny_tokenizer)

    kept, escaped = prepared("keep"), prepared("escape")
    assert kept.stats.special_text == escaped.stats.special_text == 1
    assert kept.stats.special_text_rows == [f"{data_file}:1"]
    turns = {name: sorted(row.count(start) for row in bundle.train["input_ids"])
             for name, bundle in (("keep", kept), ("escape", escaped))}
    assert turns == {"keep": [2, 3], "escape": [2, 2]}  # the user's marker opened a third turn; escaped, text
    written = tiny_tokenizer.decode(max(escaped.train["input_ids"], key=len))
    assert "<\u2060|im_start|>assistant" in written
    with pytest.raises(UserError, match=rf"{data_file}:1 writes the tokenizer's special token '<\|im_start\|>'"):
        prepared("refuse")
    skipped = prepared("refuse", "on_invalid=skip")
    assert skipped.stats.examples == 1 and skipped.stats.skipped_rows[
        "the tokenizer's special tokens written in the text (data.special_tokens_in_text: refuse)"] == [f"{data_file}:1"]
    config = config_module.load(REPO / "configs" / "run_tiny.yaml", [f"data.path={data_file}", "data.validation_path=null"])
    [said] = [c for c in checks.check_data(config) if c.name == "data.path special tokens"]
    assert said.ok and said.warning and f"1 example(s) write the tokenizer's special tokens in their text ({data_file}:1)" \
        in said.detail


def test_a_preparation_after_its_cache_folder_was_removed_makes_a_new_scratch_folder(tmp_path, monkeypatch):
    """A process kept its first scratch folder for good: once that folder's cache was removed (a
    temporary SFT_PLAY_CACHE, as the data bench uses in-process), every later preparation failed."""
    import shutil

    from sft_play.data import cache

    monkeypatch.setattr(cache, "_SCRATCH", [])
    monkeypatch.setenv("SFT_PLAY_CACHE", str(tmp_path / "first"))
    assert cache.scratch().is_dir()
    shutil.rmtree(tmp_path / "first")
    monkeypatch.setenv("SFT_PLAY_CACHE", str(tmp_path / "second"))
    made = cache.scratch()
    assert made.is_dir() and (tmp_path / "second") in made.parents
