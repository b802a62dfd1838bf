"""Checkpoints that can be trusted: a completeness marker written once a checkpoint is whole,
rotation that never leaves a run without one, and setting torn or corrupted ones aside (which
run and checkpoint to resume is the run folder's question: :mod:`sft_play.run_folder`).

A checkpoint folder (``<run>/checkpoints/checkpoint-N``) is complete when it holds
``sft_play_complete.json`` and every file that marker lists, at the size it lists; on resume
the files' SHA-256 digests are checked too. The marker is written after every rank has finished
saving, and only when the files of every rank are there (``rng_state_<rank>.pth``); older
checkpoints are deleted (``train.save_total_limit``) only after the new one is marked. A
process killed during a save, a disk that filled up, a node writing into a folder the others
cannot see, or a file damaged later leaves a checkpoint that fails these checks: on resume it
is moved to ``<run>/incomplete-checkpoints/`` with a warning, never loaded, and the previous
complete one is used.

Digests catch damage, not a swapped payload whose digests were rewritten with it. The states a
resume unpickles (optimizer, scheduler, random-number generators, DeepSpeed's partitions, which
DeepSpeed loads with ``weights_only=False``) are therefore read for what they would build before
anything loads them (:func:`code_it_would_run`): a file naming anything beyond tensors, plain data
and the few classes the libraries save there is refused, never loaded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

logger = logging.getLogger(__name__)

MARKER = "sft_play_complete.json"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
_CHUNK = 8 << 20


def file_digest(path: Path) -> str:
    """SHA-256 of a file's contents, read in 8 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def digests(checkpoint: Path, names: list[str], threads: int = 4) -> dict[str, str]:
    """SHA-256 of each of `names` inside `checkpoint` (hashlib releases the GIL: threads overlap)."""
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        return dict(zip(names, pool.map(lambda name: file_digest(checkpoint / name), names)))


def checkpoint_files(checkpoint: Path) -> list[str]:
    """The files of a checkpoint (relative names), without its marker."""
    return [str(p.relative_to(checkpoint)) for p in sorted(checkpoint.rglob("*"))
            if p.is_file() and p.name != MARKER and not p.name.startswith(f".{MARKER}")]


def missing_rank_files(checkpoint: Path, world_size: int) -> list[str]:
    """The per-rank files (``rng_state_<rank>.pth``, written by every rank) absent from
    `checkpoint`: a rank that did not finish saving, or a node writing into a folder the others
    cannot see."""
    if world_size <= 1:
        return []
    expected = [f"rng_state_{rank}.pth" for rank in range(world_size)]
    return [name for name in expected if not (checkpoint / name).is_file()]


def write_marker(checkpoint: Path, step: int, world_size: int = 1, strategy: str | None = None,
                 file_digests: dict[str, str] | None = None, elapsed: tuple[float, int] | None = None) -> None:
    """Record that `checkpoint` is complete: its files with their sizes and SHA-256 digests, the
    number of processes and the strategy that wrote it, and the training time that led to it.

    Args:
        file_digests: digests already computed (e.g. by several ranks); the rest are computed here.
        elapsed: (seconds of training, segments) up to this checkpoint, every resumed segment's
            included; :func:`time_before` reads it back.
    """
    names = checkpoint_files(checkpoint)
    known = dict(file_digests or {})
    known.update(digests(checkpoint, [n for n in names if n not in known]))
    files = {name: {"size": (checkpoint / name).stat().st_size, "sha256": known[name]} for name in names}
    staging = checkpoint / f".{MARKER}.tmp"
    runtime = {"train_runtime_s": round(elapsed[0], 3), "segments": elapsed[1]} if elapsed else {}
    staging.write_text(json.dumps({"step": step, "world_size": world_size, "strategy": strategy, **runtime,
                                   "files": files}, indent=1))
    staging.rename(checkpoint / MARKER)


def time_before(checkpoint: Path | str | None) -> tuple[float, int]:
    """(seconds of training, segments) that led to `checkpoint`, as its marker recorded them: what
    a run resumed from it adds to its own time. (0, 0) for a fresh start; a checkpoint without the
    record counts as one segment of unknown time."""
    if checkpoint is None:
        return 0.0, 0
    marker = read_marker(Path(checkpoint)) or {}
    runtime, segments = marker.get("train_runtime_s"), marker.get("segments")
    if isinstance(runtime, (int, float)) and isinstance(segments, int) and runtime >= 0 and segments >= 1:
        return float(runtime), segments
    return 0.0, 1


