"""Answer a prompt with a trained run, or, without --prompt, held-out prompts from the run's
validation data with the reference answer and the base model's answer beside the trained one.

Usage: python scripts/generate.py [--config PATH] [--run RUN_DIR] [--prompt TEXT] [--image FILE] [--count N]
"""

from __future__ import annotations


from sft_play import cli, lean_imports


def main() -> int:
    parser = cli.run_parser(cli.summary(__doc__))
    parser.add_argument("--prompt", help="a user message (plain text for a run trained on prompt/completion data); "
                        "default: held-out prompts from the validation data")
    parser.add_argument("--image", help="a picture the prompt shows (a vision-language run); needs --prompt")
    parser.add_argument("--count", type=int, default=5, help="held-out prompts to answer (default 5)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--no-base", action="store_true", help="do not show the base model's answers")
    args = parser.parse_args()

    run = cli.chosen_run(args)
    lean_imports.for_run_folder(run)  # before the model stack is imported

    with cli.importing():
        from sft_play import export
    trained, tokenizer, config = export.load_trained(run)
    if args.image and not args.prompt:
        raise cli.UserError("IMAGE= goes with a PROMPT= about it (make generate PROMPT=\"What is in the picture?\" "
                            "IMAGE=...)")
    if args.prompt:
        # as the run's data was: plain, or through the chat template
        prompts = [export.user_prompt(run, args.prompt, args.image)]
    else:
        prompts = export.held_out_prompts(config, args.count) if config else []
        if not prompts:
            raise cli.UserError(f"{run} has no validation data (data.validation_path or data.validation_fraction); "
                                "pass --prompt (PROMPT=...)")
    answers = [export.generate(trained, tokenizer, p, args.max_new_tokens) for p in prompts]
    before: list[str | None] = [None] * len(prompts)
    if not args.no_base and config is not None:
        with export.base_model_of(trained, config) as base:
            before = [export.generate(base, tokenizer, p, args.max_new_tokens) for p in prompts]

    print(f"Run: {run}")
    correct = 0
    for prompt, answer, base_answer in zip(prompts, answers, before):
        print(f"\nprompt:    {prompt.shown()}")
        if prompt.reference:
            print(f"reference: {prompt.reference}")
        if base_answer is not None:
            print(f"before:    {base_answer!r}")
        print(f"after:     {answer!r}")
        correct += bool(prompt.reference) and answer == prompt.reference
    if any(p.reference for p in prompts):
        print(f"\nexact matches after training: {correct}/{len(prompts)}")
    return 0


if __name__ == "__main__":
    cli.run(main)
