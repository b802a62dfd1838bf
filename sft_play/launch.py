"""Starting things: the training command for each launcher, free loopback ports, TensorBoard,
and looking after the training processes until they end.

The launch targets of the Makefile come through here (``scripts/launch.py``): one process
(``python``), DDP under ``accelerate launch`` with ``configs/accelerate/ddp.yaml``, and
DeepSpeed under ``torchrun`` (DeepSpeed takes its settings from the run config through the
trainer, see :func:`sft_play.training.deepspeed_config`). This module starts processes and
prints where to look; it does no training itself.

Both launchers run inside the launcher process (as ``accelerate launch`` itself runs torchrun's
agent), on a thread, so that this process keeps the say over signals and outcomes:

- a stop signal (SIGTERM, SIGINT; SIGHUP counts as SIGTERM) is passed on to the training
  processes once, however many times it arrives (a terminal or a cluster signals every process,
  and ``make`` passes SIGTERM on too), and they get ``distributed.stop_timeout_minutes`` to
  finish the step and save before they are killed (torchrun's own agent would kill them after
  30 s, and exit with a traceback);
- the launcher exits with the training processes' status (75 after a stop that saved), with one
  ``error:`` line instead of a traceback when the launch itself fails;
- on one node the processes meet through torchrun's standalone rendezvous on a port it picks
  (two launches at once never race for one); on several nodes, node 0's address and port, and
  every node says how many are still missing while it waits, for at most
  ``distributed.rendezvous_timeout_minutes``.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN_SCRIPT = REPO / "scripts" / "train_distributed.py"
ACCELERATE_DDP_CONFIG = REPO / "configs" / "accelerate" / "ddp.yaml"
LOOPBACK = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500
EXIT_INTERRUPTED = 75  # EX_TEMPFAIL: stopped by a signal after saving; resume to finish
EXIT_USER_ERROR = 2
# The same stop signal arriving again within this many seconds is a duplicate, not a second request
DUPLICATE_SIGNAL_WINDOW_S = 2.0


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


@dataclass
class Topology:
    """Where the processes of a run are: how many per node, how many nodes, who rendezvous where."""

    processes_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = LOOPBACK
    master_port: int = DEFAULT_MASTER_PORT
    cpu: bool = False  # CPU processes (gloo), for tests and machines without GPUs

    @property
    def world_size(self) -> int:
        return self.processes_per_node * self.nnodes

    @property
    def standalone(self) -> bool:
        """One node: torchrun's standalone rendezvous on a port it picks, no MASTER_ADDR/PORT."""
        return self.nnodes == 1

    def rendezvous(self) -> str:
        return "standalone (a free local port)" if self.standalone else f"{self.master_addr}:{self.master_port}"


@dataclass
class Timeouts:
    """The launcher's waits, in seconds (from the run config's ``distributed`` section)."""

    stop_s: float = 15 * 60
    rendezvous_s: float = 10 * 60

    @classmethod
    def from_config(cls, distributed) -> Timeouts:
        return cls(distributed.stop_timeout_minutes * 60, distributed.rendezvous_timeout_minutes * 60)


class LaunchError(ValueError):
    """The launch cannot go ahead as asked; the message says why and what to do."""


