"""The caching allocator's rules (:mod:`sft_play.planner.simulate.allocator`) compiled: a whole
training step's allocations and frees, given as arrays, replayed in one call.

A replay is tens of thousands of allocations; in Python each costs microseconds of interpreter
work, which made a plan with remedies tens of seconds. Here the same rules run as machine code
(numba: a wheel with its own LLVM, so nothing is built on the user's machine). Like Python's own
bytecode, the machine code is compiled once for the installed source and kept beside it
(``__pycache__``, or numba's user-wide cache where that folder cannot be written).
:class:`~sft_play.planner.simulate.allocator.CachingAllocator` stays the reference: the two are
checked against each other, event for event (tests/test_allocator.py), and where numba cannot be
imported the step is replayed through the reference, with the same predictions.

Data layout: blocks are rows of parallel arrays (segment, address, size, allocated, category, the
previous and next block of the segment, -1 for none); each pool's cached blocks are kept sorted by
(size, address) in three arrays, so the best fit is a binary search, as ``lower_bound`` is in
``CUDACachingAllocator.cpp``.
"""

from __future__ import annotations

import functools
import logging
import os

import numpy as np

from sft_play.planner.simulate.allocator import LARGE_SEGMENT, MIN_BLOCK, MIN_LARGE_ALLOC, ROUND_LARGE, SMALL_SEGMENT, SMALL_SIZE

logger = logging.getLogger(__name__)

RULES = (MIN_BLOCK, SMALL_SIZE, SMALL_SEGMENT, LARGE_SEGMENT, MIN_LARGE_ALLOC, ROUND_LARGE)


@functools.lru_cache(maxsize=1)
def _kernel():
    """numba's compiled :func:`_replay`, or None where numba is not installed (or fails to load).
    Loaded at the first replay, not on import: a process that plans nothing never imports numba."""
    if os.environ.get("SFT_PLAY_PURE_PYTHON_ALLOCATOR"):
        return None
    try:
        import numba
    except Exception as error:  # noqa: BLE001 - the reference allocator replays instead
        logger.debug("numba unavailable (%s): replays run through the Python allocator", error)
        return None
    jit = numba.njit(cache=True, nogil=True)
    global _free_position
    _free_position = jit(_free_position)  # _replay calls it compiled
    return jit(_replay)


def _free_position(keys_size, keys_address, pool, count, size, address):
    """The first position of `pool`'s sorted free list whose (size, address) is not below the given."""
    low, high = 0, count
    while low < high:
        middle = (low + high) >> 1
        s = keys_size[pool, middle]
        if s < size or (s == size and keys_address[pool, middle] < address):
            low = middle + 1
        else:
            high = middle
    return low


