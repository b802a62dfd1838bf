"""Starting things: the training command for each launcher (:mod:`.commands`), looking after
the training processes until they end (:mod:`.supervise`), and TensorBoard beside them
(:mod:`.tensorboard`). The launch targets of the Makefile come through here
(``scripts/launch.py``); nothing here trains. What a stop means to both sides (exit statuses,
the resume command) is :mod:`sft_play.stopping`.
"""

from sft_play.launch.commands import (ACCELERATE_DDP_CONFIG, DEFAULT_MASTER_PORT, REPO, TRAIN_SCRIPT, LaunchError,
                                      Timeouts, Topology, accelerate_command, child_env, python_command,
                                      resolve_topology, torchrun_command)
from sft_play.lean_imports import sanitized_cuda_arch_list
from sft_play.launch.supervise import NodeCount, StopForwarder, run_launcher, run_process
from sft_play.launch.tensorboard import (LOOPBACK, free_port, interrupt_on_termination, loopback_url, port_is_free,
                                         start_tensorboard, stop, wait_for_port)
from sft_play.stopping import (DUPLICATE_SIGNAL_WINDOW_S, EXIT_INTERRUPTED, EXIT_USER_ERROR, resume_command,
                               user_command)

__all__ = [
    "ACCELERATE_DDP_CONFIG", "DEFAULT_MASTER_PORT", "DUPLICATE_SIGNAL_WINDOW_S", "EXIT_INTERRUPTED", "EXIT_USER_ERROR",
    "LOOPBACK", "REPO", "TRAIN_SCRIPT", "LaunchError", "NodeCount", "StopForwarder", "Timeouts", "Topology",
    "accelerate_command", "child_env", "free_port", "interrupt_on_termination", "loopback_url", "port_is_free",
    "python_command", "resolve_topology", "resume_command", "run_launcher", "run_process", "sanitized_cuda_arch_list",
    "start_tensorboard", "stop", "torchrun_command", "user_command", "wait_for_port",
]
