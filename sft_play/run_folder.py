"""The run folder, and who writes what in it.

``<train.output_dir>/<run name>/`` holds one run: ``config.yaml`` (the resolved config),
``plan.json`` (the plan as made), ``run.json`` (the resolved run: every decision, the batch as
planned, the data's counts), ``events.jsonl`` (what changed while it trained: calibration, an
out-of-memory backoff), ``checkpoints/`` (:mod:`sft_play.checkpoints`), ``model/`` and
``summary.json`` (what it did). These are written here, by rank 0: each once per start of the run,
``events.jsonl`` appended to as things change. (``checkpoints/`` and ``model/`` are the trainer's,
``memory_check.json`` :mod:`sft_play.memory_check`'s.)

Also here: which folder a run goes into (a new one, or the run a resume continues, with what
must not have changed since), the check that every node sees the same folder, and finding the
finished runs that merge, generate, chat and eval read.
"""

from __future__ import annotations

import fcntl
import glob
import json
import logging
import os
import re
import secrets
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from sft_play import checkpoints
from sft_play.config import load
from sft_play.errors import UserError
from sft_play.parallelism import Strategy

logger = logging.getLogger(__name__)
CONFIG, PLAN, RUN, EVENTS, SUMMARY = "config.yaml", "plan.json", "run.json", "events.jsonl", "summary.json"
LOCK = ".sft_play.lock"


# --- one writer per run folder -----------------------------------------------------------------

OTHER_HOST_WAIT_S = 150.0  # past NFSv4's default 90 s lease, with the grace its recovery takes
_HELD: dict[str, int] = {}  # run folder -> the open lock file this process holds it by


class RunInUse(UserError):
    """A run folder another process is writing (training, or resuming it)."""


def hold(run_dir: Path) -> None:
    """Take `run_dir`'s lock for the rest of this process's life: one writer per run folder. The
    kernel releases it when the process ends, however it ends (``flock``; a stale lock file means
    nothing). Taking it again in the same process is a no-op.

    Raises:
        RunInUse: another process holds it (its pid and host are named).
    """
    key = str(run_dir.resolve())
    if key in _HELD:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        logger.warning("%s cannot be locked (%s): another process could write the run at the same time", run_dir, error)
        return
    attempt, waited_from = 0, None
    while True:
        attempt += 1
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if attempt <= 4:  # a reader's brief shared lock (in_use) is no writer
                time.sleep(0.1)
                continue
            holder = _holder(fd)
            if _on_another_host(holder):
                # a node that crashed keeps its lock on NFS until the server's lease for it ends
                # (NFSv4: 90 s by default): a requeued job waits that long before it is refused
                waited_from = waited_from or time.monotonic()
                if attempt == 5:  # said once
                    logger.warning("%s is locked by %s, another host: waiting up to %.0f s (a crashed node's lock "
                                   "ends with its file-server lease)", run_dir, holder, OTHER_HOST_WAIT_S)
                if time.monotonic() - waited_from < OTHER_HOST_WAIT_S:
                    time.sleep(1.0)
                    continue
            os.close(fd)
            raise RunInUse(f"{run_dir} is in use by another process ({holder}): a run folder has one writer. Wait "
                           "for it to end (or stop it: it saves a checkpoint), or choose another train.run_name") from None
        except OSError as error:  # a filesystem without flock (NFS without lockd, Lustre without -o flock)
            os.close(fd)
            logger.warning("%s cannot be locked on this filesystem (%s): another process could write the run at the "
                           "same time", run_dir, error)
            return
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
    _HELD[key] = fd


def _on_another_host(holder: str) -> bool:
    host = holder.rpartition(" on ")[2]
    here = socket.gethostname()
    return bool(host) and " on " in holder and host.split(".")[0] != here.split(".")[0]  # a name or its FQDN


