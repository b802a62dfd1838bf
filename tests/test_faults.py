"""Faults on the CPU, injected for real: signals to a training process, half-written
checkpoints, a full disk, NaN losses. Nothing already saved may be lost."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import TrainerCallback

from sft_play import callbacks, checkpoints, checks, run_folder, training
from sft_play import config as config_module
from sft_play.errors import UserError
from sft_play.run import BatchSplit
from tests.conftest import FORKED, PINNED
from tests.conftest import tiny_trainer_factory as build

REPO = Path(__file__).resolve().parents[1]


def train_process(*overrides: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "scripts/train_distributed.py", "--config", "configs/run_tiny.yaml",
                             *overrides], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **FORKED, **(env or {})})


def run_to_end(*overrides: str) -> str:
    process = train_process(*overrides)
    output = process.communicate(timeout=600)[0]
    assert process.returncode == 0, output[-4000:]
    return output


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_resume_ends_like_an_uninterrupted_run(tmp_path):
    common = ["train.max_steps=4", "train.logging_steps=1", f"train.output_dir={tmp_path}", *PINNED]
    # two processes at once, each on one of the cores (OpenMP threads of both spinning on the
    # same cores made this test several times slower: conftest.run_scripts_together)
    alongside = {"OMP_NUM_THREADS": "1"}
    reference = train_process(*common, "train.run_name=reference", env=alongside)  # never interrupted
    process = train_process(*common, "train.run_name=interrupted", env={"SFT_PLAY_FAULTS": "hold_step=2", **alongside})
    seen: list[str] = []

    def read():
        for line in process.stdout:
            seen.append(line)
            if "fault injection (hold_step)" in line:  # step 2 waits for the signal
                process.send_signal(signal.SIGTERM)

    reader = threading.Thread(target=read)
    reader.start()
    process.wait(timeout=300)
    reader.join()
    output = "".join(seen)
    assert process.returncode == 75, output[-4000:]
    assert "received SIGTERM: finishing this step, saving a checkpoint" in output
    ran = [sys.executable, "scripts/train_distributed.py", "--config", "configs/run_tiny.yaml", *common,
           "train.run_name=interrupted"]
    assert f"resume: {shlex.join(ran + ['train.resume_from=auto'])}" in output, "the command that ran, to resume"
    run = tmp_path / "interrupted"
    saved = checkpoints.newest_complete(run / "checkpoints")
    assert saved is not None and saved.name == "checkpoint-2", "train.save_steps is 0: saved on the signal only"
    assert not (run / "model").exists(), "an interrupted run has no final model"
    first = json.loads((run / "summary.json").read_text())
    assert first["interrupted"] == "SIGTERM" and first["segments"] == 1 and first["train_runtime_s"] > 0

    resumed = run_to_end(*common, "train.run_name=interrupted", "train.resume_from=auto")
    assert f"resuming {run} from {saved.name}" in resumed
    assert reference.wait(timeout=600) == 0
    ours = json.loads((run / "summary.json").read_text())
    theirs = json.loads((tmp_path / "reference" / "summary.json").read_text())
    assert ours["global_step"] == theirs["global_step"] == 4
    assert ours["last_loss"] == pytest.approx(theirs["last_loss"], rel=1e-5)
    # the time of both segments, not the last one's alone
    assert ours["segments"] == 2 and theirs["segments"] == 1 and ours["train_runtime_s"] > first["train_runtime_s"]
    assert "in 2 segments (stopped and resumed)" in (run / "model" / "README.md").read_text()


def test_sigint_in_process_stops_at_the_step_boundary_with_a_checkpoint(tmp_path):
    class Interrupt(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1:
                os.kill(os.getpid(), signal.SIGINT)

    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when pytest was started in the background
    stop = callbacks.GracefulStop()
    make = build(tmp_path, [callbacks.CheckpointMarker(), stop, Interrupt()])
    trainer, _ = training.train_with_backoff(make, BatchSplit(8, 1, 1, 8))
    assert stop.received == "SIGINT" and stop.stopped_at == 2 and trainer.state.global_step == 2
    assert checkpoints.is_complete(tmp_path / "checkpoints" / "checkpoint-2")
    assert signal.getsignal(signal.SIGINT) is before  # handlers restored


def test_a_stop_signal_during_a_write_to_the_log_is_said_after_it():
    """A write blocked on a full pipe runs pending signal handlers inside it: the stop's message,
    logged from there into the same stream, raised "reentrant call inside BufferedWriter" and was
    lost (a logging traceback instead). Here the stream runs the handler in the middle of a write,
    as that write would, and refuses a write into itself as the buffered writer does."""
    import io
    import logging

    stop = callbacks.GracefulStop()

    class Stream(io.StringIO):
        writing = False

        def write(self, text):
            if self.writing:
                raise RuntimeError("reentrant call inside <_io.BufferedWriter name=2>")
            self.writing = True
            try:
                if "step 2 waits" in text:
                    stop._handle(signal.SIGTERM, None)
                return super().write(text)
            finally:
                self.writing = False

    stream = Stream()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("sft_play.callbacks")
    logger.addHandler(handler)
    try:
        logger.warning("step 2 waits for a stop signal")
        for thread in threading.enumerate():
            if thread.name == "stop-message":
                thread.join(10)
    finally:
        logger.removeHandler(handler)
    assert stream.getvalue().splitlines() == [
        "step 2 waits for a stop signal",
        "received SIGTERM: finishing this step, saving a checkpoint, then stopping (send it again to stop at once)"]
    assert stop.received == "SIGTERM"


def test_nan_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
    class Poison(TrainerCallback):  # from the third step on, the adapters produce NaN
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if state.global_step == 2:
                for name, param in model.named_parameters():
                    if "lora_B" in name:
                        param.data.fill_(float("nan"))

    guard = callbacks.NonFiniteGuard(patience=2)
    make = build(tmp_path, [callbacks.CheckpointMarker(), guard, Poison()], "train.save_steps=1")
    trainer, _ = training.train_with_backoff(make, BatchSplit(8, 1, 1, 8))
    assert guard.stopped_at == 3 and guard.bad_steps == 2 and trainer.state.global_step == 4
    kept = checkpoints.checkpoints(tmp_path / "checkpoints")
    assert [p.name for p in kept] == ["checkpoint-1", "checkpoint-2"], "no checkpoint after the NaN"
    assert not (tmp_path / "checkpoints" / "README.md").exists()  # TRL's card of a model named "checkpoints"
    from safetensors.torch import load_file

    last = load_file(kept[-1] / "adapter_model.safetensors")
    assert all(torch.isfinite(t).all() for t in last.values())


def test_nan_guard_leaves_weights_alone_and_does_not_save(tmp_path):
    checkpoint_steps = []

    class Saves(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            checkpoint_steps.append(state.global_step)

    class Poison(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if state.global_step == 2:
                model.base_model.model.model.embed_tokens.weight.data[:, 0] = float("nan")

    guard = callbacks.NonFiniteGuard(patience=2)
    make = build(tmp_path, [guard, Poison(), Saves()])
    trainer, _ = training.train_with_backoff(make, BatchSplit(8, 1, 1, 8))
    lora = [p for n, p in trainer.model.named_parameters() if "lora_" in n]
    assert all(torch.isfinite(p).all() for p in lora), "skipped steps must not write NaN into the adapters"
    assert guard.stopped_at == 3 and checkpoint_steps == []


def test_checkpoint_markers_detect_half_written_folders(tmp_path):
    good = tmp_path / "checkpoints" / "checkpoint-2"
    good.mkdir(parents=True)
    (good / "adapter_model.safetensors").write_bytes(b"x" * 100)
    (good / "optimizer.pt").write_bytes(b"y" * 50)
    checkpoints.write_marker(good, 2)
    assert checkpoints.is_complete(good)
    newer = tmp_path / "checkpoints" / "checkpoint-4"
    shutil.copytree(good, newer)
    (newer / "optimizer.pt").write_bytes(b"y" * 10)  # truncated: the disk filled up
    no_marker = tmp_path / "checkpoints" / "checkpoint-6"
    no_marker.mkdir()
    (no_marker / "adapter_model.safetensors").write_bytes(b"x")  # killed while saving
    assert not checkpoints.is_complete(newer) and not checkpoints.is_complete(no_marker)
    assert checkpoints.newest_complete(tmp_path / "checkpoints") == good
    moved = checkpoints.set_aside_incomplete(tmp_path / "checkpoints")
    assert sorted(p.name for p in moved) == ["checkpoint-4", "checkpoint-6"]
    assert [p.name for p in checkpoints.checkpoints(tmp_path / "checkpoints")] == ["checkpoint-2"]
    assert (tmp_path / "incomplete-checkpoints" / "checkpoint-4" / "optimizer.pt").is_file()


def test_resume_from_a_half_written_checkpoint_is_refused(tmp_path):
    (tmp_path / "run" / "checkpoints" / "checkpoint-3").mkdir(parents=True)
    (tmp_path / "run" / "config.yaml").write_text("{}")
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        run_folder.resolve_resume(str(tmp_path / "run" / "checkpoints" / "checkpoint-3"), tmp_path, None, "run")
    run, checkpoint, message = run_folder.resolve_resume("auto", tmp_path / "nothing", None, "run_tiny")
    assert run is None and checkpoint is None
    assert "no run of 'run_tiny'" in message and "starting a fresh run" in message


def test_resume_with_other_settings_is_refused():
    saved = config_module.load(None, ["lora.r=8"], check_paths=False).to_dict()
    current = config_module.load(None, ["lora.r=16", "train.max_steps=99"], check_paths=False).to_dict()
    assert run_folder.differences(saved, current) == ["lora.r: 8 in the run, 16 now"]
    # how many processes tokenise is no setting of the run (a run saved before its default became auto resumes)
    older = {**saved, "data": {**saved["data"], "num_proc": None}}
    assert run_folder.differences(older, saved) == []


def test_rotation_keeps_the_newest_complete_checkpoints(tmp_path):
    run = tmp_path / "run"
    for step in (1, 2, 3, 4, 5):
        fake_checkpoint(run, step)
    torn = run / "checkpoints" / "checkpoint-6"
    torn.mkdir()  # being written: not counted, not deleted
    assert [p.name for p in checkpoints.rotate(run / "checkpoints", keep=2)] == ["checkpoint-1", "checkpoint-2",
                                                                                  "checkpoint-3"]
    assert [p.name for p in checkpoints.checkpoints(run / "checkpoints")] == ["checkpoint-4", "checkpoint-5",
                                                                              "checkpoint-6"]


def test_a_full_disk_is_refused_before_training(tmp_path, monkeypatch):
    from sft_play.planner import model_shape
    from sft_play.run import resolve

    config = config_module.load(None, ["train.save_steps=10", f"train.output_dir={tmp_path}"])
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(checks.shutil, "disk_usage", lambda _: usage._replace(free=1000))
    run = resolve(config, on_cuda=False, bf16_supported=False, world_size=1)
    with pytest.raises(UserError, match="not enough disk for this run: 0.0 GiB free, checkpoints need about"):
        checks.ensure_disk_room(config, tmp_path, model_shape(config), run)
    monkeypatch.setattr(checks.shutil, "disk_usage", lambda _: usage._replace(free=10**12))
    checks.ensure_disk_room(config, tmp_path, model_shape(config), run)
    small = checks.check_disk(config, 5 * 1024**2, tmp_path)  # the tiny model's checkpoints: MiB, not "0.00 GiB"
    assert small.ok and small.detail.endswith("checkpoints need about 5.0 MiB")


@pytest.mark.slow
def test_secrets_stay_out_of_logs_and_saved_files(tmp_path):
    secret = "hf_SECRETtoken1234567890"
    process = subprocess.run([sys.executable, "scripts/train_distributed.py", "--config", "configs/run_tiny.yaml",
                              "train.max_steps=2", "train.save_steps=2", f"train.output_dir={tmp_path}", *PINNED,
                              "train.run_name=secret"], cwd=REPO, capture_output=True, text=True,
                             env={**os.environ, **FORKED, "HF_TOKEN": secret, "HUGGING_FACE_HUB_TOKEN": secret},
                             timeout=600)
    assert process.returncode == 0, process.stderr[-3000:]
    assert secret not in process.stdout + process.stderr
    files = [path for path in (tmp_path / "secret").rglob("*") if path.is_file()]
    assert any(path.name == "adapter_model.safetensors" for path in files)
    for path in files:
        assert secret.encode() not in path.read_bytes(), path


# --- which checkpoint a resume trusts ---------------------------------------------------------


def fake_run(output_dir: Path, name: str, summary: dict | None = None, overrides: tuple[str, ...] = ()) -> Path:
    run = output_dir / name
    run.mkdir(parents=True, exist_ok=True)  # (a run chosen earlier in the test made and holds it)
    (run / "config.yaml").write_text(config_module.load(None, list(overrides), check_paths=False).to_yaml())
    if summary is not None:
        (run / "summary.json").write_text(json.dumps(summary))
    return run


def fake_checkpoint(run: Path, step: int, world_size: int = 1, strategy: str = "ddp",
                    saved_at: float | None = None) -> Path:
    folder = run / "checkpoints" / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "adapter_model.safetensors").write_bytes(os.urandom(256))
    for rank in range(world_size):  # a state a resume would load: torch's format, tensors and plain data
        torch.save({"python": rank, "cpu": torch.zeros(2)},
                   folder / (f"rng_state_{rank}.pth" if world_size > 1 else "rng_state.pth"))
    checkpoints.write_marker(folder, step, world_size, strategy)
    if saved_at is not None:
        os.utime(folder / checkpoints.MARKER, (saved_at, saved_at))
    return folder


INTERRUPTED, FINISHED = {"interrupted": "SIGTERM"}, {"global_step": 8}


def test_resume_auto_takes_the_newest_unfinished_run_with_a_checkpoint_and_says_why(tmp_path):
    now = time.time()
    older = fake_run(tmp_path, "run_tiny-20250101-000000", INTERRUPTED)
    fake_checkpoint(older, 6, saved_at=now - 400)
    stopped = fake_run(tmp_path, "run_tiny-20250101-000001", INTERRUPTED)
    fake_checkpoint(stopped, 4, saved_at=now - 300)
    finished = fake_run(tmp_path, "run_tiny-20250101-000002", FINISHED)  # newer, and complete: not resumable
    fake_checkpoint(finished, 8, saved_at=now - 200)
    fake_run(tmp_path, "run_tiny-20250101-000003")  # the newest: killed before any checkpoint
    fake_checkpoint(fake_run(tmp_path, "other-20250101-000004", INTERRUPTED), 2, saved_at=now)  # another config
    run, checkpoint, message = run_folder.resolve_resume("auto", tmp_path, None, "run_tiny")
    assert (run, checkpoint) == (stopped, stopped / "checkpoints" / "checkpoint-4")
    assert message == (f"resuming {stopped} from checkpoint-4: the newest unfinished run of 'run_tiny' with a "
                       "checkpoint (1 finished run(s) skipped; 1 unfinished run(s) without a checkpoint skipped)")


def test_resume_auto_says_why_there_is_nothing_to_resume(tmp_path):
    for index in range(3):  # killed or crashed with train.save_steps 0: no checkpoint
        fake_run(tmp_path / "bare", f"run_tiny-2025010{index}-000000")
    run, _, message = run_folder.resolve_resume("auto", tmp_path / "bare", None, "run_tiny", save_steps=0)
    assert run is None
    assert "none of the 3 unfinished run(s) of 'run_tiny'" in message and "has a checkpoint" in message
    assert "train.save_steps is 0" in message and 'ARGS="train.save_steps=100"' in message
    for index in range(2):
        fake_run(tmp_path / "done", f"run_tiny-2025010{index}-000000", FINISHED)
    _, _, message = run_folder.resolve_resume("auto", tmp_path / "done", None, "run_tiny")
    assert "all 2 run(s) of 'run_tiny'" in message and "finished; nothing to resume" in message
    _, _, message = run_folder.resolve_resume("auto", tmp_path / "done", "slurm-run", "run_tiny")
    assert message.startswith("train.resume_from=auto: no run named 'slurm-run'") and message.endswith("starting it")
    named = fake_run(tmp_path / "done", "slurm-run", FINISHED)
    fake_checkpoint(named, 8)
    with pytest.raises(ValueError, match="finished .*nothing to resume. Choose another train.run_name"):
        run_folder.resolve_resume("auto", tmp_path / "done", "slurm-run", "run_tiny")


def test_resume_is_refused_with_other_processes_or_another_strategy(tmp_path):
    named = ["train.resume_from=auto", "train.run_name=r", f"train.output_dir={tmp_path}"]
    run = fake_run(tmp_path, "r", INTERRUPTED, tuple(named))
    checkpoint = fake_checkpoint(run, 2, world_size=2, strategy="ddp")
    config = config_module.load(None, named, check_paths=False)
    assert run_folder.choose_run_folder(config, "configs/run_tiny.yaml", world_size=2)[:2] == ("r", str(checkpoint))
    with pytest.raises(ValueError, match=r"(?s)cannot resume .* processes: 2 wrote it, 1 now"):
        run_folder.choose_run_folder(config, "configs/run_tiny.yaml", world_size=1)
    deepspeed = config_module.load(None, [*named, "distributed.strategy=deepspeed_zero2"], check_paths=False)
    with pytest.raises(ValueError, match="distributed.strategy: 'ddp' wrote it, 'deepspeed_zero2' now"):
        run_folder.choose_run_folder(deepspeed, "configs/run_tiny.yaml", world_size=2)


def test_auto_resume_takes_only_this_configs_runs(tmp_path):
    """exp.yaml's RESUME=auto continued exp-lowlr.yaml's run: 'exp-*' matched its folder too."""
    other = fake_run(tmp_path, "exp-lowlr-20261126-095931", INTERRUPTED)
    fake_checkpoint(other, 41)
    assert run_folder.find_resume_run(tmp_path, None, "exp")[0] is None
    own = fake_run(tmp_path, "exp-20261126-090000", INTERRUPTED)
    fake_checkpoint(own, 7, saved_at=1.0)  # older than the other config's: still the only one of exp
    assert run_folder.find_resume_run(tmp_path, None, "exp")[0] == own
    assert run_folder.find_resume_run(tmp_path, None, "exp-lowlr")[0] == other


def test_resume_refuses_a_new_learning_rate_the_checkpoint_would_override(tmp_path):
    """The checkpoint's scheduler brings back the old learning rate and schedule: a resume with
    another one trained at the old rate while config.yaml said the new one. Length, logging and
    saving, and the split of the same global batch may change."""
    named = ["train.resume_from=auto", "train.run_name=r", f"train.output_dir={tmp_path}"]
    run = fake_run(tmp_path, "r", INTERRUPTED, tuple(named))
    fake_checkpoint(run, 2)
    for change in ("train.learning_rate=1e-5", "train.lr_scheduler=linear", "train.warmup_ratio=0.1",
                   "train.weight_decay=0.1", "train.optimizer=adamw_8bit", "train.neftune_noise_alpha=5"):
        key = change.split("=")[0]
        with pytest.raises(ValueError, match=rf"(?s)cannot resume .*{key}: .* in the run, .* now"):
            run_folder.choose_run_folder(config_module.load(None, [*named, change], check_paths=False),
                                          "configs/run_tiny.yaml")
    allowed = config_module.load(None, [*named, "train.max_steps=900", "train.save_steps=50", "train.logging_steps=5",
                                        "train.max_grad_norm=0.5",
                                        "train.micro_batch_size=2", "train.gradient_checkpointing=true"],
                                 check_paths=False)
    assert run_folder.choose_run_folder(allowed, "configs/run_tiny.yaml")[0] == "r"


def test_resume_warns_when_the_data_changed_since_the_run_started(tmp_path):
    named = ["train.resume_from=auto", "train.run_name=r", f"train.output_dir={tmp_path}"]
    run = fake_run(tmp_path, "r", INTERRUPTED, tuple(named))
    fake_checkpoint(run, 2)
    data = {"examples": 282, "tokens": 9000, "loss_tokens": 3000, "rows": 40}
    (run / "run.json").write_text(json.dumps({"data": data}))
    config = config_module.load(None, named, check_paths=False)
    assert "warning" not in run_folder.choose_run_folder(config, "configs/run_tiny.yaml", data=data)[2]
    grown = {**data, "examples": 374, "tokens": 12000}
    message = run_folder.choose_run_folder(config, "configs/run_tiny.yaml", data=grown)[2]
    assert "warning: the training data changed since r started (examples 282 -> 374, tokens 9000 -> 12000)" in message
    # a second resume still compares with the first start (run.json is rewritten at each start)
    run_folder.write_run(run, SimpleNamespace(to_dict=dict), grown)
    assert json.loads((run / "run.json").read_text())["data_at_start"] == data
    assert "examples 282 -> 374" in run_folder.choose_run_folder(config, "configs/run_tiny.yaml", data=grown)[2]


def test_a_new_run_never_goes_into_a_folder_that_holds_a_run(tmp_path):
    # A user reusing a run name overwrote a finished 200-step model with a 2-step one
    fresh = ["train.run_name=r", f"train.output_dir={tmp_path}"]
    config = config_module.load(None, fresh, check_paths=False)
    assert run_folder.choose_run_folder(config, "configs/run_tiny.yaml")[:2] == ("r", None)  # nothing there yet
    run = fake_run(tmp_path, "r", INTERRUPTED, tuple(fresh))
    fake_checkpoint(run, 2)
    with pytest.raises(ValueError, match=r"holds an unfinished run \(last checkpoint checkpoint-2\).*RESUME=auto"):
        run_folder.choose_run_folder(config, "configs/run_tiny.yaml")
    fake_run(tmp_path, "done", FINISHED)
    finished = config_module.load(None, ["train.run_name=done", f"train.output_dir={tmp_path}"], check_paths=False)
    with pytest.raises(ValueError, match="holds a finished run .*choose another train.run_name"):
        run_folder.choose_run_folder(finished, "configs/run_tiny.yaml")
    assert (tmp_path / "done" / "summary.json").is_file()  # untouched


def test_a_checkpoint_damaged_in_place_is_set_aside_for_the_previous_one(tmp_path):
    run = fake_run(tmp_path, "run_tiny-20250101-000000", INTERRUPTED)
    previous = fake_checkpoint(run, 2)
    damaged = fake_checkpoint(run, 4)
    weights = damaged / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[100] ^= 0xFF  # same size: a size check cannot see it
    weights.write_bytes(bytes(data))
    assert checkpoints.is_complete(damaged) and not checkpoints.is_complete(damaged, verify=True)
    with pytest.raises(ValueError, match="does not match the digests recorded when it was saved"):
        run_folder.resolve_resume(str(damaged), tmp_path, None, "run_tiny")
    resumed_run, checkpoint, _ = run_folder.resolve_resume("auto", tmp_path, None, "run_tiny")
    assert (resumed_run, checkpoint) == (run, previous)
    assert (run / "incomplete-checkpoints" / "checkpoint-4" / "adapter_model.safetensors").read_bytes() == bytes(data)


def test_an_output_folder_that_is_not_shared_is_told_apart(tmp_path):
    token = run_folder.mark_shared(tmp_path / "node0")  # rank 0's folder
    assert run_folder.sees_shared_mark(tmp_path / "node0", token, wait_s=0)
    started = time.monotonic()
    assert not run_folder.sees_shared_mark(tmp_path / "node1", token, wait_s=0.6)  # another node's own disk
    assert time.monotonic() - started >= 0.6, "a late network filesystem gets its time"
    run_folder.unmark_shared(tmp_path / "node0", token)
    assert list((tmp_path / "node0").iterdir()) == []
    message = run_folder.unshared_message(tmp_path / "node0", ["gpu-b"])
    assert "is not shared: the processes on gpu-b cannot see" in message and "filesystem every node mounts" in message


def test_a_payload_swapped_with_its_digests_is_never_loaded(tmp_path):
    """Digests catch damage, not a payload swapped in with the marker's digests rewritten to match:
    DeepSpeed unpickles its partitions with weights_only=False, torch.distributed.checkpoint its
    index with pickle.load. A file that would run code is refused before anything loads it."""
    import pickle

    run = fake_run(tmp_path, "run_tiny-20250101-000000", INTERRUPTED)
    fake_checkpoint(run, 2)
    planted = fake_checkpoint(run, 4)
    marker = tmp_path / "pwned"

    class Planted:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    (planted / "global_step4").mkdir()
    torch.save({"state": Planted()}, planted / "global_step4" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    checkpoints.write_marker(planted, 4)  # the digests rewritten with it
    assert checkpoints.is_complete(planted, verify=True)
    assert checkpoints.code_it_would_run(planted) == {
        "global_step4/zero_pp_rank_0_mp_rank_00_optim_states.pt": ["posix.system"]}
    with pytest.raises(ValueError, match=r"optim_states.pt would run posix.system when loaded: not something"):
        run_folder.resolve_resume(str(planted), tmp_path, "run_tiny-20250101-000000", "run_tiny", 2)
    index = fake_checkpoint(run, 6)  # an FSDP2 state's index, read with pickle.load
    (index / "optimizer_0").mkdir()
    (index / "optimizer_0" / ".metadata").write_bytes(pickle.dumps({"planned": Planted()}))
    checkpoints.write_marker(index, 6)
    assert checkpoints.code_it_would_run(index) == {"optimizer_0/.metadata": ["posix.system"]}
    linked = fake_checkpoint(run, 8)  # a planted state behind a link, or named by DeepSpeed's `latest`
    (linked / "global_step8").symlink_to(planted / "global_step4")
    assert checkpoints.code_it_would_run(linked) == {"global_step8": [f"a symbolic link to {planted / 'global_step4'}"]}
    (linked / "global_step8").unlink()
    (linked / "latest").write_text("../checkpoint-4/global_step4")
    assert "latest" in checkpoints.code_it_would_run(linked)
    assert checkpoints.newest_intact(run / "checkpoints").name == "checkpoint-2"  # all set aside, never loaded
    assert sorted(p.name for p in (run / "incomplete-checkpoints").iterdir()) == ["checkpoint-4", "checkpoint-6",
                                                                                  "checkpoint-8"]
    assert not marker.exists()


def test_markers_cover_every_ranks_files_and_older_markers_still_count(tmp_path):
    folder = fake_checkpoint(tmp_path / "run", 2, world_size=2)
    assert checkpoints.written_by(folder) == (2, "ddp") and not checkpoints.missing_rank_files(folder, 2)
    (folder / "rng_state_1.pth").unlink()  # rank 1 did not finish, or wrote elsewhere
    assert checkpoints.missing_rank_files(folder, 2) == ["rng_state_1.pth"] and not checkpoints.is_complete(folder)
    old = tmp_path / "old" / "checkpoints" / "checkpoint-3"  # a marker from before digests: sizes only
    old.mkdir(parents=True)
    (old / "rng_state_0.pth").write_bytes(b"a")
    (old / "rng_state_1.pth").write_bytes(b"b")
    sizes_only = {"step": 3, "files": {"rng_state_0.pth": 1, "rng_state_1.pth": 1}}
    (old / checkpoints.MARKER).write_text(json.dumps(sizes_only))
    assert checkpoints.is_complete(old, verify=True) and checkpoints.written_by(old) == (2, None)


def test_the_old_checkpoint_is_deleted_only_after_the_new_one_is_marked(tmp_path):
    class DiesBeforeTheMarker(TrainerCallback):  # runs before CheckpointMarker: as if killed there
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == 4:
                raise RuntimeError("killed")

    make = build(tmp_path, [DiesBeforeTheMarker(), callbacks.CheckpointMarker(keep=1)], "train.save_steps=2",
                 "train.save_total_limit=1")
    with pytest.raises(RuntimeError, match="killed"):
        training.train_with_backoff(make, BatchSplit(8, 1, 1, 8))
    folder = tmp_path / "checkpoints"
    assert checkpoints.is_complete(folder / "checkpoint-2"), "the only complete checkpoint was rotated away"
    assert (folder / "checkpoint-4").is_dir() and not checkpoints.is_complete(folder / "checkpoint-4")
    assert checkpoints.newest_intact(folder) == folder / "checkpoint-2"
    assert checkpoints.rotate(folder, keep=1) == []


def test_a_signal_delivered_twice_is_one_stop_request(monkeypatch):
    monkeypatch.setattr(callbacks.stops, "DUPLICATE_SIGNAL_WINDOW_S", 0.3)
    stop = callbacks.GracefulStop()
    stop.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # from the cluster
        os.kill(os.getpid(), signal.SIGTERM)  # and passed on by the launcher
        assert stop.received == "SIGTERM"
        time.sleep(0.4)
        with pytest.raises(KeyboardInterrupt):  # a real second request: stop at once
            os.kill(os.getpid(), signal.SIGTERM)
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


@pytest.mark.slow
def test_a_rank_killed_while_saving_leaves_the_previous_checkpoint_to_resume(tmp_path):
    """Two processes, save_total_limit 1: checkpoint 2 is deleted once checkpoint 4 is marked.
    At checkpoint 6, rank 1 is killed as soon as it has written its part, while rank 0 may still
    be writing its own and before the ranks agree the checkpoint is whole: checkpoint 4 must
    stay (the trainer's own rotation used to delete it before that point)."""
    result = subprocess.run(
        [sys.executable, "scripts/launch.py", "--launcher", "accelerate", "--cpu", "--num-gpus", "2",
         "--config", "configs/run_tiny.yaml", "train.max_steps=6", "train.logging_steps=1", "train.save_steps=2",
         "train.save_total_limit=1", f"train.output_dir={tmp_path}", "train.run_name=killed", *PINNED],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        env={**os.environ, **FORKED, "SFT_PLAY_FAULTS": "kill_before_marker=6:1"},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-4000:]
    assert "error: training failed: rank 1 killed by SIGKILL first" in output
    assert "[rank 0] error: lost contact with another process of this run" in output
    assert "Traceback" not in output, output[-4000:]
    folder = tmp_path / "killed" / "checkpoints"
    assert [p.name for p in checkpoints.checkpoints(folder)] == ["checkpoint-4", "checkpoint-6"]
    assert checkpoints.is_complete(folder / "checkpoint-4", verify=True)
    assert (folder / "checkpoint-6").is_dir() and not checkpoints.is_complete(folder / "checkpoint-6")
    run, checkpoint, message = run_folder.resolve_resume("auto", tmp_path, "killed", "run_tiny")
    assert checkpoint == folder / "checkpoint-4" and message.startswith(f"resuming {run} from checkpoint-4")
    assert (tmp_path / "killed" / "incomplete-checkpoints" / "checkpoint-6").is_dir()


def test_a_streamed_run_resumes_at_the_row_it_stopped_and_ends_like_an_uninterrupted_one(tmp_path):
    """``data.streaming``: the trainer reads the stream as it trains; stopped at step 2 and resumed,
    it skips the rows already trained (not reading the stream again from its start), so its weights
    end as those of the run that was never stopped."""
    class Interrupt(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1:  # (the step under way finishes: stopped at 2)
                os.kill(os.getpid(), signal.SIGINT)

    streamed = ("data.streaming=true", "data.sample_rows=300", "data.validation_path=null", "train.max_steps=4")
    whole, _ = training.train_with_backoff(build(tmp_path / "whole", [], *streamed), BatchSplit(8, 1, 1, 8))
    assert whole.state.global_step == 4

    stop = callbacks.GracefulStop()
    first, _ = training.train_with_backoff(
        build(tmp_path / "stopped", [callbacks.CheckpointMarker(), stop, Interrupt()], *streamed), BatchSplit(8, 1, 1, 8))
    stop.restore()
    assert first.state.global_step == 2
    checkpoint = tmp_path / "stopped" / "checkpoints" / "checkpoint-2"
    resumed, _ = training.train_with_backoff(build(tmp_path / "stopped", [], *streamed), BatchSplit(8, 1, 1, 8),
                                             resume_from_checkpoint=str(checkpoint))
    assert resumed.state.global_step == 4
    ours = {k: v for k, v in resumed.model.state_dict().items() if "lora" in k}
    theirs = {k: v for k, v in whole.model.state_dict().items() if "lora" in k}
    assert ours and all(torch.equal(ours[k], theirs[k]) for k in theirs)
