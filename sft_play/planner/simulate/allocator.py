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
import operator
from sft_play.units import MIB

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


class _Block:
    __slots__ = ("segment", "address", "size", "small", "allocated", "category", "previous", "next")

    def __init__(self, segment: int, address: int, size: int, small: bool, previous=None, next=None):
        self.segment = segment
        self.address = address  # orders blocks as (segment, offset) does: segment << 48 | offset
        self.size = size
        self.small = small
        self.allocated = False
        self.category = ""
        self.previous = previous
        self.next = next


_address = operator.attrgetter("address")


class _FreeBlocks:
    """One pool's cached blocks, for best fit: sorted distinct sizes, and per size the blocks in
    address order (segments in the order they were allocated)."""

    __slots__ = ("sizes", "by_size")

    def __init__(self):
        self.sizes: list[int] = []
        self.by_size: dict[int, list[_Block]] = {}

    def add(self, block: _Block) -> None:
        blocks = self.by_size.get(block.size)
        if blocks is None:
            self.by_size[block.size] = [block]
            bisect.insort(self.sizes, block.size)
        elif blocks[-1].address < block.address:  # most often the highest address of its size
            blocks.append(block)
        else:
            bisect.insort(blocks, block, key=_address)

    def remove(self, block: _Block) -> None:
        blocks = self.by_size[block.size]
        if len(blocks) == 1:
            del self.by_size[block.size]
            del self.sizes[bisect.bisect_left(self.sizes, block.size)]
        else:
            blocks.remove(block)

    def blocks(self) -> list[_Block]:
        return [b for blocks in self.by_size.values() for b in blocks]


