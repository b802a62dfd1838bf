"""The GPU's own sequence of allocations for one shape, replayed through the planner's allocator.

The planner replays its traced training step through a simulation of PyTorch's caching allocator
(sft_play/planner/simulate/allocator.py). Where its allocator cache is off (Gemma-2-9B's eager attention
on an H200: 2.45 GiB replayed, 4.98 GiB measured, docs/PLANNER.md section 6), one question splits
the cause in two: fed the GPU's own allocations and frees, in the GPU's order, does the simulation
reserve what the GPU reserved?

- yes: the allocator's rules are right, and the planner's traced event order differs from the
  GPU's; the trace's large allocations, with the Python line that made each, show where;
- no: a rule of the allocator differs; the replay names the first allocation after which the
  simulation and the GPU hold different reserved memory (more than 64 MiB apart).

On a GPU the script trains a shape (bench/lease.py's --shape syntax, bench/shapes.py) for
planner_accuracy's 3 steps with ``torch.cuda.memory._record_memory_history`` on, and writes the
GPU's trace compactly (--output, gzipped JSON): every allocation, completed free and segment of the allocator with its
size and address, the Python line that made each allocation of 1 MiB or more, and the
allocator's statistics; then it replays the trace and prints the verdict. Anywhere, --replay
FILE replays a written trace. Random weights are built on the GPU first (bench/prepare_weights.py),
as the lease does.

Usage (on the lent machine: about a minute for Gemma-2 with 12 layers, weights included):
  python3 bench/memory_snapshot.py gemma-2-9b,method=lora,seq=2048,ckpt=on,micro=8,layers=12 \\
      --output $OUT/gemma2-trace.json.gz
  python bench/memory_snapshot.py --replay gemma2-trace.json.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
from pathlib import Path

from _common import lean  # bench/ is the script's folder
from shapes import Shape, build_weights, model_folder, shape_task, weights_for

MAX_ENTRIES = 4_000_000  # trace entries kept; a trace that reached it lost its start and cannot be replayed
FRAME_FROM = 1 << 20  # allocations this large keep the Python line that made them
DIVERGENCE = 64 << 20  # reserved memory this far apart: the simulation and the GPU have parted
OWN_CODE = ("transformers/", "peft/", "trl/", "sft_play/", "accelerate/", "torch/utils/checkpoint", "torch/optim/")
# The allocator's trace actions kept, by one letter: an allocation, a completed free (the block is
# back in the pool), a segment from cudaMalloc, a segment back to CUDA
ACTIONS = {"alloc": "a", "free_completed": "f", "segment_alloc": "s", "segment_free": "r"}


def _frame(frames: list[dict]) -> str:
    """The most telling Python frame of an allocation: the first in the model's or trainer's code."""
    for frame in frames:
        if any(part in frame.get("filename", "") for part in OWN_CODE):
            return f"{frame['filename'].split('site-packages/')[-1]}:{frame.get('line')} {frame.get('name')}"
    return f"{frames[0].get('filename', '?')}:{frames[0].get('line')} {frames[0].get('name')}" if frames else ""


def compact(snapshot: dict, stats: dict, device: int = 0) -> dict:
    """The parts of ``torch.cuda.memory._snapshot()`` the replay needs, small enough to travel."""
    entries = snapshot["device_traces"][device]
    frames: list[str] = []
    index: dict[str, int] = {}
    events = []
    for entry in entries:
        action = ACTIONS.get(entry["action"])
        if action is None:
            continue
        frame = -1
        if action == "a" and entry["size"] >= FRAME_FROM and entry.get("frames"):
            text = _frame(entry["frames"])
            frame = index.setdefault(text, len(frames))
            if frame == len(frames):
                frames.append(text)
        events.append([action, entry["addr"], entry["size"], frame])
    keep = ("reserved_bytes.all.peak", "allocated_bytes.all.peak", "segment.all.peak", "num_device_alloc",
            "num_alloc_retries", "inactive_split_bytes.all.peak", "num_ooms")
    streams = sorted({entry.get("stream", 0) for entry in entries if entry["action"] in ACTIONS})
    return {"events": events, "frames": frames, "stats": {k: stats.get(k) for k in keep},
            "truncated": len(entries) >= MAX_ENTRIES, "streams": len(streams)}


def replay(trace: dict) -> dict:
    """Feed the GPU's allocations and frees, in its order, to the simulated allocator: its peak
    reserved and segments against the GPU's, and where the two first part.

    A segment the GPU gives back (``segment_free``) comes from a release of the cache: the
    trainer's ``empty_cache`` as training starts (accelerate's ``free_memory``), or a retry after
    a failed cudaMalloc; both hand back every completely free segment, and so does the
    simulation there. The peaks are those after the last such release (training, not loading),
    and a new segment starts at the GPU's address for it, which orders equal-sized blocks."""
    from sft_play.planner.simulate.allocator import CachingAllocator

    sim = CachingAllocator()
    frames = trace["frames"]
    real = real_peak = sim_peak = real_segments = 0
    first = None
    address_of_segment = None
    previous = ""
    recent: list[str] = []  # the large allocations before the parting, the latest last
    for number, (action, address, size, frame) in enumerate(trace["events"]):
        if action == "s":
            real += size
            real_segments += 1
            address_of_segment = address
        elif action == "r":
            if previous != "r":
                sim._release_cache()  # noqa: SLF001 - the same release the GPU made
            real -= size
            real_peak, sim_peak = real, sim.reserved  # peaks count from the last release on
        elif action == "f":
            sim.free(address)
        elif action == "a":
            sim.segment_address = address_of_segment
            sim.malloc(address, size)
            sim.segment_address = address_of_segment = None
            if size >= FRAME_FROM:
                recent = (recent + [f"{size / 2**20:,.0f} MiB at {frames[frame] if frame >= 0 else '?'}"])[-6:]
            if first is None and abs(sim.reserved - real) > DIVERGENCE:
                first = {"event": number, "size": size, "made_at": frames[frame] if frame >= 0 else "",
                         "gpu_reserved": real, "simulated_reserved": sim.reserved, "large_allocations_before": recent}
        real_peak, sim_peak = max(real_peak, real), max(sim_peak, sim.reserved)
        previous = action
    stats = trace.get("stats", {})
    return {
        "streams": trace.get("streams", 1),
        "events": len(trace["events"]),
        "truncated": bool(trace.get("truncated")),
        "gpu_peak_reserved": real_peak,
        "simulated_peak_reserved": sim_peak,
        "gpu_stats_peak_reserved": stats.get("reserved_bytes.all.peak"),  # torch's, reset after loading
        "gpu_stats_peak_allocated": stats.get("allocated_bytes.all.peak"),
        "gpu_segments": real_segments,
        "simulated_segments": sim._segments,  # noqa: SLF001
        "releases": sim.releases,
        "first_parting": first,
    }


