"""Launch training, optionally with TensorBoard beside it.

TensorBoard serves the run's output folder on a free loopback port; its URL is printed before
training starts and it is stopped when training ends (or is interrupted).

Usage: python scripts/launch.py --launcher python [--tensorboard] --config PATH [key=value ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sft_play import cli, launch  # noqa: E402
from sft_play import config as config_module  # noqa: E402


def main() -> int:
    parser = cli.config_parser(__doc__.splitlines()[0])
    parser.add_argument("--launcher", choices=["python"], default="python", help="how training processes start")
    parser.add_argument("--tensorboard", action="store_true", help="serve TensorBoard while training runs")
    args = parser.parse_args()
    config = config_module.load(args.config, args.overrides)  # fail before starting anything

    command = launch.python_command(args.config, args.overrides)
    board = None
    if args.tensorboard:
        board, port = launch.start_tensorboard(config.train.output_dir)
        if launch.wait_for_port(port, process=board):
            print(f"TensorBoard: {launch.loopback_url(port)}  (logs under {config.train.output_dir}/; stops when training ends)", flush=True)
        else:
            print(f"TensorBoard did not start; see {config.train.output_dir}/tensorboard.log", file=sys.stderr)
    try:
        return launch.run_forwarding_signals(command, env=launch.child_env())
    finally:
        if board is not None:
            launch.stop(board)


if __name__ == "__main__":
    cli.run(main)
