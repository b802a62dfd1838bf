"""What planning learns from a model's code, and what it predicts, is kept on disk
(sft_play.planner.simulate.cache): a second plan of the same model, in a new process, imports no
modeling code, replays nothing and says the same; a broken or unwritable cache never stops a
plan. Replays run side by side (predict.predict_many) with the same results as one after
another, in workers that end with their parent and on SIGTERM."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from sft_play.architecture import config_identity
from sft_play.planner.simulate import cache
from tests.conftest import FIXTURES, REPO, start_script

PLAN = """
import json, sys
from sft_play import config as config_module
from sft_play.planner import WITHOUT_REMEDIES, Target, make_plan
config = config_module.load(None, [f"model.name_or_path={sys.argv[1]}", "finetune.method=lora",
                                   "data.max_seq_length=512", "train.global_batch_size=4"], check_paths=False)
plan = make_plan(config, Target(1, 80 * 1024**3, "1 x GPU"), options=WITHOUT_REMEDIES)
print(json.dumps({"modeling_imported": "transformers.modeling_utils" in sys.modules,
                  "config_imported": any(m.startswith("transformers.models.") for m in sys.modules),
                  "peak": plan.peak_bytes_per_gpu, "micro": plan.micro_batch_size, "breakdown": plan.breakdown,
                  "trainable": plan.trainable_params, "replays": plan.replays}))
"""


def _plan_in_new_process(cache_dir) -> dict:
    env = {**os.environ, "SFT_PLAY_CACHE": str(cache_dir), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", PLAN, str(FIXTURES / "model_configs" / "tiny-llama-256")],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_second_plan_of_a_model_needs_no_modeling_code_and_says_the_same(tmp_path):
    first = _plan_in_new_process(tmp_path)
    assert first["modeling_imported"]
    kept = sorted(p.name.split("-")[0] for p in (tmp_path / "planner").iterdir())
    assert "shape" in kept and "lora" in kept and "trace" in kept and "prediction" in kept
    second = _plan_in_new_process(tmp_path)
    assert not second["modeling_imported"] and not second["config_imported"]  # a local model: its config.json is read as text
    same = ("peak", "micro", "breakdown", "trainable")
    assert {k: second[k] for k in same} == {k: first[k] for k in same}
    assert first["replays"] > 0 and second["replays"] == 0  # every prediction kept: nothing replayed again


def test_what_is_kept_follows_its_key_and_a_cache_that_cannot_be_written_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setenv("SFT_PLAY_CACHE", str(tmp_path))
    calls = []

    def compute(value):
        calls.append(value)
        return {"value": value}

    assert cache.remembered("shape", ("a",), lambda: compute(1)) == {"value": 1}
    assert cache.remembered("shape", ("a",), lambda: compute(2)) == {"value": 1}  # kept
    assert cache.remembered("shape", ("b",), lambda: compute(3)) == {"value": 3}  # another model config
    assert cache.remembered("trace", ("a",), lambda: compute(4)) == {"value": 4}  # another kind
    assert cache.remembered("shape", ("a",), lambda: compute(5), keep=False) == {"value": 5}  # remote code
    assert calls == [1, 3, 4, 5]
    for path in (tmp_path / "planner").iterdir():  # broken files count as none, and are rewritten
        path.write_bytes(b"not a pickle")
    assert cache.remembered("shape", ("a",), lambda: compute(6)) == {"value": 6}
    assert cache.remembered("shape", ("a",), lambda: compute(7)) == {"value": 6}
    assert not list((tmp_path / "planner").glob("*.tmp"))
    (tmp_path / "planner").chmod(0o500)  # read-only: computed every time, never an error
    try:
        if not os.access(tmp_path / "planner", os.W_OK):  # (root writes anyway)
            assert cache.remembered("shape", ("c",), lambda: compute(8)) == {"value": 8}
            assert cache.remembered("shape", ("c",), lambda: compute(9)) == {"value": 9}
    finally:
        (tmp_path / "planner").chmod(0o700)


def test_a_planted_cache_file_runs_no_code_and_counts_as_none(tmp_path, monkeypatch):
    """The cache was pickle.loads of whatever lay in $SFT_PLAY_CACHE/planner: a planted file ran
    `touch` on make plan. Only the planner's own dataclasses and plain containers load."""
    import pickle

    from sft_play.planner.simulate.trace import ModuleEvents

    monkeypatch.setenv("SFT_PLAY_CACHE", str(tmp_path))
    assert cache.remembered("shape", ("a",), lambda: {"value": 1}) == {"value": 1}
    [path] = (tmp_path / "planner").iterdir()
    marker = tmp_path / "pwned"

    class Planted:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    path.write_bytes(pickle.dumps(Planted()))
    assert cache.remembered("shape", ("a",), lambda: {"value": 2}) == {"value": 2}  # recomputed
    assert not marker.exists()
    path.write_bytes(pickle.dumps({"value": 3}))
    assert cache.remembered("shape", ("a",), lambda: {"value": 4}) == {"value": 3}  # plain data loads
    events = ModuleEvents(**{field.name: () for field in dataclasses.fields(ModuleEvents)})
    assert cache._loads(pickle.dumps([events, frozenset({1}), (2, 3.0)])) == [events, frozenset({1}), (2, 3.0)]