def read_marker(checkpoint: Path) -> dict | None:
    """The checkpoint's marker, or None where it is missing or not one this module wrote (an entry
    that is neither a size nor {size, sha256}: the checkpoint then counts as incomplete)."""
    try:
        marker = json.loads((checkpoint / MARKER).read_text())
        files = marker.get("files")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(files, dict) or not all(_well_formed(entry) for entry in files.values()):
        return None
    return marker


def _well_formed(entry: object) -> bool:
    if isinstance(entry, dict):
        entry, digest = entry.get("size"), entry.get("sha256")
        if digest is not None and not isinstance(digest, str):
            return False
    return isinstance(entry, int) and not isinstance(entry, bool)


def _entries(marker: dict) -> dict[str, tuple[int, str | None]]:
    """(size, digest) per file; markers written before digests list sizes only."""
    return {name: (entry, None) if isinstance(entry, int) else (entry["size"], entry.get("sha256"))
            for name, entry in marker["files"].items()}


def is_complete(checkpoint: Path, verify: bool = False) -> bool:
    """Whether `checkpoint` has its marker and every file the marker lists, at its size; with
    `verify`, also with its recorded SHA-256 digest (reads every byte)."""
    marker = read_marker(checkpoint)
    if marker is None or not marker["files"]:
        return False
    entries = _entries(marker)
    for name, (size, _) in entries.items():
        path = checkpoint / name
        if not path.is_file() or path.stat().st_size != size:
            return False
    if verify:
        recorded = {name: digest for name, (_, digest) in entries.items() if digest}
        return digests(checkpoint, list(recorded)) == recorded
    return True


def written_by(checkpoint: Path) -> tuple[int, str | None]:
    """(processes, strategy) that wrote `checkpoint`: from its marker, or for markers that do not
    record them, the processes from its per-rank files and the strategy from DeepSpeed's folders."""
    marker = read_marker(checkpoint) or {}
    world_size = marker.get("world_size") or max(1, len(list(checkpoint.glob("rng_state_*.pth"))))
    strategy = marker.get("strategy")
    if strategy is None and "world_size" not in marker:
        strategy = "deepspeed" if any(checkpoint.glob("global_step*")) else None
    return world_size, strategy


