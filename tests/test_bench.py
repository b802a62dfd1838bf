"""The benchmarks' CPU paths run here so that they cannot rot; the reports say what they are."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

from tests.conftest import run_script, run_scripts_together

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture
def forked(monkeypatch):
    """The processes the benches start (``_common.run_python``) forked from the tests' zygote
    (conftest.run_script): the same script, arguments and environment, from the repository root
    (the tests' paths are absolute), without a fresh interpreter's imports of torch and
    transformers (most of a small run's CPU here)."""
    sys.path.insert(0, str(REPO / "bench"))

    def run_python(args, env=None, timeout=None, cwd=None):
        script, *rest = map(str, args)
        return run_script(script, *rest, timeout=int(timeout or 600), env=env or {})

    for name in ("_common", "tiny_default", "tiny_recipes", "tiny_vlm", "planner_accuracy", "preference"):
        monkeypatch.setattr(importlib.import_module(name), "run_python", run_python)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path")
def test_the_planner_accuracy_cpu_path_reports_predicted_against_measured_per_row(forked, monkeypatch, tmp_path):
    """bench/planner_accuracy.py as `make bench-planner` runs it without a GPU: the tiny shape at
    each micro-batch of its grid predicted here and measured by a worker, and planning timed."""
    import planner_accuracy

    # lean() would hide bitsandbytes from this process, and from the tests after this one
    monkeypatch.setattr(planner_accuracy, "lean", lambda method=None: None)
    report = tmp_path / "planner_accuracy.md"
    monkeypatch.setattr(sys, "argv", ["planner_accuracy.py", "--timing-runs", "1", "--output", str(report)])
    assert planner_accuracy.main() == 0
    text = report.read_text()
    assert "No GPU figure exists in this report" in text
    rows = [line for line in text.splitlines() if line.startswith("| tiny_model")]
    assert len(rows) == 2 and all("%" in row for row in rows)  # each measured row has its error
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


def test_the_default_bench_reports_a_runs_precision_answers_and_margin(tiny_lora_run):
    """bench/tiny_default.py's row for a finished run (the shared one; the bench's training command
    runs in the vision bench's test): the precision the run's start-up line names, its steps,
    make generate's five and the held-out puzzles answered greedily, and the five's smallest margin."""
    sys.path.insert(0, str(REPO / "bench"))
    import tiny_default

    folder, finished = tiny_lora_run
    row = tiny_default.trained(finished, folder, 42, "auto", wall=0.0)
    row.update(tiny_default.score(row["run"], 6))
    text = tiny_default.report([row])
    assert "- hardware: " in text and "(no GPU)" in text
    rows = [[cell.strip() for cell in line.split("|")] for line in text.splitlines()
            if line.startswith("| 42 | auto |")]
    assert len(rows) == 1, text
    cells = rows[0]
    assert cells[3] == json.loads((folder / "run.json").read_text())["precision"]["mixed"]  # what it trained in
    steps = json.loads((folder / "summary.json").read_text())["global_step"]
    assert cells[6].endswith(f" in {steps}") and cells[9].endswith(" of 6")
    # the five's smallest margin is above 0 exactly when greedy decoding writes all five answers
    assert (cells[7] == "5/5") == (float(cells[8]) > 0), cells


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path")
def test_the_one_lease_command_keeps_every_row_and_a_second_call_goes_on(forked, monkeypatch, tmp_path):
    import collections

    import lease

    monkeypatch.setattr(lease, "lean", lambda method=None: None)  # as in the planner accuracy test
    state, report = tmp_path / "rows.jsonl", tmp_path / "lease.md"

    def call(*more: str) -> int:  # `make bench-gpu ARGS=...`, each task a worker of its own
        monkeypatch.setattr(sys, "argv", ["lease.py", "--state", str(state), "--output", str(report), *more])
        return lease.main()

    assert call("--max-tasks", "2") == 0
    text = report.read_text()
    assert "No GPU figure exists in this report" in text and "- device: CPU" in text
    assert ("These rows await a GPU: P llama-3.1-8b lora +dropout0 32768 ckpt on micro 1, P llama-3.1-8b lora "
            "+dropout0 +tiled 32768 ckpt on micro 1, ") in text
    assert "| tiny-lora | B |" in text and "| tiny-lora | T |" in text
    assert "6 task(s) left for the next call" in text and "P tiny_model" in text  # said, not lost
    assert call() == 0
    rows = [json.loads(line) for line in state.read_text().splitlines()]
    results = collections.Counter(row["task"] for row in rows if row["kind"] in {"A", "B", "T", "P"})
    assert sorted(results) == ["A tiny-lora", "B tiny-lora", "P tiny-qwen2.5-vl lora 12,544 px 80 ckpt on micro 2",
                               "P tiny_model lora +dropout0 +tiled 128 ckpt on micro 1",
                               "P tiny_model lora 128 ckpt off micro 4", "P tiny_model lora dpo 128 ckpt on micro 2",
                               "P tiny_model lora kto 128 ckpt on micro 2", "T tiny-lora"]
    assert set(results.values()) == {1}, "the second call went on; it did not measure again"
    assert all(row["result"].get("ok", True) for row in rows if row["kind"] in {"A", "B", "T", "P"}), rows
    assert [row["kind"] for row in rows].count("call") == 2 and any(row["kind"] == "T-try" for row in rows)
    text = report.read_text()
    assert "Nothing: every task of both phases has its row." in text
    assert "| tiny-lora | A |" in text and "| B over T |" in text
    sides = {side: next(line for line in text.splitlines() if line.startswith(f"| tiny-lora | {side} |")).split("|")
             for side in ("A", "T", "B")}
    assert sides["A"][3].strip() == "4 x 1" and sides["T"][3].strip() == "8 x 1"  # TRL's default; T's one try
    ratio = sides["B"][8].strip()
    assert ratio.endswith("x") and float(ratio[:-1]) > 0  # B over the tuned baseline
    assert all(float(side[7]) > 0 for side in sides.values())  # each side's loss of its last steps
    shape = next(line for line in text.splitlines() if line.startswith("| tiny_model lora 128"))
    assert "%" in shape, shape  # predicted against measured
    # every kind of P the GPU plan has trained its steps here: each one timed after its first
    shapes = {row["task"]: row["result"]["measured"] for row in rows if row["kind"] == "P"}
    assert all(len(measured["step_seconds"]) == 1 for key, measured in shapes.items() if "micro 4" not in key), shapes
    timing = next(line for line in text.splitlines() if line.startswith("| B tiny-lora |"))
    assert "n/a (no GPU to time)" in timing
    # rows of another device are not mixed into this one's: the command says so and exits, no traceback
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"kind": "call", "device": "NVIDIA H100 80GB HBM3", "on_cuda": True}) + "\n")
    refused = run_script("bench/lease.py", "--state", str(other), "--output", str(report))
    assert refused.returncode == 2 and "measured on NVIDIA H100 80GB HBM3" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_a_task_cut_by_a_leases_end_runs_again_and_a_failed_one_does_not(tmp_path):
    sys.path.insert(0, str(REPO / "bench"))
    import lease
    import shapes

    tasks = [{"key": "B x"}, {"key": "T x"}, {"key": "P y"}]
    rows = [{"task": "B x", "kind": "B", "result": {"ok": False, "error": "out of memory"}},
            {"task": "T x", "kind": "T-try", "result": {"micro_batch": 4}}, {"task": "T x", "kind": "cut"}]
    assert [task["key"] for task in lease.pending(tasks, rows)] == ["T x", "P y"]
    # on a GPU, a T that ran the setup the bench no longer runs (BFD padding-free on SDPA) runs again
    gpu = [{"kind": "call", "on_cuda": True}, {"task": "B x", "kind": "B", "result": {"micro_batch": 8}},
           {"task": "T x", "kind": "T", "result": {"micro_batch": 4}}, {"task": "P y", "kind": "P", "result": {}}]
    assert [task["key"] for task in lease.pending(tasks, gpu)] == ["T x"]
    gpu[2]["result"]["setup"] = "wrapped rows, SDPA"
    assert lease.pending(tasks, gpu) == []
    path = tmp_path / "rows.jsonl"
    lease.append_row(path, rows[0])
    path.write_text(path.read_text() + '{"task": "T x", "ki')  # the lease ended mid-line
    assert [row["task"] for row in lease.read_rows(path)] == ["B x"]
    shape = shapes.Shape.parse("gemma-2-9b,method=lora,seq=4096,ckpt=off,micro=3,layers=12")
    assert (shape.model, shape.seq_len, shape.checkpointing, shape.micro, shape.layers) == ("gemma-2-9b", 4096, False,
                                                                                             3, 12)
    with pytest.raises(ValueError, match="neither a folder"):
        shapes.Shape.parse("no-such-model")
    with pytest.raises(ValueError, match="batch=4"):
        shapes.Shape.parse("gemma-2-9b,batch=4")
    shape = shapes.Shape.parse("llama-3.1-8b,seq=65536,micro=1,steps=2,dropout0,offload")
    assert shape.levers == ("dropout0", "offload") and shape.steps == 2
    assert shape.label == "llama-3.1-8b lora +dropout0 +offload 65536 ckpt on micro 1"
    with pytest.raises(ValueError, match="objective must be sft, dpo or kto"):
        shapes.Shape.parse("llama-3.1-8b,objective=orpo")
    assert shapes.Shape.parse("llama-3.1-8b,objective=kto").label == "llama-3.1-8b lora kto 2048 ckpt on micro 2"
    plan = lease.gpu_plan()  # first the long rows' working set, then the allocator on the GPU's own order
    assert [task["kind"] for task in plan[:7]] == ["P"] * 6 + ["S"]
    snapshot = plan[6]
    assert snapshot["kind"] == "S" and snapshot["shape"]["model"] == "gemma-2-9b" and snapshot["shape"]["layers"] == 12
    assert json.loads((Path(shapes.model_folder(snapshot)) / "config.json").read_text())["num_hidden_layers"] == 12
    cut = shapes.cut_layers(REPO / "tests" / "fixtures" / "model_configs" / "qwen3-30b-a3b", 6)
    config = json.loads((cut / "config.json").read_text())
    assert config["num_hidden_layers"] == 6 and all(len(v) == 6 for v in config.values() if isinstance(v, list)
                                                    and len(v) > 1)


