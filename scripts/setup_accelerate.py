"""Write an accelerate config into configs/accelerate/: interactively with accelerate's own
wizard, or (--auto) from the detected hardware without questions.

Usage: python scripts/setup_accelerate.py [--auto] [--output configs/accelerate/local.yaml] [--force]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path


from sft_play import cli

DEFAULT_OUTPUT = "configs/accelerate/local.yaml"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--auto", action="store_true", help="no questions: write a config for this machine's GPUs")
    parser.add_argument("--output", default=DEFAULT_OUTPUT, help=f"where to write (default {DEFAULT_OUTPUT})")
    parser.add_argument("--force", action="store_true", help="replace an existing file")
    args = parser.parse_args()
    output = Path(args.output)
    if output.exists() and not args.force:
        raise cli.UserError(f"{output} exists; pass FORCE=1 (--force) to replace it, or OUTPUT=another.yaml")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.unlink(missing_ok=True)

    if args.auto:
        from accelerate.commands.config.default import write_basic_config

        from sft_play import hardware

        facts = hardware.detect()
        if facts.gpus:
            mixed = "bf16" if all(g.bf16_supported for g in facts.gpus) else "fp16"
        else:
            mixed = "no"
        write_basic_config(mixed_precision=mixed, save_location=str(output))
        print(f"wrote {output} for {len(facts.gpus)} GPU(s), mixed precision {mixed}:\n")
        print(output.read_text())
    else:
        if not sys.stdin.isatty():
            raise cli.UserError("the accelerate wizard asks questions and needs a terminal; "
                                "run `make setup-accelerate` in one, or `make setup-accelerate AUTO=1`")
        status = subprocess.call([sys.executable, "-m", "accelerate.commands.accelerate_cli", "config",
                                  "--config_file", str(output)])
        if status != 0:
            return status
        print(f"\nwrote {output}")
    print(f"use it with: make train-distributed ACCELERATE_CONFIG={output}")
    return 0


if __name__ == "__main__":
    cli.run(main)
