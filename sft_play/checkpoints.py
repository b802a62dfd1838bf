"""Checkpoints that can be trusted: a completeness marker written once a checkpoint is whole,
finding the newest complete one to resume from, and setting half-written ones aside.

A checkpoint folder (``<run>/checkpoints/checkpoint-N``) is complete when it holds
``sft_play_complete.json`` and every file that marker lists, at the size it lists. The marker
is written after the trainer has finished saving on every rank; a process killed during a save,
or a disk that filled up, leaves a folder without it (or with files of another size), and such a
folder is moved to ``<run>/incomplete-checkpoints/`` on resume (so that neither resuming nor the
trainer's ``save_total_limit`` rotation ever sees it) with a warning, never loaded.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

logger = logging.getLogger(__name__)

MARKER = "sft_play_complete.json"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def write_marker(checkpoint: Path, step: int) -> None:
    """Record that `checkpoint` is complete: its files and their sizes."""
    files = {
        str(p.relative_to(checkpoint)): p.stat().st_size
        for p in sorted(checkpoint.rglob("*"))
        if p.is_file() and p.name != MARKER
    }
    staging = checkpoint / f".{MARKER}.tmp"
    staging.write_text(json.dumps({"step": step, "files": files}, indent=1))
    staging.rename(checkpoint / MARKER)


def is_complete(checkpoint: Path) -> bool:
    """Whether `checkpoint` has its marker and every file the marker lists, at its size."""
    marker = checkpoint / MARKER
    try:
        listed = json.loads(marker.read_text())["files"]
    except (OSError, ValueError, KeyError):
        return False
    for name, size in listed.items():
        path = checkpoint / name
        if not path.is_file() or path.stat().st_size != size:
            return False
    return bool(listed)


def checkpoints(folder: Path) -> list[Path]:
    """``checkpoint-N`` folders in `folder`, by step."""
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if p.is_dir() and (m := _CHECKPOINT.match(p.name))]
    return [p for _, p in sorted(found)]


def set_aside_incomplete(folder: Path) -> list[Path]:
    """Move every incomplete checkpoint in `folder` to ``../incomplete-checkpoints/``; returns
    where they went."""
    moved = []
    for checkpoint in checkpoints(folder):
        if not is_complete(checkpoint):
            aside = folder.parent / "incomplete-checkpoints"
            aside.mkdir(exist_ok=True)
            target = aside / checkpoint.name
            suffix = 1
            while target.exists():
                suffix += 1
                target = aside / f"{checkpoint.name}.{suffix}"
            checkpoint.rename(target)
            logger.warning("%s is incomplete (killed while saving, or the disk filled up): moved to %s, not loaded",
                           checkpoint, target)
            moved.append(target)
    return moved


def newest_complete(folder: Path) -> Path | None:
    """The complete checkpoint with the highest step in `folder`, or None."""
    complete = [c for c in checkpoints(folder) if is_complete(c)]
    return complete[-1] if complete else None


def find_resume_run(output_dir: Path, run_name: str | None, config_stem: str) -> Path | None:
    """The run folder ``train.resume_from: auto`` continues: the named run, else the newest run
    of this config (``<config name>-<timestamp>``) that has a complete checkpoint."""
    if run_name:
        run = output_dir / run_name
        return run if run.is_dir() else None
    candidates = [p for p in output_dir.glob(f"{config_stem}-*") if p.is_dir()] if output_dir.is_dir() else []
    with_checkpoints = [p for p in candidates if newest_complete(p / "checkpoints") is not None]
    return max(with_checkpoints, key=lambda p: p.stat().st_mtime, default=None)


# What a checkpoint depends on: resuming under other values would train something else.
_MUST_MATCH = ("model", "finetune", "lora", "quantization", "data")
_MUST_MATCH_TRAIN = ("global_batch_size", "seed")


def resolve_resume(resume_from: str, output_dir: Path, run_name: str | None, config_stem: str) -> tuple[Path | None, Path | None, str]:
    """Where ``train.resume_from`` continues: (run folder, checkpoint, what to tell the user).

    ``auto`` takes the newest complete checkpoint of the run (see :func:`find_resume_run`),
    setting incomplete ones aside first; with nothing to resume it says so and training starts
    fresh. A path must name a complete checkpoint inside a run folder.

    Raises:
        ValueError: a path that is not a complete checkpoint of a run.
    """
    if resume_from == "auto":
        run = find_resume_run(output_dir, run_name, config_stem)
        if run is None:
            return None, None, f"train.resume_from=auto: no run of '{config_stem}' to resume in {output_dir}; starting fresh"
        set_aside_incomplete(run / "checkpoints")
        checkpoint = newest_complete(run / "checkpoints")
        if checkpoint is None:
            return None, None, f"train.resume_from=auto: {run} has no complete checkpoint; starting a fresh run"
        return run, checkpoint, f"resuming {run} from {checkpoint.name}"
    checkpoint = Path(resume_from)
    if not checkpoint.is_dir():
        raise ValueError(f"train.resume_from: '{resume_from}' is not a folder; use auto or a checkpoint folder")
    if not is_complete(checkpoint):
        raise ValueError(f"train.resume_from: '{resume_from}' is not a complete checkpoint (no {MARKER}, or files "
                         "missing): it was being written when the run stopped. Use auto to take the newest complete one")
    run = checkpoint.parent.parent
    if checkpoint.parent.name != "checkpoints" or not (run / "config.yaml").is_file():
        raise ValueError(f"train.resume_from: '{resume_from}' is not inside a run folder (<run>/checkpoints/checkpoint-N)")
    return run, checkpoint, f"resuming {run} from {checkpoint.name}"


def differences(saved: dict, current: dict) -> list[str]:
    """The settings a resumed run must share with the run that wrote the checkpoint, where they differ."""
    changed = []
    for section in _MUST_MATCH:
        for key, value in saved.get(section, {}).items():
            if current.get(section, {}).get(key) != value:
                changed.append(f"{section}.{key}: {value!r} in the run, {current.get(section, {}).get(key)!r} now")
    for key in _MUST_MATCH_TRAIN:
        if saved.get("train", {}).get(key) != current.get("train", {}).get(key):
            changed.append(f"train.{key}: {saved['train'].get(key)!r} in the run, {current['train'].get(key)!r} now")
    return changed


def choose_run_folder(config, config_path: str) -> tuple[str, str | None, str | None]:
    """(run folder name, checkpoint to resume or None, message) for a run of `config`: a new
    folder (``train.run_name``, else ``<config name>-<timestamp>``), or the run being resumed.

    Raises:
        ValueError: an unusable ``train.resume_from``, or a resume with settings the checkpoint
            was not trained with.
    """
    from datetime import datetime

    from sft_play.config import load

    stem = Path(config_path).stem
    fresh = config.train.run_name or f"{stem}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    if not config.train.resume_from:
        return fresh, None, None
    run, checkpoint, message = resolve_resume(config.train.resume_from, Path(config.train.output_dir),
                                              config.train.run_name, stem)
    if run is None:
        return fresh, None, message
    changed = differences(load(run / "config.yaml", check_paths=False).to_dict(), config.to_dict())
    if changed:
        raise ValueError(f"cannot resume {run} with different settings:\n  " + "\n  ".join(changed))
    return run.name, str(checkpoint), message
