"""Decisions agreed across ranks: one number all-reduced per question, so that every process
stops at the same step and none waits forever in a collective (each a no-op in one process)."""

from __future__ import annotations

import torch


def distributed():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else None


def any_rank(flag: bool) -> bool:
    """True on every rank if `flag` is true on any rank (no-op without a process group)."""
    return bool(max_over_ranks(1 if flag else 0))


def max_over_ranks(value: int) -> int:
    """The largest `value` of all ranks (itself without a process group)."""
    dist = distributed()
    if dist is None:
        return value
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    tensor = torch.tensor([value], device=device, dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def lost_another_rank(error: BaseException) -> bool:
    """Whether `error` is a collective failing because another process of the run went away
    (it crashed, was killed, or its node failed): that process's own error, or the launcher's
    report of it, says why."""
    import torch.distributed as dist

    text = str(error)
    return isinstance(error, dist.DistError) or any(
        sign in text for sign in ("Connection closed by peer", "Connection reset by peer", "remote worker",
                                  "NCCL communicator was aborted"))


def barrier() -> None:
    dist = distributed()
    if dist is not None:
        dist.barrier()


def rank_and_world() -> tuple[int, int]:
    dist = distributed()
    return (dist.get_rank(), dist.get_world_size()) if dist is not None else (0, 1)