def test_the_dry_run_plans_each_kind_of_gpu_task_as_the_lent_gpu_will_run_it():
    """The rehearsal before a lease: a long row with and without a lever, an image a row, DPO
    pairs, KTO answers and SFT-Play's planned side, each planned for the lent GPU within its 3
    minutes; a task the planner refuses is said in its row, not met on the GPU."""
    sys.path.insert(0, str(REPO / "bench"))
    import lease
    import shapes

    plan = {task["key"]: task for task in lease.gpu_plan()}
    picked = [shapes.shape_task(shape, 1) for shape in (lease.LONG_ROWS[3], lease.LONG_ROWS[5], lease.PICTURES[0],
                                                        *lease.PAIRS)]
    picked += [plan["B llama-3.1-8b-lora"], shapes.shape_task(shapes.Shape("llama-3.1-8b", seq_len=0), 1)]
    assert all(task["key"] in plan for task in picked[:5])
    lines = lease.dry_run(picked, "h100", 8.0)
    rows = [line.split(" | ") for line in lines if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 7
    *planned, refused = rows
    peaks = [float(row[3]) for row in planned]
    assert all(0 < peak < 80 for peak in peaks)  # each fits the H100 it is planned for
    assert peaks[1] < peaks[0]  # offloaded hidden states: less on the GPU than the plain 64k row
    assert all(float(row[4]) > 0 and int(row[5]) <= lease.TASK_SECONDS for row in planned), planned
    assert "cannot be planned" in refused[3]


def test_the_tuned_search_doubles_until_memory_runs_out_in_any_form_and_keeps_the_best(monkeypatch):
    sys.path.insert(0, str(REPO / "bench"))
    import throughput

    seen = []

    def fake_baseline(case, steps, warmup, output_dir, tuned="", micro=4):
        seen.append(micro)
        if micro >= 32:  # cuBLAS runs out as a RuntimeError, not torch.OutOfMemoryError
            raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
        return {"tokens_per_second": {4: 100.0, 8: 180.0, 16: 175.0}[micro], "micro_batch": micro}  # within 5 %

    monkeypatch.setattr(throughput, "run_baseline", fake_baseline)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 0)
    case = throughput.CPU_CASES[0]
    result = throughput.run_tuned_search(case, 2, 1, "/tmp/unused", start=4)
    assert seen == [4, 8, 16, 32] and result["micro_batch"] == 8 and result["tokens_per_second"] == 180.0
    assert result["tries"][-1]["error"] == "out of memory"
    seen.clear()  # the start does not fit: halving to the first that does
    result = throughput.run_tuned_search(case, 2, 1, "/tmp/unused", start=64)
    assert seen == [64, 32, 16] and result["micro_batch"] == 16
    seen.clear()  # another error after a good try ends the search with what it has, said in the tries

    def broken(case, steps, warmup, output_dir, tuned="", micro=4):
        seen.append(micro)
        if micro > 4:
            raise ValueError("a bug")
        return {"tokens_per_second": 50.0, "micro_batch": micro}

    monkeypatch.setattr(throughput, "run_baseline", broken)
    result = throughput.run_tuned_search(case, 2, 1, "/tmp/unused", start=4)
    assert seen == [4, 8] and result["micro_batch"] == 4 and result["tries"][1]["error"] == "ValueError: a bug"
    seen.clear()  # a deadline the last try's pace cannot meet starts no further try
    monkeypatch.setattr(throughput, "run_baseline", fake_baseline)
    import time

    result = throughput.run_tuned_search(case, 2, 1, "/tmp/unused", start=4, deadline=time.time() - 1)
    assert seen == [4] and result["stopped"] == "deadline" and result["micro_batch"] == 4
    seen.clear()  # a try more than 5 % slower than the best before it ends the doubling (seen on an H200)

    def slowing(case, steps, warmup, output_dir, tuned="", micro=4):
        seen.append(micro)
        return {"tokens_per_second": {4: 100.0, 8: 180.0, 16: 120.0}.get(micro, 500.0), "micro_batch": micro}

    monkeypatch.setattr(throughput, "run_baseline", slowing)
    result = throughput.run_tuned_search(case, 2, 1, "/tmp/unused", start=4)
    assert seen == [4, 8, 16] and result["stopped"] == "slower" and result["micro_batch"] == 8


