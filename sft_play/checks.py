"""Pre-flight checks for ``make check``: the config, the environment, the data, the output
folder and the disk. Each check returns a :class:`Check`; none of them loads weights."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from sft_play.config import ConfigError, RunConfig
from sft_play.errors import UserError
from sft_play.hardware import HardwareInfo
from sft_play.parallelism import Strategy
from sft_play.units import GIB, MIB

REQUIREMENTS = Path(__file__).resolve().parents[1] / "requirements.txt"


@dataclass
class Check:
    """One line of the report: what was checked, whether it passed, and the detail."""

    name: str
    ok: bool
    detail: str
    warning: bool = False  # passed, but worth a look

    def line(self) -> str:
        mark = "WARN" if self.ok and self.warning else ("PASS" if self.ok else "FAIL")
        return f"[{mark}] {self.name}: {self.detail}"


def pinned_requirements(path: Path = REQUIREMENTS) -> dict[str, str]:
    """Package name -> pinned version, from requirements.txt."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[name.strip().lower()] = version.strip()
    return pins


def check_python() -> Check:
    version = sys.version.split()[0]
    ok = sys.version_info >= (3, 10)
    return Check("python", ok, version + ("" if ok else " (3.10 or newer is needed)"))


def check_packages(config: RunConfig | None) -> list[Check]:
    """Every pinned package installed, at its pin (a different version is a warning)."""
    checks = []
    needed_only_for = {
        "bitsandbytes": "qlora or 8-bit optimizers",
        "deepspeed": "distributed.strategy deepspeed_*",
    }
    for name, pin in pinned_requirements().items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            optional = name in needed_only_for and config is not None and not _needs(config, name)
            reason = f"not installed (pinned {pin}); run `make install`"
            if optional:
                checks.append(Check(f"package {name}", True, f"not installed; only needed for {needed_only_for[name]}", True))
            else:
                checks.append(Check(f"package {name}", False, reason))
            continue
        same = installed.split("+")[0] == pin
        checks.append(Check(f"package {name}", True, installed if same else f"{installed} (pinned {pin})", not same))
    return checks


def check_patches() -> list[Check]:
    """Each change the package makes to a library (:mod:`sft_play.patches`), with the versions it
    was written for: a warning where the installed library is outside them."""
    from sft_play import patches

    return [Check(f"patch {patch.target}", True, problem or f"{patch.library} {version or 'not installed'} "
                  f"(written for {patch.written_for}): {patch.why}", problem is not None)
            for patch, version, problem in patches.listed()]


def _needs(config: RunConfig, package: str) -> bool:
    if package == "bitsandbytes":
        return config.finetune.method == "qlora" or "8bit" in config.train.optimizer
    if package == "deepspeed":
        return Strategy(config.distributed.strategy).deepspeed
    return True


def check_accelerator(facts: HardwareInfo) -> Check:
    if not facts.gpus:
        return Check("cuda", True, "no CUDA GPU: training runs on the CPU (fine for the tiny default)", True)
    names = ", ".join(sorted({g.name for g in facts.gpus}))
    free = min(g.free_bytes for g in facts.gpus) / GIB
    detail = (
        f"{len(facts.gpus)} GPU(s) ({names}), smallest free {free:.1f} GiB, driver {facts.driver_version}, "
        f"CUDA {facts.cuda_runtime_version}, NCCL {facts.nccl_version or 'not found'}"
    )
    return Check("cuda", True, detail, warning=facts.nccl_version is None and len(facts.gpus) > 1)


def check_precision(config: RunConfig, facts: HardwareInfo) -> Check:
    """The autocast mode and weights dtype the run would train in here, and why."""
    from sft_play.precision import resolve_precision

    precision = resolve_precision(config, has_gpu=facts.has_gpu, bf16_supported=facts.bf16_supported(facts.has_gpu))
    compute = "fp32" if precision.mixed == "no" else f"{precision.mixed} autocast"
    detail = f"{compute}, {precision.weights_dtype} weights ({precision.reason})"
    if precision.warning:
        detail += f"; {precision.warning}"
    return Check("precision", True, detail, warning=precision.warning is not None)


