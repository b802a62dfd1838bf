"""What a long plan is doing, said while it does it.

A plan with remedies, or ``make plan LONGEST=1``, plans many changed configs one after another;
without a word for seconds a user cannot tell planning from a hang. Within :func:`reporting`,
the planner names what it is on (:func:`doing`: the remedy, the lever; :func:`say`: the length,
the micro-batch), and once the plan has run for :data:`QUIET_SECONDS` the latest is written on
one line of stderr, at most once a second. Outside it (training, tests, ``--json``) nothing is
written.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from typing import TextIO

QUIET_SECONDS = 2.0  # a plan quicker than this says nothing
EVERY_SECONDS = 1.0


class _Reporter:
    def __init__(self, stream: TextIO, quiet: float, every: float):
        self.stream, self.quiet, self.every = stream, quiet, every
        self.started = time.monotonic()
        self.last = float("-inf")
        self.written = False

        self.labels: list[str] = []

    def say(self, what: str) -> None:
        now = time.monotonic()
        if now - self.started < self.quiet or now - self.last < self.every:
            return
        self.last = now
        line = f"planning ({now - self.started:.0f} s): " + ", ".join([*self.labels, what] if what else self.labels)
        try:
            if self.stream.isatty():  # one line, rewritten in place
                self.stream.write(f"\r\033[K{line[:119]}")
            else:
                self.stream.write(line + "\n")
            self.stream.flush()
            self.written = True
        except (OSError, ValueError):  # a closed or full stream: planning goes on without it
            pass

    def close(self) -> None:
        """Clear the line written in place on a terminal (what is printed next starts clean)."""
        with contextlib.suppress(OSError, ValueError):
            if self.written and self.stream.isatty():
                self.stream.write("\r\033[K")
                self.stream.flush()
        self.written = False


_REPORTER: _Reporter | None = None


@contextlib.contextmanager
def reporting(stream: TextIO | None = None, quiet: float = QUIET_SECONDS, every: float = EVERY_SECONDS) -> Iterator[None]:
    """Within this block, :func:`say` reports to `stream` (stderr) once the block has run `quiet` seconds."""
    global _REPORTER
    outer = _REPORTER
    _REPORTER = _Reporter(stream or sys.stderr, quiet, every)
    try:
        yield
    finally:
        _REPORTER.close()
        _REPORTER = outer


@contextlib.contextmanager
def doing(label: str) -> Iterator[None]:
    """Within this block the planner is on `label` (a remedy, a lever): said before whatever it says."""
    if _REPORTER is None:
        yield
        return
    reporter = _REPORTER
    reporter.labels.append(label)
    reporter.say("")
    try:
        yield
    finally:
        reporter.labels.pop()


def silenced() -> None:
    """Say nothing from here on in this process (a process planning beside the one that reports)."""
    global _REPORTER
    _REPORTER = None


def clear() -> None:
    """Clear the progress line before printing something else (within :func:`reporting`)."""
    if _REPORTER is not None:
        _REPORTER.close()


def say(what: str) -> None:
    """What the planner starts now (a length, a micro-batch); written only within :func:`reporting`."""
    if _REPORTER is not None:
        _REPORTER.say(what)
