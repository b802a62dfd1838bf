"""The benchmarks' CPU paths run here so that they cannot rot; the reports say what they are."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path")
def test_planner_accuracy_cpu_path_writes_a_report(tmp_path):
    report = tmp_path / "planner_accuracy.md"
    result = subprocess.run([sys.executable, "bench/planner_accuracy.py", "--timing-runs", "1", "--output", str(report)],
                            cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    text = report.read_text()
    assert "No GPU figure exists in this report" in text
    rows = [line for line in text.splitlines() if line.startswith("| tiny_model")]
    assert len(rows) == 2 and all("%" in row for row in rows)
    assert "median absolute error" in text
    timing = text.split("## Planning time", 1)[1]
    assert "Failed" not in timing and "| CPU seconds |" in timing and "Allocator replays per plan" in timing


def test_workers_keep_the_callers_python_path(monkeypatch):
    sys.path.insert(0, str(REPO))
    from bench._common import worker_env

    monkeypatch.setenv("PYTHONPATH", "/opt/site-packages")
    entries = worker_env()["PYTHONPATH"].split(":")
    assert entries == ["/opt/site-packages", str(REPO)]  # packages installed there stay importable


def test_a_worker_that_fails_after_the_trainer_logged_is_a_failed_row(tmp_path):
    # On an H100 an out-of-memory try of the tuned baseline ended with the trainer's last log line,
    # a Python dict, which the bench read as its JSON report and crashed on
    sys.path.insert(0, str(REPO))
    from bench._common import run_worker

    worker = tmp_path / "worker.py"
    worker.write_text("import sys\nprint({'loss': 1.0, 'epoch': 0.1})\nsys.exit('torch.OutOfMemoryError: CUDA out of memory')\n")
    assert run_worker(worker, {}, timeout=60) == {"ok": False, "error": "out of memory"}
    worker.write_text("print({'loss': 1.0})\nprint('{\"ok\": true, \"tokens\": 3}')\n")
    assert run_worker(worker, {}, timeout=60) == {"ok": True, "tokens": 3}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path")
def test_throughput_cpu_path_compares_both_sides(tmp_path):
    report = tmp_path / "benchmarks.md"
    result = subprocess.run([sys.executable, "bench/throughput.py", "--steps", "2", "--warmup", "1", "--output",
                             str(report)], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    text = report.read_text()
    assert "These rows await a GPU" in text and "llama-3.1-8b-lora" in text
    rows = {side: next(line for line in text.splitlines() if line.startswith(f"| tiny-lora | {side} |"))
            for side in ("A", "T", "B")}
    assert not any("failed" in row for row in rows.values()), rows
    assert rows["T"].split("|")[3].strip() == "8"  # the tuned baseline's micro-batch (searched on a GPU)
    ratio = rows["B"].split("|")[8].strip()
    assert ratio.endswith("x") and float(ratio[:-1]) > 0  # B over the best tuned baseline


def test_tiny_default_bench_trains_scores_and_reports(tmp_path):
    """A smoke run of bench/tiny_default.py on the path a CPU without native bf16 takes."""
    report = tmp_path / "tiny_default.md"
    result = subprocess.run([sys.executable, "bench/tiny_default.py", "--seeds", "3", "--paths", "without-bf16",
                             "--steps", "3", "--count", "6", "--out", str(report)],
                            cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    text = report.read_text()
    assert "- hardware: " in text and "(no GPU)" in text
    rows = [line for line in text.splitlines() if line.startswith("| 3 | without-bf16 |")]
    assert len(rows) == 1, text
    assert "| no |" in rows[0], "capped at AVX2, auto resolves to fp32"
    assert "in 3 |" in rows[0] and " of 6 |" in rows[0]
