"""Showing a plan: a readable table, one JSON document, and a picture of the memory per GPU."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from types import SimpleNamespace

from sft_play.parallelism import Strategy
from sft_play.planner.plan import Plan
from sft_play.planner.choose.remedies import REMEDIES, Remedy, command, plan_command
from sft_play.planner.present.evidence import lines as evidence_lines
from sft_play.units import GIB

# Breakdown terms in the order they are drawn and listed; labels for people.
TERM_LABELS = {
    "weights": "weights (+ adapters)",
    "reference": "reference copy (preference)",
    "gradients": "gradients",
    "optimizer_states": "optimizer states",
    "master_weights": "fp32 master weights",
    "ddp_buckets": "DDP gradient buckets",
    "zero_buffers": "ZeRO bucket buffers",
    "fsdp_buffers": "FSDP2 reduce-scatter and all-gather buffers",
    "cuda_runtime": "CUDA context + cuBLAS",
    "inputs": "batch, mask, rotary tables",
    "activations": "activations (forward)",
    "backward_working": "backward working set",
    "logits_loss": "loss head (chunked)",
    "reference_forward": "reference forward (preference)",
    "kl_forward": "policy forward of KTO's mismatched rows",
    "precompute_pass": "reference pass before training (preference)",
    "loading": "whole model as loaded, before it is sharded",
    "optimizer_step": "optimizer step temporaries",
    "allocator_cache": "allocator cache (freed, kept)",
    "smaller_batch": "a smaller micro-batch or shorter rows peak higher",
}


def gib(value: int) -> str:
    return f"{value / GIB:.2f}"


def to_json(plan: Plan, config_path: str | None = None, overrides: list[str] | tuple[str, ...] = (),
            hardware: str = "") -> str:
    """The plan as one JSON document; `config_path` and the user's `overrides` complete its
    command (where it fits) and the remedies', as in :func:`to_text`."""
    document = plan.to_dict()
    document["command"] = run_command(plan, config_path, overrides) if plan.fits else None
    for entry in document.get("remedies") or []:
        entry["command"] = _command(entry, plan, config_path, overrides)
        entry["plan_command"] = _command(entry, plan, config_path, overrides, hardware, planning=True)
    return json.dumps(document, indent=2)


