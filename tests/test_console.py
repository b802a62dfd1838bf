"""The ``sft-play`` command (pyproject's console entry, sft_play/console.py): each make target's
script as a subcommand, run as Python runs the file, with the arguments its target passes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from sft_play.console import COMMANDS
from tests.conftest import REPO, run_script

ENTRY = Path(sys.executable).parent / "sft-play"  # what make install puts beside the interpreter


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(ENTRY), *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_every_script_a_make_target_calls_is_a_command_with_the_targets_arguments():
    makefile = (REPO / "Makefile").read_text()
    assert set(re.findall(r"scripts/(\w+\.py)", makefile)) <= {script for script, _, _ in COMMANDS.values()}
    assert all((REPO / "scripts" / script).is_file() for script, _, _ in COMMANDS.values())
    recipes = dict(re.findall(r"^([a-z-]+): \$\(STAMP\).*\n\t(.*)$", makefile, flags=re.M))
    for target in ("train-tb", "train-distributed", "train-deepspeed"):
        script, preset, _ = COMMANDS[target]
        recipe = recipes[target].replace("$(ACCELERATE_CONFIG)", str(REPO / "configs" / "accelerate" / "ddp.yaml"))
        assert f"scripts/{script} {' '.join(preset)} " in recipe, recipe


def test_help_lists_every_command_and_a_wrong_one_is_one_line():
    listed = _run("--help")
    assert listed.returncode == 0 and all(f"  {name} " in listed.stdout for name in COMMANDS)
    wrong = _run("plann", "--config", "configs/run_tiny.yaml")
    assert wrong.returncode == 2 and wrong.stderr.strip().splitlines() == [
        "error: sft-play has no command 'plann'; did you mean 'plan'? (sft-play --help lists them)"]


def test_a_command_says_what_its_script_says_and_its_errors_are_one_line():
    by_entry = _run("gpu-info", "--json")
    by_script = run_script("gpu_info.py", "--json", timeout=120)
    assert by_entry.returncode == by_script.returncode == 0
    entry, script = json.loads(by_entry.stdout), json.loads(by_script.stdout)
    assert entry.pop("ram_available_bytes") > 0 and script.pop("ram_available_bytes") > 0  # (moves meanwhile)
    assert entry == script
    refused = _run("check", "--config", "configs/run_tiny.yaml", "train.learning_rat=1")
    assert refused.returncode == 1 and "[FAIL] config" in refused.stdout and "Traceback" not in refused.stderr
