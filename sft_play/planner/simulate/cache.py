"""What planning learns from a model's code, and what it predicts, kept on disk between processes.

The model's shape (its parameters counted on a meta-device build) and its traced layers are the
only parts of a plan that need transformers' modeling code, and importing that code is most of
what a plan costs (``transformers.modeling_utils`` alone takes 3-4 s on 2 cores, against 0.2-1 s
of planning). Both are functions of the model's config, the method, the run's trace settings and
the code that computes them, so they are kept in ``$SFT_PLAY_CACHE/planner/`` under a key of
exactly those: the model's config (:func:`sft_play.architecture.config_identity`: a local
folder's config.json as written, read without importing transformers; a hub model's config as
loaded), the arguments, the versions of torch, transformers and peft, and the source of the
modules that compute them. A second plan of the same model (``make plan`` after ``make train``,
or after a change of batch, GPUs or sequence length) then never imports the modeling code.

Predictions (a micro-batch's replayed peak: :func:`kept`, :func:`keep`) are kept too, as JSON,
under a key of everything that decides them (the model's config, the shape, the resolved run, the
micro-batch, the budget) and the source of the whole package: a warm plan, remedies and all,
replays nothing it replayed before.

What is kept is read back by an unpickler that builds only the planner's own dataclasses and plain
containers (:class:`_PlannerUnpickler`): a planted file cannot run code, so the cache can be
shared between people. Models with remote code are not kept (their code can change under the same config), nor what a
process computed from a local config.json that was edited after it read it. A file that cannot be
read counts as absent and is recomputed; a cache that cannot be written is skipped. Nothing is
evicted: a few hundred KB per model and sequence length.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import io
import json
import logging
import os
import pickle
import tempfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import TypeVar

from sft_play.architecture import config_is_current
from sft_play import cache_usage
from sft_play.paths import cache_dir

logger = logging.getLogger(__name__)
T = TypeVar("T")

_PACKAGE = Path(__file__).resolve().parents[2]
# The modules whose code decides a shape or a trace
_SOURCES = ("planner/simulate/trace.py", "planner/simulate/encoder.py", "planner/simulate/shapes.py", "architecture.py",
            "adapters.py", "run.py")
_PACKAGES = ("torch", "transformers", "peft")


@functools.lru_cache(maxsize=1)
def fingerprint() -> str:
    """The versions and the source that computed what is kept."""
    digest = hashlib.sha256()
    for package in _PACKAGES:
        try:
            digest.update(f"{package} {metadata.version(package)}\n".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{package} absent\n".encode())
    for name in _SOURCES:
        digest.update((_PACKAGE / name).read_bytes())
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def package_fingerprint() -> str:
    """The versions and every source file of the package: what decides a prediction is spread
    over the simulation, the run's resolution and the byte formulas, so any change of code
    forgets every prediction kept."""
    digest = hashlib.sha256(fingerprint().encode())
    for path in sorted(_PACKAGE.rglob("*.py")):
        digest.update(path.relative_to(_PACKAGE).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def folder() -> Path:
    return cache_dir() / "planner"


def remembered(kind: str, key: tuple, compute: Callable[[], T], *, keep: bool = True) -> T:
    """`compute()`, or what it returned for the same `kind`, `key` and :func:`fingerprint` before.

    Args:
        kind: what is kept ("shape", "lora", "trace"): the file's prefix.
        key: everything the result depends on besides the code (its repr is hashed).
        keep: False computes without reading or writing the cache (remote code).
    """
    if not keep:
        return compute()
    digest = hashlib.sha256(repr((kind, key, fingerprint())).encode()).hexdigest()[:40]
    path = folder() / f"{kind}-{digest}.pkl"
    try:
        value = _loads(path.read_bytes())
        cache_usage.used(path)
        return value
    except FileNotFoundError:
        pass
    except Exception as error:  # noqa: BLE001 - a broken file counts as none
        logger.debug("planner cache %s unreadable (%s); recomputing", path, error)
    value = compute()
    _write_whole(path, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
    return value


class _PlannerUnpickler(pickle.Unpickler):
    """Builds the planner's own dataclasses and enums (``sft_play.*``) and plain containers,
    nothing else: a pickle names any callable to run on load, and this cache may be shared."""

    _BUILTINS = frozenset({"list", "tuple", "dict", "set", "frozenset", "complex"})

    def find_class(self, module: str, name: str):
        if module == "builtins" and name in self._BUILTINS:
            return super().find_class(module, name)
        if module.startswith("sft_play.") and "." not in name:
            found = super().find_class(module, name)
            if isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)):
                return found
        raise pickle.UnpicklingError(f"{module}.{name} is not something the planner keeps")


def _loads(data: bytes):
    return _PlannerUnpickler(io.BytesIO(data)).load()


def _write_whole(path: Path, data: bytes) -> None:
    """Write `data` to `path` whole or not at all, whoever else writes it; skipped (and said at
    debug level) where the cache cannot be written."""
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as handle:
            temporary = Path(handle.name)
            handle.write(data)
        os.replace(temporary, path)
        temporary = None
    except OSError as error:
        logger.debug("planner cache %s not written (%s)", path, error)
    finally:
        if temporary is not None:
            temporary.unlink(missing_ok=True)


def keeps(name_or_path: str, trust_remote_code: bool) -> bool:
    """Whether what is computed for this model may be kept: not for remote code, and not when this
    process read a local config.json that has changed since (its results are of the old text)."""
    return not trust_remote_code and config_is_current(name_or_path)


def _document_path(kind: str, key: tuple) -> Path:
    digest = hashlib.sha256(repr((kind, key, package_fingerprint())).encode()).hexdigest()[:40]
    return folder() / f"{kind}-{digest}.json"


def kept(kind: str, key: tuple) -> dict | None:
    """The JSON document :func:`keep` wrote for `kind` and `key` under this code, or None."""
    path = _document_path(kind, key)
    try:
        document = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:  # a broken file counts as none
        logger.debug("planner cache %s unreadable (%s)", path, error)
        return None
    cache_usage.used(path)
    return document if isinstance(document, dict) else None


def keep(kind: str, key: tuple, document: dict) -> None:
    """Keep `document` (JSON data) for `kind` and `key`; skipped where the cache cannot be written."""
    _write_whole(_document_path(kind, key), json.dumps(document).encode())
