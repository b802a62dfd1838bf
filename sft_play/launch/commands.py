"""The training command for each launcher and the topology it runs on: one process
(``python``), DDP under ``accelerate launch`` with ``configs/accelerate/ddp.yaml``, DeepSpeed
under ``torchrun`` (DeepSpeed takes its settings from the run config through the trainer, see
:func:`sft_play.training.deepspeed_config`), and the environment the training processes get."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from sft_play.lean_imports import sanitized_cuda_arch_list
from sft_play.launch import rendezvous
from sft_play.launch.tensorboard import LOOPBACK, port_is_free
from sft_play.run import CPU_ENV
from sft_play.stopping import USER_COMMAND_ENV, user_command

REPO = Path(__file__).resolve().parents[2]
TRAIN_SCRIPT = REPO / "scripts" / "train_distributed.py"
ACCELERATE_DDP_CONFIG = REPO / "configs" / "accelerate" / "ddp.yaml"
DEFAULT_MASTER_PORT = 29500


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
        """One node: the rendezvous store on a free loopback port, no MASTER_ADDR/PORT."""
        return self.nnodes == 1

    def rendezvous(self) -> str:
        return "a free loopback port" if self.standalone else f"{self.master_addr}:{self.master_port}"


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
    oversubscribe: bool = False,
) -> tuple[Topology, list[str]]:
    """The topology from the user's settings and the GPUs this machine has, and what to tell them.

    Args:
        num_gpus: processes per node; default: every selected GPU.
        gpus: ``GPUS=0,1``: which GPUs (sets ``CUDA_VISIBLE_DEVICES``).
        nnodes, node_rank, master_addr, master_port: the multi-node rendezvous (one node needs none).
        cpu: run CPU processes (no GPU needed).
        visible_gpus: GPUs torch sees here.
        oversubscribe: start more CPU processes than this node has cores (``OVERSUBSCRIBE=1``).

    Raises:
        LaunchError: no GPU and no ``CPU=1``; more processes than GPUs, or than cores for CPU
            processes; a port that is no port, or taken on a multi-node run.
    """
    messages = []
    picked = [g.strip() for g in gpus.split(",") if g.strip()] if gpus else []
    if gpus is not None and cpu:
        raise LaunchError(f"GPUS={gpus} picks GPUs, and CPU=1 trains CPU processes: leave one of them out")
    if picked and not cpu:
        _check_picked(gpus, picked, visible_gpus)
    selected = len(picked) if gpus else visible_gpus
    if num_gpus is not None and num_gpus < 1:  # 0 read as "not given" took every GPU
        raise LaunchError(f"NUM_GPUS={num_gpus}: the processes per node must be at least 1 (leave NUM_GPUS out "
                          "for every selected GPU)")
    if not cpu:
        if selected == 0:
            raise LaunchError("no CUDA GPU here: use `make train` for one CPU process, or CPU=1 NUM_GPUS=2 to try "
                              "distributed training with CPU processes")
        if num_gpus and num_gpus > selected:
            raise LaunchError(f"NUM_GPUS={num_gpus} but only {selected} GPU(s) are selected/visible")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    processes = num_gpus or (selected if not cpu else min(2, cores))
    if cpu and processes > cores and not oversubscribe:
        # each would get a sliver of a core, and starting them alone (every one imports torch) can
        # stall the machine for minutes
        raise LaunchError(f"CPU=1 NUM_GPUS={processes}: {processes} CPU processes on the {cores} core(s) this node "
                          f"gives us; use NUM_GPUS={cores} or fewer, or OVERSUBSCRIBE=1 to start them anyway")
    if master_port is not None and not 1 <= master_port <= 65535:
        raise LaunchError(f"MASTER_PORT={master_port} is not a TCP port (1-65535)")
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise LaunchError(f"NODE_RANK={node_rank} must be between 0 and NNODES-1={nnodes - 1}")
    port = master_port or DEFAULT_MASTER_PORT
    if nnodes == 1:
        if master_port:
            messages.append(f"one node: MASTER_PORT={master_port} is not used, the processes meet on a free loopback "
                            "port")
    elif node_rank == 0 and not port_is_free(port, "0.0.0.0"):
        raise LaunchError(f"MASTER_PORT={port} is in use on this node (rank 0): pick a free one and pass the same "
                          f"MASTER_PORT to every node")
    if nnodes > 1 and not master_addr:
        raise LaunchError("a multi-node run needs MASTER_ADDR (the address of node 0), the same on every node")
    return Topology(processes, nnodes, node_rank, master_addr or LOOPBACK, port, cpu), messages


def _check_picked(gpus: str, picked: list[str], visible_gpus: int) -> None:
    """``GPUS=`` names GPUs this machine has, each once: indices below the number visible (a UUID,
    ``GPU-...`` or ``MIG-...``, as CUDA_VISIBLE_DEVICES takes it, unchecked)."""
    if visible_gpus == 0:
        raise LaunchError(f"GPUS={gpus}, but there is no CUDA GPU here: use `make train` for one CPU process, or "
                          "CPU=1 NUM_GPUS=2 to try distributed training with CPU processes")
    if len(picked) != len(gpus.split(",")) or any(" " in g for g in picked):
        raise LaunchError(f"GPUS={gpus}: name the GPUs separated by commas alone, e.g. GPUS=0,1")
    indices = [g for g in picked if not g.startswith(("GPU-", "MIG-"))]
    wrong = [g for g in indices if not g.isdigit()]
    # (under a CUDA_VISIBLE_DEVICES of the shell's, GPUS replaces it: its indices are the machine's, not counted here)
    if os.environ.get("CUDA_VISIBLE_DEVICES") is None:
        wrong += [g for g in indices if g.isdigit() and int(g) >= visible_gpus]
    if wrong:
        raise LaunchError(f"GPUS={gpus}: {', '.join(wrong)} is not a GPU here (the {visible_gpus} visible are "
                          f"0-{visible_gpus - 1})")
    if len({int(g) if g.isdigit() else g for g in picked}) < len(picked):
        raise LaunchError(f"GPUS={gpus} names a GPU twice: each takes one process")


def python_command(config: str, overrides: list[str]) -> list[str]:
    """Training in this process's interpreter, one process."""
    return [sys.executable, str(TRAIN_SCRIPT), "--config", config, *overrides]


