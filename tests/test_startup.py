"""How a command starts: its libraries are imported with Python's garbage collector paused, and
what they made is frozen (sft_play.cli.importing); and how the scripts the tests run start: forked
from a process that has imported the libraries, as a fresh interpreter would run them (tests/zygote.py)."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys

import pytest

from sft_play import cli
from tests.conftest import _BASE_ENV, REPO, ZYGOTE_WANTED


def frozen(objects) -> list[bool]:
    """Whether each object is in the permanent generation (``gc.freeze``): the collector's three
    generations no longer hold it. Asked of the objects themselves, since the freeze count also
    falls whenever a frozen object dies, which the process's other threads may do at any moment."""
    collectable = {id(tracked) for tracked in gc.get_objects()}
    return [id(obj) not in collectable for obj in objects]


def test_imports_are_made_without_collections_and_frozen_after(monkeypatch):
    monkeypatch.setattr(cli, "FREEZE_IMPORTS", True)  # as in a command (conftest turns it off in the suite)
    collections = []

    def count(phase, info):
        collections.append(info["generation"]) if phase == "start" else None

    gc.callbacks.append(count)
    try:
        with cli.importing():
            assert not gc.isenabled()
            made = [[index] for index in range(50_000)]  # ~70 young collections' worth, were it collecting
            with cli.importing():  # nested: the outermost freezes
                pass
            assert not any(frozen(made)) and not gc.isenabled()
        assert collections == []
        assert gc.isenabled() and all(frozen(made))
    finally:
        gc.callbacks.remove(count)


def test_where_the_collector_was_off_it_stays_off_and_nothing_is_frozen(monkeypatch):
    monkeypatch.setattr(cli, "FREEZE_IMPORTS", True)  # were it to freeze, it would here
    gc.disable()
    try:
        with cli.importing():
            made = [[index] for index in range(1_000)]
        assert not gc.isenabled() and made and not any(frozen(made))
    finally:
        gc.enable()


def test_a_command_imports_torch_frozen_and_collects_after():
    # cli.run imports torch (quiet_libraries) before the command's main
    probe = ("import gc\nfrom sft_play import cli\n"
             "def main():\n    print(gc.isenabled(), gc.get_freeze_count())\n"
             "cli.run(main)\n")
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    enabled, frozen = result.stdout.split()
    assert enabled == "True" and int(frozen) > 100_000, result.stdout



# --- the scripts the tests start (tests/zygote.py) -------------------------------------------

PROBE = """import json, os, sys, threading, time
import torch
late = threading.Thread(target=lambda: (time.sleep(0.5), print("thread done", flush=True)))  # waited for at exit
late.start()
print(json.dumps({"name": __name__, "argv": sys.argv[1:], "cwd": os.getcwd(), "path0": sys.path[0], "pid": os.getpid(),
                  "threads": torch.get_num_threads(), "marker": os.environ.get("ACCELERATE_MIXED_PRECISION"),
                  "stdin": sys.stdin.read()}))
print("to stderr", file=sys.stderr)
sys.exit(sys.argv[1] if sys.argv[1] != "0" else 0)
"""


needs_zygote = pytest.mark.skipif(not ZYGOTE_WANTED, reason="scripts start fresh here (SFT_PLAY_TESTS_FRESH=1, or not Linux)")


