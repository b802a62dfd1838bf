"""What every script shares: ``--config PATH [key=value ...]`` arguments, logging set-up, and
turning user errors into a clear message and a non-zero exit instead of a traceback."""

from __future__ import annotations

import argparse
import contextlib
import errno
import gc
import importlib.util
import logging
import math
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NoReturn
from pathlib import Path

from sft_play import run_folder
from sft_play import config as config_module
from sft_play.config import ConfigError
from sft_play.data.formats import InvalidRow, UnknownFormat
from sft_play.errors import UserError

DEFAULT_CONFIG = "configs/run_tiny.yaml"

# Exit status for user errors (bad config, bad data, a plan that cannot fit): not a crash.
EXIT_USER_ERROR = 2


USER_ERRORS: tuple[type[BaseException], ...] = (ConfigError, InvalidRow, UnknownFormat, UserError, FileNotFoundError)
# What a filesystem refuses (read-only, immutable, no permission, full, over quota): said as one
# line naming the file, as any other user error; other OS errors stay tracebacks (they are bugs)
FILESYSTEM_REFUSALS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT})


def summary(docstring: str | None) -> str:
    """A script's docstring's first paragraph, on one line: what ``--help`` says it does."""
    return " ".join((docstring or "").strip().split("\n\n")[0].split())


class Parser(argparse.ArgumentParser):
    """argparse, with a mistake said in one line (argparse prints its whole usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} ({self.prog} --help lists the options)\n")


def number(kind: type, variable: str) -> Callable[[str], Any]:
    """An argument type that names the make variable a bad value came from (``NUM_GPUS=abc``)."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or (kind is float and not math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"{variable}={text} is not {'a whole number' if kind is int else 'a number'}")
        return value
    return parse


def config_parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with ``--config`` and positional ``key=value`` overrides."""
    parser = Parser(description=description)
    parser.add_argument("--config", default=DEFAULT_CONFIG, help=f"run config YAML (default {DEFAULT_CONFIG})")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. train.max_steps=10")
    return parser


def run_parser(description: str) -> argparse.ArgumentParser:
    """:func:`config_parser` plus ``--run RUN_DIR``, for the commands that use a finished run."""
    parser = config_parser(description)
    parser.add_argument("--run", help="run folder (default: the newest finished run under train.output_dir)")
    return parser


# What a command on a finished run takes from ``key=value`` overrides: where to find the run
RUN_CHOOSING = ("train.output_dir", "train.run_name")


def chosen_run(args: argparse.Namespace, also: tuple[str, ...] = ()):
    """The run folder ``--run`` names, else ``train.run_name``'s under ``train.output_dir``, else
    the newest finished run there. The run's own saved settings (``config.yaml`` in it) say how it
    loads and what its data is: other overrides would be ignored, so they are refused (but for the
    keys in `also`, which the command reads itself).

    Raises:
        UserError: an override other than :data:`RUN_CHOOSING` and `also`.
    """
    ignored = [o for o in args.overrides if "=" in o and o.split("=", 1)[0].strip() not in (*RUN_CHOOSING, *also)]
    if ignored:
        raise UserError(f"{' '.join(ignored)}: a finished run is used with the settings it trained with (its "
                        "config.yaml); only train.output_dir and train.run_name choose the run here. To evaluate on "
                        "other data: make eval DATA=PATH; to train with other data or settings, train a run with them")
    config = config_module.load(args.config, args.overrides, check_paths=False)
    run = args.run
    if run is None and config.train.run_name:
        run = str(Path(config.train.output_dir) / config.train.run_name)
    return run_folder.resolve_run(run, config.train.output_dir)


def is_main_process() -> bool:
    """Rank 0 by the launcher's environment (usable before any process group exists)."""
    return os.environ.get("RANK", "0") == "0"


def setup_logging(quiet: bool = False) -> None:
    """INFO from our package on the main process, warnings only elsewhere (and when `quiet`);
    the libraries' noise that tells the user nothing is silenced (:func:`quiet_libraries`)."""
    level = logging.INFO if is_main_process() and not quiet else logging.WARNING
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    logging.getLogger("sft_play").setLevel(level)
    quiet_libraries()


# Whether importing() freezes: a process that runs commands in itself, one after another (the
# test suite), sets it False after its own imports, since a freeze keeps whatever garbage is left then
FREEZE_IMPORTS = True


