"""What a plan's memory figures rest on: GPU measurements of runs of the same kind, the trace's
rules checked against PyTorch's own count on real CPU steps, or neither (extrapolated).

What has been measured is data (evidence.json, beside this file), copied from the reports the
benches write; this module only matches a run against it and says, in one line per kind, what
the run has that no measurement covered.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from sft_play.planner.simulate.shapes import ModelShape
from sft_play.run import Run


@functools.lru_cache(maxsize=1)
def measured() -> dict[str, Any]:
    return json.loads((Path(__file__).with_name("evidence.json")).read_text())


def evidence(run: Run, shape: ModelShape) -> dict[str, Any]:
    """``gpu``: the GPU measurements of runs of this kind (empty: none); ``cpu``: whether the
    CPU steps checked the rules this run's plan uses; ``extrapolated``: what neither covered."""
    facts = measured()
    kind = _kind(run, shape)
    beyond = _levers(run)
    gpu = [g for g in facts["gpu"] if not _differences(kind, g)] if not beyond else []
    # (the CPU steps check which tensors live and when, at any length: a row's length is not their gap;
    # a lever they ran, tiled MLPs, is the same PyTorch code on a GPU)
    cpu_gap = _differences({**kind, "tokens": 0}, facts["cpu"], attention=False)
    unchecked = [lever for lever in beyond if lever not in facts["cpu"].get("levers", [])]
    # (a cell of this run's kind that the CPU steps measured beyond the stated error)
    missed = [g["said"] for g in facts["cpu"].get("gaps", []) if all(
        kind.get(key) == value for key, value in g.items() if key != "said")]
    extrapolated = list(unchecked)
    if not gpu:
        nearest = min(facts["gpu"], key=lambda g: len(_differences(kind, g)))
        extrapolated += [d for d in _differences(kind, nearest) + missed if d not in extrapolated]
    return {"gpu": [{k: g[k] for k in ("device", "date", "rows", "median_error_pct", "max_error_pct")} for g in gpu],
            "cpu": not cpu_gap and not unchecked and not missed, "cpu_cells": facts["cpu"]["cells"],
            "cpu_max_error_pct": facts["cpu"]["max_error_pct"], "extrapolated": extrapolated}


def lines(found: dict[str, Any]) -> list[str]:
    """The plan's evidence as ``make plan`` prints it."""
    said = []
    for g in found["gpu"]:
        said.append(f"measured on a GPU: {g['rows']} runs of this kind on {g['device']} ({g['date']}), peak error "
                    f"median {g['median_error_pct']:.2f} %, at most {g['max_error_pct']:.2f} %")
    if not found["gpu"]:
        said.append("measured on a GPU: no run of this kind")
    if found["cpu"]:
        said.append(f"checked on CPU steps: the trace and replay rules this plan uses, by PyTorch's own count "
                    f"({found['cpu_cells']} cells, every peak within {found['cpu_max_error_pct']:.1f} %: "
                    "bench/cpu_ground_truth.py)")
    if found["extrapolated"]:
        said.append("extrapolated: " + "; ".join(found["extrapolated"]))
    return said


def _kind(run: Run, shape: ModelShape) -> dict[str, Any]:
    return {"model_type": shape.model_type, "method": run.method, "mixed_precision": run.precision.mixed,
            "checkpointing": run.gradient_checkpointing,
            "strategy": "none" if run.parallel.world_size <= 1 else run.parallel.strategy.name,
            "objective": run.preference.objective if run.preference is not None else "sft",
            "attention": run.kernels.attention, "tokens": run.sequence.tokens}


def _differences(kind: dict[str, Any], covered: dict[str, Any], attention: bool = True) -> list[str]:
    """What of `kind` the measurements `covered` do not cover, each as the plan says it."""
    differences = []
    families = {family: [m for f, m in covered["kinds"] if f == family] for family, _ in covered["kinds"]}
    if kind["model_type"] not in families:
        differences.append(f"the {kind['model_type']} family's layers (measured: {', '.join(families)})")
    elif kind["method"] not in families[kind["model_type"]]:
        differences.append(f"{kind['method']} of the {kind['model_type']} family (measured: "
                           f"{', '.join(families[kind['model_type']])})")
    if kind["strategy"] not in covered["strategies"]:
        measured = ", ".join("one process" if s == "none" else s for s in covered["strategies"])
        differences.append(f"{kind['strategy']} across processes (measured: {measured})")
    if kind["objective"] not in covered["objectives"]:
        differences.append(f"{kind['objective'].upper()} steps (measured: {', '.join(covered['objectives']).upper()})")
    elif kind["objective"] != "sft" and kind["strategy"] not in covered.get("preference_strategies", covered["strategies"]):
        differences.append(f"{kind['objective'].upper()} steps across processes (measured in one process)")
    if kind["mixed_precision"] not in covered.get("mixed_precision", [kind["mixed_precision"]]):
        def computing(mixed: str) -> str:
            return "fp32" if mixed == "no" else f"{mixed} mixed precision"
        differences.append(f"computing in {computing(kind['mixed_precision'])} (measured: "
                           f"{', '.join(map(computing, covered['mixed_precision']))})")
    if attention and kind["attention"] not in covered["attention"]:
        differences.append(f"{kind['attention']}'s saved tensors (from its documented kernel; measured: "
                           f"{', '.join(covered['attention'])})")
    if kind["tokens"] > covered["max_tokens"]:
        differences.append(f"rows of {kind['tokens']:,} tokens (measured up to {covered['max_tokens']:,})")
    return differences


def _levers(run: Run) -> list[str]:
    """The run's levers that no measurement has exercised, GPU or CPU."""
    kernels, parallel = run.kernels, run.parallel
    return [name for name, on in (
        ("tiled MLPs", kernels.tiled_mlp),
        ("offloaded activations", run.offload_activations),
        ("Liger's kernels", kernels.liger),
        ("compiled layers", kernels.compile_layers),
        ("rows split across processes", parallel.sequence_parallel > 1),  # (DeepSpeed's Ulysses)
        ("rows split across processes by context parallelism", parallel.context_parallel > 1),
        ("offloaded parameters or optimizer states", parallel.offload_parameters or parallel.offload_optimizer),
        ("the vision encoder", bool(run.encoder_inputs)),
    ) if on]
