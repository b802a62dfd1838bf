"""A process that has imported the libraries every script imports, and forks the scripts the
tests run (tests/conftest.py: ``run_script``, ``run_scripts_together``).

A script started by a test spends most of its CPU importing torch, transformers, accelerate,
peft, TRL and sft_play (docs/reports/test_suite.md), and the suite starts dozens. Forked from
here, a script starts with them imported and runs as
``python SCRIPT ARGS`` would: ``__main__``, its arguments, working directory, environment,
output files and thread count are its own, its exit status is reported as a process's.

What cannot be the script's own is what those libraries read from the environment when they
were imported (``HF_HUB_OFFLINE``, ``HF_HOME``, ``ATEN_CPU_CAPABILITY``...): a request whose
environment differs from this process's in anything but :data:`READ_AT_RUN_TIME` is started
as a fresh interpreter instead (conftest decides). Nothing is imported here that a script
decides about or configures first (:data:`PRELOADED`): bitsandbytes is imported by the script
that uses it, as in a fresh process (:data:`PRELOADED_WITHOUT_BITSANDBYTES`), and DeepSpeed,
imported here as a script would import it, is hidden until a script imports it
(:class:`_HiddenDeepSpeed`).

Started as ``zygote.py SOCKET PID``, it listens on the Unix socket SOCKET once imported and
serves every pytest process of the session that connects to it, one JSON document per line: for
each request ``{"argv": [...], "env": {...}, "cwd": ..., "stdout": path, "stderr": path}``,
``{"pid": N}`` (``{"error": ...}`` where it could not fork), and when that child ends
``{"ended": N, "returncode": R}`` (negative: the signal that ended it, as ``subprocess`` says).
It exits when the process PID (the one pytest runs in) has ended.

The ranks a launcher starts (torchrun's agent, inside ``make train-distributed``) are forked
from here too: under the suite every Python process imports ``tests/shim/sitecustomize.py``, which
in a rank hands its arguments, environment and standard streams to this process over the Unix
socket named by :data:`SOCKET_ENV` and stands in for the fork (see there) while it runs. Each
connection is one request, ``{"argv", "env", "cwd", "unbuffered"}`` with the descriptors 0-2
passed alongside, answered ``{"pid": N}`` then ``{"ended": N, "returncode": R}``, or
``{"fresh": [names]}`` where the environment differs in what the libraries read on import (the
rank then starts as the fresh interpreter it is). A connection that closes first (its stand-in
killed) ends its fork with SIGKILL, as the rank itself would have been.
"""

from __future__ import annotations

import gc
import json
import os
import re
import select
import signal
import socket
import sys
import weakref
from pathlib import Path

# What the scripts read when they run, not when the libraries import: a request may differ in these
# (huggingface_hub reads a token from the environment each time it needs one); and the pytest-xdist
# worker's name, which nothing reads on import: every worker asks this one process, started with the
# environment of the first
READ_AT_RUN_TIME = frozenset({"OMP_NUM_THREADS", "PYTEST_CURRENT_TEST", "PYTEST_XDIST_WORKER",
                              "ACCELERATE_MIXED_PRECISION", "SFT_PLAY_CACHE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"})
# What a make target and its launcher set for the ranks, which nothing the zygote imports reads on
# import: the Makefile's variables and make's own (exported to the commands below it), the
# rendezvous, accelerate's and the training's settings, what DeepSpeed reads (not imported here) and
# datasets' progress bars (imported here as every command sets them); a shell's own (SHLVL, _) and a
# SLURM job's, which the launcher reads. CUDA_VISIBLE_DEVICES is read at torch's first CUDA call,
# which the imports here do not make (main checks it).
RANK_READS_AT_RUN_TIME = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                    "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR",
                                    "MASTER_PORT", "CUDA_VISIBLE_DEVICES", "DS_ACCELERATOR",
                                    "HF_DATASETS_DISABLE_PROGRESS_BARS", "COLUMNS", "LINES", "MAKEFLAGS", "MFLAGS",
                                    "MAKEOVERRIDES", "MAKELEVEL", "SHLVL", "_",
                                    *re.findall(r"^([A-Z_]+) \?=", (Path(__file__).resolve().parents[1] / "Makefile")
                                                .read_text(), flags=re.MULTILINE)})
RANK_PREFIXES_READ_AT_RUN_TIME = ("TORCHELASTIC_", "TORCH_ELASTIC_", "TORCH_NCCL_", "ACCELERATE_", "FSDP_", "NCCL_",
                                  "SFT_PLAY_", "SLURM_")
