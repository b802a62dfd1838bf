"""The Makefile front door: every target is documented, and the targets themselves work here."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sft_play.launch import port_is_free
from tests.conftest import FORKED, PINNED

REPO = Path(__file__).resolve().parents[1]


def make(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **FORKED})


def phony_targets() -> list[str]:
    text = (REPO / "Makefile").read_text().replace("\\\n", " ")  # join continued lines
    names = []
    for line in text.splitlines():
        if line.startswith(".PHONY:"):
            names += line.split(":", 1)[1].split()
    return names


def test_help_lists_every_target_with_a_description():
    result = make("help")
    assert result.returncode == 0, result.stderr
    assert "\x1b" not in result.stdout  # piped (or NO_COLOR): no colour codes; a terminal gets them
    listed = dict(re.findall(r"^\s+([a-z-]+)\s+(\S.*)$", result.stdout, re.M))
    for target in phony_targets():
        assert target in listed, f"make help does not list '{target}'"
        assert len(listed[target]) > 10
    assert sorted(set(listed) - set(phony_targets())) == []  # every target is .PHONY (none builds a file)


def recipes() -> dict[str, list[str]]:
    """Each target's recipe lines (continuations joined)."""
    text = (REPO / "Makefile").read_text().replace("\\\n", " ")
    found: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        match = re.match(r"^([A-Za-z_$(). /-]+):", line)
        if match and not line.startswith("\t"):
            current = match.group(1).strip()
            found.setdefault(current, [])
        elif line.startswith("\t") and current is not None:
            found[current].append(line.strip())
    return found


def test_makefile_targets_are_one_liners_calling_scripts():
    found = recipes()
    own = {"help", "install", "clean"}  # make's own housekeeping
    for target in phony_targets():
        if target in own:
            continue
        lines = found.get(target, [])
        assert len(lines) <= 1, f"{target}: {len(lines)} recipe lines"
        if lines:
            # (@: the line is not echoed, for the targets whose output is a JSON document)
            assert re.match(r"^@?\$\(PY\) ((scripts|bench)/\w+\.py|-m pytest|-m ruff check)( |$)", lines[0]), f"{target}: {lines[0]}"
    assert not any("-c " in line for lines in found.values() for line in lines), "no Python one-liners in make"


def test_make_gpu_info_runs_here():
    result = make("gpu-info")
    assert result.returncode == 0, result.stderr
    assert "CPU:" in result.stdout
    document = make("gpu-info", "ARGS=--json")  # what make prints is the document alone: it parses
    assert json.loads(document.stdout)["auto_mixed_precision"]["mode"] in ("bf16", "no")


def test_make_check_passes_on_the_embedded_default():
    result = make("check")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[PASS] config" in result.stdout and "[PASS] data.path: 24000 records (messages)" in result.stdout
    assert "0 failed" in result.stdout
    from sft_play.patches import PATCHES  # each of the package's changes to a library, listed

    assert all(f"[PASS] patch {patch.target}: " in result.stdout for patch in PATCHES.values())


def test_make_check_fails_with_a_list_on_a_bad_config():
    result = make("check", "ARGS=train.learning_rat=1 data.path=missing.jsonl")
    assert result.returncode != 0
    assert "[FAIL] config" in result.stdout and "train.learning_rate" in result.stdout


def test_args_reach_the_commands_as_text_never_through_a_shell(tmp_path, monkeypatch):
    """ARGS was pasted into the recipe's shell line: `...` and $(...) in it ran, and a line break
    dropped what followed it while the resume hint still listed it."""
    from sft_play import cli
    from sft_play.errors import UserError

    marker = tmp_path / "pwned"
    result = make("check", f"ARGS=train.run_name=`touch {marker}` train.seed=$(touch {marker})")
    assert not marker.exists()
    assert f"override '{marker}`' is not of the form section.key=value" in result.stdout, result.stdout
    result = make("check", "ARGS=train.max_steps=1\ntrain.seed=3")
    assert result.returncode == 2 and result.stderr.splitlines()[0] == (
        "error: ARGS holds a line break: put every override on one line, separated by spaces")
    # free text in PROMPT (IMAGE, DATA) reaches the script as it was typed, quotes and all
    result = make("generate", f'PROMPT=what does `touch {marker}` do? $(touch {marker}) "x"', f"RUN={tmp_path}")
    assert result.returncode == 2 and not marker.exists(), result.stderr
    echoed = make("--dry-run", "generate", "RUN=runs/x").stdout
    assert "--config" not in echoed, "a finished run is used with its own config: none is named unless given"
    monkeypatch.setenv(cli.MAKE_ARGS, """train.run_name="a b" data.path='x y.jsonl' --json $HOME""")
    assert cli.make_args() == ["train.run_name=a b", "data.path=x y.jsonl", "--json", "$HOME"]  # quotes group
    assert cli.MAKE_ARGS not in os.environ, "taken: the processes it starts do not read it again"
    monkeypatch.setenv(cli.MAKE_ARGS, 'train.run_name="unclosed')
    with pytest.raises(UserError, match="ARGS cannot be read as words"):
        cli.make_args()


