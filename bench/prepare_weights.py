"""Random weights for the benches' model configs, built on the GPU.

The benches train config-only models (tests/fixtures/model_configs), whose weights SFT-Play
initialises once on the CPU (sft_play.model.materialise_init_weights: fp32 initialisation of a
7-8B model on the CPU plus the write takes minutes). On a GPU they are built in seconds; this
script puts them where the loader looks for them (the same cache folder), so a short GPU lease
is spent measuring. The values differ from the CPU-built ones (a GPU's random numbers are not
the CPU's); what the benches measure (memory, speed, a loss falling from random) does not
depend on them.

Usage: python bench/prepare_weights.py MODEL:DTYPE [MODEL:DTYPE ...]  (MODEL: a fixture name or a config folder)
  e.g. python bench/prepare_weights.py llama-3.1-8b:bfloat16 qwen2.5-0.5b:float32
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from _common import CONFIGS  # bench/ is the script's folder


def prepare(name: str, dtype: str, seed: int = 0) -> str:
    """Build `name`'s weights (a folder of tests/fixtures/model_configs, or any config folder)."""
    import torch
    from transformers import AutoConfig

    from sft_play.architecture import model_class
    from sft_play.model import TORCH_DTYPES, has_weights, init_weights_dir, save_init_weights

    config_dir = CONFIGS / name if (CONFIGS / name).is_dir() else Path(name)
    target = init_weights_dir(str(config_dir), seed, dtype)
    if has_weights(str(target)):
        return f"{name} {dtype}: already in {target}"
    started = time.time()
    torch.manual_seed(seed)
    model_config = AutoConfig.from_pretrained(config_dir)
    with torch.device("cuda"):  # (a vision-language model's class: its encoder's weights too)
        model = model_class(model_config).from_config(model_config, dtype=TORCH_DTYPES[dtype])
    save_init_weights(model, target)
    del model
    torch.cuda.empty_cache()
    return f"{name} {dtype}: built on the GPU in {time.time() - started:.0f} s into {target}"


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("prepare_weights.py builds on a GPU; without one the benches build the weights themselves")
        return 0
    for spec in sys.argv[1:]:
        name, _, dtype = spec.partition(":")
        print(prepare(name, dtype or "bfloat16"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