def check_model(config: RunConfig) -> list[Check]:
    """The model's config reads (a hub id: downloaded or cached), and its tokenizer encodes text."""
    from sft_play.architecture import load_model_config
    from sft_play.model import load_tokenizer  # deferred: imports torch

    name = config.model.name_or_path
    try:
        model_config = load_model_config(name, config.model.revision, config.model.trust_remote_code)
    except UserError as exc:
        return [Check("model", False, str(exc))]
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    checks = [Check("model", True, f"{name}: {getattr(model_config, 'model_type', '?')}, "
                                   f"{getattr(text, 'num_hidden_layers', '?')} layers, vocabulary {getattr(text, 'vocab_size', '?')}")]
    try:
        ensure_positions(config)
    except UserError as exc:
        checks.append(Check("sequence length", False, str(exc)))
    from sft_play.architecture import parameter_count
    from sft_play.model import random_init_warning, weights_source

    ok, detail = weights_source(config)
    warning = random_init_warning(name, parameter_count(model_config)) if "initialised from" in detail else None
    checks.append(Check("weights", ok, warning or detail, warning=bool(warning)))
    try:
        tokenizer = load_tokenizer(config)
        checks.append(Check("tokenizer", True, f"{len(tokenizer)} tokens, from "
                                               f"{config.model.tokenizer_name_or_path or name}"))
    except UserError as exc:
        checks.append(Check("tokenizer", False, str(exc)))
        return checks
    from sft_play.model import load_processor

    try:
        processor = load_processor(config, tokenizer)
        if processor is not None:
            checks.append(Check("processor", True, f"{type(processor).__name__} (vision-language model)"))
    except UserError as exc:
        checks.append(Check("processor", False, str(exc)))
    return checks


def check_data(config: RunConfig) -> list[Check]:
    """Every row of the training (and validation) data reads and converts; data with images meets a
    model and settings that can train on it (:func:`check_images`)."""
    from sft_play.data import DataStats, iter_records
    from sft_play.data.formats import InvalidRow
    from sft_play.data.pipeline import ORIGIN
    from sft_play.data.sources import HELD_OUT
    from sft_play.data.stats import special_text_note
    from sft_play.data.tokenize import markers_in

    checks = []
    sources = [("data.path", config.data.path)]
    if config.data.validation_path:
        sources.append(("data.validation_path", config.data.validation_path))
    pictured = 0
    markers = _text_markers(config)
    for key, paths in sources:
        stats = DataStats()
        records = images = 0
        try:
            for record in iter_records(paths, config.data, stats, None if key == "data.path" else HELD_OUT,
                                       pairs=config.finetune.objective != "sft"):
                records += 1
                images += bool(record.get("images"))
                if markers and markers_in(record, markers):
                    stats.special_text += 1
                    if len(stats.special_text_rows) < 3:
                        stats.special_text_rows.append(record.get(ORIGIN) or f"record {records}")
        except (InvalidRow, ValueError, FileNotFoundError, UserError) as exc:
            checks.append(Check(key, False, str(exc)))
            continue
        pictured += images
        formats = ", ".join(sorted(set(stats.formats.values())))
        what = {"sft": "records", "kto": "preference records (KTO answers, or pairs split into two)"}.get(
            config.finetune.objective, "preference pairs")
        if config.finetune.objective not in ("sft", "kto") and "unpaired" in stats.formats.values():
            checks.append(Check(key, False, f"answers labelled one by one (KTO's unpaired format) have no pairs for "
                                f"finetune.objective={config.finetune.objective}; set finetune.objective=kto"))
            continue
        detail = f"{records} {what} ({formats})" + (f", {images} with images" if images else "")
        if stats.skipped:
            from sft_play.data import skip_summary

            detail += f"; would be {skip_summary(stats)}"
        checks.append(Check(key, bool(records), detail if records else "no usable records", bool(stats.skipped)))
        note = special_text_note(stats, config.data.special_tokens_in_text)
        if note:
            refused = config.data.special_tokens_in_text == "refuse" and config.data.on_invalid == "error"
            checks.append(Check(f"{key} special tokens", not refused, note, warning=not refused))
    if pictured:
        checks.append(check_images(config))
    return checks


def _text_markers(config: RunConfig) -> tuple[str, ...]:
    """The special tokens of the run's tokenizer that text can spell (none where it does not load:
    the tokenizer's own check says why)."""
    from sft_play.data.tokenize import text_markers
    from sft_play.model import load_tokenizer

    try:
        return text_markers(load_tokenizer(config))
    except (UserError, OSError, ValueError):
        return ()


def check_images(config: RunConfig) -> Check:
    """Data with images meets a model and settings that can train on them: a vision-language model,
    no packing, and rows long enough for an image where the config tells what one costs (what
    preparing the data would refuse, said before it runs)."""
    from sft_play.architecture import image_tokens, is_vision_language, load_model_config

    try:
        model_config = load_model_config(config.model.name_or_path, config.model.revision,
                                         config.model.trust_remote_code)
    except UserError as exc:
        return Check("images", False, str(exc))
    if not is_vision_language(model_config):
        return Check("images", False, f"the data shows images, and {config.model.name_or_path} is a text model (no "
                                      "vision encoder): choose a vision-language model, or data without images")
    if config.data.packing:
        return Check("images", False, "data.packing joins examples into rows, which examples with images cannot "
                                      "share: set data.packing=false for data with images")
    known = image_tokens(model_config, config.data.image_max_pixels)
    if known and known[0] >= config.data.max_seq_length:
        return Check("images", False, f"an image costs up to {known[0]:,} tokens besides its marks ({known[1]}), and "
                                      f"data.max_seq_length={config.data.max_seq_length} cannot hold one: every "
                                      "example with an image would be left out; raise it (or lower "
                                      "data.image_max_pixels where the processor sizes images by pixels)")
    cost = (f"up to {known[0]:,} tokens an image besides its marks ({known[1]})" if known else
            "tokens an image costs: the processor's")
    return Check("images", True, f"a vision-language model, rows unpacked, {cost}")


