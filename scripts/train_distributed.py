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
    built = build_model_first(config)
    if built:
        return built
    lean_imports.for_training(config)  # bitsandbytes and DeepSpeed only where the run uses them
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):  # before DeepSpeed is imported: it cannot parse "9.0a"
        os.environ["TORCH_CUDA_ARCH_LIST"] = lean_imports.sanitized_cuda_arch_list(os.environ["TORCH_CUDA_ARCH_LIST"])
    with cli.importing():  # after the environment is right: it imports the libraries
        from sft_play.train import train

    return train(config, args.config)


def build_model_first(config: config_module.RunConfig) -> int:
    """Train ``model.build_with`` into ``model.name_or_path`` when that folder is missing (the
    preference default's SFT model): its own run, in a process of its own, as ``make train`` would
    start it. Returns its exit status where it did not finish (0: nothing to build, or built)."""
    import subprocess
    import sys
    from pathlib import Path

    target = Path(config.model.name_or_path)
    if not config.model.build_with or target.is_dir():
        return 0
    if "RANK" in os.environ:
        raise cli.UserError(f"model.name_or_path ({target}) does not exist yet: train it first, with make train "
                            f"CONFIG={config.model.build_with} train.output_dir={target.parent.parent} "
                            f"train.run_name={target.parent.name}, then launch this run")
    print(f"{target} does not exist yet: training it first (model.build_with: {config.model.build_with})", flush=True)
    status = subprocess.call([sys.executable, __file__, "--config", config.model.build_with,
                              f"train.output_dir={target.parent.parent}", f"train.run_name={target.parent.name}"])
    if status == 0 and not target.is_dir():
        raise cli.UserError(f"the run of {config.model.build_with} finished without writing {target}")
    return status


if __name__ == "__main__":
    cli.run(main)
