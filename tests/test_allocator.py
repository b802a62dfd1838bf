"""The caching-allocator simulation follows PyTorch's rules (c10/cuda/CUDACachingAllocator.cpp)."""

from __future__ import annotations

import pytest

from sft_play.planner.simulate.allocator import MIB, CachingAllocator, HostMemory, OutOfMemory, round_size, segment_size


def test_sizes_round_to_512_bytes_and_segments_by_pool():
    assert round_size(1) == 512 and round_size(513) == 1024 and round_size(4096) == 4096
    assert segment_size(100) == 2 * MIB  # small pool: 2 MiB segments
    assert segment_size(1 * MIB) == 2 * MIB
    assert segment_size(1 * MIB + 512) == 20 * MIB  # under 10 MiB: a 20 MiB segment
    assert segment_size(10 * MIB) == 10 * MIB  # from 10 MiB: rounded up to 2 MiB
    assert segment_size(11 * MIB) == 12 * MIB


def test_small_requests_share_a_segment_and_large_ones_split_theirs():
    a = CachingAllocator()
    a.malloc("x", 1000)
    a.malloc("y", 1000)
    assert a.reserved == 2 * MIB and a.allocated == 2048
    a.malloc("big", 3 * MIB)  # a 20 MiB segment, split: the rest stays cached
    assert a.reserved == 22 * MIB and a.allocated == 2048 + 3 * MIB
    a.malloc("more", 3 * MIB)  # served from the cached remainder
    assert a.reserved == 22 * MIB


def test_a_large_remainder_of_at_most_1_mib_is_not_split_off():
    a = CachingAllocator()
    a.malloc("x", 11 * MIB)  # a 12 MiB segment; 1 MiB left is not more than 1 MiB
    assert a.allocated == 12 * MIB


def test_freed_blocks_are_cached_merged_and_reused_best_fit():
    a = CachingAllocator()
    for name in "abc":
        a.malloc(name, 30 * MIB)
    assert a.reserved == 90 * MIB
    a.free("a")
    a.free("b")
    a.malloc("d", 25 * MIB)  # best fit: a cached 30 MiB block, split
    assert a.reserved == 90 * MIB and a.allocated == 55 * MIB
    a.malloc("e", 40 * MIB)  # nothing cached is large enough (blocks of different segments never merge)
    assert a.reserved == 130 * MIB
    a.free("d")
    a.free("e")
    a.free("c")
    assert a.allocated == 0 and a.reserved == 130 * MIB  # freed memory stays reserved
    assert a.peak_reserved == 130 * MIB and a.peak_allocated == 95 * MIB


def test_adjacent_free_blocks_of_one_segment_merge():
    a = CachingAllocator()
    a.malloc("whole", 60 * MIB)
    a.free("whole")
    a.malloc("x", 20 * MIB)  # split from the cached 60 MiB block
    a.malloc("y", 20 * MIB)
    a.free("x")
    a.free("y")  # merges with x's block and the rest: one 60 MiB block again
    a.malloc("z", 60 * MIB)
    assert a.reserved == 60 * MIB


def test_at_the_limit_the_cache_is_released_and_the_allocation_retried():
    a = CachingAllocator(capacity=100 * MIB)
    a.malloc("a", 40 * MIB)
    a.malloc("b", 40 * MIB)
    a.free("a")
    a.malloc("c", 50 * MIB)  # 80 reserved + 50 > 100: the free 40 MiB segment goes back, then it fits
    assert a.releases == 1 and a.reserved == 90 * MIB
    with pytest.raises(OutOfMemory):
        a.malloc("d", 20 * MIB)


def test_the_breakdown_at_the_peak_accounts_for_every_reserved_byte():
    a = CachingAllocator()
    a.malloc("w", 50 * MIB, "weights")
    a.malloc("x", 30 * MIB, "activations")
    a.free("x")
    a.malloc("y", 40 * MIB, "activations")
    assert a.peak_reserved == 120 * MIB
    assert a.at_peak == {"weights": 50 * MIB, "activations": 40 * MIB, "allocator_cache": 30 * MIB}