def check_output_dir(config: RunConfig) -> Check:
    root = Path(config.train.output_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".write-test-"):
            pass
    except OSError as exc:
        return Check("output folder", False, f"cannot write to '{root}': {exc.strerror}")
    return Check("output folder", True, f"'{root}' is writable")


def check_disk(config: RunConfig, needed_bytes: int | None, probe: Path | None = None) -> Check:
    """Free space under the output folder against what the run's checkpoints need."""
    root = Path(config.train.output_dir)
    probe = probe if probe is not None and probe.exists() else (root if root.exists() else Path(os.getcwd()))
    free = shutil.disk_usage(probe).free
    if needed_bytes is None:
        return Check("disk", True, f"{free / GIB:.1f} GiB free (checkpoint size unknown)", True)
    ok = free >= needed_bytes
    need = f"{needed_bytes / GIB:.2f} GiB" if needed_bytes >= GIB // 10 else f"{needed_bytes / MIB:.1f} MiB"
    detail = f"{free / GIB:.1f} GiB free, checkpoints need about {need}"
    if not ok:
        detail += "; free space, lower train.save_total_limit, or point train.output_dir elsewhere"
    return Check("disk", ok, detail)


def check_config(path: str, overrides: list[str]) -> tuple[RunConfig | None, Check]:
    from sft_play import config as config_module

    try:
        config = config_module.load(path, overrides)
    except ConfigError as exc:
        return None, Check("config", False, str(exc))
    config, stand_in = config_module.as_built(config)
    return config, Check("config", True, f"{path} is valid" + (f"; {stand_in}" if stand_in else ""))


def needed_disk_bytes(config: RunConfig, shape, run) -> int:
    """Disk the run's checkpoints and final model need (see :mod:`sft_play.planner.simulate.disk`), from
    the resolved run's precision and optimizer."""
    from sft_play.planner.simulate.disk import run_disk_bytes

    train = config.train
    return run_disk_bytes(shape, run.method, run.precision, run.optimizer, train.save_steps, train.save_total_limit)


def ensure_positions(config: RunConfig) -> None:
    """Refuse a ``data.max_seq_length`` beyond the positions the model was trained on, unless
    ``data.beyond_model_positions`` says it is meant (before any data is read or packed: packing
    sizes its rows by it). A model whose config cannot be read here is left to the loader.

    Raises:
        UserError: with the model's limit and the two ways on.
    """
    from sft_play.architecture import config_int, load_model_config, text_config

    if config.data.beyond_model_positions:
        return
    try:
        model_config = load_model_config(config.model.name_or_path, config.model.revision, config.model.trust_remote_code)
    except (OSError, ValueError, UserError):
        return
    limit = config_int(text_config(model_config), "max_position_embeddings", "n_positions", "max_sequence_length")
    if limit and config.data.max_seq_length > limit:
        raise UserError(f"data.max_seq_length={config.data.max_seq_length:,} is beyond the {limit:,} positions "
                        f"{config.model.name_or_path} was trained on (max_position_embeddings): lower it to {limit:,}, "
                        "or set data.beyond_model_positions=true where that is meant (an extended context, or packed "
                        "rows of examples that each fit)")


def ensure_disk_room(config: RunConfig, run_dir: Path, shape, run) -> None:
    """Refuse to start when the disk under `run_dir` cannot hold the run's checkpoints and model.

    Raises:
        UserError: with the sizes and what to do.
    """

    check = check_disk(config, needed_disk_bytes(config, shape, run), probe=run_dir)
    if not check.ok:
        raise UserError(f"not enough disk for this run: {check.detail}")


def run_checks(config: RunConfig, facts: HardwareInfo) -> list[Check]:
    """``make check``'s lines of the run as training would resolve it here (the planner's target for
    this machine): what it refuses on these processes and devices with this model
    (:func:`sft_play.config.consistency_problems`), and the disk, with the exact model shape when
    its config can be read (a hub id while offline cannot; then free space alone)."""
    from sft_play import planner  # deferred: the planner imports torch

    try:
        shape = planner.model_shape(config)
    except OSError:
        return [check_disk(config, None)]
    target = planner.target_for(facts, allow_cpu=True)
    try:
        run = planner.resolve_for(config, target, None, shape)
    except UserError as exc:  # (a warning: a launch of fewer processes, or elsewhere, may take it)
        refused = str(exc).replace("\n", "; ")
        return [Check("run here", True, f"{target.device_name}, every device training, would refuse it: {refused}",
                      warning=True), check_disk(config, None)]
    here = Check("run here", True, f"{target.device_name}: nothing refused")
    return [here, check_disk(config, needed_disk_bytes(config, shape, run))]
