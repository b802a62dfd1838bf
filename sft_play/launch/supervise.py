"""Looking after the training processes until they end.

Both launchers run inside the launcher process (as ``accelerate launch`` itself runs torchrun's
agent), on a thread, so that this process keeps the say over signals and outcomes:

- a stop signal (SIGTERM, SIGINT, SIGHUP) is passed on to the training processes as it came
  (each says which stopped it), once however many times it arrives (a terminal or a cluster
  signals every process, and ``make`` passes SIGTERM on too), and they get ``distributed.stop_timeout_minutes`` to
  finish the step and save before they are killed (torchrun's own agent would kill them after
  30 s, and exit with a traceback);
- the launcher exits with the training processes' status (75 after a stop that saved), with one
  ``error:`` line instead of a traceback when the launch itself fails;
- the processes meet through :mod:`.rendezvous`: on one node a free loopback port (two launches
  at once never race for one); on several nodes, node 0's address and port, and every node says
  how many are still missing while it waits, for at most ``distributed.rendezvous_timeout_minutes``.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from sft_play.launch import rendezvous
from sft_play.launch.commands import Timeouts, Topology
from sft_play.launch.tensorboard import LOOPBACK
from sft_play.stopping import DUPLICATE_SIGNAL_WINDOW_S, EXIT_INTERRUPTED, EXIT_LOST_PEER, EXIT_USER_ERROR


class StopForwarder:
    """Passes a stop signal on to the training processes, once per request.

    SIGTERM, SIGINT and SIGHUP are passed on as they are (the training processes treat each as a
    stop request, and say which it was); a signal arriving within
    :data:`DUPLICATE_SIGNAL_WINDOW_S` of the previous one is the same request delivered twice
    and is not passed on again. A later one is (the training processes then stop at once).
    Each target is a process-group leader (torchrun starts its workers in their own sessions,
    and so do we), so its own children get the signal too.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

    def __init__(self, targets: Callable[[], list[int]]) -> None:
        self.targets = targets
        self.first: str | None = None  # the first signal's name
        self.first_at: float | None = None
        self.requests = 0
        self.signalled: set[int] = set()
        self._last_at = -1e9
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _handle(self, signum, _frame) -> None:
        now = time.monotonic()
        if now - self._last_at < DUPLICATE_SIGNAL_WINDOW_S:
            return
        self._last_at = now
        if self.first is None:
            self.first, self.first_at = signal.Signals(signum).name, now
        self.requests += 1
        self.send(signum)

    def catch_up(self) -> None:
        """Pass a stop request on to training processes started after it arrived."""
        if self.first is not None:
            self.send(signal.Signals[self.first], [pid for pid in self.targets() if pid not in self.signalled])

    def send(self, signum: int, pids: list[int] | None = None) -> None:
        for pid in self.targets() if pids is None else pids:
            self.signalled.add(pid)
            try:
                os.killpg(pid, signum)
            except (ProcessLookupError, PermissionError):
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass


class NodeCount:
    """How many nodes of a multi-node run have arrived, counted under a key of ours in node 0's
    rendezvous store (the launchers on every node connect to it as clients), on a thread of its
    own: connecting waits for node 0 to be up."""

    KEY = "sft_play/nodes_arrived"

    def __init__(self, topology: Topology, timeout_s: float) -> None:
        self.topology = topology
        self.arrived: int | None = None  # None until connected to node 0
        self.complete = False
        self._timeout = timedelta(seconds=timeout_s + 60)  # the launcher's deadline comes first, with its message
        threading.Thread(target=self._count, daemon=True, name="sft-play-node-count").start()

    def _count(self) -> None:
        from torch.distributed import TCPStore

        try:
            store = TCPStore(self.topology.master_addr, self.topology.master_port, None, False, self._timeout,
                             wait_for_workers=False)
            self.arrived = store.add(self.KEY, 1)
            while self.arrived < self.topology.nnodes:
                time.sleep(0.5)
                self.arrived = store.add(self.KEY, 0)
            self.complete = True
        except Exception:  # node 0 never came, or went away: the launcher's deadline says so
            return

    def waiting(self) -> str:
        where = f"{self.topology.master_addr}:{self.topology.master_port}"
        arrived = self.arrived or (1 if self.topology.node_rank == 0 else None)
        if arrived is None:
            return f"waiting for node 0 at {where}"
        missing = self.topology.nnodes - arrived
        return f"waiting for {missing} more node(s) at {where} ({arrived} of {self.topology.nnodes} here)"

    def failure(self, timeout_s: float) -> str:
        t = self.topology
        where = f"{t.master_addr}:{t.master_port}"
        after = f"within {timeout_s / 60:g} min (distributed.rendezvous_timeout_minutes)"
        if self.arrived is None and t.node_rank != 0:
            return (f"node 0 did not answer at {where} {after}: start node 0 (NODE_RANK=0) with NNODES={t.nnodes} "
                    f"and MASTER_PORT={t.master_port}, and check that this node reaches {where}")
        return (f"only {self.arrived or 1} of {t.nnodes} node(s) arrived at {where} {after}: start the missing node(s) "
                f"with NNODES={t.nnodes} MASTER_ADDR={t.master_addr} MASTER_PORT={t.master_port} and their "
                f"NODE_RANK, and check that they reach {where}")


