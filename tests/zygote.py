"""A process that has imported the libraries every script imports, and forks the scripts the
tests run (tests/conftest.py: ``run_script``, ``run_scripts_together``).

A script started by a test spends most of its CPU importing torch, transformers and accelerate
(about 4 of a 4-step tiny training's 7 CPU-seconds on a 2-core AMD EPYC), and the
suite starts dozens. Forked from here, a script starts with them imported and runs as
``python SCRIPT ARGS`` would: ``__main__``, its arguments, working directory, environment,
output files and thread count are its own, its exit status is reported as a process's.

What cannot be the script's own is what those libraries read from the environment when they
were imported (``HF_HUB_OFFLINE``, ``HF_HOME``, ``ATEN_CPU_CAPABILITY``...): a request whose
environment differs from this process's in anything but :data:`READ_AT_RUN_TIME` is started
as a fresh interpreter instead (conftest decides). Nothing is imported here that a script
decides about or configures first (:data:`PRELOADED`): datasets, bitsandbytes and DeepSpeed,
peft, trl and sft_play itself are imported by the script, as in a fresh process.

Protocol, one JSON document per line: on stdout ``{"ready": true}`` once imported; then, for
each request on stdin ``{"argv": [...], "env": {...}, "cwd": ..., "stdout": path,
"stderr": path}``, ``{"pid": N}``, and when a child ends ``{"ended": N, "returncode": R}``
(negative: the signal that ended it, as ``subprocess`` says). It exits when stdin closes.
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import sys

# What the scripts read when they run, not when the libraries import: a request may differ in these
READ_AT_RUN_TIME = frozenset({"OMP_NUM_THREADS", "PYTEST_CURRENT_TEST", "ACCELERATE_MIXED_PRECISION",
                              "SFT_PLAY_CACHE"})
# Only libraries that read nothing a script sets in its environment before importing them: not
# datasets (HF_DATASETS_DISABLE_PROGRESS_BARS, set by sft_play.cli.quiet_libraries), DeepSpeed
# (DS_ACCELERATOR, TORCH_CUDA_ARCH_LIST), bitsandbytes, peft or trl (sft_play.lean_imports)
PRELOADED = ("torch", "torch.distributed.tensor", "transformers", "transformers.modeling_utils",
             "transformers.masking_utils", "transformers.models.auto.modeling_auto",
             "transformers.tokenization_utils_base", "accelerate", "safetensors", "numba")


# This process's own streams, kept referenced in a child: were they collected there, they would
# close the descriptors the child's own streams use
_KEPT: list = []


def _child(request: dict, own_fds: tuple[int, ...]) -> None:
    """In the forked child: become ``python argv...`` and never return."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in own_fds:
            os.close(fd)
        _KEPT.extend((sys.stdin, sys.stdout, sys.stderr, sys.__stdin__, sys.__stdout__, sys.__stderr__))
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT),
                                (2, request["stderr"], os.O_WRONLY | os.O_CREAT)):
            opened = os.open(path, flags, 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        # as a fresh interpreter opens them: stdout block-buffered to a file, stderr line-buffered
        sys.stdin = sys.__stdin__ = open(0, closefd=False)
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


def main() -> None:
    gc.disable()  # as sft_play.cli.importing: imported with the collector paused, then frozen
    import importlib

    for name in PRELOADED:
        importlib.import_module(name)
    gc.freeze()
    gc.enable()
    ended_r, ended_w = os.pipe()
    os.set_blocking(ended_w, False)
    signal.set_wakeup_fd(ended_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    out = sys.stdout

    def say(document: dict) -> None:
        out.write(json.dumps(document) + "\n")
        out.flush()

    say({"ready": True})
    pending = b""
    while True:
        readable, _, _ = select.select([sys.stdin.fileno(), ended_r], [], [])
        if ended_r in readable:
            os.read(ended_r, 4096)
        while True:  # every child that has ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            say({"ended": pid, "returncode": os.waitstatus_to_exitcode(status)})
        if sys.stdin.fileno() in readable:
            chunk = os.read(sys.stdin.fileno(), 65536)
            if not chunk:
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                sys.stdout.flush(), sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(request, (ended_r, ended_w))
                say({"pid": pid})
                print(f"forked {pid}: {' '.join(request['argv'][:2])}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
