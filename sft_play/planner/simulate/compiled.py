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
(size, address) in one array (``free[pool, SIZE | ADDRESS | BLOCK, i]``), so the best fit is a
binary search, as ``lower_bound`` is in ``CUDACachingAllocator.cpp``.
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
    # Without numba's reference counts (``_nrt``, its runtime): every array is made in Python
    # (:func:`_arrays`) and only indexed here, and counting each one in and out of every helper,
    # atomically, was half of a replay. The helpers are inlined into the loop.
    jit = numba.njit(cache=True, nogil=True, _nrt=False)
    inline = numba.njit(cache=True, nogil=True, _nrt=False, inline="always")
    global _position, _remove, _insert, _release, _new_block, _retire, _take, _give_back
    _position, _remove, _insert, _release = inline(_position), inline(_remove), inline(_insert), inline(_release)
    _new_block, _retire = inline(_new_block), inline(_retire)
    _take, _give_back = inline(_take), inline(_give_back)
    return jit(_replay)


# A pool's free list: free[pool, SIZE | ADDRESS | BLOCK, i], sorted by (size, address), counts[pool] long
SIZE, ADDRESS, BLOCK = 0, 1, 2


def _position(free, counts, pool, size, address):
    """The first position of `pool`'s free list whose (size, address) is not below the given:
    with address -1, the best fit for `size` (the smallest block that holds it, lowest address)."""
    low, high = 0, counts[pool]
    while low < high:
        middle = (low + high) >> 1
        found = free[pool, SIZE, middle]
        if found < size or (found == size and free[pool, ADDRESS, middle] < address):
            low = middle + 1
        else:
            high = middle
    return low


def _remove(free, counts, pool, position):
    for field in range(3):  # each field's run moved in one contiguous loop (no slices: a view each time)
        for i in range(position, counts[pool] - 1):
            free[pool, field, i] = free[pool, field, i + 1]
    counts[pool] -= 1


def _insert(free, counts, pool, size, address, block):
    position = _position(free, counts, pool, size, address)
    for field in range(3):
        for i in range(counts[pool], position, -1):
            free[pool, field, i] = free[pool, field, i - 1]
    free[pool, SIZE, position], free[pool, ADDRESS, position], free[pool, BLOCK, position] = size, address, block
    counts[pool] += 1


def _release(free, counts, previous, following, segment_of, segment_sizes, state, dead):
    """``release_cached_blocks``: every completely free segment goes back; the bytes released."""
    released = 0
    for pool in range(2):
        i = 0
        while i < counts[pool]:
            block = free[pool, BLOCK, i]
            if previous[block] == -1 and following[block] == -1:
                released += segment_sizes[segment_of[block]]
                _remove(free, counts, pool, i)
                _retire(block, state, dead)
            else:
                i += 1
    return released


# The replay's counters: state[RESERVED | RELEASES | BLOCKS | SEGMENTS | DEAD]
RESERVED, RELEASES, BLOCKS, SEGMENTS, DEAD = 0, 1, 2, 3, 4


def _new_block(state, dead):
    """A block number for a new block: one a merge or a release retired, else the next. Reused,
    the blocks' arrays stay as long as the most blocks alive at once, not one entry per split of
    the step (millions for a long row's tiled MLPs), and stay in the processor's caches."""
    if state[DEAD] > 0:
        state[DEAD] -= 1
        return dead[state[DEAD]]
    block = state[BLOCKS]
    state[BLOCKS] += 1
    return block


def _retire(block, state, dead):
    dead[state[DEAD]] = block
    state[DEAD] += 1


