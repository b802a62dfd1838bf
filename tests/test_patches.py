"""The package's changes to other libraries (sft_play/patches.py): each still finds what it
replaces in the installed library, each was written for the installed version, one outside its
range is a warning naming the library and version, ``make check`` lists them, and no other module
assigns into a library."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import json
import logging
import os

import pytest

from sft_play import checks, patches
from tests.conftest import REPO, run_script

LIBRARIES = {"torch", "transformers", "trl", "accelerate", "peft", "deepspeed", "huggingface_hub", "datasets",
             "bitsandbytes", "tokenizers", "safetensors"}


def _resolved(target: str):
    """The object `target` names (``a.b.C.d``, a mapping's key as ``['key']``), importing the
    longest importable module prefix."""
    path, _, key = target.partition("[")
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
            break
        except ImportError:
            continue
    for attribute in parts[cut:]:
        found = getattr(found, attribute)
    return found, key.strip("]'") or None


@pytest.fixture(autouse=True)
def _environment():
    """Importing DeepSpeed sets variables in this process's environment (PYTORCH_NVML_BASED_CUDA_CHECK):
    put back, so that the scripts later tests start still match the zygote's (tests/zygote.py)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_every_patch_finds_what_it_replaces_in_the_installed_library(tmp_path):
    """In a process nothing patched (a fresh interpreter, or the suite's zygote's fork of one, which
    imports the libraries and patches nothing): each target the library itself defines."""
    probe = f"""
import importlib, json, sys
sys.path.insert(0, {str(REPO)!r})
from tests.test_patches import _resolved
from sft_play import patches
found = {{}}
for name, patch in patches.PATCHES.items():
    if patch.library == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        continue
    target, key = _resolved(patch.target)
    found[name] = (callable(target) or isinstance(target, bool)) if key is None else (
        isinstance(target, dict) if name == "fsdp_on_cpu" else key in target)
print(json.dumps({{"patched": patches._checked.cache_info().currsize, "found": found}}))
"""
    script = tmp_path / "probe.py"
    script.write_text(probe)
    done = run_script(str(script), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    found = said["found"]
    assert said["patched"] == 0, "the probe's process had applied a patch"
    # (accelerate fills the shared state's dict when a state is made: the dict itself is the target)
    assert found == {name: True for name in found} and set(found) >= set(patches.PATCHES) - {"skip_deepspeed_shm_build"}


@pytest.mark.parametrize("name", list(patches.PATCHES))
def test_every_patch_was_written_for_the_installed_version(name):
    """requirements.txt's pins inside every range: raising a pin means reading the patches again."""
    patch = patches.PATCHES[name]
    assert patches.installed(patch.library) is not None or patch.library == "deepspeed"
    assert patches.outside_range(patch) is None


def test_a_library_outside_a_patchs_range_is_one_warning_naming_it(monkeypatch, caplog):
    torch_version = patches.installed("torch")
    monkeypatch.setitem(patches.PATCHES, "autocast_on_meta",
                        dataclasses.replace(patches.PATCHES["autocast_on_meta"], written_for="<2"))
    patches._checked.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="sft_play.patches"):
            for _ in range(2):  # once a process
                with patches.meta_compatible():
                    pass
    finally:
        patches._checked.cache_clear()
    warned = [r.getMessage() for r in caplog.records if "torch.autocast.__init__" in r.getMessage()]
    assert len(warned) == 1
    assert f"torch {torch_version} is installed" in warned[0] and "written for torch<2" in warned[0]
    listed = {c.name: c for c in checks.check_patches()}
    assert listed["patch torch.autocast.__init__"].warning and "written for torch<2" in listed[
        "patch torch.autocast.__init__"].detail


def test_make_check_lists_every_patch_with_its_library_and_range():
    listed = checks.check_patches()
    assert [c.name for c in listed] == [f"patch {p.target}" for p in patches.PATCHES.values()]
    for check, patch in zip(listed, patches.PATCHES.values()):
        assert check.ok and not check.warning
        assert f"(written for {patch.written_for}): {patch.why}" in check.detail


def test_the_meta_patches_are_undone_when_the_trace_ends():
    import torch
    from torch import _meta_registrations as registrations
    from transformers.integrations import moe

    def python_meta_kernels() -> set[str]:
        library = registrations._meta_lib_dont_use_me_use_register_meta
        return set(library._op_impls) if library.m is not None else set()

    before = torch.autocast.__init__, moe._can_use_grouped_mm
    overriding = python_meta_kernels()
    assert "aten/add.Tensor/Meta" in overriding  # (torch's Python kernel over the C++ one)
    for _ in range(2):  # the first trace of a process splits torch's library; a later one the same
        with patches.meta_compatible():
            assert torch.autocast.__init__ is not before[0]
            with torch.autocast("meta", enabled=False):  # what peft opens around its fused-expert fold
                pass
            assert not python_meta_kernels()
            with patches.meta_compatible():  # a trace inside a trace
                pass
            assert not python_meta_kernels()
            meta = torch.empty(2, 3, device="meta")
            assert (meta + meta).shape == (2, 3)  # the C++ kernel
            assert torch.ops.aten.bucketize(meta, torch.empty(4, device="meta")).dtype == torch.int64  # Python's only
        assert (torch.autocast.__init__, moe._can_use_grouped_mm) == before
        assert python_meta_kernels() and python_meta_kernels() <= overriding
    with patches.meta_kernels_kept():  # a plan: nothing switched until it traces, then until it ends
        assert python_meta_kernels()
        for _ in range(2):
            with patches.meta_compatible():
                assert not python_meta_kernels()
            assert not python_meta_kernels()
    assert python_meta_kernels() and python_meta_kernels() <= overriding


def _library_names(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.split(".")[0] in LIBRARIES}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in LIBRARIES:
            names |= {a.asname or a.name for a in node.names}
    return names


def _root(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _assignments_into_libraries(source: str) -> list[str]:
    """Each attribute or item of an imported library (module, class or object it exports) that
    `source` sets, with its line."""
    tree = ast.parse(source)
    names = _library_names(tree)
    found = []
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in targets:
            for part in ast.walk(target) if isinstance(target, ast.Tuple) else [target]:
                if isinstance(part, (ast.Attribute, ast.Subscript)) and _root(part) in names:
                    found.append(f"{node.lineno} {ast.unparse(part)}")
        if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and node.args
                and _root(node.args[0]) in names):
            found.append(f"{node.lineno} setattr({ast.unparse(node.args[0])})")
    return found


def test_no_other_module_assigns_into_a_library():
    """Registering through a library's own API (``AttentionInterface.register``) is not one."""
    found = [f"{path.relative_to(REPO)}:{line}" for path in sorted((REPO / "sft_play").rglob("*.py"))
             if path.name != "patches.py" for line in _assignments_into_libraries(path.read_text())]
    assert found == [], "move them into sft_play/patches.py, with the versions they were written for"


def test_the_scan_sees_each_kind_of_patch():
    source = ("import torch\nfrom trl.trainer import utils as u\nfrom accelerate import PartialState\n"
              "torch.autocast.__init__ = f\nu._use_triton = g\nPartialState._shared_state['k'] = 1\n"
              "setattr(torch, 'x', 1)\nmodel.config.use_cache = False\n")
    assert _assignments_into_libraries(source) == [
        "4 torch.autocast.__init__", "5 u._use_triton", "6 PartialState._shared_state['k']", "7 setattr(torch)"]
