"""Distributed training with real processes on the CPU (gloo): DDP through accelerate launch,
DeepSpeed ZeRO-2 through torchrun, stops and resumes under both, and multi-node starts on one
machine, all started by the make targets or the launcher script they call."""

from __future__ import annotations

import json
import os
import queue
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import pytest

from sft_play import checkpoints, launch, training
from sft_play.launch import rendezvous, supervise
from sft_play import config as config_module
from sft_play.run import resolve
from tests.conftest import FORKED, PINNED, with_forks

REPO = Path(__file__).resolve().parents[1]
# Two ranks of 4 rows: the micro-batch pinned, since the CPU plan's own choice follows the RAM free
# at that moment (the planner's choice is tested against fixed budgets in test_planner.py)
TINY = ["train.max_steps=4", "train.logging_steps=1", "train.record_samples=true", "train.save_steps=2", *PINNED,
        "train.micro_batch_size=4",
        # a trained copy of lm_head is refused under FSDP2 (see test_fsdp2.py); DDP and ZeRO train the same
        "lora.modules_to_save=[embed_tokens]"]
FSDP2 = ("distributed.strategy=fsdp2",)
# Step 2 plus its save take this long after the stop signal: longer than torchrun's default
# shutdown timeout (30 s), after which its agent would have killed the processes unsaved
SLOW_STOP_S = 31


def make(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ))


def rows_seen(run_dir: Path, rank: int) -> set[str]:
    lines = (run_dir / "samples" / f"rank-{rank}.jsonl").read_text().splitlines()
    return {fingerprint for line in lines for fingerprint in json.loads(line)}


def check_two_rank_run(run_dir: Path, output: str) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_step"] == 4
    assert len(set(summary["weights_fingerprints"])) == 1, "the ranks ended with different weights"
    assert "final weights identical on all 2 rank(s)" in output
    assert not rows_seen(run_dir, 0) & rows_seen(run_dir, 1), "the ranks saw the same rows"
    assert output.count("Run folder:") == 1, "only the main process reports"
    assert (run_dir / "model" / "adapter_model.safetensors").is_file()
    assert len(list(run_dir.rglob("adapter_model.safetensors"))) == 3  # model/ + checkpoints 2 and 4
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.is_dir()) == ["checkpoint-2", "checkpoint-4"]
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 1
    return summary


class StoppedRun:
    """A make target started in its own process group and sent SIGTERM (or SIGHUP: the terminal
    closed), to the whole group as a terminal or a cluster does, once step 2 is under way (made
    slow on purpose: ``slow_step``)."""

    def __init__(self, target: str, run_dir: Path, extra: tuple[str, ...] = (),
                 signum: signal.Signals = signal.SIGTERM) -> None:
        self.target, self.run_dir, self.signum = target, run_dir, signum
        self.command = ["make", "--no-print-directory", target, "CPU=1", "NUM_GPUS=2",
                        f"ARGS={' '.join([*TINY, *extra])} train.output_dir={run_dir.parent} train.run_name={run_dir.name}"]
        self.process = subprocess.Popen(
            self.command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
            env={**os.environ, "SFT_PLAY_FAULTS": f"slow_step=2:{SLOW_STOP_S}"},
        )
        self.lines: list[str] = []
        self.signalled_at = self.ended_at = None
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)
            if self.signalled_at is None and "fault injection (slow_step)" in line:
                os.killpg(self.process.pid, self.signum)
                self.signalled_at = time.monotonic()
        self.process.wait()
        self.ended_at = time.monotonic()

    def output(self, timeout: float = 600) -> str:
        self.reader.join(timeout)
        assert not self.reader.is_alive(), f"{self.target} did not end"
        return "".join(self.lines)

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def stopped_runs(tmp_path_factory):
    """DDP, ZeRO-2 and FSDP2 runs stopped by SIGTERM (FSDP2's by SIGHUP) during a slow step, started
    first so that they sleep through the uninterrupted runs below."""
    root = tmp_path_factory.mktemp("stopped")
    runs = {"ddp": StoppedRun("train-distributed", root / "ddp"),
            "zero2": StoppedRun("train-deepspeed", root / "zero2"),
            "fsdp2": StoppedRun("train-distributed", root / "fsdp2", FSDP2, signal.SIGHUP)}
    yield runs
    for run in runs.values():
        run.kill()


