"""Chat with a trained run in the terminal: each line you type is a user turn; the history is
kept. /reset starts over, /exit (or Ctrl-D) leaves.

Usage: python scripts/chat.py [--config PATH] [--run RUN_DIR] [--system TEXT]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sft_play import cli  # noqa: E402
from sft_play import config as config_module  # noqa: E402


def main() -> int:
    parser = cli.config_parser(__doc__.splitlines()[0])
    parser.add_argument("--run", help="run folder (default: the newest finished run under train.output_dir)")
    parser.add_argument("--system", help="a system message to start every conversation with")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    args = parser.parse_args()

    from sft_play import export

    output_dir = config_module.load(args.config, args.overrides, check_paths=False).train.output_dir
    run = export.resolve_run(args.run, output_dir)
    trained, tokenizer, _ = export.load_trained(run)
    start = [{"role": "system", "content": args.system}] if args.system else []
    history = list(start)
    print(f"Chatting with {run}. /reset starts over, /exit leaves.", flush=True)
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            print()
            return 0
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            history = list(start)
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        answer = export.generate(trained, tokenizer, history, args.max_new_tokens)
        history.append({"role": "assistant", "content": answer})
        print(f"model> {answer}", flush=True)


if __name__ == "__main__":
    cli.run(main)