class _AgentNoise(logging.Filter):
    """Drops torchrun's log lines that say nothing to our users: that it cannot install signal
    handlers off the main thread (the launcher handles them, :class:`StopForwarder`), and, after
    a stop, that a rank "failed" with status 75 and the others are sent SIGTERM (they are done)."""

    def __init__(self, stop: StopForwarder) -> None:
        super().__init__()
        self.stop = stop

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if "running on a child thread" in text or f"(exitcode: {EXIT_INTERRUPTED})" in text:
            return False
        return not (self.stop.first and "closing signal" in text)


def _run_in_thread(command: list[str], stop: StopForwarder) -> tuple[threading.Thread, dict]:
    """Start ``accelerate launch`` or ``torchrun`` (as `command` names them) in this process, on a
    thread; the dict receives its exception, if any, under ``error``."""
    module, arguments = command[2], command[3:]
    outcome: dict = {}
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed import run

    def target() -> None:
        try:
            if module == "accelerate.commands.launch":
                args = launch_command_parser().parse_args(arguments)
                # accelerate has no flag for it; torchrun's arguments are taken from accelerate's by name
                args.rdzv_endpoint = f"{args.main_process_ip or LOOPBACK}:{args.main_process_port or 0}"
                launch_command(args)
            elif module == "torch.distributed.run":
                run.run(run.parse_args(arguments))
            else:
                raise ValueError(f"not a launcher this module runs: {module}")
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            outcome["error"] = exc

    rendezvous.register()
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_AgentNoise(stop))
    thread = threading.Thread(target=target, daemon=True, name="sft-play-launcher")
    thread.start()
    return thread, outcome


_STOPPED_AT_START = "stopped by {} while starting, before training: nothing new to save"


def _cause(error: Any, codes: dict[int, int]) -> int:
    """The rank whose failure the others followed: the earliest failure among the ranks that did
    not merely lose contact with another (:data:`EXIT_LOST_PEER`). A rank that lost contact may
    exit before the launcher has seen the one that died; their order of exit says nothing."""
    causes = {rank: failure for rank, failure in error.failures.items() if codes[rank] != EXIT_LOST_PEER}
    if not causes:
        return error.get_first_failure()[0]
    return min(causes, key=lambda rank: (causes[rank].timestamp, rank))


def _failure_status(error: BaseException, stop: StopForwarder) -> tuple[int, str | None]:
    """(exit status, error message or None) for the launcher thread's exception."""
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError

    if isinstance(error, ChildFailedError):
        codes = {rank: failure.exitcode for rank, failure in error.failures.items()}
        if EXIT_INTERRUPTED in codes.values():  # a rank exits 75 only after every rank saved
            return EXIT_INTERRUPTED, None
        if set(codes.values()) == {EXIT_USER_ERROR}:  # each rank printed its error
            return EXIT_USER_ERROR, None
        if stop.first and stop.requests == 1 and set(codes.values()) <= {-s for s in StopForwarder.SIGNALS}:
            return EXIT_INTERRUPTED, _STOPPED_AT_START.format(stop.first)
        def said(rank: int) -> str:
            code = codes[rank]
            return f"rank {rank} " + (f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}")

        first = _cause(error, codes)
        others = "".join(f", then {said(rank)}" for rank in sorted(codes) if rank != first)
        resume = "RESUME=auto continues from the newest complete checkpoint"
        if stop.first and stop.requests > 1:
            return 130, (f"stopped at once by a second {stop.first} ({said(first)}{others}); nothing was saved for "
                         f"the step under way: {resume}")
        why = (" (a process killed without a message was usually out of host memory, see `dmesg`, or killed by the "
               "cluster)" if codes[first] < 0 else ": its error is printed above")
        return 1, f"training failed: {said(first)} first{others}{why}; {resume}"
    if isinstance(error, (DistError, RendezvousError)):
        return EXIT_USER_ERROR, f"the nodes could not meet: {error}"
    raise error


