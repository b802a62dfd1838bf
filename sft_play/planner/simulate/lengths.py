"""A layer's trace at one row length derived from its traces at others, as the trace at any
micro-batch is derived from those at one and two rows (:mod:`sft_play.planner.simulate.trace`).

Within one regime (the same operations in the same order: no window mask switching on, no tile
count changing, which the caller keys apart), every allocation of a decoder layer is a polynomial
of degree at most two in the row's length: activations grow with it, an s x s mask or score with
its square. Three traces fix each size exactly (Lagrange, in integers); every further trace at
hand must then agree to the byte, or nothing is derived. Only lengths that are multiples of
:data:`STEP` are fitted and derived: there no kernel's rounding (FlashAttention's 128-token blocks,
the memory-efficient kernel's log-sum-exp padded to 32, a mask's rows to 8, SDPA's 16) bends the
polynomial. ``make plan LONGEST=1`` climbs the ladder an octave at a time for each lever, and a
plan's envelope covers every shorter octave down to 256 tokens (a split row's share of it, down
to 32), so most of their lengths are derived instead of traced.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import Any

import numpy as np

STEP = 128  # lengths fitted and derived: multiples of this, the coarsest rounding of the traced kernels
AT_HAND = 4  # traces of a regime before one is derived: three fit each size, the rest check the fit

_PHASES = ("forward", "after_forward", "cache_release", "backward")


def numbers(trace: Any) -> tuple[tuple, list[float]]:
    """(what does not depend on the length, the sizes that do): a trace's operations and
    names, and each event's bytes and bytes per extra row, in order."""
    sizes: list[float] = []
    seen: dict[int, Any] = {}

    def module(events: Any) -> Any:
        if events is None:
            return None
        if id(events) not in seen:
            for phase in _PHASES:
                for _, _, size, slope in getattr(events, phase):
                    sizes.extend((size, slope))
            seen[id(events)] = (tuple(tuple(e[:2] for e in getattr(events, p)) for p in _PHASES), events.output,
                                events.input_grad, events.input_kept, events.persistent, events.base_micro)
        return seen[id(events)]

    skeleton = (tuple(module(m) for m in trace.single), tuple(module(m) for m in trace.batched),
                tuple(tuple(module(m) for m in pair) for pair in trace.kinds), trace.pattern, trace.names)
    return skeleton, sizes


def rebuilt(template: Any, sizes: list[float]) -> Any:
    """`template` (a LayerTrace) with its sizes replaced by `sizes`, in :func:`numbers`'s order;
    a module shared by several places stays shared."""
    values = iter(sizes)
    made: dict[int, Any] = {}

    def module(events: Any) -> Any:
        if events is None:
            return None
        if id(events) not in made:
            made[id(events)] = dataclasses.replace(events, **{
                phase: tuple((kind, i, next(values), next(values)) for kind, i, _, _ in getattr(events, phase))
                for phase in _PHASES})
        return made[id(events)]

    single = tuple(module(m) for m in template.single)
    batched = tuple(module(m) for m in template.batched)
    kinds = tuple(tuple(module(m) for m in pair) for pair in template.kinds)
    return dataclasses.replace(template, single=single, batched=batched, kinds=kinds)


def _weights(points: tuple[int, ...], at: int) -> tuple[list[int], int]:
    """Lagrange's weights of the values at `points` for the polynomial through them, at `at`, as
    whole numbers over one common denominator."""
    fractions = []
    for i, xi in enumerate(points):
        weight = Fraction(1)
        for j, xj in enumerate(points):
            if j != i:
                weight *= Fraction(at - xj, xi - xj)
        fractions.append(weight)
    denominator = math.lcm(*(w.denominator for w in fractions))
    return [w.numerator * (denominator // w.denominator) for w in fractions], denominator


def _through(points: tuple[int, ...], values: list[np.ndarray], at: int) -> list[float] | None:
    """Each size at `at` from its values at `points` (in whole numbers: Python's, unbounded); None
    where one is not a whole number of bytes (then the sizes are not that polynomial)."""
    weights, denominator = _weights(points, at)
    scaled = sum(weight * column for weight, column in zip(weights, values))
    if any(scaled % denominator):
        return None
    return [float(v) for v in scaled // denominator]


def derived(known: dict[int, Any], seq_len: int) -> Any | None:
    """The trace at `seq_len` from `known` (real traces of the same layer and regime, by length),
    or None when fewer than :data:`AT_HAND` are at hand, their operations differ, or the traces
    the fit leaves out do not agree with it to the byte."""
    lengths = sorted(s for s in known if s % STEP == 0)
    if seq_len % STEP or len(lengths) < AT_HAND or seq_len in known:
        return None
    described = {s: numbers(known[s]) for s in lengths}
    skeleton = described[lengths[-1]][0]
    if any(d[0] != skeleton or len(d[1]) != len(described[lengths[-1]][1]) for d in described.values()):
        return None
    fit = tuple(lengths[-3:])  # the longest three: the nearest to what is asked next
    if any(v != float(int(v)) for s in fit for v in described[s][1]):
        return None
    values = [np.array([int(v) for v in described[s][1]], dtype=object) for s in fit]
    for check in lengths[:-3]:
        if _through(fit, values, check) != described[check][1]:
            return None
    sizes = _through(fit, values, seq_len)
    if sizes is None or any(size < 0 for size in sizes[0::2]):
        return None
    return rebuilt(known[lengths[-1]], sizes)
