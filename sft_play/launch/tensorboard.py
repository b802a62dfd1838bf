"""Serving TensorBoard beside training: free loopback ports, starting and stopping it, and the
signal handling that makes sure it is stopped however the launcher ends."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
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
    blocks that stop TensorBoard (it runs in a session of its own) run on every way to stop us.

    One request is enough: after the first, SIGTERM and SIGHUP are ignored. A terminal or cluster
    signals the whole process group, and make forwards its own SIGTERM to us again; that second
    copy must not cut short the stopping the first one started.
    """
    def interrupt(_signum, _frame):
        for signum in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_IGN)
        raise KeyboardInterrupt

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, interrupt)


@contextmanager
def signals_deferred(signums=(signal.SIGINT, signal.SIGTERM, signal.SIGHUP)):
    """Hold SIGINT, SIGTERM and SIGHUP until the block ends, then deliver the first one received
    to the handler that was in place before (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = {s: signal.signal(s, lambda signum, _frame: received.append(signum)) for s in signums}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if received:
            signal.raise_signal(received[0])


def stop(process: subprocess.Popen, timeout: float = 10.0) -> None:
    """Stop a process we started (SIGTERM, then SIGKILL). A signal that arrives meanwhile is
    held until it is stopped: TensorBoard runs in a session of its own, and a stop cut short
    would leave it serving after we are gone."""
    with signals_deferred():
        if process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
