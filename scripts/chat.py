"""Chat with a trained run in the terminal: each line you type is a user turn; the history is
kept. /image PATH shows a picture with your next line (a vision-language run), /reset starts over,
/exit (or Ctrl-D) leaves.

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
    pictures: list = []  # the images the conversation has shown, in order
    pending = None  # the image /image gave, shown with the next line
    sees = export.text_tokenizer(tokenizer) is not tokenizer  # a vision-language model's processor
    commands = ("/image PATH shows a picture with your next line, " if sees else "") + \
        "/reset starts over, /exit leaves, /help lists these"
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
            history, pictures, pending = list(start), [], None
            print("(conversation cleared)", flush=True)
            continue
        if line.startswith("/image"):
            if not sees:
                print("(this model reads text only)", flush=True)
                continue
            if not line.removeprefix("/image").strip():
                print("(/image needs the path of a picture: /image PATH)", flush=True)
                continue
            try:
                pending = export.user_prompt(run, "", line.removeprefix("/image").strip(), "/image ").images[0]
                print("(the picture goes with your next line)", flush=True)
            except cli.UserError as exc:
                print(f"({exc})", flush=True)
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
        if pending is not None:
            history.append({"role": "user", "content": [{"type": "image"}, {"type": "text", "text": line}]})
            pictures.append(pending)
            pending = None
        else:
            history.append({"role": "user", "content": line})
        shown = export.Prompt(history, None, "", pictures) if pictures else history
        try:
            answer = export.generate(trained, tokenizer, shown, args.max_new_tokens)
        except cli.UserError as exc:  # a picture shown earlier changed or went: the conversation starts over
            print(f"({exc}; conversation cleared)", flush=True)
            history, pictures, pending = list(start), [], None
            continue
        history.append({"role": "assistant", "content": answer})
        print(f"model> {answer}", flush=True)


if __name__ == "__main__":
    cli.run(main)
