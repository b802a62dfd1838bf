"""Write an accelerate config into configs/accelerate/: interactively with accelerate's own
wizard, or (--auto) from the detected hardware without questions.

The file is written beside its destination and moved into place only once complete, so an
existing config survives a wizard that cannot run or is abandoned. --auto writes YAML (accelerate's
own write_basic_config writes JSON whatever the file is called) for multi-GPU DDP: on a machine
without GPUs (a login node) it still describes GPU nodes, whose process count `make
train-distributed` fills in from NUM_GPUS.

Usage: python scripts/setup_accelerate.py [--auto] [--output configs/accelerate/local.yaml] [--force]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


from sft_play import cli

DEFAULT_OUTPUT = "configs/accelerate/local.yaml"


def auto_config(output: Path) -> str:
    """Write the config for this machine's GPUs to `output`; returns what to tell the user."""
    from accelerate.commands.config.config_args import ClusterConfig

    from sft_play import hardware

    gpus = hardware.detect().gpus
    # Precision and sharding are the run's decisions (train.mixed_precision, resolved with the
    # planner; distributed.strategy: ddp or fsdp2); the training processes pin them over whatever
    # an accelerate config says, so this one says "no" and MULTI_GPU
    precision = ("mixed precision from the run config (train.mixed_precision), and the sharding too "
                 "(distributed.strategy: ddp, or fsdp2 for FSDP2)")
    if gpus:
        note = f"for {len(gpus)} GPU(s); {precision}"
    else:
        note = ("for GPU nodes (no GPU here): make train-distributed starts NUM_GPUS processes per node, default "
                f"every GPU of the node it runs on; {precision}")
    ClusterConfig(
        compute_environment="LOCAL_MACHINE", distributed_type="MULTI_GPU", mixed_precision="no",
        num_processes=max(1, len(gpus)), gpu_ids="all", use_cpu=False, debug=False,
        rdzv_backend="static", same_network=True, main_training_function="main",
    ).to_yaml_file(str(output))
    return note


def wizard(output: Path) -> None:
    """accelerate's own questions (``accelerate config``), in this process: answers it refuses
    (multi-GPU on a machine of one GPU, say) are its ValueError, said here in one line."""
    from accelerate.commands.config.config import get_user_input

    try:
        config = get_user_input()
    except ValueError as exc:
        raise cli.UserError(f"accelerate's wizard refused the answers: {exc} Nothing was written") from None
    if output.suffix == ".json":  # as accelerate's own `config` command chooses
        config.to_json_file(str(output))
    else:
        config.to_yaml_file(str(output))


def main() -> int:
    parser = cli.Parser(description=cli.summary(__doc__))
    parser.add_argument("--auto", action="store_true", help="no questions: write a config for this machine's GPUs")
    parser.add_argument("--output", default=DEFAULT_OUTPUT, help=f"where to write (default {DEFAULT_OUTPUT})")
    parser.add_argument("--force", action="store_true", help="replace an existing file")
    args = parser.parse_args()
    output = Path(args.output)
    if output.exists() and not args.force:
        raise cli.UserError(f"{output} exists; pass FORCE=1 (--force) to replace it, or write another file with "
                            f"ARGS=\"--output configs/accelerate/other.yaml\"")
    if not args.auto and not sys.stdin.isatty():
        raise cli.UserError("the accelerate wizard asks questions and needs a terminal; "
                            "run `make setup-accelerate` in one, or `make setup-accelerate AUTO=1`")
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = output.with_name(f".{output.name}.{os.getpid()}.tmp{output.suffix}")
    try:
        if args.auto:
            note = auto_config(staging)
        else:
            wizard(staging)
            note = "with accelerate's wizard"
        staging.replace(output)
    finally:
        staging.unlink(missing_ok=True)
    print(f"wrote {output} {note}:\n")
    print(output.read_text())
    print(f"use it with: make train-distributed ACCELERATE_CONFIG={output}")
    return 0


if __name__ == "__main__":
    cli.run(main)
