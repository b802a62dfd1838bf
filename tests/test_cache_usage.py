"""make clean-cache: what the cache holds, and deleting what no run has used for a while (never
data a process is preparing); reading an entry marks it used."""

from __future__ import annotations

import os
import time

from tests.conftest import run_script

DAY = 24 * 3600


def _entry(path, size: int, age_days: float) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "blob").write_bytes(b"x" * size)
    stamp = time.time() - age_days * DAY
    os.utime(path, (stamp, stamp))


def test_clean_cache_deletes_what_was_not_used_and_keeps_what_is_being_prepared(tmp_path):
    from filelock import FileLock

    cache = tmp_path / "cache"
    _entry(cache / "data" / "oldkey", 1000, 20)
    _entry(cache / "data" / "newkey", 1000, 1)
    _entry(cache / "data" / "lockedkey", 1000, 30)  # a process is preparing it right now
    _entry(cache / "data" / ".deadkey-abc", 1000, 2)  # a write that died two days ago
    _entry(cache / "data" / ".livekey-abc", 1000, 0.01)  # a write under way
    # scratch folders of data preparations (named for their host and process): a killed one's goes
    # at once, a running one's stays however old (a run with data.cache off trains on its files)
    import socket
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()
    _entry(cache / "data" / f".work-{socket.gethostname()}-{dead.pid}-x1", 1000, 0.01)
    running = f".work-{socket.gethostname()}-{os.getpid()}-x2"
    _entry(cache / "data" / running, 1000, 3)
    _entry(cache / "init_weights" / "0123", 5000, 15)
    (cache / "planner").mkdir()
    trace = cache / "planner" / "trace-ab.pkl"
    trace.write_bytes(b"y" * 100)
    os.utime(trace, (time.time() - 40 * DAY,) * 2)
    (cache / "locks").mkdir()
    lock = FileLock(str(cache / "locks" / "data-lockedkey.lock"))
    env = {"SFT_PLAY_CACHE": str(cache)}
    with lock:
        dry = run_script("clean_cache.py", "--dry-run", env=env)
        assert dry.returncode == 0, dry.stderr
        assert "9 entries" in dry.stdout and "Dry run: would delete 5 (entries unused for more than 14 days)" in dry.stdout
        assert (cache / "data" / "oldkey").is_dir()  # nothing deleted

        cleaned = run_script("clean_cache.py", env=env)
        assert cleaned.returncode == 0, cleaned.stderr
        assert "Deleted 5 (entries unused for more than 14 days)" in cleaned.stdout
        left = {p.relative_to(cache).as_posix() for kind in ("data", "init_weights", "planner")
                for p in (cache / kind).iterdir()}
        assert left == {"data/newkey", "data/lockedkey", "data/.livekey-abc", f"data/{running}"}

        everything = run_script("clean_cache.py", "--all", env=env)
        assert "Deleted 1 (every entry not in use)" in everything.stdout  # not the data being prepared or written
        assert {p.name for p in (cache / "data").iterdir()} == {"lockedkey", ".livekey-abc", running}
    bad = run_script("clean_cache.py", "--days", "-1", env=env)
    assert bad.returncode == 2 and "error: --days must be 0 or more" in bad.stderr and "Traceback" not in bad.stderr


def test_reading_a_cache_entry_marks_it_used(tmp_path, monkeypatch):
    from sft_play.planner.simulate import cache

    monkeypatch.setenv("SFT_PLAY_CACHE", str(tmp_path))
    assert cache.remembered("test", ("a",), lambda: 42) == 42
    (kept,) = (tmp_path / "planner").iterdir()
    old = time.time() - 30 * DAY
    os.utime(kept, (old, old))
    assert cache.remembered("test", ("a",), lambda: 0) == 42  # read, not computed
    assert kept.stat().st_mtime > old + 29 * DAY
