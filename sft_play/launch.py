"""Starting things: the training command for each launcher, free loopback ports, TensorBoard.

The launch targets of the Makefile come through here (``scripts/launch.py``): one process
(``python``), DDP under ``accelerate launch`` with ``configs/accelerate/ddp.yaml``, and
DeepSpeed under ``torchrun`` (DeepSpeed takes its settings from the run config through the
trainer, see :func:`sft_play.training.deepspeed_config`). This module starts processes and
prints where to look; it does no training itself.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRAIN_SCRIPT = REPO / "scripts" / "train_distributed.py"
ACCELERATE_DDP_CONFIG = REPO / "configs" / "accelerate" / "ddp.yaml"
LOOPBACK = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500


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
        nnodes, node_rank, master_addr, master_port: the multi-node rendezvous.
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
        if not port_is_free(port):
            taken = port
            port = free_port()
            messages.append(f"port {taken} is in use: the processes rendezvous on {port} instead")
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
                       accelerate_config: Path = ACCELERATE_DDP_CONFIG) -> list[str]:
    """DDP under ``accelerate launch``: the committed DDP config, with the topology filled in.

    On CPU, ``--multi_gpu`` is what starts several gloo processes (``--cpu`` starts one and
    wants mpirun), and mixed precision is off.
    """
    command = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(accelerate_config),
        "--num_processes", str(topology.world_size),
        "--num_machines", str(topology.nnodes),
        "--machine_rank", str(topology.node_rank),
        "--main_process_ip", topology.master_addr,
        "--main_process_port", str(topology.master_port),
    ]
    if topology.cpu:
        command += ["--multi_gpu", "--mixed_precision", "no"]
    return command + [str(TRAIN_SCRIPT), "--config", config, *overrides]


def torchrun_command(topology: Topology, config: str, overrides: list[str]) -> list[str]:
    """The same entry script under ``torchrun`` (used for DeepSpeed, and for multi-node)."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc_per_node", str(topology.processes_per_node),
        "--nnodes", str(topology.nnodes),
        "--node_rank", str(topology.node_rank),
        "--master_addr", topology.master_addr,
        "--master_port", str(topology.master_port),
        str(TRAIN_SCRIPT), "--config", config, *overrides,
    ]


def sanitized_cuda_arch_list(value: str | None) -> str | None:
    """``TORCH_CUDA_ARCH_LIST`` without architecture suffixes (``9.0a`` -> ``9.0``): DeepSpeed
    0.19 parses each entry as numbers and fails on ``9.0a`` ("invalid literal for int()")."""
    if not value:
        return value
    return re.sub(r"(\d+\.\d+)[a-z]+", r"\1", value)


def child_env(topology: Topology | None = None, gpus: str | None = None) -> dict[str, str]:
    """The environment for training processes: ours, with the repo importable, the selected GPUs,
    and for CPU processes DeepSpeed's CPU accelerator."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    arch = sanitized_cuda_arch_list(env.get("TORCH_CUDA_ARCH_LIST"))
    if arch:
        env["TORCH_CUDA_ARCH_LIST"] = arch
    if topology is not None and topology.cpu:
        env["DS_ACCELERATOR"] = "cpu"
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // topology.processes_per_node)))
    return env