def in_use(run_dir: Path) -> str | None:
    """Who holds `run_dir`'s lock ("pid N on host"), or None when no process does."""
    try:
        fd = os.open(run_dir / LOCK, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder(fd) if str(run_dir.resolve()) not in _HELD else None
    except OSError:  # no flock on this filesystem: nothing can be said
        return None
    finally:
        os.close(fd)  # (and the shared lock with it)
    return None


def discard_if_empty(run_dir: Path) -> None:
    """Remove `run_dir` if it holds nothing but this process's lock: a start refused before it
    wrote anything leaves no folder behind."""
    if not run_dir.is_dir() or {p.name for p in run_dir.iterdir()} - {LOCK}:
        return
    fd = _HELD.pop(str(run_dir.resolve()), None)
    if fd is not None:
        os.close(fd)
    shutil.rmtree(run_dir, ignore_errors=True)


def _holder(fd: int) -> str:
    try:
        return os.pread(fd, 200, 0).decode(errors="replace").strip() or "a process"
    except OSError:
        return "a process"


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
    checkpoint = checkpoints.newest_complete(run / "checkpoints")
    return (checkpoint / checkpoints.MARKER).stat().st_mtime if checkpoint else run.stat().st_mtime


def _no_checkpoint_help(save_steps: int) -> str:
    if save_steps > 0:
        return (f"checkpoints are written every train.save_steps={save_steps} steps and when a run is stopped by "
                "a signal")
    return ("train.save_steps is 0, so a checkpoint is written only when a run is stopped by a signal: set "
            "train.save_steps (e.g. ARGS=\"train.save_steps=100\") so that a killed or crashed run can resume")


# The timestamp of a run folder named after its config: <config name>-YYYYmmdd-HHMMSS (the
# runs of exp.yaml are exp-20261126-095931, not those of exp-lowlr.yaml)
_RUN_STAMP = re.compile(r"\d{8}-\d{6}(-\d+)?")


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
    named = _safe_name(config_stem)
    runs = [p for p in output_dir.glob(f"{glob.escape(named)}-*")
            if _RUN_STAMP.fullmatch(p.name[len(named) + 1:]) and (p / "config.yaml").is_file()]
    if not runs:
        return None, f"{prefix} no run of '{config_stem}' in {output_dir}; starting a fresh run"
    unfinished = [p for p in runs if not is_finished(p)]
    finished = len(runs) - len(unfinished)
    if not unfinished:
        return None, (f"{prefix} all {finished} run(s) of '{config_stem}' in {output_dir} finished; nothing to resume, "
                      "starting a fresh run")
    resumable = [p for p in unfinished if checkpoints.newest_complete(p / "checkpoints") is not None]
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
# A permission to go on, and how many processes tokenise (the same rows whatever it is): not settings of the run
_MAY_CHANGE = frozenset({"data.beyond_model_positions", "data.num_proc"})
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
        hold(run)  # before torn checkpoints are set aside: nobody else is writing them
        checkpoint = checkpoints.newest_intact(run / "checkpoints")
        if checkpoint is None:
            return None, None, (f"train.resume_from=auto: {run} has no complete checkpoint "
                                f"({_no_checkpoint_help(save_steps)}); starting it again from step 0")
        return run, checkpoint, f"resuming {run} from {checkpoint.name}: {why}"
    checkpoint = Path(resume_from)
    if not checkpoint.is_dir():
        raise ValueError(f"train.resume_from: '{resume_from}' is not a folder; use auto or a checkpoint folder")
    if not checkpoints.is_complete(checkpoint):
        raise ValueError(f"train.resume_from: '{resume_from}' is not a complete checkpoint (no {checkpoints.MARKER}, or files "
                         "missing): it was being written when the run stopped. Use auto to take the newest complete one")
    if not checkpoints.is_complete(checkpoint, verify=True):
        raise ValueError(f"train.resume_from: '{resume_from}' does not match the digests recorded when it was saved "
                         "(a file damaged since). Use auto to take the newest intact one")
    refused = checkpoints.refusal(checkpoint)
    if refused:
        raise ValueError(f"train.resume_from: '{resume_from}': {refused}")
    run = checkpoint.parent.parent
    if checkpoint.parent.name != "checkpoints" or not (run / "config.yaml").is_file():
        raise ValueError(f"train.resume_from: '{resume_from}' is not inside a run folder (<run>/checkpoints/checkpoint-N)")
    hold(run)
    return run, checkpoint, f"resuming {run} from {checkpoint.name}"


def differences(saved: dict, current: dict) -> list[str]:
    """The settings a resumed run must share with the run that wrote the checkpoint, where they differ."""
    changed = []
    for section in _MUST_MATCH:
        for key, value in saved.get(section, {}).items():
            if f"{section}.{key}" in _MAY_CHANGE:
                continue
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
    saved_world, saved_strategy = checkpoints.written_by(checkpoint)
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
        RunInUse: another process is writing the run.
    """
    stem = Path(config_path).stem
    output_dir = Path(config.train.output_dir)
    if not config.train.resume_from:
        return _new_run(output_dir, config.train.run_name, stem), None, None
    run, checkpoint, message = resolve_resume(config.train.resume_from, output_dir,
                                              config.train.run_name, stem, config.train.save_steps)
    if run is None:
        # nothing to resume: a named run with no checkpoint yet starts again in its own folder
        return _new_run(output_dir, config.train.run_name, stem, restart=True), None, message
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


def folder_of(output_dir: str | Path, name: str, checkpoint: str | None) -> Path:
    """The folder of the run :func:`choose_run_folder` chose: a resumed checkpoint's own run folder
    (named by its path, it may lie outside `output_dir`), else `name` under `output_dir`."""
    return Path(checkpoint).parents[1] if checkpoint else Path(output_dir) / name


def _new_run(output_dir: Path, run_name: str | None, stem: str, restart: bool = False) -> str:
    """A new run's folder, created and held: `run_name`, or ``<stem>-<timestamp>`` with ``-2``,
    ``-3``... when runs started in the same second (the folder is made atomically, so two starts
    never share one). With `restart`, `run_name` may hold an unfinished run without a checkpoint
    (what ``RESUME=auto`` starts again from step 0).

    Raises:
        ValueError: `run_name` holds a run; the output folder cannot hold run folders.
        RunInUse: another process holds `run_name`.
    """
    _usable_output_dir(output_dir)
    if run_name:
        hold(output_dir / run_name)
        if restart:
            shutil.rmtree(output_dir / run_name / "model.partial", ignore_errors=True)
        else:
            _refuse_to_overwrite(output_dir / run_name)
        return run_name
    base = f"{_safe_name(stem)}-{_timestamp()}"
    for attempt in range(1, 1000):
        name = base if attempt == 1 else f"{base}-{attempt}"
        try:
            (output_dir / name).mkdir(parents=True)
        except FileExistsError:
            continue
        hold(output_dir / name)
        return name
    raise ValueError(f"train.output_dir ({output_dir}) already holds 999 runs named {base}-*")


def _safe_name(stem: str) -> str:
    """A config file's name as a run name's start: what train.run_name allows, and room for the time."""
    return re.sub(r"[^A-Za-z0-9._-]", "-", stem).lstrip(".-")[:100] or "run"


def _timestamp() -> str:
    from datetime import datetime

    return datetime.now().strftime("%Y%m%d-%H%M%S")


def _usable_output_dir(output_dir: Path) -> None:
    """Raises ValueError, saying what to do, where run folders cannot be made in `output_dir`."""
    if output_dir.exists() and not output_dir.is_dir():
        raise ValueError(f"train.output_dir ({output_dir}) is a file, not a folder: point it at a folder")
    existing = next((p for p in [output_dir, *output_dir.parents] if p.exists()), None)
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"train.output_dir ({output_dir}): {existing} is not writable by this user; choose a "
                         "folder you can write to")


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
        checkpoint = checkpoints.newest_complete(run / "checkpoints")
        what = f"an unfinished run ({'last checkpoint ' + checkpoint.name if checkpoint else 'no complete checkpoint'})"
        remedy = ("continue it with RESUME=auto (train.resume_from=auto), choose another train.run_name, "
                  "or delete that folder")
    raise ValueError(f"train.run_name={run.name}: {run} holds {what}; a new run there would overwrite it: {remedy}")


# --- finished runs (what merge, generate, chat and eval read) ---------------------------------


def finished_runs(output_dir: str | Path) -> list[Path]:
    """Run folders that trained to their end, with their whole model saved, oldest first (a run
    whose final save was cut short has no ``model/``: it is saved as ``model.partial/`` first)."""
    root = Path(output_dir)
    runs = [p for p in root.glob("*") if (p / "model").is_dir() and (p / "config.yaml").is_file() and is_finished(p)
            and not in_use(p)] if root.is_dir() else []
    return sorted(runs, key=lambda p: (p / "model").stat().st_mtime)


def resolve_run(run: str | None, output_dir: str | Path) -> Path:
    """`run` when given, else the newest finished run under `output_dir`.

    Raises:
        FileNotFoundError: with what to do, when there is no such run.
        RunInUse: `run` is still being written.
    """
    if run:
        path = Path(run)
        holder = in_use(path) if path.is_dir() else None  # (a live run has no model/ yet: say who trains it)
        if holder:
            raise RunInUse(f"{path} is still being written ({holder}): wait for its training to end")
        if not path.is_dir() or not ((path / "model").is_dir() or (path / "config.json").is_file()
                                     or (path / "adapter_config.json").is_file()):
            if path.is_dir() and any(path.glob("checkpoints/checkpoint-*")):  # a run stopped before its end
                raise FileNotFoundError(f"'{run}' did not finish (it has no model/, only checkpoints/): the make "
                                        "train command that started it, with RESUME=auto, finishes it")
            raise FileNotFoundError(f"'{run}' is neither a finished run folder (with model/) nor a model folder; "
                                    f"see `ls {output_dir}`")
        return path
    runs = finished_runs(output_dir)
    if not runs:
        raise FileNotFoundError(f"no finished run under '{output_dir}'; train one first with `make train`")
    return runs[-1]


# --- the files of a run ------------------------------------------------------------------------


def write_config(run_dir: Path, config: Any) -> None:
    """``config.yaml``: the resolved config, loadable as it is (a resume compares with it)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / CONFIG).write_text(config.to_yaml())


