"""The planner's error on your own hardware: every run folder's memory check (predicted peak
beside what the GPU really used, written at the end of each training run) as one table.

Usage: python scripts/planner_check.py [--runs runs/] [--json]
"""

from __future__ import annotations

import json
from pathlib import Path

from sft_play import cli, memory_check


def main() -> int:
    parser = cli.Parser(description=cli.summary(__doc__))
    parser.add_argument("--runs", default="runs", help="a folder of run folders (train.output_dir), or one run folder")
    parser.add_argument("--json", action="store_true", help="the records as one JSON list")
    args = parser.parse_args()
    root = Path(args.runs)
    if not root.is_dir():
        raise cli.UserError(f"'{root}' is not a folder; pass the runs' folder (train.output_dir) with RUNS=...")
    documents = memory_check.gather(root)
    if not documents:
        raise cli.UserError(f"no run under '{root}' has a {memory_check.RECORD} yet: one is written when training ends")
    print(json.dumps(documents, indent=2) if args.json else memory_check.table(documents))
    return 0


if __name__ == "__main__":
    cli.run(main)
