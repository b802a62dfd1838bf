"""Write docs/CONFIG.md, the reference of every config key, from the config schema itself.

Usage: python scripts/config_reference.py [--check]   (--check: exit 1 if the file is out of date)
"""

from __future__ import annotations

import sys
from pathlib import Path


from sft_play import cli, config

TARGET = Path(__file__).resolve().parents[1] / "docs" / "CONFIG.md"


def main() -> int:
    parser = cli.Parser(description=cli.summary(__doc__))
    parser.add_argument("--check", action="store_true", help="only check that docs/CONFIG.md is current")
    args = parser.parse_args()
    text = config.reference_markdown()
    if args.check:
        current = TARGET.read_text() if TARGET.exists() else ""
        if current != text:
            print(f"{TARGET} is out of date: run python scripts/config_reference.py", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(text)
    print(f"wrote {TARGET}")
    return 0


if __name__ == "__main__":
    cli.run(main)
