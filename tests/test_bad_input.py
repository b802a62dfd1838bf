"""Everything a newcomer can type wrong ends with one clear message and exit status 2, never a
Python traceback. Each row runs the real script (in this process, as ``python scripts/X.py``
would: ``cli.run`` is what turns errors into messages) and checks the message names the problem.
"""

from __future__ import annotations

import runpy
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("bad")
    (folder / "qa.csv").write_text("question,answer\nWhat is 2+2?,4\nCapital of France?,Paris\n")
    rows = ['{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}'] * 10
    rows[4] = '{"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}'  # row 5: no content
    rows[8] = '{"messages": [{"role": "robot", "content": "a"}, {"role": "assistant", "content": "b"}]}'  # row 9
    (folder / "two_bad_rows.jsonl").write_text("\n".join(rows) + "\n")
    config_only = folder / "config_only"
    config_only.mkdir()
    shutil.copy(FIXTURES / "model_configs" / "qwen2.5-0.5b" / "config.json", config_only)
    (folder / "random.yaml").write_bytes(bytes(range(256)) * 12)  # 3 KB that are not text
    (folder / "tab.yaml").write_text("train:\n\tmax_steps: 3\n")
    bomb = 'a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n'
    for level, previous in zip("bcdefghi", "abcdefgh"):  # 480 bytes that expand to 9^9 strings
        bomb += f"{level}: &{level} [{', '.join(['*' + previous] * 9)}]\n"
    (folder / "bomb.yaml").write_text(bomb + "train:\n  report_to: *i\n")
    (folder / "huge.yaml").write_text("# " + "x" * (2 << 20) + "\n")
    good = rows[0]
    (folder / "deep.jsonl").write_text(good + "\n" + "[" * 100_000 + "]" * 100_000 + "\n" + good + "\n")
    big = '{"messages": [{"role": "user", "content": "' + "a " * (9 << 20) + '"}]}'  # 18 MiB in one line
    (folder / "big_row.jsonl").write_text(good + "\n" + big + "\n")
    return {"csv": folder / "qa.csv", "rows": folder / "two_bad_rows.jsonl", "config_only": config_only,
            "random": folder / "random.yaml", "tab": folder / "tab.yaml", "bomb": folder / "bomb.yaml",
            "huge": folder / "huge.yaml", "deep": folder / "deep.jsonl", "big_row": folder / "big_row.jsonl",
            "folder": folder}


# (script, arguments, what the message must say)
CASES = [
    ("data_stats.py", ["data.path={csv}", "data.validation_path=null"],
     "cannot tell the data format from the columns ['answer', 'question']"),
    ("data_stats.py", ["data.path={rows}", "data.validation_path=null"],
     "2 bad row(s) in the data"),
    ("train_distributed.py", ["train.micro_batch_size=0"], "train.micro_batch_size: got 0"),
    ("train_distributed.py", ["train.gradient_accumulation_steps=-1"], "train.gradient_accumulation_steps: got -1"),
    ("plan.py", ["--gpus", "-2", "--vram-gib", "80"], "the number of GPUs must be at least 1 (got -2)"),
    ("plan.py", ["--gpus", "0", "--vram-gib", "80"], "the number of GPUs must be at least 1 (got 0)"),
    ("plan.py", ["--gpus", "1", "--vram-gib", "-5"], "the GPU memory must be positive (got -5 GiB)"),
    ("plan.py", ["--gpus", "1", "--vram-gib", "abc"], "VRAM_GIB=abc is not a number"),
    ("plan.py", ["--gpus", "1.5", "--vram-gib", "80"], "NUM_GPUS=1.5 is not a whole number"),
    # PLOT= checked before planning: a traceback from matplotlib or mkdir after it lost the plan
    ("plan.py", ["--no-data", "--plot", "{folder}/plan.txt"], "the picture's name must end in one of .avif, .eps"),
    ("plan.py", ["--no-data", "--plot", "{csv}/plan.png"], "qa.csv is a file, not a folder"),
    ("plan.py", ["--no-data", "--plot", "{folder}"], "is a folder: name the image file to write in it"),
    ("plan.py", ["model.name_or_path=nobody-here/no-such-model", "--gpus", "1", "--vram-gib", "24"],
     "cannot load the model 'nobody-here/no-such-model': the hub cannot be reached"),
    ("train_distributed.py", ["distributed.strategy=deepspeed_zero2"], "use make train-deepspeed"),
    ("data_stats.py", ["model.name_or_path={config_only}"], "cannot encode text"),
    ("data_stats.py", ["data.columns=question"], "data.columns.prompt=question"),
    ("train_distributed.py", ["train.learning_rat=1"], "did you mean 'train.learning_rate'"),
    ("train_distributed.py", ["train.learning_rate=inf"], "train.learning_rate: got 'inf'; must be a finite number"),
    ("train_distributed.py", ["train.learning_rate=nan"], "train.learning_rate: got 'nan'; must be a finite number"),
    ("train_distributed.py", ["train.num_epochs=inf"], "train.num_epochs: got 'inf'; must be a finite number"),
    ("train_distributed.py", ["train.seed=-1"], "train.seed: got -1; must be greater than or equal to 0"),
    ("train_distributed.py", ["train.seed=4294967296"], "train.seed: got 4294967296; must be less than or equal to"),
    *[("train_distributed.py", [f"train.run_name={name}"], f"train.run_name: got {name!r}; a run is one folder")
      for name in ("..", "../../x", "/tmp/elsewhere", "-rf", "a/b/c", ".hidden")],
    ("data_stats.py", ["data.path={deep}", "data.validation_path=null"], "row 2, field '<line>': nested deeper than 32"),
    ("data_stats.py", ["data.path={big_row}", "data.validation_path=null"], "over 16 MiB in one record, more than a record may hold"),
    ("train_distributed.py", ["data.max_seq_length=1000000000"],
     "data.max_seq_length=1,000,000,000 is beyond the 512 positions configs/tiny_model was trained on"),
    ("data_stats.py", ["data.max_seq_length=1024"], "or set data.beyond_model_positions=true where that is meant"),
    ("train_distributed.py", ["--config", "{random}"], "is not UTF-8 text"),
    ("train_distributed.py", ["--config", "{tab}"], "YAML indents with spaces, not tabs"),
    ("train_distributed.py", ["--config", "{bomb}"], "expands to more than 100,000 values"),
    ("train_distributed.py", ["--config", "{huge}"], "a run config is a few KB of YAML"),
    ("train_distributed.py", ["train.report_to=[" + "x" * 100_000 + "]"], "xxx...xxx"),  # a long value, quoted short
]


