"""Every plan says what its memory figures rest on (issue 61): GPU measurements of runs of its
kind, the rules checked on real CPU steps, and what neither covered."""

from __future__ import annotations

import re

from sft_play import config as config_module
from sft_play.planner import Target, model_shape, resolve_for
from sft_play.planner.present import evidence as module
from tests.conftest import FIXTURES, REPO

GIB = 1024**3


def found(model: str, *overrides: str, gpus: int = 1) -> dict:
    config = config_module.load(None, [f"model.name_or_path={FIXTURES / 'model_configs' / model}", *overrides],
                                check_paths=False)
    shape = model_shape(config)
    return module.evidence(resolve_for(config, Target(gpus, 80 * GIB, f"{gpus} x H100", gpu_model="H100"), None, shape),
                           shape)


def test_a_run_of_a_measured_kind_names_its_gpu_rows_and_a_checked_one_the_cpu_steps():
    said = found("qwen2.5-0.5b", "finetune.method=lora", "data.max_seq_length=2048", "model.attn_implementation=sdpa")
    assert [g["device"] for g in said["gpu"]] == ["one H100 80GB"] and not said["cpu"] and not said["extrapolated"]
    assert module.lines(said) == [
        "measured on a GPU: 21 runs of this kind on one H100 80GB (2026-11-23), peak error median 0.79 %, at most 2.77 %"]
    # the embedded default's Llama: the CPU steps checked its rules; no GPU measured LoRA of the family
    config = config_module.load(REPO / "configs" / "run_tiny.yaml", ["finetune.method=lora"], check_paths=False)
    shape = model_shape(config)
    tiny = module.evidence(resolve_for(config, Target(1, 80 * GIB, "1 x H100", gpu_model="H100"), None, shape), shape)
    assert tiny["cpu"] and tiny["gpu"] == [] and tiny["extrapolated"] == ["lora of the llama family (measured: qlora)"]
    assert module.lines(tiny)[1].startswith("checked on CPU steps: the trace and replay rules this plan uses")
    # the GPU rows, trained in bf16, do not speak for a run computing in fp32, nor the CPU steps
    # (fp32 and bf16) for one in fp16
    for mixed, gpu_gap, cpu in (("no", "computing in fp32 (measured: bf16 mixed precision)", True),
                                ("bf16", None, True),
                                ("fp16", "computing in fp16 mixed precision (measured: bf16 mixed precision)", False)):
        config = config_module.load(REPO / "configs" / "run_tiny.yaml",
                                    ["finetune.method=qlora", f"train.mixed_precision={mixed}"], check_paths=False)
        shape = model_shape(config)
        said = module.evidence(resolve_for(config, Target(1, 80 * GIB, "1 x H100", gpu_model="H100"), None, shape), shape)
        assert said["cpu"] is cpu and (said["gpu"] == []) is (gpu_gap is not None)
        assert [e for e in said["extrapolated"] if e.startswith("computing in")] == ([gpu_gap] if gpu_gap else [])


def test_a_kind_whose_cpu_steps_missed_is_not_claimed(monkeypatch):
    """A gap of evidence.json (a kind the CPU steps measured beyond the stated error) takes the
    CPU's claim from the plans of that kind and is named among what is extrapolated."""
    import copy

    facts = copy.deepcopy(module.measured())
    said = "full fine-tuning in bf16 with checkpointing (a CPU step beyond the stated error)"
    facts["cpu"]["gaps"] = [{"method": "full", "mixed_precision": "bf16", "checkpointing": True, "said": said}]
    monkeypatch.setattr(module, "measured", lambda: facts)
    for checkpointing, missed in (("true", True), ("false", False)):
        config = config_module.load(REPO / "configs" / "run_tiny.yaml",
                                    ["finetune.method=full", f"train.gradient_checkpointing={checkpointing}"],
                                    check_paths=False)
        shape = model_shape(config)
        found = module.evidence(resolve_for(config, Target(1, 80 * GIB, "1 x H100", gpu_model="H100"), None, shape), shape)
        assert found["cpu"] is not missed and (said in found["extrapolated"]) is missed


def test_the_gpu_kinds_are_the_measured_rows():
    import json

    for fixture, device in (("h100_measurements.json", "one H100 80GB"), ("h200_measurements.json", "one H200")):
        rows = json.loads((FIXTURES / fixture).read_text())["rows"]
        kinds = {(json.loads((FIXTURES / "model_configs" / r["model"] / "config.json").read_text())["model_type"],
                  r["method"]) for r in rows}
        said = next(g for g in module.measured()["gpu"] if g["device"] == device)
        assert kinds == {tuple(kind) for kind in said["kinds"]}


