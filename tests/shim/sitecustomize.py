"""Under the test suite (tests/conftest.py puts this folder on every process's ``PYTHONPATH``), a
training rank that a launcher starts is forked from the suite's zygote (tests/zygote.py), which
has imported torch, transformers, accelerate, peft, TRL and sft_play already, instead of importing
them again (most of a rank's start: docs/reports/test_suite.md), and the suite starts dozens of ranks.

This process, the one the launcher started, hands the rank's arguments, environment, working
directory and standard streams to the zygote, and stands in for the fork while it runs: the
signals it is sent go to the fork (a launcher stops its ranks by signalling them, or their process
group, which is this process's alone), it asks the kernel for ``LAUNCHER_GONE`` when its parent
ends as the rank would (``sft_play.stopping.die_with_parent``) and passes it on, and it ends as
the fork ended: with its exit status, or killed by the same signal. Killed itself (SIGKILL), its
connection closes and the zygote kills the fork. Where the zygote is not there, or the rank's
environment differs from the zygote's in what the libraries read on import, nothing happens here
and the rank starts as a fresh interpreter; so under ``SFT_PLAY_TESTS_FRESH=1``, which the tests of
what a rank's own process does when its launcher ends give it.

A script a test starts itself (``python scripts/train_distributed.py ...``, not through
``conftest.run_script``) is forked the same way where the test puts ``SFT_PLAY_TESTS_FORK=1`` in its
environment: for the tests that send it signals, read its output as it comes, or wait for it, as
they would for the script's own process. Not for a test of what the process group, the terminal or
a SIGKILL does to the script itself: the fork is not in the stand-in's process group, and a SIGKILL
reaches it when the zygote sees the stand-in gone, a moment later.
"""

import os
import signal
import sys

FORK_ENV = "SFT_PLAY_TESTS_FORK"
# What a stand-in passes on to its fork
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGALRM, signal.SIGCONT, signal.SIGWINCH)


def _stand_in() -> None:
    path = os.environ.get("SFT_PLAY_TESTS_ZYGOTE")
    # a script a test starts itself asks for its fork too where the test says so (FORK_ENV); its own
    # children (a launcher and its agent) do not, unless they are ranks
    script = os.environ.pop(FORK_ENV, None) == "1"
    if (not path or os.environ.get("SFT_PLAY_TESTS_FRESH") == "1" or not (script or "LOCAL_RANK" in os.environ)
            or not sys.argv or not sys.argv[0].endswith(".py") or not sys.platform.startswith("linux")):
        return
    import json
    import socket

    # held from before the fork exists until it is passed on to it (a test may signal this process as
    # soon as the fork has printed)
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(path)
        request = {"argv": sys.argv, "env": dict(os.environ), "cwd": os.getcwd(), "rank": not script,
                   "stand_in": os.getpid(), "unbuffered": "-u" in sys.orig_argv[1:sys.orig_argv.index(sys.argv[0])]
                   if sys.argv[0] in sys.orig_argv else False}
        socket.send_fds(connection, [(json.dumps(request) + "\n").encode()], [0, 1, 2])
        reader = connection.makefile("rb")
        answer = json.loads(reader.readline() or b"{}")
    except (OSError, ValueError):
        answer = {}
    if "pid" not in answer:  # the zygote said fresh (or is gone): this interpreter goes on as the rank
        connection.close()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        return
    try:  # from here this process is the rank's stand-in, and never runs the script itself
        _stand_in_for(answer["pid"], reader, rank=not script)
    finally:
        os._exit(1)


def _stand_in_for(fork: int, reader, rank: bool) -> None:
    import json

    def forward(signum, _frame):
        try:
            os.kill(fork, signum)
        except ProcessLookupError:
            pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    if rank:
        import ctypes

        parent = os.getppid()
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGUSR1), 0, 0, 0)  # PR_SET_PDEATHSIG: LAUNCHER_GONE
        if os.getppid() != parent:
            forward(signal.SIGUSR1, None)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)  # (what came meanwhile is passed on now)
    ended = json.loads(reader.readline() or b'{"returncode": -9}')["returncode"]  # (-9: the zygote is gone)
    if ended < 0:
        if -ended not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-ended, signal.SIG_DFL)
        os.kill(os.getpid(), -ended)
    os._exit(ended if ended >= 0 else 128 - ended)


_stand_in()