def _uninterrupted(tmp_path_factory, target: str, name: str, extra: tuple[str, ...] = ()):
    """The run's folder, output and status; the addresses its processes listened on, in LISTENED[name]."""
    root = tmp_path_factory.mktemp(name)
    process = subprocess.Popen(
        ["make", "--no-print-directory", target, "CPU=1", "NUM_GPUS=2",
         f"ARGS={' '.join([*TINY, *extra])} train.output_dir={root} train.run_name={name}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **FORKED})
    LISTENED[name] = listening_while(process)
    return root / name, process.stdout.read(), process.wait(timeout=900)


LISTENED: dict[str, set[tuple[str, str]]] = {}


def listening_while(process: subprocess.Popen) -> set[tuple[int, str]]:
    """(pid, address) of every TCP socket `process` and its descendants listen on, seen every 0.2 s
    until it ends: the launcher's rendezvous store, gloo's, TensorBoard's."""
    import psutil

    seen: set[tuple[int, str]] = set()
    root = psutil.Process(process.pid)

    def watch() -> None:
        while process.poll() is None:
            try:
                tree = {member.pid for member in with_forks([root, *root.children(recursive=True)])}
            except psutil.NoSuchProcess:
                return
            # the machine's sockets in one pass (psutil reads the socket tables once, not once per
            # process: a tenth of the CPU with the eight processes of a two-rank launch)
            seen.update((c.pid, c.laddr.ip) for c in psutil.net_connections("tcp")
                        if c.pid in tree and c.status == psutil.CONN_LISTEN)
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    return seen


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, stopped_runs):
    return _uninterrupted(tmp_path_factory, "train-distributed", "ddp")


@pytest.fixture(scope="module")
def zero2_run(tmp_path_factory, stopped_runs):
    return _uninterrupted(tmp_path_factory, "train-deepspeed", "zero2")


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory, stopped_runs):
    return _uninterrupted(tmp_path_factory, "train-distributed", "fsdp2", FSDP2)


@pytest.mark.slow
def test_make_train_distributed_runs_ddp_on_two_cpu_processes(ddp_run):
    run_dir, output, status = ddp_run
    assert status == 0, output[-5000:]
    assert "launching 2 process(es) on 1 node(s) (accelerate, ddp, rendezvous a free loopback port)" in output
    assert "2 process(es) on 1 node(s), DistributedType.MULTI_CPU" in output
    assert "global 8 = micro 4 x accum 1 x world 2" in output
    summary = check_two_rank_run(run_dir, output)
    assert summary["batch"] == "global 8 = micro 4 x accum 1 x world 2"


@pytest.mark.slow
def test_make_train_deepspeed_runs_zero2_on_two_cpu_processes(zero2_run):
    run_dir, output, status = zero2_run
    assert status == 0, output[-5000:]
    assert "(torchrun, deepspeed_zero2, rendezvous a free loopback port)" in output
    assert "DistributedType.DEEPSPEED" in output
    assert "shm_comm_op built" not in output  # its inference-only comm op is not compiled (~40 s)
    check_two_rank_run(run_dir, output)
    saved = config_module.load(run_dir / "config.yaml")
    assert saved.distributed.strategy == "deepspeed_zero2"


@pytest.mark.slow
def test_fsdp2_lora_trains_like_ddp_on_disjoint_rows_and_saves_shards(fsdp2_run, ddp_run):
    run_dir, output, status = fsdp2_run
    assert status == 0, output[-5000:]
    assert "(accelerate, fsdp2, rendezvous a free loopback port)" in output and "strategy fsdp2" in output
    ours = json.loads((run_dir / "summary.json").read_text())
    theirs = json.loads((ddp_run[0] / "summary.json").read_text())
    assert ours["world_size"] == 2 and ours["global_step"] == 4
    assert ours["distributed_type"] == "FSDP" and theirs["distributed_type"] == "MULTI_CPU"  # as the trainers ran
    assert [step for step, _ in ours["losses"]] == [step for step, _ in theirs["losses"]]
    for (_, mine), (_, reference) in zip(ours["losses"], theirs["losses"]):
        assert mine == pytest.approx(reference, rel=1e-4)
    assert not rows_seen(run_dir, 0) & rows_seen(run_dir, 1), "the ranks saw the same rows"
    for step in (2, 4):
        checkpoint = run_dir / "checkpoints" / f"checkpoint-{step}"
        assert checkpoints.is_complete(checkpoint, verify=True)
        assert checkpoints.written_by(checkpoint) == (2, "fsdp2")
        shards = sorted(p.name for p in (checkpoint / "pytorch_model_fsdp_0").glob("*.distcp"))
        assert len(shards) == 2, "each rank writes its own shard"
    # the model folder holds whole tensors, which the export commands read like any other
    assert (run_dir / "model" / "adapter_model.safetensors").is_file()
    assert len(set(ours["weights_fingerprints"])) == 2  # each rank's own shards