def test_what_no_measurement_covered_is_named():
    said = found("qwen2.5-7b", "finetune.method=full", "distributed.strategy=deepspeed_zero3", "data.max_seq_length=16384",
                 "train.gradient_checkpointing=true", "train.tiled_mlp=true", "model.attn_implementation=sdpa", gpus=8)
    assert said["gpu"] == [] and not said["cpu"]
    assert said["extrapolated"] == ["deepspeed_zero3 across processes (measured: one process)",
                                    "rows of 16,384 tokens (measured up to 4,096)"]
    assert module.lines(said)[0] == "measured on a GPU: no run of this kind"
    # tiled MLPs ran in the CPU steps (the same PyTorch code on a GPU); offloaded activations did not
    tiled = found("llama-3.1-8b", "finetune.method=lora", "lora.dropout=0", "train.tiled_mlp=true",
                  "train.gradient_checkpointing=true", "data.max_seq_length=16384")
    assert tiled["gpu"] == [] and tiled["cpu"] and "tiled MLPs" not in tiled["extrapolated"]
    offloaded = found("llama-3.1-8b", "finetune.method=lora", "train.offload_activations=true",
                      "train.gradient_checkpointing=true", "data.max_seq_length=16384")
    assert not offloaded["cpu"] and offloaded["extrapolated"][0] == "offloaded activations"
    # the CPU steps check which tensors live and when at any length, but not another family's layers
    gemma = found("gemma-2-9b", "finetune.method=lora", "data.max_seq_length=8192")
    assert not gemma["cpu"] and gemma["gpu"] == []
    assert gemma["extrapolated"] == ["rows of 8,192 tokens (measured up to 2,048)"]


def test_the_cpu_facts_are_the_ground_truth_reports():
    """evidence.json's CPU line against the report bench/cpu_ground_truth.py writes: every cell of
    the strategies it claims counted, none beyond the error it states, and each family and method
    with a cell claimed (the embedded Llama's; a row naming a tiny model, that model's type); the
    strategies it leaves out have their cells in the report, beyond that error."""
    import json

    report = (REPO / "docs" / "reports" / "cpu_ground_truth.md").read_text()
    rows = re.findall(r"^\| ([^|]+) \| (full|lora|qlora) \|.*\| ([+-][\d.]+) % \|", report, flags=re.M)
    facts = module.measured()["cpu"]
    names = {"DDP": "ddp", "ZeRO-2": "deepspeed_zero2", "ZeRO-3": "deepspeed_zero3", "FSDP2": "fsdp2"}

    def strategy(step: str) -> str:  # (rows split across the processes: a lever of its own)
        found = re.search(r", (\S+) on \d+ processes", step)
        name = names[found.group(1)] if found else "none"
        return f"{name}, each row split" if "each row split" in step else name

    def is_claimed(step: str) -> bool:
        name = strategy(step)
        split = name.endswith(", each row split")
        return (name.removesuffix(", each row split") in facts["strategies"]
                and (not split or "rows split across processes" in facts["levers"]))

    claimed = [(step, method, abs(float(e))) for step, method, e in rows if is_claimed(step)]
    assert len(claimed) == facts["cells"] and max(e for _, _, e in claimed) <= facts["max_error_pct"]
    left_out = {strategy(step) for step, _, _ in rows if not is_claimed(step)}
    for name in left_out:  # measured, and not claimed because a cell of it misses
        assert max(abs(float(e)) for step, _, e in rows if strategy(step) == name) > facts["max_error_pct"], name
    measured = set()
    for step, method, _ in claimed:
        family = next((part for part in step.split(", ") if part.startswith("tiny-")), None)
        folder = FIXTURES / "model_configs" / family if family else REPO / "configs" / "tiny_model"
        measured.add((json.loads((folder / "config.json").read_text())["model_type"], method))
    assert {tuple(kind) for kind in facts["kinds"]} == measured
    # preference steps claimed where they were measured only
    preference = {strategy(step) for step, _, _ in rows if step.split(",")[0] in ("DPO", "ORPO", "SimPO", "KTO")}
    assert preference == set(facts["preference_strategies"])


def test_a_preference_plan_across_processes_is_not_said_checked_where_only_sft_steps_ran_there():
    """ZeRO-2's SFT steps were measured on CPU processes, DPO's in one process only: a DPO plan under
    ZeRO-2 (TRL prepares its reference copy at ZeRO stage 0) is not said checked on CPU steps."""
    target = Target(2, 80 * GIB, "2 x H100", gpu_model="H100")

    def said(config_file: str) -> tuple[dict, list[str]]:
        config = config_module.load(REPO / "configs" / config_file, [
            "finetune.method=full", "distributed.strategy=deepspeed_zero2", f"model.name_or_path={REPO / 'configs' / 'tiny_model'}",
            "model.build_with=null"], check_paths=False)
        shape = model_shape(config)
        run = resolve_for(config, target, None, shape)
        cpu_gap = module._differences({**module._kind(run, shape), "tokens": 0}, module.measured()["cpu"], attention=False)
        return module.evidence(run, shape), cpu_gap

    (sft, sft_gap), (dpo, dpo_gap) = said("run_tiny.yaml"), said("run_tiny_dpo.yaml")
    assert sft["cpu"] and sft_gap == []
    assert not dpo["cpu"] and dpo_gap == ["DPO steps across processes (measured in one process)"]


def test_rows_split_by_ulysses_are_checked_on_cpu_and_by_context_parallelism_are_not():
    """The CPU cells split rows with DeepSpeed's Ulysses under ZeRO-2 and ZeRO-3 (within the stated
    error once the count takes gloo's frees on its own threads); FSDP2's context parallelism never
    ran there."""
    common = ("finetune.method=lora", "train.gradient_checkpointing=true", "train.global_batch_size=8")
    for zero in ("deepspeed_zero2", "deepspeed_zero3"):
        split = found("llama-3.1-8b", *common, f"distributed.strategy={zero}", "distributed.sequence_parallel=2",
                      gpus=8)
        assert "rows split across processes" not in split["extrapolated"], zero
    context = found("llama-3.1-8b", *common, "distributed.strategy=fsdp2", "distributed.context_parallel=2",
                    "data.packing=false", gpus=8)
    assert "rows split across processes by context parallelism" in context["extrapolated"]
