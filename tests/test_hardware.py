"""Hardware facts: on this CPU-only machine gpu-info says so plainly and still reports the CPU."""

from __future__ import annotations

import json

import pytest
import torch

from sft_play import hardware
from tests.conftest import run_script

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU report")


def test_detect_reports_cpu_and_memory():
    facts = hardware.detect()
    assert facts.cpu_logical_cores >= 1
    assert facts.cpu_usable_cores >= 1
    assert facts.ram_total_bytes > facts.ram_available_bytes > 0
    assert facts.torch_version == torch.__version__


@no_gpu
def test_gpu_info_without_a_gpu_says_so_and_exits_zero():
    result = run_script("gpu_info.py")
    assert result.returncode == 0, result.stderr
    assert "No CUDA GPU found" in result.stdout
    assert "CPU:" in result.stdout and "RAM" in result.stdout


@no_gpu
def test_gpu_info_json_is_one_document():
    result = run_script("gpu_info.py", "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["has_gpu"] is False and doc["gpus"] == []
    assert doc["cpu_logical_cores"] >= 1 and doc["ram_total_bytes"] > 0


def test_report_lists_each_gpu():
    facts = hardware.HardwareInfo(
        gpus=[hardware.GpuInfo(0, "NVIDIA H100 80GB HBM3", 80 * hardware.GIB, 79 * hardware.GIB, (9, 0), True, "GPU-x", 18)],
        links=[],
        driver_version="580.1",
        cuda_driver_version="13.0",
        cuda_runtime_version="13.0",
        nccl_version="2.27.3",
        gpu_source="nvml",
    )
    report = hardware.format_report(facts)
    assert "NVIDIA H100 80GB HBM3" in report and "79.00" in report and "9.0" in report
    assert "driver 580.1" in report and "NCCL 2.27.3" in report
