"""Choosing the batch: the budget, the micro-batch size, the accumulation steps and, when
nothing fits, the remedies. Pure arithmetic on numbers the other planner modules produce."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchSplit:
    """How the global batch is made: ``global = micro x accum x world``."""

    micro_batch_size: int
    gradient_accumulation_steps: int
    world_size: int
    requested_global_batch_size: int
    note: str = ""

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.gradient_accumulation_steps * self.world_size

    def describe(self) -> str:
        return (
            f"global {self.global_batch_size} = micro {self.micro_batch_size} x accum "
            f"{self.gradient_accumulation_steps} x world {self.world_size}"
        )


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
