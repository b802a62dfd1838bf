"""Every change this package makes to another library's functions or private state, in one place.

Each is used only because the library has no setting for what the run needs; :data:`PATCHES` says,
for each, what it replaces, why, and the versions of the library it was written against. The first
time a patch is applied in a process its library's installed version is checked against that range
(a warning naming the library and version when outside it: the patch may then miss or break what
it replaces); ``make check`` lists them all. tests/test_patches.py checks that every target still
exists in the installed libraries.

Each function here imports its library when called: this module is the lowest of the package's
rooms and imports none of them.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Patch:
    target: str  # what is replaced, as a dotted path (a mapping's key in brackets)
    library: str  # the distribution whose code it is
    written_for: str  # the versions it was written against (a PEP 440 specifier)
    why: str


PATCHES = {
    "skip_split_loaders": Patch(
        "transformers.trainer.skip_first_batches", "transformers", "==5.23.*",
        "a split-sequence run resumes mid-epoch: accelerate's skip cannot rebuild DeepSpeed's "
        "UlyssesSPDataLoaderAdapter (it has no dataset)"),
    "sdpa_by_example": Patch(
        "transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS['sdpa']", "transformers", ">=5.23,<6",
        "under DeepSpeed Ulysses SDPA gets no mask: each packed example attends on its own, and no mask is built"),
    "fsdp_on_cpu": Patch(
        "accelerate.PartialState._shared_state['distributed_type']", "accelerate", "==1.15.*",
        "FSDP2 in CPU processes: accelerate enables FSDP only for GPU process types and has no public setter"),
    "labelled_positions_on_cpu": Patch(
        "trl.trainer.utils._use_triton", "trl", "==1.16.*",
        "TRL's fused loss head projects only the labelled positions on a CPU too (the same loss, fewer projections)"),
    "no_reference_loading": Patch(
        "trl.trainer.dpo_trainer.create_model_from_path", "trl", "==1.16.*",
        "ORPO and SimPO have no reference: DPOTrainer would load one from the model's name (while it is built)"),
    "hub_offline": Patch(
        "huggingface_hub.constants.HF_HUB_OFFLINE", "huggingface_hub", ">=1,<3",
        "offline mode for a process already running once the hub is found unreachable (read at import otherwise)"),
    "skip_deepspeed_shm_build": Patch(
        "deepspeed.ops.__compatible_ops__['deepspeed_shm_comm']", "deepspeed", "==0.19.*",
        "DeepSpeed on a CPU builds a shared-memory all-reduce op at start (~40 s of C++ on 2 cores) that only "
        "inference uses: marked incompatible, it is not built"),
    "save_from_every_rank": Patch(
        "transformers.modeling_utils.PreTrainedModel.should_save_on_this_rank", "transformers", "==5.23.*",
        "initialised weights staged by each rank once a process group is up: transformers writes a model's files "
        "from rank 0 only, and another rank's empty folder, renamed into place first, was read as the model"),
    "autocast_on_meta": Patch(
        "torch.autocast.__init__", "torch", ">=2.13,<3",
        "the planner's trace on the meta device: peft opens torch.autocast('meta'), which torch refuses "
        "(while tracing only)"),
    "native_meta_kernels": Patch(
        "torch._meta_registrations.activate_meta", "torch", ">=2.13,<3",
        "the planner's trace on the meta device: the Python meta kernels it registers over the dispatcher's "
        "C++ ones (~100 us a call against ~1) are withdrawn where a C++ one exists (while a plan traces)"),
    "grouped_experts_on_meta": Patch(
        "transformers.integrations.moe._can_use_grouped_mm", "transformers", "==5.23.*",
        "the planner's trace on the meta device: the grouped experts take their fallback op, which has a "
        "meta implementation (while tracing only)"),
}


def installed(library: str) -> str | None:
    try:
        return importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        return None


def outside_range(patch: Patch) -> str | None:
    """Why `patch` may not fit the installed library (its version outside the range it was
    written for); None when it is inside, or the library is not installed."""
    from packaging.specifiers import SpecifierSet

    version = installed(patch.library)
    if version is None or SpecifierSet(patch.written_for).contains(version, prereleases=True):
        return None
    return (f"{patch.library} {version} is installed; the patch of {patch.target} was written for "
            f"{patch.library}{patch.written_for} (requirements.txt pins the tested versions)")


@functools.cache
def _checked(name: str) -> None:
    """Once per process and patch, before it is first applied."""
    problem = outside_range(PATCHES[name])
    if problem:
        logger.warning("%s: %s", problem, PATCHES[name].why)


def skip_split_loaders() -> None:
    """Let the trainer resume a split-sequence run mid-epoch. It skips the micro-batches already
    trained with ``transformers.trainer.skip_first_batches`` (accelerate's), which rebuilds a
    ``DataLoader``; the function the trainer calls is replaced by one that skips DeepSpeed's
    ``UlyssesSPDataLoaderAdapter``'s loader by whole batches, then the adapter by the rest (each
    batch is `sp_world_size` of its micro-batches), and hands every other loader to accelerate's.
    Kept until accelerate or DeepSpeed skips the adapter itself; tests/test_sequence_parallel.py
    resumes a stopped run to the uninterrupted run's weights."""
    import transformers.trainer as trainer_module

    if getattr(trainer_module.skip_first_batches, "skips_split_loaders", False):
        return
    _checked("skip_split_loaders")
    skip = trainer_module.skip_first_batches

    def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

        if not isinstance(dataloader, UlyssesSPDataLoaderAdapter):
            return skip(dataloader, num_batches)
        whole, part = divmod(num_batches, dataloader.sp_world_size)
        adapter = UlyssesSPDataLoaderAdapter(skip(dataloader.dl, whole), sp_rank=dataloader.sp_rank,
                                             sp_group=dataloader.sp_group, sp_world_size=dataloader.sp_world_size,
                                             device=dataloader.device)
        for _ in range(part):
            next(adapter)
        return adapter

    skip_first_batches.skips_split_loaders = True
    trainer_module.skip_first_batches = skip_first_batches


