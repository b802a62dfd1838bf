"""The Makefile front door: every target is documented, and the targets themselves work here."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def make(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ))


def phony_targets() -> list[str]:
    text = (REPO / "Makefile").read_text().replace("\\\n", " ")  # join continued lines
    names = []
    for line in text.splitlines():
        if line.startswith(".PHONY:"):
            names += line.split(":", 1)[1].split()
    return names


def test_help_lists_every_target_with_a_description():
    result = make("help")
    assert result.returncode == 0, result.stderr
    listed = dict(re.findall(r"^\s+(?:\x1b\[\d+m)?([a-z-]+)(?:\x1b\[0m)?\s+(\S.*)$", result.stdout, re.M))
    for target in phony_targets():
        assert target in listed, f"make help does not list '{target}'"
        assert len(listed[target]) > 10


def recipes() -> dict[str, list[str]]:
    """Each target's recipe lines (continuations joined)."""
    text = (REPO / "Makefile").read_text().replace("\\\n", " ")
    found: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        match = re.match(r"^([A-Za-z_$(). /-]+):", line)
        if match and not line.startswith("\t"):
            current = match.group(1).strip()
            found.setdefault(current, [])
        elif line.startswith("\t") and current is not None:
            found[current].append(line.strip())
    return found


def test_makefile_targets_are_one_liners_calling_scripts():
    found = recipes()
    own = {"help", "install", "clean"}  # make's own housekeeping
    for target in phony_targets():
        if target in own:
            continue
        lines = found.get(target, [])
        assert len(lines) <= 1, f"{target}: {len(lines)} recipe lines"
        if lines:
            assert re.match(r"^\$\(PY\) ((scripts|bench)/\w+\.py|-m pytest)( |$)", lines[0]), f"{target}: {lines[0]}"
    assert not any("-c " in line for lines in found.values() for line in lines), "no Python one-liners in make"


def test_make_gpu_info_runs_here():
    result = make("gpu-info")
    assert result.returncode == 0, result.stderr
    assert "CPU:" in result.stdout


def test_make_check_passes_on_the_embedded_default():
    result = make("check")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[PASS] config" in result.stdout and "[PASS] data.path: 6000 records (messages)" in result.stdout
    assert "0 failed" in result.stdout


def test_make_check_fails_with_a_list_on_a_bad_config():
    result = make("check", "ARGS=train.learning_rat=1 data.path=missing.jsonl")
    assert result.returncode != 0
    assert "[FAIL] config" in result.stdout and "train.learning_rate" in result.stdout


@pytest.mark.slow
def test_make_train_tb_prints_the_url_and_stops_tensorboard(tmp_path):
    from sft_play.launch import port_is_free

    result = make("train-tb", f"ARGS=train.max_steps=2 train.output_dir={tmp_path} train.run_name=tb")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    match = re.search(r"TensorBoard: http://127\.0\.0\.1:(\d+)/", result.stdout)
    assert match, result.stdout
    assert port_is_free(int(match.group(1))), "TensorBoard must stop when training ends"
    assert list((tmp_path / "tb" / "tensorboard").glob("events.out.tfevents.*"))