def checkpoints(folder: Path) -> list[Path]:
    """``checkpoint-N`` folders in `folder`, by step."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if p.is_dir() and (m := _CHECKPOINT.match(p.name))]
    return [p for _, p in sorted(found)]


def set_aside(checkpoint: Path, why: str) -> Path:
    """Move `checkpoint` to ``<run>/incomplete-checkpoints/`` (never deleted: it may help find out
    what happened) and say so; returns where it went."""
    aside = checkpoint.parent.parent / "incomplete-checkpoints"
    aside.mkdir(exist_ok=True)
    target = aside / checkpoint.name
    suffix = 1
    while target.exists():
        suffix += 1
        target = aside / f"{checkpoint.name}.{suffix}"
    checkpoint.rename(target)
    logger.warning("%s %s: moved to %s, not loaded", checkpoint, why, target)
    return target


def set_aside_incomplete(folder: Path) -> list[Path]:
    """Move every incomplete checkpoint in `folder` aside; returns where they went."""
    return [set_aside(c, "is incomplete (killed while saving, a rank's files missing, or the disk filled up)")
            for c in checkpoints(folder) if not is_complete(c)]


def newest_complete(folder: Path) -> Path | None:
    """The complete checkpoint with the highest step in `folder` (sizes checked), or None."""
    complete = [c for c in checkpoints(folder) if is_complete(c)]
    return complete[-1] if complete else None


# What the libraries' own states name besides what torch's weights_only loading builds anyway:
# numpy's arrays (random-number states), DeepSpeed's loss scaler, stage and fragment addresses
_SAVED_CLASSES = frozenset({
    "numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct", "numpy.ndarray", "numpy.dtype",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler", "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum", "deepspeed.utils.tensor_fragment.fragment_address",
})
# The trainer pickles its arguments beside the states (training_args.bin), for people; a resume never loads it
_NEVER_LOADED = frozenset({"training_args.bin"})
_PICKLED = (".pt", ".pth", ".bin", ".pkl")
_RAW_PICKLES = (".metadata",)  # torch.distributed.checkpoint's index of an FSDP2 state, read with pickle.load


class _IndexUnpickler(pickle.Unpickler):
    """Builds what a torch.distributed.checkpoint index holds (its metadata dataclasses and enums,
    sizes, dtypes, layouts, paths, plain containers); records and refuses anything else."""

    _NAMED = frozenset({"torch.Size", "torch.serialization._get_layout", "pathlib.PosixPath",
                        "collections.OrderedDict", "builtins.set", "builtins.frozenset", "builtins.complex"})

    def __init__(self, file) -> None:
        super().__init__(file)
        self.refused: list[str] = []

    def find_class(self, module: str, name: str):
        import dataclasses
        import enum

        import torch

        found = super().find_class(module, name) if module.split(".")[0] in ("torch", "pathlib", "collections",
                                                                               "builtins") else None
        if (f"{module}.{name}" in self._NAMED or isinstance(found, torch.dtype)
                or (module in ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
                    and isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)))):
            return found
        self.refused.append(f"{module}.{name}")
        raise pickle.UnpicklingError(f"{module}.{name}")


def _index_names(path: Path) -> list[str]:
    with open(path, "rb") as handle:
        unpickler = _IndexUnpickler(handle)
        try:
            unpickler.load()
        except Exception as exc:  # noqa: BLE001 - what it refused, or a file that is no pickle
            return unpickler.refused or [f"unreadable as a pickle ({exc.__class__.__name__})"]
    return []


def code_it_would_run(checkpoint: Path) -> dict[str, list[str]]:
    """For each pickled file of `checkpoint` a resume loads, the callables loading it would call
    beyond those of tensors, plain data and :data:`_SAVED_CLASSES` (read with torch's
    ``weights_only`` scanner, which runs nothing); also every symbolic link in it, and a DeepSpeed
    ``latest`` naming anything but a folder of its own (a loader would follow them out of the
    folder the scan read). Empty when there are none."""
    from torch.serialization import get_unsafe_globals_in_checkpoint

    found = {}
    latest = checkpoint / "latest"  # DeepSpeed's: the folder of its states, which it loads from
    if latest.is_file() and not (re.fullmatch(r"global_step\d+", latest.read_text().strip())
                                 and (checkpoint / latest.read_text().strip()).is_dir()):
        found["latest"] = [f"a folder other than a global_stepN of its own ({latest.read_text().strip()[:80]!r})"]
    for path in sorted(checkpoint.rglob("*")):
        if path.is_symlink():  # (rglob does not look inside a linked folder; a loader follows it)
            found[path.relative_to(checkpoint).as_posix()] = [f"a symbolic link to {os.readlink(path)}"]
            continue
        if not path.is_file() or path.name in _NEVER_LOADED:
            continue
        if path.name in _RAW_PICKLES:
            names = _index_names(path)
        elif path.suffix in _PICKLED:
            try:
                names = get_unsafe_globals_in_checkpoint(str(path))
            except Exception as exc:  # noqa: BLE001 - not torch's format: a raw pickle, refused as unreadable
                names = [f"unreadable as a torch file ({exc.__class__.__name__})"]
        else:
            continue
        names = [name for name in names if name not in _SAVED_CLASSES and not name.startswith("numpy.dtypes.")]
        if names:
            found[path.relative_to(checkpoint).as_posix()] = names
    return found


def _code_said(found: dict[str, list[str]]) -> str:
    name, names = next(iter(found.items()))
    more = f" (and {len(found) - 1} more file(s))" if len(found) > 1 else ""
    if names[0].startswith(("a symbolic link", "a folder other")):  # where the loader would go, not what it runs
        return f"{name} is {names[0]}{more}"
    return f"{name} would run {', '.join(names[:3])}{', ...' if len(names) > 3 else ''} when loaded{more}"


def refusal(checkpoint: Path) -> str | None:
    """Why `checkpoint` must not be loaded even though it is complete and matches its digests
    (:func:`code_it_would_run`), or None."""
    found = code_it_would_run(checkpoint)
    return f"{_code_said(found)}: not something training saves, so not loaded" if found else None


def newest_intact(folder: Path) -> Path | None:
    """The newest checkpoint in `folder` whose files match their recorded digests. Incomplete
    checkpoints, and complete ones whose contents changed since (a file damaged in place), are
    set aside, so that the previous complete one is used; so are checkpoints holding a file that
    would run code when loaded (:func:`refusal`)."""
    set_aside_incomplete(folder)
    for checkpoint in reversed(checkpoints(folder)):
        if not is_complete(checkpoint, verify=True):
            set_aside(checkpoint, "does not match the digests recorded when it was saved (a file damaged since)")
        elif (why := refusal(checkpoint)) is not None:
            set_aside(checkpoint, why)
        else:
            return checkpoint
    return None


def rotate(folder: Path, keep: int) -> list[Path]:
    """Delete complete checkpoints older than the newest `keep` complete ones; returns them.
    Called once the newest is marked, so a run always keeps at least one complete checkpoint."""
    complete = [c for c in checkpoints(folder) if is_complete(c)]
    old = complete[:-keep] if keep > 0 else []
    for checkpoint in old:
        shutil.rmtree(checkpoint, ignore_errors=True)
    return old