def test_a_gpu_report_renders_mfu_time_and_the_planners_error_from_its_rows(tmp_path):
    sys.path.insert(0, str(REPO / "bench"))
    import lease

    gib = 1024**3
    rows = [
        {"kind": "call", "call": "1", "device": "NVIDIA H100 80GB HBM3", "on_cuda": True, "versions": "v",
         "command": "make bench-gpu"},
        {"task": "B qwen2.5-0.5b-full", "kind": "B", "result": {
            "tokens_per_second": 60000.0, "micro_batch": 16, "accumulation": 2, "peak_bytes": 50 * gib,
            "last_loss": 9.5, "predicted_peak": 55 * gib, "reserved_bytes": 54 * gib, "predicted_step_seconds": 1.1,
            "measured_step_seconds": 1.0}},
        {"task": "T qwen2.5-0.5b-full", "kind": "T-try", "result": {"ok": False, "micro_batch": 32,
                                                                    "error": "out of memory"}},
        {"task": "T qwen2.5-0.5b-full", "kind": "T", "result": {
            "tokens_per_second": 40000.0, "micro_batch": 16, "peak_bytes": 60 * gib, "last_loss": 9.6,
            "setup": "wrapped rows, SDPA"}},
        {"task": "B llama-3.2-3b-full", "kind": "B", "result": {"tokens_per_second": 9000.0, "micro_batch": 8}},
        {"task": "T llama-3.2-3b-full", "kind": "T", "result": {"tokens_per_second": 1000.0, "micro_batch": 4}},
        {"task": "P llama-3.2-3b full 2048 ckpt on micro 4", "kind": "P", "result": {
            "ok": True, "predicted": {"peak_bytes": 51 * gib, "allocated_bytes": 48 * gib, "seconds_per_step": 1.25},
            "measured": {"ok": True, "peak_bytes": 50 * gib, "allocated_bytes": 47 * gib,
                         "step_seconds": [1.0, 1.5, 1.1]}}},
        {"task": "B llama-3.1-8b-lora", "kind": "B", "result": {"ok": False, "error": "out of memory",
                                                                  "predicted_peak": 70 * gib}},
        {"task": "S gemma-2-9b (12 layers) lora 2048 ckpt on micro 8", "kind": "S", "result": {
            "verdict": "9 events; peak reserved: ...\nthe simulation reserves what the GPU reserved", "trace": "g.json.gz",
            "order": ["replace at GPU event 7 / planned event 7:", "  GPU     a 2,048.0 MiB softmax"]}},
    ]
    text = lease.render(rows, tmp_path / "rows.jsonl")
    assert "could not be rendered" not in text and "No GPU figure" not in text
    b = next(line for line in text.splitlines() if line.startswith("| qwen2.5-0.5b-full | B |")).split("|")
    assert b[3].strip() == "16 x 2" and b[6].strip().endswith("%") and b[8].strip() == "1.50x"
    assert "| qwen2.5-0.5b-full | T | 16 x 1 (wrapped rows, SDPA) |" in text
    # a T row from before the bench said its setup ran BFD padding-free on SDPA: no B-over-T claim from it
    assert "| llama-3.2-3b-full | B | 8 x 1 |" in text and "not compared: T ran BFD padding-free on SDPA |" in text
    assert "are no baseline" in text
    assert "- T qwen2.5-0.5b-full: 32: out of memory" in text  # a failed try trained nothing: no setup to blame
    # the H200 lease's rows: their T ran the old setup, and the report counts them as left to measure
    rows = lease.read_rows(REPO / "docs" / "reports" / "gpu_lease.jsonl")
    left = lease.render(rows, tmp_path / "rows.jsonl").split("## Not measured yet")[1]
    assert "T qwen2.5-0.5b-full, " in left and "T llama-3.1-8b-lora, " in left and "B qwen2.5-0.5b-full," not in left
    assert "| B qwen2.5-0.5b-full | 1.100 / 1.000 | +10.0% | 55.00 / 54.00 | +1.9% |" in text
    assert "| llama-3.2-3b full 2048 ckpt on micro 4 | 51.00 / 50.00 | +2.0% |" in text
    assert "| 1.25 / 1.10 |" in text  # seconds per step: planned against the median measured
    assert "Peak: median absolute error 2.0%" in text and "32: out of memory" in text
    assert "| llama-3.1-8b-lora | B | - | failed: out of memory |" in text
    assert ("- gemma-2-9b (12 layers) lora 2048 ckpt on micro 8: 9 events; peak reserved: ...; the simulation reserves "
            "what the GPU reserved (trace: `g.json.gz`)") in text
    assert "  replace at GPU event 7 / planned event 7:\n    GPU     a 2,048.0 MiB softmax\n" in text


