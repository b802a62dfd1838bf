"""GPU truth in one lease: speed, memory and time on whatever GPU is at hand, in one command.

GPU time is short and pre-emptible (for this project as for users on rented or spot machines), so
`make bench-gpu` spends it where it tells, most telling first, and writes every figure to its
rows (--state, one JSON line each) the moment it exists, and the report (--output) after every
row. A call that ends or is cut short keeps every finished row; the next call with the same
--state skips what its rows hold and goes on.

Tasks, each in a fresh process (a clean allocator; an out-of-memory error cannot poison the next):

  W  random weights for the next task's model, built on the GPU (bench/prepare_weights.py) and
     removed after the last task of the call that needs them (--keep-weights keeps them)
  B  SFT-Play on a case of bench/throughput.py: the planner's micro-batch, packed rows; tokens/s,
     MFU, peak memory, the loss of the last steps, and the planner's predicted peak and seconds
     per step beside the measured
  T  TRL tuned (bench/throughput.py): ONE process tries micro-batches in increasing order,
     doubling from half B's until one runs out of memory, each try on freshly loaded weights
     with its own warm-up; every try is a row, T is the fastest
  A  TRL with its defaults (bench/throughput.py)
  P  the planner's predicted against measured peak and seconds per step for one shape
     (bench/planner_accuracy.py's worker: a few steps of rows exactly the sequence length long,
     torch's peak reservation plus what NVML sees outside it); a shape may switch long-row levers
     on, show one image a row, or train preference pairs (bench/shapes.py)
  S  the GPU's own allocations for a shape, replayed through the planner's allocator
     (bench/memory_snapshot.py): whether a rule of the simulation or the traced order differs;
     the trace is written beside the rows

The order is what each task settles (phase 1, about 20 minutes on an H200: more than one lease,
each call going on from the last):
  1. Llama-3.1-8B LoRA, one row of 32k and of 64k tokens, with checkpointing, then with a tiled MLP,
     then with offloaded hidden states: the per-token working set the planner disagreed with itself
     about (one process against ZeRO-3);
  2. S for Gemma-2-9B (12 layers) LoRA, whose allocator cache the planner under-predicted on an H200
     (docs/PLANNER.md, section 6);
  3. Qwen2.5-VL-7B LoRA, frozen encoder, one image a row at 448 x 448 and at 1344 x 1344: the
     encoder trace's first GPU check;
  4. Llama-3.1-8B DPO with LoRA (the reference: the adapters switched off);
  5. B and T for Qwen2.5-0.5B full and Llama-3.1-8B LoRA: SFT-Play planned against TRL tuned on its
     supported setup.
Phase 2: the old list's shapes (Gemma-2 and Qwen3-MoE P rows among them), QLoRA and 8k-token LoRA,
TRL's defaults, B with each kernel lever, more shapes. A task has TASK_SECONDS at most; --dry-run
plans every task here, as the lent GPU will run it, with its estimated seconds: the rehearsal to run
before a lease. --shape adds any config folder as a P task, first in phase 1. Without a GPU the same
code runs tiny shapes of every kind on the CPU and the report says no GPU figure exists.

Usage: python bench/lease.py [--minutes 8] [--phase 1|all] [--state docs/reports/gpu_lease.jsonl]
                             [--output docs/reports/gpu_lease.md] [--max-tasks N] [--keep-weights]
                             [--dry-run [h100|h200]]
                             [--shape FOLDER[,method=lora][,seq=2048][,ckpt=on][,micro=2][,layers=N][,pixels=N]
                                      [,objective=dpo|kto][,steps=3][,tiled][,offload][,dropout0] ...]
On the lent GPU machine (see docs/PLANNER.md, "Measuring on a GPU"): a second call continues
from the rows of the first when they travel with it:
  cp docs/reports/gpu_lease.jsonl $OUT/ 2>/dev/null; python bench/lease.py --state $OUT/gpu_lease.jsonl --output $OUT/gpu_lease.md
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from _common import (  # bench/ is the script's folder
    CONFIGS,
    REPO,
    REPORTS,
    import_training_stack,
    lean,
    run_worker,
    versions,
)
from shapes import ROW_LEVERS, Shape, build_weights, model_folder, shape_task, weights_for

GIB = 1024**3
MIN_SECONDS_LEFT = 45  # a task is not started with less than this left on a GPU (the weights alone take longer)
TASK_SECONDS = 180  # the most one task may take on a GPU: each is sized to fit (--dry-run estimates them)
# What a task took on the H200 lease of 2026-11-26 besides its timed steps (docs/reports/gpu_lease.jsonl):
# random weights built on the GPU 19-31 s a model; a P task's process, load and plan 22-25 s at 2k tokens
# (its steps a second or two); B 50 s for 8B LoRA; T's search 30-249 s. The dry run's estimate of a task
# is these plus the plan's own seconds per step for its steps; S replays besides (about a minute).
SETUP_SECONDS = {"W": 30, "P": 25, "S": 60, "B": 50, "T": 170, "A": 60}


# 1. The per-token working set of long rows, where the planner disagrees with itself (one process
#    against ZeRO-3): Llama-3.1-8B LoRA, one row a step, plain with checkpointing and with each lever
LONG_ROWS = [Shape("llama-3.1-8b", "lora", seq, True, 1, levers=("dropout0", *lever), steps=2)
             for seq in (32768, 65536) for lever in ((), ("tiled",), ("offload",))]
# 3. The vision encoder's trace: Qwen2.5-VL-7B LoRA, frozen encoder, one image a row at two budgets
#    (448 x 448: 256 image tokens; 1344 x 1344: 2,304), 256 text tokens beside it
PICTURES = [Shape("qwen2.5-vl-7b", "lora", (side // 28) ** 2 + 256, True, 2, pixels=side * side)
            for side in (448, 1344)]
# 4. Preference tuning: Llama-3.1-8B DPO and KTO with LoRA (the reference: the adapters switched off;
#    KTO's two answers a micro-batch with their mismatched rows)
PAIRS = [Shape("llama-3.1-8b", "lora", 2048, True, 2, objective=objective) for objective in ("dpo", "kto")]


def gpu_plan() -> list[dict]:
    """Every GPU task in the order it runs, most telling first; phase 1 is what a first lease is for."""
    from throughput import GPU_CASES, LEVERS

    cases = {case.name: case for case in GPU_CASES}
    main = [(cases["qwen2.5-0.5b-full"], 32), (cases["llama-3.1-8b-lora"], 16)]
    tasks = [shape_task(shape, 1) for shape in LONG_ROWS]
    # 2. The allocator on the GPU's own order for the shape the planner under-predicted (docs/PLANNER.md,
    # section 6): whether a rule of the simulated allocator or the traced order differs
    tasks.append(snapshot_task(Shape("gemma-2-9b", "lora", 2048, True, 8, layers=12), 1))
    tasks += [shape_task(shape, 1) for shape in PICTURES + PAIRS]
    # 5. SFT-Play planned against TRL tuned on its supported setup
    for case, global_batch in main:
        tasks += [throughput_task("B", case, 1, global_batch), throughput_task("T", case, 1, global_batch)]
    # 6. The rest: shapes never measured, the old list's rows, TRL's defaults, each kernel lever
    tasks += [shape_task(shape, 2) for shape in (
        Shape("gemma-2-9b", "lora", 2048, True, 8, layers=12),  # never measured: soft-capped logits, big vocabulary
        Shape("qwen3-30b-a3b", "lora", 2048, True, 8, layers=6),  # never measured: routed experts
        Shape("llama-3.2-3b", "full", 2048, True, 4),  # full fine-tuning with checkpointing (its predicted peak swung from one shape to the next)
        Shape("qwen2.5-0.5b", "full", 2048, True, 16),
        Shape("llama-3.1-8b", "lora", 4096, True, 2),
        Shape("mistral-7b-v0.1", "qlora", 2048, True, 4),
        # rows as long as Mistral's 4096-token sliding window: SDPA gets a mask, every layer keeps a bias
        Shape("mistral-7b-v0.1", "lora", 4096, False, 1, layers=16),
    )]
    others = [(cases["llama-3.1-8b-qlora"], 16), (cases["llama-3.1-8b-lora-8k"], 8)]
    for case, global_batch in others:
        tasks += [throughput_task("B", case, 2, global_batch), throughput_task("T", case, 2, global_batch)]
    import importlib.util

    liger = importlib.util.find_spec("liger_kernel") is not None
    for case, global_batch in main + others:
        tasks.append(throughput_task("A", case, 2, global_batch))
        if liger:  # at T's micro-batch: Liger's kernels only lower the memory a micro-batch takes
            tasks.append(throughput_task("T", case, 2, global_batch, lever="liger"))
        tasks += [throughput_task("B", case, 2, global_batch, lever=lever) for lever in LEVERS
                  if lever != "liger" or liger]
    tasks += [shape_task(shape, 2) for shape in (
        Shape("qwen2.5-14b", "lora", 2048, True, 2),
        Shape("llama-3.2-3b", "lora", 2048, False, 4),
        Shape("qwen2.5-0.5b", "qlora", 4096, True, 16),
        Shape("tiny-mixtral", "full", 2048, False, 8),
    )]
    return tasks


def cpu_plan() -> list[dict]:
    """The same kinds of task on tiny shapes, so that the command cannot rot without a GPU: every
    worker the GPU plan runs (a long-row lever, an image a row, preference pairs) once."""
    from throughput import CPU_CASES

    case = CPU_CASES[0]
    tiny = str(REPO / "configs" / "tiny_model")
    return [throughput_task("B", case, 1, 8), throughput_task("T", case, 1, 8),
            shape_task(Shape(tiny, "lora", 128, False, 4), 1),
            shape_task(Shape(tiny, "lora", 128, True, 1, levers=("dropout0", "tiled"), steps=2), 1),
            shape_task(Shape(str(CONFIGS / "tiny-qwen2.5-vl"), "lora", 16 + 64, True, 2, pixels=112 * 112, steps=2), 1),
            shape_task(Shape(tiny, "lora", 128, True, 2, objective="dpo", steps=2), 1),
            shape_task(Shape(tiny, "lora", 128, True, 2, objective="kto", steps=2), 1),
            throughput_task("A", case, 2, 8)]


def throughput_task(kind: str, case, phase: int, global_batch: int, lever: str = "") -> dict:
    key = f"{kind}{'+' + lever if lever else ''} {case.name}"
    return {"key": key, "kind": kind, "phase": phase, "case": asdict(case), "global_batch": global_batch,
            "lever": lever}


def snapshot_task(shape: Shape, phase: int) -> dict:
    """S: bench/memory_snapshot.py on a shape: the GPU's allocations replayed through the simulation."""
    return {"key": f"S {shape.label}", "kind": "S", "phase": phase, "shape": shape.fields()}