@pytest.mark.slow
def test_a_node_that_never_comes_is_waited_for_then_ends_with_one_error():
    """Node 0 alone, and node 1 alone (at another port): each says what it waits for, then gives
    up within the configured time. (Before the test below: they sleep while its runs finish.)"""
    def node(rank: int, port: int) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "scripts/launch.py", "--launcher", "torchrun", "--cpu", "--num-gpus", "1", "--nnodes", "2",
             "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
             "--config", "configs/run_tiny.yaml", "distributed.rendezvous_timeout_minutes=0.05"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **FORKED})

    alone0, alone1 = free_ports(2)
    launches = {"alone0": node(0, alone0), "alone1": node(1, alone1)}
    # A hang guard, not a clock: without the configured 0.05 min, torch waits 15 min for a node
    outputs = {name: process.communicate(timeout=300)[0] for name, process in launches.items()}
    for name, process in launches.items():
        assert process.returncode == 2, f"{name}: {outputs[name][-3000:]}"
        assert "Traceback" not in outputs[name], outputs[name][-3000:]
    assert f"waiting for 1 more node(s) at 127.0.0.1:{alone0} (1 of 2 here)" in outputs["alone0"]
    arrived = rf"^error: only 1 of 2 node\(s\) arrived at 127.0.0.1:{alone0} within 0.05 min"
    assert re.search(arrived, outputs["alone0"], re.M)
    assert f"waiting for node 0 at 127.0.0.1:{alone1}" in outputs["alone1"]
    assert re.search(rf"^error: node 0 did not answer at 127.0.0.1:{alone1} within 0.05 min", outputs["alone1"], re.M)


