"""Print this machine's GPUs (index, name, memory, compute capability, bf16, links), CPU and RAM,
and the precision ``train.mixed_precision: auto`` trains in here.

On a GPU that nothing has measured yet (same GPU model, driver and torch), it also probes once
what a training process holds outside PyTorch's allocator (creating a CUDA context on the first
GPU, and loading the kernels a first step loads) and keeps it for the planner
(hardware.remember_outside_allocator); every GPU run measures it again.

Exits 0 on a machine without a GPU, saying so. --json prints the same facts as one document.

Usage: python scripts/gpu_info.py [--json]
"""

from __future__ import annotations

import json
import sys


from sft_play import cli, hardware
from sft_play.precision import auto_mixed_precision


def main() -> int:
    parser = cli.Parser(description=cli.summary(__doc__))
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args()
    facts = hardware.detect()
    if facts.gpus and not facts.outside_allocator:
        try:
            measured = hardware.measure_outside_allocator(0)
        except Exception as exc:  # noqa: BLE001 - a busy or failing GPU: the report goes on without it
            print(f"(what a process holds outside the allocator was not measured: {str(exc).splitlines()[0][:200]})",
                  file=sys.stderr)
            measured = None
        if measured:
            hardware.remember_outside_allocator(facts, hardware.PROBE, measured)
            facts.outside_allocator = hardware.remembered_outside_allocator(facts)
    mixed, reason = auto_mixed_precision(facts.has_gpu, facts.bf16_supported(facts.has_gpu))
    if args.json:
        print(json.dumps({**facts.to_dict(), "auto_mixed_precision": {"mode": mixed, "reason": reason}}, indent=2))
    else:
        print(hardware.format_report(facts))
        print(f"train.mixed_precision=auto trains in {'fp32' if mixed == 'no' else mixed} here ({reason})")
    return 0


if __name__ == "__main__":
    cli.run(main)