def _replay(kinds, handles, sizes, categories, handle_count, category_count, capacity, rules):
    """Replay the events; `capacity` < 0 is unlimited; `rules` the allocator's sizes (:data:`RULES`,
    passed at run time: numba's cache follows this file, not the module the sizes come from).
    Returns (peak_reserved, peak_allocated, releases, out_of_memory, at_peak, at_peak_allocated):
    the by-category arrays with the allocator's cache last in ``at_peak``."""
    min_block, small_size, small_segment, large_segment, min_large_alloc, round_large = rules
    events = kinds.shape[0]
    most = 2 * events + 2
    block_segment = np.zeros(most, np.int64)
    block_address = np.zeros(most, np.int64)
    block_size = np.zeros(most, np.int64)
    block_small = np.zeros(most, np.bool_)
    block_allocated = np.zeros(most, np.bool_)
    block_category = np.zeros(most, np.int64)
    block_previous = np.full(most, -1, np.int64)
    block_next = np.full(most, -1, np.int64)
    blocks = 0
    segment_sizes = np.zeros(events + 1, np.int64)
    segments = 0
    keys_size = np.zeros((2, most), np.int64)
    keys_address = np.zeros((2, most), np.int64)
    keys_block = np.zeros((2, most), np.int64)
    counts = np.zeros(2, np.int64)
    live = np.full(handle_count, -1, np.int64)
    by_category = np.zeros(category_count, np.int64)
    at_peak = np.zeros(category_count + 1, np.int64)
    at_peak_allocated = np.zeros(category_count, np.int64)
    reserved = allocated = peak_reserved = peak_allocated = releases = 0
    pending = False
    out_of_memory = False

    for event in range(events):
        handle = handles[event]
        if kinds[event] == 1:
            size = sizes[event]
            size = min_block if size < min_block else ((size + min_block - 1) // min_block) * min_block
            small = size <= small_size
            pool = 0 if small else 1
            index = _free_position(keys_size, keys_address, pool, counts[pool], size, -1)
            grew = index == counts[pool]
            if grew:
                if small:
                    allocation = small_segment
                elif size < min_large_alloc:
                    allocation = large_segment
                else:
                    allocation = ((size + round_large - 1) // round_large) * round_large
                if capacity >= 0 and reserved + allocation > capacity:
                    # release_cached_blocks: every completely free segment goes back
                    releases += 1
                    for p in range(2):
                        i = 0
                        while i < counts[p]:
                            b = keys_block[p, i]
                            if block_previous[b] == -1 and block_next[b] == -1:
                                reserved -= segment_sizes[block_segment[b]]
                                for j in range(i, counts[p] - 1):
                                    keys_size[p, j] = keys_size[p, j + 1]
                                    keys_address[p, j] = keys_address[p, j + 1]
                                    keys_block[p, j] = keys_block[p, j + 1]
                                counts[p] -= 1
                            else:
                                i += 1
                    if reserved + allocation > capacity:
                        out_of_memory = True
                        break
                segment_sizes[segments] = allocation
                reserved += allocation
                block = blocks
                blocks += 1
                block_segment[block] = segments
                block_address[block] = segments << 48
                block_size[block] = allocation
                block_small[block] = small
                block_previous[block] = -1
                block_next[block] = -1
                segments += 1
            else:
                block = keys_block[pool, index]
                for j in range(index, counts[pool] - 1):
                    keys_size[pool, j] = keys_size[pool, j + 1]
                    keys_address[pool, j] = keys_address[pool, j + 1]
                    keys_block[pool, j] = keys_block[pool, j + 1]
                counts[pool] -= 1
            remaining = block_size[block] - size
            if (remaining >= min_block) if small else (remaining > small_size):
                following = block_next[block]
                rest = blocks
                blocks += 1
                block_segment[rest] = block_segment[block]
                block_address[rest] = block_address[block] + size
                block_size[rest] = remaining
                block_small[rest] = small
                block_allocated[rest] = False
                block_previous[rest] = block
                block_next[rest] = following
                if following != -1:
                    block_previous[following] = rest
                block_next[block] = rest
                block_size[block] = size
                position = _free_position(keys_size, keys_address, pool, counts[pool], remaining, block_address[rest])
                for j in range(counts[pool], position, -1):
                    keys_size[pool, j] = keys_size[pool, j - 1]
                    keys_address[pool, j] = keys_address[pool, j - 1]
                    keys_block[pool, j] = keys_block[pool, j - 1]
                keys_size[pool, position] = remaining
                keys_address[pool, position] = block_address[rest]
                keys_block[pool, position] = rest
                counts[pool] += 1
            category = categories[event]
            block_allocated[block] = True
            block_category[block] = category
            live[handle] = block
            allocated += block_size[block]
            by_category[category] += block_size[block]
            if allocated > peak_allocated:
                peak_allocated = allocated
                pending = True
            if grew and reserved > peak_reserved:
                peak_reserved = reserved
                for c in range(category_count):
                    at_peak[c] = by_category[c]
                at_peak[category_count] = reserved - allocated
        else:
            block = live[handle]
            if block == -1:
                continue
            live[handle] = -1
            if pending:
                for c in range(category_count):
                    at_peak_allocated[c] = by_category[c]
                pending = False
            allocated -= block_size[block]
            by_category[block_category[block]] -= block_size[block]
            block_allocated[block] = False
            pool = 0 if block_small[block] else 1
            previous = block_previous[block]
            following = block_next[block]
            for neighbour in (previous, following):
                if neighbour == -1 or block_allocated[neighbour]:
                    continue
                position = _free_position(keys_size, keys_address, pool, counts[pool], block_size[neighbour],
                                          block_address[neighbour])
                for j in range(position, counts[pool] - 1):
                    keys_size[pool, j] = keys_size[pool, j + 1]
                    keys_address[pool, j] = keys_address[pool, j + 1]
                    keys_block[pool, j] = keys_block[pool, j + 1]
                counts[pool] -= 1
                if neighbour == previous:
                    block_size[previous] += block_size[block]
                    block_next[previous] = following
                    if following != -1:
                        block_previous[following] = previous
                    block = previous
                else:
                    block_size[block] += block_size[following]
                    after = block_next[following]
                    block_next[block] = after
                    if after != -1:
                        block_previous[after] = block
            position = _free_position(keys_size, keys_address, pool, counts[pool], block_size[block],
                                      block_address[block])
            for j in range(counts[pool], position, -1):
                keys_size[pool, j] = keys_size[pool, j - 1]
                keys_address[pool, j] = keys_address[pool, j - 1]
                keys_block[pool, j] = keys_block[pool, j - 1]
            keys_size[pool, position] = block_size[block]
            keys_address[pool, position] = block_address[block]
            keys_block[pool, position] = block
            counts[pool] += 1
    if pending:
        for c in range(category_count):
            at_peak_allocated[c] = by_category[c]
    return peak_reserved, peak_allocated, releases, out_of_memory, at_peak, at_peak_allocated


def available() -> bool:
    """Whether replays run compiled."""
    return _kernel() is not None


def replay(kinds: np.ndarray, handles: np.ndarray, sizes: np.ndarray, categories: list[str],
           category_ids: np.ndarray, capacity: int | None) -> dict:
    """Replay events (`kinds` 1 allocate / 0 free, `handles` any int64 names, `sizes` in bytes,
    `category_ids` indexing `categories`, numbered in the order categories first appear) with
    `capacity` bytes (None: unlimited). Returns what :class:`CachingAllocator` would hold after
    the same calls: ``peak_reserved``, ``peak_allocated``, ``releases``, ``out_of_memory``,
    ``at_peak`` and ``at_peak_allocated`` (dicts by category, as the reference builds them)."""
    dense, inverse = np.unique(handles, return_inverse=True)
    peak_reserved, peak_allocated, releases, oom, at_peak, at_peak_allocated = _kernel()(
        kinds, inverse.astype(np.int64), sizes, category_ids, len(dense), len(categories),
        -1 if capacity is None else max(0, int(capacity)), RULES)
    peak = {categories[c]: int(v) for c, v in enumerate(at_peak[:-1]) if v}
    if peak_reserved:
        peak["allocator_cache"] = int(at_peak[-1])
    return {"peak_reserved": int(peak_reserved), "peak_allocated": int(peak_allocated), "releases": int(releases),
            "out_of_memory": bool(oom), "at_peak": peak,
            "at_peak_allocated": {categories[c]: int(v) for c, v in enumerate(at_peak_allocated) if v}}