def test_the_recipes_bench_reshapes_a_recipes_model_and_reports_a_runs_answers_and_margins(tiny_lora_run, tmp_path):
    """bench/tiny_recipes.py: a recipe's training command (heads-4: the default's parameters in
    4 heads of 32) and the report's row for a finished LoRA run of the default (the shared one)."""
    sys.path.insert(0, str(REPO / "bench"))
    import tiny_recipes
    from transformers import AutoConfig, AutoModelForCausalLM

    from sft_play import config as config_module

    args, env = tiny_recipes.command("heads-4", tmp_path, 3)
    assert args[:3] == ["scripts/train_distributed.py", "--config", "configs/run_tiny.yaml"]
    config = config_module.load(REPO / args[2], args[3:])  # every override is one the command line takes
    assert config.finetune.method == "lora" and config.train.max_steps == 3 and env["ATEN_CPU_CAPABILITY"] == "avx2"
    reshaped = AutoConfig.from_pretrained(config.model.name_or_path)
    assert (reshaped.num_attention_heads, reshaped.head_dim, reshaped.num_key_value_heads) == (4, 32, 2)

    def parameters(model_config) -> int:
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(model_config).parameters())

    assert parameters(reshaped) == parameters(AutoConfig.from_pretrained(REPO / "configs" / "tiny_model"))

    folder, _ = tiny_lora_run
    row = tiny_recipes.trained("lora", 42, "auto", folder, wall=0.0)
    row.update(tiny_recipes.score(row["run"], 8))
    text = tiny_recipes.report([row], 8)
    assert "- hardware: " in text and "(no GPU)" in text
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| lora |")]
    assert len(rows) == 1, text
    cells = rows[0]
    assert cells[1] == "42" and int(cells[5]) <= 200 and int(cells[6]) <= 8 and cells[7].count("/") >= 2
    by_kind = [[int(n) for n in kind.split("/")] for kind in cells[7].split(", ")]
    assert [sum(right for right, _ in by_kind), sum(of for _, of in by_kind)] == [int(cells[6]), 8]  # the fresh ones
    float(cells[8]), float(cells[9].rstrip(" |"))  # the margins are numbers


