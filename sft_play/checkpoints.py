"""Checkpoints that can be trusted: a completeness marker written once a checkpoint is whole,
rotation that never leaves a run without one, finding the run and checkpoint to resume, and
setting torn or corrupted ones aside.

A checkpoint folder (``<run>/checkpoints/checkpoint-N``) is complete when it holds
``sft_play_complete.json`` and every file that marker lists, at the size it lists; on resume
the files' SHA-256 digests are checked too. The marker is written after every rank has finished
saving, and only when the files of every rank are there (``rng_state_<rank>.pth``); older
checkpoints are deleted (``train.save_total_limit``) only after the new one is marked. A
process killed during a save, a disk that filled up, a node writing into a folder the others
cannot see, or a file damaged later leaves a checkpoint that fails these checks: on resume it
is moved to ``<run>/incomplete-checkpoints/`` with a warning, never loaded, and the previous
complete one is used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import secrets
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from sft_play.config import load
from sft_play.parallelism import Strategy

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
                 file_digests: dict[str, str] | None = None) -> None:
    """Record that `checkpoint` is complete: its files with their sizes and SHA-256 digests, and
    the number of processes and the strategy that wrote it.

    Args:
        file_digests: digests already computed (e.g. by several ranks); the rest are computed here.
    """
    names = checkpoint_files(checkpoint)
    known = dict(file_digests or {})
    known.update(digests(checkpoint, [n for n in names if n not in known]))
    files = {name: {"size": (checkpoint / name).stat().st_size, "sha256": known[name]} for name in names}
    staging = checkpoint / f".{MARKER}.tmp"
    staging.write_text(json.dumps({"step": step, "world_size": world_size, "strategy": strategy, "files": files},
                                  indent=1))
    staging.rename(checkpoint / MARKER)


def read_marker(checkpoint: Path) -> dict | None:
    try:
        marker = json.loads((checkpoint / MARKER).read_text())
        return marker if isinstance(marker.get("files"), dict) else None
    except (OSError, ValueError, AttributeError):
        return None


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


def newest_intact(folder: Path) -> Path | None:
    """The newest checkpoint in `folder` whose files match their recorded digests. Incomplete
    checkpoints, and complete ones whose contents changed since (a file damaged in place), are
    set aside, so that the previous complete one is used."""
    set_aside_incomplete(folder)
    for checkpoint in reversed(checkpoints(folder)):
        if is_complete(checkpoint, verify=True):
            return checkpoint
        set_aside(checkpoint, "does not match the digests recorded when it was saved (a file damaged since)")
    return None


def rotate(folder: Path, keep: int) -> list[Path]:
    """Delete complete checkpoints older than the newest `keep` complete ones; returns them.
    Called once the newest is marked, so a run always keeps at least one complete checkpoint."""
    complete = [c for c in checkpoints(folder) if is_complete(c)]
    old = complete[:-keep] if keep > 0 else []
    for checkpoint in old:
        shutil.rmtree(checkpoint, ignore_errors=True)
    return old


# --- one output folder for every node ------------------------------------------------------------

_SHARED_MARK = ".sft_play_shared_{}"


def mark_shared(folder: Path) -> str:
    """Create `folder` and write a token file into it that every rank must then find there (see
    :func:`sees_shared_mark`); returns the token."""
    folder.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(8)
    (folder / _SHARED_MARK.format(token)).write_text(token)
    return token


def sees_shared_mark(folder: Path, token: str, wait_s: float = 5.0) -> bool:
    """Whether this process finds rank 0's token file in `folder` (within `wait_s`, for network
    filesystems that show new files late): False on a node whose folder is not rank 0's."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if (folder / _SHARED_MARK.format(token)).read_text() == token:
                return True
        except OSError:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)


def unmark_shared(folder: Path, token: str) -> None:
    (folder / _SHARED_MARK.format(token)).unlink(missing_ok=True)


