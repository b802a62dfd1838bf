"""Train: the entry point every launch target calls.

Runs alone (python), under torchrun, under accelerate launch and under DeepSpeed; every rank
runs the same flow, :func:`sft_play.train.train` (config -> data -> run -> plan -> model ->
SFTTrainer -> train -> save).

Usage: python scripts/train_distributed.py --config configs/run_tiny.yaml [key=value ...]
"""

from __future__ import annotations

import os

from sft_play import stopping

if "RANK" in os.environ:  # a rank a launcher started ends when the launcher does: asked first thing
    stopping.die_with_parent()

from sft_play import cli, lean_imports  # noqa: E402 (after the request above)
from sft_play import config as config_module


def main() -> int:
    args = cli.config_parser(cli.summary(__doc__)).parse_args()
    cli.setup_logging()
    config = config_module.load(args.config, args.overrides)
    lean_imports.for_training(config)  # bitsandbytes and DeepSpeed only where the run uses them
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):  # before DeepSpeed is imported: it cannot parse "9.0a"
        os.environ["TORCH_CUDA_ARCH_LIST"] = lean_imports.sanitized_cuda_arch_list(os.environ["TORCH_CUDA_ARCH_LIST"])
    with cli.importing():  # after the environment is right: it imports the libraries
        from sft_play.train import train

    return train(config, args.config)


if __name__ == "__main__":
    cli.run(main)
