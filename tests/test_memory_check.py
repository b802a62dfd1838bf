"""The planner checks itself on every run: the run folder records the prediction beside what the
process used, and `make planner-check` gathers the records into a table."""

from __future__ import annotations

import json
import subprocess
from types import SimpleNamespace

from sft_play import memory_check
from sft_play.run import BatchSplit
from tests.conftest import REPO, run_script

GIB = 1024**3


def _plan(peak_gib: float, micro: int = 4):
    return SimpleNamespace(peak_bytes_per_gpu=int(peak_gib * GIB), micro_batch_size=micro, model="/x/llama-3.1-8b",
                           method="lora", strategy="ddp", device="1 x H100", sequence_length=4096,
                           gradient_checkpointing=True, budget_bytes_per_gpu=76 * GIB)


def _run(micro: int = 4):
    return SimpleNamespace(batch=BatchSplit(micro, 2, 2, micro * 4))


def test_a_gpu_record_compares_the_largest_rank_with_the_prediction(tmp_path):
    ranks = [{"max_memory_reserved": int(59.5 * GIB), "max_memory_allocated": 57 * GIB, "outside_allocator_bytes": GIB,
              "max_rss_bytes": 3 * GIB},
             {"max_memory_reserved": int(59.8 * GIB), "max_memory_allocated": 57 * GIB,
              "outside_allocator_bytes": GIB, "max_rss_bytes": 3 * GIB}]
    document = memory_check.record(tmp_path, _plan(61.2), _run(), ranks, "finished")
    assert document["measured_peak_bytes"] == int(60.8 * GIB)
    assert abs(document["error"] - (61.2 / 60.8 - 1)) < 1e-6
    assert memory_check.line(document) == ("peak: predicted 61.20 GiB, measured 60.80 GiB (+0.7 %) at micro-batch 4, "
                                           "largest of 2 ranks")
    assert json.loads((tmp_path / memory_check.RECORD).read_text())["ranks"] == ranks


def test_after_a_backoff_the_record_says_so_and_computes_no_error(tmp_path):
    ranks = [{"max_memory_reserved": 70 * GIB, "max_memory_allocated": 69 * GIB, "max_rss_bytes": GIB}]
    document = memory_check.record(tmp_path, _plan(61.2, micro=8), _run(micro=4), ranks, "finished")
    assert document["error"] is None and "(planned 8)" in memory_check.line(document)


def test_a_real_cpu_run_writes_its_record_and_the_table_gathers_it(tiny_lora_run, tmp_path):
    run_dir, result = tiny_lora_run
    document = json.loads((run_dir / memory_check.RECORD).read_text())
    assert document["outcome"] == "finished" and document["micro_batch_trained"] == 8
    assert document["measured_peak_bytes"] is None and document["error"] is None  # a CPU: no comparable peak
    assert document["ranks"][0]["max_rss_bytes"] > 0
    assert "peak: predicted" in result.stderr + result.stdout
    # a GPU run beside it (written as a GPU run writes it) and the table of both
    gpu = tmp_path / "gpu-run"
    gpu.mkdir()
    memory_check.record(gpu, _plan(61.2), _run(), [{"max_memory_reserved": int(59.8 * GIB),
                                                    "max_memory_allocated": 57 * GIB, "outside_allocator_bytes": GIB,
                                                    "max_rss_bytes": GIB}], "finished")
    (tmp_path / run_dir.name).symlink_to(run_dir)
    shown = run_script("planner_check.py", "--runs", str(tmp_path))
    assert shown.returncode == 0, shown.stderr
    assert "| gpu-run | llama-3.1-8b | lora | on | 4096 | 4 | 61.20 | 60.80 | +0.7 % | finished |" in shown.stdout
    assert "1 run(s) measured on a GPU: median |error| 0.7 %, largest 0.7 %" in shown.stdout
    empty = subprocess.run(["make", "-s", "planner-check", f"RUNS={tmp_path / 'nothing'}"], cwd=REPO,
                           capture_output=True, text=True)
    assert empty.returncode == 2 and "is not a folder" in empty.stderr and "Traceback" not in empty.stderr


# --- what lives outside the allocator: measured on the GPUs that train, not assumed --------------

def _h100(outside: dict | None = None):
    from sft_play import hardware

    return hardware.HardwareInfo(
        gpus=[hardware.GpuInfo(i, "NVIDIA H100 80GB HBM3", 80 * GIB, 79 * GIB, (9, 0), True, f"GPU-{i}", 18)
              for i in range(2)],
        driver_version="580.1", cuda_runtime_version="13.0", torch_version="2.13.0", gpu_source="nvml",
        outside_allocator=outside or {})


def test_a_runs_measurement_outside_the_allocator_is_kept_per_gpu_and_driver(tmp_path, monkeypatch):
    from sft_play import hardware

    monkeypatch.setenv("SFT_PLAY_CACHE", str(tmp_path))
    facts = _h100()
    assert hardware.remembered_outside_allocator(facts) == {}
    memory_check.remember_runtime(facts, [{"outside_allocator_bytes": 600 * 2**20}, {"outside_allocator_bytes": 640 * 2**20}])
    memory_check.remember_runtime(facts, [{"outside_allocator_bytes": 540 * 2**20}])
    assert hardware.remembered_outside_allocator(facts) == {"several_processes": 640 * 2**20, "one_process": 540 * 2**20}
    memory_check.remember_runtime(facts, [{"outside_allocator_bytes": 500 * 2**20}])  # the largest seen is kept
    assert hardware.remembered_outside_allocator(facts)["one_process"] == 540 * 2**20
    memory_check.remember_runtime(facts, [{"max_rss_bytes": GIB}])  # a CPU run measures nothing outside
    other_driver = _h100()
    other_driver.driver_version = "590.2"
    assert hardware.remembered_outside_allocator(other_driver) == {}
    assert "0.53 GiB with one process" in hardware.format_report(_h100(hardware.remembered_outside_allocator(facts)))


def test_the_plan_uses_what_was_measured_outside_the_allocator_and_says_so():
    from sft_play.planner import make_plan, target_for
    from sft_play.planner.memory import CUDA_CONTEXT_BYTES, NCCL_BYTES
    from tests.test_planner import plan_config

    config = plan_config("qwen2.5-0.5b", "finetune.method=lora", "train.micro_batch_size=2")
    assumed = make_plan(config, target_for(_h100(), gpus=1), with_remedies=False)
    assert any("not measured on these GPUs yet" in note for note in assumed.notes)
    measured_one = 900 * 2**20
    one = make_plan(config, target_for(_h100({"one_process": measured_one}), gpus=1), with_remedies=False)
    assert one.peak_bytes_per_gpu - assumed.peak_bytes_per_gpu == measured_one - CUDA_CONTEXT_BYTES
    assert one.breakdown["cuda_runtime"] - assumed.breakdown["cuda_runtime"] == measured_one - CUDA_CONTEXT_BYTES
    assert any("0.88 GiB per process, measured on these GPUs" in note for note in one.notes)
    # two processes: a one-process measurement takes NCCL's estimate on top; a two-process one is used as it is
    two = target_for(_h100({"one_process": measured_one}), gpus=2)
    assert two.outside_allocator_bytes == measured_one + NCCL_BYTES and "estimate" in two.outside_allocator_source
    both = target_for(_h100({"one_process": measured_one, "several_processes": 1200 * 2**20}), gpus=2)
    assert both.outside_allocator_bytes == 1200 * 2**20
    # hardware described (--vram-gib) is not these GPUs: the constants
    assert target_for(_h100({"one_process": measured_one}), gpus=1, vram_gib=80).outside_allocator_bytes is None