def duration(seconds: float) -> str:
    """``0.4 ms``, ``2.35 s``, ``12.5 min``, ``3.20 h``: a time in the unit that reads best."""
    if seconds < 1:
        return f"{seconds * 1000:.2g} ms" if seconds < 0.01 else f"{seconds * 1000:.0f} ms"
    if seconds < 120:
        return f"{seconds:.2f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def to_text(plan: Plan, config_path: str | None = None, overrides: list[str] | tuple[str, ...] = (),
            hardware: str = "") -> str:
    """The plan as ``make plan`` prints it; `config_path` and the user's `overrides` complete the
    remedies' commands, and `hardware` (the variables that described the GPUs: ``VRAM_GIB=80``)
    the ``make plan`` beside each that plans it."""
    lines = [
        f"Model    {plan.model}: {plan.total_params:,} parameters, {plan.trainable_params:,} trainable ({plan.method})"
        + (f"; mixture of experts ({plan.experts}): {plan.active_params:,} active per token" if plan.experts else ""),
        "         by kind: " + ", ".join(f"{k} {v:,}" for k, v in plan.params_by_kind.items() if v),
        f"Hardware {plan.device}; {plan.strategy}, world size {plan.world_size}",
        f"Recipe   weights {plan.precision['weights']}, compute {plan.precision['compute']} "
        f"(mixed precision {plan.precision['mixed']}), attention {plan.attention}"
        f"{' with a mask' if plan.attention_mask else ' with a mask on its sliding-window layers' if plan.sliding_window_mask else ''}, "
        f"gradient checkpointing {'on' if plan.gradient_checkpointing else 'off'}",
        f"Sequence {plan.sequence_length} tokens: {plan.sequence_length_source}",
        "",
        f"  {'per-GPU memory term' if plan.on_cuda else 'per-process memory term (host)':<32} {'GiB':>9} {'share':>7}",
    ]
    total = max(1, plan.peak_bytes_per_gpu)
    for term, value in plan.breakdown.items():
        if value:
            lines.append(f"  {TERM_LABELS.get(term, term):<32} {gib(value):>9} {100 * value / total:>6.1f}%")
    lines += [
        f"  {'predicted peak':<32} {gib(plan.peak_bytes_per_gpu):>9}   (live tensors at most "
        f"{gib(plan.allocated_bytes_per_gpu)})",
        f"  {'budget (free less margin)':<32} {gib(plan.budget_bytes_per_gpu):>9}   of {gib(plan.free_bytes_per_gpu)} free",
        "",
        f"Plan     {plan.describe()}  {'FITS' if plan.fits else 'DOES NOT FIT'}",
    ]
    if plan.fits:
        lines.append(f"Run      {run_command(plan, config_path, overrides)}")
    if plan.time:
        t = plan.time
        run_part = (f"; {t['steps']} steps: {duration(t['wall_seconds'])}, {t['gpu_hours']:.1f} GPU-hours"
                    if t.get("wall_seconds") else "")
        lines.append(f"Time     {'' if plan.fits else '(were it to fit) '}about {t['tokens_per_second']:,.0f} tokens/s, "
                     f"{duration(t['seconds_per_step'])} per optimizer step{run_part}")
        lines += [f"  time: {source}" for source in t["sources"]]
        if t["seconds_per_step"] < 0.01:
            lines.append("  time: a step this short is not what the time model counts (FLOPs and communication): "
                         "kernel launches, Python and the data loader dominate it, so expect far longer")
    if plan.evidence:
        lines += [f"{'Evidence' if i == 0 else '':<8} {line}" for i, line in enumerate(evidence_lines(plan.evidence))]
    lines += [f"  note: {note}" for note in plan.notes]
    lines += [f"  warning: {warning}" for warning in plan.warnings]
    if plan.remedies:
        lines += ["", "Remedies (those that fit first: on the hardware at hand, then the same training, then room to spare, "
                  "then the fastest; then the rest, cheapest first):"]
        for r in plan.remedies:
            outcome = f"fits, micro {r['micro_batch_size']}" if r["fits"] else "still too big"
            name = r["name"]
            if len(name) > 34:  # a combination: its names on a line of their own, the columns kept
                lines.append(f"  {name}")
                name = ""
            bound = ">=" if r.get("peak_is_lower_bound") else "  "  # weights and states alone, not replayed
            lines.append(f"  {name:<34} peak {bound}{gib(r['peak_bytes']):>7} GiB  {outcome:<16} {' '.join(r['change'])}")
            if r.get("host_bytes_per_node"):
                lines.append(f"  {'':<34} needs {gib(r['host_bytes_per_node'])} GiB of host memory per node")
            if r["fits"]:
                step = f", {duration(r['seconds_per_step'])} a step" if r.get("seconds_per_step") else ""
                room = "tight" if r["tight"] else "room to spare"
                lines.append(f"  {'':<34} {r['result_text']}, {gib(r['headroom_bytes'])} GiB left ({room}){step}")
                lines.append(f"  {'':<34} what it costs: {r['description']}")
                lines.append(f"  {'':<34} run:  {_command(r, plan, config_path, overrides)}")
                lines.append(f"  {'':<34} plan: {_command(r, plan, config_path, overrides, hardware, planning=True)}")
    if plan.smallest_hardware:
        lines.append(f"\nSmallest hardware that would run it: {plan.smallest_hardware}")
    lines.append(f"\nPlanned in {plan.plan_seconds:.2f} s.")
    return "\n".join(lines)


def run_command(plan: Plan, config_path: str | None, overrides=()) -> str:
    """The make command that trains the planned config on the planned hardware: the target its
    strategy launches with (one process without a launcher: ``make train``), its GPUs, the config
    and the user's overrides."""
    strategy = Strategy(plan.strategy)
    make_target = strategy.make_target if strategy.shards_states or plan.world_size > 1 else "train"
    as_planned = Remedy("as planned", "", (), make_target, lambda c, t: True)
    return command([as_planned], SimpleNamespace(world_size=plan.world_size if plan.on_cuda else 1), [], config_path,
                   [o for o in overrides if "=" in o])