@contextlib.contextmanager
def importing() -> Iterator[None]:
    """Import the libraries a command needs with Python's cyclic garbage collector paused, then
    freeze what the imports made (``gc.freeze``) and let it collect again.

    torch, transformers, TRL, PEFT and datasets make hundreds of thousands of Python objects on
    import, and they live as long as the process. While they are made the collector walks all of
    them again each time they have grown by a quarter: about a second of CPU that every command
    and every rank pays (measured in docs/reports/test_suite.md). Frozen, they are skipped by
    every later collection too. The price: the few cycles the imports left unreachable (a few MB)
    are never freed.

    Used around a command's imports only, never around work that makes garbage; nested uses
    leave the freezing to the outermost."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            if FREEZE_IMPORTS:
                gc.freeze()
            gc.enable()


def quiet_libraries() -> None:
    """Silence what the stack prints on every command without telling the user anything, and
    nothing else (their other warnings stay):

    - bitsandbytes' "Failed to load CPU gemm_4bit_forward from kernels-community" (an optional
      hub package we do not install);
    - transformers' FutureWarning that ``gradient_checkpointing`` is renamed (TRL passes it);
    - DeepSpeed's "Setting accelerator to CPU" on machines without a GPU, where accelerate
      imports DeepSpeed to unwrap a model even when it is not used (``DS_ACCELERATOR=cpu`` says so);
    - datasets' progress bars (the data module logs what it did instead);
    - transformers' "Token indices sequence length is longer than the specified maximum sequence
      length for this model" on a long example: the data module truncates or drops examples at
      ``data.max_seq_length`` after tokenising them whole, and says how many;
    - peft's RuntimeWarning that the rank and alpha patterns it sets itself for a mixture-of-
      experts model's fused ``gate_up_proj`` "did not match any targeted module" (peft 0.21's
      ``transformers_weight_conversion`` doubles r and alpha for the fused gate and up experts,
      then checks the patterns against modules, not the parameters it targets: they do apply).

    transformers' "Loading weights" bar goes where models load (:func:`sft_play.model.quiet_loading`).
    """
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
        lambda record: "gemm_4bit_forward" not in record.getMessage())
    logging.getLogger("transformers.tokenization_utils_base").addFilter(
        lambda record: "Token indices sequence length is longer" not in record.getMessage())
    warnings.filterwarnings("ignore", message=r".*(is_)?gradient_checkpointing.* is deprecated", category=FutureWarning)
    # DeepSpeed 0.19's ZeRO calls torch's all_gather_into_tensor and reduce_scatter_tensor, which torch 2.13
    # deprecates (a line per call on every rank): nothing to act on here
    warnings.filterwarnings("ignore", message=r"`torch.distributed.(all_gather_into|reduce_scatter)_tensor` is "
                            r"deprecated", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r"The following (rank|alpha)_pattern keys did not match any targeted "
                            r"module and were ignored: \['\.\*\\\\\.gate_up_proj'\]", category=RuntimeWarning)
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    if "DS_ACCELERATOR" not in os.environ and importlib.util.find_spec("torch") is not None:
        import torch

        if not torch.cuda.is_available():
            os.environ["DS_ACCELERATOR"] = "cpu"


_READER_GONE = {errno.EPIPE, errno.EIO}  # a closed pipe; a terminal that hung up


class SurvivingStream:
    """stdout or stderr, whose reader may go away (``make train | tee log``, and Ctrl-C ends tee
    first): the first write that finds the pipe closed points the file descriptor at /dev/null,
    so that nothing written later, by Python or by a library's C code, fails, and a stop signal
    still ends in a saved checkpoint (a BrokenPipeError in the middle of a step ended the run)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as error:
            if error.errno not in _READER_GONE:
                raise
            self._to_devnull()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as error:
            if error.errno not in _READER_GONE:
                raise
            self._to_devnull()

    def _to_devnull(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())
        os.close(devnull)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def run(main: Callable[[], int | None]) -> None:
    """Call `main` and exit with its status; user errors print a message and exit 2. The
    libraries' noise is silenced first (:func:`quiet_libraries`); a closed stdout or stderr never
    ends the command (:class:`SurvivingStream`)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, SurvivingStream) and hasattr(stream, "fileno"):
            setattr(sys, name, SurvivingStream(stream))
    with importing():  # torch, where it is installed
        quiet_libraries()
    try:
        sys.argv[1:] = [*sys.argv[1:], *make_args()]
        status = main()
    except USER_ERRORS as exc:
        _end_progress_bars()
        print(f"{_rank_prefix()}error: {exc}", file=sys.stderr)
        leave(EXIT_USER_ERROR)
    except OSError as exc:
        if exc.errno not in FILESYSTEM_REFUSALS or exc.filename is None:
            raise
        _end_progress_bars()
        print(f"{_rank_prefix()}error: {exc.filename}: {exc.strerror}", file=sys.stderr)
        leave(EXIT_USER_ERROR)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        leave(130)
    leave(status or 0)


MAKE_ARGS = "SFT_PLAY_ARGS"


def make_args() -> list[str]:
    """The words of ``make ... ARGS="..."``, which the Makefile passes in :data:`MAKE_ARGS` rather
    than through a shell (so that nothing in them is run), split as a shell splits words, with
    quotes grouping; taken out of the environment, so that the processes this one starts do not
    read them again.

    Raises:
        UserError: a line break in ARGS (a shell would have run the rest as another command)."""
    text = os.environ.pop(MAKE_ARGS, "")
    if "\n" in text or "\r" in text:
        raise UserError("ARGS holds a line break: put every override on one line, separated by spaces")
    import shlex

    try:
        return shlex.split(text)
    except ValueError as exc:
        raise UserError(f"ARGS cannot be read as words ({exc}): {text}") from None


def _rank_prefix() -> str:
    rank = os.environ.get("RANK")
    return f"[rank {rank}] " if rank not in (None, "0") else ""


def _end_progress_bars() -> None:
    """Close the progress bars an error interrupted (the trainer's), so that the error line starts
    a line of its own instead of trailing a bar's."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ()) or ()):
        try:
            bar.close()
        except Exception:  # noqa: BLE001 - a bar that cannot close leaves the line as it is
            pass


def leave(status: int) -> None:
    """Exit with `status`. A process that formed a process group leaves without tearing the
    interpreter down: the group's C++ threads then abort the process ("terminate called without
    an active exception", SIGABRT after a run had finished and saved) or, with the group
    destroyed first, DDP's reducer waits forever joining them (both seen on 2 CPU ranks). By
    then everything is saved and said: the output is flushed, and the run ends here."""
    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            sys.stdout.flush()
            sys.stderr.flush()
            logging.shutdown()
            os._exit(status)
    sys.exit(status)
