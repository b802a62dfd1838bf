"""Reading models and datasets from the Hugging Face hub without waiting on a network that is not there.

The hub client retries every request five times with back-off: where the hub cannot be reached
(an offline cluster node, a firewall) a model id that is not in the local cache costs over a
minute of printed retries before the error. Before the first hub read of a process,
:func:`prepare` checks once, in a second or two, whether the hub's host answers; when it does
not, the process goes offline (``HF_HUB_OFFLINE``): the cache is read, nothing is retried, and
the error comes at once.

Planning needs a model's ``config.json`` alone. The configs of the models that the example
run configs name ship with the project under ``configs/hub/<org>/<name>/``
(``configs/hub/README.md`` says where each came from), so that those plan without a network:
:func:`shipped_config` finds them.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

from sft_play import patches

logger = logging.getLogger(__name__)

SHIPPED = Path(__file__).resolve().parents[1] / "configs" / "hub"
PROBE_TIMEOUT_S = 2.0
_TRUE = {"1", "on", "yes", "true"}


def offline() -> bool:
    """Whether the hub client is (or has been put) in offline mode."""
    return any(os.environ.get(name, "").lower() in _TRUE for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


@functools.lru_cache(maxsize=1)
def reachable() -> bool:
    """Whether the hub's host (``HF_ENDPOINT``, default huggingface.co) accepts a connection
    within :data:`PROBE_TIMEOUT_S` (asked once per process)."""
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        with socket.create_connection((endpoint.hostname or "huggingface.co", port), timeout=PROBE_TIMEOUT_S):
            return True
    except OSError:
        return False


def prepare(name_or_path: str) -> None:
    """Before `name_or_path` is read: a hub id while the hub cannot be reached puts this process
    in offline mode, so that the read uses the local cache and fails at once without retries."""
    if Path(name_or_path).is_dir() or offline() or reachable():
        return
    go_offline()


def go_offline() -> None:
    """Put the hub client of this process, and of the processes it starts, in offline mode."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    patches.hub_offline()
    logger.info("the hub cannot be reached: reading hub models and datasets from the local cache only "
                "(HF_HUB_OFFLINE=1)")


def shipped_config(name: str, revision: str | None = None) -> Path | None:
    """The folder of the project's copy of hub model `name`'s ``config.json``, if one ships
    (for the default revision only)."""
    if revision not in (None, "main") or Path(name).is_dir():
        return None
    folder = SHIPPED / name
    return folder if (folder / "config.json").is_file() else None
