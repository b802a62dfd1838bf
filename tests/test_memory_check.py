"""The planner checks itself on every run: the run folder records the prediction beside what the
process used, and `make planner-check` gathers the records into a table."""

from __future__ import annotations

import json
import subprocess
from types import SimpleNamespace

import pytest

from sft_play import memory_check
from sft_play.run import BatchSplit
from tests.conftest import REPO, run_script

GIB = 1024**3
MIB = 1024**2


def _plan(peak_gib: float, micro: int = 4):
    return SimpleNamespace(peak_bytes_per_gpu=int(peak_gib * GIB), micro_batch_size=micro, model="/x/llama-3.1-8b",
                           method="lora", strategy="ddp", device="1 x H100", sequence_length=4096,
                           gradient_checkpointing=True, budget_bytes_per_gpu=76 * GIB)


def _split(micro: int = 4):
    return BatchSplit(micro, 2, 2, micro * 4)


def test_a_gpu_record_compares_the_largest_rank_with_the_prediction(tmp_path):
    ranks = [{"max_memory_reserved": int(59.5 * GIB), "max_memory_allocated": 57 * GIB, "outside_allocator_bytes": GIB,
              "max_rss_bytes": 3 * GIB},
             {"max_memory_reserved": int(59.8 * GIB), "max_memory_allocated": 57 * GIB,
              "outside_allocator_bytes": GIB, "max_rss_bytes": 3 * GIB}]
    document = memory_check.record(tmp_path, _plan(61.2), _split(), ranks, "finished")
    assert document["measured_peak_bytes"] == int(60.8 * GIB)
    assert abs(document["error"] - (61.2 / 60.8 - 1)) < 1e-6
    assert memory_check.line(document) == ("peak: predicted 61.20 GiB, measured 60.80 GiB (+0.7 %) at micro-batch 4, "
                                           "largest of 2 ranks")
    assert json.loads((tmp_path / memory_check.RECORD).read_text())["ranks"] == ranks


def test_after_a_backoff_the_record_says_so_and_computes_no_error(tmp_path):
    ranks = [{"max_memory_reserved": 70 * GIB, "max_memory_allocated": 69 * GIB, "max_rss_bytes": GIB}]
    document = memory_check.record(tmp_path, _plan(61.2, micro=8), _split(micro=4), ranks, "finished")
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
    memory_check.record(gpu, _plan(61.2), _split(), [{"max_memory_reserved": int(59.8 * GIB),
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
    facts, adamw, paged = _h100(), SimpleNamespace(optimizer="adamw_torch_fused"), SimpleNamespace(optimizer="paged_adamw_8bit")
    assert hardware.remembered_outside_allocator(facts) == {}
    memory_check.remember_runtime(facts, adamw, [{"outside_allocator_bytes": 600 * MIB}, {"outside_allocator_bytes": 640 * MIB}])
    memory_check.remember_runtime(facts, adamw, [{"outside_allocator_bytes": 540 * MIB}])
    assert hardware.remembered_outside_allocator(facts) == {"2": 640 * MIB, "1": 540 * MIB}
    memory_check.remember_runtime(facts, adamw, [{"outside_allocator_bytes": 500 * MIB}])  # the largest seen is kept
    memory_check.remember_runtime(facts, adamw, [{"max_rss_bytes": GIB}])  # a CPU run measures nothing outside
    memory_check.remember_runtime(facts, paged, [{"outside_allocator_bytes": 3 * GIB}])  # managed memory beside it
    assert hardware.remembered_outside_allocator(facts) == {"2": 640 * MIB, "1": 540 * MIB}
    other_driver = _h100()
    other_driver.driver_version = "590.2"
    assert hardware.remembered_outside_allocator(other_driver) == {}
    assert "0.53 GiB (a run of 1 process(es))" in hardware.format_report(_h100(hardware.remembered_outside_allocator(facts)))


@pytest.mark.parametrize("written", ["not json {", "[1, 2]", '{"KEY": [1]}', '{"KEY": {"1": "big", "2": true, "x": 5}}'])
def test_a_broken_runtime_record_counts_as_no_measurement_and_is_rewritten(tmp_path, monkeypatch, written):
    from sft_play import hardware

    monkeypatch.setenv("SFT_PLAY_CACHE", str(tmp_path))
    facts = _h100()
    (tmp_path / hardware.RUNTIME_RECORD).write_text(written.replace("KEY", hardware.runtime_key(facts)))
    assert hardware.remembered_outside_allocator(facts) == {}
    hardware.remember_outside_allocator(facts, "1", 700 * MIB)
    assert hardware.remembered_outside_allocator(facts) == {"1": 700 * MIB}


def test_the_plan_uses_what_was_measured_outside_the_allocator_and_says_so():
    from sft_play.planner import WITHOUT_REMEDIES, make_plan, target_for
    from sft_play.planner.simulate.memory import CUDA_CONTEXT_BYTES, NCCL_BYTES, outside_allocator
    from tests.test_planner import plan_config

    config = plan_config("qwen2.5-0.5b", "finetune.method=lora", "train.micro_batch_size=2")
    assumed = make_plan(config, target_for(_h100(), gpus=1), options=WITHOUT_REMEDIES)
    assert any("not measured on these GPUs yet" in note for note in assumed.notes)
    measured_one = 900 * MIB
    one = make_plan(config, target_for(_h100({"1": measured_one}), gpus=1), options=WITHOUT_REMEDIES)
    assert one.peak_bytes_per_gpu - assumed.peak_bytes_per_gpu == measured_one - CUDA_CONTEXT_BYTES
    assert one.breakdown["cuda_runtime"] - assumed.breakdown["cuda_runtime"] == measured_one - CUDA_CONTEXT_BYTES
    assert any("0.88 GiB per process, measured on these GPUs by a run of 1" in note for note in one.notes)
    # what a run of each size takes: its own measurement, else the context plus NCCL's estimate,
    # never less than a smaller run of several processes measured
    measured = {"1": measured_one, "2": 1200 * MIB}
    assert outside_allocator(2, True, measured)[0] == 1200 * MIB
    assert outside_allocator(8, True, {"1": measured_one})[0] == measured_one + NCCL_BYTES
    assert outside_allocator(8, True, {"1": measured_one, "2": 2 * GIB})[0] == 2 * GIB
    assert outside_allocator(1, True, {"probe": 300 * MIB})[0] == CUDA_CONTEXT_BYTES  # a probe never lowers it
    assert outside_allocator(1, True, {"probe": 700 * MIB})[0] == 700 * MIB
    assert outside_allocator(1, False, measured)[0] == 0
    # the remedies plan other world sizes from the same measurements
    eight = make_plan(config, target_for(_h100({"1": measured_one}), gpus=8), options=WITHOUT_REMEDIES)
    eight_assumed = make_plan(config, target_for(_h100(), gpus=8), options=WITHOUT_REMEDIES)
    assert eight.breakdown["cuda_runtime"] - eight_assumed.breakdown["cuda_runtime"] == measured_one - CUDA_CONTEXT_BYTES
    assert any(f"plus NCCL's buffers ({NCCL_BYTES // MIB} MiB, an estimate)" in note for note in eight.notes)
    # hardware described (--vram-gib) is not these GPUs: the constants
    assert target_for(_h100({"1": measured_one}), gpus=1, vram_gib=80).outside_allocator_measured == {}
