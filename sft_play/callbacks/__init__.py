"""Behaviour added to the trainer as callbacks, in rooms of one concern:

  ranks.py    decisions agreed across ranks (one all-reduced number each)
  markers.py  checkpoints marked complete once every rank has saved, then rotated
  stops.py    a clean stop on SIGTERM/SIGINT, NaN or infinite steps, early stopping
  logs.py     one readable log line, true token counts and throughput, expert load
  faults.py   fault injection for tests (``SFT_PLAY_FAULTS``)
"""

from sft_play.callbacks.faults import FAULTS_ENV, FaultInjection, injected_faults, kill_if_injected
from sft_play.callbacks.logs import ExpertLoad, LogLastStep, LogLines, PrintedLogLines, TokenThroughput, log_line
from sft_play.callbacks.markers import CheckpointMarker
from sft_play.callbacks.ranks import any_rank, lost_another_rank, max_over_ranks
from sft_play.callbacks.stops import AlreadyTrained, EarlyStopping, GracefulStop, NonFiniteGuard, NothingPastTheEnd

__all__ = [
    "FAULTS_ENV", "AlreadyTrained", "CheckpointMarker", "EarlyStopping", "ExpertLoad", "FaultInjection", "GracefulStop", "LogLastStep",
    "LogLines", "NonFiniteGuard", "NothingPastTheEnd", "PrintedLogLines", "TokenThroughput", "any_rank", "injected_faults",
    "kill_if_injected", "log_line", "lost_another_rank", "max_over_ranks",
]