# --- rows ---------------------------------------------------------------------------------------

DONE_KINDS = {"A", "B", "T", "P", "S"}  # a task whose row of its own kind exists is done (failed ones too)


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by the end of a lease: the task runs again
                continue
    return rows


def append_row(path: Path, row: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torn = path.exists() and path.stat().st_size and not path.read_bytes().endswith(b"\n")
    with path.open("a") as handle:  # a line cut by a lease's end stays alone; this row starts its own
        handle.write(("\n" if torn else "") + json.dumps({**row, "at": round(time.time(), 1)}) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def pending(tasks: list[dict], rows: list[dict]) -> list[dict]:
    """The tasks whose result is not in the rows yet (a task cut short by a lease's end runs again;
    so does a GPU's T that ran the setup the bench no longer runs: BFD padding-free on SDPA)."""
    on_cuda = any(row.get("on_cuda") for row in rows if row.get("kind") == "call")
    done = {row["task"] for row in rows if row.get("kind") in DONE_KINDS and "task" in row
            and not (on_cuda and row["kind"] == "T" and row["result"].get("ok", True) is not False
                     and "setup" not in row["result"])}
    return [task for task in tasks if task["key"] not in done]


# --- workers ------------------------------------------------------------------------------------

def settings(on_cuda: bool) -> dict:
    """Warm-up and timed steps: on a GPU enough for a stable rate, no more (each try of T's
    search has its own warm-up: the compile and the allocator's first growth happen there)."""
    return ({"warmup": 2, "steps": 6, "try_warmup": 1, "try_steps": 3} if on_cuda else
            {"warmup": 1, "steps": 2, "try_warmup": 1, "try_steps": 2})


def run_task(task: dict, state: Path, output: Path, on_cuda: bool) -> dict:
    """In the worker process: run one task, append its rows, render the report."""
    import throughput

    steps = settings(on_cuda)
    kind = task["kind"]
    with tempfile.TemporaryDirectory() as workdir:
        if kind == "B":
            case = throughput.Case(**task["case"])
            result = throughput.run_sft_play(case, steps["steps"], steps["warmup"], workdir, task.get("lever", ""),
                                             global_batch=task["global_batch"])
        elif kind == "A":
            case = throughput.Case(**task["case"])
            result = throughput.run_baseline(case, steps["steps"], steps["warmup"], workdir)
        elif kind == "T" and task.get("lever") == "liger":
            case = throughput.Case(**task["case"])
            result = throughput.run_baseline(case, steps["steps"], steps["warmup"], workdir, tuned="liger",
                                             micro=task.get("micro") or 4)
        elif kind == "T":
            case = throughput.Case(**task["case"])
            start = task.get("start") or 8

            def emit(attempt: dict) -> None:  # each try lands in the rows at once
                append_row(state, {"task": task["key"], "kind": "T-try", "result": attempt})
                render_to(state, output)

            result = throughput.run_tuned_search(case, steps["try_steps"], steps["try_warmup"], workdir, start,
                                                 emit=emit, deadline=task.get("deadline"))
        elif kind == "S":
            import memory_snapshot

            shape = Shape(**task["shape"])
            slug = re.sub(r"[^A-Za-z0-9.-]+", "-", shape.label).strip("-")
            trace_file = state.with_name(f"{slug}.trace.json.gz")
            trace = memory_snapshot.record_shape(shape, model_folder(task), trace_file)
            result = {**memory_snapshot.examine(trace), "trace": trace_file.name, "measured": trace.get("measured")}
        else:
            result = measure_shape(Shape(**task["shape"]), model_folder(task), workdir)
    append_row(state, {"task": task["key"], "kind": kind, "result": result})
    render_to(state, output)
    return {"ok": True}


def measure_shape(shape: Shape, folder: str, workdir: str) -> dict:
    import planner_accuracy

    from sft_play import hardware
    from sft_play.planner import Target, target_for

    case = _case_of(shape, folder)
    facts = hardware.detect()
    target = target_for(facts, gpus=1, allow_cpu=True)
    if facts.gpus:  # plan against the whole device: the measurement is of one process alone on it
        target = Target(1, facts.gpus[0].total_bytes, facts.gpus[0].name)
    predicted, _ = planner_accuracy.predict(case, shape.micro, target)
    try:
        measured = planner_accuracy._worker(case, shape.micro, workdir)
    except Exception as exc:  # noqa: BLE001 - out of memory above all: the row keeps the prediction
        from throughput import out_of_memory

        measured = {"ok": False, "error": out_of_memory(exc) or f"{type(exc).__name__}: {exc}"[:300]}
    return {"ok": measured.get("ok", False), "predicted": predicted, "measured": measured}


# --- the report -----------------------------------------------------------------------------------

def render_to(state: Path, output: Path) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = output.with_name(output.name + ".tmp")
    try:
        text = render(read_rows(state), state)
    except Exception as exc:  # noqa: BLE001 - a report that cannot be drawn must not end the lease: the rows stay
        text = (f"# GPU truth in one lease\n\nThe report could not be rendered ({type(exc).__name__}: {exc}); every "
                f"figure is in its rows, `{state}`.\n")
    staging.write_text(text)
    staging.replace(output)


STOPPED = {"deadline": "by the deadline", "slower": "a larger micro-batch ran slower"}


def _tuned_setup(result: dict) -> str:
    """The packing and attention a T row ran (rows from before the bench recorded it ran BFD
    padding-free rows on SDPA where FlashAttention-2 was not installed); "" for a failed try of
    those rows, which trained nothing."""
    import throughput

    return result.get("setup") or ("" if result.get("ok") is False else throughput.LEGACY_SETUP)


def _gib(value) -> str:
    return f"{value / GIB:.2f}" if value else "n/a"


def render(rows: list[dict], state: Path) -> str:
    import throughput

    calls = [row for row in rows if row.get("kind") == "call"]
    device = calls[0]["device"] if calls else "unknown"
    on_cuda = bool(calls and calls[0].get("on_cuda"))
    peak = throughput.peak_flops(device) if on_cuda else None
    ends = {row.get("call"): row for row in rows if row.get("kind") == "call-end"}
    lines = ["# GPU truth in one lease", ""]
    if not on_cuda:
        lines += ["**No GPU figure exists in this report.** It was produced on a machine without a GPU, by the CPU path",
                  "(a tiny shape through the same code), which shows that the command, its rows and its resumption work,",
                  "not how fast or how well planned SFT-Play is on a GPU. Run `make bench-gpu` on one (an H100 is the",
                  "reference).", "", "These rows await a GPU: " + ", ".join(task["key"] for task in gpu_plan()) + ".",
                  ""]
    lines += [f"- device: {device}" + (f"; dense bf16 peak for MFU: {peak / 1e12:.0f} TFLOP/s" if peak else ""),
              f"- versions: {calls[0]['versions'] if calls else versions()}", f"- rows: `{_shown(state)}`"]
    for number, call in enumerate(calls, 1):
        end = ends.get(call.get("call"))
        took = f"{end['seconds']:.0f} s, {end['done']} task(s)" + (", cut by its deadline" if end.get("cut") else "") \
            if end else "did not finish (cut short)"
        lines.append(f"- call {number}: `{call['command']}` ({took})")
    lines += ["- sides (bench/throughput.py): A, TRL's SFTTrainer with its defaults (micro-batch 4, no packing); T, TRL",
              "  tuned (bf16, its BFD packing with padding-free rows on FlashAttention-2 where installed, else its",
              "  wrapped rows on SDPA, fused AdamW; the setup it ran is in its row);",
              "  T+liger, T with TRL's Liger kernels at T's micro-batch; B, SFT-Play planned and packed; B+lever, B with",
              "  one kernel switch on (flex attention, compiled layers, Liger kernels, expandable segments)",
              "- each task a fresh process; T: one process tries micro-batches in increasing order (doubling from half",
              "  B's until one runs out of memory or runs slower than one before), each try on freshly loaded weights",
              "  with its own warm-up; T is the",
              "  fastest try. Tokens are real (non-pad) tokens; MFU: model FLOPs per token (6N full, 4N + 6N_lora",
              "  adapters) x tokens/s over the GPU's dense bf16 peak; B over T: over the faster of T and T+liger", ""]
    results = {row["task"]: row["result"] for row in rows if row.get("kind") in DONE_KINDS and "task" in row}
    flops = {}

    known = {case.name: case for case in throughput.GPU_CASES + throughput.CPU_CASES}

    def mfu(name: str, tps: float) -> str:
        if not peak or name not in known:
            return "n/a"
        if name not in flops:
            flops[name] = throughput.flops_per_token(known[name])
        return f"{100 * flops[name] * tps / peak:.1f}%"

    speed = [(key, result) for key, result in results.items() if key[0] in "ABT"]
    if speed:
        lines += ["## Throughput", "", "| case | side | micro x accumulation | tokens/s | peak GiB (allocated) | MFU | loss (last steps) "
                  "| B over T |", "|---|---|---|---|---|---|---|---|"]
        for key, result in speed:
            side, name = key.split(" ", 1)
            if result.get("ok") is False:
                lines.append(f"| {name} | {side} | - | failed: {result.get('error')} | | | | |")
                continue
            tps = result.get("tokens_per_second", 0.0)
            baselines = [results.get(f"{t} {name}", {}) for t in ("T", "T+liger")]
            baselines = [t for t in baselines if t and t.get("ok", True) is not False]
            tuned = max((t.get("tokens_per_second") or 0 for t in baselines), default=0)
            unfair = on_cuda and any(_tuned_setup(t) == throughput.LEGACY_SETUP for t in baselines)
            ratio = ("not compared: T ran " + throughput.LEGACY_SETUP if unfair else f"{tps / tuned:.2f}x") \
                if side.startswith("B") and tuned else ""
            batch = f"{result.get('micro_batch')} x {result.get('accumulation', 1)}" + (
                f" ({_tuned_setup(result)})" if side.startswith("T") and on_cuda else "") + (
                f" (search stopped: {STOPPED[result['stopped']]})" if result.get("stopped") else "")
            lines.append(f"| {name} | {side} | {batch} | {tps:,.0f} | {_gib(result.get('peak_bytes'))} | "
                         f"{mfu(name, tps)} | "
                         f"{result.get('last_loss', float('nan')):.3f} | {ratio} |")
        if on_cuda and any(_tuned_setup(r) == throughput.LEGACY_SETUP for k, r in speed if k.startswith("T")):
            lines += ["", f"T rows marked \"{throughput.LEGACY_SETUP}\" are no baseline: BFD packing makes TRL flatten "
                      "the micro-batch into one sequence (padding-free), which it supports with FlashAttention only; "
                      "on SDPA each step attends over micro x seq tokens, slower with every micro-batch (their tries "
                      "below). No B-over-T figure is drawn from them; the bench now runs TRL's wrapped rows there."]
        tries = [(row["task"], row["result"]) for row in rows if row.get("kind") == "T-try"]
        if tries:
            lines += ["", "T's search, try by try (`micro`: tokens/s, peak GiB):", ""]
            by_task: dict[str, list[str]] = {}
            for key, attempt in tries:
                shown = (f"{attempt.get('micro_batch')}: {attempt.get('error')}" if attempt.get("ok") is False else
                         f"{attempt.get('micro_batch')}: {attempt.get('tokens_per_second', 0):,.0f}, "
                         f"{_gib(attempt.get('peak_bytes'))}")
                setup = _tuned_setup(attempt) if on_cuda else ""
                by_task.setdefault(f"{key} ({setup})" if setup else key, []).append(shown)
            lines += [f"- {key}: " + "; ".join(shown) for key, shown in by_task.items()]
        lines.append("")
    timed = [(key, result) for key, result in results.items() if key.startswith("B") and result.get("ok") is not False]
    if timed:
        lines += ["## Time and memory the planner predicted for side B", "",
                  "| case | s/step: predicted / measured | error | peak GiB: predicted / measured | error |",
                  "|---|---|---|---|---|"]
        for key, result in timed:
            predicted, measured = result.get("predicted_step_seconds"), result.get("measured_step_seconds")
            timing = (f"{predicted:.3f} / {measured:.3f} | {100 * (predicted - measured) / measured:+.1f}%"
                      if predicted and measured else f"n/a / {measured or 0:.3f} | n/a (no GPU to time)")
            p_peak, m_peak = result.get("predicted_peak"), result.get("reserved_bytes")
            memory = (f"{_gib(p_peak)} / {_gib(m_peak)} | {100 * (p_peak - m_peak) / m_peak:+.1f}%" if p_peak and m_peak
                      else f"{_gib(p_peak)} / n/a | n/a")
            lines.append(f"| {key} | {timing} | {memory} |")
        lines.append("")
    shapes = [(key, result) for key, result in results.items() if key.startswith("P ")]
    if shapes:
        lines += ["## The planner's peak on shapes", "",
                  "| shape | peak GiB: predicted / measured | error | live GiB: predicted / measured | "
                  "cache GiB: predicted / measured | s/step: predicted / measured |", "|---|---|---|---|---|---|"]
        errors = []
        for key, result in shapes:
            predicted, measured = result.get("predicted", {}), result.get("measured", {})
            if not measured.get("ok") or not measured.get("peak_bytes") or measured["peak_bytes"] <= 0:
                lines.append(f"| {key[2:]} | {_gib(predicted.get('peak_bytes'))} / ({measured.get('error') or result.get('error')}) | | | | |")
                continue
            error = (predicted["peak_bytes"] - measured["peak_bytes"]) / measured["peak_bytes"]
            errors.append(abs(error))
            steps = measured.get("step_seconds") or []  # (after the first step: its warm-up is not timed)
            timing = (f"{predicted['seconds_per_step']:.2f}" if predicted.get("seconds_per_step") else "n/a") + \
                (f" / {statistics.median(steps):.2f}" if steps else " / n/a")
            lines.append(f"| {key[2:]} | {_gib(predicted['peak_bytes'])} / {_gib(measured['peak_bytes'])} | "
                         f"{100 * error:+.1f}% | {_gib(predicted.get('allocated_bytes'))} / "
                         f"{_gib(measured.get('allocated_bytes'))} | {_gib(predicted.get('allocator_cache_bytes'))} / "
                         f"{_gib(measured.get('allocator_cache_bytes'))} | {timing} |")
        if errors and on_cuda:
            lines += ["", f"Peak: median absolute error {100 * statistics.median(errors):.1f}%, max "
                          f"{100 * max(errors):.1f}% over {len(errors)} shape(s)."]
        elif errors:
            lines += ["", "(CPU: the measured peak is the process's peak RSS above its RSS after imports; it checks the "
                          "plumbing, not the planner.)"]
        lines.append("")
    snapshots = [(key, result) for key, result in results.items() if key.startswith("S ")]
    if snapshots:
        lines += ["## The allocator on the GPU's own order (bench/memory_snapshot.py)", ""]
        for key, result in snapshots:
            lines += [f"- {key[2:]}: " + (f"failed: {result.get('error')}" if result.get("ok") is False else
                                          result.get("verdict", "").replace("\n", "; ") +
                                          f" (trace: `{result.get('trace')}`)")]
            if result.get("order"):
                lines += ["", "  The planner's order of allocations and frees of 16 MiB or more against the GPU's:", "",
                          "  ```", *(f"  {line}" for line in result["order"][:30]), "  ```", ""]
        lines.append("")
    lines += ["Targets (one H100): B >= 1.3x the best tuned TRL baseline on every row, with matching losses;",
              "MFU >= 45 % for 8B LoRA and >= 40 % for 0.5B full; predicted seconds per step within 15 % of measured;",
              "the planner's peak within its measured error (docs/PLANNER.md, section 6).", ""]
    built = [row for row in rows if row.get("kind") == "W"]
    if built:
        lines += ["## Setup", ""] + [f"- weights of {Path(row['model']).name} ({row['dtype']}): {row['message']}"
                                     for row in built] + [""]
    cut = [row["task"] for row in rows if row.get("kind") == "cut" and row["task"] not in results]
    left = [task["key"] for task in pending(gpu_plan() if on_cuda else cpu_plan(), rows)]
    lines += ["## Not measured yet", ""]
    if left:
        lines += [f"{len(left)} task(s) left for the next call with the same rows: " + ", ".join(left) + "."]
        if cut:
            lines += ["", "Cut short by a call's deadline (they run again): " + ", ".join(dict.fromkeys(cut)) + "."]
    else:
        lines += ["Nothing: every task of both phases has its row."]
    return "\n".join(lines) + "\n"


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


# --- the command ----------------------------------------------------------------------------------

def detect_device() -> tuple[bool, str]:
    """(whether the tasks run on a GPU, its name), without creating a CUDA context here (the
    workers measure alone on it); NVML first, so that a machine without a GPU answers at once."""
    cpu = f"CPU ({os.cpu_count()} cores), no GPU"
    try:
        import pynvml

        pynvml.nvmlInit()
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
    except Exception:  # noqa: BLE001 - no NVML, no driver or no GPU
        return False, cpu
    import torch

    if not torch.cuda.is_available():  # a GPU this torch cannot use: the CPU path
        return False, cpu
    return True, name.decode() if isinstance(name, bytes) else str(name)


# The GPUs a lease lends, as their own NVML reports them (name, total memory)
LENT = {"h100": ("NVIDIA H100 80GB HBM3", 81_559 * 1024**2), "h200": ("NVIDIA H200", 143_771 * 1024**2)}


def dry_run(tasks: list[dict], lent: str, minutes: float) -> list[str]:
    """The GPU plan's tasks in order, each planned here as the lease will measure it (its config
    loaded, its prediction made on the lent GPU) with its estimated seconds: a rehearsal that needs
    no GPU and catches a task that cannot be planned, or that is sized past TASK_SECONDS."""
    import planner_accuracy
    import throughput

    from sft_play import config as config_module
    from sft_play import planner
    from sft_play.planner import Target

    name, memory = LENT[lent]
    target = Target(1, memory, name, gpu_model=name)
    lines = [(f"Dry run: {len(tasks)} task(s) as `make bench-gpu` runs them on one {name} ({memory / GIB:.0f} GiB); "
              f"estimated seconds: setup as the last lease took it, plus the plan's steps. A call stops starting "
              f"tasks after {minutes:g} minutes."), "",
             "| # | task | phase | planned peak GiB | planned s/step | estimated s | minutes so far | call |",
             "|---|---|---|---|---|---|---|---|"]
    built: set[str] = set()
    clock, total, call = 0.0, 0.0, 1
    for number, task in enumerate(tasks, 1):
        kind = task["kind"]
        peak = step = None
        try:
            if kind in {"P", "S"}:
                shape = Shape(**task["shape"])
                case = _case_of(shape, model_folder(task))
                predicted, _ = planner_accuracy.predict(case, shape.micro, target)
                peak, step = predicted["peak_bytes"], predicted["seconds_per_step"]
                seconds = SETUP_SECONDS[kind] + (shape.steps + 1) * (step or 0)
            else:
                case = throughput.Case(**task["case"])
                config = config_module.load(None, throughput.sft_play_overrides(case, "/tmp/unused", 8, task["global_batch"],
                                                                                task.get("lever", "")),
                                            check_paths=False)
                plan = planner.make_plan(config, target, options=planner.WITHOUT_REMEDIES)
                peak, step = plan.peak_bytes_per_gpu, (plan.time or {}).get("seconds_per_step")
                seconds = SETUP_SECONDS[kind] + (8 * (step or 0) if kind != "T" else 0)
        except Exception as exc:  # noqa: BLE001 - what the lease would have hit: said in its row
            lines.append(f"| {number} | {task['key']} | {task['phase']} | cannot be planned: "
                         f"{type(exc).__name__}: {str(exc)[:200]} | | | | |")
            continue
        folder = model_folder(task)
        if folder not in built:
            built.add(folder)
            seconds += SETUP_SECONDS["W"]
        if clock + seconds > 60 * minutes:
            clock, call = 0.0, call + 1
        clock += seconds
        total += seconds
        over = " **over its 3 minutes**" if seconds > TASK_SECONDS else ""
        lines.append(f"| {number} | {task['key']} | {task['phase']} | {_gib(peak)} | "
                     f"{f'{step:.2f}' if step else 'n/a'} | {seconds:.0f}{over} | {total / 60:.1f} | {call} |")
    return lines


def _case_of(shape: Shape, folder: str):
    """planner_accuracy's case for a P or S task's shape."""
    import planner_accuracy

    return planner_accuracy.Case(folder, shape.method, shape.seq_len, shape.checkpointing, (shape.micro,),
                                 levers=tuple(o for lever in shape.levers for o in ROW_LEVERS[lever]),
                                 pixels=shape.pixels, objective=shape.objective, steps=shape.steps)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=None,
                        help="start no task after this many minutes, cut the one running (default 8 on a GPU)")
    parser.add_argument("--phase", choices=["1", "all"], default="all",
                        help="1: only the first report's tasks; all (default): phase 2 after them while time is left")
    parser.add_argument("--state", default=str(REPORTS / "gpu_lease.jsonl"), help="the rows (JSON lines)")
    parser.add_argument("--output", default=str(REPORTS / "gpu_lease.md"), help="the report")
    parser.add_argument("--shape", action="append", default=[], metavar="SPEC",
                        help="also measure the planner on a config folder: FOLDER[,method=lora][,seq=2048][,ckpt=on]"
                             "[,micro=2][,layers=N] (first in phase 1; repeatable)")
    parser.add_argument("--max-tasks", type=int, default=None, help="run at most this many tasks in this call")
    parser.add_argument("--keep-weights", action="store_true", help="keep the weights this call builds")
    parser.add_argument("--dry-run", choices=sorted(LENT), nargs="?", const="h100", default=None, metavar="GPU",
                        help="measure nothing: plan every GPU task here as it will run on that GPU (h100, the "
                             "default, or h200), with its estimated seconds, and print the order")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        spec = json.loads(args.worker)
        task = spec["task"]
        lean(task["case"]["method"] if "case" in task else task["shape"]["method"])
        import_training_stack()
        print(json.dumps(run_task(spec["task"], Path(spec["state"]), Path(spec["output"]), spec["on_cuda"])))
        return 0
    try:
        shapes = [Shape.parse(text) for text in args.shape]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    lean()  # every measurement runs in a worker of its own
    if args.dry_run:
        tasks = [task for task in [shape_task(shape, 1) for shape in shapes] + gpu_plan()
                 if args.phase == "all" or task["phase"] == 1][:args.max_tasks]
        began = time.time()
        lines = dry_run(tasks, args.dry_run, args.minutes if args.minutes is not None else 8.0)
        from tiny_default import hardware_line

        print("\n".join(["# The GPU lease's tasks, planned before it", "",
                         f"`python bench/lease.py {' '.join(sys.argv[1:])}`, planned on {hardware_line()} in "
                         f"{time.time() - began:.0f} s (planning is CPU work; nothing here ran on a GPU).", "", *lines]),
              flush=True)
        return 0

    on_cuda, device = detect_device()
    state, output = Path(args.state), Path(args.output)
    rows = read_rows(state)
    measured_on = {row["device"] for row in rows if row.get("kind") == "call"}
    if measured_on and measured_on != {device}:
        print(f"error: the rows in {state} were measured on {', '.join(sorted(measured_on))}, this is {device}; "
              "give this device its own --state (and --output)", file=sys.stderr)
        return 2
    minutes = args.minutes if args.minutes is not None else (8.0 if on_cuda else None)
    started = time.time()
    deadline = started + 60 * minutes if minutes else None
    plan = [shape_task(shape, 1) for shape in shapes] + (gpu_plan() if on_cuda else cpu_plan())
    todo = [task for task in pending(plan, rows) if args.phase == "all" or task["phase"] == 1]
    if args.max_tasks is not None:
        todo = todo[:args.max_tasks]
    call = f"{int(started)}-{os.getpid()}"
    command = "make bench-gpu" + (f' ARGS="{" ".join(sys.argv[1:])}"' if len(sys.argv) > 1 else "")
    append_row(state, {"kind": "call", "call": call, "device": device, "on_cuda": on_cuda, "versions": versions(),
                       "command": command, "minutes": minutes})
    render_to(state, output)
    print(f"{device}: {len(todo)} task(s) to run; rows -> {state}, report -> {output}", flush=True)
    built: list[Path] = []
    done, cut = 0, False
    for index, task in enumerate(todo):
        left = deadline - time.time() if deadline else None
        if left is not None and left < MIN_SECONDS_LEFT:
            cut = True
            break
        if task["kind"] == "T":  # the search starts from half B's micro-batch; T+liger runs at T's
            name = task["case"]["name"]
            found = {row["task"]: row["result"] for row in read_rows(state) if row.get("kind") in {"B", "T"}}
            task = {**task, "start": max(1, (found.get(f"B {name}", {}).get("micro_batch") or 8) // 2) if on_cuda
                    else 8, "micro": found.get(f"T {name}", {}).get("micro_batch")}
        if on_cuda:
            folder, dtype, target = weights_for(task)
            if target is not None and not target.exists():
                began = time.time()
                message = build_weights(folder, dtype, int(left or 1800))
                append_row(state, {"kind": "W", "model": folder, "dtype": dtype, "seconds": time.time() - began,
                                   "message": message})
                if not target.exists():  # timed out or failed: no half-written copy stays on the disk, and the
                    for staging in target.parent.glob(f".{target.name}-*"):  # task waits for the next call
                        shutil.rmtree(staging, ignore_errors=True)  # (a worker would build them on the CPU)
                    append_row(state, {"kind": "cut", "task": task["key"], "why": f"weights: {message}"})
                    render_to(state, output)
                    continue
                built.append(target)
                left = deadline - time.time() if deadline else None
                if left is not None and left < MIN_SECONDS_LEFT:
                    cut = True
                    break
        append_row(state, {"kind": "start", "task": task["key"], "spec": task})
        print(f"[{time.time() - started:5.0f} s] {task['key']}", flush=True)
        # a task has TASK_SECONDS (T's search stops itself a little before); the call's deadline may come first
        allowed = min(left, TASK_SECONDS) if left is not None else TASK_SECONDS if on_cuda else 3600
        spec = {"task": {**task, "deadline": time.time() + allowed - 20}, "state": str(state), "output": str(output),
                "on_cuda": on_cuda}
        result = run_worker(__file__, spec, timeout=int(allowed))
        rows = read_rows(state)
        since = max(i for i, row in enumerate(rows) if row.get("kind") == "start" and row.get("task") == task["key"])
        if task["key"] in {row.get("task") for row in rows[since:] if row.get("kind") in DONE_KINDS}:
            done += 1  # its row of this call (a T of an old setup has an older one)
        elif result.get("error") == "timeout" and deadline and time.time() >= deadline - 1:
            append_row(state, {"kind": "cut", "task": task["key"]})
            cut = True
        else:  # the worker died before its row, or overran its time: the failure is the row
            error = result.get("error", "no result")
            append_row(state, {"task": task["key"], "kind": task["kind"], "result": {"ok": False, "error": (
                f"over its {TASK_SECONDS} s (sized too large for a lease)" if error == "timeout" else error)}})
            done += 1
        render_to(state, output)
        if built and not args.keep_weights:  # disk: weights no later task of this call needs go
            needed = {weights_for(later)[2] for later in todo[index + 1:]} if on_cuda else set()
            for folder in [path for path in built if path not in needed]:
                shutil.rmtree(folder, ignore_errors=True)
                built.remove(folder)
    append_row(state, {"kind": "call-end", "call": call, "seconds": time.time() - started, "done": done, "cut": cut})
    render_to(state, output)
    left = len(pending(plan, read_rows(state)))
    print(f"{done} task(s) measured in {time.time() - started:.0f} s; {left} left; report: {output}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
