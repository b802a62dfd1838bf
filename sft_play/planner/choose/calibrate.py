"""Calibration (``planner.calibrate: true``, GPU only): measure two short training steps at two
small micro-batches, fit the peak as a fixed part plus a per-sample part, and plan from the fit.

The analytic model predicts every term; calibration corrects what it cannot see on a given
machine (kernel workspaces, allocator behaviour, a CUDA version). The two measurements and the
predictions for the same micro-batches are reported side by side.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sft_play.planner.choose.split import budget_bytes, decide_split, safety_fraction
from sft_play.units import GIB


def fit(measured: dict[int, int]) -> tuple[float, float]:
    """(fixed bytes, bytes per sample) of the line through two (micro-batch, peak) measurements.

    Raises:
        ValueError: fewer than two distinct micro-batches.
    """
    if len(measured) < 2:
        raise ValueError("calibration needs peaks at two different micro-batch sizes")
    (m1, p1), (m2, p2) = sorted(measured.items())[:2]
    per_sample = max(0.0, (p2 - p1) / (m2 - m1))
    return p1 - per_sample * m1, per_sample


def calibrated_plan(plan, measured: dict[int, int], predicted: dict[int, int], train: Any, settings: Any):
    """`plan` re-decided from measured peaks: the largest micro-batch whose fitted peak fits the
    budget, split by the same rule as the plan (:func:`sft_play.planner.choose.split.decide_split`,
    reading the ``train`` section), and notes comparing prediction with measurement.

    Args:
        train, settings: the run config's ``train`` and ``planner`` sections.
    """
    fixed, per_sample = fit(measured)
    # the plan's own margin: an attention kernel measured short keeps its shortfall here too (a line
    # through micro-batches 1 and 2 cannot see the cache a larger micro-batch's blocks leave)
    fraction, _ = safety_fraction(settings.safety_fraction, plan.attention, plan.on_cuda)
    budget = budget_bytes(plan.free_bytes_per_gpu, settings.safety_margin_gib, fraction)
    per_process = max(1, -(-plan.requested_global_batch_size // plan.world_size))
    fitting = int((budget - fixed) // per_sample) if per_sample else per_process
    fitting = max(0, min(fitting, per_process))
    split = decide_split(plan.requested_global_batch_size, plan.world_size, "auto", train.gradient_accumulation_steps,
                         fitting)
    peak = int(fixed + per_sample * split.micro_batch_size)
    comparison = ", ".join(
        f"micro {m}: predicted {predicted[m] / GIB:.2f} GiB, measured {measured[m] / GIB:.2f} GiB "
        f"({100 * (predicted[m] - measured[m]) / measured[m]:+.1f}%)" for m in sorted(measured)
    )
    notes = [f"calibrated on this GPU: {comparison}",
             f"fitted peak = {fixed / GIB:.2f} GiB + {per_sample / GIB:.3f} GiB per sample"]
    return dataclasses.replace(
        plan,
        micro_batch_size=split.micro_batch_size,
        gradient_accumulation_steps=split.gradient_accumulation_steps,
        global_batch_size=split.global_batch_size,
        peak_bytes_per_gpu=peak,
        budget_bytes_per_gpu=budget,
        fits=fitting >= 1 and peak <= budget,
        notes=plan.notes + notes + ([split.note] if split.note else []),
    )
