"""The fit search: which micro-batches fit one GPU's budget, as predicted, and the peak a plan
reports for the one it chooses.

Predicted peaks swing a few per cent from one batch shape to the next, up or down: what the
allocator's cache keeps at the peak depends on how the sizes freed earlier in the step (the
activations, the logits) pack the sizes allocated later (the optimizer's states), which is the
caching allocator's own rule, replayed (PLANNER.md section 4). A batch the run also trains must
not be predicted to fail where the planned one fits (an unpacked batch is padded to its longest
row, packing leaves rows short, the out-of-memory backoff and an accumulation's last micro-batch
run smaller ones), and a longer row must not be predicted to fit where a shorter one does not, so
a plan reports an envelope (:meth:`FitSearch.envelope`), the same function of the length and the
micro-batch for every plan:

- at a power of two (256, 512, 1,024 ... tokens, or any length up to the first): the largest
  peak of any batch it covers, the micro-batches up to the planned one at this length and at each
  shorter power of two (:func:`shorter_lengths`);
- between two powers of two: the straight line between their envelopes, term by term.

Both only grow with the micro-batch and the length, at every length, so a longer row never
reports a smaller peak nor fits where a shorter one does not, and a micro-batch fits only when
every smaller one does (``make plan LONGEST=1``'s bisection rests on it). Where the memory grows
faster than a line (attention's s x s terms) the line lies above the replays between the two
powers of two; where a length's own replay swings above it (the cache's packing, a few per cent;
a masked row off SDPA's 16-token grid, which holds a padded copy of its mask), the plan reports
the line: a length a few tokens longer would not repeat the swing.

What the search predicted at the planned length stays in :attr:`FitSearch.tried`, for the plan's
table and picture (no further replays).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from sft_play.planner import progress
from sft_play.planner.choose.split import largest_fitting_micro
from sft_play.planner.simulate.predict import Prediction, checkpointed_lower_bound, predict_many, static_lower_bound
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


def power_above(tokens: int) -> int | None:
    """The power of two above `tokens` (at least the ladder's first rung), whose allocator cache a
    plan at `tokens` is charged, scaled (:meth:`FitSearch.envelope`); None where `tokens` is one."""
    if tokens & (tokens - 1) == 0:
        return None
    return max(SHORTEST_RUNG, 1 << tokens.bit_length())


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
    # the envelope over shorter rows and smaller batches (the remedy search's quick plans do
    # without: they report the planned batch's own prediction)
    shorter_rows: bool = True
    tried: dict[int, Prediction] = field(default_factory=dict)

    def rungs(self) -> list[int]:
        """The shorter lengths this search covers."""
        return shorter_lengths(self.run.sequence.tokens) if self.shorter_rows else []

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

    def envelope(self, micro: int, accumulating: bool | None = None) -> Envelope:
        """What a plan of `micro` reports (the module's docstring says why), accumulating as the
        split would (`micro` itself as `accumulating` says too): at a power of two (or at most the
        ladder's first rung) :meth:`_covering`; between two, the line between theirs, term by term.
        Without :attr:`shorter_rows`, the planned batch's own prediction and the smaller ones at
        its length."""
        tokens = self.run.sequence.tokens
        own = self.predicted_all([(micro, accumulating, None)] + [(m, None, None) for m in range(1, micro + 1)])
        if not self.shorter_rows:
            peak = max(p.peak_bytes for p in own)
            return Envelope(own[0], peak, _with_term(own[0].breakdown, "smaller_batch", peak - own[0].peak_bytes),
                            bool(own[0].fits) and peak <= self.budget)
        above = power_above(tokens)
        if above is None or tokens <= SHORTEST_RUNG:
            peak, breakdown = self._covering(micro, accumulating, tokens)
            return Envelope(own[0], peak, breakdown, peak <= self.budget)
        below = above // 2
        (low, low_terms), (high, high_terms) = (self._covering(micro, accumulating, below),
                                                self._covering(micro, accumulating, above))
        peak = low + (high - low) * (tokens - below) // (above - below)
        breakdown = {term: low_terms.get(term, 0) + (high_terms.get(term, 0) - low_terms.get(term, 0))
                     * (tokens - below) // (above - below) for term in dict.fromkeys([*high_terms, *low_terms])}
        breakdown = _with_term(breakdown, max(breakdown, key=breakdown.get), peak - sum(breakdown.values()))
        return Envelope(own[0], peak, breakdown, peak <= self.budget)

    def _covering(self, micro: int, accumulating: bool | None, tokens: int) -> tuple[int, dict[str, int]]:
        """The largest peak of a micro-batch up to `micro` at `tokens` and at each shorter power of
        two of the ladder; its terms those of `micro` at `tokens`, the difference a term of its own
        (``smaller_batch``)."""
        at = None if tokens == self.run.sequence.tokens else tokens
        predictions = self.predicted_all([(micro, accumulating, at)] + [
            (m, None, length) for length in [at, *shorter_lengths(tokens)] for m in range(1, micro + 1)])
        chosen, peak = predictions[0], max(p.peak_bytes for p in predictions)
        return peak, _with_term(chosen.breakdown, "smaller_batch", peak - chosen.peak_bytes)

    def cannot_fit(self) -> bool:
        """Whether micro-batch 1's own prediction already exceeds the budget where its envelope
        covers it (at a power of two, or up to the ladder's first rung): then no envelope fits,
        which one replay at the planned length says without the shorter rows' traces."""
        tokens = self.run.sequence.tokens
        covered = power_above(tokens) is None or tokens <= SHORTEST_RUNG
        if covered and checkpointed_lower_bound(self.shape, self.run, 1) > self.budget:
            return True  # (without a trace: the layers' kept inputs alone exceed it)
        return covered and self.predicted(1).peak_bytes > self.budget  # (the envelope's own rule)

    def largest_fitting(self) -> int:
        """The largest micro-batch up to the per-process share whose envelope fits (with it, every
        smaller one's: the envelope grows with the micro-batch); 0 when micro-batch 1's does not.
        The planned length's own predictions guess it (:func:`largest_fitting_micro`), and the
        envelope steps down from the guess (at a power of two it covers the guess's own
        prediction, so it fits no larger one), or between powers of two, up from it."""
        if not self.envelope(1).fits:
            return 0
        guess = largest_fitting_micro(lambda m: bool(self.predicted(m).fits), self.per_process,
                                      _crossing(self.predicted(1), self.predicted(self.per_process), self.budget))
        fitting = max(guess, 1)
        while fitting > 1 and not self.envelope(fitting).fits:
            fitting -= 1
        if power_above(self.run.sequence.tokens) is not None and self.shorter_rows:
            while fitting < self.per_process and self.envelope(fitting + 1).fits:
                fitting += 1
        return fitting

    def reported(self, split: BatchSplit) -> Envelope:
        """The envelope of the split's micro-batch, accumulating as the split does."""
        return self.envelope(split.micro_batch_size, split.gradient_accumulation_steps > 1)

    def candidates(self) -> list[dict]:
        """Every micro-batch the search predicted, in order: the plan's table and picture."""
        return [{"micro_batch_size": m, "peak_bytes": p.peak_bytes, "fits": bool(p.fits), "breakdown": p.breakdown}
                for m, p in sorted(self.tried.items())]


@dataclass(frozen=True)
class Envelope:
    """What a plan reports for a micro-batch (:meth:`FitSearch.envelope`): the micro-batch's own
    prediction, the peak reported and its terms (they add up to it), and whether it fits."""

    chosen: Prediction
    peak_bytes: int
    breakdown: dict[str, int]
    fits: bool


def _with_term(terms: dict[str, int], term: str, extra: int) -> dict[str, int]:
    """`terms` with `extra` bytes added to `term` (taken from the largest other term where that
    would leave it below zero); a term of nothing is left out."""
    breakdown = dict(terms)
    value = breakdown.get(term, 0) + extra
    if value < 0:
        largest = max((k for k in breakdown if k != term), key=breakdown.get)
        breakdown[largest] += value
        value = 0
    breakdown[term] = value
    return {k: v for k, v in breakdown.items() if v}


def _crossing(first: Prediction, last: Prediction, budget: int) -> int | None:
    """Where the straight line through two predictions reaches the budget."""
    if last.micro_batch <= first.micro_batch or last.peak_bytes <= first.peak_bytes:
        return None
    per_sample = (last.peak_bytes - first.peak_bytes) / (last.micro_batch - first.micro_batch)
    return first.micro_batch + int((budget - first.peak_bytes) // per_sample)
