"""Serve TensorBoard for one run folder (or every run under the config's output folder) on a
free loopback port, in the foreground; Ctrl-C, SIGTERM or SIGHUP stops it (TensorBoard runs in
its own session, so it is stopped here, never left behind).

Usage: python scripts/serve_tensorboard.py [--config PATH] [--run RUN_DIR]
"""

from __future__ import annotations

from pathlib import Path

from sft_play import cli, launch
from sft_play import config as config_module


def main() -> int:
    parser = cli.config_parser(cli.summary(__doc__))
    parser.add_argument("--run", help="run folder (default: every run under train.output_dir)")
    args = parser.parse_args()
    if args.run:
        logdir = Path(args.run)
        if not logdir.is_dir():
            raise cli.UserError(f"run folder '{args.run}' does not exist")
        if not (_events(logdir) or (logdir / "config.yaml").is_file()):
            raise cli.UserError(f"'{args.run}' is not a run folder (no config.yaml) and holds no TensorBoard "
                                "event files; name a folder under train.output_dir, or leave RUN out for every run")
    else:
        logdir = Path(config_module.load(args.config, args.overrides, check_paths=False).train.output_dir)
    if not _events(logdir):
        print(f"No TensorBoard event files under {logdir} yet: runs write them while they train (unless "
              "train.tensorboard=false), and TensorBoard shows them as they appear.", flush=True)
    launch.interrupt_on_termination()
    board = None
    try:
        board, port = launch.start_tensorboard(logdir)
        if not launch.wait_for_port(port, process=board):
            raise cli.UserError(f"TensorBoard did not start; see {logdir / 'tensorboard.log'}")
        print(f"TensorBoard: {launch.loopback_url(port)}  (serving {logdir}; Ctrl-C stops it)", flush=True)
        return board.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        if board is not None:
            launch.stop(board)

def _events(folder: Path) -> bool:
    """Whether `folder` holds TensorBoard event files at any depth."""
    return next(folder.rglob("events.out.tfevents*"), None) is not None


if __name__ == "__main__":
    cli.run(main)
