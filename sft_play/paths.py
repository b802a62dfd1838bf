"""Where SFT-Play keeps what it caches between runs: ``$SFT_PLAY_CACHE``, else
``~/.cache/sft_play``. Initialised weights (``init_weights/``), preprocessed data (``data/``) and
its statistics alone (``data_stats/``: :func:`sft_play.data.cache.stats_key`),
what GPU processes were measured to hold outside PyTorch's allocator (``cuda_runtime.json``),
what the planner learned from a model's code (``planner/``: :mod:`sft_play.planner.simulate.cache`) and the
locks of data being prepared (``locks/``: :func:`sft_play.data.cache.preparing`). ``make
clean-cache`` shows and cleans it (:mod:`sft_play.cache_usage`)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$SFT_PLAY_CACHE``, else ``~/.cache/sft_play``."""
    return Path(os.environ.get("SFT_PLAY_CACHE", Path.home() / ".cache" / "sft_play"))
