"""Distributed training with real processes on the CPU (gloo): DDP through accelerate launch,
DeepSpeed ZeRO-2 through torchrun, and two "nodes" on one machine, all started by the make
targets or the launcher script they call."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from sft_play import config as config_module
from sft_play import launch, training

REPO = Path(__file__).resolve().parents[1]
TINY = ["train.max_steps=4", "train.logging_steps=1", "train.record_samples=true", "train.save_steps=2"]


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


@pytest.mark.slow
def test_make_train_distributed_runs_ddp_on_two_cpu_processes(tmp_path):
    result = make("train-distributed", "CPU=1", "NUM_GPUS=2",
                  f"ARGS={' '.join(TINY)} train.output_dir={tmp_path} train.run_name=ddp")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    assert "launching 2 process(es) on 1 node(s) (accelerate, ddp" in output
    assert "2 process(es) on 1 node(s), DistributedType.MULTI_CPU" in output
    assert "global 8 = micro 4 x accum 1 x world 2" in output
    summary = check_two_rank_run(tmp_path / "ddp", output)
    assert summary["batch"] == "global 8 = micro 4 x accum 1 x world 2"


@pytest.mark.slow
def test_make_train_deepspeed_runs_zero2_on_two_cpu_processes(tmp_path):
    result = make("train-deepspeed", "CPU=1", "NUM_GPUS=2",
                  f"ARGS={' '.join(TINY)} train.output_dir={tmp_path} train.run_name=zero2")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    assert "(torchrun, deepspeed_zero2" in output
    assert "DistributedType.DEEPSPEED" in output
    check_two_rank_run(tmp_path / "zero2", output)
    saved = config_module.load(tmp_path / "zero2" / "config.yaml")
    assert saved.distributed.strategy == "deepspeed_zero2"


@pytest.mark.slow
def test_two_nodes_on_one_machine(tmp_path):
    port = launch.free_port()
    def node(rank: int) -> list[str]:
        return [sys.executable, "scripts/launch.py", "--launcher", "torchrun", "--cpu", "--num-gpus", "1",
                "--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
                "--config", "configs/run_tiny.yaml", *TINY, f"train.output_dir={tmp_path}", "train.run_name=nodes"]

    nodes = [subprocess.Popen(node(rank), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    outputs = [node.communicate(timeout=900)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert "2 process(es) on 2 node(s)" in outputs[0]
    assert "global 8 = micro 4 x accum 1 x world 2" in outputs[0]  # the global batch counts both nodes
    check_two_rank_run(tmp_path / "nodes", outputs[0] + outputs[1])


# --- the launcher's decisions, without processes ---------------------------------------------


def test_taken_port_is_replaced_on_one_node_and_said_so():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        taken = sock.getsockname()[1]
        topology, messages = launch.resolve_topology(2, None, 1, 0, None, taken, True, 0)
    assert topology.master_port != taken
    assert messages == [f"port {taken} is in use: the processes rendezvous on {topology.master_port} instead"]


def test_taken_port_on_a_multi_node_rank_zero_is_an_error():
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        sock.listen()
        taken = sock.getsockname()[1]
        with pytest.raises(launch.LaunchError, match=f"MASTER_PORT={taken} is in use"):
            launch.resolve_topology(1, None, 2, 0, "10.0.0.1", taken, True, 0)


def test_launch_settings_are_checked():
    with pytest.raises(launch.LaunchError, match="no CUDA GPU here"):
        launch.resolve_topology(None, None, 1, 0, None, None, False, 0)
    with pytest.raises(launch.LaunchError, match="NUM_GPUS=4 but only 2"):
        launch.resolve_topology(4, "0,1", 1, 0, None, None, False, 8)
    with pytest.raises(launch.LaunchError, match="NODE_RANK=2"):
        launch.resolve_topology(1, None, 2, 2, "10.0.0.1", None, True, 0)
    with pytest.raises(launch.LaunchError, match="needs MASTER_ADDR"):
        launch.resolve_topology(1, None, 2, 1, None, None, True, 0)
    topology, _ = launch.resolve_topology(None, "0,2", 1, 0, None, None, False, 8)
    assert topology.processes_per_node == 2  # GPUS=0,2 selects two


def test_commands_carry_the_topology():
    topology = launch.Topology(processes_per_node=8, nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=1234)
    command = launch.accelerate_command(topology, "c.yaml", ["train.max_steps=3"])
    assert command[command.index("--num_processes") + 1] == "16"
    assert command[command.index("--machine_rank") + 1] == "1"
    assert command[command.index("--main_process_ip") + 1] == "10.0.0.1"
    assert command[-3:] == ["--config", "c.yaml", "train.max_steps=3"] and "--multi_gpu" not in command
    command = launch.torchrun_command(topology, "c.yaml", [])
    assert command[command.index("--nproc_per_node") + 1] == "8"
    assert command[command.index("--nnodes") + 1] == "2"
    env = launch.child_env(launch.Topology(cpu=True, processes_per_node=2), gpus="0,1")
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and env["DS_ACCELERATOR"] == "cpu"


def test_cuda_arch_suffixes_are_removed_for_deepspeed():
    assert launch.sanitized_cuda_arch_list("9.0a") == "9.0"
    assert launch.sanitized_cuda_arch_list("8.0;9.0a;10.0a+PTX") == "8.0;9.0;10.0+PTX"


def test_deepspeed_config_fills_from_the_run_config():
    assert training.deepspeed_config(config_module.load(None, check_paths=False)) is None
    zero2 = training.deepspeed_config(config_module.load(None, ["distributed.strategy=deepspeed_zero2"]))
    assert zero2["zero_optimization"]["stage"] == 2
    assert zero2["train_micro_batch_size_per_gpu"] == "auto" and zero2["gradient_accumulation_steps"] == "auto"
    offload = training.deepspeed_config(config_module.load(
        None, ["distributed.strategy=deepspeed_zero2", "distributed.offload_optimizer=true"]))
    assert offload["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert offload["optimizer"]["params"]["lr"] == "auto"
    zero3 = training.deepspeed_config(config_module.load(None, ["distributed.strategy=deepspeed_zero3"]))
    assert zero3["zero_optimization"]["stage"] == 3


def test_setup_accelerate_auto_writes_a_config_accelerate_reads(tmp_path):
    output = tmp_path / "local.yaml"
    result = subprocess.run([sys.executable, "scripts/setup_accelerate.py", "--auto", "--output", str(output)],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    from accelerate.commands.config.config_args import load_config_from_file

    loaded = load_config_from_file(str(output))
    assert loaded.compute_environment.value == "LOCAL_MACHINE"
    again = subprocess.run([sys.executable, "scripts/setup_accelerate.py", "--auto", "--output", str(output)],
                           cwd=REPO, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "exists" in again.stderr


def test_setup_accelerate_wizard_needs_a_terminal(tmp_path):
    result = subprocess.run([sys.executable, "scripts/setup_accelerate.py", "--output", str(tmp_path / "x.yaml")],
                            cwd=REPO, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)
    assert result.returncode == 2 and "AUTO=1" in result.stderr
