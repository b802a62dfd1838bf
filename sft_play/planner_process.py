"""A process that only plans: it builds models on the meta device and never runs a GPU kernel,
so the packages that bring kernels are not imported. bitsandbytes alone costs about a second of
``make plan`` on 2 cores (it compiles its CPU operators' registrations through torch's inductor on
import) and is not needed: QLoRA is planned from transformers' rule for which linears it would
quantise, on plain meta-device linears."""

from __future__ import annotations

import sys

KERNEL_PACKAGES = ("bitsandbytes",)


def without_gpu_kernel_packages() -> None:
    """Make this process see the kernel packages as absent (``importlib.util.find_spec`` answers
    None, as peft and transformers ask). Call it before anything imports them; only in a process
    that plans and exits."""
    for name in KERNEL_PACKAGES:
        if name not in sys.modules:
            sys.modules[name] = None  # type: ignore[assignment]