def test_the_key_is_the_model_config_as_written_and_the_code_that_reads_it(tmp_path):
    source = FIXTURES / "model_configs" / "tiny-llama-256"
    copy = tmp_path / "model"
    copy.mkdir()
    written = json.loads((source / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(written))
    before = config_identity(str(copy), None, False)
    assert before == config_identity(str(copy), None, False)
    (copy / "config.json").write_text(json.dumps({**written, "intermediate_size": written["intermediate_size"] + 64}))
    assert config_identity(str(copy), None, False) != before
    assert config_identity(str(source), None, False) != before  # another folder
    assert len(cache.fingerprint()) == 64


def test_what_a_process_computed_from_an_edited_config_is_not_kept(tmp_path):
    from sft_play.architecture import load_model_config

    copy = tmp_path / "edited"
    copy.mkdir()
    written = json.loads((FIXTURES / "model_configs" / "tiny-llama-256" / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(written))
    assert cache.keeps(str(copy), False)  # not read yet: whatever is computed reads it now
    load_model_config(str(copy))  # read (and kept in this process, by path)
    assert cache.keeps(str(copy), False)
    (copy / "config.json").write_text(json.dumps({**written, "num_hidden_layers": 3}))
    assert not cache.keeps(str(copy), False)  # this process's shapes would be of the old text
    assert not cache.keeps(str(FIXTURES / "model_configs" / "tiny-llama-256"), True)  # remote code never


def test_replays_side_by_side_say_the_same_as_one_after_another_and_fall_back_when_the_pool_fails(monkeypatch):
    from sft_play import config as config_module
    from sft_play.planner import Target, model_shape, resolve_for
    from sft_play.planner.simulate import predict as prediction

    config = config_module.load(None, [f"model.name_or_path={FIXTURES / 'model_configs' / 'tiny-llama-256'}",
                                       "finetune.method=lora", "data.max_seq_length=512"], check_paths=False)
    shape = model_shape(config)
    run = resolve_for(config, Target(1, 80 * 1024**3, "1 x GPU"), None, shape)
    requests = [(run, m, None, True) for m in range(1, 7)]
    monkeypatch.setattr(prediction, "_cores_per_process", lambda: 2)
    monkeypatch.setattr(prediction, "FORK_LAYER_REPLAYS", 1)  # a tiny model: fork even for this little
    pools = []
    real_pool = prediction.ProcessPoolExecutor

    def counted_pool(*args, **kwargs):
        pools.append(args)
        return real_pool(*args, **kwargs)

    monkeypatch.setattr(prediction, "ProcessPoolExecutor", counted_pool)
    monkeypatch.setattr(prediction, "_CACHE", {})
    before = prediction.REPLAYS[0]
    side_by_side = prediction.predict_many(shape, requests)
    assert len(pools) == 1 and prediction.REPLAYS[0] - before == len(requests)  # counted from the workers
    monkeypatch.setattr(prediction, "_CACHE", {})
    serial = [prediction.predict(shape, *request) for request in requests]
    assert side_by_side == serial
    monkeypatch.setattr(prediction, "FORK_LAYER_REPLAYS", 10**6)  # too little to fork for: one after another
    monkeypatch.setattr(prediction, "_CACHE", {})
    assert prediction.predict_many(shape, requests) == serial and len(pools) == 1

    def no_pool(*args, **kwargs):
        raise OSError("fork: resource temporarily unavailable")

    monkeypatch.setattr(prediction, "ProcessPoolExecutor", no_pool)
    monkeypatch.setattr(prediction, "_CACHE", {})
    assert prediction.predict_many(shape, requests) == serial


def test_the_ranks_of_a_node_share_its_cores_for_replays(monkeypatch):
    from sft_play.planner.simulate import predict as prediction

    monkeypatch.setattr(prediction.os, "sched_getaffinity", lambda _pid: set(range(16)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert prediction._cores_per_process() == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert prediction._cores_per_process() == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert prediction._cores_per_process() == 1  # replays one after another


def test_side_by_side_answers_in_order_from_forked_processes_or_here(monkeypatch):
    """The remedy search's plans and make plan LONGEST=1's targets: taken one at a time by this
    process and by processes forked beside it where a core is spare, here one after another where
    not, or where the pool cannot start; the answers the same, in order, the forked processes'
    replays counted here, and what a forked call raises raised here."""
    import time

    from sft_play.planner.simulate import predict as prediction

    def call(name: str):
        def planned():
            time.sleep(0.3)  # (long enough for a forked process to take its share)
            prediction.REPLAYS[0] += 5
            return name, os.getpid(), prediction._cores_per_process()
        return planned

    names = ["first", "second", "third", "fourth"]
    calls = [call(name) for name in names]
    monkeypatch.setattr(prediction.hardware, "usable_cores", lambda: 2)
    replays = prediction.REPLAYS[0]
    answers = prediction.side_by_side(calls)
    assert [a[0] for a in answers] == names
    assert os.getpid() in {a[1] for a in answers} and len({a[1] for a in answers}) == 2  # here and one beside
    assert {a[2] for a in answers} == {1}, "the two processes share the two cores out"
    assert prediction.REPLAYS[0] - replays == 20 and prediction._cores_per_process() == 2
    monkeypatch.setattr(prediction.hardware, "usable_cores", lambda: 1)
    assert prediction.side_by_side(calls) == [(name, os.getpid(), 1) for name in names]

    def failing():
        raise ValueError("a config the forked process refused")

    monkeypatch.setattr(prediction.hardware, "usable_cores", lambda: 2)
    with pytest.raises(ValueError, match="refused"):
        prediction.side_by_side([calls[0], failing, calls[1]])

    def no_pool(*args, **kwargs):
        raise OSError("fork: resource temporarily unavailable")

    monkeypatch.setattr(prediction, "ProcessPoolExecutor", no_pool)
    assert [a[:2] for a in prediction.side_by_side(calls)] == [(name, os.getpid()) for name in names]


def test_a_second_make_plan_imports_no_transformers_and_says_the_same(tmp_path):
    """What a plan needs from the model's code and from the tokenised data is kept: the second
    `make plan` of a config (or the one after `make train`) loads neither the modeling code nor the
    tokenizer nor the datasets library, which were most of its seconds."""
    env = {**os.environ, "SFT_PLAY_CACHE": str(tmp_path), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-X", "importtime", "scripts/plan.py", "--config", "configs/run_tiny.yaml",
               f"data.path={FIXTURES / 'data' / 'messages.jsonl'}", "data.validation_path=null", "--json"]
    runs = [subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=True)
            for _ in range(2)]
    imported = [{line.rsplit("|", 1)[1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")}
                for run in runs]
    assert {"transformers", "datasets"} <= imported[0]
    assert not {"transformers", "datasets"} & imported[1]
    same = ("total_params", "trainable_params", "micro_batch_size", "sequence_length", "sequence_length_source",
            "peak_bytes_per_gpu", "breakdown", "precision", "attention")  # (the host memory free moves between runs)
    plans = [{k: v for k, v in json.loads(run.stdout).items() if k in same} for run in runs]
    assert len(plans[0]) == len(same) and plans[1] == plans[0]



def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_replay_workers_end_with_their_parent_and_on_sigterm(tmp_path):
    """A replay worker outlived its planning process, killed by the kernel's OOM killer, for 46
    minutes, and ignored SIGTERM."""
    import signal
    import time

    import pytest

    if not sys.platform.startswith("linux"):
        pytest.skip("the parent's death is signalled by Linux's prctl")
    script = tmp_path / "parent.py"
    script.write_text(
        "import os, sys, time, signal, multiprocessing\n"
        "from concurrent.futures import ProcessPoolExecutor\n"
        "from sft_play.planner.simulate import predict\n"
        "signal.signal(signal.SIGTERM, lambda *_: None)\n"
        "def pid(_):\n    time.sleep(0.2)\n    return os.getpid()\n"
        "pool = ProcessPoolExecutor(2, mp_context=multiprocessing.get_context('fork'),\n"
        "                           initializer=predict._replay_worker_started, initargs=(os.getpid(),))\n"
        "print(' '.join(map(str, sorted(set(pool.map(pid, range(6)))))), flush=True)\n"
        "time.sleep(600)\n")
    def started() -> tuple:
        # (forked from the suite's zygote where it can be: conftest.start_script; its workers are its own children)
        out = tmp_path / f"out-{time.monotonic_ns()}"
        with open(out, "w") as stdout, open(os.devnull, "w") as stderr:
            parent = start_script([sys.executable, str(script)], {**os.environ, "OMP_NUM_THREADS": "1"}, stdout, stderr)
        deadline = time.monotonic() + 120
        while not out.read_text().endswith("\n"):
            assert parent.poll() is None and time.monotonic() < deadline, "the planning process said nothing"
            time.sleep(0.05)
        workers = [int(p) for p in out.read_text().split()]
        assert workers and all(_alive(p) for p in workers)
        return parent, workers

    def ended(pids: list[int]) -> bool:
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        return not any(_alive(p) for p in pids)

    parent, workers = started()
    try:
        os.kill(workers[0], signal.SIGTERM)  # honoured, though the parent's handler ignores it
        assert ended(workers[:1]) and parent.poll() is None
    finally:
        parent.kill()
        parent.wait(timeout=30)
    parent, workers = started()
    try:
        parent.send_signal(signal.SIGKILL)  # nobody tells the workers: the kernel does
        parent.wait(timeout=30)
        assert ended(workers)
    finally:
        parent.kill()


def test_a_long_plan_says_what_it_is_on_and_a_quick_one_says_nothing():
    import io

    from sft_play.planner import progress

    said = io.StringIO()
    with progress.reporting(said, quiet=0, every=0):
        with progress.doing("remedy 2 of 9: ZeRO-3"):
            progress.say("micro-batch 1, 2 at 4,096 tokens")
        progress.say("")
    lines = said.getvalue().splitlines()
    assert lines[0].startswith("planning (0 s): remedy 2 of 9: ZeRO-3")
    assert lines[1] == "planning (0 s): remedy 2 of 9: ZeRO-3, micro-batch 1, 2 at 4,096 tokens"
    quiet = io.StringIO()
    with progress.reporting(quiet):  # two seconds before the first word
        with progress.doing("remedy 1 of 9: gradient checkpointing"):
            progress.say("micro-batch 1 at 2,048 tokens")
    progress.say("outside: never written")
    assert quiet.getvalue() == ""
