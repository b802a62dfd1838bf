"""Caching preprocessed data: the tokenised (and packed) datasets and their statistics, keyed
by the data itself (local files by path, size and modification time; hub datasets by name and
split), the tokenizer (its vocabulary, merges and chat template) and every ``data`` setting.

Kept under ``$SFT_PLAY_CACHE/data/<key>/`` (default ``~/.cache/sft_play``), written atomically,
and read memory-mapped, so that the second run of a config, and every rank but the first of a
distributed run, skip tokenisation. Processes that start together with the same data (a sweep,
runs launched side by side) prepare it once: the first holds a lock on the key while it
tokenises, the others wait for it and read what it saved (:func:`preparing`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from sft_play.config import DataConfig
from sft_play.data.sources import expand, is_local
from sft_play.paths import cache_dir

logger = logging.getLogger(__name__)

CACHE_VERSION = 1  # bump when tokenisation or packing change what they produce


def cache_root() -> Path:
    return cache_dir() / "data"


def _sources(paths: str | list[str] | None, split: str) -> list[Any]:
    described: list[Any] = []
    for entry in [paths] if isinstance(paths, str) else (paths or []):
        if is_local(entry):
            for file in expand(entry):
                stat = file.stat()
                described.append([str(file.resolve()), stat.st_size, stat.st_mtime_ns])
        else:
            described.append([entry, split])
    return described


def _tokenizer_fingerprint(tokenizer: Any, template: str) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    special = [tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id]
    return hashlib.sha256((body + template + json.dumps(special)).encode()).hexdigest()


def cache_key(cfg: DataConfig, tokenizer: Any, template: str, seed: int) -> str:
    """The key of one preprocessing: data, tokenizer, settings and our code's version."""
    settings = cfg.model_dump(mode="json")
    settings.pop("num_proc", None)  # how many processes tokenise does not change the result
    payload = {
        "version": CACHE_VERSION,
        "settings": settings,
        "seed": seed,
        "train": _sources(cfg.path, cfg.split),
        "validation": _sources(cfg.validation_path, cfg.split),
        "tokenizer": _tokenizer_fingerprint(tokenizer, template),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:20]


@contextlib.contextmanager
def preparing(key: str):
    """Held while this process looks for `key` and, not finding it, prepares and saves it: a process
    that asks for the same key meanwhile waits, then finds it saved. Where no lock file can be
    made (a read-only cache folder), each process goes on alone, as without the lock."""
    from filelock import FileLock, Timeout

    locks = cache_dir() / "locks"
    lock = FileLock(str(locks / f"data-{key}.lock"))
    try:
        locks.mkdir(parents=True, exist_ok=True)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            logger.info("data: another process is preparing the same data; waiting to read it from the cache")
            lock.acquire()
    except OSError:
        yield
        return
    try:
        yield
    finally:
        lock.release()


def load(key: str) -> dict[str, Any] | None:
    """{"train", "validation", "stats", "validation_stats"} as saved, or None when not cached."""
    import datasets

    folder = cache_root() / key
    meta = folder / "meta.json"
    if not meta.is_file():
        return None
    saved = json.loads(meta.read_text())
    return {
        "train": datasets.load_from_disk(str(folder / "train")),
        "validation": datasets.load_from_disk(str(folder / "validation")) if saved["has_validation"] else None,
        "stats": saved["stats"],
        "validation_stats": saved["validation_stats"],
    }


def save(key: str, train: Any, validation: Any | None, stats: dict, validation_stats: dict | None) -> None:
    """Store one preprocessing under `key` (atomically: a reader sees all of it or none)."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root, prefix=f".{key}-"))
    try:
        train.save_to_disk(str(staging / "train"))
        if validation is not None:
            validation.save_to_disk(str(staging / "validation"))
        (staging / "meta.json").write_text(json.dumps({
            "has_validation": validation is not None, "stats": stats, "validation_stats": validation_stats,
        }))
        os.rename(staging, root / key)
    except OSError:  # another process stored it first, or the disk is full: the run goes on uncached
        shutil.rmtree(staging, ignore_errors=True)