@pytest.mark.slow
def test_two_nodes_on_one_machine_meet_at_node_zeros_store_and_train(tmp_path):
    """NNODES=2 as two launchers, one process each, through our rendezvous: node 0's store on the
    address MASTER_ADDR names (here loopback), node 1 a client of it."""
    port = free_ports(1)[0]
    nodes = [subprocess.Popen(
        [sys.executable, "scripts/launch.py", "--launcher", "torchrun", "--cpu", "--num-gpus", "1", "--nnodes", "2",
         "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
         "--config", "configs/run_tiny.yaml", *PINNED, "train.max_steps=2", "train.micro_batch_size=2",
         f"train.output_dir={tmp_path}", "train.run_name=two_nodes"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **FORKED})
        for rank in (0, 1)]
    listened = listening_while(nodes[0])
    outputs = [node.communicate(timeout=600)[0] for node in nodes]
    for node, output in zip(nodes, outputs):
        assert node.returncode == 0, output[-3000:]
    assert "2 process(es) on 2 node(s)" in outputs[0]
    summary = json.loads((tmp_path / "two_nodes" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_step"] == 2
    assert {address for _, address in listened} == {"127.0.0.1"}, sorted(listened)


@pytest.mark.slow
def test_sigterm_under_every_strategy_saves_every_rank_and_resumes_to_the_same_loss(stopped_runs, ddp_run, zero2_run,
                                                                                    fsdp2_run):
    strategies = {"ddp": "ddp", "zero2": "deepspeed_zero2", "fsdp2": "fsdp2"}
    references = {"ddp": ddp_run, "zero2": zero2_run, "fsdp2": fsdp2_run}
    resumes = {}
    for name, run in stopped_runs.items():
        output = run.output()
        assert run.signalled_at is not None, output[-5000:]
        # the launcher's exit status (make itself, signalled too, dies by the signal)
        assert "[Makefile" in output and f"{run.target}] Error 75" in output, output[-5000:]
        assert run.ended_at - run.signalled_at > 30, "the processes had the time the step and the save took"
        assert "Traceback" not in output and "SignalException" not in output, output[-5000:]
        said = run.signum.name  # the signal the terminal or cluster sent, as the ranks say it
        assert output.count(f"received {said}: finishing this step") == 2, "each rank got the stop once"
        assert f"Stopped by {said} at step 2; checkpoint saved" in output
        checkpoint = run.run_dir / "checkpoints" / "checkpoint-2"
        assert checkpoints.is_complete(checkpoint, verify=True)
        assert checkpoints.written_by(checkpoint) == (2, strategies[name])
        assert not checkpoints.missing_rank_files(checkpoint, 2)
        assert not (run.run_dir / "model").exists()
        resume = re.search(r"^  resume: (.+)$", output, re.M).group(1)
        assert shlex.split(resume) == run.command + ["RESUME=auto"], "the command that ran, plus RESUME=auto"
        resumes[name] = subprocess.Popen(shlex.split(resume), cwd=REPO, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True, env={**os.environ, **FORKED})
    for name, process in resumes.items():
        reference = references[name][0]
        output = process.communicate(timeout=600)[0]
        assert process.returncode == 0, output[-5000:]
        run_dir = stopped_runs[name].run_dir
        assert f"resuming {run_dir} from checkpoint-2" in output
        ours = json.loads((run_dir / "summary.json").read_text())
        theirs = json.loads((reference / "summary.json").read_text())
        assert ours["global_step"] == theirs["global_step"] == 4
        assert ours["last_loss"] == pytest.approx(theirs["last_loss"], rel=1e-5)
        assert ours["weights_fingerprints"] == theirs["weights_fingerprints"]


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


# --- the launcher's decisions, without processes ---------------------------------------------


def test_one_node_meets_on_a_free_loopback_port():
    topology, messages = launch.resolve_topology(2, None, 1, 0, None, 29555, True, 0, oversubscribe=True)  # (any core count)
    assert topology.standalone and topology.rendezvous() == "a free loopback port"
    assert messages == ["one node: MASTER_PORT=29555 is not used, the processes meet on a free loopback port"]
    command = launch.torchrun_command(topology, "c.yaml", [])
    assert "--standalone" not in command and "--master_port" not in command
    assert command[command.index("--rdzv_backend") + 1] == rendezvous.BACKEND
    assert command[command.index("--rdzv_endpoint") + 1] == "127.0.0.1:0"
    command = launch.accelerate_command(topology, "c.yaml", [])
    assert command[command.index("--main_process_port") + 1] == "0" and "--main_process_ip" not in command
    assert command[command.index("--rdzv_backend") + 1] == rendezvous.BACKEND


@pytest.mark.slow
def test_every_listener_of_a_one_node_run_is_on_loopback(ddp_run, zero2_run):
    """torchrun's own stores bound every interface: a client on the host's other addresses could
    read and write the run's keys. Both launchers, the store and the ranks' own listeners."""
    for name, run in {"ddp": ddp_run, "zero2": zero2_run}.items():
        assert run[2] == 0, run[1][-3000:]
        addresses = {address for _, address in LISTENED[name]}
        assert addresses == {"127.0.0.1"}, f"{name}: {sorted(LISTENED[name])}"
        launcher = {pid for pid, _ in LISTENED[name]}
        assert len(launcher) >= 3, "the launcher's store and each rank's gloo listener were seen"


def test_the_store_binds_loopback_on_one_node_and_master_addrs_address_on_several():
    assert rendezvous.listen_address("10.1.2.3", 1) == ("127.0.0.1", None)
    assert rendezvous.listen_address("10.1.2.3", 2) == ("10.1.2.3", None)
    assert rendezvous.listen_address("127.0.0.1", 2) == ("127.0.0.1", None)  # nodes on one machine
    assert rendezvous.listen_address("localhost", 2) == ("127.0.0.1", None)
    bind, note = rendezvous.listen_address("no-such-host.invalid", 2)
    assert bind == "0.0.0.0" and "MASTER_ADDR=no-such-host.invalid does not resolve" in note


def test_taken_port_on_a_multi_node_rank_zero_is_an_error():
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        sock.listen()
        taken = sock.getsockname()[1]
        with pytest.raises(launch.LaunchError, match=f"MASTER_PORT={taken} is in use"):
            launch.resolve_topology(1, None, 2, 0, "10.0.0.1", taken, True, 0)


def test_launch_settings_are_checked(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(launch.LaunchError, match="no CUDA GPU here"):
        launch.resolve_topology(None, None, 1, 0, None, None, False, 0)
    with pytest.raises(launch.LaunchError, match="NUM_GPUS=4 but only 2"):
        launch.resolve_topology(4, "0,1", 1, 0, None, None, False, 8)
    with pytest.raises(launch.LaunchError, match="NODE_RANK=2"):
        launch.resolve_topology(1, None, 2, 2, "10.0.0.1", None, True, 0)
    for cpu in (True, False):  # NUM_GPUS=0 read as "not given" took every GPU
        with pytest.raises(launch.LaunchError, match="NUM_GPUS=0: the processes per node must be at least 1"):
            launch.resolve_topology(0, None, 1, 0, None, None, cpu, 8)
    with pytest.raises(launch.LaunchError, match="needs MASTER_ADDR"):
        launch.resolve_topology(1, None, 2, 1, None, None, True, 0)
    topology, _ = launch.resolve_topology(None, "0,2", 1, 0, None, None, False, 8)
    assert topology.processes_per_node == 2  # GPUS=0,2 selects two
    # GPUS= names GPUs this machine has, each once
    with pytest.raises(launch.LaunchError, match="GPUS=0,1, but there is no CUDA GPU here"):
        launch.resolve_topology(None, "0,1", 1, 0, None, None, False, 0)
    with pytest.raises(launch.LaunchError, match=r"GPUS=7: 7 is not a GPU here \(the 2 visible are 0-1\)"):
        launch.resolve_topology(None, "7", 1, 0, None, None, False, 2)
    with pytest.raises(launch.LaunchError, match="GPUS=1,01 names a GPU twice"):
        launch.resolve_topology(None, "1,01", 1, 0, None, None, False, 2)
    with pytest.raises(launch.LaunchError, match="GPUS=0,,1: name the GPUs separated by commas alone"):
        launch.resolve_topology(None, "0,,1", 1, 0, None, None, False, 2)
    with pytest.raises(launch.LaunchError, match="GPUS=0 picks GPUs, and CPU=1 trains CPU processes"):
        launch.resolve_topology(2, "0", 1, 0, None, None, True, 0)
    assert launch.resolve_topology(None, "GPU-8f3e,1", 1, 0, None, None, False, 2)[0].processes_per_node == 2
    # the shell's CUDA_VISIBLE_DEVICES=4,5,6,7 shows 4 GPUs; GPUS replaces it with the machine's own indices
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert launch.resolve_topology(None, "4,5", 1, 0, None, None, False, 4)[0].processes_per_node == 2
    with pytest.raises(launch.LaunchError, match="MASTER_PORT=70000 is not a TCP port"):
        launch.resolve_topology(1, None, 1, 0, None, 70000, True, 0)


def test_a_cpu_launch_of_more_processes_than_cores_is_refused_unless_asked(monkeypatch):
    """1,000 CPU processes on 2 cores made the machine unusable for 12 minutes."""
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {0, 1})
    with pytest.raises(launch.LaunchError, match=r"CPU=1 NUM_GPUS=1000: 1000 CPU processes on the 2 core\(s\)"
                                                 r".*NUM_GPUS=2 or fewer, or OVERSUBSCRIBE=1"):
        launch.resolve_topology(1000, None, 1, 0, None, None, True, 0)
    assert launch.resolve_topology(2, None, 1, 0, None, None, True, 0)[0].processes_per_node == 2
    assert launch.resolve_topology(3, None, 1, 0, None, None, True, 0, oversubscribe=True)[0].processes_per_node == 3
    assert launch.resolve_topology(8, None, 1, 0, None, None, False, 8)[0].processes_per_node == 8  # GPUs: no cap


def test_make_refuses_a_thousand_cpu_processes_in_one_line_before_starting_any():
    done = subprocess.run(["make", "--no-print-directory", "train-distributed", "CPU=1", "NUM_GPUS=1000",
                           "ARGS=train.max_steps=1"], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **FORKED})
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "OVERSUBSCRIBE=1" in errors[0] and "Traceback" not in done.stderr
    assert "launching" not in done.stdout


def test_train_deepspeed_refuses_a_config_that_says_fsdp2():
    """make train-deepspeed rewrote any strategy but deepspeed_* to ZeRO-2: an FSDP2 config trained
    under DeepSpeed, unsaid."""
    done = subprocess.run([sys.executable, "scripts/launch.py", "--launcher", "torchrun", "--cpu", "--deepspeed",
                           "--config", "configs/run_tiny.yaml", "distributed.strategy=fsdp2"],
                          cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, **FORKED})
    assert done.returncode == 2 and "distributed.strategy=fsdp2: use make train-distributed" in done.stderr
    assert "Traceback" not in done.stderr