@needs_zygote
def test_a_script_forked_by_the_zygote_runs_as_a_fresh_interpreter_would(tmp_path):
    from tests.conftest import _zygote, run_scripts_together, start_script

    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    zygote = _zygote()
    assert zygote is not None, "the test zygote did not start"
    # (from the environment every test starts with: an earlier test of this worker may have left a variable
    # a library sets on import, with which a script starts fresh: the test after this one)
    env = {**_BASE_ENV, "ACCELERATE_MIXED_PRECISION": "bf16", "OMP_NUM_THREADS": "1"}
    with open(tmp_path / "out", "w+") as out, open(tmp_path / "err", "w+") as err:
        forked = start_script([sys.executable, str(script), "0", "two"], env, out, err)
        assert not isinstance(forked, subprocess.Popen)  # served by the zygote
        assert forked.wait(timeout=120) == 0
        said = json.loads(out.read().splitlines()[0])
    fresh = subprocess.run([sys.executable, str(script), "0", "two"], cwd=REPO, env=env, capture_output=True, text=True,
                           stdin=subprocess.DEVNULL, timeout=120)
    expected = json.loads(fresh.stdout.splitlines()[0])
    assert said["pid"] == forked.pid and said["pid"] != expected["pid"]
    del said["pid"], expected["pid"]
    assert said == expected == {"name": "__main__", "argv": ["0", "two"], "cwd": str(REPO), "path0": str(tmp_path),
                                "threads": 1, "marker": "bf16", "stdin": ""}
    assert (tmp_path / "out").read_text().splitlines()[1:] == fresh.stdout.splitlines()[1:] == ["thread done"]
    assert (tmp_path / "err").read_text() == fresh.stderr == "to stderr\n"
    # exit statuses: a number, a message (status 1), a signal
    message, = run_scripts_together((str(script), "stopped here"))
    assert message.returncode == 1 and message.stderr.endswith("to stderr\nstopped here\n")
    with open(tmp_path / "out2", "w") as out, open(tmp_path / "err2", "w") as err:
        killed = start_script([sys.executable, str(script), "3"], env, out, err)
        killed.kill()
        assert killed.wait(timeout=60) in (-signal.SIGKILL, 3)


@needs_zygote
def test_an_environment_the_libraries_read_on_import_gets_a_fresh_interpreter(tmp_path):
    from tests.conftest import _zygote, start_script

    assert _zygote() is not None
    with open(tmp_path / "out", "w+") as out, open(tmp_path / "err", "w+") as err:
        started = start_script([sys.executable, "-c", "pass"], {**os.environ, "HF_HUB_OFFLINE": "0"}, out, err)
        assert isinstance(started, subprocess.Popen)
        assert started.wait(timeout=60) == 0


RANK_PROBE = """import json, os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: (print("stopping"), sys.exit(75)))
print(json.dumps({"pid": os.getpid(), "argv": sys.argv[1:], "torch": "torch" in sys.modules}))  # not flushed: python -u
if sys.argv[1] == "die":
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(120)
"""


@needs_zygote
def test_a_launchers_rank_is_forked_and_its_stand_in_passes_signals_and_endings_through(tmp_path):
    """A rank a launcher starts (``python -u script`` with LOCAL_RANK set) is forked from the zygote
    by tests/shim/sitecustomize.py; the process the launcher sees stands in for it."""
    import psutil

    from tests.conftest import _zygote, with_forks

    assert _zygote() is not None
    script = tmp_path / "rank.py"
    script.write_text(RANK_PROBE)

    def started(argument: str, **env: str) -> tuple[subprocess.Popen, dict]:
        process = subprocess.Popen([sys.executable, "-u", str(script), argument], stdout=subprocess.PIPE, text=True,
                                   env={**_BASE_ENV, "LOCAL_RANK": "0", "RANK": "0", **env})
        return process, json.loads(process.stdout.readline())

    stood_in, said = started("stop")
    assert said["pid"] != stood_in.pid and said["argv"] == ["stop"] and said["torch"]  # forked, imported
    assert [p.pid for p in with_forks([psutil.Process(stood_in.pid)])] == [stood_in.pid, said["pid"]]
    stood_in.send_signal(signal.SIGTERM)  # passed on: the rank's handler stops it, its status is the stand-in's
    assert stood_in.wait(timeout=60) == 75 and stood_in.stdout.read() == "stopping\n"
    died, _ = started("die")
    assert died.wait(timeout=60) == -signal.SIGKILL  # the rank's death by a signal is the stand-in's
    killed, said = started("killed")
    rank = psutil.Process(said["pid"])
    killed.kill()  # the stand-in killed: so is its rank
    killed.wait(timeout=60)
    _, alive = psutil.wait_procs([rank], timeout=30)
    assert not alive
    fresh, said = started("fresh", HF_HUB_OFFLINE="0")  # an environment the imports read: a fresh interpreter
    assert said["pid"] == fresh.pid and not said["torch"]
    fresh.kill()
    fresh.wait(timeout=60)
