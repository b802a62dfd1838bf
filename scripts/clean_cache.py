"""Show what the cache ($SFT_PLAY_CACHE, else ~/.cache/sft_play) holds and delete what runs have
not used for a while: preprocessed data, initialised weights, planner traces. A run makes again
whatever it needs; nothing deleted here is a result.

Usage: python scripts/clean_cache.py [--days N | --all] [--dry-run]
"""

from __future__ import annotations

import time

from sft_play import cache_usage, cli
from sft_play.paths import cache_dir
from sft_play.units import GIB


def main() -> int:
    parser = cli.Parser(description=cli.summary(__doc__))
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--days", type=float, default=14.0,
                       help="delete entries no run has used for this many days (default 14)")
    which.add_argument("--all", action="store_true", help="delete every entry no process is preparing or writing")
    parser.add_argument("--dry-run", action="store_true", help="say what would be deleted, delete nothing")
    args = parser.parse_args()
    if args.days < 0:
        raise cli.UserError(f"--days must be 0 or more (got {args.days:g})")
    root = cache_dir()
    found = cache_usage.entries(root)
    chosen = cache_usage.to_clean(None if args.all else args.days, root)
    now = time.time()
    print(f"Cache {root}: {len(found)} entries, {sum(e.bytes for e in found) / GIB:.2f} GiB")
    for kind, name in cache_usage.KINDS.items():
        of_kind = [e for e in found if e.kind == kind]
        if of_kind:
            going = [e for e in chosen if e.kind == kind]
            print(f"  {name:<28} {len(of_kind):>4} entries {sum(e.bytes for e in of_kind) / GIB:8.2f} GiB"
                  f"   unused for {(now - max(e.last_used for e in of_kind)) / 86400:.0f}-"
                  f"{(now - min(e.last_used for e in of_kind)) / 86400:.0f} days;"
                  f" {len(going)} to delete ({sum(e.bytes for e in going) / GIB:.2f} GiB)")
    rule = "every entry not in use" if args.all else f"entries unused for more than {args.days:g} days"
    if args.dry_run:
        print(f"Dry run: would delete {len(chosen)} ({rule}), {sum(e.bytes for e in chosen) / GIB:.2f} GiB")
        return 0
    freed = cache_usage.remove(chosen)
    print(f"Deleted {len(chosen)} ({rule}): {freed / GIB:.2f} GiB freed")
    return 0


if __name__ == "__main__":
    cli.run(main)
