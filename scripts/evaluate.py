"""Evaluate a run: loss and perplexity on its validation data (or on other data: --data, a
held-out test set), and a few greedy generations for held-out prompts; written to
<run>/eval.json (<run>/eval-<name>.json for other data) and printed.

Usage: python scripts/evaluate.py [--config PATH] [--run RUN_DIR] [--count N] [--data PATH]
"""

from __future__ import annotations


from sft_play import cli, lean_imports


def _examples(result: dict) -> str:
    examples, rows = result["validation_examples"], result["validation_rows"]
    return f"{examples} examples" + (f", packed into {rows} rows" if rows != examples else "")


def print_pairs(run: object, result: dict, data: str | None) -> None:
    """A preference run's evaluation (sft_play.export.evaluate_pairs)."""
    from sft_play import export

    print(f"Run: {run}\n  data: {result['data']} ({result['pairs']} pairs)\n"
          f"  reward accuracy {result['reward_accuracy']:.3f}, margin mean {result['margin_mean']:.3f} "
          f"(min {result['margin_min']:.3f}), rewards chosen {result['chosen_reward']:.3f} / rejected "
          f"{result['rejected_reward']:.3f} (beta {result['beta']:g})\n"
          f"  the model prefers the chosen answer in {result['preference_accuracy']:.3f} of the pairs "
          f"({result['preference_accuracy_before']:.3f} before: the model it started from)")
    for g in result["generations"]:
        mark = "ok " if g["matches_chosen"] else ("rej" if g["matches_rejected"] else "no ")
        print(f"  {mark} {g['prompt']!r} -> {g['answer']!r} (chosen {g['chosen']!r}, rejected {g['rejected']!r})")
    matches = sum(g["matches_chosen"] for g in result["generations"])
    print(f"  chosen answers: {matches}/{len(result['generations'])}; written to {run}/{export.eval_file_name(data)}")


def print_answers(run: object, result: dict, data: str | None) -> None:
    """A KTO run's evaluation on answers labelled one by one (sft_play.export.evaluate_answers)."""
    from sft_play import export

    rewards = {side: "n/a" if result[f"{side}_reward"] is None else f"{result[f'{side}_reward']:.3f}"
               for side in ("desirable", "undesirable")}
    print(f"Run: {run}\n  data: {result['data']} ({result['answers']} answers, {result['desirable']} desirable)\n"
          f"  reward accuracy {result['reward_accuracy']:.3f} (a reward of its label's sign), rewards desirable "
          f"{rewards['desirable']} / undesirable {rewards['undesirable']} (beta {result['beta']:g})")
    for g in result["generations"]:
        print(f"  {'=  ' if g['matches_given'] else '   '} {g['prompt']!r} -> {g['answer']!r} (given "
              f"{g['given']!r}, {'desirable' if g['label'] else 'undesirable'})")
    print(f"  written to {run}/{export.eval_file_name(data)}")


def main() -> int:
    parser = cli.run_parser(cli.summary(__doc__))
    parser.add_argument("--count", type=int, default=5, help="held-out prompts to answer (default 5)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--data", help="evaluate on this data instead of the run's validation data (a file, folder, "
                        "glob or hub dataset, read as the run read its own; make eval DATA=...)")
    args = parser.parse_args()
    cli.setup_logging()

    # DATA= is read as the run read its own data, but for what to do with its bad rows (the value
    # checked as chosen_run loads the overrides)
    run = cli.chosen_run(args, also=("data.on_invalid",) if args.data else ())
    on_invalid = next((value.strip() for key, _, value in (o.partition("=") for o in args.overrides)
                       if key.strip() == "data.on_invalid"), None)
    lean_imports.for_run_folder(run)  # before the model stack is imported

    with cli.importing():
        from sft_play import export
    result = export.evaluate(run, args.count, args.max_new_tokens, data_path=args.data, on_invalid=on_invalid)
    if "answers" in result:
        print_answers(run, result, args.data)
        return 0
    if "reward_accuracy" in result:
        print_pairs(run, result, args.data)
        return 0
    print(f"Run: {run}\n  data: {result['data']}\n  validation loss {result['loss']:.4f}, perplexity {result['perplexity']:.3f} "
          f"over {result['loss_tokens']} tokens ({_examples(result)})")
    for g in result["generations"]:
        print(f"  {'ok ' if g['exact_match'] else 'no '} {g['prompt']!r} -> {g['answer']!r} (reference {g['reference']!r})")
    matches = sum(g["exact_match"] for g in result["generations"])
    print(f"  exact matches: {matches}/{len(result['generations'])}; written to {run}/{export.eval_file_name(args.data)}")
    return 0


if __name__ == "__main__":
    cli.run(main)
