"""The fit search: which micro-batches fit one GPU's budget, as predicted, and the peak a plan
reports for the one it chooses.

Predicted peaks swing a few per cent from one micro-batch to the next (the allocator's cache
keeps other blocks at each size), so fitting is made monotone here: a micro-batch fits only when
every smaller one does, and the peak reported for micro m is the largest predicted for any
micro <= m. What the search predicted stays in :attr:`FitSearch.tried`, for the plan's table and
picture (no further replays).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sft_play.planner.choose import largest_fitting_micro
from sft_play.planner.predict import Prediction, predict, static_lower_bound
from sft_play.planner.shapes import ModelShape
from sft_play.run import BatchSplit, Run


@dataclass
class FitSearch:
    """The predictions for one run on one GPU's budget.

    Attributes:
        per_process: the per-process share of the global batch, the largest micro-batch tried.
        fixed_accum: the accumulation the config fixes (None: ``auto``); it says whether
            gradients are held across micro-batches while the next forward runs.
    """

    shape: ModelShape
    run: Run
    budget: int
    per_process: int
    fixed_accum: int | None
    tried: dict[int, Prediction] = field(default_factory=dict)

    def predicted(self, micro: int, accumulating: bool | None = None) -> Prediction:
        """The prediction at `micro` against the budget (accumulating as the split would, unless
        said). When the weights and optimizer states alone exceed the budget, the whole step is
        replayed without a limit: the report then shows the real peak, beyond the budget."""
        if accumulating is None:
            accumulating = self.fixed_accum > 1 if self.fixed_accum is not None else micro < self.per_process
        if static_lower_bound(self.shape, self.run) > self.budget:
            whole = predict(self.shape, self.run, micro, None, accumulating)
            prediction = Prediction(micro, whole.peak_bytes, whole.allocated_bytes, whole.breakdown, False)
        else:
            prediction = predict(self.shape, self.run, micro, self.budget, accumulating)
        self.tried.setdefault(micro, prediction)
        return prediction

    def largest_fitting(self) -> int:
        """The largest micro-batch up to the per-process share that fits, with every smaller one
        fitting too (0 when micro-batch 1 does not)."""
        fitting = largest_fitting_micro(lambda m: bool(self.predicted(m).fits), self.per_process,
                                        _crossing(self.predicted(1), self.predicted(self.per_process), self.budget))
        return next((m - 1 for m in range(1, fitting + 1) if not self.predicted(m).fits), fitting)

    def reported(self, split: BatchSplit) -> tuple[Prediction, int, dict[str, int]]:
        """The prediction for the split's micro-batch, and the peak and breakdown the plan reports
        for it: the largest peak of any micro-batch up to it, the difference shown as its own term
        ("smaller_micro_batch")."""
        chosen = self.predicted(split.micro_batch_size, split.gradient_accumulation_steps > 1)
        peak, breakdown = chosen.peak_bytes, dict(chosen.breakdown)
        smaller = max((self.predicted(m).peak_bytes for m in range(1, split.micro_batch_size)), default=0)
        if smaller > peak:
            breakdown["smaller_micro_batch"] = smaller - peak
            peak = smaller
        return chosen, peak, breakdown

    def candidates(self) -> list[dict]:
        """Every micro-batch the search predicted, in order: the plan's table and picture."""
        return [{"micro_batch_size": m, "peak_bytes": p.peak_bytes, "fits": bool(p.fits), "breakdown": p.breakdown}
                for m, p in sorted(self.tried.items())]


def _crossing(first: Prediction, last: Prediction, budget: int) -> int | None:
    """Where the straight line through two predictions reaches the budget."""
    if last.micro_batch <= first.micro_batch or last.peak_bytes <= first.peak_bytes:
        return None
    per_sample = (last.peak_bytes - first.peak_bytes) / (last.micro_batch - first.micro_batch)
    return first.micro_batch + int((budget - first.peak_bytes) // per_sample)