def _command(entry: dict, plan: Plan, config_path: str | None, overrides, hardware: str = "",
             planning: bool = False) -> str:
    chosen = [r for r in REMEDIES if r.name in entry.get("remedies", [])]
    planned_on = SimpleNamespace(world_size=plan.world_size, on_cuda=plan.on_cuda)
    arguments = (chosen, planned_on, entry["change"], config_path, [o for o in overrides if "=" in o])
    return plan_command(*arguments, hardware) if planning else command(*arguments)


PLOTTED_BARS = 16  # more would not be readable on one screen


def _readable(candidates: list[dict], chosen: int) -> list[dict]:
    """At most :data:`PLOTTED_BARS` of `candidates` (in order): the first, the last, the chosen
    micro-batch and its neighbours, and between them others spread out (each the one farthest from
    those already kept)."""
    if len(candidates) <= PLOTTED_BARS:
        return candidates
    at = next((i for i, c in enumerate(candidates) if c["micro_batch_size"] == chosen), 0)
    kept = {0, len(candidates) - 1, *(i for i in (at - 1, at, at + 1) if 0 <= i < len(candidates))}
    while len(kept) < PLOTTED_BARS:
        kept.add(max(range(len(candidates)), key=lambda i: min(abs(i - k) for k in kept)))
    return [candidates[i] for i in sorted(kept)]


def plot_path(path: str | Path) -> Path:
    """`path` as :func:`plot` will write it, checked before planning: an image format matplotlib
    writes, not a folder, in a folder that is one or can be made.

    Raises:
        ValueError: what is wrong with it, in a sentence.
    """
    from matplotlib.backend_bases import FigureCanvasBase

    path = Path(path)
    formats = {f for f in FigureCanvasBase.get_supported_filetypes() if f != "pgf"}  # (pgf needs a LaTeX install)
    if path.is_dir():
        raise ValueError(f"PLOT={path} is a folder: name the image file to write in it (PLOT={path / 'plan.png'})")
    if path.suffix.lstrip(".").lower() not in formats:
        endings = ", ".join("." + f for f in sorted(formats))
        raise ValueError(f"PLOT={path}: the picture's name must end in one of {endings}")
    for folder in path.parents:
        if folder.exists():
            if not folder.is_dir():
                raise ValueError(f"PLOT={path}: {folder} is a file, not a folder")
            break
    return path


def plot(plan: Plan, path: str | Path) -> Path:
    """Stacked bars of the per-GPU breakdown for each candidate micro-batch, the budget as a line,
    the chosen micro-batch marked; written as an image to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    every = plan.candidates or [
        {"micro_batch_size": plan.micro_batch_size, "breakdown": plan.breakdown, "peak_bytes": plan.peak_bytes_per_gpu}
    ]
    candidates = _readable(every, plan.micro_batch_size)
    terms = [t for t in TERM_LABELS if any(c["breakdown"].get(t, 0) for c in candidates)]
    labels = [str(c["micro_batch_size"]) for c in candidates]
    figure, axes = plt.subplots(figsize=(max(6, 0.6 * len(candidates) + 3), 5))  # at most 12.6 in: one screen
    bottoms = [0.0] * len(candidates)
    colours = plt.get_cmap("tab20").colors
    for i, term in enumerate(terms):
        heights = [c["breakdown"].get(term, 0) / GIB for c in candidates]
        axes.bar(labels, heights, bottom=bottoms, label=TERM_LABELS[term], color=colours[i % len(colours)])
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    axes.axhline(plan.budget_bytes_per_gpu / GIB, color="red", linestyle="--", label="budget")
    chosen = labels.index(str(plan.micro_batch_size)) if str(plan.micro_batch_size) in labels else None
    if chosen is not None:
        mark = "chosen" if plan.fits else "does not fit"
        axes.annotate(mark, (chosen, bottoms[chosen]), textcoords="offset points", xytext=(0, 6), ha="center",
                      fontweight="bold", color="black" if plan.fits else "red")
    axes.set_xlabel("micro-batch size (sequences per GPU)")
    axes.set_ylabel("GiB per GPU")
    title = f"{Path(plan.model).name or plan.model} ({plan.method}), seq {plan.sequence_length}, {plan.device}"
    if len(candidates) < len(every):
        title += f" ({len(candidates)} of the {len(every)} micro-batches planned)"
    axes.set_title(textwrap.fill(title, 60), fontsize=9)
    axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
