"""Merge a run's LoRA/QLoRA adapter into its base and save a standalone model (safetensors) and
tokenizer, loadable with AutoModelForCausalLM.from_pretrained; QLoRA bases are de-quantised first.

Usage: python scripts/merge.py [--config PATH] [--run RUN_DIR] [--output DIR]   (default RUN_DIR/merged)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sft_play import cli  # noqa: E402
from sft_play import config as config_module  # noqa: E402


def main() -> int:
    parser = cli.config_parser(__doc__.splitlines()[0])
    parser.add_argument("--run", help="run folder (default: the newest finished run under train.output_dir)")
    parser.add_argument("--output", help="where to write (default: <run>/merged)")
    args = parser.parse_args()
    cli.setup_logging()

    from sft_play import export

    output_dir = config_module.load(args.config, args.overrides, check_paths=False).train.output_dir
    run = export.resolve_run(args.run, output_dir)
    merged = export.merge(run, args.output)
    print(f"Merged model: {merged}\n  load it: AutoModelForCausalLM.from_pretrained('{merged}')\n"
          f"  try it:  make generate RUN={merged}")
    return 0


if __name__ == "__main__":
    cli.run(main)
