"""The ``sft-play`` command: each make target's script as a subcommand, with the same arguments
(``sft-play plan --config C --gpus 8`` is ``python scripts/plan.py --config C --gpus 8``; the
launch targets with the flags their make target passes, ``sft-play train-deepspeed --cpu
--num-gpus 2 --config C``). The Makefile keeps calling the scripts; this finds them beside the
package, as ``make install`` installs it (editable, from the checkout), and runs one as Python
runs a file. Nothing here imports the package's rooms: ``sft-play --help`` answers at once."""

from __future__ import annotations

import difflib
import runpy
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"

# subcommand: (script, the arguments its make target puts before the user's, what it does)
COMMANDS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "check": ("check.py", (), "validate a config, the environment, the data, the output folder and the disk"),
    "gpu-info": ("gpu_info.py", (), "this machine's GPUs, CPU and RAM"),
    "plan": ("plan.py", (), "plan a run's batch, per-GPU memory and time before any weight loads"),
    "data-stats": ("data_stats.py", (), "a config's data as training sees it"),
    "setup-accelerate": ("setup_accelerate.py", (), "write configs/accelerate/local.yaml"),
    "train": ("train_distributed.py", (), "train in one process"),
    "train-tb": ("launch.py", ("--launcher", "python", "--tensorboard"), "train in one process, with TensorBoard"),
    "train-distributed": ("launch.py", ("--launcher", "accelerate", "--accelerate-config",
                                        str(SCRIPTS.parent / "configs" / "accelerate" / "ddp.yaml")),
                          "DDP or FSDP2 on several GPUs (--num-gpus N; --cpu: CPU processes), via accelerate"),
    "train-deepspeed": ("launch.py", ("--launcher", "torchrun", "--deepspeed"),
                        "DeepSpeed ZeRO on several GPUs (--num-gpus N; --cpu: CPU processes), via torchrun"),
    "launch": ("launch.py", (), "launch training with the launcher named (--launcher python|accelerate|torchrun)"),
    "tensorboard": ("serve_tensorboard.py", (), "serve TensorBoard for a run"),
    "generate": ("generate.py", (), "answer a prompt (or held-out prompts) with a run"),
    "chat": ("chat.py", (), "chat with a run in the terminal"),
    "eval": ("evaluate.py", (), "a run's validation loss, perplexity and held-out generations"),
    "merge": ("merge.py", (), "merge a run's adapter into its base"),
    "planner-check": ("planner_check.py", (), "the planner's error on your hardware, from finished runs"),
    "clean-cache": ("clean_cache.py", (), "what the cache holds, and delete what runs have left"),
    "config-reference": ("config_reference.py", (), "write docs/CONFIG.md from the config schema"),
}


def usage() -> str:
    lines = ["usage: sft-play COMMAND [arguments]   (sft-play COMMAND --help: its arguments)", "", "commands:"]
    lines += [f"  {name:<18} {said}" for name, (_, _, said) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, *rest = argv
    if name not in COMMANDS:
        near = difflib.get_close_matches(name, COMMANDS, n=1)
        print(f"error: sft-play has no command '{name}'" + (f"; did you mean '{near[0]}'?" if near else "")
              + " (sft-play --help lists them)", file=sys.stderr)
        return 2
    script_name, preset, _ = COMMANDS[name]
    script = SCRIPTS / script_name
    if not script.is_file():
        print(f"error: sft-play runs the scripts of a source checkout ({script} is missing): install the "
              "package from one with make install", file=sys.stderr)
        return 2
    sys.argv = [str(script), *preset, *rest]
    runpy.run_path(str(script), run_name="__main__")  # (a script ends the process with its own status)
    return 0


if __name__ == "__main__":
    sys.exit(main())
