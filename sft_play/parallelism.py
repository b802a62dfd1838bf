"""How the processes of a run share the work, and what follows from it.

Every question about the strategy ("is this DeepSpeed?", "are the parameters sharded?", "which make
target launches it?") is answered here, once, by a property; the rest of the package asks, and
never compares the strategy's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

StrategyName = Literal["ddp", "deepspeed_zero2", "deepspeed_zero3", "fsdp2"]
STRATEGIES: tuple[StrategyName, ...] = ("ddp", "deepspeed_zero2", "deepspeed_zero3", "fsdp2")


@dataclass(frozen=True)
class Strategy:
    """One of :data:`STRATEGIES` and its facts."""

    name: StrategyName = "ddp"

    def __post_init__(self) -> None:
        if self.name not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.name!r}; expected one of {', '.join(STRATEGIES)}")

    def __str__(self) -> str:
        return self.name

    @property
    def deepspeed(self) -> bool:
        """Run by DeepSpeed's engine (ZeRO-2 or ZeRO-3), launched by ``make train-deepspeed``."""
        return self.name.startswith("deepspeed")

    @property
    def fsdp(self) -> bool:
        """PyTorch's FSDP2, through accelerate."""
        return self.name == "fsdp2"

    @property
    def zero3(self) -> bool:
        return self.name == "deepspeed_zero3"

    @property
    def shards_states(self) -> bool:
        """Gradients and optimizer states are split across the processes (ZeRO, FSDP2)."""
        return self.deepspeed or self.fsdp

    @property
    def shards_parameters(self) -> bool:
        """The parameters themselves are split, and gathered layer by layer (ZeRO-3, FSDP2)."""
        return self.zero3 or self.fsdp

    @property
    def label(self) -> str:
        return {"ddp": "DDP", "deepspeed_zero2": "ZeRO-2", "deepspeed_zero3": "ZeRO-3", "fsdp2": "FSDP2"}[self.name]

    @property
    def make_target(self) -> str:
        """The target that launches it on several processes."""
        return "train-deepspeed" if self.deepspeed else "train-distributed"


@dataclass(frozen=True)
class Parallelism:
    """The run's share of the work: the strategy, the processes, what is offloaded, how
    ZeRO buckets its communication and how long ZeRO-3 keeps parameters gathered."""

    strategy: Strategy = Strategy()
    world_size: int = 1
    offload_optimizer: bool = False  # optimizer states in CPU memory (implied by offloaded parameters)
    offload_parameters: bool = False  # ZeRO-3 / FSDP2: parameters in CPU memory (FSDP2: gradients, states too)
    reshard_after_forward: bool = True  # FSDP2: layers gathered again for backward (full shard)
    reduce_bucket_elements: int | None = None  # ZeRO's reduce_bucket_size, as the trainer fills it
    # ZeRO-3's stage3_max_reuse_distance: a gathered parameter used again within this many
    # parameters of the step's trace is kept gathered
    reuse_distance_elements: int | None = None
    # Processes that split each row's tokens between them (DeepSpeed Ulysses): world_size of them
    # form world_size / sequence_parallel data-parallel groups
    sequence_parallel: int = 1
    context_parallel: int = 1  # the same, with torch's ring attention under FSDP2

    def __post_init__(self) -> None:
        if self.offload_parameters and not self.offload_optimizer:  # offloaded parameters take their states along
            object.__setattr__(self, "offload_optimizer", True)
        if self.row_shards < 1 or self.world_size % self.row_shards:
            raise ValueError(f"rows split across {self.row_shards} processes do not divide {self.world_size} process(es)")

    @classmethod
    def from_config(cls, distributed: Any, world_size: int = 1,
                    zero: tuple[int | None, int | None] = (None, None), sequence_parallel: int = 1) -> Parallelism:
        """From the config's ``distributed`` section (:class:`sft_play.config.schema.DistributedConfig`),
        with ZeRO's sizes from its JSON (:func:`sft_play.run.zero_sizes`) and its ``sequence_parallel``
        as resolved (``auto`` is the planner's)."""
        return cls(
            strategy=Strategy(distributed.strategy),
            world_size=world_size,
            offload_optimizer=distributed.offload_optimizer or distributed.offload_parameters,
            offload_parameters=distributed.offload_parameters,
            reshard_after_forward=distributed.reshard_after_forward,
            reduce_bucket_elements=zero[0],
            reuse_distance_elements=zero[1],
            sequence_parallel=sequence_parallel,
            context_parallel=distributed.context_parallel,
        )

    @property
    def row_shards(self) -> int:
        """Processes each row is split across (sequence or context parallelism; 1: whole rows)."""
        return self.sequence_parallel * self.context_parallel

    @property
    def data_parallel(self) -> int:
        """Processes that train on different rows: ``micro x accum x data_parallel`` rows a step."""
        return self.world_size // self.row_shards

    @property
    def splits_sequence(self) -> bool:
        """Rows split by DeepSpeed's Ulysses (sequence parallelism)."""
        return self.sequence_parallel > 1

    @property
    def row_multiple(self) -> int:
        """What a split row's length must divide by: the split (Ulysses), or twice it (the ring's
        load balancing gives each process two chunks); 1 for whole rows."""
        if self.splits_sequence:
            return self.sequence_parallel
        return 2 * self.context_parallel if self.context_parallel > 1 else 1

    @property
    def deepspeed(self) -> bool:
        return self.strategy.deepspeed

    @property
    def fsdp(self) -> bool:
        return self.strategy.fsdp

    @property
    def state_shards(self) -> int:
        """How many ways gradients and optimizer states are split (1 under DDP)."""
        return self.world_size if self.strategy.shards_states else 1

    @property
    def weight_shards(self) -> int:
        """How many ways the parameters themselves are split (ZeRO-3 and FSDP2)."""
        return self.world_size if self.strategy.shards_parameters else 1

    @property
    def computes_in_gathered_copies(self) -> bool:
        """The layers compute on 16-bit copies of the parameters (with mixed precision): DeepSpeed
        casts the module to the compute dtype, FSDP2 all-gathers in it (its ``param_dtype``)."""
        return self.strategy.shards_states