def _take(size, capacity, rules, blocks, free, counts, segment_sizes, state, dead):
    """The block serving an allocation of `size` rounded bytes: the best fit, else a new segment
    (after releasing the cache at `capacity`), split when the rest is large enough; (block, grew),
    block -1 where the allocation fails."""
    segment_of, address, size_of, small_pool, taken, _, previous, following = blocks
    min_block, small_size, small_segment, large_segment, min_large_alloc, round_large = rules
    small = size <= small_size
    pool = 0 if small else 1
    index = _position(free, counts, pool, size, -1)
    grew = index == counts[pool]
    if grew:
        if small:
            allocation = small_segment
        elif size < min_large_alloc:
            allocation = large_segment
        else:
            allocation = ((size + round_large - 1) // round_large) * round_large
        if capacity >= 0 and state[RESERVED] + allocation > capacity:
            state[RELEASES] += 1
            state[RESERVED] -= _release(free, counts, previous, following, segment_of, segment_sizes, state, dead)
            if state[RESERVED] + allocation > capacity:
                return -1, grew
        segment = state[SEGMENTS]
        segment_sizes[segment] = allocation
        state[RESERVED] += allocation
        block = _new_block(state, dead)
        segment_of[block], address[block], size_of[block] = segment, segment << 48, allocation
        small_pool[block] = small
        previous[block], following[block] = -1, -1
        state[SEGMENTS] += 1
    else:
        block = free[pool, BLOCK, index]
        _remove(free, counts, pool, index)
    remaining = size_of[block] - size
    if (remaining >= min_block) if small else (remaining > small_size):
        rest = _new_block(state, dead)
        segment_of[rest], address[rest], size_of[rest] = segment_of[block], address[block] + size, remaining
        small_pool[rest], taken[rest] = small, False
        previous[rest], following[rest] = block, following[block]
        if following[block] != -1:
            previous[following[block]] = rest
        following[block] = rest
        size_of[block] = size
        _insert(free, counts, pool, remaining, address[rest], rest)
    return block, grew


def _give_back(block, blocks, free, counts, state, dead):
    """A freed block merged with the free blocks beside it in its segment, and cached."""
    _, address, size_of, small_pool, taken, _, previous, following = blocks
    taken[block] = False
    pool = 0 if small_pool[block] else 1
    before, after = previous[block], following[block]
    if before != -1 and not taken[before]:  # merged into the free block before it
        _remove(free, counts, pool, _position(free, counts, pool, size_of[before], address[before]))
        size_of[before] += size_of[block]
        following[before] = after
        if after != -1:
            previous[after] = before
        _retire(block, state, dead)
        block = before
    if after != -1 and not taken[after]:  # and the free block after it into it
        _remove(free, counts, pool, _position(free, counts, pool, size_of[after], address[after]))
        size_of[block] += size_of[after]
        following[block] = following[after]
        if following[after] != -1:
            previous[following[after]] = block
        _retire(after, state, dead)
    _insert(free, counts, pool, size_of[block], address[block], block)


def _arrays(kinds: np.ndarray, handle_count: int, category_count: int) -> tuple:
    """The replay's working arrays, for `kinds`' allocations: per block, its segment, address,
    size, small pool or not, allocated or not, category, previous and next (-1: none), each
    written as a block is made (empty, not zeroed: only the blocks alive at once are touched); the
    segments' sizes; the pools' free lists; the retired block numbers (reused first); the free
    lists' lengths; the counters (:data:`RESERVED`...); each handle's live block; the bytes by
    category now, at the reserved peak (the allocator's cache last) and at the allocated peak."""
    allocations = int(np.count_nonzero(kinds))
    most = 2 * allocations + 2  # an allocation makes at most two blocks: a segment and a split's rest
    blocks = (np.empty(most, np.int64), np.empty(most, np.int64), np.empty(most, np.int64), np.empty(most, np.bool_),
              np.empty(most, np.bool_), np.empty(most, np.int64), np.empty(most, np.int64), np.empty(most, np.int64))
    return (blocks, np.empty(allocations + 1, np.int64), np.empty((2, 3, most), np.int64), np.empty(most, np.int64),
            np.zeros(2, np.int64), np.zeros(5, np.int64), np.full(handle_count, -1, np.int64),
            np.zeros(category_count, np.int64), np.zeros(category_count + 1, np.int64),
            np.zeros(category_count, np.int64))


def _replay(kinds, handles, sizes, categories, capacity, rules, blocks, segment_sizes, free, dead, counts, state, live,
            by_category, at_peak, at_peak_allocated):
    """Replay the events into the arrays of :func:`_arrays`; `capacity` < 0 is unlimited; `rules`
    the allocator's sizes (:data:`RULES`, passed at run time: numba's cache follows this file, not
    the module the sizes come from). Returns (peak_reserved, peak_allocated, releases,
    out_of_memory); the bytes by category at the peaks are left in `at_peak` and `at_peak_allocated`."""
    min_block = rules[0]
    events = kinds.shape[0]
    category_count = by_category.shape[0]
    size_of, taken, category_of = blocks[2], blocks[4], blocks[5]
    allocated = peak_reserved = peak_allocated = 0
    pending = False  # allocated reached a new peak and nothing was freed since
    out_of_memory = False
    for event in range(events):
        handle = handles[event]
        if kinds[event] == 1:
            size = sizes[event]
            size = min_block if size < min_block else ((size + min_block - 1) // min_block) * min_block
            block, grew = _take(size, capacity, rules, blocks, free, counts, segment_sizes, state, dead)
            if block == -1:
                out_of_memory = True
                break
            category = categories[event]
            taken[block] = True
            category_of[block] = category
            live[handle] = block
            allocated += size_of[block]
            by_category[category] += size_of[block]
            if allocated > peak_allocated:
                peak_allocated = allocated
                pending = True
            if grew and state[RESERVED] > peak_reserved:
                peak_reserved = state[RESERVED]
                for category in range(category_count):  # (a slice's copy would need numba's runtime)
                    at_peak[category] = by_category[category]
                at_peak[category_count] = state[RESERVED] - allocated
        else:
            block = live[handle]
            if block == -1:
                continue
            live[handle] = -1
            if pending:
                for category in range(category_count):
                    at_peak_allocated[category] = by_category[category]
                pending = False
            allocated -= size_of[block]
            by_category[category_of[block]] -= size_of[block]
            _give_back(block, blocks, free, counts, state, dead)
    if pending:
        for category in range(category_count):
            at_peak_allocated[category] = by_category[category]
    return peak_reserved, peak_allocated, state[RELEASES], out_of_memory


# The replay's handles (sft_play.planner.simulate.step): a traced tensor's is its layer's number
# shifted by 24 bits plus its id in the layer's trace; the replay's own count up from 1 << 62
_OWN = 1 << 62
_LAYER_BITS = 24


def _numbered(handles: np.ndarray) -> tuple[np.ndarray, int]:
    """The handles numbered from 0 (each distinct handle its own number) and how many numbers:
    read off the step's handles where they have that layout (one pass, where sorting every event
    took a third of a replay), else by sorting them."""
    if handles.size:
        own = handles >= _OWN
        traced = handles[~own]
        if traced.size and traced.min() >= 0:
            layer, event = traced >> _LAYER_BITS, traced & ((1 << _LAYER_BITS) - 1)
            width = int(event.max()) + 1
            span = (int(layer.max()) + 1) * width
            extra = int(handles[own].max() - _OWN) + 1 if own.any() else 0
            if span + extra <= 4 * handles.size + 4096:  # (a layout this sparse is sorted instead)
                numbered = np.empty_like(handles)
                numbered[~own] = layer * width + event
                numbered[own] = span + (handles[own] - _OWN)
                return numbered, span + extra
    dense, inverse = np.unique(handles, return_inverse=True)
    return inverse.astype(np.int64).reshape(-1), len(dense)


def available() -> bool:
    """Whether replays run compiled."""
    return _kernel() is not None


def compile_ahead() -> bool:
    """Compile the replay now and keep it on disk, as ``make install`` byte-compiles the Python:
    else the first plan after an install compiles it (seconds). False where numba is not there."""
    if not available():
        return False
    events = np.array([1, 0], np.int64)  # one allocation and its free, of the arrays' types a step's replay has
    replay(events, np.zeros(2, np.int64), np.array([512, 0], np.int64), ["weights"], np.zeros(2, np.int64), None)
    return True


def loaded() -> bool:
    """Whether this process has loaded the compiled replay already (then a replay of any size costs
    less compiled than through the reference allocator)."""
    return _kernel.cache_info().currsize > 0 and _kernel() is not None


def replay(kinds: np.ndarray, handles: np.ndarray, sizes: np.ndarray, categories: list[str],
           category_ids: np.ndarray, capacity: int | None) -> dict:
    """Replay events (`kinds` 1 allocate / 0 free, `handles` any int64 names, `sizes` in bytes,
    `category_ids` indexing `categories`, numbered in the order categories first appear) with
    `capacity` bytes (None: unlimited). Returns what :class:`CachingAllocator` would hold after
    the same calls: ``peak_reserved``, ``peak_allocated``, ``releases``, ``out_of_memory``,
    ``at_peak`` and ``at_peak_allocated`` (dicts by category, as the reference builds them)."""
    numbered, count = _numbered(handles)
    arrays = _arrays(kinds, count, len(categories))
    at_peak, at_peak_allocated = arrays[-2:]
    peak_reserved, peak_allocated, releases, oom = _kernel()(
        kinds, numbered, sizes, category_ids, -1 if capacity is None else max(0, int(capacity)), RULES, *arrays)
    peak = {categories[c]: int(v) for c, v in enumerate(at_peak[:-1]) if v}
    if peak_reserved:
        peak["allocator_cache"] = int(at_peak[-1])
    return {"peak_reserved": int(peak_reserved), "peak_allocated": int(peak_allocated), "releases": int(releases),
            "out_of_memory": bool(oom), "at_peak": peak,
            "at_peak_allocated": {categories[c]: int(v) for c, v in enumerate(at_peak_allocated) if v}}
