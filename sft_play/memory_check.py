"""The planner checks itself on every run: what the plan predicted beside what the devices
really used, written into the run folder (``memory_check.json``) at the end of training and when
it runs out of memory, and said in one line::

    peak: predicted 61.2 GiB, measured 60.8 GiB (+0.7 %) at micro-batch 4 (largest of 8 ranks)

On a GPU, each rank's ``torch.cuda.max_memory_reserved`` and ``max_memory_allocated``, and what
NVML says the process holds (the CUDA context and libraries outside the allocator); the measured
peak is the reserved peak plus that outside part, the quantity the plan predicts. On the CPU the
process's peak resident memory is recorded too, but it holds the interpreter and the libraries
the plan does not count, so no error is computed there.

:func:`gather` reads every run folder's record under a folder: ``make planner-check`` prints
them as a table, the planner's error on the user's own hardware.
"""

from __future__ import annotations

import json
import resource
import statistics
from pathlib import Path
from typing import Any

from sft_play import hardware
from sft_play.units import GIB

RECORD = "memory_check.json"


def measure_here(on_cuda: bool, device_index: int = 0) -> dict[str, int]:
    """This process's peaks so far."""
    measured = {"max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if on_cuda:
        import torch

        reserved_now = torch.cuda.memory_reserved(device_index)
        measured.update(max_memory_reserved=torch.cuda.max_memory_reserved(device_index),
                        max_memory_allocated=torch.cuda.max_memory_allocated(device_index))
        process = hardware.process_gpu_bytes(device_index)
        if process is not None:
            measured["nvml_process_bytes"] = process
            measured["outside_allocator_bytes"] = max(0, process - reserved_now)
    return measured


def comparable_peak(measured: dict[str, int]) -> int | None:
    """The measured quantity the plan predicts: the reserved peak plus what lives outside the
    allocator (None without a GPU)."""
    if "max_memory_reserved" not in measured:
        return None
    return measured["max_memory_reserved"] + measured.get("outside_allocator_bytes", 0)


def record(run_dir: Path, plan: Any, trained: Any, ranks: list[dict[str, int]], outcome: str) -> dict[str, Any]:
    """Write ``memory_check.json``: the prediction for the micro-batch that trained (`trained`: the
    batch split, :class:`sft_play.run.BatchSplit`), every rank's measurements, and the error of
    the largest (what the budget must hold)."""
    peaks = [comparable_peak(rank) for rank in ranks]
    measured = max((p for p in peaks if p is not None), default=None)
    predicted = plan.peak_bytes_per_gpu
    planned_micro = plan.micro_batch_size
    document = {
        "outcome": outcome,  # finished, stopped, or out_of_memory
        "model": plan.model, "method": plan.method, "strategy": plan.strategy, "device": plan.device,
        "sequence_length": plan.sequence_length, "gradient_checkpointing": plan.gradient_checkpointing,
        "micro_batch_planned": planned_micro, "micro_batch_trained": trained.micro_batch_size,
        "predicted_peak_bytes": predicted, "budget_bytes": plan.budget_bytes_per_gpu,
        "measured_peak_bytes": measured,
        "error": (predicted / measured - 1) if measured and planned_micro == trained.micro_batch_size else None,
        "ranks": ranks,
        "note": None if measured else "no GPU: the process's peak resident memory holds the interpreter and the "
                                      "libraries, which the plan does not count; no error computed",
    }
    (run_dir / RECORD).write_text(json.dumps(document, indent=2) + "\n")
    return document


def remember_runtime(facts: Any, run: Any, ranks: list[dict[str, int]]) -> None:
    """Keep what the ranks held outside the allocator (the largest of them) as this machine's
    measurement for runs of as many processes (:func:`sft_play.hardware.remember_outside_allocator`),
    for the next plans. Not after a paged optimizer's run: its states live in managed memory,
    which NVML may count beside the context."""
    outside = [rank["outside_allocator_bytes"] for rank in ranks if rank.get("outside_allocator_bytes")]
    if outside and "paged" not in run.optimizer:
        hardware.remember_outside_allocator(facts, str(len(ranks)), max(outside))


def line(document: dict[str, Any]) -> str:
    """``peak: predicted 61.2 GiB, measured 60.8 GiB (+0.7 %) at micro-batch 4``."""
    predicted = document["predicted_peak_bytes"] / GIB
    text = f"peak: predicted {predicted:.2f} GiB"
    if document["measured_peak_bytes"]:
        text += f", measured {document['measured_peak_bytes'] / GIB:.2f} GiB"
        if document["error"] is not None:
            text += f" ({100 * document['error']:+.1f} %)"
    else:
        rss = max(rank.get("max_rss_bytes", 0) for rank in document["ranks"])
        text += f" of host memory for the tensors; the process peaked at {rss / GIB:.2f} GiB resident (interpreter included)"
    text += f" at micro-batch {document['micro_batch_trained']}"
    if document["micro_batch_trained"] != document["micro_batch_planned"]:
        text += f" (planned {document['micro_batch_planned']})"
    if len(document["ranks"]) > 1:
        text += f", largest of {len(document['ranks'])} ranks"
    return text


def gather(root: Path) -> list[dict[str, Any]]:
    """Every run folder's record under `root` (a folder of run folders, or one run folder)."""
    paths = [root / RECORD] if (root / RECORD).is_file() else sorted(root.glob(f"*/{RECORD}"))
    documents = []
    for path in paths:
        try:
            document = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        documents.append({**document, "run": path.parent.name})
    return documents


def table(documents: list[dict[str, Any]]) -> str:
    """The records as a markdown table, with the median and largest error of those measured."""
    rows = ["| run | model | method | ckpt | seq | micro | predicted GiB | measured GiB | error | outcome |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for d in documents:
        measured = f"{d['measured_peak_bytes'] / GIB:.2f}" if d.get("measured_peak_bytes") else "-"
        error = f"{100 * d['error']:+.1f} %" if d.get("error") is not None else "-"
        rows.append(f"| {d['run']} | {Path(d['model']).name} | {d['method']} | {'on' if d['gradient_checkpointing'] else 'off'} "
                    f"| {d['sequence_length']} | {d['micro_batch_trained']} | {d['predicted_peak_bytes'] / GIB:.2f} "
                    f"| {measured} | {error} | {d['outcome']} |")
    errors = [abs(d["error"]) for d in documents if d.get("error") is not None]
    summary = (f"\n{len(errors)} run(s) measured on a GPU: median |error| {100 * statistics.median(errors):.1f} %, "
               f"largest {100 * max(errors):.1f} %" if errors else
               "\nno run measured on a GPU yet: the error is computed where the peak is a GPU's")
    return "\n".join(rows) + "\n" + summary