def test_the_more_sorting_mix_turns_easy_puzzles_into_sorting_ones(tmp_path):
    from collections import Counter

    sys.path.insert(0, str(REPO / "bench"))
    from tiny_recipes import more_sorting

    def kinds(path):
        return Counter(json.loads(line)["messages"][-2]["content"].split()[0] for line in path.read_text().splitlines())

    shipped, mixed = kinds(REPO / "data" / "tiny" / "train.jsonl"), kinds(more_sorting(tmp_path / "mix.jsonl"))
    assert sum(mixed.values()) == sum(shipped.values())
    assert mixed["Sort"] > shipped["Sort"] and mixed["Which"] < shipped["Which"] and mixed["Reverse"] == shipped["Reverse"]


def test_the_recipes_bench_counts_an_answer_right_exactly_when_greedy_decoding_writes_it(tiny_lora_run):
    """bench/tiny_recipes.py scores puzzles in one forward pass (teacher forcing): a puzzle counts
    when its margin is above 0, which must be when make eval's greedy decoding writes the answer.
    The shared run trained 24 steps and answers few puzzles right, so beside each puzzle's reference
    the check also scores what the model itself writes (an answer greedy decoding does write)."""
    sys.path.insert(0, str(REPO / "bench"))
    from _common import margins
    from tiny_recipes import fresh_puzzles

    from sft_play import export

    model, tokenizer, config = export.load_trained(tiny_lora_run[0], device="cpu")
    puzzles = [(p.messages, p.reference) for p in export.held_out_prompts(config, 12)] + fresh_puzzles(12)
    own = []
    for messages, _ in puzzles:
        inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)
        with torch.no_grad():
            written = model.generate(**inputs, max_new_tokens=32, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                     pad_token_id=tokenizer.pad_token_id)[0, inputs["input_ids"].shape[1]:].tolist()
        answer = tokenizer.decode(written, skip_special_tokens=True).strip()
        whole = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": answer}],
                                              return_dict=True)["input_ids"]
        if written[-1:] == [tokenizer.eos_token_id] and whole[len(inputs["input_ids"][0]):][:len(written)] == written:
            own.append((messages, answer))  # it stopped by itself, and its answer's tokens are the ones it wrote
    assert len(own) >= 6, "the model's own answers make puzzles it answers right"
    puzzles += own
    greedy = [export.generate(model, tokenizer, messages, 32) == answer for messages, answer in puzzles]
    assert [m > 0 for m in margins(model, tokenizer, puzzles)] == greedy
    assert 0 < sum(greedy) < len(greedy), "a run that answers some and misses some tells the two apart"


