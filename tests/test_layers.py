"""The one-way flow of the package: every import of one of our modules, at the top of a file or
inside a function, points down this list. A new module takes its place in it."""

from __future__ import annotations

import ast
import re

from tests.conftest import REPO

# Lowest first: a module may import only modules above it in this list
ORDER = [
    "units", "patches", "parallelism", "tiny_puzzles", "paths", "cache_usage", "errors", "hub", "stopping", "adapters", "model_card", "chat_templates",
    "config.schema", "config.messages", "config.overrides", "config.environment", "config.reference",
    "config.loading", "config", "lean_imports",
    "architecture", "long_rows", "hardware.gpu_models", "hardware.runtime", "hardware.machine", "hardware.report", "hardware",
    "precision", "run",
    "data.stats", "data.images", "data.formats", "data.tokenize", "data.vision", "data.sources", "data.cache", "data.collate",
    "data.pipeline", "data.preference", "data",
    "checkpoints", "run_folder",
    "callbacks.ranks", "callbacks.stops", "callbacks.faults", "callbacks.markers", "callbacks.logs", "callbacks",
    "planner.progress", "planner.simulate.cache", "planner.simulate.allocator", "planner.simulate.compiled", "planner.simulate.shapes", "planner.simulate.memory",
    "planner.simulate.lengths", "planner.simulate.trace", "planner.simulate.encoder", "planner.simulate.step", "planner.simulate.loading", "planner.simulate.predict", "planner.simulate.timing",
    "planner.simulate.disk", "planner.simulate", "planner.simulate.__main__",
    "planner.target", "planner.choose.split", "planner.choose.search", "planner.choose.calibrate",
    "planner.choose.remedies", "planner.choose.longest", "planner.choose", "planner.present.notes",
    "planner.present.evidence", "planner.plan", "planner",
    "planner.present.report", "planner.present",
    "model", "training.preference", "training.arguments", "training.trainer", "training.backoff", "training.saving", "training",
    "export", "memory_check", "checks", "cli",
    "launch.tensorboard", "launch.rendezvous", "launch.commands", "launch.supervise", "launch",
    "train", "console",
]
PACKAGE = REPO / "sft_play"


def _module(path) -> str:
    name = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
    return name.removesuffix(".__init__").removesuffix("__init__")


def _imports(path) -> set[str]:
    """Our modules `path` imports; ``from sft_play.planner import memory`` names the submodule."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "sft_play":
            base = node.module.removeprefix("sft_play").lstrip(".")
            submodules = [a.name for a in node.names
                          if (PACKAGE / base.replace(".", "/") / f"{a.name}.py").exists()
                          or (PACKAGE / base.replace(".", "/") / a.name / "__init__.py").exists()]
            found |= {f"{base}.{s}".lstrip(".") for s in submodules}
            if len(submodules) < len(node.names):
                found.add(base)
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("sft_play.") for a in node.names if a.name.startswith("sft_play.")}
    return found


def test_every_module_has_a_place_and_every_import_points_down():
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    modules.pop("", None)
    assert sorted(set(modules) - set(ORDER)) == [], "new modules: give them their place in ORDER"
    upward = []
    for name, path in modules.items():
        for imported in _imports(path) - {name}:
            if ORDER.index(imported) > ORDER.index(name):
                upward.append(f"{name} imports {imported}")
    assert upward == []


def test_byte_units_are_defined_once():
    defined = [str(p.relative_to(REPO)) for p in PACKAGE.rglob("*.py")
               if re.search(r"^[A-Z]IB = 1024", p.read_text(), flags=re.M)]
    assert defined == ["sft_play/units.py"]


def test_the_layout_names_every_module_and_folder():
    """docs/LAYOUT.md is the map a newcomer reads: every module of the package by its file name,
    every folder of it by ``name/``."""
    layout = (REPO / "docs" / "LAYOUT.md").read_text()
    files = sorted(p.name for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" and p.name not in layout)
    folders = sorted(f"{p.name}/" for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__"
                     and f"{p.name}/" not in layout)
    assert files == [] and folders == [], "name them in docs/LAYOUT.md"
