"""The fit search: which micro-batches fit one GPU's budget, as predicted, and the peak a plan
reports for the one it chooses.

Predicted peaks swing a few per cent from one batch shape to the next, up or down: what the
allocator's cache keeps at the peak depends on how the sizes freed earlier in the step (the
activations, the logits) pack the sizes allocated later (the optimizer's states), which is the
caching allocator's own rule, replayed (PLANNER.md section 4). A batch the run will also see must
not be predicted to fail where the planned one fits, so fitting and the reported peak are made
monotone here, over both dimensions of a batch:

- **micro-batch**: a micro-batch fits only when every smaller one does, and the peak reported for
  micro m is the largest predicted for any micro <= m (the out-of-memory backoff and an
  accumulation's last micro-batch run smaller ones);
- **sequence length**: rows shorter than the planned length are trained too (an unpacked batch is
  padded to its longest row; packing leaves rows short), so the same holds over the lengths of a
  fixed ladder below it (:func:`shorter_lengths`: 256, 512, 1,024 ... tokens). The ladder is the
  same for every plan, so a plan at any length reports at least what a plan at each ladder
  length below it reports: between ladder lengths, and from a ladder length to any longer one,
  reported peaks and fit decisions never fall. ``make plan LONGEST=1`` also covers the ladder's
  four lengths an octave within the planned length's octave (:func:`octave_lengths`) at
  micro-batch 1, where a length fits or not: there 3,072 cannot fail where 4,096 fits. Not
  covered: a length off the ladder (3,500 covers 3,072, not 3,000: that would take a replay per
  token count).

What the search predicted at the planned length stays in :attr:`FitSearch.tried`, for the plan's
table and picture (no further replays).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from sft_play.planner import progress
from sft_play.planner.choose.split import largest_fitting_micro
from sft_play.planner.simulate.predict import Prediction, predict_many, static_lower_bound
from sft_play.planner.simulate.shapes import ModelShape
from sft_play.run import BatchSplit, Run

# tokens: the ladder's first rung. A choice, not a measurement: batches of shorter rows are not
# covered (each rung costs a trace and a replay per micro-batch; PLANNER.md section 5)
SHORTEST_RUNG = 256


def ladder(longest: int, shortest: int = SHORTEST_RUNG) -> list[int]:
    """Four lengths an octave from `shortest` up to `longest`: 256, 320, 384, 448, 512, 640 ...;
    from 1,024 on, multiples of 256 (1,024, 1,280, 1,536, 1,792, 2,048 ...)."""
    lengths, octave = [], shortest
    while octave <= longest:
        lengths += [octave * quarters // 4 for quarters in (4, 5, 6, 7) if octave * quarters // 4 <= longest]
        octave *= 2
    return lengths


def shorter_lengths(tokens: int) -> list[int]:
    """The ladder's octaves below `tokens`: 256, 512, 1,024 ... (the same for every plan)."""
    return [rung for rung in ladder(tokens) if rung < tokens and rung & (rung - 1) == 0]