def test_the_memory_snapshot_replay_says_whether_the_simulation_reserves_what_the_gpu_did(tmp_path):
    sys.path.insert(0, str(REPO / "bench"))
    import gzip

    import memory_snapshot

    mib = 2**20
    frames = [{"filename": "/x/site-packages/torch/nn/functional.py", "line": 1, "name": "softmax"},
              {"filename": "/x/site-packages/transformers/models/gemma2/modeling_gemma2.py", "line": 9, "name": "eager"}]
    # the GPU reuses its freed 150 MiB block for the 100 MiB request, as the caching allocator's
    # best fit does, and takes a small segment for 512 bytes: the simulation, fed the same order,
    # reserves the same
    agree = [{"action": "segment_alloc", "addr": 0, "size": 150 * mib}, {"action": "alloc", "addr": 0, "size": 150 * mib,
             "frames": frames}, {"action": "free_requested", "addr": 0, "size": 150 * mib},
             {"action": "free_completed", "addr": 0, "size": 150 * mib}, {"action": "alloc", "addr": 0, "size": 100 * mib},
             {"action": "segment_alloc", "addr": 1 << 30, "size": 2 * mib},
             {"action": "alloc", "addr": 1 << 30, "size": 512}]
    trace = memory_snapshot.compact({"device_traces": [agree]}, {"reserved_bytes.all.peak": 152 * mib})
    assert trace["frames"] == ["transformers/models/gemma2/modeling_gemma2.py:9 eager"]  # the model's line, not torch's
    assert [event[0] for event in trace["events"]] == ["s", "a", "f", "a", "s", "a"]  # free_requested is not the pool's
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as handle:
        json.dump(trace, handle)
    result = memory_snapshot.replay(trace)
    assert result["first_parting"] is None and result["simulated_peak_reserved"] == 152 * mib
    assert result["gpu_segments"] == result["simulated_segments"] == 2
    replayed = run_script("bench/memory_snapshot.py", "--replay", str(path))
    assert replayed.returncode == 0 and "the allocator's rules hold" in replayed.stdout, replayed.stderr
    # a GPU that made a new segment where the simulation reuses a cached block: the parting is named
    parted = [*agree[:4], {"action": "segment_alloc", "addr": 1 << 40, "size": 100 * mib},
              {"action": "alloc", "addr": 1 << 40, "size": 100 * mib, "frames": frames}]
    result = memory_snapshot.replay(memory_snapshot.compact({"device_traces": [parted]}, {}))
    part = result["first_parting"]
    assert part["event"] == 4 and part["size"] == 100 * mib and part["gpu_reserved"] == 250 * mib
    assert part["simulated_reserved"] == 150 * mib and "modeling_gemma2.py:9" in part["made_at"]
    assert "an allocator rule differs" in memory_snapshot.verdict(result)
    # the trainer's empty_cache as training starts gives every free segment back, on the GPU and in
    # the replay; the peaks count from there (training, not loading)
    released = [{"action": "segment_alloc", "addr": 0, "size": 300 * mib}, {"action": "alloc", "addr": 0, "size": 300 * mib},
                {"action": "free_completed", "addr": 0, "size": 300 * mib},
                {"action": "segment_free", "addr": 0, "size": 300 * mib},
                {"action": "segment_alloc", "addr": 1 << 40, "size": 200 * mib},
                {"action": "alloc", "addr": 1 << 40, "size": 200 * mib}]
    result = memory_snapshot.replay(memory_snapshot.compact({"device_traces": [released]}, {}))
    assert result["first_parting"] is None and result["releases"] == 1
    assert result["gpu_peak_reserved"] == result["simulated_peak_reserved"] == 200 * mib
    # a new segment starts at the GPU's address for it: equal-sized free blocks go lowest address first
    from sft_play.planner.simulate.allocator import CachingAllocator

    sim = CachingAllocator()
    for handle, address in (("high", 2 << 30), ("low", 1 << 30)):
        sim.segment_address = address
        sim.malloc(handle, 100 * mib)
    sim.free("high")
    sim.free("low")
    sim.malloc("next", 100 * mib)
    assert sim._live["next"].address == 1 << 30
    missing = run_script("bench/memory_snapshot.py", "--replay", "nope.json.gz")
    assert missing.returncode == 2 and missing.stderr.startswith("error: no trace at")


