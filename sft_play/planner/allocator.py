"""PyTorch's CUDA caching allocator, simulated: what a sequence of allocations and frees
reserves from the GPU, not only what is alive.

A training step frees and allocates tensors of many sizes; the caching allocator keeps freed
blocks for reuse and asks CUDA for a new segment whenever no cached block is large enough. What
the GPU holds (``torch.cuda.memory_reserved``, and what runs out) is therefore more than the live
tensors: by a few percent for a plain forward/backward, by 10-35 % of a layer's working set with
activation checkpointing, whose recomputation allocates and frees a whole layer's activations
again for every layer. Replaying the step's allocations through the allocator's own rules
predicts that overhead instead of guessing it.

The rules, with default settings (no ``expandable_segments``, no ``max_split_size_mb``), from
``c10/cuda/CUDACachingAllocator.cpp`` and ``c10/core/AllocatorConfig.h``:

- sizes are rounded up to a multiple of 512 bytes (``round_size``);
- requests of at most 1 MiB use the small pool, others the large pool (``get_pool``);
- a request is served by the smallest cached block of its pool that is large enough, lowest
  address first (``get_free_block``: ``lower_bound`` in a set ordered by size, then address);
- otherwise a new segment is allocated (``get_allocation_size``): 2 MiB for small requests,
  20 MiB for requests under 10 MiB, else the request rounded up to 2 MiB;
- a block larger than the request is split when the remainder is at least 512 bytes (small
  pool) or more than 1 MiB (large pool) (``should_split``); otherwise the caller gets all of it;
- a freed block merges with free neighbours in the same segment (``free_block``) and stays
  cached: segments go back to CUDA only when an allocation fails, when every completely free
  segment is released and the allocation retried once (``release_cached_blocks``); failing
  again is the out-of-memory error.

One stream is simulated (a training step's tensors live on the default stream).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

MIB = 1024**2
SMALL_SIZE = 1 * MIB  # kSmallSize
SMALL_SEGMENT = 2 * MIB  # kSmallBuffer
LARGE_SEGMENT = 20 * MIB  # large_segment_size
MIN_LARGE_ALLOC = 10 * MIB  # kMinLargeAlloc
ROUND_LARGE = 2 * MIB  # kRoundLarge
MIN_BLOCK = 512  # kMinBlockSize


class OutOfMemory(Exception):
    """The simulated allocation failed even after the cache was released."""


def round_size(size: int) -> int:
    return MIN_BLOCK if size < MIN_BLOCK else -(-size // MIN_BLOCK) * MIN_BLOCK


def segment_size(size: int) -> int:
    if size <= SMALL_SIZE:
        return SMALL_SEGMENT
    if size < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass(eq=False)
class _Block:
    segment: int
    offset: int
    size: int
    small: bool
    allocated: bool = False
    previous: _Block | None = None
    next: _Block | None = None

    def key(self) -> tuple[int, int, int]:
        return (self.size, self.segment, self.offset)


@dataclass
class CachingAllocator:
    """The simulated allocator. `capacity` (bytes the allocator may reserve) None means unlimited.

    ``reserved`` and ``allocated`` follow ``torch.cuda.memory_reserved``/``memory_allocated``;
    ``peak_reserved``/``peak_allocated`` their maxima. Each live allocation carries a category,
    and ``at_peak`` holds the live bytes by category when ``reserved`` last reached its peak.
    """

    capacity: int | None = None
    reserved: int = 0
    allocated: int = 0
    peak_reserved: int = 0
    peak_allocated: int = 0
    releases: int = 0  # times the cache was released to satisfy an allocation
    at_peak: dict[str, int] = field(default_factory=dict)
    _pools: tuple[list, list] = field(default_factory=lambda: ([], []))  # (small, large): sorted keys of free blocks
    _free: dict = field(default_factory=dict)  # key -> free block
    _live: dict = field(default_factory=dict)  # handle -> (block, category)
    _by_category: dict[str, int] = field(default_factory=dict)
    _segments: int = 0
    _segment_sizes: dict[int, int] = field(default_factory=dict)

    def malloc(self, handle, size: int, category: str = "other") -> None:
        """Allocate `size` bytes for `handle` (any hashable name of the tensor).

        Raises:
            OutOfMemory: the allocation fails even after releasing the cache.
        """
        size = round_size(size)
        small = size <= SMALL_SIZE
        block = self._take_free(size, small)
        grew = block is None
        if grew:
            block = self._new_segment(size, small)
        remaining = block.size - size
        if remaining >= MIN_BLOCK if small else remaining > SMALL_SIZE:
            rest = _Block(block.segment, block.offset + size, remaining, small, previous=block, next=block.next)
            if block.next is not None:
                block.next.previous = rest
            block.next = rest
            block.size = size
            self._add_free(rest)
        block.allocated = True
        self._live[handle] = (block, category)
        self.allocated += block.size
        self._by_category[category] = self._by_category.get(category, 0) + block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        if grew and self.reserved > self.peak_reserved:
            self._record_peak()

    def free(self, handle) -> None:
        entry = self._live.pop(handle, None)
        if entry is None:
            return
        block, category = entry
        self.allocated -= block.size
        self._by_category[category] -= block.size
        block.allocated = False
        for neighbour in (block.previous, block.next):
            if neighbour is not None and not neighbour.allocated:
                self._remove_free(neighbour)
                if neighbour is block.previous:
                    neighbour.size += block.size
                    neighbour.next = block.next
                    if block.next is not None:
                        block.next.previous = neighbour
                    block = neighbour
                else:
                    block.size += neighbour.size
                    block.next = neighbour.next
                    if neighbour.next is not None:
                        neighbour.next.previous = block
        self._add_free(block)

    def is_live(self, handle) -> bool:
        return handle in self._live

    def live_bytes(self, category: str) -> int:
        return self._by_category.get(category, 0)

    # -- internals ----------------------------------------------------------------------------

    def _record_peak(self) -> None:
        self.peak_reserved = self.reserved
        self.at_peak = {k: v for k, v in self._by_category.items() if v}
        self.at_peak["allocator_cache"] = self.reserved - self.allocated

    def _take_free(self, size: int, small: bool) -> _Block | None:
        pool = self._pools[0 if small else 1]
        index = bisect.bisect_left(pool, (size, -1, -1))
        if index == len(pool):
            return None
        block = self._free.pop(pool.pop(index))
        return block

    def _add_free(self, block: _Block) -> None:
        key = block.key()
        bisect.insort(self._pools[0 if block.small else 1], key)
        self._free[key] = block

    def _remove_free(self, block: _Block) -> None:
        key = block.key()
        pool = self._pools[0 if block.small else 1]
        del pool[bisect.bisect_left(pool, key)]
        del self._free[key]

    def _new_segment(self, size: int, small: bool) -> _Block:
        allocation = segment_size(size)
        if self.capacity is not None and self.reserved + allocation > self.capacity:
            self._release_cache()
            if self.reserved + allocation > self.capacity:
                raise OutOfMemory(f"tried to allocate {allocation} bytes with {self.reserved} reserved "
                                  f"of {self.capacity}")
        segment = self._segments
        self._segments += 1
        self._segment_sizes[segment] = allocation
        self.reserved += allocation
        return _Block(segment, 0, allocation, small)

    def _release_cache(self) -> None:
        """``release_cached_blocks``: every completely free segment goes back to CUDA."""
        self.releases += 1
        for pool in self._pools:
            for key in [k for k in pool if self._free[k].previous is None and self._free[k].next is None]:
                del pool[bisect.bisect_left(pool, key)]
                block = self._free.pop(key)
                self.reserved -= self._segment_sizes.pop(block.segment)
