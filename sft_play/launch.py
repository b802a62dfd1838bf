"""Starting things: the training command for each launcher, free loopback ports, TensorBoard.

The launch targets of the Makefile come through here (``scripts/launch.py``). This module
starts processes and prints where to look; it does no training itself.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN_SCRIPT = REPO / "scripts" / "train_distributed.py"
LOOPBACK = "127.0.0.1"


def port_is_free(port: int, host: str = LOOPBACK) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(preferred: int | None = None, host: str = LOOPBACK) -> int:
    """`preferred` when it is free, else a port the OS hands out."""
    if preferred and port_is_free(preferred, host):
        return preferred
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_for_port(port: int, host: str = LOOPBACK, timeout: float = 30.0, process: subprocess.Popen | None = None) -> bool:
    """Whether something listens on host:port within `timeout` seconds (False early if `process` dies)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            return False
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.settimeout(0.5)
            if sock.connect_ex((host, port)) == 0:
                return True
        time.sleep(0.3)
    return False


def loopback_url(port: int) -> str:
    return f"http://{LOOPBACK}:{port}/"


def start_tensorboard(logdir: str | Path, port: int | None = None) -> tuple[subprocess.Popen, int]:
    """TensorBoard on a free loopback port, its output in ``<logdir>/tensorboard.log``.

    Returns:
        The process (stop it with :func:`stop`) and the port it serves on.
    """
    logdir = Path(logdir)
    logdir.mkdir(parents=True, exist_ok=True)
    port = free_port(port or 6006)
    log = open(logdir / "tensorboard.log", "ab")
    process = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", LOOPBACK, "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # our Ctrl-C goes to training; TensorBoard is stopped by us
    )
    log.close()
    return process, port


def stop(process: subprocess.Popen, timeout: float = 10.0) -> None:
    """Stop a process we started (SIGTERM, then SIGKILL)."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def run_forwarding_signals(command: list[str], env: dict[str, str] | None = None) -> int:
    """Run `command` and pass SIGINT/SIGTERM on to it, so that training can save and stop cleanly."""
    process = subprocess.Popen(command, env=env)

    def forward(signum, _frame):
        if process.poll() is None:
            process.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return process.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def python_command(config: str, overrides: list[str]) -> list[str]:
    """Training in this process's interpreter, one process."""
    return [sys.executable, str(TRAIN_SCRIPT), "--config", config, *overrides]


def child_env() -> dict[str, str]:
    """The environment for training processes: ours, with the repo importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env