def run_launcher(command: list[str], topology: Topology, timeouts: Timeouts, exclude: Callable[[], set[int]]) -> int:
    """Run ``accelerate launch``/``torchrun`` `command` in this process until training ends, and
    return the exit status: the training processes' (75 after a stop that saved), 2 when the
    nodes do not meet, 1 when training fails (with one ``error:`` line).

    Args:
        exclude: pids of our children that are not training processes (TensorBoard).
    """
    import psutil

    # on the main thread, before any other: two threads importing torch at once abort the process
    import torch.distributed.elastic.multiprocessing.errors  # noqa: F401
    import torch.distributed.elastic.rendezvous  # noqa: F401

    def workers() -> list[int]:
        skip = exclude()
        return [p.pid for p in psutil.Process().children() if p.pid not in skip]

    stop = StopForwarder(workers)
    stop.install()
    try:
        thread, outcome = _run_in_thread(command, stop)
        nodes = NodeCount(topology, timeouts.rendezvous_s) if not topology.standalone else None
        started = time.monotonic()
        said, said_at = None, started
        killed = False
        while thread.is_alive():
            thread.join(0.2)
            now = time.monotonic()
            if nodes is not None and not nodes.complete:
                if stop.first is not None:
                    print(f"{_STOPPED_AT_START.format(stop.first)} (the nodes had not all arrived)", flush=True)
                    stop.send(signal.SIGKILL)
                    return EXIT_INTERRUPTED
                if now - started > timeouts.rendezvous_s:
                    print(f"error: {nodes.failure(timeouts.rendezvous_s)}", file=sys.stderr, flush=True)
                    stop.send(signal.SIGKILL)
                    return EXIT_USER_ERROR
                message = nodes.waiting()
                if now - started > 2.0 and (message != said or now - said_at > 30):
                    print(f"{message}; up to {timeouts.rendezvous_s / 60:g} min "
                          "(distributed.rendezvous_timeout_minutes)", flush=True)
                    said, said_at = message, now
            elif nodes is not None and said is not None:
                print(f"all {topology.nnodes} nodes arrived", flush=True)
                said = None
            if stop.first is not None and not killed:
                stop.catch_up()
            if stop.first_at is not None and not killed and now - stop.first_at > timeouts.stop_s:
                print(f"error: the training processes did not stop within {timeouts.stop_s / 60:g} min of "
                      f"{stop.first} (distributed.stop_timeout_minutes): killing them; resume continues from "
                      "the newest complete checkpoint", file=sys.stderr, flush=True)
                stop.send(signal.SIGKILL)
                killed = True
        if "error" not in outcome:
            return 0
        if isinstance(outcome["error"], SystemExit):
            return outcome["error"].code if isinstance(outcome["error"].code, int) else 1
        status, message = _failure_status(outcome["error"], stop)
        if message:
            print(message if status == EXIT_INTERRUPTED else f"error: {message}", file=sys.stderr, flush=True)
        return status
    finally:
        stop.restore()


def run_process(command: list[str], env: dict[str, str], timeouts: Timeouts) -> int:
    """Run one training process (`command`) until it ends, passing stop signals on once (see
    :class:`StopForwarder`); returns its exit status. It runs in its own session, so that a
    terminal's Ctrl-C reaches it through us only, not twice."""
    process = subprocess.Popen(command, env=env, start_new_session=True)
    stop = StopForwarder(lambda: [process.pid] if process.poll() is None else [])
    stop.install()
    try:
        while True:
            try:
                status = process.wait(0.2)
                break
            except subprocess.TimeoutExpired:
                if stop.first_at is not None and time.monotonic() - stop.first_at > timeouts.stop_s:
                    print(f"error: training did not stop within {timeouts.stop_s / 60:g} min of {stop.first} "
                          "(distributed.stop_timeout_minutes): killing it", file=sys.stderr, flush=True)
                    stop.send(signal.SIGKILL)
        if stop.first and stop.requests == 1 and -status in StopForwarder.SIGNALS:
            print(_STOPPED_AT_START.format(stop.first), file=sys.stderr, flush=True)  # before it could save
            return EXIT_INTERRUPTED
        return 128 - status if status < 0 else status
    finally:
        stop.restore()