def write_plan(run_dir: Path, plan_json: str) -> None:
    """``plan.json``: the plan the run started with (``sft_play.planner.present.report.to_json``)."""
    (run_dir / PLAN).write_text(plan_json + "\n")


def data_summary(stats: Any) -> dict[str, Any]:
    """What the run trains on, in counts (of :class:`sft_play.data.DataStats`): a resume compares
    them (:func:`data_changes`)."""
    counts = {"examples": stats.examples, "tokens": stats.tokens_total, "loss_tokens": stats.loss_tokens,
              "rows": stats.packed_rows if stats.packed_rows is not None else stats.examples}
    return {**counts, "sampled": stats.sampled} if getattr(stats, "sampled", 0) else counts  # (streamed: a sample's)


def write_run(run_dir: Path, run: Any, data: dict[str, Any] | None = None, base_weights: str | None = None) -> None:
    """``run.json``: the resolved run (:class:`sft_play.run.Run`, its batch as planned), the data's
    counts (:func:`data_summary`; a resumed run keeps those of its first start beside them as
    ``data_at_start``) and where the base weights loaded from (`base_weights`: a config-only
    folder's initialised weights are in the cache)."""
    document = {**run.to_dict(), "workdir": os.getcwd()}  # what the config's relative paths are relative to
    if base_weights:
        document["base_weights"] = (os.path.abspath(base_weights) if os.path.exists(base_weights)
                                    else base_weights)  # a hub id stays one
    if data:
        try:
            saved = json.loads((run_dir / RUN).read_text())
            before = saved.get("data_at_start") or saved.get("data")
        except (OSError, ValueError, AttributeError):
            before = None
        document.update(data=data, data_at_start=before or data)
    (run_dir / RUN).write_text(json.dumps(document, indent=2, default=str) + "\n")


def record_event(run_dir: Path, event: str, **fields: Any) -> None:
    """One line of ``events.jsonl``: what changed while the run trained (``calibrated``: the split
    measured steps chose; ``out_of_memory``: the split a backoff continued with), with the time."""
    line = {"event": event, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **fields}
    with open(run_dir / EVENTS, "a") as f:
        f.write(json.dumps(line, default=str) + "\n")


def events(run_dir: Path) -> list[dict[str, Any]]:
    """The run's events, oldest first (unreadable lines skipped)."""
    found = []
    try:
        lines = (run_dir / EVENTS).read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            found.append(json.loads(line))
        except ValueError:
            continue
    return found


def write_summary(run_dir: Path, summary: dict[str, Any], before: tuple[float, int] = (0.0, 0)) -> dict[str, Any]:
    """``summary.json``: what the run did. `before`, the training time and segments its resumed
    checkpoint records (:func:`sft_play.checkpoints.time_before`), is added to this segment's;
    returns what was written."""
    summary = dict(summary)
    runtime = summary.get("train_runtime_s")
    summary.update(train_runtime_s=None if runtime is None else runtime + before[0], segments=before[1] + 1)
    (run_dir / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
    return summary