def accelerate_command(topology: Topology, config: str, overrides: list[str],
                       accelerate_config: Path = ACCELERATE_DDP_CONFIG, timeouts: Timeouts | None = None,
                       sharded: bool = False) -> list[str]:
    """DDP under ``accelerate launch``: the given accelerate config, with the topology filled in.

    ``--multi_gpu`` is always passed for several processes: this target is DDP, whatever the
    config file says (a config written where there was no GPU says one process, no
    distribution). On CPU it is also what starts several gloo processes (``--cpu`` starts one
    and wants mpirun), with mixed precision off. The rendezvous is ours (:mod:`.rendezvous`),
    its endpoint set by :func:`run_launcher`. A `sharded` (FSDP2) run is started with
    ``--use_fsdp``, which takes the distributed launcher for any number of processes (one
    included, where ``--multi_gpu`` is refused): accelerate applies FSDP only to processes its
    distributed launcher started. The FSDP settings themselves come from the run (the trainer's
    plugin), not from these flags.
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
        command += ["--main_process_ip", topology.master_addr, "--main_process_port", str(topology.master_port)]
    command += ["--rdzv_backend", rendezvous.BACKEND, "--rdzv_conf", _rendezvous_conf(topology, timeouts)]
    if sharded:
        command += ["--use_fsdp", "--fsdp_version", "2"]
    elif topology.world_size > 1:
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
    command += ["--rdzv_backend", rendezvous.BACKEND, "--rdzv_endpoint", rendezvous_endpoint(topology),
                "--rdzv_conf", _rendezvous_conf(topology, timeouts)]
    return command + [str(TRAIN_SCRIPT), "--config", config, *overrides]


def rendezvous_endpoint(topology: Topology) -> str:
    """Node 0's store: a free loopback port on one node, MASTER_ADDR:MASTER_PORT on several."""
    return f"{LOOPBACK}:0" if topology.standalone else f"{topology.master_addr}:{topology.master_port}"


def _rendezvous_conf(topology: Topology, timeouts: Timeouts) -> str:
    return f"rank={topology.node_rank},timeout={_agent_rendezvous_timeout(timeouts)}"


def _agent_rendezvous_timeout(timeouts: Timeouts) -> int:
    # a little longer than ours, so that the launcher's own message (how many nodes came) is the one shown
    return round(timeouts.rendezvous_s) + 30


def child_env(topology: Topology | None = None, gpus: str | None = None,
              timeouts: Timeouts | None = None, cpu: bool = False) -> dict[str, str]:
    """The environment for training processes: ours, with the repo importable, the selected GPUs,
    torchrun's shutdown timeout (``accelerate launch`` reads it from here), and for CPU processes
    (``CPU=1``, or a CPU topology) no GPU at all: the GPUs hidden, ``SFT_PLAY_CPU=1`` (what
    :func:`sft_play.run.placement` reads) and DeepSpeed's CPU accelerator, so that torch,
    accelerate, DeepSpeed and the run agree that nothing trains on a GPU."""
    env = dict(os.environ)
    env[USER_COMMAND_ENV] = json.dumps(user_command())  # found from here, where make is still above
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    arch = sanitized_cuda_arch_list(env.get("TORCH_CUDA_ARCH_LIST"))
    if arch:
        env["TORCH_CUDA_ARCH_LIST"] = arch
    env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(round((timeouts or Timeouts()).stop_s))
    if cpu or (topology is not None and topology.cpu):
        env["CUDA_VISIBLE_DEVICES"] = ""
        env[CPU_ENV] = "1"
        env["DS_ACCELERATOR"] = "cpu"
    if topology is not None and topology.cpu:
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // topology.processes_per_node)))
    return env