COMPARE_FROM = 16 << 20  # the order compared: allocations and frees of blocks this large


def gpu_order(trace: dict, threshold: int = COMPARE_FROM) -> list[tuple[str, int, str]]:
    """The GPU's training order: ("a" or "f", size, the Python line that allocated it) for every
    block of at least COMPARE_FROM bytes after the last release of the cache (the trainer's start),
    leaving out the optimizer's own (created lazily at the first step; the planner creates its
    states up front)."""
    events = trace["events"]
    start = max((i for i, event in enumerate(events) if event[0] == "r"), default=-1) + 1
    frames = trace["frames"]
    live: dict[int, tuple[int, str]] = {}
    order = []
    for action, address, size, frame in events[:start]:
        if action == "a":
            live[address] = (size, "")
        elif action == "f":
            live.pop(address, None)
    for action, address, size, frame in events[start:]:
        if action == "a":
            made = frames[frame] if frame >= 0 else ""
            live[address] = (size, made)
            if size >= threshold and "torch/optim/" not in made:
                order.append(("a", size, made))
        elif action == "f" and address in live:
            size, made = live.pop(address)
            if size >= threshold and "torch/optim/" not in made:
                order.append(("f", size, made))
    return order


def planned_order(fields: dict, threshold: int = COMPARE_FROM) -> list[tuple[str, int, str]]:
    """The planner's order for the same shape (bench/shapes.py Shape fields): its replay's
    allocations and frees of at least COMPARE_FROM bytes, with their categories, leaving out the
    weights and the optimizer's states (allocated before training on the GPU)."""
    import planner_accuracy

    from sft_play.planner import Target
    from sft_play.planner.simulate.predict import replay_step

    shape = Shape(**fields)
    folder = model_folder(shape_task(shape, 1))
    case = planner_accuracy.Case(folder, shape.method, shape.seq_len, shape.checkpointing, (shape.micro,))
    # the order does not depend on the GPU's size: any CUDA target resolves the same run
    _, model, run = planner_accuracy.resolved(case, shape.micro, Target(1, 80 << 30, "NVIDIA H100 80GB HBM3"))
    log: list = []
    replay_step(model, run, shape.micro, False, None, log=log)
    sizes: dict = {}
    order = []
    for entry in log:
        if entry[0] == "a":
            _, handle, size, category = entry
            sizes[handle] = (size, category)
            if size >= threshold and category not in ("weights", "optimizer_states"):
                order.append(("a", size, category))
        else:
            size, category = sizes.pop(entry[1])
            if size >= threshold and category not in ("weights", "optimizer_states"):
                order.append(("f", size, category))
    return order


def first_differences(gpu: list[tuple[str, int, str]], planned: list[tuple[str, int, str]],
                      count: int = 3, context: int = 4) -> list[str]:
    """Where the planner's order of large allocations and frees first differs from the GPU's
    (difflib's alignment of the (action, size) sequences, so that one extra event does not shift
    everything after it): up to `count` differences, each with `context` events either side."""
    import difflib

    def shown(events, low, high):
        return [f"{a} {size / 2**20:,.1f} MiB {where}".rstrip() for a, size, where in events[max(0, low):high]]

    matcher = difflib.SequenceMatcher(None, [e[:2] for e in gpu], [e[:2] for e in planned], autojunk=False)
    lines = []
    for tag, g1, g2, p1, p2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        lines += [f"{tag} at GPU event {g1} / planned event {p1}:",
                  *(f"  GPU     {text}" for text in shown(gpu, g1 - context, g2 + context)),
                  *(f"  planned {text}" for text in shown(planned, p1 - context, p2 + context))]
        count -= 1
        if not count:
            break
    return lines or ["the planner's order of large allocations and frees is the GPU's"]


