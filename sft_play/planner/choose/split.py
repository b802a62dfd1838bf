"""Choosing the batch: the budget, the micro-batch size and the accumulation steps. Pure
arithmetic on the predictions the other planner modules produce."""

from __future__ import annotations

from collections.abc import Callable

from sft_play.run import BatchSplit
from sft_play.units import GIB


# Kinds of attention whose plans keep more than ``planner.safety_fraction`` free: the largest
# under-prediction measured for them, rounded up, and where it was measured. Eager attention's
# (batch, heads, seq, seq) score blocks leave an allocator cache the replay does not reproduce
# (docs/PLANNER.md, section 6; the measurement is in docs/reports/gpu_lease.md). Calibrated plans
# keep it too: a line through micro-batches 1 and 2 cannot see the cache a larger one leaves.
MEASURED_SHORTFALL = {
    "eager": (0.11, "10.6 % under the peak measured for Gemma-2-9B (12 layers) LoRA, seq 2048, micro 8, "
                    "checkpointing, on an H200 (docs/reports/gpu_lease.md)"),
}


def safety_fraction(configured: float, attention: str, on_cuda: bool = True) -> tuple[float, str | None]:
    """The share of free memory a plan keeps free: ``planner.safety_fraction``, or on GPUs, for an
    attention kernel whose prediction has been measured short by more, that shortfall (measured on
    CUDA's caching allocator: a CPU plan keeps the configured share); with the note that says why."""
    shortfall, where = MEASURED_SHORTFALL.get(attention, (0.0, "")) if on_cuda else (0.0, "")
    if shortfall <= configured:
        return configured, None
    return shortfall, (f"{100 * shortfall:.0f} % of free memory kept free, not planner.safety_fraction's "
                       f"{100 * configured:g} %: with {attention} attention the prediction was {where}")


def budget_bytes(free_bytes: int, margin_gib: float, fraction: float) -> int:
    """What the plan may use on one GPU: its free memory less the larger of a fixed margin and a
    share of the free memory (room for what no model predicts: other processes, driver
    growth, allocator behaviour on a new CUDA version)."""
    return int(free_bytes - max(margin_gib * GIB, fraction * free_bytes))


def split_global_batch(global_batch: int, world_size: int, micro: int, accum: int | None = None) -> BatchSplit:
    """The accumulation that makes ``micro x accum x world`` equal `global_batch`, or the nearest
    valid combination with a note saying what changed.

    Args:
        global_batch: sequences per optimizer step wanted across all processes.
        world_size: number of data-parallel processes.
        micro: sequences per process per forward pass.
        accum: accumulation steps when the config fixes them; None chooses them.
    """
    if accum is not None:
        split = BatchSplit(micro, accum, world_size, global_batch)
        if split.global_batch_size != global_batch:
            split = BatchSplit(
                micro, accum, world_size, global_batch,
                note=f"train.micro_batch_size and train.gradient_accumulation_steps are both set, so the global "
                f"batch is {split.global_batch_size}, not train.global_batch_size {global_batch}",
            )
        return split
    per_step = micro * world_size
    accum = max(1, round(global_batch / per_step))
    split = BatchSplit(micro, accum, world_size, global_batch)
    if split.global_batch_size != global_batch:
        return BatchSplit(
            micro, accum, world_size, global_batch,
            note=f"global batch {global_batch} is not a multiple of micro {micro} x world {world_size}; "
            f"using the nearest, {split.global_batch_size}",
        )
    return split


def largest_fitting_micro(fits: Callable[[int], bool], upper: int, guess: int | None = None) -> int:
    """The largest micro-batch in [1, upper] that fits (0 if none).

    Memory grows with the micro-batch. With a `guess` (where a straight line through two
    predictions crosses the budget) the answer is usually within a step or two of it, so it is
    walked from there; otherwise, or when the walk runs long, a binary search narrows it.
    """
    if upper < 1 or not fits(1):
        return 0
    if fits(upper):
        return upper
    low, high = 1, upper - 1  # fits(low); everything above high does not
    if guess is not None:
        guess = min(max(guess, 1), high)
        for _ in range(3):
            if fits(guess):
                low = guess
                if guess == high:
                    return low
                guess += 1
            else:
                high = guess - 1
                if high <= low:
                    return low
                guess -= 1
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


def choose_split(global_batch: int, world_size: int, fitting_micro: int, smallest: int = 1) -> BatchSplit:
    """The fastest split of `global_batch` whose micro-batch is at most `fitting_micro`, and at
    least `smallest` (the least the run can train at).

    Prefer an exact split (a divisor of the per-process batch) when its micro-batch is at least
    half the largest that fits; otherwise take the largest that fits and the nearest global batch
    (an exact split with a tiny micro-batch would waste the GPU), saying what changed.
    """
    per_process, remainder = divmod(global_batch, world_size)
    if per_process == 0:
        return BatchSplit(1, 1, world_size, global_batch,
                          note=f"global batch {global_batch} is smaller than the world size {world_size}; "
                          f"each process takes 1, so the global batch is {world_size}")
    capped = max(min(fitting_micro, per_process), smallest)
    if remainder == 0:
        exact = max((d for d in range(smallest, capped + 1) if per_process % d == 0), default=0)
        if exact and 2 * exact >= capped:
            return BatchSplit(exact, per_process // exact, world_size, global_batch)
    # No exact split worth taking: the nearest global batch with the largest micro-batch that fits,
    # or a larger one where the global batch changes anyway and it saves passes (global 12 on 8
    # GPUs becomes 16 as micro 2 x accum 1, not micro 1 x accum 2)
    candidates = [split_global_batch(global_batch, world_size, micro)
                  for micro in range(max(1, capped), max(1, capped, fitting_micro) + 1)]
    return min(candidates, key=lambda s: (abs(s.global_batch_size - global_batch), s.gradient_accumulation_steps,
                                          -s.micro_batch_size))


def decide_split(global_batch: int, world_size: int, micro: int | str, accum: int | str, fitting: int,
                 smallest: int = 1) -> BatchSplit:
    """The split a run trains with, from the ``train`` settings and the largest micro-batch that
    fits (`fitting`, from the prediction or from calibration's measurements): a fixed
    micro-batch as configured (with a fixed accumulation, or the one that makes the global
    batch); a fixed accumulation with the micro-batch that makes the global batch; otherwise the
    fastest split whose micro-batch fits (:func:`choose_split`), never below `smallest`."""
    fixed_accum = None if accum == "auto" else int(accum)
    if isinstance(micro, int):
        return split_global_batch(global_batch, world_size, micro, fixed_accum)
    if fixed_accum is not None:
        implied = max(smallest, round(global_batch / (fixed_accum * world_size)))
        return split_global_batch(global_batch, world_size, implied, fixed_accum)
    return choose_split(global_batch, world_size, max(1, fitting), smallest)