def watch(process: subprocess.Popen, when: str, then) -> tuple[threading.Thread, list[str]]:
    """Read `process`'s output on a thread; call `then()` once a line contains `when`."""
    lines: list[str] = []

    def read():
        done = False
        for line in process.stdout:
            lines.append(line)
            if not done and when in line:
                then()
                done = True

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return reader, lines


def stop_listener(port: int) -> None:
    """Kill whatever still listens on `port` (a TensorBoard a failed test left behind)."""
    import psutil

    for connection in psutil.net_connections(kind="tcp"):
        if connection.laddr and connection.laddr.port == port and connection.status == "LISTEN" and connection.pid:
            psutil.Process(connection.pid).kill()


@pytest.mark.slow
def test_make_train_tb_ctrl_c_saves_once_and_stops_tensorboard(tmp_path):
    """Ctrl-C in a terminal signals the whole foreground group: make, the launcher and (unless it
    has a session of its own) training; training must see one request, finish the step and save."""
    process = subprocess.Popen(
        ["make", "--no-print-directory", "train-tb",
         f"ARGS=train.max_steps=4 train.logging_steps=1 {' '.join(PINNED)} train.output_dir={tmp_path} train.run_name=tb"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "SFT_PLAY_FAULTS": "hold_step=2"},
    )
    reader, lines = watch(process, "fault injection (hold_step)", lambda: os.killpg(process.pid, signal.SIGINT))
    process.wait(timeout=600)
    reader.join(30)
    output = "".join(lines)
    match = re.search(r"TensorBoard: http://127\.0\.0\.1:(\d+)/", output)
    assert match, output[-3000:]
    port = int(match.group(1))
    try:
        assert "train-tb] Error 75" in output, output[-4000:]
        assert output.count("received SIGINT: finishing this step") == 1 and "interrupted" not in output
        assert "Stopped by SIGINT at step 2" in output
        assert re.search(r"^  resume: make --no-print-directory train-tb .*RESUME=auto$", output, re.M)
        from sft_play import checkpoints

        assert checkpoints.is_complete(tmp_path / "tb" / "checkpoints" / "checkpoint-2")
        assert list((tmp_path / "tb" / "tensorboard").glob("events.out.tfevents.*"))
        assert freed_soon(port), "TensorBoard must stop when training ends"
    finally:
        stop_listener(port)


def freed_soon(port: int, seconds: float = 10.0) -> bool:
    """Whether the port is free within `seconds` (a stopped TensorBoard takes a moment to exit)."""
    deadline = time.monotonic() + seconds
    while not port_is_free(port) and time.monotonic() < deadline:
        time.sleep(0.2)
    return port_is_free(port)


def test_make_tensorboard_stops_tensorboard_on_sigterm(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("train: {}\n")  # a run that has not logged yet
    process = subprocess.Popen(["make", "--no-print-directory", "tensorboard", f"RUN={tmp_path / 'run'}"], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    reader, lines = watch(process, "TensorBoard: http", lambda: os.killpg(process.pid, signal.SIGTERM))
    process.wait(timeout=120)
    reader.join(30)
    match = re.search(r"TensorBoard: http://127\.0\.0\.1:(\d+)/", "".join(lines))
    assert match, "".join(lines)[-3000:]
    port = int(match.group(1))
    try:
        assert freed_soon(port), "TensorBoard was left running"
    finally:
        stop_listener(port)


def test_tensorboard_for_a_folder_that_is_no_run_is_refused(tmp_path):
    """RUN=<a folder that is no run> served an empty board in silence."""
    done = subprocess.run([sys.executable, "scripts/serve_tensorboard.py", "--run", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env={**os.environ, **FORKED})
    assert done.returncode == 2, done.stdout + done.stderr
    assert "is not a run folder" in done.stderr and "Traceback" not in done.stderr
    assert "TensorBoard: http" not in done.stdout


def test_a_second_stop_signal_cannot_cut_short_stopping_tensorboard():
    """make forwards the group's SIGTERM to the script that serves TensorBoard a second time; that
    copy arrived while the first was stopping TensorBoard and left it serving (CI, port 6006)."""
    from sft_play import launch

    child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                              "print('ready', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    child.stdout.readline()  # it ignores SIGTERM: stop() waits, then kills it
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
    try:
        launch.interrupt_on_termination()
        timer.start()
        with pytest.raises(KeyboardInterrupt):  # delivered once the child is stopped, not before
            launch.stop(child, timeout=1.5)
        assert child.poll() is not None, "the signal cut the stop short"
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # one request is enough
    finally:
        timer.cancel()
        child.kill()
        child.wait()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