# The socket a rank's stand-in (tests/shim/sitecustomize.py) asks this process to fork it on
SOCKET_ENV = "SFT_PLAY_TESTS_ZYGOTE"
# Only libraries that read nothing a script sets in its environment before importing them, or read
# it as every script sets it (:data:`SET_BY_EVERY_SCRIPT`): not DeepSpeed (DS_ACCELERATOR; hidden
# instead: _HiddenDeepSpeed) nor bitsandbytes (sft_play.lean_imports). Inductor's compiler is what both of
# those import through the ``torch.compile`` they decorate functions with on import (DeepSpeed's Muon,
# bitsandbytes' CPU operators): 0.8 CPU-seconds in every rank of a ZeRO run and every QLoRA process.
# Llama's modeling code: the embedded default's (configs/tiny_model), which most scripts load
PRELOADED = ("torch", "torch.distributed.tensor", "torch._inductor.compile_fx", "transformers",
             "transformers.modeling_utils", "transformers.masking_utils", "transformers.models.auto.modeling_auto",
             "transformers.models.llama.modeling_llama", "transformers.tokenization_utils_base", "accelerate",
             "safetensors", "numba", "datasets")
# Then the stack every training script imports, which reads nothing from the environment on import
# and imports neither DeepSpeed nor bitsandbytes, hidden while it imports here: peft imports
# bitsandbytes where it can (peft.helpers keeps None for it, used by no helper sft_play calls), and a
# script that uses it imports it itself (sft_play.lean_imports hides it from one that does not). The
# availability checks that cache what they found are cleared after (:func:`_preload_without_bitsandbytes`).
PRELOADED_WITHOUT_BITSANDBYTES = ("peft", "trl", "sft_play.cli", "sft_play.train", "torch.utils.tensorboard")
# What every command sets before it imports the libraries (sft_play.cli.quiet_libraries, with
# setdefault): set here only while they import, so that a request's environment without it is this
# process's, and one that sets it otherwise differs (and starts fresh)
SET_BY_EVERY_SCRIPT = {"HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}


# This process's own streams, kept referenced in a child: were they collected there, they would
# close the descriptors the child's own streams use
_KEPT: list = []


def differing(env: dict, base: dict, rank: bool = False) -> list[str]:
    """What `env` sets otherwise than `base` (the zygote's environment) beyond what the libraries
    read when a script runs (and, for a launcher's rank, what the launcher sets for it)."""
    def read_at_run_time(key: str) -> bool:
        return key in READ_AT_RUN_TIME or rank and (key in RANK_READS_AT_RUN_TIME
                                                    or key.startswith(RANK_PREFIXES_READ_AT_RUN_TIME))

    def value(environment: dict, key: str) -> str | None:
        if key == "PYTHONPATH" and rank:  # (a launcher puts the repo first again)
            return os.pathsep.join(dict.fromkeys(environment.get(key, "").split(os.pathsep)))
        return environment.get(key)

    return sorted(key for key in set(env) | set(base) if not read_at_run_time(key) and value(env, key) != value(base, key))


def _child(request: dict, own_fds: tuple[int, ...], stdio: list[int] | None = None) -> None:
    """In the forked child: become ``python argv...`` and never return. Its standard streams are
    the request's files, or the descriptors `stdio` (a rank's own, passed by its stand-in)."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in own_fds:
            os.close(fd)
        if "stand_in" in request:  # which process stands in for this one, said before the script can say anything
            _record_stand_in(request["stand_in"])
        _KEPT.extend((sys.stdin, sys.stdout, sys.stderr, sys.__stdin__, sys.__stdout__, sys.__stderr__))
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        if stdio is None:
            stdio = [os.open(path, flags, 0o644) for path, flags in (
                (os.devnull, os.O_RDONLY), (request["stdout"], os.O_WRONLY | os.O_CREAT),
                (request["stderr"], os.O_WRONLY | os.O_CREAT))]
        for fd, opened in enumerate(stdio):
            if opened != fd:
                os.dup2(opened, fd)
                os.close(opened)
        # as a fresh interpreter opens them: stdout block-buffered to a file, stderr line-buffered;
        # both written through under ``python -u`` (how launchers start their ranks)
        sys.stdin = sys.__stdin__ = open(0, closefd=False)
        if request.get("unbuffered"):
            import io

            sys.stdout = sys.__stdout__ = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
            sys.stderr = sys.__stderr__ = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                                           errors="backslashreplace")
        else:
            sys.stdout = sys.__stdout__ = open(1, "w", closefd=False)
            sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)
        threads = request["env"].get("OMP_NUM_THREADS")
        if threads:
            import torch

            torch.set_num_threads(int(threads))
        import runpy

        script, *_ = request["argv"]
        sys.argv = list(request["argv"])
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
        except BaseException:  # as the interpreter ends on an uncaught exception
            import traceback

            traceback.print_exc()
        import atexit
        import threading

        threading._shutdown()  # non-daemon threads are waited for, then the exit functions run
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _record_stand_in(stand_in: int) -> None:
    """(In a fork) The record tests/conftest.py's ``with_forks`` reads: the stand-in's pid names a file
    holding this process's, written whole (a reader never sees it half written)."""
    folder = Path(os.environ[SOCKET_ENV]).parent / "stand-ins"
    folder.mkdir(exist_ok=True)
    written = folder / f".{os.getpid()}"
    written.write_text(str(os.getpid()))
    os.replace(written, folder / str(stand_in))


def _send(connection: socket.socket, document: dict) -> None:
    """One JSON line to a stand-in or a pytest process; one that is gone is closed when next read."""
    try:
        connection.sendall((json.dumps(document) + "\n").encode())
    except OSError:
        pass


class _Rank:
    """A connection from a rank's stand-in: its request as it arrives, then the fork that runs it."""

    def __init__(self, connection: socket.socket):
        self.connection, self.key, self.received, self.fds, self.pid = connection, connection.fileno(), b"", [], None

    def answer(self, document: dict) -> None:
        _send(self.connection, document)  # (a stand-in gone: its fork is ended when its connection closes)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        self.connection.close()


class _Client:
    """A connection from a pytest process (tests/conftest.py): its scripts' requests, one a line, each
    answered ``{"pid": N}`` and, when that fork ends, ``{"ended": N, "returncode": R}``."""

    def __init__(self, connection: socket.socket):
        self.connection, self.key, self.received = connection, connection.fileno(), b""

    def say(self, document: dict) -> None:
        _send(self.connection, document)


def _preload_without_bitsandbytes() -> None:
    import importlib

    assert "bitsandbytes" not in sys.modules and "deepspeed" not in sys.modules
    from sft_play import lean_imports  # (the repo is on PYTHONPATH: conftest)

    lean_imports.without_bitsandbytes()
    for name in PRELOADED_WITHOUT_BITSANDBYTES:
        importlib.import_module(name)
    lean_imports.needed("bitsandbytes")
    import peft.import_utils
    import transformers.utils.import_utils

    for check in (peft.import_utils.is_bnb_available, peft.import_utils.is_bnb_4bit_available,
                  transformers.utils.import_utils.is_bitsandbytes_available):
        check.cache_clear()
    assert "deepspeed" not in sys.modules


# DeepSpeed's modules a ZeRO rank imports, imported here then hidden (:class:`_HiddenDeepSpeed`)
PRELOADED_HIDDEN = ("deepspeed", "deepspeed.runtime.sequence_parallel.ulysses_sp", "deepspeed.runtime.zero.muon.muon_optimizer")
# What DeepSpeed reads from the environment as it imports (DS_ACCELERATOR: which accelerator)
DEEPSPEED_READS = ("DS_ACCELERATOR", "DEEPSPEED_TIMEOUT", "DISABLE_LOGS_WHILE_COMPILING", "MSGPACK_PUREPYTHON",
                   "PYDANTIC_DISABLE_PLUGINS", "HOME")


class _HiddenDeepSpeed:
    """DeepSpeed imported here as a script imports it, then out of ``sys.modules``: a fork that
    never imports it has none of it, as a fresh process (``sft_play.lean_imports`` hides it from
    most training processes), and one that imports it is handed these modules (about half a
    CPU-second of a ZeRO rank's start, forty times in the suite), where its environment holds what
    DeepSpeed read here (:data:`DEEPSPEED_READS`); elsewhere it imports its own. What the import
    did besides (a variable it sets, its logger's stream) is done again as it is handed over. A
    meta-path finder: ``importlib.util.find_spec`` finds it without importing it, as it would
    find the files."""

    def __init__(self) -> None:
        import importlib
        import logging

        import torch

        assert not any(name == "deepspeed" or name.startswith("deepspeed.") for name in sys.modules)
        original = dict(os.environ)
        if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():  # as sft_play.cli.quiet_libraries
            os.environ["DS_ACCELERATOR"] = "cpu"
        self.read = {key: os.environ.get(key) for key in DEEPSPEED_READS}
        before = dict(os.environ)
        loggers = logging.root.manager.loggerDict
        handlers = {name: list(getattr(logger, "handlers", [])) for name, logger in loggers.items()}
        streams = {"stdout": sys.stdout, "stderr": sys.stderr}
        # (imported with stand-ins for the streams, which the handlers DeepSpeed makes on import keep:
        # a script that imports it has them pointed at its own, as a fresh import would have made them)
        stand_ins = {name: open(os.devnull, "w") for name in streams}
        sys.stdout, sys.stderr = stand_ins["stdout"], stand_ins["stderr"]
        try:
            for name in PRELOADED_HIDDEN:
                try:
                    importlib.import_module(name)
                except Exception:  # noqa: BLE001 - none, another layout, or failing here: each fork imports its own
                    break
        finally:
            sys.stdout, sys.stderr = streams["stdout"], streams["stderr"]
        self.set = {key: value for key, value in os.environ.items() if key not in before}
        os.environ.clear()
        os.environ.update(original)
        self.streams = [(handler, stream) for name, logger in loggers.items()
                        for handler in getattr(logger, "handlers", []) if handler not in handlers.get(name, [])
                        for stream, stand_in in stand_ins.items() if getattr(handler, "stream", None) is stand_in]
        self.modules = {name: module for name, module in sys.modules.items()
                        if name == "deepspeed" or name.startswith("deepspeed.")}
        for name in self.modules:
            del sys.modules[name]
        if "deepspeed" in self.modules:
            sys.meta_path.insert(0, self)

    def find_spec(self, name, path=None, target=None):
        if name != "deepspeed" or not self.modules or any(os.environ.get(k) != v for k, v in self.read.items()):
            return None
        import importlib.util

        original = self.modules["deepspeed"].__spec__
        spec = importlib.util.spec_from_loader(name, self, origin=original.origin, is_package=True)
        spec.submodule_search_locations = original.submodule_search_locations
        return spec

    def create_module(self, spec):
        return self.modules["deepspeed"]

    def exec_module(self, module) -> None:
        module.__spec__ = self.modules["deepspeed"].__spec__
        for name, found in self.modules.items():
            sys.modules.setdefault(name, found)
        self.modules = {}
        for key, value in self.set.items():
            os.environ.setdefault(key, value)
        for handler, stream in self.streams:
            handler.setStream(getattr(sys, stream))


def _no_library_teardown_at_exit() -> None:
    """torch's operator libraries, loaded here, unregister their kernels as a process exits (a
    ``weakref.finalize`` each, ~250): in a fork about to end that is work for nothing, and writes to
    pages it shares with this process, which the kernel then copies. A fork skips them; a fresh
    interpreter, which runs them, ends the same."""
    import torch.library

    for finalizer in list(getattr(weakref.finalize, "_registry", ())):  # (CPython's live finalizers)
        found = finalizer.peek()
        if found is not None and found[1] is torch.library._del_library:
            finalizer.atexit = False


def main() -> None:
    scripts_path, until = sys.argv[1], int(sys.argv[2])
    try:  # the session's end: the process the suite runs in ends (opened first: a pid taken later may be another's)
        session = os.pidfd_open(until)
    except OSError:  # (an older kernel) looked at once a second instead
        session = None
    gc.disable()  # as sft_play.cli.importing: imported with the collector paused, then frozen
    import importlib

    added = {key: value for key, value in SET_BY_EVERY_SCRIPT.items() if key not in os.environ}
    os.environ.update(added)
    for name in PRELOADED:
        importlib.import_module(name)
    _preload_without_bitsandbytes()
    # transformers' table of checkpoint renamings, which a process's first model load builds from
    # thousands of regular expressions (0.17 CPU-s) and every later load reuses: built once here
    sys.modules["transformers.conversion_mapping"].get_checkpoint_conversion_mapping("llama")
    # torch's meta kernels split in two, as a process's first plan splits them (~40 ms,
    # sft_play.patches.native_meta_kernels): done here once, not in each training process
    patches = sys.modules["sft_play.patches"]
    with patches.native_meta_kernels():
        pass
    patches._checked.cache_clear()  # (a fork checks the versions of what it patches itself)
    _HiddenDeepSpeed()
    _no_library_teardown_at_exit()
    for key in added:
        del os.environ[key]
    gc.freeze()
    gc.enable()
    assert not sys.modules["torch"].cuda.is_initialized()  # (see RANK_READS_AT_RUN_TIME)
    base = dict(os.environ)
    ended_r, ended_w = os.pipe()
    os.set_blocking(ended_w, False)
    signal.set_wakeup_fd(ended_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    scripts = _listening(scripts_path)
    if scripts is None:
        sys.exit(1)
    listener = _listening(os.environ[SOCKET_ENV]) if os.environ.get(SOCKET_ENV) else None
    clients: dict[int, _Client] = {}  # by the connection's descriptor
    owners: dict[int, _Client] = {}  # a script's fork's pid: the client that asked for it
    ranks: dict[int, _Rank] = {}  # by the connection's descriptor
    forked_ranks: dict[int, _Rank] = {}  # by the fork's pid

    def fork(request: dict, stdio: list[int] | None = None) -> int:
        sys.stdout.flush(), sys.stderr.flush()
        own = (ended_r, ended_w, scripts.fileno(), *([listener.fileno()] if listener else []),
               *([session] if session is not None else []), *clients, *ranks,
               *(fd for rank in ranks.values() for fd in rank.fds if fd not in (stdio or ())))
        pid = os.fork()
        if pid == 0:
            _child(request, own, stdio)
        print(f"forked {pid}: {' '.join(request['argv'][:2])}", file=sys.stderr, flush=True)
        return pid

    def from_rank(rank: _Rank) -> None:
        try:
            data, fds, _, _ = socket.recv_fds(rank.connection, 1 << 20, 3)
        except OSError:
            data, fds = b"", []
        rank.fds += fds
        if not data:  # the stand-in ended: so does its fork, as the rank itself would have
            if rank.pid in forked_ranks:
                os.kill(rank.pid, signal.SIGKILL)
            del ranks[rank.key]
            rank.close()
            return
        rank.received += data
        if rank.pid is not None or not rank.received.endswith(b"\n"):
            return
        request = json.loads(rank.received)
        reasons = differing(request["env"], base, rank=True)  # (a script's own request too: the same reads)
        if reasons or len(rank.fds) != 3:
            print(f"fresh: {' '.join(request['argv'][:1])}: {reasons}", file=sys.stderr, flush=True)
            rank.answer({"fresh": reasons})
            del ranks[rank.key]
            rank.close()
            return
        try:
            rank.pid = fork(request, rank.fds)
        except OSError as exc:  # (the system refused a fork: the rank starts fresh)
            rank.answer({"fresh": [str(exc)]})
            del ranks[rank.key]
            rank.close()
            return
        forked_ranks[rank.pid] = rank
        for fd in rank.fds:
            os.close(fd)
        rank.fds = []
        rank.answer({"pid": rank.pid})

    def from_client(client: _Client) -> None:
        try:
            data = client.connection.recv(65536)
        except OSError:
            data = b""
        if not data:  # its pytest process ended
            del clients[client.key]
            client.connection.close()
            return
        client.received += data
        while b"\n" in client.received:
            line, client.received = client.received.split(b"\n", 1)
            try:
                pid = fork(json.loads(line))
            except OSError as exc:  # (the system refused a fork: that script starts fresh, the others go on)
                client.say({"error": str(exc)})
                continue
            owners[pid] = client
            client.say({"pid": pid})

    while True:
        watched = [scripts, ended_r, *([listener] if listener else []), *([session] if session is not None else []),
                   *clients, *ranks]
        readable, _, _ = select.select(watched, [], [], None if session is not None else 1.0)
        if session in readable or session is None and not _alive(until):
            # (the session's folder may be gone already; the pid file says a zygote was started in it)
            for path in (scripts_path, Path(scripts_path).with_suffix(".pid"),
                         *([os.environ[SOCKET_ENV]] if listener else [])):
                Path(path).unlink(missing_ok=True)
            return
        if ended_r in readable:
            os.read(ended_r, 4096)
        while True:  # every child that has ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            ended = {"ended": pid, "returncode": os.waitstatus_to_exitcode(status)}
            rank = forked_ranks.pop(pid, None)
            if rank is None:
                client = owners.pop(pid, None)
                if client is not None and clients.get(client.key) is client:
                    client.say(ended)
            else:
                rank.answer(ended)
                if ranks.get(rank.key) is rank:  # (not a later connection given the same descriptor)
                    del ranks[rank.key]
                    rank.close()
        if scripts in readable:
            client = _Client(scripts.accept()[0])
            clients[client.key] = client
        if listener is not None and listener in readable:
            connection, _ = listener.accept()
            rank = _Rank(connection)
            ranks[rank.key] = rank
        for fd in [fd for fd in readable if fd in clients]:
            from_client(clients[fd])
        for fd in [fd for fd in readable if fd in ranks]:
            from_rank(ranks[fd])


def _listening(path: str) -> socket.socket | None:
    """A Unix socket listening at `path` (None, said on stderr, where it cannot: a path too long; then
    the tests' scripts, or the ranks, start as fresh interpreters)."""
    if os.path.exists(path):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(path)
        listener.listen(64)
    except OSError as exc:
        print(f"no socket at {path}: {exc}", file=sys.stderr, flush=True)
        listener.close()
        return None
    return listener


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


if __name__ == "__main__":
    main()
