"""Fault injection for tests: ``SFT_PLAY_FAULTS`` makes a real process slow, hold, or die at a
chosen point (see :func:`injected_faults`). Nothing here runs unless the variable is set."""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import TYPE_CHECKING

from transformers import TrainerCallback

if TYPE_CHECKING:
    from sft_play.callbacks.stops import GracefulStop

logger = logging.getLogger("sft_play.callbacks")

FAULTS_ENV = "SFT_PLAY_FAULTS"


def injected_faults() -> dict[str, tuple[int, ...]]:
    """Faults asked for in ``SFT_PLAY_FAULTS`` (for tests: a real process must be killed or made
    slow at a chosen point), e.g. ``slow_step=2:35,kill_before_marker=6:1``:

    - ``slow_step=S:SECONDS``: step S takes SECONDS longer on every rank (before its checkpoint
      decision), as a long step would;
    - ``hold_step=S``: step S ends only once this process has received a stop signal (at most
      :data:`HOLD_LIMIT_S` later), so that a test's signal lands in step S however slow the
      machine, with no window to hit;
    - ``kill_before_marker=S:RANK``: that rank (default 0) is killed (SIGKILL) once it has written
      its part of checkpoint S, before the ranks agree that the checkpoint is whole and mark it;
    - ``hold_final_save=1``: the final save, its model written but not yet in place, waits for a
      stop signal; ``kill_in_final_save=1``: the process is killed there (SIGKILL);
    - ``full_disk=S``: from the end of step S, no file this process writes may grow past 64 KiB
      (``RLIMIT_FSIZE``): the saves that follow fail in the filesystem's own way, as on a full
      disk (EFBIG where a full disk says ENOSPC; Python ignores SIGXFSZ).
    """
    faults = {}
    for item in filter(None, (part.strip() for part in os.environ.get(FAULTS_ENV, "").split(","))):
        name, _, values = item.partition("=")
        faults[name.strip()] = tuple(int(v) for v in values.split(":") if v.strip())
    return faults


def kill_if_injected(name: str, step: int, rank: int = 0) -> None:
    """SIGKILL this process if ``SFT_PLAY_FAULTS`` asks for fault `name` at `step` on `rank`."""
    values = injected_faults().get(name)
    if values and values[0] == step and (values[1] if len(values) > 1 else 0) == rank:
        logger.warning("fault injection (%s): killing rank %d at step %d", name, rank, step)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)


HOLD_LIMIT_S = 300  # hold_step's guard against a test that never sends its signal


def in_final_save(stop: GracefulStop) -> None:
    """``hold_final_save`` and ``kill_in_final_save`` of :func:`injected_faults` (the main process)."""
    faults = injected_faults()
    kill_if_injected("kill_in_final_save", 1)
    if faults.get("hold_final_save"):
        logger.warning("fault injection (hold_final_save): the final save waits for a stop signal")
        deadline = time.monotonic() + HOLD_LIMIT_S
        while stop.received is None and time.monotonic() < deadline:
            time.sleep(0.05)


class FaultInjection(TrainerCallback):
    """``slow_step`` and ``hold_step`` of :func:`injected_faults`; added (first) only when
    ``SFT_PLAY_FAULTS`` is set. `stop` is the run's :class:`GracefulStop`, whose signal ends a hold."""

    def __init__(self, stop: GracefulStop | None = None) -> None:
        self.stop = stop

    def on_step_end(self, args, state, control, **kwargs):
        faults = injected_faults()
        slow, hold, full = faults.get("slow_step"), faults.get("hold_step"), faults.get("full_disk")
        if full and full[0] == state.global_step:
            import resource

            logger.warning("fault injection (full_disk): files written from step %d on stop at 64 KiB",
                           state.global_step)
            resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        if slow and slow[0] == state.global_step:
            logger.warning("fault injection (slow_step): step %d takes %d s longer", state.global_step, slow[1])
            deadline = time.monotonic() + slow[1]
            while (left := deadline - time.monotonic()) > 0:
                time.sleep(min(left, 1.0))  # signals are handled between naps
        if hold and hold[0] == state.global_step and self.stop is not None:
            logger.warning("fault injection (hold_step): step %d waits for a stop signal", state.global_step)
            deadline = time.monotonic() + HOLD_LIMIT_S
            while self.stop.received is None and time.monotonic() < deadline:
                time.sleep(0.05)  # the signal's handler runs between naps
