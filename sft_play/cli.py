"""What every script shares: ``--config PATH [key=value ...]`` arguments, logging set-up, and
turning user errors into a clear message and a non-zero exit instead of a traceback."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable

from sft_play.config import ConfigError
from sft_play.data.formats import InvalidRow
from sft_play.errors import UserError

DEFAULT_CONFIG = "configs/run_tiny.yaml"

# Exit status for user errors (bad config, bad data, a plan that cannot fit): not a crash.
EXIT_USER_ERROR = 2


USER_ERRORS: tuple[type[BaseException], ...] = (ConfigError, InvalidRow, UserError, FileNotFoundError)


def config_parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with ``--config`` and positional ``key=value`` overrides."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", default=DEFAULT_CONFIG, help=f"run config YAML (default {DEFAULT_CONFIG})")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. train.max_steps=10")
    return parser


def is_main_process() -> bool:
    """Rank 0 by the launcher's environment (usable before any process group exists)."""
    return os.environ.get("RANK", "0") == "0"


def setup_logging(quiet: bool = False) -> None:
    """INFO from our package on the main process, warnings only elsewhere (and when `quiet`)."""
    level = logging.INFO if is_main_process() and not quiet else logging.WARNING
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    logging.getLogger("sft_play").setLevel(level)


def run(main: Callable[[], int | None]) -> None:
    """Call `main` and exit with its status; user errors print a message and exit 2."""
    try:
        status = main()
    except USER_ERRORS as exc:
        rank = os.environ.get("RANK")
        prefix = f"[rank {rank}] " if rank not in (None, "0") else ""
        print(f"{prefix}error: {exc}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(status or 0)
