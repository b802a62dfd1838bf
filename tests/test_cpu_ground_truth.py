"""The planner's memory simulation against PyTorch's own count, on a real training step on the CPU
(issue 61's ground truth): bench/cpu_ground_truth.py measures every cell and writes
docs/reports/cpu_ground_truth.md and .json; this plans every recorded cell again and holds it to
what was measured, and trains cells of each kind for real, which must meet the same target."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import cpu_ground_truth as ground_truth  # noqa: E402

REPORT = Path(__file__).resolve().parents[1] / "docs" / "reports" / "cpu_ground_truth.json"


RECORDS = json.loads(REPORT.read_text())["cells"]


def _named(cell: dict) -> str:
    return json.dumps({key: cell[key] for key in ground_truth.CELL_KEYS if key in cell}, sort_keys=True)


def test_the_report_records_every_cell_of_the_matrix():
    """A record for each rank of every cell bench/cpu_ground_truth.py trains, each measured."""
    assert sorted(map(_named, RECORDS)) == sorted(
        _named(cell) for cell in ground_truth.CELLS for _ in range(ground_truth._processes(cell)))
    assert all(record["ok"] for record in RECORDS)


@pytest.mark.parametrize("record", RECORDS, ids=[",".join(f"{key}={r[key]}" for key in ground_truth.CELL_KEYS if key in r)
                                                  + f",rank={r.get('rank', 0)}" for r in RECORDS])
def test_each_cell_of_the_matrix_is_planned_within_the_stated_error_of_what_it_measured(record):
    """Issue 61's matrix in the suite: a cell bench/cpu_ground_truth.py trained under PyTorch's
    count (a rank's record in cpu_ground_truth.json: its batches, its data's statistics, the live
    bytes at its peak and named points), planned again by the planner as it is now, without training:
    a change to the trace, the replay or a run decision that moves any cell out of its error fails
    here, not at the next run of the bench (about 20 minutes of real steps, which the tests below
    sample). The peak within the error the plans' evidence states (evidence.json); each named point
    within 2 %, but for the two gaps docs/PLANNER.md ("Inside the layers' backward") explains, where
    the plan is high and never low by more than 2 %: the first layer's backward (the rotary tables
    and masks the replay keeps to the end of backward) and FSDP2's layers (its backward an envelope);
    and FSDP2's point after the forward, which is low by one hidden state more on some runs than on
    others (alive or not as the forward returns, on both ranks alike)."""
    from sft_play.planner.present import evidence
    from sft_play.planner.simulate.step import POINTS, layer_backward_point

    hidden = json.loads((REPORT.parents[2] / "configs" / "tiny_model" / "config.json").read_text())["hidden_size"]
    stated = evidence.measured()["cpu"]["max_error_pct"]
    planned = ground_truth.replan(record)
    error = 100 * (planned["predicted_bytes"] / record["measured_bytes"] - 1)
    assert abs(error) <= stated, error
    fsdp2 = record.get("strategy") == "fsdp2"
    for point, (measured, plan) in planned["points"].items():
        if point == layer_backward_point(0) or (fsdp2 and point not in POINTS):
            assert plan / measured - 1 > -0.02, (point, measured, plan)
            continue
        rows, tokens, _ = record["batches"][-1]
        state = rows * tokens * hidden * (2 if record.get("precision") else 4) if fsdp2 and point == "after_forward" else 0
        assert (plan + state) / measured - 1 > -0.02 and plan / measured - 1 < 0.02, (point, measured, plan)


@pytest.mark.slow  # real training steps under the profiler
def test_a_real_cpu_step_peaks_where_the_plan_says_by_pytorchs_own_count(tmp_path):
    """Two padded rows a step (their lengths, less one, odd multiples of 512 bytes): host memory
    counts each tensor's bytes as asked, not as the CUDA allocator's blocks would hold them. The
    step's named points (the forward returned, each decoder layer's backward done, the optimizer
    step starting and ending) too."""
    from sft_play.planner.simulate.step import POINTS, layer_backward_point

    result = ground_truth.measure({"method": "full", "checkpointing": True, "micro": 2, "seq": 256}, tmp_path)
    measured, planned = result["measured"], result["predicted"]
    assert sum(measured.values()) == result["measured_bytes"]  # every byte alive at the peak has its category
    # the terms counted from the shapes: the weights (less the rotary embedding's 256-byte buffer)
    # and AdamW's two states per trained weight (less its 4-byte step counters), at the peak
    assert 0 <= measured["PARAMETER"] - planned["weights"] <= 256
    assert 0 <= measured["OPTIMIZER_STATE"] - planned["optimizer_states"] <= 4 * 64
    assert measured["GRADIENT"] == planned["gradients"]
    # the whole peak within issue 61's 1 %
    assert abs(result["predicted_bytes"] / result["measured_bytes"] - 1) < 0.01, result
    # the allocator's count, which measures the cells across processes, is the profile's to 0.1 %
    assert abs(result["allocator_bytes"] / result["measured_bytes"] - 1) < 0.001, result
    # and the live bytes as the last step passed each named point, within 2 %; as each layer's
    # backward is done, the same but for the first layer's, where the plan is high by the rotary
    # tables and the masks, which it keeps to the end of backward (docs/PLANNER.md, "Inside the
    # layers' backward": freed there, a measured H100 run that ran out of memory planned to fit)
    assert set(result["points"]) == {*POINTS, *(layer_backward_point(i) for i in range(4))}, result
    for point, (measured, planned) in result["points"].items():
        if point == layer_backward_point(0):
            assert 0.02 < planned / measured - 1 < 0.04, (point, measured, planned)
        else:
            assert abs(planned / measured - 1) < 0.02, (point, measured, planned)


@pytest.mark.slow  # real training steps under the profiler
def test_a_dpo_step_with_its_reference_copy_peaks_where_the_plan_says(tmp_path):
    """Preference tuning (issue 58): a pair is two rows through the policy, and the frozen
    reference copy is a second set of weights; at the peak PyTorch counts both copies' parameters
    (the plan's weights and reference terms) and the rest within issue 61's 1 %. With checkpointing
    the step peaks in the loss, not in the optimizer's step: on a CPU torch's AdamW runs tensor by
    tensor, without the CUDA foreach kernels' intermediate the size of every state."""
    result = ground_truth.measure({"method": "full", "checkpointing": True, "micro": 2, "seq": 64,
                                   "reference": "copy"}, tmp_path)
    measured, planned = result["measured"], result["predicted"]
    assert [rows for rows, _, _ in result["batches"]] == [4, 4]  # two pairs a step: four rows
    assert 0 <= measured["PARAMETER"] - planned["weights"] - planned["reference"] <= 2 * 256
    assert abs(result["predicted_bytes"] / result["measured_bytes"] - 1) < 0.01, result


@pytest.mark.slow  # real training steps under the profiler
def test_a_tiled_mlp_step_peaks_where_the_plan_says(tmp_path):
    """Tiled MLPs (DeepSpeed's TiledMLP): without checkpointing the MLPs' intermediates are most of
    the activations; tiled, backward recomputes them a tile at a time. The plan of the untiled step
    keeps a quarter more; the tiled one is within issue 61's 1 % of PyTorch's count (the allocator's,
    which the first test holds to the memory profile's)."""
    import dataclasses

    from sft_play.planner import model_shape
    from sft_play.planner.simulate.predict import predict

    cell = {"method": "lora", "checkpointing": False, "micro": 2, "seq": 256, "tiled": True}
    result = ground_truth.measure(cell, tmp_path / "tiled", categories=False)
    assert abs(result["predicted_bytes"] / result["measured_bytes"] - 1) < 0.01, result
    config, run, _, _, _ = ground_truth.tiny_trainer(tmp_path / "plain", cell)
    untiled = run.with_changes(kernels=dataclasses.replace(run.kernels, tiled_mlp=False))
    assert run.kernels.tiled_mlp and predict(model_shape(config), untiled, 2).peak_bytes > 1.25 * result["predicted_bytes"]



def test_a_tensor_freed_on_another_thread_is_counted_freed():
    """gloo frees a collective's tensors on its own threads, where the profiler records no free: the
    count reads the allocator's running total, which every_thread_counted keeps on every thread."""
    import threading

    import torch
    from torch.profiler import ProfilerActivity, profile

    held = [torch.empty(0)]
    with ground_truth.every_thread_counted(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        held[0] = torch.empty(1 << 18)  # 1 MiB
        freeing = threading.Thread(target=held.clear)
        freeing.start()
        freeing.join()
        again = torch.empty(1 << 18)
        del again
    peak, made, _ = ground_truth.allocator_count(prof)
    assert peak == 1 << 20 and len(made) >= 1
