"""The checkpoint's completeness marker, written once every rank has saved its part, and the
rotation of older checkpoints after it (:mod:`sft_play.checkpoints` holds the rules)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from transformers import TrainerCallback

from sft_play import checkpoints
from sft_play.callbacks.faults import kill_if_injected
from sft_play.callbacks.ranks import barrier, distributed, rank_and_world

logger = logging.getLogger("sft_play.callbacks")


class CheckpointMarker(TrainerCallback):
    """Marks each checkpoint complete once every rank has finished writing it, then deletes the
    complete checkpoints beyond the newest `keep` (the trainer's own rotation, which deletes
    before the new checkpoint is known to be whole, stays off: ``save_total_limit=None``).

    The marker lists every file with its size and SHA-256 digest (the ranks hash a share of the
    files each) and is withheld when a rank's files are missing.
    """

    def __init__(self, keep: int | None = None, strategy: str | None = None,
                 before: tuple[float, int] = (0.0, 0)) -> None:
        """`before`: the training time and segments the resumed checkpoint records (see
        :func:`sft_play.checkpoints.time_before`), carried into each new marker."""
        self.keep = keep
        self.strategy = strategy
        self.before = before
        self.started = time.monotonic()

    def on_train_begin(self, args, state, control, **kwargs):
        self.started = time.monotonic()

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        rank, world = rank_and_world()
        kill_if_injected("kill_before_marker", state.global_step, rank)
        barrier()  # every rank has written its part
        names = [checkpoints.checkpoint_files(folder) if rank == 0 and folder.is_dir() else []]
        dist = distributed()
        if dist is not None:
            dist.broadcast_object_list(names, src=0)
        mine = {}
        for name in names[0][rank::world]:
            try:
                mine[name] = checkpoints.file_digest(folder / name)
            except OSError:  # not visible from this node: rank 0 hashes it
                pass
        shares = [mine] if dist is None else [None] * world
        if dist is not None:
            dist.all_gather_object(shares, mine)
        if rank == 0 and folder.is_dir():
            missing = checkpoints.missing_rank_files(folder, world)
            if missing:
                logger.error("%s is not marked complete: %s missing (a rank did not finish saving, or a node writes "
                             "into a folder the others cannot see: train.output_dir must be shared by every node)",
                             folder, ", ".join(missing))
            else:
                merged = {name: digest for share in shares for name, digest in (share or {}).items()}
                elapsed = (self.before[0] + time.monotonic() - self.started, self.before[1] + 1)
                checkpoints.write_marker(folder, state.global_step, world, self.strategy, merged, elapsed)
                if self.keep:
                    checkpoints.rotate(folder.parent, self.keep)
        barrier()