def test_commands_carry_the_topology(monkeypatch):
    topology = launch.Topology(processes_per_node=8, nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=1234)
    command = launch.accelerate_command(topology, "c.yaml", ["train.max_steps=3"])
    assert command[command.index("--num_processes") + 1] == "16"
    assert command[command.index("--machine_rank") + 1] == "1"
    assert command[command.index("--main_process_ip") + 1] == "10.0.0.1"
    assert command[-3:] == ["--config", "c.yaml", "train.max_steps=3"]
    assert "--multi_gpu" in command, "DDP whatever the accelerate config file says"
    timeouts = launch.Timeouts(stop_s=600, rendezvous_s=120)
    assert command[command.index("--rdzv_conf") + 1] == "rank=1,timeout=630"
    command = launch.torchrun_command(topology, "c.yaml", [], timeouts)
    assert command[command.index("--nproc_per_node") + 1] == "8"
    assert command[command.index("--nnodes") + 1] == "2"
    assert command[command.index("--rdzv_endpoint") + 1] == "10.0.0.1:1234" and "--standalone" not in command
    assert command[command.index("--shutdown_timeout") + 1] == "600"
    assert command[command.index("--rdzv_conf") + 1] == "rank=1,timeout=150"
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)  # another test's launch may have left it here
    env = launch.child_env(launch.Topology(processes_per_node=2), gpus="0,1", timeouts=timeouts)
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and "DS_ACCELERATOR" not in env
    # CPU processes see no GPU, whatever GPUS selects (tests/test_one_decision.py: CPU=1 beside a GPU)
    env = launch.child_env(launch.Topology(cpu=True, processes_per_node=2), gpus="0,1", timeouts=timeouts)
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["DS_ACCELERATOR"] == "cpu"
    assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "600"  # what accelerate launch's agent reads
    config = config_module.load(
        None, ["distributed.stop_timeout_minutes=2", "distributed.rendezvous_timeout_minutes=0.5"], check_paths=False)
    assert launch.Timeouts.from_config(config.distributed) == launch.Timeouts(stop_s=120, rendezvous_s=30)