def unshared_message(folder: Path, hosts: list[str]) -> str:
    return (f"train.output_dir ({folder}) is not shared: the processes on {', '.join(hosts)} cannot see what rank 0 "
            "writes there. Every node writes its part of each checkpoint (its optimizer shard and random-number "
            "state) into the run folder, and resuming reads them all back: set train.output_dir to a folder on a "
            "filesystem every node mounts (NFS, Lustre, ...), at the same path on every node")


# --- which run to resume -----------------------------------------------------------------------


def is_finished(run: Path) -> bool:
    """Whether `run` trained to its end (its ``summary.json`` is written then, and by a stopped
    run with ``interrupted`` in it)."""
    try:
        return "interrupted" not in json.loads((run / "summary.json").read_text())
    except (OSError, ValueError):
        return False


def _last_saved(run: Path) -> float:
    checkpoint = newest_complete(run / "checkpoints")
    return (checkpoint / MARKER).stat().st_mtime if checkpoint else run.stat().st_mtime


def _no_checkpoint_help(save_steps: int) -> str:
    if save_steps > 0:
        return (f"checkpoints are written every train.save_steps={save_steps} steps and when a run is stopped by "
                "a signal")
    return ("train.save_steps is 0, so a checkpoint is written only when a run is stopped by a signal: set "
            "train.save_steps (e.g. ARGS=\"train.save_steps=100\") so that a killed or crashed run can resume")


# The timestamp of a run folder named after its config: <config name>-YYYYmmdd-HHMMSS (the
# runs of exp.yaml are exp-20261126-095931, not those of exp-lowlr.yaml)
_RUN_STAMP = re.compile(r"\d{8}-\d{6}")


def find_resume_run(output_dir: Path, run_name: str | None, config_stem: str,
                    save_steps: int = 0) -> tuple[Path | None, str]:
    """The run folder ``train.resume_from: auto`` continues, and why (or why none).

    With ``train.run_name``: that run, unless it finished (nothing to resume: an error). Without:
    the newest unfinished run of this config (``<config name>-<timestamp>``) that has a complete
    checkpoint; finished runs are not resumable and are skipped.

    Raises:
        ValueError: the named run finished.
    """
    prefix = "train.resume_from=auto:"
    if run_name:
        run = output_dir / run_name
        if not run.is_dir():
            return None, f"{prefix} no run named '{run_name}' in {output_dir} yet; starting it"
        if is_finished(run):
            raise ValueError(f"{prefix} {run} finished (see its summary.json and model/); there is nothing to resume. "
                             "Choose another train.run_name for a new run")
        return run, f"the run named '{run_name}'"
    runs = [p for p in output_dir.glob(f"{config_stem}-*")
            if _RUN_STAMP.fullmatch(p.name[len(config_stem) + 1:]) and (p / "config.yaml").is_file()]
    if not runs:
        return None, f"{prefix} no run of '{config_stem}' in {output_dir}; starting a fresh run"
    unfinished = [p for p in runs if not is_finished(p)]
    finished = len(runs) - len(unfinished)
    if not unfinished:
        return None, (f"{prefix} all {finished} run(s) of '{config_stem}' in {output_dir} finished; nothing to resume, "
                      "starting a fresh run")
    resumable = [p for p in unfinished if newest_complete(p / "checkpoints") is not None]
    if not resumable:
        return None, (f"{prefix} none of the {len(unfinished)} unfinished run(s) of '{config_stem}' in {output_dir} "
                      f"has a checkpoint ({_no_checkpoint_help(save_steps)}); starting a fresh run")
    run = max(resumable, key=_last_saved)
    skipped = [f"{finished} finished run(s) skipped"] if finished else []
    without = len(unfinished) - len(resumable)
    if without:
        skipped.append(f"{without} unfinished run(s) without a checkpoint skipped")
    why = f"the newest unfinished run of '{config_stem}' with a checkpoint"
    if skipped:
        why += f" ({'; '.join(skipped)})"
    return run, why


