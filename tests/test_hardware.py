"""Hardware facts: on this CPU-only machine gpu-info says so plainly and still reports the CPU."""

from __future__ import annotations

import json

import pytest
import torch

from sft_play import hardware
from sft_play.units import GIB
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
        gpus=[hardware.GpuInfo(0, "NVIDIA H100 80GB HBM3", 80 * GIB, 79 * GIB, (9, 0), True, "GPU-x", 18)],
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


# --- the CPU's bf16, and the precision train.mixed_precision=auto takes from it ----------------

AMD_ZEN3 = {"avx2", "fma", "sse4_2"}  # AVX2 only: bf16 autocast is emulated there
AMD_ZEN4 = AMD_ZEN3 | {"avx512f", "avx512bw", "avx512_bf16"}
INTEL_SPR = AMD_ZEN3 | {"avx512f", "avx512bw", "avx512_bf16", "amx_bf16", "amx_tile"}
INTEL_SKX = AMD_ZEN3 | {"avx512f", "avx512bw"}  # AVX512 without bf16: oneDNN says yes, and emulates


@pytest.mark.parametrize("flags, torch_says, native", [
    (AMD_ZEN3, False, False),
    (AMD_ZEN4, True, True),
    (INTEL_SPR, True, True),
    (INTEL_SKX, True, False),
    ({"fp", "asimd", "bf16"}, True, True),  # Arm with the BF16 extension
    (None, True, True),  # flags unreadable: PyTorch's word
    (INTEL_SPR, False, False),  # PyTorch cannot use it (a build without oneDNN's bf16, or an ISA cap)
])
def test_native_bf16_needs_the_instructions_and_pytorch(flags, torch_says, native):
    found, evidence = hardware.native_bf16(flags, torch_says)
    assert found is native
    assert evidence
    if flags is INTEL_SPR and torch_says:
        assert "AMX" in evidence


def _config(*overrides):
    from sft_play import config as config_module

    return config_module.load(None, list(overrides), check_paths=False)


@pytest.mark.parametrize("cpu_bf16, expected", [(True, "bf16"), (False, "no")])
def test_auto_precision_on_the_cpu_follows_its_native_bf16(monkeypatch, cpu_bf16, expected):
    """The decision both ways, with the CPU's capability faked where detect() reads it."""
    from sft_play import planner
    from sft_play.precision import resolve_precision

    monkeypatch.setattr(hardware.machine, "native_bf16", lambda flags, says: (cpu_bf16, "faked"))
    facts = hardware.detect().without_gpus()
    assert facts.cpu_bf16 is cpu_bf16
    config = _config("train.mixed_precision=auto")
    precision = resolve_precision(config, has_gpu=False, bf16_supported=facts.bf16_supported(on_gpu=False))
    assert precision.mixed == expected
    assert ("natively" if cpu_bf16 else "no native bf16") in precision.reason
    # the planner's CPU target carries the same fact, so plan and trainer agree
    target = planner.target_for(facts, allow_cpu=True)
    assert target.bf16_supported is cpu_bf16
    assert planner.resolve_for(config, target).precision.mixed == expected


def test_a_gpu_named_on_a_machine_without_one_is_planned_with_its_memory():
    """make plan GPU_MODEL=H100 on a CPU machine planned the CPU, the GPU unsaid; with NUM_GPUS it
    asked for VRAM_GIB, which the name says (but for a model sold in two sizes)."""
    from types import SimpleNamespace

    from sft_play import planner

    no_gpu = SimpleNamespace(gpus=[])
    target = planner.target_for(no_gpu, gpu_model="h200", allow_cpu=True)
    assert target.on_cuda and target.world_size == 1 and target.free_bytes == 141 * 2**30 and target.gpu_model == "H200"
    assert planner.target_for(no_gpu, 2, gpu_model="H100").free_bytes == 80 * 2**30
    assert planner.target_for(no_gpu, 1, 40, gpu_model="H100").free_bytes == 40 * 2**30  # VRAM_GIB still decides
    with pytest.raises(ValueError, match="GPU_MODEL=A100 comes with more than one memory size"):
        planner.target_for(no_gpu, 1, gpu_model="A100")
    # ... where the name does not say which
    for name, gib in (("A100 80GB", 80), ("NVIDIA A100-SXM4-40GB", 40)):
        assert planner.target_for(no_gpu, 1, gpu_model=name).free_bytes == gib * 2**30, name
    nvl = planner.target_for(no_gpu, 1, gpu_model="H100 NVL")  # not an H100 SXM: 94 GiB, over PCIe
    assert nvl.free_bytes == 94 * 2**30 and nvl.gpu_model == "H100 NVL" and "PCIe" in nvl.device_name


