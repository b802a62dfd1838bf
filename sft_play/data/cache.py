"""Caching preprocessed data: the tokenised (and packed) datasets and their statistics, keyed
by the data itself (local files by path, size and modification time; hub datasets by name and
split), the tokenizer (its vocabulary, merges and chat template) and every ``data`` setting.

Kept under ``$SFT_PLAY_CACHE/data/<key>/`` (default ``~/.cache/sft_play``), written atomically,
and read memory-mapped, each file checked first against the size and digest recorded when it was
saved (a damaged entry is prepared again, with one warning), so that the second run of a config, and every rank but the first of a
distributed run, skip tokenisation. A preparation's own Arrow files (records, tokens, packed rows)
are written in a folder of its process (:func:`scratch`), removed when it ends; one a killed process
left is removed by the next preparation on the same host. Processes that start together with the same data (a sweep,
runs launched side by side) prepare it once: the first holds a lock on the key while it
tokenises, the others wait for it and read what it saved (:func:`preparing`).

Beside each preprocessing, its statistics alone are kept (``data_stats/``) under a second key that needs no
tokenizer loaded: a local tokenizer folder's files by name, size and modification time in place
of the vocabulary (:func:`stats_key`). Planning reads them there (:func:`remembered_stats`), so
that ``make plan`` after ``make train``, or a second ``make plan``, imports neither transformers'
tokenizers nor datasets (about 4 s of the 5 s it took on 2 cores).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from sft_play import cache_usage
from sft_play.config import DataConfig
from sft_play.data.sources import HELD_OUT, expand, is_local
from sft_play.paths import cache_dir

logger = logging.getLogger(__name__)

# Bump when reading, splitting, tokenisation or packing change what they produce, or the
# statistics they keep: 2 holds out each weighted source's share before mixing, refuses empty
# answers, and names the examples tokenising leaves out; 3 reads Alpaca's history, tool calls and
# ShareGPT's function_call (rows skip used to drop), and folders by split; 4 keeps the sum of the examples'
# squared lengths (attention's FLOPs); 5 reads content given as parts and images (rows skip used to drop); 6
# counts the examples that show images; 7 keeps the vision encoder's inputs for the heaviest example; 8 records
# each saved file's size and digest, and counts the special tokens examples write in their text
CACHE_VERSION = 8


def cache_root() -> Path:
    return cache_dir() / "data"


def _sources(paths: str | list[str] | None, split: str) -> list[Any]:
    described: list[Any] = []
    for entry in [paths] if isinstance(paths, str) else (paths or []):
        if is_local(entry):
            for found in expand(entry, split):  # a file, or a save_to_disk folder: each file in it
                for file in sorted(found.rglob("*")) if found.is_dir() else [found]:
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


def cache_key(cfg: DataConfig, tokenizer: Any, template: str, seed: int, images: str | None = None,
              preference: str | None = None) -> str:
    """The key of one preprocessing: data, tokenizer, settings, our code's version, for a
    vision-language model how its processor turns `images` into tokens, and for preference pairs
    the `preference` settings that decide them (:func:`sft_play.data.preference.identity`)."""
    identity = {"tokenizer": _tokenizer_fingerprint(tokenizer, template)}
    if images is not None:
        identity["images"] = hashlib.sha256(images.encode()).hexdigest()
    if preference is not None:
        identity["preference"] = preference
    return _key(cfg, seed, identity)


def _key(cfg: DataConfig, seed: int, tokenizer: dict[str, Any]) -> str:
    """A key of the data, the settings, the seed, our code's version and `tokenizer` (what
    identifies the tokenizer)."""
    settings = cfg.model_dump(mode="json")
    settings.pop("num_proc", None)  # how many processes tokenise does not change the result
    payload = {
        "version": CACHE_VERSION,
        "settings": settings,
        "seed": seed,
        "train": _sources(cfg.path, cfg.split),
        "validation": _sources(cfg.validation_path, HELD_OUT),
        **tokenizer,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:20]


def stats_key(cfg: DataConfig, tokenizer_source: str | None, seed: int, preference: str | None = None) -> str | None:
    """The key of one preprocessing's statistics, from the data, the settings and the files of a
    local tokenizer folder (names, sizes, modification times); None for a hub tokenizer, whose
    files only loading it would find."""
    folder = Path(tokenizer_source) if tokenizer_source else None
    if folder is None or not folder.is_dir():
        return None
    try:
        files = sorted([entry.name, entry.stat().st_size, entry.stat().st_mtime_ns]
                       for entry in folder.iterdir() if entry.is_file())
    except OSError:  # a folder that cannot be listed: no statistics kept, nothing else changes
        return None
    return _key(cfg, seed, {"tokenizer_files": [str(folder.resolve()), files],
                            **({"preference": preference} if preference is not None else {})})


def remember_stats(key: str | None, stats: dict, validation_stats: dict | None) -> None:
    """Keep a preprocessing's statistics under :func:`stats_key` (atomically; skipped where the
    cache cannot be written)."""
    if key is None:
        return
    root = cache_dir() / "data_stats"
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=root, prefix=f".{key}-", suffix=".json", delete=False) as f:
            json.dump({"stats": stats, "validation_stats": validation_stats}, f)
        os.replace(f.name, root / f"{key}.json")
    except OSError:
        logger.debug("data: statistics not kept under %s", key)


def remembered_stats(key: str | None) -> dict[str, Any] | None:
    """{"stats", "validation_stats"} kept under `key`, or None."""
    if key is None:
        return None
    try:
        path = cache_dir() / "data_stats" / f"{key}.json"
        remembered = json.loads(path.read_text())
        cache_usage.used(path)
        return remembered
    except (OSError, ValueError):
        return None


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


_SCRATCH: list[Path] = []  # this process's scratch folder, once made


def scratch() -> Path:
    """A new, empty folder for one preparation's Arrow files, inside a folder of this process that
    is removed when it exits (under the cache root, else the system's temporary folder where the
    cache cannot be written). Arrow files in memory would hold all of the data in RAM; on disk
    they are read memory-mapped, batch by batch."""
    _sweep_abandoned()
    if _SCRATCH and not _SCRATCH[-1].is_dir():  # removed under us (its cache folder deleted): another
        _SCRATCH.clear()
    if not _SCRATCH:
        try:
            cache_root().mkdir(parents=True, exist_ok=True)
            folder = Path(tempfile.mkdtemp(dir=cache_root(), prefix=f".work-{cache_usage.owner_tag()}-"))
        except OSError:
            folder = Path(tempfile.mkdtemp(prefix=f"sft-play-work-{cache_usage.owner_tag()}-"))
        _SCRATCH.append(folder)
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return Path(tempfile.mkdtemp(dir=_SCRATCH[-1]))


def forget(key: str) -> None:
    """Remove the preprocessing stored under `key` (stale: what it was made from changed in a way
    its key cannot see): renamed aside first, so that a reader sees all of it or none."""
    folder = cache_root() / key
    aside = cache_root() / f".{key}-{cache_usage.owner_tag()}-forgotten"
    try:
        os.rename(folder, aside)
    except OSError:
        return
    shutil.rmtree(aside, ignore_errors=True)


def discard(folder: Path) -> None:
    """Remove a :func:`scratch` folder whose datasets are no longer used (their files may still be
    mapped: Linux frees them when unmapped)."""
    shutil.rmtree(folder, ignore_errors=True)


def _sweep_abandoned() -> None:
    """Remove the scratch and staging folders that processes of this host left when killed."""
    try:
        entries = list(cache_root().iterdir())
    except OSError:
        return
    for entry in entries:
        if entry.is_dir() and cache_usage.owner_gone(entry.name):
            shutil.rmtree(entry, ignore_errors=True)


def out_of_space(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno == errno.ENOSPC


def load(key: str, verify: bool = True) -> dict[str, Any] | None:
    """{"train", "validation", "stats", "validation_stats"} as saved, or None when not cached. With
    `verify`, every file is first checked against the size and digest recorded when it was saved:
    a damaged entry (a file cut short, bytes flipped, a file gone) is removed, said once, and
    counts as not cached."""
    import datasets

    folder = cache_root() / key
    meta = folder / "meta.json"
    if not meta.is_file():
        return None
    try:
        saved = json.loads(meta.read_text())
        damage = _damage(folder, saved["files"]) if verify else None
    except OSError as exc:  # not ours to read (a shared cache): prepared here, the entry left as it is
        logger.info("data: the cached preprocessing %s cannot be read here (%s): preparing the data", key, exc)
        return None
    except (ValueError, KeyError, TypeError) as exc:
        damage = f"meta.json unreadable ({exc})"
    if damage:
        logger.warning("data: the cached preprocessing %s is damaged (%s): preparing the data again", key, damage)
        forget(key)
        return None
    cache_usage.used(folder)
    return {
        "train": datasets.load_from_disk(str(folder / "train")),
        "validation": datasets.load_from_disk(str(folder / "validation")) if saved["has_validation"] else None,
        "stats": saved["stats"],
        "validation_stats": saved["validation_stats"],
    }


def _file_digest(path: Path) -> str:
    # xxHash (a dependency of datasets): damage, not tampering, is what it detects, at several GB/s,
    # so that a million rows cost a second or so to check on every start
    import xxhash

    digest = xxhash.xxh3_128()
    with open(path, "rb") as handle:
        while chunk := handle.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _files(folder: Path) -> dict[str, dict[str, Any]]:
    """Every file under `folder` (but meta.json): its size and digest, by path relative to it."""
    return {path.relative_to(folder).as_posix(): {"size": path.stat().st_size, "xxh3_128": _file_digest(path)}
            for path in sorted(folder.rglob("*")) if path.is_file() and path.name != "meta.json"}


def _damage(folder: Path, recorded: dict[str, dict[str, Any]]) -> str | None:
    """What differs between `folder`'s files and `recorded` (:func:`_files`), or None."""
    for name, entry in recorded.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != entry["size"]:
            return f"{name} is {path.stat().st_size:,} bytes, saved as {entry['size']:,}"
        if _file_digest(path) != entry["xxh3_128"]:
            return f"{name} does not match the digest saved with it"
    return None


def save(key: str, train: Any, validation: Any | None, stats: dict, validation_stats: dict | None) -> bool:
    """Store one preprocessing under `key` (atomically: a reader sees all of it or none; a process
    killed on the way leaves a staging folder no reader opens, which :func:`scratch` removes).
    False where it could not be stored."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=root, prefix=f".{key}-{cache_usage.owner_tag()}-"))
    try:
        train.save_to_disk(str(staging / "train"))
        if validation is not None:
            validation.save_to_disk(str(staging / "validation"))
        (staging / "meta.json").write_text(json.dumps({
            "has_validation": validation is not None, "stats": stats, "validation_stats": validation_stats,
            "files": _files(staging),
        }))
        os.rename(staging, root / key)
        return True
    except OSError:  # another process stored it first, or the disk is full: the run goes on uncached
        shutil.rmtree(staging, ignore_errors=True)
        return (root / key / "meta.json").is_file()