def sdpa_by_example(by_example: Callable[[Callable], Callable]) -> None:
    """transformers' SDPA attention function replaced, in this process, by `by_example` of it
    (:func:`sft_play.long_rows.attend_by_example`), and its mask function by one that builds
    none: under Ulysses each process would build a mask for its share of a packed row,
    [tokens / split]^2 per row, which Ulysses drops unread. (The entry of the models' own
    registry, which DeepSpeed's Ulysses wrapper reads; the mask through transformers' public one.)"""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    _checked("sdpa_by_example")
    ALL_ATTENTION_FUNCTIONS["sdpa"] = by_example(sdpa_attention_forward)
    AttentionMaskInterface.register("sdpa", _no_mask)


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None


def fsdp_on_cpu() -> None:
    """The shared accelerator state's process type set to FSDP, which accelerate sets only for
    GPU-type processes; both of its states read it (the plugin is set by the caller, publicly)."""
    from accelerate import PartialState
    from accelerate.utils import DistributedType

    _checked("fsdp_on_cpu")
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def labelled_positions_on_cpu() -> None:
    """Make TRL's fused loss head (``trl.trainer.utils.add_fused_lm_head``, which training and
    ``make eval`` use) project only the positions that have a label on a CPU too. TRL does so on
    devices with Triton and projects every position elsewhere, so that a compiler (Neuron) sees one
    tile shape per batch; on a CPU nothing is compiled and the loss is the same (a position without
    a label contributes zero). Other devices are decided by TRL as before. Once per process; the
    planner counts the head this way (sft_play.planner.simulate.step)."""
    import trl.trainer.utils as trl_utils

    decide = trl_utils._use_triton
    if getattr(decide, "labelled_only_on_cpu", False):
        return
    _checked("labelled_positions_on_cpu")

    def labelled_only(device: Any) -> bool:
        return device.type == "cpu" or decide(device)

    labelled_only.labelled_only_on_cpu = True
    labelled_only.trl_decision = decide
    trl_utils._use_triton = labelled_only


@contextlib.contextmanager
def no_reference_loading() -> Iterator[None]:
    """While a DPOTrainer is built: it loads a reference from the model's name for full
    fine-tuning when given none (its only way to learn there is no need); ORPO and SimPO have none."""
    from trl.trainer import dpo_trainer

    _checked("no_reference_loading")
    load = dpo_trainer.create_model_from_path
    dpo_trainer.create_model_from_path = lambda *args, **kwargs: None
    try:
        yield
    finally:
        dpo_trainer.create_model_from_path = load


def save_from_every_rank(model: Any) -> None:
    """``model.save_pretrained`` writes its files from this process whatever its rank in a process
    group (on this model only)."""
    _checked("save_from_every_rank")
    model.should_save_on_this_rank = lambda is_main_process: is_main_process


def hub_offline() -> None:
    """The hub client of this process in offline mode, as ``HF_HUB_OFFLINE=1`` at its import would
    have put it (``datasets`` copies the setting when imported: its copy too)."""
    import sys

    import huggingface_hub.constants

    _checked("hub_offline")
    huggingface_hub.constants.HF_HUB_OFFLINE = True
    datasets_config = sys.modules.get("datasets.config")
    if datasets_config is not None:
        datasets_config.HF_HUB_OFFLINE = datasets_config.HF_DATASETS_OFFLINE = True


def skip_deepspeed_shm_build() -> None:
    """Before DeepSpeed's communication starts in CPU processes: its shared-memory all-reduce op
    (``deepspeed.comm.torch.build_shm_op``, a C++ build on the first run in each
    TORCH_EXTENSIONS_DIR) is used only by ``inference_all_reduce``; training's collectives go
    through torch.distributed (gloo). Marked incompatible, it is skipped. The table of every op's
    compatibility is made on its first read by probing them all (compiler subprocesses and
    setuptools' import: seconds of each rank's start); only this op's entry is ever read
    (``.get(name, False)``), so where nothing probed yet the table is started with it alone."""
    import deepspeed.ops

    _checked("skip_deepspeed_shm_build")
    deepspeed.ops.__dict__.setdefault("__compatible_ops__", {})["deepspeed_shm_comm"] = False