def test_the_memory_snapshot_records_a_shape_with_the_allocators_history_on(tmp_path, monkeypatch):
    """The GPU path's glue, with torch's recorder and the training worker stood in for (no GPU here)."""
    sys.path.insert(0, str(REPO / "bench"))
    import gzip

    import memory_snapshot
    import planner_accuracy
    import shapes

    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: calls.append(kw.get("enabled")))
    monkeypatch.setattr(planner_accuracy, "_worker", lambda case, micro, workdir: calls.append((case.model, micro)) or
                        {"ok": True, "peak_bytes": 3})
    entries = [{"action": "segment_alloc", "addr": 0, "size": 2 << 20}, {"action": "alloc", "addr": 0, "size": 4096}]
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: {"device_traces": [entries]})
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: {"reserved_bytes.all.peak": 2 << 20})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H200")
    shape = shapes.Shape.parse("qwen3-30b-a3b,method=lora,micro=2,layers=2")
    output = tmp_path / "out" / "trace.json.gz"
    trace = memory_snapshot.record_shape(shape, "/a/folder", output)
    assert calls == ["all", ("/a/folder", 2), None]  # recording on, the step trained, recording off
    with gzip.open(output, "rt") as handle:
        written = json.load(handle)
    assert written == trace and written["shape"] == shape.label and written["measured"]["peak_bytes"] == 3
    assert written["device"] == "NVIDIA H200" and written["events"] == [["s", 0, 2 << 20, -1], ["a", 0, 4096, -1]]
    replayed = memory_snapshot.replay(written)  # 4 KiB: a segment of the small pool, 2 MiB, on both sides
    assert replayed["first_parting"] is None and replayed["simulated_peak_reserved"] == 2 << 20


def test_the_memory_snapshot_compares_the_planners_order_of_allocations_with_the_gpus():
    sys.path.insert(0, str(REPO / "bench"))
    import memory_snapshot

    mib = 2**20
    frames = ["torch/optim/adamw.py:1 _init_group", "transformers/models/gemma2/modeling_gemma2.py:9 eager"]
    # loading (before the trainer's release of the cache) and the optimizer's own blocks are left out
    events = [["s", 0, 100 * mib, -1], ["a", 0, 40 * mib, -1], ["a", 1, 50 * mib, -1], ["f", 1, 0, -1],
              ["r", 1 << 30, 60 * mib, -1], ["a", 2, 32 * mib, 1], ["a", 3, 32 * mib, 0], ["f", 2, 0, -1],
              ["f", 0, 0, -1], ["a", 4, 8 * mib, 1]]
    order = memory_snapshot.gpu_order({"events": events, "frames": frames})
    assert order == [("a", 32 * mib, frames[1]), ("f", 32 * mib, frames[1]), ("f", 40 * mib, "")]
    assert memory_snapshot.gpu_order({"events": events, "frames": frames}, threshold=0)[-1] == ("a", 8 * mib, frames[1])
    same = memory_snapshot.first_differences(order, [("a", 32 * mib, "x"), ("f", 32 * mib, "x"), ("f", 40 * mib, "y")])
    assert same == ["the planner's order of large allocations and frees is the GPU's"]
    swapped = memory_snapshot.first_differences(order, [("f", 40 * mib, "y"), ("a", 32 * mib, "x"), ("f", 32 * mib, "x")])
    assert swapped[0].endswith("at GPU event 0 / planned event 0:") and "  planned f 40.0 MiB y" in swapped
    # the planner's side, on a tiny shape: its replay's allocations and frees, without weights or optimizer states
    planned = memory_snapshot.planned_order({"model": str(REPO / "configs" / "tiny_model"), "method": "lora",
                                             "seq_len": 64, "checkpointing": False, "micro": 2}, threshold=0)
    categories = {category for _, _, category in planned}
    assert "activations" in categories and not categories & {"weights", "optimizer_states"}
    assert sum(1 for a, *_ in planned if a == "a") >= sum(1 for a, *_ in planned if a == "f") > 0


def test_the_data_bench_prepares_the_same_packed_rows_on_both_sides_and_reports(monkeypatch, tmp_path):
    """bench/data_prep.py on 40 generated rows, each side's preparation in this process (the bench
    runs each in a fresh one for its memory figures, which this test does not read)."""
    sys.path.insert(0, str(REPO / "bench"))
    import data_prep

    monkeypatch.setattr(data_prep, "run_worker", lambda script, spec, timeout: data_prep.worker(spec))
    out = tmp_path / "data_prep.md"
    monkeypatch.setattr(sys, "argv", ["data_prep.py", "--rows", "40", "--max-seq-length", "512", "--out", str(out)])
    assert data_prep.main() == 0
    rows = [[cell.strip() for cell in line.split("|")] for line in out.read_text().splitlines()
            if line.startswith("| 40 generated rows")]
    assert [r[3] for r in rows] == ["sft_play", "sft_play, cache written", "trl"]
    assert rows[0][5] == rows[1][5] == rows[2][5] and int(rows[0][5]) > 1  # the same packed rows from the same file


