"""Chat with a trained run in the terminal: each line you type is a user turn; the history is
kept. /reset starts over, /exit (or Ctrl-D) leaves.

Usage: python scripts/chat.py [--config PATH] [--run RUN_DIR] [--system TEXT]
"""

from __future__ import annotations

import re


from sft_play import cli, lean_imports


def main() -> int:
    parser = cli.run_parser(cli.summary(__doc__))
    parser.add_argument("--system", help="a system message to start every conversation with (default: the run's "
                        "data.system_prompt)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    args = parser.parse_args()

    run = cli.chosen_run(args)
    lean_imports.for_run_folder(run)  # before the model stack is imported

    with cli.importing():
        from sft_play import export
    trained, tokenizer, _ = export.load_trained(run)
    plain = export.trained_on_plain_text(run)
    if plain and args.system:
        raise cli.UserError(f"{run} trained on plain prompt/completion text, without a chat template: it has no system "
                            "message to take; leave out --system")
    start = [{"role": "system", "content": args.system}] if args.system else export.system_turn(run)
    history = list(start)
    commands = "/reset starts over, /exit leaves, /help lists these"
    print(f"Chatting with {run}. {commands}.", flush=True)
    if plain:
        print("It trained on plain prompt/completion text (no chat template): each line goes to it as it is, "
              "without the lines before.", flush=True)
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
            print("(conversation cleared)", flush=True)
            continue
        if re.match(r"/[A-Za-z]+\b", line):  # a command, not a message
            word = line.split()[0]
            print(f"({commands})" if word == "/help" else f"(unknown command {word}: {commands})", flush=True)
            continue
        if not line:
            continue
        if plain:
            print(f"model> {export.generate(trained, tokenizer, export.Prompt(None, line, ''), args.max_new_tokens)}",
                  flush=True)
            continue
        history.append({"role": "user", "content": line})
        answer = export.generate(trained, tokenizer, history, args.max_new_tokens)
        history.append({"role": "assistant", "content": answer})
        print(f"model> {answer}", flush=True)


if __name__ == "__main__":
    cli.run(main)
