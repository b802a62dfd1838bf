"""Launch training: one process, DDP under accelerate, or DeepSpeed under torchrun, on one or
many nodes, optionally with TensorBoard beside it.

The config is validated before anything starts. On one node the processes meet on a port
torchrun picks; on several, at MASTER_ADDR:MASTER_PORT, saying how many nodes are missing while
they wait. A stop signal is passed on to the training processes once, and they get
distributed.stop_timeout_minutes to save; the exit status is theirs (75: stopped after saving,
resume to finish). TensorBoard serves the output folder on a free loopback port; its URL is
printed before training starts and it is stopped when training ends.

Usage: python scripts/launch.py --launcher {python,accelerate,torchrun} [--num-gpus N] [--gpus 0,1]
         [--nnodes N --node-rank R --master-addr A --master-port P] [--cpu] [--tensorboard]
         --config PATH [key=value ...]
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path


from sft_play import cli, launch
from sft_play import config as config_module
from sft_play.parallelism import Strategy


def visible_gpu_count() -> int:
    from sft_play import hardware

    return len(hardware.detect().gpus)


def main() -> int:
    parser = cli.config_parser(cli.summary(__doc__))
    parser.add_argument("--launcher", choices=["python", "accelerate", "torchrun"], default="python")
    parser.add_argument("--num-gpus", type=cli.number(int, "NUM_GPUS"), help="processes per node (default: every selected GPU)")
    parser.add_argument("--gpus", help="GPUs to use, e.g. 0,1 (sets CUDA_VISIBLE_DEVICES)")
    parser.add_argument("--nnodes", type=cli.number(int, "NNODES"), default=1)
    parser.add_argument("--node-rank", type=cli.number(int, "NODE_RANK"), default=0)
    parser.add_argument("--master-addr")
    parser.add_argument("--master-port", type=cli.number(int, "MASTER_PORT"))
    parser.add_argument("--cpu", action="store_true", help="CPU processes (gloo): for tests and GPU-less machines")
    parser.add_argument("--oversubscribe", action="store_true", help="with --cpu: more processes than cores")
    parser.add_argument("--deepspeed", action="store_true",
                        help="train with DeepSpeed: ZeRO-2 unless the config already names a deepspeed_* strategy")
    parser.add_argument("--accelerate-config", default=str(launch.ACCELERATE_DDP_CONFIG),
                        help="accelerate config for --launcher accelerate (default configs/accelerate/ddp.yaml)")
    parser.add_argument("--tensorboard", action="store_true", help="serve TensorBoard while training runs")
    args = parser.parse_args()
    if args.deepspeed:
        # the strategy the config names, read without what only DeepSpeed allows (rows split by
        # sequence parallelism), which the switch to ZeRO-2 below makes valid
        named = config_module.load(args.config, [*args.overrides, "distributed.sequence_parallel=1"]).distributed.strategy
        if Strategy(named).fsdp:
            raise cli.UserError("make train-deepspeed trains with DeepSpeed, and the config says "
                                "distributed.strategy=fsdp2: use make train-distributed for FSDP2, or set "
                                "distributed.strategy=deepspeed_zero2 (or deepspeed_zero3)")
        if not Strategy(named).deepspeed:
            print(f"distributed.strategy {named} -> deepspeed_zero2 (make train-deepspeed)", flush=True)
            args.overrides.append("distributed.strategy=deepspeed_zero2")
    config = config_module.load(args.config, args.overrides)  # fail before starting anything

    topology = None
    timeouts = launch.Timeouts.from_config(config.distributed)
    if args.launcher == "python":
        command = launch.python_command(args.config, args.overrides)
    else:
        try:
            topology, messages = launch.resolve_topology(
                args.num_gpus, args.gpus, args.nnodes, args.node_rank, args.master_addr, args.master_port,
                args.cpu, 0 if args.cpu else visible_gpu_count(), args.oversubscribe,
            )
        except launch.LaunchError as exc:
            raise cli.UserError(str(exc)) from None
        problems = config_module.consistency_problems(config, topology.world_size, args.cpu)  # before any rank
        if problems:  # starts (each would say it)
            raise cli.UserError("\n".join(problems))
        for message in messages:
            print(message, flush=True)
        if args.launcher == "accelerate":
            command = launch.accelerate_command(topology, args.config, args.overrides, Path(args.accelerate_config),
                                                timeouts, sharded=Strategy(config.distributed.strategy).fsdp)
        else:
            command = launch.torchrun_command(topology, args.config, args.overrides, timeouts)
        print(f"launching {topology.world_size} process(es) on {topology.nnodes} node(s) "
              f"({args.launcher}, {config.distributed.strategy}, rendezvous {topology.rendezvous()})", flush=True)
    board = None
    env = launch.child_env(topology, args.gpus, timeouts, cpu=args.cpu)
    try:
        if args.tensorboard and args.node_rank == 0:
            launch.interrupt_on_termination()  # until training starts: then the signals are passed on to it
            board, port = launch.start_tensorboard(config.train.output_dir)
            if launch.wait_for_port(port, process=board):
                print(f"TensorBoard: {launch.loopback_url(port)}  (logs under {config.train.output_dir}/; "
                      "stops when training ends)", flush=True)
            else:
                print(f"TensorBoard did not start; see {config.train.output_dir}/tensorboard.log", file=sys.stderr)
        if topology is None:
            return launch.run_process(command, env, timeouts)
        os.environ.update(env)  # the launcher runs in this process and starts the training processes
        status = launch.run_launcher(command, topology, timeouts, exclude=lambda: {board.pid} if board else set())
    finally:
        if board is not None:
            launch.stop(board)
    if status != 0 and any(t.daemon and t.is_alive() for t in threading.enumerate()):
        # torchrun's agent (or the rendezvous store of a node that never came) is still blocked in
        # C++ on its thread: tearing the interpreter down around it aborts the process ("terminate
        # called without an active exception") after the error was said. Leave with the status.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


if __name__ == "__main__":
    cli.run(main)