def test_bf16_asked_for_on_a_cpu_without_it_is_kept_and_warned_about():
    from sft_play.precision import resolve_precision

    slow = resolve_precision(_config("train.mixed_precision=bf16"), has_gpu=False, bf16_supported=False)
    assert slow.mixed == "bf16" and "25x slower" in slow.warning
    assert resolve_precision(_config("train.mixed_precision=bf16"), has_gpu=False, bf16_supported=True).warning is None
    assert resolve_precision(_config("train.mixed_precision=no"), has_gpu=False, bf16_supported=False).warning is None


def test_auto_precision_on_gpus():
    from sft_play.precision import resolve_precision

    config = _config("train.mixed_precision=auto")
    assert resolve_precision(config, has_gpu=True, bf16_supported=True).mixed == "bf16"
    assert resolve_precision(config, has_gpu=True, bf16_supported=False).mixed == "fp16"
    gpus = hardware.HardwareInfo(gpus=[hardware.GpuInfo(0, "Tesla V100", 1, 1, (7, 0), False)], cpu_bf16=True)
    assert gpus.bf16_supported(on_gpu=True) is False and gpus.bf16_supported(on_gpu=False) is True


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"), reason="x86 oneDNN ISA cap")
def test_gpu_info_and_check_say_fp32_where_the_cpu_has_no_bf16():
    """A real CPU without native bf16, as oneDNN sees one when its ISA is capped at AVX2: the
    same test on an AVX2-only machine and on one with AMX."""
    avx2 = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    result = run_script("gpu_info.py", "--json", env=avx2)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["cpu_bf16"] is False and doc["cpu_capability"] == "AVX2"
    assert doc["auto_mixed_precision"]["mode"] == "no"
    result = run_script("check.py", "--config", "configs/run_tiny.yaml", env=avx2)
    line = next(line for line in result.stdout.splitlines() if "precision:" in line)
    assert "fp32" in line and "no native bf16" in line, line


def test_the_cublas_workspace_is_what_pytorch_takes_on_each_gpu(monkeypatch):
    from sft_play.hardware import cublas_workspace_bytes

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    hopper, other = 32 * 2**20, 8 * 2**20 + 128 * 2**10  # PyTorch's :4096:8 on sm90 exactly, else :4096:2:16:8
    assert cublas_workspace_bytes((9, 0)) == hopper
    assert cublas_workspace_bytes((8, 0)) == cublas_workspace_bytes((8, 9)) == cublas_workspace_bytes((10, 0)) == other
    assert cublas_workspace_bytes(None) == hopper  # an unknown GPU: the larger
    assert cublas_workspace_bytes((9, 0), ":16:8") == 128 * 2**10  # what transformers' full determinism sets
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2:16:8")
    assert cublas_workspace_bytes((9, 0)) == other


def test_the_cpu_generation_comes_from_cpuinfos_family_and_model(monkeypatch):
    # a virtual machine's model name says "AMD EPYC" of a Zen 3 and of a Zen 4 alike; the benches'
    # reports name family and model, read by the same parser as the flags and the model name
    fields = {"model name": "AMD EPYC", "cpu family": "25", "model": "1", "flags": "fpu avx2 fma"}
    monkeypatch.setattr(hardware.machine, "_cpuinfo", lambda: fields)
    assert hardware.cpu_family_and_model() == "CPU family 25, model 1"
    assert hardware.machine._cpu_flags_and_model() == ({"fpu", "avx2", "fma"}, "AMD EPYC")
    monkeypatch.setattr(hardware.machine, "_cpuinfo", lambda: {"model name": "Neoverse", "Features": "fp asimd bf16"})
    assert hardware.cpu_family_and_model() == "" and hardware.machine._cpu_flags_and_model()[0] == {"fp", "asimd", "bf16"}