def octave_lengths(tokens: int) -> list[int]:
    """The ladder's other lengths below `tokens` within its octave (4,096: 2,560, 3,072 and
    3,584), which ``make plan LONGEST=1``'s plans cover at micro-batch 1, where a length fits or
    not: a length of the octave cannot fail there where a longer one fits, and the bisection
    within the octave is sound. Other plans leave them out: their replays and traces made the
    planner's tests half as long again (measured), for lengths a plan is rarely compared with.
    Covering them at every micro-batch, and every octave's, would make every reported peak
    monotone over the whole ladder: twice the tests' time."""
    octave = 1 << (max(tokens - 1, 1).bit_length() - 1)
    return [rung for rung in ladder(tokens) if octave < rung < tokens and rung & (rung - 1)]


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
    shorter_rows: bool = True  # cover the ladder's shorter lengths (the remedy search does not)
    octave_rows: bool = False  # cover the lengths of the planned length's octave at micro-batch 1 (LONGEST)
    tried: dict[int, Prediction] = field(default_factory=dict)

    def rungs(self) -> list[int]:
        """The shorter lengths this search covers."""
        return shorter_lengths(self.run.sequence.tokens) if self.shorter_rows else []

    def octave_rungs(self) -> list[int]:
        """The lengths of the planned length's octave this search covers at micro-batch 1."""
        return octave_lengths(self.run.sequence.tokens) if self.octave_rows else []

    def predicted(self, micro: int, accumulating: bool | None = None, tokens: int | None = None) -> Prediction:
        """The prediction at `micro` (rows of `tokens`, the planned length unless said) against
        the budget, accumulating as the split would unless said. When the weights and optimizer
        states alone exceed the budget, the whole step is replayed without a limit: the report
        then shows the real peak, beyond the budget."""
        return self.predicted_all([(micro, accumulating, tokens)])[0]

    def predicted_all(self, shapes: list[tuple[int, bool | None, int | None]]) -> list[Prediction]:
        """:meth:`predicted` for each (micro, accumulating, tokens), replayed side by side
        (:func:`sft_play.planner.simulate.predict.predict_many`)."""
        requests, beyond = [], []
        for micro, accumulating, tokens in shapes:
            if accumulating is None:
                accumulating = self.fixed_accum > 1 if self.fixed_accum is not None else micro < self.per_process
            run = self.run
            if tokens is not None and tokens != run.sequence.tokens:
                run = run.with_changes(sequence=dataclasses.replace(run.sequence, tokens=tokens))
            beyond.append(static_lower_bound(self.shape, run) > self.budget)
            requests.append((run, micro, None if beyond[-1] else self.budget, accumulating))
        if requests:
            progress.say("micro-batch " + ", ".join(sorted({str(micro) for _, micro, _, _ in requests}, key=int))
                         + " at " + ", ".join(f"{t:,}" for t in sorted({run.sequence.tokens for run, *_ in requests}))
                         + " tokens")
        predictions = []
        for (run, micro, _, _), whole, prediction in zip(requests, beyond, predict_many(self.shape, requests)):
            if whole:
                prediction = dataclasses.replace(prediction, fits=False)
            if run is self.run:
                self.tried.setdefault(micro, prediction)
            predictions.append(prediction)
        return predictions

    def covered(self, split: BatchSplit) -> list[Prediction]:
        """The predictions a plan of `split` answers for: its micro-batch and every smaller one
        (accumulating, as the backoff runs them), at the planned length and at each shorter
        length of the ladder."""
        micro, accumulating = split.micro_batch_size, split.gradient_accumulation_steps > 1
        # the split's own accumulation, and the search's (they differ when rounding the global
        # batch gave accumulation 1 to a micro-batch below the per-process share)
        smaller = [(m, None, tokens) for tokens in [None, *self.rungs()] for m in range(1, micro + 1)]
        octave = [(1, None, tokens) for tokens in self.octave_rungs()]
        return self.predicted_all([(micro, accumulating, None), *smaller, *octave])

    def shorter_rows_fitting(self, micro: int) -> int:
        """The largest micro-batch up to `micro` that fits, with every smaller one, with rows of
        every shorter length of the ladder (`micro` itself when it does; 0 when micro-batch 1 does
        not). Only the micro-batches a run of `micro` trains are replayed: the plan covers them
        anyway (:meth:`covered`), so this costs no replay of its own."""
        shorter = self.predicted_all([(m, None, tokens) for tokens in self.rungs() for m in range(1, micro + 1)]
                                     + [(1, None, tokens) for tokens in self.octave_rungs()])
        return min((p.micro_batch - 1 for p in shorter if not p.fits), default=micro)

    def largest_fitting(self) -> int:
        """The largest micro-batch up to the per-process share that fits, with every smaller one
        fitting too, at the planned length (0 when micro-batch 1 does not). Rows of the ladder's
        shorter lengths are checked for the micro-batch the run chooses (:meth:`shorter_rows_fitting`),
        not for larger ones it never trains: those would cost a replay per micro-batch and rung."""
        if not self.predicted(1).fits:
            return 0
        fitting = largest_fitting_micro(lambda m: bool(self.predicted(m).fits), self.per_process,
                                        _crossing(self.predicted(1), self.predicted(self.per_process), self.budget))
        below = self.predicted_all([(m, None, None) for m in range(1, fitting + 1)])
        return next((p.micro_batch - 1 for p in below if not p.fits), fitting)

    def reported(self, split: BatchSplit) -> tuple[Prediction, int, dict[str, int]]:
        """The prediction for the split's micro-batch, and the peak and breakdown the plan reports
        for it: the largest peak of any batch it covers (:meth:`covered`), the difference from its
        own shown as a term of its own ("smaller_batch")."""
        chosen = self.predicted(split.micro_batch_size, split.gradient_accumulation_steps > 1)
        peak, breakdown = chosen.peak_bytes, dict(chosen.breakdown)
        covered = max(p.peak_bytes for p in self.covered(split))
        if covered > peak:
            breakdown["smaller_batch"] = covered - peak
            peak = covered
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