def examine(trace: dict, compare: bool = True) -> dict:
    """What a trace says: the replay in the GPU's order with its verdict, and with `compare`
    where the planner's order of large allocations and frees first differs from the GPU's (a
    comparison that fails is said in its place: the verdict stands without it)."""
    result = replay(trace)
    result["verdict"] = verdict(result)
    if compare:
        try:
            result["order"] = first_differences(gpu_order(trace), planned_order(trace["shape_fields"]))
        except Exception as exc:  # noqa: BLE001 - the trace and its verdict are kept all the same
            result["order"] = [f"not compared: {type(exc).__name__}: {exc}"[:300]]
    return result


def verdict(result: dict) -> str:
    gib = 2**30
    lines = [f"{result['events']:,} events; peak reserved after the last release of the cache: GPU "
             f"{result['gpu_peak_reserved'] / gib:.2f} GiB, simulated {result['simulated_peak_reserved'] / gib:.2f} GiB; "
             f"segments made: GPU {result['gpu_segments']}, simulated {result['simulated_segments']}"]
    if result["streams"] > 1:
        lines.append(f"the GPU used {result['streams']} streams, whose blocks it does not share; the simulation "
                     "has one: a parting may come from that alone")
    if result["truncated"]:
        lines.append("the trace reached its entry limit and lost its start: no verdict")
    elif result["first_parting"] is None:
        lines.append("the simulation reserves what the GPU reserved, in the GPU's order: the allocator's rules hold, "
                     "and the planner's traced event order is what differs")
    else:
        part = result["first_parting"]
        lines += [f"the simulation parts from the GPU at event {part['event']:,}: an allocation of "
                  f"{part['size'] / 2**20:,.1f} MiB made at {part['made_at'] or '?'} (GPU {part['gpu_reserved'] / gib:.2f} "
                  f"GiB reserved, simulated {part['simulated_reserved'] / gib:.2f}): an allocator rule differs",
                  "large allocations before it:", *(f"  {text}" for text in part["large_allocations_before"])]
    return "\n".join(lines)


def record(spec: str, output: Path) -> dict:
    """Parse `spec` (bench/lease.py's --shape syntax), build the weights it needs, and record it."""
    shape = Shape.parse(spec)
    lean(shape.method)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("error: recording the allocator's history needs a CUDA GPU (--replay works anywhere)")
    task = shape_task(shape, 1)
    folder, dtype, target = weights_for(task)
    if target is not None and not target.exists():
        print(build_weights(folder, dtype, 900), flush=True)
    trace = record_shape(shape, model_folder(task), output)
    print(f"trace of {spec}: {len(trace['events']):,} events -> {output}")
    return trace


def record_shape(shape, folder: str, output: Path) -> dict:
    """Train `shape` (a bench/shapes.py Shape, its weights built) from `folder` with the allocator's
    history on; write the compact trace to `output` and return it."""
    import planner_accuracy
    import torch

    case = planner_accuracy.Case(folder, shape.method, shape.seq_len, shape.checkpointing, (shape.micro,))
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                             max_entries=MAX_ENTRIES)
    try:
        with tempfile.TemporaryDirectory() as workdir:
            measured = planner_accuracy._worker(case, shape.micro, workdir)
        trace = compact(torch.cuda.memory._snapshot(), torch.cuda.memory_stats())
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    trace.update(shape=shape.label, shape_fields=shape.fields(), measured=measured,
                 device=torch.cuda.get_device_name(0), torch=torch.__version__)
    output.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(output, "wt") as handle:
        json.dump(trace, handle)
    return trace


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", nargs="?", help="FOLDER[,method=lora][,seq=2048][,ckpt=on][,micro=2][,layers=N]")
    parser.add_argument("--output", default="memory-trace.json.gz", help="where the GPU's trace goes (gzipped JSON)")
    parser.add_argument("--replay", metavar="FILE", help="replay a written trace instead of recording one")
    parser.add_argument("--compare", action="store_true",
                        help="also compare the planner's order of large allocations and frees with the GPU's")
    args = parser.parse_args()
    if args.replay:
        path = Path(args.replay)
        if not path.is_file():
            print(f"error: no trace at {path}", file=sys.stderr)
            return 2
        with gzip.open(path, "rt") as handle:
            trace = json.load(handle)
    elif args.shape:
        try:
            trace = record(args.shape, Path(args.output))
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    else:
        parser.error("give a shape to record (on a GPU) or --replay FILE")
    if args.compare:
        if "shape_fields" not in trace:
            print("error: this trace does not say which shape it is of", file=sys.stderr)
            return 2
        lean(trace["shape_fields"]["method"])
    result = examine(trace, args.compare)
    print("\n".join([result["verdict"], *result.get("order", [])]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
