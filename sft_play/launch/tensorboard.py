"""Serving TensorBoard beside training: free loopback ports, starting and stopping it, and the
signal handling that makes sure it is stopped however the launcher ends."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

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


def interrupt_on_termination() -> None:
    """Make SIGTERM and SIGHUP raise KeyboardInterrupt, as Ctrl-C does, so that the ``finally``
    blocks that stop TensorBoard (it runs in a session of its own) run on every way to stop us."""
    def interrupt(_signum, _frame):
        raise KeyboardInterrupt

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, interrupt)


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