class CachingAllocator:
    """The simulated allocator. `capacity` (bytes the allocator may reserve) None means unlimited.

    ``reserved`` and ``allocated`` follow ``torch.cuda.memory_reserved``/``memory_allocated``;
    ``peak_reserved``/``peak_allocated`` their maxima. Each live allocation carries a category,
    ``at_peak`` holds the live bytes by category when ``reserved`` last reached its peak, and
    ``at_peak_allocated`` when ``allocated`` did (the most the step's tensors ever hold).

    Args:
        capacity: bytes the allocator may reserve (None: unlimited).
        log: a list that receives every allocation ``("a", handle, size, category)`` and free
            ``("f", handle)`` in order (bench/memory_snapshot.py compares the planner's order
            with a GPU's).

    A replay makes tens of thousands of calls: the state is in slots and the hot paths read it
    into locals once per call.
    """

    __slots__ = ("capacity", "reserved", "allocated", "peak_reserved", "peak_allocated", "releases", "at_peak",
                 "_at_peak_allocated", "_peak_pending", "_pools", "_live", "_by_category", "_segments",
                 "_segment_sizes", "segment_address", "log", "points")

    def __init__(self, capacity: int | None = None, log: list | None = None):
        self.capacity = capacity
        self.reserved = self.allocated = self.peak_reserved = self.peak_allocated = 0
        self.releases = 0  # times the cache was released to satisfy an allocation
        self.at_peak: dict[str, int] = {}
        self._at_peak_allocated: dict[str, int] = {}
        # allocated rose to a new peak and nothing was freed since: the breakdown at the peak is
        # the current one, copied when the first free (or a reader) comes
        self._peak_pending = False
        self._pools = (_FreeBlocks(), _FreeBlocks())
        self._live: dict = {}  # handle -> block
        self._by_category: dict[str, int] = {}
        self._segments = 0
        self._segment_sizes: dict[int, int] = {}
        # Where the next segment starts, when a replay of a real trace knows it (cudaMalloc's address
        # orders equal-sized blocks); None: segments are ordered as they were created
        self.segment_address: int | None = None
        self.log = log
        self.points: dict[str, int] = {}  # (named points are host memory's: HostMemory.mark)

    def mark(self, point: str) -> None:
        pass

    @property
    def at_peak_allocated(self) -> dict[str, int]:
        if self._peak_pending:
            self._snapshot_allocated_peak()
        return self._at_peak_allocated

    def malloc(self, handle, size: int, category: str = "other") -> None:
        """Allocate `size` bytes for `handle` (any hashable name of the tensor).

        Raises:
            OutOfMemory: the allocation fails even after releasing the cache.
        """
        if self.log is not None:
            self.log.append(("a", handle, size, category))
        size = MIN_BLOCK if size < MIN_BLOCK else -(-size // MIN_BLOCK) * MIN_BLOCK
        small = size <= SMALL_SIZE
        pool = self._pools[0 if small else 1]
        # the best fit: the smallest cached size that holds it, lowest address first
        sizes = pool.sizes
        index = bisect.bisect_left(sizes, size)
        grew = index == len(sizes)
        if grew:
            block = self._new_segment(size, small)
        else:
            found = sizes[index]
            by_size = pool.by_size
            blocks = by_size[found]
            if len(blocks) == 1:
                block = blocks[0]
                del by_size[found]
                del sizes[index]
            else:
                block = blocks.pop(0)
        remaining = block.size - size
        if remaining >= MIN_BLOCK if small else remaining > SMALL_SIZE:
            following = block.next
            rest = _Block(block.segment, block.address + size, remaining, small, block, following)
            if following is not None:
                following.previous = rest
            block.next = rest
            block.size = size
            pool.add(rest)
        block.allocated = True
        block.category = category
        self._live[handle] = block
        allocated = self.allocated + block.size
        self.allocated = allocated
        by_category = self._by_category
        by_category[category] = by_category.get(category, 0) + block.size
        if allocated > self.peak_allocated:
            self.peak_allocated = allocated
            self._peak_pending = True
        if grew and self.reserved > self.peak_reserved:
            self._record_peak()

    def free(self, handle) -> None:
        block = self._live.pop(handle, None)
        if block is None:
            return
        if self.log is not None:
            self.log.append(("f", handle))
        if self._peak_pending:
            self._snapshot_allocated_peak()
        self.allocated -= block.size
        self._by_category[block.category] -= block.size
        block.allocated = False
        pool = self._pools[0 if block.small else 1]
        previous, following = block.previous, block.next
        if previous is not None and not previous.allocated:
            pool.remove(previous)
            previous.size += block.size
            previous.next = following
            if following is not None:
                following.previous = previous
            block = previous
        if following is not None and not following.allocated:
            pool.remove(following)
            block.size += following.size
            after = following.next
            block.next = after
            if after is not None:
                after.previous = block
        pool.add(block)

    # -- internals ----------------------------------------------------------------------------

    def _snapshot_allocated_peak(self) -> None:
        self._at_peak_allocated = {k: v for k, v in self._by_category.items() if v}
        self._peak_pending = False

    def _record_peak(self) -> None:
        self.peak_reserved = self.reserved
        self.at_peak = {k: v for k, v in self._by_category.items() if v}
        self.at_peak["allocator_cache"] = self.reserved - self.allocated

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
        address = segment << 48 if self.segment_address is None else self.segment_address
        self.segment_address = None  # it was this segment's
        return _Block(segment, address, allocation, small)

    def _release_cache(self) -> None:
        """``release_cached_blocks``: every completely free segment goes back to CUDA."""
        self.releases += 1
        for pool in self._pools:
            for block in pool.blocks():
                if block.previous is None and block.next is None:
                    pool.remove(block)
                    self.reserved -= self._segment_sizes.pop(block.segment)


class HostMemory:
    """Host memory as a CPU training process's tensors hold it: what is asked is what is counted
    (no 512-byte rounding, no blocks kept whole, no cache; glibc's malloc hands freed memory back
    for the next request or to the system). The same interface as :class:`CachingAllocator`:
    ``reserved`` is ``allocated``, and a `capacity` exceeded by the live bytes is out of memory.
    Checked against PyTorch's memory profile of real CPU steps (bench/cpu_ground_truth.py)."""

    def __init__(self, capacity: int | None = None, log: list | None = None):
        self.capacity = capacity
        self.allocated = self.peak_allocated = self.releases = 0
        self.at_peak_allocated: dict[str, int] = {}
        self.log = log
        self._live: dict = {}  # handle -> (size, category)
        self._by_category: dict[str, int] = {}
        self.points: dict[str, int] = {}  # the live bytes at each named point of the step, as last passed

    def mark(self, point: str) -> None:
        self.points[point] = self.allocated

    @property
    def peak_reserved(self) -> int:
        return self.peak_allocated

    @property
    def at_peak(self) -> dict[str, int]:
        return self.at_peak_allocated

    def malloc(self, handle, size: int, category: str = "other") -> None:
        if self.log is not None:
            self.log.append(("a", handle, size, category))
        if self.capacity is not None and self.allocated + size > self.capacity:
            raise OutOfMemory(f"tried to allocate {size} bytes with {self.allocated} in use of {self.capacity}")
        self._live[handle] = (size, category)
        self.allocated += size
        self._by_category[category] = self._by_category.get(category, 0) + size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
            self.at_peak_allocated = {k: v for k, v in self._by_category.items() if v}

    def free(self, handle) -> None:
        found = self._live.pop(handle, None)
        if found is not None:
            if self.log is not None:
                self.log.append(("f", handle))
            self.allocated -= found[0]
            self._by_category[found[1]] -= found[0]
