"""Merge a run's LoRA/QLoRA adapter into its base and save a standalone model (safetensors) and
tokenizer (a vision-language model's processor), loadable with transformers' from_pretrained; QLoRA bases are
de-quantised first.

Usage: python scripts/merge.py [--config PATH] [--run RUN_DIR] [--output DIR]   (default RUN_DIR/merged)
"""

from __future__ import annotations


from sft_play import cli, lean_imports


def main() -> int:
    parser = cli.run_parser(cli.summary(__doc__))
    parser.add_argument("--output", help="where to write (default: <run>/merged)")
    args = parser.parse_args()
    cli.setup_logging()

    run = cli.chosen_run(args)
    lean_imports.for_run_folder(run)  # before the model stack is imported

    with cli.importing():
        from sft_play import export
    merged = export.merge(run, args.output)
    model_class = "AutoModelForImageTextToText" if (merged / "processor_config.json").is_file() else "AutoModelForCausalLM"
    print(f"Merged model: {merged}\n  load it: {model_class}.from_pretrained('{merged}')\n"
          f"  try it:  make generate RUN={merged}")
    return 0


if __name__ == "__main__":
    cli.run(main)
