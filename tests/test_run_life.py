"""The edges of a run's life: the final save is as safe as a checkpoint, one process writes a run
folder, runs started together get folders of their own, a closed terminal stops a run as a stop
signal does, and a training process never outlives the launcher that started it."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from sft_play import callbacks, checkpoints, run_folder
from sft_play import config as config_module
from tests.conftest import FORKED, PINNED, with_forks

REPO = Path(__file__).resolve().parents[1]
COMMON = ["train.max_steps=2", "train.logging_steps=1", "train.tensorboard=false", *PINNED]
# What a rank's own process does when its launcher ends is what some tests here check: their ranks
# start as the launcher starts them, not forked from the suite's zygote (tests/shim/sitecustomize.py)
OWN_RANKS = {"SFT_PLAY_TESTS_FRESH": "1"}


def train(tmp_path: Path, *overrides: str, faults: str = "", on_line=None) -> tuple[int, str]:
    """Run the training entry to its end; `on_line(process, line)` sees each line as it comes."""
    env = {**os.environ, **FORKED, **({"SFT_PLAY_FAULTS": faults} if faults else {})}
    process = subprocess.Popen([sys.executable, "scripts/train_distributed.py", "--config", "configs/run_tiny.yaml",
                                *COMMON, f"train.output_dir={tmp_path}", "train.run_name=r", *overrides],
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    seen: list[str] = []
    for line in process.stdout:
        seen.append(line)
        if on_line is not None:
            on_line(process, line)
    return process.wait(timeout=600), "".join(seen)


@pytest.mark.slow
def test_a_stop_during_the_final_save_lets_it_finish(tmp_path):
    def stop_in_the_save(process, line):
        if "fault injection (hold_final_save)" in line:
            process.send_signal(signal.SIGTERM)

    status, output = train(tmp_path, faults="hold_final_save=1", on_line=stop_in_the_save)
    run = tmp_path / "r"
    assert status == 0, output[-3000:]  # the run is complete: nothing to resume
    assert "came during the final save, which finished first" in output
    assert list((run / "model").glob("*.safetensors")) and not (run / "model.partial").exists()
    assert run_folder.is_finished(run) and run_folder.finished_runs(tmp_path) == [run]


@pytest.mark.slow
def test_a_kill_during_the_final_save_leaves_no_finished_run_and_resuming_only_saves(tmp_path):
    status, output = train(tmp_path, "train.save_steps=2", faults="kill_in_final_save=1")
    run = tmp_path / "r"
    assert status == -signal.SIGKILL, output[-3000:]
    assert (run / "model.partial").is_dir() and not (run / "model").exists()
    assert run_folder.finished_runs(tmp_path) == []  # make generate cannot pick a torn model
    with pytest.raises(FileNotFoundError, match="no finished run"):
        run_folder.resolve_run(None, tmp_path)
    # named, it is said to be unfinished, and how to finish it
    with pytest.raises(FileNotFoundError, match=r"did not finish \(it has no model/, only checkpoints/\).*RESUME=auto"):
        run_folder.resolve_run(str(run), tmp_path)
    measured = (run / "memory_check.json").read_text()
    trained_s, segments = checkpoints.time_before(run / "checkpoints" / "checkpoint-2")
    assert trained_s > 0 and segments == 1

    # resumed by the checkpoint's path with train.output_dir elsewhere (which locked the checkpoint's
    # run folder but wrote a new one under output_dir): it continues in its own run folder
    elsewhere = tmp_path / "elsewhere"
    status, output = train(elsewhere, "train.save_steps=2", f"train.resume_from={run / 'checkpoints' / 'checkpoint-2'}")
    assert status == 0, output[-3000:]
    assert f"resuming {run} from checkpoint-2" in output
    assert not elsewhere.exists() or not any(elsewhere.iterdir()), "nothing written under the other output_dir"
    assert config_module.load(run / "config.yaml", check_paths=False).train.output_dir == str(tmp_path)
    assert "resumed at step 2, the run's last: nothing left to train, only the final save" in output
    summary = json.loads((run / "summary.json").read_text())
    assert summary["global_step"] == 2 and [step for step, _ in summary["losses"]] == [1, 2]  # no step 3 of 2
    assert list((run / "model").glob("*.safetensors")) and not (run / "model.partial").exists()
    # the training time is the killed segment's, carried by its checkpoint; the memory check is
    # still the one that trained, not one of loading alone
    assert summary["segments"] == 2 and summary["train_runtime_s"] > trained_s
    assert (run / "memory_check.json").read_text() == measured


def _holder(folder: Path) -> subprocess.Popen:
    """Another process that holds `folder`'s lock until it is killed."""
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from sft_play import run_folder
        run_folder.hold(Path({str(folder)!r}))
        print("held", flush=True)
        time.sleep(600)
    """)
    process = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "held"
    return process


def test_one_process_writes_a_run_folder_and_the_lock_dies_with_it(tmp_path):
    run = tmp_path / "r"
    run.mkdir()  # a live run: no model/ yet
    holder = _holder(run)
    try:
        assert run_folder.in_use(run) == f"pid {holder.pid} on {os.uname().nodename}"
        with pytest.raises(run_folder.RunInUse, match=f"in use by another process \\(pid {holder.pid}"):
            run_folder.hold(run)
        with pytest.raises(run_folder.RunInUse, match=f"is still being written \\(pid {holder.pid}"):  # make eval RUN=
            run_folder.resolve_run(str(run), tmp_path)
    finally:
        holder.kill()
        holder.wait()
    assert run_folder.in_use(run) is None  # released by the kernel with the process
    run_folder.hold(run)
    run_folder.hold(run)  # again in the same process: it already holds it


@pytest.mark.slow
def test_a_lock_held_from_another_host_is_waited_for_as_a_crashed_nodes_lease_runs_out(tmp_path, monkeypatch,
                                                                                      caplog):
    """On NFS a crashed node's lock outlives it until the file server's lease for it ends: a
    requeued RESUME=auto was refused at once, naming a process that no longer existed."""
    run = tmp_path / "r"
    script = textwrap.dedent(f"""
        import os, sys, time
        from pathlib import Path
        from sft_play import run_folder
        run = Path({str(run)!r})
        run_folder.hold(run)
        os.pwrite(os.open(run / run_folder.LOCK, os.O_WRONLY), b"pid 4242 on node-that-crashed\\n", 0)
        print("held", flush=True)
        time.sleep(float(sys.argv[1]))
    """)

    def holder(seconds: float) -> subprocess.Popen:
        process = subprocess.Popen([sys.executable, "-c", script, str(seconds)], cwd=REPO, stdout=subprocess.PIPE,
                                   text=True)
        assert process.stdout.readline().strip() == "held"
        return process

    monkeypatch.setattr(run_folder, "OTHER_HOST_WAIT_S", 60.0)
    lease = holder(3)
    started = time.monotonic()
    run_folder.hold(run)  # the lease ran out: taken
    assert time.monotonic() - started > 1 and lease.wait(timeout=30) == 0
    assert "locked by pid 4242 on node-that-crashed, another host: waiting up to 60 s" in caplog.text
    os.close(run_folder._HELD.pop(str(run.resolve())))  # this process lets its lock go, for the second case
    monkeypatch.setattr(run_folder, "OTHER_HOST_WAIT_S", 1.0)
    alive = holder(600)
    try:
        with pytest.raises(run_folder.RunInUse, match="in use by another process \\(pid 4242 on node-that-crashed\\)"):
            run_folder.hold(run)
    finally:
        alive.kill()
        alive.wait()


@pytest.mark.slow
def test_resume_auto_is_refused_while_another_make_trains_the_run(tmp_path):
    """Two real `make train` on one run folder: the second (RESUME=auto, what a refused duplicate
    name advises) trained into the same folder at the same time."""
    run = tmp_path / "r"
    args = f"ARGS=train.run_name=r train.output_dir={tmp_path} train.max_steps=3 train.save_steps=1 {' '.join(PINNED)}"
    # (each training process forked from the suite's zygote: the first's lock is held by its fork)
    first = subprocess.Popen(["make", "--no-print-directory", "train", args], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, **FORKED, "SFT_PLAY_FAULTS": "hold_step=1"})
    try:
        seen = []
        for line in first.stdout:  # step 1 waits for a stop signal, holding the run
            seen.append(line)
            if "fault injection (hold_step)" in line:
                break
        stand_in = next(p for p in psutil.Process(first.pid).children(recursive=True)
                        if "train_distributed.py" in " ".join(p.cmdline()))
        found = with_forks([stand_in])
        trainer = found[1] if len(found) > 1 else stand_in  # its fork, or itself where none was forked
        second = subprocess.run(["make", "--no-print-directory", "train", "RESUME=auto", args], cwd=REPO,
                                capture_output=True, text=True, timeout=600, env={**os.environ, **FORKED})
        trainer.send_signal(signal.SIGTERM)
        rest = first.communicate(timeout=600)[0]
    finally:
        if first.poll() is None:
            first.kill()
    assert second.returncode == 2, second.stderr[-3000:]
    assert f"{run} is in use by another process (pid {trainer.pid} on {os.uname().nodename})" in second.stderr
    assert "Traceback" not in second.stderr
    assert first.returncode == 2 and "Error 75" in rest, "".join(seen)[-2000:] + rest[-2000:]  # make says 75
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["checkpoint-1"], "only the first one wrote"


@pytest.mark.slow
def test_the_ranks_of_a_real_launch_end_when_makes_process_group_is_killed(tmp_path):
    """SIGKILL to make's process group during `make train-distributed CPU=1 NUM_GPUS=2`: the ranks
    were re-parented to PID 1 and trained on to the end. Now each gets the launcher's end as a stop
    request, saves the step it is in, and exits."""
    args = f"ARGS=train.run_name=r train.output_dir={tmp_path} train.max_steps=4 train.save_steps=0 {' '.join(PINNED)}"
    command = ["make", "--no-print-directory", "train-distributed", "CPU=1", "NUM_GPUS=2", args]
    make = subprocess.Popen(command,
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "SFT_PLAY_FAULTS": "hold_step=1", **OWN_RANKS})
    seen = []
    for line in make.stdout:
        seen.append(line)
        if "fault injection (hold_step)" in line:
            break
    ranks = [p for p in psutil.Process(make.pid).children(recursive=True)
             if "train_distributed.py" in " ".join(p.cmdline())]
    assert len(ranks) == 2, "".join(seen)[-3000:]
    os.killpg(make.pid, signal.SIGKILL)
    make.wait()
    gone, alive = psutil.wait_procs(ranks, timeout=180)
    for survivor in alive:
        survivor.kill()
    assert not alive, f"ranks outlived their launcher: {[p.pid for p in alive]}"
    checkpoint = tmp_path / "r" / "checkpoints" / "checkpoint-1"
    assert checkpoints.is_complete(checkpoint, verify=True), "the step they were in was saved"
    assert not run_folder.is_finished(tmp_path / "r")
    # with make gone, the ranks could no longer find it above them: each printed its own python line,
    # which a resume refused (2 processes wrote the checkpoint, 1 would read it)
    said = make.stdout.read()
    resumes = re.findall(r"^  resume: (.+)$", said, re.M)
    assert resumes and all(shlex.split(line) == [*command, "RESUME=auto"] for line in resumes), said[-3000:]


def test_runs_started_in_the_same_second_get_folders_of_their_own(tmp_path, monkeypatch):
    monkeypatch.setattr(run_folder, "_timestamp", lambda: "20261127-120000")
    from sft_play import config as config_module

    config = config_module.load(None, [f"train.output_dir={tmp_path}"], check_paths=False)
    names = [run_folder.choose_run_folder(config, "configs/exp.yaml")[0] for _ in range(3)]
    assert names == ["exp-20261127-120000", "exp-20261127-120000-2", "exp-20261127-120000-3"]
    assert all(run_folder.in_use(tmp_path / name) is None for name in names)  # held by this process


def test_an_output_dir_that_cannot_hold_runs_is_one_clear_error(tmp_path):
    from sft_play import config as config_module

    (tmp_path / "file").write_text("")
    config = config_module.load(None, [f"train.output_dir={tmp_path / 'file'}"], check_paths=False)
    with pytest.raises(ValueError, match="is a file, not a folder"):
        run_folder.choose_run_folder(config, "configs/exp.yaml")


def test_the_launchers_end_is_a_stop_request_that_never_aborts_a_save(monkeypatch):
    from sft_play import stopping

    monkeypatch.setattr(callbacks.stops, "DUPLICATE_SIGNAL_WINDOW_S", 0.05)
    stop = callbacks.GracefulStop()
    stop.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # a stop the launcher passed on
        time.sleep(0.2)
        os.kill(os.getpid(), stopping.LAUNCHER_GONE)  # then the launcher was killed: no KeyboardInterrupt
        time.sleep(0.1)
    finally:
        stop.restore()
    assert stop.received == "SIGTERM"


def test_a_closed_terminal_is_a_stop_request(monkeypatch):
    stop = callbacks.GracefulStop()
    stop.install()
    try:
        os.kill(os.getpid(), signal.SIGHUP)  # the terminal or ssh session went away
        deadline = time.monotonic() + 5
        while stop.received is None and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.on_train_end(None, None, None)
    assert stop.received == "SIGHUP"


def test_a_training_process_ends_when_its_launcher_does(tmp_path):
    """What a rank does first under a launcher (scripts/train_distributed.py): the kernel sends it
    stopping.LAUNCHER_GONE when the launcher ends, here killed outright; training takes it as a stop
    request that a second signal never turns into an abort."""
    marker = tmp_path / "got-sigterm"
    child = textwrap.dedent(f"""
        import signal, sys, time
        from pathlib import Path
        from sft_play import stopping
        signal.signal(stopping.LAUNCHER_GONE, lambda *_: (Path({str(marker)!r}).write_text("stopped"), sys.exit(75)))
        stopping.die_with_parent()
        print("ready", flush=True)
        time.sleep(600)
    """)
    launcher = textwrap.dedent(f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", {child!r}], stdout=subprocess.PIPE, text=True)
        print(child.pid, child.stdout.readline().strip(), flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", launcher], cwd=REPO, stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    pid, ready = parent.stdout.readline().split()
    assert ready == "ready"
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 30
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.read_text() == "stopped"
    with pytest.raises(ProcessLookupError):
        for _ in range(100):  # gone soon after (reaped by init)
            os.kill(int(pid), 0)
            time.sleep(0.05)


def test_a_marker_that_is_not_ours_makes_its_checkpoint_incomplete(tmp_path):
    from sft_play import checkpoints

    checkpoint = tmp_path / "checkpoints" / "checkpoint-2"
    checkpoint.mkdir(parents=True)
    (checkpoint / "rng_state.pth").write_bytes(b"rng")
    checkpoints.write_marker(checkpoint, 2)
    assert checkpoints.is_complete(checkpoint, verify=True)
    for entry in ("3", {"size": "3"}, {"size": 3, "sha256": 7}, True):
        (checkpoint / checkpoints.MARKER).write_text(json.dumps({"step": 2, "files": {"rng_state.pth": entry}}))
        assert not checkpoints.is_complete(checkpoint, verify=True), entry
    assert checkpoints.newest_intact(tmp_path / "checkpoints") is None  # set aside, never loaded
    assert (tmp_path / "incomplete-checkpoints" / "checkpoint-2").is_dir()


def test_a_model_folder_with_pickled_weights_only_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    import runpy

    (tmp_path / "config.json").write_text((REPO / "configs" / "tiny_model" / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((REPO / "configs" / "tiny_model" / name).read_text())
    monkeypatch.setattr(sys, "argv", ["generate.py", "--run", str(tmp_path), "--prompt", "hi"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(REPO / "scripts" / "generate.py"), run_name="__main__")
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert "has no safetensors weights (only pytorch_model.bin: pickled files" in err


@pytest.mark.slow
def test_a_closed_stdout_never_ends_a_run(tmp_path):
    """`make train | tee log`, and Ctrl-C ends tee first: what training writes next meets a closed
    pipe (a BrokenPipeError ended the run there, without its model)."""
    process = subprocess.Popen([sys.executable, "scripts/train_distributed.py", "--config", "configs/run_tiny.yaml",
                                *COMMON, f"train.output_dir={tmp_path}", "train.run_name=r"],
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, **FORKED})
    process.stdout.readline()
    process.stdout.close()  # the reader goes away
    assert process.wait(timeout=600) == 0
    assert run_folder.is_finished(tmp_path / "r") and list((tmp_path / "r" / "model").glob("*.safetensors"))


def test_resume_auto_starts_a_named_run_without_a_checkpoint_again_in_its_folder(tmp_path):
    """What a SLURM requeue does after a job stopped before its first checkpoint."""
    from sft_play import config as config_module

    named = ["train.run_name=r", f"train.output_dir={tmp_path}", "train.resume_from=auto"]
    config = config_module.load(None, named, check_paths=False)
    (tmp_path / "r" / "model.partial").mkdir(parents=True)  # a final save cut short, with save_steps 0
    (tmp_path / "r" / "config.yaml").write_text(config.to_yaml())
    name, checkpoint, message = run_folder.choose_run_folder(config, "configs/run_tiny.yaml")
    assert (name, checkpoint) == ("r", None) and "starting it again from step 0" in message
    assert not (tmp_path / "r" / "model.partial").exists()


def test_default_run_names_are_safe_whatever_the_config_file_is_called(tmp_path, monkeypatch):
    from sft_play import config as config_module

    monkeypatch.setattr(run_folder, "_timestamp", lambda: "20261127-120000")
    config = config_module.load(None, [f"train.output_dir={tmp_path}"], check_paths=False)
    name = run_folder.choose_run_folder(config, "configs/exp+lora v2.yaml")[0]
    assert name == "exp-lora-v2-20261127-120000"
    config.train.run_name = name  # what config.yaml then says: it loads again
    config_module.load(None, [f"train.run_name={name}"], check_paths=False)


def test_a_start_refused_before_writing_leaves_no_folder(tmp_path):
    from sft_play import config as config_module

    config = config_module.load(None, [f"train.output_dir={tmp_path}"], check_paths=False)
    name = run_folder.choose_run_folder(config, "configs/exp.yaml")[0]
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "config.yaml").write_text("")
    run_folder.discard_if_empty(tmp_path / name)  # what a refusal for disk room does
    run_folder.discard_if_empty(tmp_path / "kept")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]


@pytest.mark.slow
@pytest.mark.parametrize("save_steps", [1, 0], ids=["checkpoint", "final_model"])
def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_checkpoints_written(tmp_path, save_steps):
    """A save that the filesystem refuses part-way (here: files may not grow past 64 KiB from step
    2 on, as on a full disk) ended in a SafetensorError traceback."""
    status, output = train(tmp_path, f"train.save_steps={save_steps}", "finetune.method=full", faults="full_disk=2")
    run = tmp_path / "r"
    assert status == 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "File too large" in errors[0], output[-3000:]
    if save_steps:
        assert errors[0].startswith(f"error: could not write a checkpoint into {run / 'checkpoints'}")
        assert "the checkpoints already written are kept (newest checkpoint-1)" in errors[0]
        assert checkpoints.newest_intact(run / "checkpoints").name == "checkpoint-1"
        assert not checkpoints.is_complete(run / "checkpoints" / "checkpoint-2")
    else:
        assert errors[0].startswith(f"error: could not write the final model into {run / 'model.partial'}")
        assert not (run / "model.partial").exists() and not (run / "model").exists()
    assert not run_folder.is_finished(run)


@pytest.mark.slow
def test_a_checkpoints_folder_made_immutable_mid_run_is_one_line_and_resumes_once_writable(tmp_path):
    run = tmp_path / "r"
    held = []

    def freeze(process, line):
        if "fault injection (slow_step)" in line:
            held.append(subprocess.run(["chattr", "+i", str(run / "checkpoints")], capture_output=True, text=True))

    try:
        status, output = train(tmp_path, "train.save_steps=1", faults="slow_step=2:4", on_line=freeze)
        if held and held[0].returncode != 0:
            pytest.skip(f"chattr +i is not allowed here: {held[0].stderr.strip()}")
        assert status == 2 and "Traceback" not in output, output[-3000:]
        assert f"error: could not write a checkpoint into {run / 'checkpoints'}: Operation not permitted" in output
        assert checkpoints.newest_intact(run / "checkpoints").name == "checkpoint-1"
    finally:
        subprocess.run(["chattr", "-i", str(run / "checkpoints")], capture_output=True)
    status, output = train(tmp_path, "train.save_steps=1", "train.resume_from=auto")
    assert status == 0, output[-3000:]
    assert "from checkpoint-1" in output and run_folder.is_finished(run)


def test_an_output_folder_the_filesystem_refuses_is_one_line_on_every_rank(tmp_path, capsys):
    """An immutable (chattr +i) or read-only output folder ended in run_folder's PermissionError
    traceback; a refusal anywhere else in a command is one line too."""
    from sft_play import cli, train
    from sft_play.errors import UserError

    folder = tmp_path / "out"
    folder.mkdir()
    held = subprocess.run(["chattr", "+i", str(folder)], capture_output=True, text=True)
    if held.returncode != 0:
        pytest.skip(f"chattr +i is not allowed here: {held.stderr.strip()}")
    try:
        with pytest.raises(UserError, match=rf"cannot write into train.output_dir \({folder}\): Operation not "):
            train.check_shared_folder(folder)

        def main():
            (folder / "f").write_text("x")

        with pytest.raises(SystemExit) as ended:
            cli.run(main)
        assert ended.value.code == 2
        assert capsys.readouterr().err.strip().splitlines() == [f"error: {folder / 'f'}: Operation not permitted"]
    finally:
        subprocess.run(["chattr", "-i", str(folder)], capture_output=True)


def test_a_stop_while_the_ranks_start_ends_the_launcher_and_every_rank(tmp_path):
    """A launcher starting its ranks took SIGTERM twice and went on; only SIGKILL ended it. Sent
    to make's process group while the ranks import, as a terminal or a timeout does, the stop
    ends everything: the launcher says so and exits 75, no rank is left."""
    args = f"ARGS=train.run_name=r train.output_dir={tmp_path} train.max_steps=4 {' '.join(PINNED)}"
    make = subprocess.Popen(["make", "--no-print-directory", "train-distributed", "CPU=1", "NUM_GPUS=2", args],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, **OWN_RANKS})
    seen = []
    for line in make.stdout:
        seen.append(line)
        if line.startswith("launching 2 process(es)"):
            break
    deadline = time.monotonic() + 60
    ranks = []
    while len(ranks) < 2 and time.monotonic() < deadline:  # both started, neither trained yet
        ranks = [p for p in psutil.Process(make.pid).children(recursive=True)
                 if "train_distributed.py" in " ".join(p.cmdline())]
        time.sleep(0.1)
    assert len(ranks) == 2, "".join(seen)
    os.killpg(make.pid, signal.SIGTERM)
    said = make.communicate(timeout=120)[0]
    gone, alive = psutil.wait_procs(ranks, timeout=30)
    for survivor in alive:
        survivor.kill()
    assert not alive, f"ranks outlived the stop: {[p.pid for p in alive]}"
    assert "stopped by SIGTERM while starting, before training: nothing new to save" in said or \
        "Stopped by SIGTERM before training started" in said, said[-3000:]
    assert "Error 75" in said and "Traceback" not in said, said[-3000:]