def run_in_process(script: str, argv: list[str], monkeypatch) -> int:
    """`python scripts/SCRIPT ARGV` in this process, from the repo (cli.run turns errors into
    messages there); its exit status."""
    monkeypatch.setattr(sys, "argv", [script, *argv])
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(REPO / "scripts" / script), run_name="__main__")
    return exit_info.value.code


@pytest.mark.parametrize("script, arguments, expected", CASES, ids=[f"{c[0]}:{c[1][0][:40]}" for c in CASES])
def test_bad_input_gets_one_message_and_exit_2(script, arguments, expected, bad_files, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("RANK", raising=False)
    argv = [a.format(**bad_files) for a in arguments]
    status = run_in_process(script, ["--config", str(REPO / "configs" / "run_tiny.yaml"), *argv], monkeypatch)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert expected in err, err[-2000:]
    assert status == 2
    assert len(err) < 4000  # one message, not the input echoed back


@pytest.mark.parametrize("script, arguments", [("plan.py", ["--gpus", "abc"]), ("launch.py", ["--num-gpus", "abc"])])
def test_a_bad_make_variable_is_one_line_naming_it(script, arguments, monkeypatch, capsys):
    status = run_in_process(script, arguments, monkeypatch)
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and "NUM_GPUS=abc is not a whole number" in err


def test_a_picture_that_cannot_be_written_is_said_beside_the_plan(monkeypatch, capsys):
    target = "/proc/sft-play-plan.png"  # a folder where no one, root neither, makes a file
    status = run_in_process("plan.py", ["--config", str(REPO / "configs" / "run_tiny.yaml"), "--no-data",
                                        "--plot", target], monkeypatch)
    out = capsys.readouterr().out
    assert status == 0 and "Plan " in out and f"the picture could not be written to {target}" in out


def test_a_refused_config_leaves_no_run_folder(tmp_path, monkeypatch, capsys):
    run_in_process("train_distributed.py", ["--config", str(REPO / "configs" / "run_tiny.yaml"),
                                            f"train.output_dir={tmp_path}", "train.seed=-1"], monkeypatch)
    assert list(tmp_path.iterdir()) == []


def test_every_bad_row_is_named(bad_files, monkeypatch, capsys):
    run_in_process("data_stats.py", ["--config", str(REPO / "configs" / "run_tiny.yaml"),
                                     f"data.path={bad_files['rows']}", "data.validation_path=null"], monkeypatch)
    err = capsys.readouterr().err
    assert "row 5, field 'messages[0].content': missing" in err and "row 9, field 'messages[0].role'" in err


def test_a_model_type_transformers_does_not_know_is_one_clear_error(tmp_path):
    """make plan, check and train printed transformers' traceback (plan.py exiting 1)."""
    from sft_play import architecture
    from sft_play.errors import UserError

    (tmp_path / "config.json").write_text('{"model_type": "llamazzz", "hidden_size": 64}')
    with pytest.raises(UserError, match="cannot read the model config of .*`llamazzz`.*a newer model may need"):
        architecture.load_model_config(str(tmp_path))
