"""Print this machine's GPUs (index, name, memory, compute capability, bf16, links), CPU and RAM.

Exits 0 on a machine without a GPU, saying so. --json prints the same facts as one document.

Usage: python scripts/gpu_info.py [--json]
"""

from __future__ import annotations

import argparse
import json


from sft_play import cli, hardware


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args()
    facts = hardware.detect()
    print(json.dumps(facts.to_dict(), indent=2) if args.json else hardware.format_report(facts))
    return 0


if __name__ == "__main__":
    cli.run(main)