@contextlib.contextmanager
def meta_compatible() -> Iterator[None]:
    """What the libraries do on real devices, made to run on the meta device for the planner's
    trace: ``torch.autocast("meta")`` (peft opens one, disabled, around its fused-expert LoRA
    fold) becomes the CPU's, which changes nothing on meta tensors; transformers' grouped experts
    take their fallback op, which has a meta implementation."""
    import torch
    from transformers.integrations import moe

    _checked("autocast_on_meta")
    original_init = torch.autocast.__init__

    def init(self, device_type, *args, **kwargs):
        original_init(self, "cpu" if device_type == "meta" else device_type, *args, **kwargs)

    grouped = getattr(moe, "_can_use_grouped_mm", None)
    torch.autocast.__init__ = init
    if grouped is not None:
        _checked("grouped_experts_on_meta")
        moe._can_use_grouped_mm = lambda *args, **kwargs: False
    try:
        with native_meta_kernels():
            yield
    finally:
        torch.autocast.__init__ = original_init
        if grouped is not None:
            moe._can_use_grouped_mm = grouped


# Whether torch's meta kernels are switched (native_meta_kernels), and who needs them so: traces
# running, plans holding them switched between their traces (meta_kernels_kept)
_NATIVE_META: dict[str, Any] = {"switched": False, "tracing": 0, "kept": 0}


@contextlib.contextmanager
def native_meta_kernels() -> Iterator[None]:
    """The dispatcher's C++ meta kernels for the ops that have one, for a trace. At import, torch
    registers a Python meta kernel (``torch._meta_registrations.activate_meta``) over the C++ one of
    every op it can decompose, for torch.compile's symbolic shapes, which a trace never has; a Python
    kernel costs ~100 us a call against ~1. The first time, torch's library of them is split in
    two: the kernels of ops with no C++ one, kept for good, and the others, withdrawn inside and
    registered again after (~6 ms; inside :func:`meta_kernels_kept`, once it ends)."""
    if not _NATIVE_META["switched"]:
        _checked("native_meta_kernels")
        _withdraw_python_meta_kernels()
        _NATIVE_META["switched"] = True
    _NATIVE_META["tracing"] += 1
    try:
        yield
    finally:
        _NATIVE_META["tracing"] -= 1
        _restore_python_meta_kernels_unless_needed()


@contextlib.contextmanager
def meta_kernels_kept() -> Iterator[None]:
    """Inside, torch's meta kernels stay as a trace switched them (:func:`native_meta_kernels`)
    until the end: a plan's traces switch them once, and a plan that traces nothing not at all."""
    _NATIVE_META["kept"] += 1
    try:
        yield
    finally:
        _NATIVE_META["kept"] -= 1
        _restore_python_meta_kernels_unless_needed()


def _withdraw_python_meta_kernels() -> None:
    import torch
    from torch import _meta_registrations as registrations

    if "overriding" in _NATIVE_META:
        registrations._meta_lib_dont_use_me_use_register_meta._destroy()
        return
    library = registrations._meta_lib_dont_use_me_use_register_meta
    kernels = {}
    for key in sorted(library._op_impls):  # "aten/add.Tensor/Meta"
        namespace, name, _ = key.split("/")
        packet, _, overload = name.partition(".")
        op = getattr(getattr(getattr(torch.ops, namespace), packet), overload or "default")
        kernels[op] = op.py_kernels[torch._C.DispatchKey.Meta]
    library._destroy()
    _NATIVE_META["python_only"] = torch.library.Library("aten", "IMPL", "Meta")
    _NATIVE_META["overriding"] = {}
    for op, kernel in kernels.items():
        if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Meta"):
            _NATIVE_META["overriding"][op] = kernel
        else:
            _NATIVE_META["python_only"].impl(op, kernel)


def _restore_python_meta_kernels_unless_needed() -> None:
    if not _NATIVE_META["switched"] or _NATIVE_META["tracing"] or _NATIVE_META["kept"]:
        return
    import torch
    from torch import _meta_registrations as registrations

    overriding = torch.library.Library("aten", "IMPL", "Meta")
    for op, kernel in _NATIVE_META["overriding"].items():
        overriding.impl(op, kernel)
    registrations._meta_lib_dont_use_me_use_register_meta = overriding
    _NATIVE_META["switched"] = False


def listed() -> list[tuple[Patch, str | None, str | None]]:
    """Every patch, with its library's installed version and why it may not fit it (None: it fits
    or the library is not installed), for ``make check``."""
    return [(patch, installed(patch.library), outside_range(patch)) for patch in PATCHES.values()]