def test_the_planner_questions_bench_writes_each_answer_with_its_command(tmp_path):
    out = tmp_path / "planner_questions.md"
    done = run_scripts_together(("bench/planner_questions.py", "--only", "fits-micro", "--out", str(out)))[0]
    assert done.returncode == 0, done.stderr[-2000:]
    text = out.read_text()
    assert "Planned on: " in text and "make plan NUM_GPUS=2 VRAM_GIB=11" in text
    assert "- run: `make train-distributed NUM_GPUS=2 ARGS=" in text and "micro-batch 2, not 3" in text
    refused = run_scripts_together(("bench/planner_questions.py", "--only", "no-such-question", "--out", str(out)))[0]
    assert refused.returncode == 2 and "unknown question(s) no-such-question" in refused.stderr


def test_the_vision_bench_trains_both_sides_from_the_same_weights_and_reports(forked, tmp_path):
    sys.path.insert(0, str(REPO / "bench"))
    import tiny_vlm

    from sft_play import export

    rows = tiny_vlm.train_and_score(["auto"], tmp_path, 2, 4)
    table = [[cell.strip() for cell in line.split("|")] for line in tiny_vlm.report(rows).splitlines()
             if line.startswith("| auto |")]
    assert [r[2] for r in table] == ["SFT-Play", "TRL"]
    assert table[0][3] == table[1][3] and all(r[6] == "2" and r[7].endswith("of 4") for r in table)
    # the same initialised weights: the encoder, which trains on neither side, is the same in both
    # trained models; the text model, which trains on both, is not
    ours, theirs = (dict(export.load_trained(row["model"], device="cpu")[0].named_parameters()) for row in rows)
    assert ours.keys() == theirs.keys()
    same = {name for name in ours if torch.equal(ours[name], theirs[name])}
    tower, text = ({name for name in ours if part in name} for part in ("vision_tower", "language_model"))
    assert tower and text and tower <= same and not text & same, sorted(same)


def test_the_planner_speed_report_compares_answers_and_says_what_failed():
    """bench/planner_speed.py's report (its timings are the bench's to measure, not a test's): an
    earlier planner's answer that differs is said, a failed run is said, not timed."""
    sys.path.insert(0, str(REPO / "bench"))
    import planner_speed
    from tests.plan_snapshots import CASES

    fits, longest = CASES[0], next(c for c in CASES if c.longest)
    ran = {"ok": True, "wall": 3.0, "planned": 1.5, "answer": {"peak_bytes_per_gpu": 1}}
    new = {fits.name: {"cold": ran, "warm": {**ran, "wall": 1.0}},
           longest.name: {"cold": {**ran, "planned": None}, "warm": {"ok": False, "wall": 9.0, "error": "boom"}}}
    old = {fits.name: {"cold": {**ran, "answer": {"peak_bytes_per_gpu": 2}}, "warm": ran},
           longest.name: {"cold": {**ran, "planned": None}, "warm": ran}}
    text = planner_speed.report([fits, longest], new, old, "abc1234", ("0.10", "0.20"))
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    assert f"| {fits.name} | this | 3.0 | 1.5 | 1.0 | 1.5 |  |" in lines
    assert "|  | earlier | 3.0 | 1.5 | 3.0 | 1.5 | **no** |" in lines  # another peak: not the same answer
    assert f"| {longest.name} | this | 3.0 | - | failed | failed |  |" in lines
    assert "|  | earlier | 3.0 | - | 3.0 | 1.5 | yes |" in lines
    assert "the earlier one: commit abc1234" in text


def test_the_preference_bench_trains_both_sides_to_the_same_losses(forked, tmp_path):
    """bench/preference.py's product check: SFT-Play's DPO run and TRL's DPOTrainer, built as its own
    script builds it, from the same weights and pairs, log the same losses step for step (our
    tokens, collator and reference are TRL's); the report says pairs/s and peak memory of each."""
    import preference

    weights = preference.starting_weights(tmp_path / "start", None)
    rows = {"SFT-Play": preference.side("ours", weights, tmp_path, 3),
            "TRL": preference.side("trl", weights, tmp_path, 3)}
    assert len(rows["SFT-Play"]["losses"]) == len(rows["TRL"]["losses"]) == 3
    assert rows["SFT-Play"]["losses"] == pytest.approx(rows["TRL"]["losses"], abs=1e-4)
    assert rows["SFT-Play"]["losses"][0] == pytest.approx(0.6931, abs=1e-4)
    text = preference.report({"dpo": rows}, 3, "the tiny model initialised", None)
    assert "| SFT-Play |" in text and "| TRL |" in text and "Ratio of pairs/s" in text