def test_the_resume_command_is_the_one_that_ran_plus_resume_auto():
    ran = ["make", "train-distributed", "NUM_GPUS=2", "ARGS=train.max_steps=4 train.resume_from=runs/x/checkpoints/c",
           "RESUME=runs/y"]
    assert launch.resume_command(ran) == "make train-distributed NUM_GPUS=2 ARGS=train.max_steps=4 RESUME=auto"
    ran = [sys.executable, "scripts/launch.py", "--launcher", "torchrun", "--config", "c.yaml", "train.max_steps=4"]
    assert launch.resume_command(ran) == shlex.join(ran + ["train.resume_from=auto"])


def test_the_users_command_is_found_through_make_and_its_shell(tmp_path):
    show = f"{sys.executable} -c 'from sft_play import launch; print(launch.user_command())'"
    (tmp_path / "Makefile").write_text(f"show:\n\t{show} && true\n")  # "&& true": make runs it through sh -c
    env = {**os.environ, "MAKEFLAGS": ""}
    through_make = subprocess.run(["make", "-s", "-f", str(tmp_path / "Makefile"), "show", "X=1"], cwd=REPO,
                                  capture_output=True, text=True, env=env)
    assert through_make.stdout.strip() == repr(["make", "-s", "-f", str(tmp_path / "Makefile"), "show", "X=1"])
    alone = subprocess.run(shlex.split(show), cwd=REPO, capture_output=True, text=True)  # started by pytest
    assert alone.stdout.strip() == repr([sys.executable, "-c"])