def _reference(events: list[tuple], categories: list[str], capacity: int | None) -> dict:
    a = CachingAllocator(capacity=capacity)
    oom = False
    try:
        for kind, handle, size, category in events:
            if kind:
                a.malloc(handle, size, categories[category])
            else:
                a.free(handle)
    except OutOfMemory:
        oom = True
    return {"peak_reserved": a.peak_reserved, "peak_allocated": a.peak_allocated, "releases": a.releases,
            "out_of_memory": oom, "at_peak": dict(a.at_peak), "at_peak_allocated": dict(a.at_peak_allocated)}


def _random_step(seed: int) -> list[tuple]:
    """Allocations of a step's mix of sizes (small, under 10 MiB, large; some exact segment
    sizes) and frees of live ones, in random order, with categories first named in random order."""
    import random

    rng = random.Random(seed)
    live, events, handle = [], [], 0
    for _ in range(rng.randrange(200, 1500)):
        if live and rng.random() < 0.45:
            events.append((0, live.pop(rng.randrange(len(live))), 0, 0))
            continue
        size = rng.choice([rng.randrange(1, 1 * MIB), rng.randrange(MIB, 10 * MIB), rng.randrange(10 * MIB, 200 * MIB),
                           2 * MIB, 20 * MIB, 512, 0])
        handle += 1
        live.append(handle if rng.random() < 0.9 else rng.randrange(1, handle + 1))  # now and then a name again
        events.append((1, live[-1], size, rng.randrange(4)))
    events += [(0, h, 0, 0) for h in rng.sample(live, len(live) // 2)]
    return events


@pytest.mark.parametrize("seed", range(40))
def test_the_compiled_replay_holds_what_the_reference_allocator_holds(seed):
    """sft_play.planner.simulate.compiled replays planned steps; the Python allocator is the
    reference: peaks, releases, the out-of-memory point and the breakdowns (their order too)."""
    import numpy as np

    from sft_play.planner.simulate import compiled

    if not compiled.available():
        pytest.skip("numba is not installed: replays run through the reference")
    events = _random_step(seed)
    categories = ["activations", "weights", "gradients", "other"]
    # numbered as an allocation first names them, as the step's recorder numbers them
    order = list(dict.fromkeys(categories[c] for kind, _, _, c in events if kind))
    renumber = {categories.index(name): number for number, name in enumerate(order)}
    columns = [np.array(column, np.int64) for column in zip(*[(k, h, s, renumber.get(c, 0)) for k, h, s, c in events])]
    unlimited = _reference(events, categories, None)
    for capacity in (None, unlimited["peak_reserved"], int(unlimited["peak_allocated"] * 1.05),
                     unlimited["peak_allocated"] // 2):
        expected = _reference(events, categories, capacity)
        found = compiled.replay(*columns[:3], order, columns[3], capacity)
        assert found == expected
        assert list(found["at_peak"]) == list(expected["at_peak"])
        assert list(found["at_peak_allocated"]) == list(expected["at_peak_allocated"])


@pytest.mark.parametrize("model, overrides, gpus, micro", [
    ("llama-3.1-8b", ("finetune.method=lora", "data.max_seq_length=2048"), 1, 2),
    ("qwen2.5-7b", ("finetune.method=full", "distributed.strategy=deepspeed_zero3", "train.gradient_checkpointing=true",
                    "data.max_seq_length=1024"), 8, 3),
    ("tiny-qwen3-next", ("finetune.method=lora", "data.max_seq_length=512"), 1, 4),  # a hybrid's kinds of layers
])
def test_a_public_models_step_replays_compiled_as_through_the_reference(model, overrides, gpus, micro, monkeypatch):
    from sft_play import config as config_module
    from sft_play.planner import Target, model_shape, resolve_for
    from sft_play.planner.simulate import compiled, step
    from sft_play.planner.simulate.predict import replay_step
    from tests.conftest import FIXTURES

    if not compiled.available():
        pytest.skip("numba is not installed: replays run through the reference")
    config = config_module.load(None, [f"model.name_or_path={FIXTURES / 'model_configs' / model}", *overrides],
                                check_paths=False)
    shape = model_shape(config)
    run = resolve_for(config, Target(gpus, 80 * 1024**3, f"{gpus} x GPU"), None, shape)
    replays = {}
    for way, threshold in (("reference", float("inf")), ("compiled", 0)):
        monkeypatch.setattr(step, "COMPILED_FROM", threshold)
        unlimited = replay_step(shape, run, micro, True, None)
        # at a limit the cache is released, or the step runs out of memory
        limited = [replay_step(shape, run, micro, True, int(unlimited.peak_reserved * share)) for share in (0.97, 0.5)]
        replays[way] = [unlimited, *limited]
    assert replays["compiled"] == replays["reference"]
    assert [list(r.at_peak) for r in replays["compiled"]] == [list(r.at_peak) for r in replays["reference"]]
    assert replays["reference"][2].out_of_memory


def test_the_replay_make_install_compiles_is_the_one_a_step_runs(monkeypatch):
    """`make install` compiles the replay ahead (compiled.compile_ahead), as it byte-compiles the
    Python: for the arrays a step's replay passes, so that a plan after it compiles nothing."""
    from sft_play import config as config_module
    from sft_play.planner import Target, model_shape, resolve_for
    from sft_play.planner.simulate import compiled, step
    from sft_play.planner.simulate.predict import replay_step
    from tests.conftest import FIXTURES

    if not compiled.compile_ahead():
        pytest.skip("numba is not installed: replays run through the reference")
    signatures = list(compiled._kernel().signatures)
    config = config_module.load(None, [f"model.name_or_path={FIXTURES / 'model_configs' / 'tiny-qwen3-next'}",
                                       "finetune.method=lora", "data.max_seq_length=512"], check_paths=False)
    shape = model_shape(config)
    monkeypatch.setattr(step, "COMPILED_FROM", 0)
    run = resolve_for(config, Target(1, 80 * 1024**3, "1 x GPU"), None, shape)
    assert run.on_cuda  # (a GPU's step replays compiled; host memory does not)
    replay_step(shape, run, 1, True, None)
    assert len(signatures) == 1 and compiled._kernel().signatures == signatures


def test_host_memory_counts_the_bytes_asked_and_its_peak_by_category():
    """A CPU step's tensors (bench/cpu_ground_truth.py checks it against PyTorch's own count): the
    sizes the CUDA allocator would round or keep whole are counted as they are."""
    cuda, host = CachingAllocator(), HostMemory()
    for memory in (cuda, host):
        memory.malloc("labels", 510, "inputs")  # two rows of 255 positions
        memory.malloc("tile", 15 * MIB + 256 * 1024, "logits_loss")  # leaves an unsplit remainder of 768 KiB
        memory.free("tile")
        memory.malloc("state", 4, "optimizer_states")
    assert cuda.peak_allocated == 512 + 16 * MIB
    assert host.peak_allocated == host.peak_reserved == 510 + 15 * MIB + 256 * 1024
    assert host.at_peak_allocated == host.at_peak == {"inputs": 510, "logits_loss": 15 * MIB + 256 * 1024}
    assert host.allocated == 514 and host.releases == 0
    limited = HostMemory(capacity=1000)
    limited.malloc("a", 600)
    with pytest.raises(OutOfMemory):
        limited.malloc("b", 600)


def test_the_compiled_replay_numbers_handles_as_sorting_them_would():
    """Each distinct handle one number, the same handle the same number: read off the step's
    layout (a layer's events, the replay's own tensors from 1 << 62), or sorted where the layout
    is sparse or another."""
    import numpy as np

    from sft_play.planner.simulate import compiled

    rng = np.random.default_rng(0)
    laid_out = np.concatenate([(rng.integers(2, 40, 5000) << 24) + rng.integers(0, 300, 5000),
                               (1 << 62) + rng.integers(0, 800, 2000), rng.integers(0, 50, 100)])
    sparse = np.array([7, (1 << 40) + 3, 7, 5, (1 << 62) + 9, 5], np.int64)
    for handles in (rng.permutation(laid_out), sparse, np.array([(1 << 62) + 1, 1 << 62], np.int64)):
        numbered, count = compiled._numbered(handles)
        _, inverse = np.unique(handles, return_inverse=True)
        assert numbered.min() >= 0 and numbered.max() < count
        pairs = set(zip(numbered.tolist(), inverse.reshape(-1).tolist()))
        assert len(pairs) == len({n for n, _ in pairs}) == len({i for _, i in pairs})  # one to one