def resolve_topology(
    num_gpus: int | None,
    gpus: str | None,
    nnodes: int,
    node_rank: int,
    master_addr: str | None,
    master_port: int | None,
    cpu: bool,
    visible_gpus: int,
) -> tuple[Topology, list[str]]:
    """The topology from the user's settings and the GPUs this machine has, and what to tell them.

    Args:
        num_gpus: processes per node; default: every selected GPU.
        gpus: ``GPUS=0,1``: which GPUs (sets ``CUDA_VISIBLE_DEVICES``).
        nnodes, node_rank, master_addr, master_port: the multi-node rendezvous (one node needs none).
        cpu: run CPU processes (no GPU needed).
        visible_gpus: GPUs torch sees here.

    Raises:
        LaunchError: no GPU and no ``CPU=1``; more processes than GPUs; a taken port on a multi-node run.
    """
    messages = []
    selected = len([g for g in gpus.split(",") if g.strip()]) if gpus else visible_gpus
    if not cpu:
        if selected == 0:
            raise LaunchError("no CUDA GPU here: use `make train` for one CPU process, or CPU=1 NUM_GPUS=2 to try "
                              "distributed training with CPU processes")
        if num_gpus and num_gpus > selected:
            raise LaunchError(f"NUM_GPUS={num_gpus} but only {selected} GPU(s) are selected/visible")
    processes = num_gpus or (selected if not cpu else 2)
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise LaunchError(f"NODE_RANK={node_rank} must be between 0 and NNODES-1={nnodes - 1}")
    port = master_port or DEFAULT_MASTER_PORT
    if nnodes == 1:
        if master_port:
            messages.append(f"one node: MASTER_PORT={master_port} is not used, the processes meet on a free port "
                            "torchrun picks (standalone rendezvous)")
    elif node_rank == 0 and not port_is_free(port, "0.0.0.0"):
        raise LaunchError(f"MASTER_PORT={port} is in use on this node (rank 0): pick a free one and pass the same "
                          f"MASTER_PORT to every node")
    if nnodes > 1 and not master_addr:
        raise LaunchError("a multi-node run needs MASTER_ADDR (the address of node 0), the same on every node")
    return Topology(processes, nnodes, node_rank, master_addr or LOOPBACK, port, cpu), messages


def python_command(config: str, overrides: list[str]) -> list[str]:
    """Training in this process's interpreter, one process."""
    return [sys.executable, str(TRAIN_SCRIPT), "--config", config, *overrides]


def accelerate_command(topology: Topology, config: str, overrides: list[str],
                       accelerate_config: Path = ACCELERATE_DDP_CONFIG, timeouts: Timeouts | None = None) -> list[str]:
    """DDP under ``accelerate launch``: the given accelerate config, with the topology filled in.

    ``--multi_gpu`` is always passed for several processes: this target is DDP, whatever the
    config file says (a config written where there was no GPU says one process, no
    distribution). On CPU it is also what starts several gloo processes (``--cpu`` starts one
    and wants mpirun), with mixed precision off. On one node the rendezvous is torchrun's
    standalone one (see :func:`run_launcher`).
    """
    timeouts = timeouts or Timeouts()
    command = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(accelerate_config),
        "--num_processes", str(topology.world_size),
        "--num_machines", str(topology.nnodes),
        "--machine_rank", str(topology.node_rank),
    ]
    if topology.standalone:
        command += ["--main_process_port", "0"]
    else:
        command += ["--main_process_ip", topology.master_addr, "--main_process_port", str(topology.master_port),
                    "--rdzv_conf", f"timeout={_agent_rendezvous_timeout(timeouts)}"]
    if topology.world_size > 1:
        command += ["--multi_gpu"]
    if topology.cpu:
        command += ["--mixed_precision", "no"]
    return command + [str(TRAIN_SCRIPT), "--config", config, *overrides]


def torchrun_command(topology: Topology, config: str, overrides: list[str],
                     timeouts: Timeouts | None = None) -> list[str]:
    """The same entry script under ``torchrun`` (used for DeepSpeed)."""
    timeouts = timeouts or Timeouts()
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc_per_node", str(topology.processes_per_node),
        "--nnodes", str(topology.nnodes),
        "--shutdown_timeout", str(round(timeouts.stop_s)),
    ]
    if topology.standalone:
        command += ["--standalone"]
    else:
        command += ["--node_rank", str(topology.node_rank), "--master_addr", topology.master_addr,
                    "--master_port", str(topology.master_port),
                    "--rdzv_conf", f"timeout={_agent_rendezvous_timeout(timeouts)}"]
    return command + [str(TRAIN_SCRIPT), "--config", config, *overrides]


def _agent_rendezvous_timeout(timeouts: Timeouts) -> int:
    # a little longer than ours, so that the launcher's own message (how many nodes came) is the one shown
    return round(timeouts.rendezvous_s) + 30


def sanitized_cuda_arch_list(value: str | None) -> str | None:
    """``TORCH_CUDA_ARCH_LIST`` without architecture suffixes (``9.0a`` -> ``9.0``): DeepSpeed
    0.19 parses each entry as numbers and fails on ``9.0a`` ("invalid literal for int()")."""
    if not value:
        return value
    return re.sub(r"(\d+\.\d+)[a-z]+", r"\1", value)


