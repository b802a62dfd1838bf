"""A shape to measure (model, method, workload, micro-batch), its task, and the weights it trains
from: what bench/lease.py and bench/memory_snapshot.py share, so that neither imports the other."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from _common import CONFIGS, REPO, worker_env  # bench/ is the script's folder

# The long-row levers a shape can switch on, as the run's config overrides
# (a tiled MLP recomputes each tile without replaying its random numbers: LoRA's dropout must be off)
ROW_LEVERS = {"tiled": ("train.tiled_mlp=true",), "offload": ("train.offload_activations=true",),
              "dropout0": ("lora.dropout=0",)}


@dataclass(frozen=True)
class Shape:
    """A P or S task of bench/lease.py: one model shape, method and workload at one micro-batch."""

    model: str  # a fixture name (tests/fixtures/model_configs) or a config folder
    method: str = "lora"
    seq_len: int = 2048
    checkpointing: bool = True
    micro: int = 2
    layers: int | None = None  # keep only the first N decoder layers (a shape a short lease can build)
    levers: tuple[str, ...] = ()  # long-row levers on (ROW_LEVERS)
    pixels: int = 0  # vision-language: each row shows one square image of this many pixels
    objective: str = "sft"  # dpo: `micro` pairs a step, prompts and answers of half seq_len each; kto: `micro`
    # answers a step, labelled desirable and undesirable in turn, with their mismatched rows
    steps: int = 3

    def __post_init__(self):  # (a shape read back from JSON has lists)
        object.__setattr__(self, "levers", tuple(self.levers))

    def fields(self) -> dict:
        """The shape as JSON holds it (and gives it back): a task's or a trace's."""
        return {**asdict(self), "levers": list(self.levers)}

    @property
    def label(self) -> str:
        cut = f" ({self.layers} layers)" if self.layers else ""
        extra = "".join(f" +{lever}" for lever in self.levers) + (f" {self.pixels:,} px" if self.pixels else "") + (
            f" {self.objective}" if self.objective != "sft" else "")
        return f"{Path(self.model).name}{cut} {self.method}{extra} {self.seq_len} ckpt " \
               f"{'on' if self.checkpointing else 'off'} micro {self.micro}"

    @classmethod
    def parse(cls, text: str) -> "Shape":
        """``FOLDER[,method=lora][,seq=2048][,ckpt=on][,micro=2][,layers=N][,pixels=N][,objective=dpo|kto]
        [,steps=3][,tiled][,offload]``"""
        folder, *fields = text.split(",")
        values: dict = {"model": folder}
        levers = []
        for field in fields:
            key, _, value = field.partition("=")
            key = {"seq": "seq_len", "ckpt": "checkpointing"}.get(key.strip(), key.strip())
            if key in ROW_LEVERS and not value:
                levers.append(key)
                continue
            if key not in {"method", "seq_len", "checkpointing", "micro", "layers", "pixels", "objective", "steps"} \
                    or not value:
                raise ValueError(f"--shape {text}: '{field}' is not one of method=, seq=, ckpt=, micro=, layers=, "
                                 f"pixels=, objective=, steps= or a lever ({', '.join(ROW_LEVERS)})")
            values[key] = (value.lower() in {"on", "true", "1", "yes"} if key == "checkpointing" else
                           value if key in {"method", "objective"} else int(value))
        values["levers"] = tuple(levers)
        if values.get("method", "lora") not in {"full", "lora", "qlora"}:
            raise ValueError(f"--shape {text}: method must be full, lora or qlora")
        if values.get("objective", "sft") not in {"sft", "dpo", "kto"}:
            raise ValueError(f"--shape {text}: objective must be sft, dpo or kto")
        if not (CONFIGS / folder).is_dir() and not (Path(folder) / "config.json").is_file():
            raise ValueError(f"--shape {text}: '{folder}' is neither a folder with a config.json nor a fixture of "
                             f"{CONFIGS.relative_to(REPO)}")
        return cls(**values)


def shape_task(shape: Shape, phase: int) -> dict:
    return {"key": f"P {shape.label}", "kind": "P", "phase": phase, "shape": shape.fields()}


def model_folder(task: dict) -> str:
    """The config folder a task trains (a layer cut is written once into the cache, from the fixture)."""
    if "shape" not in task:
        return task["case"]["model"]
    shape = Shape(**task["shape"])
    folder = CONFIGS / shape.model if (CONFIGS / shape.model).is_dir() else Path(shape.model)
    return str(cut_layers(folder, shape.layers) if shape.layers else folder)


def cut_layers(folder: Path, layers: int) -> Path:
    """A copy of `folder`'s config.json that keeps only the first `layers` decoder layers (lists
    with one entry per layer cut to match)."""
    from sft_play.paths import cache_dir

    config = json.loads((folder / "config.json").read_text())
    for section in [config] + ([config["text_config"]] if isinstance(config.get("text_config"), dict) else []):
        if "num_hidden_layers" not in section:
            continue
        total = section["num_hidden_layers"]
        section["num_hidden_layers"] = min(layers, total)
        for key, value in list(section.items()):
            if isinstance(value, list) and len(value) == total:
                section[key] = value[:layers]
        if isinstance(section.get("mlp_only_layers"), list):
            section["mlp_only_layers"] = [i for i in section["mlp_only_layers"] if i < layers]
    target = cache_dir() / "lease_configs" / f"{folder.name}-{layers}-layers"
    target.mkdir(parents=True, exist_ok=True)
    text = json.dumps(config, indent=1, sort_keys=True) + "\n"
    if not (target / "config.json").exists() or (target / "config.json").read_text() != text:
        (target / "config.json").write_text(text)
    return target


def weights_for(task: dict) -> tuple[str, str, Path | None]:
    """(config folder, dtype, the folder SFT-Play loads its random weights from; None when the
    folder has weights of its own, which the workers load as they are)."""
    from sft_play import config as config_module
    from sft_play.model import has_weights, init_weights_dir
    from sft_play.precision import init_weights_dtype

    folder = model_folder(task)
    if has_weights(folder):
        return folder, "", None
    method = task["shape"]["method"] if "shape" in task else task["case"]["method"]
    config = config_module.load(None, [f"model.name_or_path={folder}", f"finetune.method={method}"],
                                check_paths=False, check_packages=False)  # this process skips bitsandbytes (lean)
    dtype = init_weights_dtype(config)
    return folder, dtype, init_weights_dir(folder, config.model.init_seed, dtype)


def build_weights(folder: str, dtype: str, timeout: int) -> str:
    """bench/prepare_weights.py in a fresh process (its CUDA context leaves with it): what it said."""
    try:
        result = subprocess.run([sys.executable, str(REPO / "bench" / "prepare_weights.py"), f"{folder}:{dtype}"],
                                capture_output=True, text=True, timeout=timeout, env=worker_env())
    except subprocess.TimeoutExpired:
        return "timed out"
    said = (result.stdout.strip().splitlines() or result.stderr.strip().splitlines() or ["no output"])[-1]
    return said if result.returncode == 0 else f"failed: {said[:300]}"