# What a checkpoint depends on: resuming under other values would train something else than
# the run the checkpoint continues (another schedule, warm-up, weight decay or optimizer from
# the middle on), or ignore the new value while config.yaml says it (the learning rate, which
# the scheduler's state brings back). Of `train`, only these may change on resume: how long it
# runs (the schedule is stretched to a new length), how it logs and saves, how each process
# splits the same global batch on the hardware it now has, and the guards against bad steps
# (a tighter max_grad_norm after a run stopped on NaN losses).
_MUST_MATCH = ("model", "finetune", "lora", "quantization", "data")
_MAY_CHANGE_TRAIN = frozenset({
    "output_dir", "run_name", "resume_from", "max_steps", "num_epochs", "logging_steps", "save_steps",
    "save_total_limit", "eval_steps", "tensorboard", "max_bad_steps", "record_samples", "micro_batch_size",
    "gradient_accumulation_steps", "gradient_checkpointing", "mixed_precision", "deterministic", "torch_compile",
    "liger_kernels", "expandable_segments", "max_grad_norm", "early_stopping_patience", "report_to",
})


def resolve_resume(resume_from: str, output_dir: Path, run_name: str | None, config_stem: str,
                   save_steps: int = 0) -> tuple[Path | None, Path | None, str]:
    """Where ``train.resume_from`` continues: (run folder, checkpoint, what to tell the user).

    ``auto`` takes the newest intact checkpoint of the run :func:`find_resume_run` picks (torn
    and damaged ones are set aside first); with nothing to resume it says why and training
    starts fresh. A path must name a complete, undamaged checkpoint inside a run folder.

    Raises:
        ValueError: a path that is not a complete checkpoint of a run; a named run that finished.
    """
    if resume_from == "auto":
        run, why = find_resume_run(output_dir, run_name, config_stem, save_steps)
        if run is None:
            return None, None, why
        checkpoint = newest_intact(run / "checkpoints")
        if checkpoint is None:
            return None, None, (f"train.resume_from=auto: {run} has no complete checkpoint "
                                f"({_no_checkpoint_help(save_steps)}); starting it again from step 0")
        return run, checkpoint, f"resuming {run} from {checkpoint.name}: {why}"
    checkpoint = Path(resume_from)
    if not checkpoint.is_dir():
        raise ValueError(f"train.resume_from: '{resume_from}' is not a folder; use auto or a checkpoint folder")
    if not is_complete(checkpoint):
        raise ValueError(f"train.resume_from: '{resume_from}' is not a complete checkpoint (no {MARKER}, or files "
                         "missing): it was being written when the run stopped. Use auto to take the newest complete one")
    if not is_complete(checkpoint, verify=True):
        raise ValueError(f"train.resume_from: '{resume_from}' does not match the digests recorded when it was saved "
                         "(a file damaged since). Use auto to take the newest intact one")
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
    saved_train, current_train = saved.get("train", {}), current.get("train", {})
    for key in sorted(set(saved_train) | set(current_train)):
        if key not in _MAY_CHANGE_TRAIN and saved_train.get(key) != current_train.get(key):
            changed.append(f"train.{key}: {saved_train.get(key)!r} in the run, {current_train.get(key)!r} now")
    return changed


def data_changes(run: Path, data: dict[str, Any]) -> str | None:
    """How the training data differs from what `run` first started on (its ``run.json``'s
    ``data_at_start``), as a warning; None when it is the same, or unknown."""
    try:
        saved = json.loads((run / "run.json").read_text())
        before = saved.get("data_at_start") or saved.get("data")
    except (OSError, ValueError):
        return None
    if not before or before == data:
        return None
    moved = ", ".join(f"{key} {before.get(key)} -> {data.get(key)}" for key in data if before.get(key) != data.get(key))
    return (f"the training data changed since {run.name} started ({moved}): the resumed steps draw from the data "
            "as it is now, in another order than an uninterrupted run's")


def layout_differences(checkpoint: Path, world_size: int, strategy: str) -> list[str]:
    """How the processes about to resume differ from those that wrote `checkpoint`: its optimizer
    states and random-number states are per process and per strategy."""
    saved_world, saved_strategy = written_by(checkpoint)
    changed = []
    if saved_world != world_size:
        changed.append(f"processes: {saved_world} wrote it, {world_size} now (NUM_GPUS x NNODES)")
    if saved_strategy is not None:
        same = (saved_strategy == strategy if saved_strategy != "deepspeed"
                else Strategy(strategy).deepspeed)  # an older marker names only the family
        if not same:
            changed.append(f"distributed.strategy: {saved_strategy!r} wrote it, {strategy!r} now")
    return changed