def child_env(topology: Topology | None = None, gpus: str | None = None,
              timeouts: Timeouts | None = None) -> dict[str, str]:
    """The environment for training processes: ours, with the repo importable, the selected GPUs,
    torchrun's shutdown timeout (``accelerate launch`` reads it from here), and for CPU processes
    DeepSpeed's CPU accelerator."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    arch = sanitized_cuda_arch_list(env.get("TORCH_CUDA_ARCH_LIST"))
    if arch:
        env["TORCH_CUDA_ARCH_LIST"] = arch
    env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(round((timeouts or Timeouts()).stop_s))
    if topology is not None and topology.cpu:
        env["DS_ACCELERATOR"] = "cpu"
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // topology.processes_per_node)))
    return env


# --- the command to resume with ----------------------------------------------------------------

_MAKE = {"make", "gmake"}
_SHELLS = {"sh", "bash", "dash", "zsh"}


def user_command() -> list[str]:
    """The command the user ran to start this training process: the nearest ``make`` above it
    (reached through the launcher and make's shell only), else the launcher script's command
    line, else this process's own."""
    import psutil

    found = [sys.executable, *sys.argv]
    try:
        parents = psutil.Process().parents()
    except psutil.Error:
        return found
    for parent in parents:
        try:
            command = parent.cmdline()
        except psutil.Error:
            break
        name = Path(command[0]).name if command else ""
        if name in _MAKE:
            return command
        if any(Path(word).name == "launch.py" and Path(word).parent.name == "scripts" for word in command[1:3]):
            found = command
        elif not (name in _SHELLS and "-c" in command[1:2]):
            break
    return found


def resume_command(command: list[str] | None = None) -> str:
    """`command` (default :func:`user_command`) as a shell line that resumes the run: ``make``
    commands get ``RESUME=auto``, script command lines ``train.resume_from=auto`` (replacing any
    resume setting they had)."""
    command = list(command or user_command())
    if command and Path(command[0]).name in _MAKE:
        words = []
        for word in command:
            if word.startswith("RESUME="):
                continue
            if word.startswith("ARGS="):
                kept = [w for w in word[len("ARGS="):].split() if not w.startswith("train.resume_from=")]
                word = "ARGS=" + " ".join(kept)
            words.append(word)
        return shlex.join(words + ["RESUME=auto"])
    return shlex.join([w for w in command if not w.startswith("train.resume_from=")] + ["train.resume_from=auto"])


# --- looking after the training processes ------------------------------------------------------


class StopForwarder:
    """Passes a stop signal on to the training processes, once per request.

    SIGTERM and SIGINT are passed on as they are, SIGHUP as SIGTERM; a signal arriving within
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
        self.send(signal.SIGTERM if signum == signal.SIGHUP else signum)

    def catch_up(self) -> None:
        """Pass a stop request on to training processes started after it arrived."""
        if self.first is not None:
            signum = signal.SIGTERM if self.first == "SIGHUP" else signal.Signals[self.first]
            self.send(signum, [pid for pid in self.targets() if pid not in self.signalled])

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
                if "--main_process_ip" not in arguments:
                    args.standalone = True  # one node: passed through to torchrun, as accelerate itself does
                launch_command(args)
            elif module == "torch.distributed.run":
                run.run(run.parse_args(arguments))
            else:
                raise ValueError(f"not a launcher this module runs: {module}")
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            outcome["error"] = exc

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_AgentNoise(stop))
    thread = threading.Thread(target=target, daemon=True, name="sft-play-launcher")
    thread.start()
    return thread, outcome


_STOPPED_AT_START = "stopped by {} while starting, before training: nothing new to save"


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
        if stop.first and stop.requests == 1 and set(codes.values()) <= {-signal.SIGTERM, -signal.SIGINT}:
            return EXIT_INTERRUPTED, _STOPPED_AT_START.format(stop.first)
        def said(rank: int) -> str:
            code = codes[rank]
            return f"rank {rank} " + (f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}")

        first, _ = error.get_first_failure()
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
        if stop.first and stop.requests == 1 and status in (-signal.SIGTERM, -signal.SIGINT):
            print(_STOPPED_AT_START.format(stop.first), file=sys.stderr, flush=True)  # before it could save
            return EXIT_INTERRUPTED
        return 128 - status if status < 0 else status
    finally:
        stop.restore()