def test_the_rank_that_failed_is_named_not_the_one_that_lost_contact_with_it(tmp_path):
    """A rank that lost contact (exit 3) can leave before the launcher has seen the rank that
    died: the message names the dead one first all the same."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    failures = {0: ProcessFailure(0, 100, 3, str(tmp_path / "none")),
                1: ProcessFailure(1, 101, -signal.SIGKILL, str(tmp_path / "none"))}
    failures[0].timestamp, failures[1].timestamp = 10, 11  # rank 0 seen leaving first
    status, message = supervise._failure_status(ChildFailedError("train", failures), supervise.StopForwarder(lambda: []))
    assert status == 1 and message.startswith("training failed: rank 1 killed by SIGKILL first, then rank 0 exit "
                                              "status 3"), message


def lines_of(stream) -> Callable[[], str]:
    """The next line of a child's output, read on a thread and waited for in short slices.

    A signal this process sends itself may be handed to another of its threads; Python runs the
    handler only when the main thread next runs bytecode, so a main thread blocked in a read that
    only the handler's work can satisfy would wait forever. "" if no line comes within 30 s."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line.strip()) for line in stream], daemon=True).start()

    def next_line() -> str:
        deadline = time.perf_counter() + 30  # (the test below stands in for time.monotonic)
        while time.perf_counter() < deadline:
            try:
                return lines.get(timeout=0.05)
            except queue.Empty:
                pass
        return ""

    return next_line


