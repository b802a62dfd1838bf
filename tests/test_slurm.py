"""scripts/slurm_train.sbatch run as SLURM would run it, as far as that goes on one machine:
stub ``srun`` (one task per "node", each a real launcher here), ``scontrol`` and ``squeue``,
and the real make and launcher."""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import subprocess
from pathlib import Path

import pytest

from tests.conftest import FORKED
from tests.test_distributed import TINY, check_two_rank_run

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "slurm_train.sbatch"

STUBS = {
    # every "node" runs the task here, with its own SLURM_NODEID; srun's status is the highest
    "srun": """#!/bin/bash
echo "srun $*" >> "$STUB_LOG"
echo "srun's environment: SFT_PLAY_ARGS=$SFT_PLAY_ARGS" >> "$STUB_LOG"
while [[ $1 == --* ]]; do shift; done
[[ -n ${STUB_SRUN_STATUS:-} ]] && exit "$STUB_SRUN_STATUS"
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
  # (the task sees the job's environment, not the stubs')
  env -u STUB_LOG -u STUB_TIME_LEFT -u REAL_PATH PATH="$REAL_PATH" \
    SLURM_NODEID=$node SLURM_PROCID=$node SLURM_GPUS_ON_NODE=1 "$@" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid"; code=$?; (( code > status )) && status=$code; done
exit $status
""",
    "scontrol": """#!/bin/bash
echo "scontrol $*" >> "$STUB_LOG"
[[ $1 == show ]] && printf '127.0.0.1\\nlocalhost\\n'
exit 0
""",
    "squeue": """#!/bin/bash
echo "$STUB_TIME_LEFT"
""",
    "make": """#!/bin/bash
echo "make $*" >> "$STUB_LOG"
exec /usr/bin/env -u STUB_LOG PATH="$REAL_PATH" make "$@"
""",
}


def stubs(folder: Path) -> dict[str, str]:
    folder.mkdir(parents=True)
    for name, text in STUBS.items():
        (folder / name).write_text(text)
        (folder / name).chmod((folder / name).stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{folder}{os.pathsep}{os.environ['PATH']}", "REAL_PATH": os.environ["PATH"],
            "STUB_LOG": str(folder / "calls.log")}


def sbatch(tmp_path: Path, job_id: int, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run the script as the batch step of job `job_id` on two nodes; returns it and the stub calls."""
    environment = {**os.environ, **stubs(tmp_path / "bin"), "SLURM_JOB_ID": str(job_id), "SLURM_JOB_NAME": "sft-play",
                   "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_CPUS_PER_TASK": "3",
                   "CONFIG": "configs/run_tiny.yaml", "CPU": "1", **env}
    result = subprocess.run(["bash", str(SCRIPT)], cwd=REPO, capture_output=True, text=True, env=environment,
                            timeout=900)
    return result, (tmp_path / "bin" / "calls.log").read_text().splitlines()


def test_the_job_header_asks_for_requeue_and_writes_its_log_where_sbatch_runs():
    header = dict(re.findall(r"^#SBATCH --([a-z-]+)(?:=(.*))?$", SCRIPT.read_text(), re.M))
    assert header["output"] == "slurm-%x-%j.out", "SLURM opens the log before the script runs: no runs/ folder yet"
    assert "requeue" in header and header["signal"] == "TERM@300"
    assert "MULTI_GPU_GUIDE.md" in SCRIPT.read_text()
    guide = (REPO / "docs" / "MULTI_GPU_GUIDE.md").read_text()
    assert "## Pre-emption, time limits and requeue on SLURM" in guide


def test_a_stop_at_the_time_limit_requeues_the_job_and_a_stop_by_hand_does_not(tmp_path):
    at_limit, calls = sbatch(tmp_path / "limit", 123456, STUB_SRUN_STATUS="75", STUB_TIME_LEFT="4:10",
                             ARGS="train.max_steps=4")
    assert at_limit.returncode == 75, at_limit.stderr
    assert calls.count("make --no-print-directory install") == 1, "one install, before the nodes start"
    srun = [c for c in calls if c.startswith("srun ")]
    assert len(srun) == 1 and srun[0].startswith("srun --ntasks-per-node=1 --cpus-per-task=3 bash -c ")
    task = srun[0]
    assert "scripts/launch.py --launcher accelerate" in task and "--node-rank $SLURM_NODEID" in task
    assert "--num-gpus ${SLURM_GPUS_ON_NODE:-8}" in task and "--nnodes 2" in task
    assert "--master-addr 127.0.0.1 --master-port 23456" in task, "the port comes from the job id"
    assert task.endswith("--config configs/run_tiny.yaml train.resume_from=auto"), task
    # the overrides reach the launcher as make passes ARGS, in the environment srun passes on
    assert "srun's environment: SFT_PLAY_ARGS=train.run_name=sft-play-run_tiny train.max_steps=4" in calls
    assert "scontrol requeue 123456" in calls
    by_hand, calls = sbatch(tmp_path / "hand", 123456, STUB_SRUN_STATUS="75", STUB_TIME_LEFT="1-02:00:00")
    assert by_hand.returncode == 75 and not [c for c in calls if "requeue" in c]
    assert "sbatch again with the same CONFIG and RUN_NAME" in by_hand.stdout
    failed, calls = sbatch(tmp_path / "failed", 123456, STUB_SRUN_STATUS="1", STUB_TIME_LEFT="4:10")
    assert failed.returncode == 1 and not [c for c in calls if "requeue" in c]


@pytest.mark.slow
def test_the_job_trains_on_two_nodes(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result, calls = sbatch(tmp_path, 7, MASTER_PORT=str(port), STUB_TIME_LEFT="10:00:00",
                           ARGS=f"{' '.join(TINY)} train.output_dir={tmp_path / 'runs'}", **FORKED)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    assert "2 process(es) on 2 node(s)" in output
    assert "global 8 = micro 4 x accum 1 x world 2" in output  # the global batch counts both nodes
    run_dir = tmp_path / "runs" / "sft-play-run_tiny"
    check_two_rank_run(run_dir, output)
    assert json.loads((run_dir / "summary.json").read_text())["world_size"] == 2
    assert not [c for c in calls if "requeue" in c]
