"""What ``$SFT_PLAY_CACHE`` holds, and cleaning it (``make clean-cache``).

Every entry is something a run can make again: preprocessed data (``data/``, one folder per
data, tokenizer, template, length and seed), its statistics (``data_stats/``), weights
initialised from a bare ``config.json`` (``init_weights/``, 2-4 bytes per parameter: the big
ones), what the planner learned from a model's code (``planner/``) and the lease's model
configs (``lease_configs/``). Nothing here is a result: deleting an entry costs its
preparation again, nothing else. An entry's last use is its modification time, refreshed when
a run reads it (:func:`used`); cleaning removes entries not used for a number of days, never
one whose data a process is preparing (its lock is held), and the staging folders of writes
that died half-way once they are a day old (or at once where their name says they belong to a
process of this host that is gone; never one of a process still running).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from sft_play.paths import cache_dir

# The kinds of entry, by folder, as the cleaning report names them
KINDS = {
    "data": "preprocessed data",
    "data_stats": "data statistics",
    "init_weights": "initialised weights",
    "planner": "planner traces and counts",
    "lease_configs": "GPU lease model configs",
}
DAY_S = 24 * 3600
STALE_STAGING_S = DAY_S  # a half-written entry this old belongs to no live process


@dataclass(frozen=True)
class Entry:
    kind: str  # a folder of KINDS
    path: Path
    bytes: int
    last_used: float  # seconds since the epoch
    staging: bool = False  # a write that never finished (".<key>-..." beside the entries)


def owner_tag() -> str:
    """``<host>-<pid>``: what a staging or scratch folder's name carries of the process writing it."""
    return f"{socket.gethostname()}-{os.getpid()}"


def owner_gone(name: str) -> bool | None:
    """Whether the process a staging or scratch folder named `name` belongs to (:func:`owner_tag`)
    has ended: True or False for a process of this host, None where the name says no process of
    this host (another node's on a shared cache, or a name without one)."""
    match = re.match(rf"^\.(?:work-)?(?:[0-9a-f]{{20}}-)?{re.escape(socket.gethostname())}-(\d+)-", name)
    if match is None:
        return None
    try:
        os.kill(int(match.group(1)), 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's process: running
        return False
    return False


def used(path: str | Path) -> None:
    """Mark the cache entry at `path` as used now (its last use, for cleaning); quietly nothing
    where the cache is read-only."""
    try:
        os.utime(path)
    except OSError:
        pass


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += (Path(root) / name).stat().st_size
            except OSError:  # removed meanwhile
                pass
    return total


def entries(root: Path | None = None) -> list[Entry]:
    """Every entry of the cache at `root` (default :func:`sft_play.paths.cache_dir`)."""
    root = root or cache_dir()
    found = []
    for kind in KINDS:
        folder = root / kind
        if not folder.is_dir():
            continue
        for path in sorted(folder.iterdir()):
            try:
                last_used = path.stat().st_mtime
            except OSError:
                continue
            found.append(Entry(kind, path, _size(path), last_used, staging=path.name.startswith(".")))
    return found


def _being_prepared(entry: Entry, root: Path) -> bool:
    """Whether a process holds the lock of the data `entry` is (it is reading or writing it now)."""
    if entry.kind != "data":
        return False
    from filelock import FileLock, Timeout

    key = entry.path.name.lstrip(".").split("-", 1)[0]
    lock_file = root / "locks" / f"data-{key}.lock"
    if not lock_file.exists():
        return False
    lock = FileLock(str(lock_file))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        return True
    except OSError:
        return False
    lock.release()
    return False


def to_clean(unused_days: float | None, root: Path | None = None, now: float | None = None) -> list[Entry]:
    """The entries cleaning removes: those not used for `unused_days` (None: every entry), and
    staging folders a day old; never one whose data a process is preparing."""
    root = root or cache_dir()
    now = time.time() if now is None else now
    chosen = []
    for entry in entries(root):
        age = now - entry.last_used
        if entry.staging:
            gone = owner_gone(entry.path.name)
            old = gone or (gone is None and age > STALE_STAGING_S)
        else:
            old = unused_days is None or age > unused_days * DAY_S
        if old and not _being_prepared(entry, root):
            chosen.append(entry)
    return chosen


def remove(chosen: list[Entry]) -> int:
    """Delete `chosen`; the bytes freed."""
    freed = 0
    for entry in chosen:
        if entry.path.is_dir():
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            entry.path.unlink(missing_ok=True)
        if not entry.path.exists():
            freed += entry.bytes
    return freed