def choose_run_folder(config, config_path: str, world_size: int = 1,
                      data: dict[str, Any] | None = None) -> tuple[str, str | None, str | None]:
    """(run folder name, checkpoint to resume or None, message) for a run of `config` on
    `world_size` processes: a new folder (``train.run_name``, else ``<config name>-<timestamp>``),
    or the run being resumed.

    Raises:
        ValueError: an unusable ``train.resume_from``; a resume with settings, a number of
            processes or a strategy other than those the checkpoint was written with.
    """
    from datetime import datetime

    stem = Path(config_path).stem
    fresh = config.train.run_name or f"{stem}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    if not config.train.resume_from:
        _refuse_to_overwrite(Path(config.train.output_dir) / fresh)
        return fresh, None, None
    run, checkpoint, message = resolve_resume(config.train.resume_from, Path(config.train.output_dir),
                                              config.train.run_name, stem, config.train.save_steps)
    if run is None:
        return fresh, None, message
    changed = differences(load(run / "config.yaml", check_paths=False).to_dict(), config.to_dict())
    changed += layout_differences(checkpoint, world_size, config.distributed.strategy)
    if changed:
        raise ValueError(f"cannot resume {run} from {checkpoint.name} with different settings:\n  "
                         + "\n  ".join(changed)
                         + "\nResume with the settings it was written with, or start a new run "
                           "(without RESUME=auto, or with another train.run_name)")
    changed_data = data_changes(run, data) if data else None
    if changed_data:
        message += f"\nwarning: {changed_data}"
    return run.name, str(checkpoint), message


def _refuse_to_overwrite(run: Path) -> None:
    """A new run does not go into a folder that holds a run: its model, checkpoints and logs would
    be overwritten or mixed with the new run's.

    Raises:
        ValueError: `run` holds a run (finished, or with checkpoints to resume).
    """
    if not ((run / "config.yaml").is_file() or (run / "model").is_dir() or (run / "checkpoints").is_dir()):
        return
    if is_finished(run):
        what = "a finished run (its model/ and summary.json)"
        remedy = "choose another train.run_name, or delete that folder to train it again"
    else:
        checkpoint = newest_complete(run / "checkpoints")
        what = f"an unfinished run ({'last checkpoint ' + checkpoint.name if checkpoint else 'no complete checkpoint'})"
        remedy = ("continue it with RESUME=auto (train.resume_from=auto), choose another train.run_name, "
                  "or delete that folder")
    raise ValueError(f"train.run_name={run.name}: {run} holds {what}; a new run there would overwrite it: {remedy}")


# --- finished runs (what merge, generate, chat and eval read) ---------------------------------


def finished_runs(output_dir: str | Path) -> list[Path]:
    """Run folders with a saved model, oldest first."""
    root = Path(output_dir)
    runs = [p for p in root.glob("*") if (p / "model").is_dir() and (p / "config.yaml").is_file()] if root.is_dir() else []
    return sorted(runs, key=lambda p: (p / "model").stat().st_mtime)


def resolve_run(run: str | None, output_dir: str | Path) -> Path:
    """`run` when given, else the newest finished run under `output_dir`.

    Raises:
        FileNotFoundError: with what to do, when there is no such run.
    """
    if run:
        path = Path(run)
        if not path.is_dir() or not ((path / "model").is_dir() or (path / "config.json").is_file()
                                     or (path / "adapter_config.json").is_file()):
            raise FileNotFoundError(f"'{run}' is neither a finished run folder (with model/) nor a model folder; "
                                    f"see `ls {output_dir}`")
        return path
    runs = finished_runs(output_dir)
    if not runs:
        raise FileNotFoundError(f"no finished run under '{output_dir}'; train one first with `make train`")
    return runs[-1]
