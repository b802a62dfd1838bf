"""Print this machine's GPUs (index, name, memory, compute capability, bf16, links), CPU and RAM,
and the precision ``train.mixed_precision: auto`` trains in here.

Exits 0 on a machine without a GPU, saying so. --json prints the same facts as one document.

Usage: python scripts/gpu_info.py [--json]
"""

from __future__ import annotations

import argparse
import json


from sft_play import cli, hardware
from sft_play.precision import auto_mixed_precision


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args()
    facts = hardware.detect()
    mixed, reason = auto_mixed_precision(facts.has_gpu, facts.bf16_supported(facts.has_gpu))
    if args.json:
        print(json.dumps({**facts.to_dict(), "auto_mixed_precision": {"mode": mixed, "reason": reason}}, indent=2))
    else:
        print(hardware.format_report(facts))
        print(f"train.mixed_precision=auto trains in {'fp32' if mixed == 'no' else mixed} here ({reason})")
    return 0


if __name__ == "__main__":
    cli.run(main)