def test_a_stop_signal_is_passed_on_once_however_often_it_arrives(monkeypatch):
    """Three deliveries of one SIGTERM within the duplicate window are one request; a SIGHUP after
    it is a second (passed on as it came). The forwarder's clock is the test's, so that a busy
    machine cannot stretch the window; the child says when its trap is set and when it got each."""
    clock = [1000.0]
    monkeypatch.setattr(supervise.time, "monotonic", lambda: clock[0])
    sent = []
    real_killpg = os.killpg
    monkeypatch.setattr(supervise.os, "killpg", lambda pid, signum: (sent.append(signum), real_killpg(pid, signum)))
    child = subprocess.Popen(["bash", "-c", 'trap "echo got" TERM HUP; echo ready; while :; do sleep 0.05; done'],
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    next_line = lines_of(child.stdout)
    forwarder = launch.StopForwarder(lambda: [child.pid])
    forwarder.install()
    try:
        assert next_line() == "ready"  # the child's trap is set
        for _ in range(3):  # the terminal, make and the cluster each deliver it, within the window
            os.kill(os.getpid(), signal.SIGTERM)
            clock[0] += 0.1
        received = [next_line()]  # (two signals in flight at once would merge)
        clock[0] += launch.DUPLICATE_SIGNAL_WINDOW_S + 1.0
        os.kill(os.getpid(), signal.SIGHUP)  # a second request, later: passed on
        received.append(next_line())
    finally:
        forwarder.restore()
        child.kill()
        child.wait()
    assert sent == [signal.SIGTERM, signal.SIGHUP] and received == ["got", "got"]
    assert forwarder.first == "SIGTERM" and forwarder.requests == 2
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_cuda_arch_suffixes_are_removed_for_deepspeed():
    assert launch.sanitized_cuda_arch_list("9.0a") == "9.0"
    assert launch.sanitized_cuda_arch_list("8.0;9.0a;10.0a+PTX") == "8.0;9.0;10.0+PTX"


def test_deepspeed_config_fills_from_the_run_config():
    def deepspeed(*overrides: str):
        config = config_module.load(None, list(overrides), check_paths=False)
        return training.deepspeed_config(config, resolve(config, on_cuda=True, bf16_supported=True, world_size=2))

    assert deepspeed() is None
    zero2 = deepspeed("distributed.strategy=deepspeed_zero2")
    assert zero2["zero_optimization"]["stage"] == 2
    assert zero2["train_micro_batch_size_per_gpu"] == "auto" and zero2["gradient_accumulation_steps"] == "auto"
    offload = deepspeed("distributed.strategy=deepspeed_zero2", "distributed.offload_optimizer=true")
    assert offload["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert offload["optimizer"]["params"]["lr"] == "auto"
    zero3 = deepspeed("distributed.strategy=deepspeed_zero3")
    assert zero3["zero_optimization"]["stage"] == 3


def setup_accelerate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/setup_accelerate.py", *args], cwd=REPO, capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, timeout=300, env={**os.environ, **FORKED})


def test_setup_accelerate_auto_writes_yaml_for_multi_gpu_ddp_that_accelerate_reads(tmp_path):
    output = tmp_path / "local.yaml"
    result = setup_accelerate("--auto", "--output", str(output))
    assert result.returncode == 0, result.stderr
    import yaml
    from accelerate.commands.config.config_args import load_config_from_file

    assert not output.read_text().lstrip().startswith("{"), "YAML, not JSON in a .yaml file"
    written = yaml.safe_load(output.read_text())
    assert written["distributed_type"] == "MULTI_GPU", "a config written without GPUs still starts several processes"
    loaded = load_config_from_file(str(output))
    assert loaded.compute_environment.value == "LOCAL_MACHINE"
    again = setup_accelerate("--auto", "--output", str(output))
    assert again.returncode == 2 and "exists" in again.stderr and 'ARGS="--output' in again.stderr
    assert "OUTPUT=" not in again.stderr, "the Makefile has no OUTPUT variable"
    ignored = subprocess.run(["git", "check-ignore", "-q", "configs/accelerate/local.yaml"], cwd=REPO)
    assert ignored.returncode == 0, "the machine-specific config is not committed by accident"


def test_setup_accelerate_wizard_needs_a_terminal_and_keeps_the_existing_file(tmp_path):
    output = tmp_path / "local.yaml"
    output.write_text("mine: true\n")
    result = setup_accelerate("--force", "--output", str(output))
    assert result.returncode == 2 and "AUTO=1" in result.stderr
    assert output.read_text() == "mine: true\n", "FORCE=1 must not delete the file before the wizard can run"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["local.yaml"]


def test_contradictory_wizard_answers_are_one_line_and_keep_the_existing_file(tmp_path):
    """multi-GPU on a machine of one GPU: accelerate's wizard refuses with a ValueError, whose
    traceback (naming our staging file) was all the user saw. Answered through a terminal."""
    import pty
    import select

    output = tmp_path / "local.yaml"
    output.write_text("mine: true\n")
    pid, terminal = pty.fork()
    if pid == 0:  # the child: the make target's command, in a terminal
        os.chdir(REPO)
        os.execv(sys.executable, [sys.executable, "scripts/setup_accelerate.py", "--force", "--output", str(output)])
    seen = b""

    def until(text: bytes, timeout: float = 60.0) -> None:
        nonlocal seen
        deadline = time.monotonic() + timeout
        while text not in seen and time.monotonic() < deadline:
            if select.select([terminal], [], [], 0.2)[0]:
                try:
                    seen += os.read(terminal, 65536)
                except OSError:  # the child ended
                    return
        time.sleep(0.5)  # a menu puts the terminal in raw mode after its text, flushing what came before

    until(b"In which compute environment")
    os.write(terminal, b"\r")  # This machine
    until(b"Which type of machine")
    os.write(terminal, b"\x1b[B" * 4 + b"\r")  # multi-GPU
    for question in (b"How many different machines", b"checked while running", b"torch dynamo", b"DeepSpeed?",
                     b"FullyShardedDataParallel?", b"Megatron-LM", b"How many GPU(s)"):
        until(question)
        os.write(terminal, b"\r")  # the defaults: one machine, one GPU
    until(b"Nothing was written")
    deadline = time.monotonic() + 60
    while (ended := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    if ended[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    status = ended[1]
    text = seen.decode(errors="replace")
    assert os.WEXITSTATUS(status) == 2, text[-3000:]
    assert "Traceback" not in text and ".tmp" not in text, text[-3000:]
    assert ("error: accelerate's wizard refused the answers: Specified distributed type DistributedType.MULTI_GPU "
            "but only using 1 GPU") in text
    assert output.read_text() == "mine: true\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["local.yaml"]


def test_deepspeed_without_gpus_trains_in_fp32_whatever_the_config_asks():
    # transformers refuses 16-bit autocast without a GPU unless use_cpu, which DeepSpeed's process
    # group cannot use: a config that asks for bf16 (or auto, on a CPU with native bf16) must still
    # run under `make train-deepspeed CPU=1`
    from sft_play.precision import resolve_precision

    for asked in ("bf16", "auto"):
        config = config_module.load(REPO / "configs" / "run_tiny.yaml",
                                    ["distributed.strategy=deepspeed_zero2", f"train.mixed_precision={asked}"])
        assert resolve_precision(config, has_gpu=False, bf16_supported=True).mixed == "no"
        assert resolve_precision(config, has_gpu=True, bf16_supported=True).mixed == "bf16"
    ddp = config_module.load(REPO / "configs" / "run_tiny.yaml", ["train.mixed_precision=bf16"])
    assert resolve_precision(ddp, has_gpu=False, bf16_supported=False).mixed == "bf16"  # CPU autocast, use_cpu
