"""What stopping means, for the launcher and the training processes alike: the exit statuses,
when a repeated signal is the same request, and the command that resumes a stopped run (the
user's own ``make`` line with ``RESUME=auto``, found by walking up the parent processes).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import sys
from pathlib import Path

EXIT_INTERRUPTED = 75  # EX_TEMPFAIL: stopped by a signal after saving; resume to finish
EXIT_USER_ERROR = 2
# A rank that lost contact with another (which stopped, or whose node failed): a consequence,
# so the launcher names another failed rank as the cause when there is one
EXIT_LOST_PEER = 3
# The same stop signal arriving again within this many seconds is a duplicate, not a second request
DUPLICATE_SIGNAL_WINDOW_S = 2.0

_MAKE = {"make", "gmake"}


# What the kernel sends a training rank when its launcher ends: a stop request of its own, which
# the training's handler never takes for a second, impatient one (SIGTERM twice stops at once)
LAUNCHER_GONE = signal.SIGUSR1


def die_with_parent() -> None:
    """Have the kernel send this process :data:`LAUNCHER_GONE` when the process that started it
    ends, however it ends (Linux's ``PR_SET_PDEATHSIG``): a training rank never outlives its
    launcher, which make's process group may lose to a SIGKILL while the ranks, in their own
    group, would go on training into the run folder. The rank saves a checkpoint and stops.

    Raises:
        SystemExit: the launcher ended before the request took effect.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(LAUNCHER_GONE), 0, 0, 0)
    if os.getppid() != parent:
        raise SystemExit("the launcher that started this training process is gone; not training")

_SHELLS = {"sh", "bash", "dash", "zsh"}


# The user's command, as the launcher found it, for the training processes it starts: they may
# outlive it (killed with make's process group) and can no longer find it above them
USER_COMMAND_ENV = "SFT_PLAY_USER_COMMAND"


def user_command() -> list[str]:
    """The command the user ran to start this training process: the one its launcher found
    (:data:`USER_COMMAND_ENV`), else the nearest ``make`` above it (reached through the launcher
    and make's shell only), else the launcher script's command line, else this process's own."""
    import json

    import psutil

    try:
        given = json.loads(os.environ.get(USER_COMMAND_ENV, "null"))
    except ValueError:
        given = None
    if isinstance(given, list) and given and all(isinstance(word, str) for word in given):
        return given
    found = [sys.executable, *sys.argv]
    try:
        parents = psutil.Process().parents()
    except psutil.Error:
        return found
    for parent in parents:
        try:
            command = parent.cmdline()
        except psutil.Error:
            break
        name = Path(command[0]).name if command else ""
        if name in _MAKE:
            return command
        if any(Path(word).name == "launch.py" and Path(word).parent.name == "scripts" for word in command[1:3]):
            found = command
        elif not (name in _SHELLS and "-c" in command[1:2]):
            break
    return found


def resume_command(command: list[str] | None = None) -> str:
    """`command` (default :func:`user_command`) as a shell line that resumes the run: ``make``
    commands get ``RESUME=auto``, script command lines ``train.resume_from=auto`` (replacing any
    resume setting they had)."""
    command = list(command or user_command())
    if command and Path(command[0]).name in _MAKE:
        words = []
        for word in command:
            if word.startswith("RESUME="):
                continue
            if word.startswith("ARGS="):  # as typed, less a resume setting (RESUME=auto says it)
                word = re.sub(r"(^|\s)train\.resume_from=\S*", "", word[len("ARGS="):]).strip()
                word = "ARGS=" + word
            words.append(word)
        return shlex.join(words + ["RESUME=auto"])
    return shlex.join([w for w in command if not w.startswith("train.resume_from=")] + ["train.resume_from=auto"])
