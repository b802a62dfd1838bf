"""Describe a config's data as the run will see it: examples, tokens per example (p50, p95, max),
the share truncated, the share of tokens that carry loss, rows after packing, skipped rows by
reason and the formats detected. These are the numbers the planner uses.

Usage: python scripts/data_stats.py [--config PATH] [key=value ...] [--json]
"""

from __future__ import annotations

import json


from sft_play import cli
from sft_play import config as config_module


def _preference_lines(name: str, stats) -> list[str]:
    """Preference data: KTO's labelled answers (an example an answer), or pairs (an example a
    pair, its length the prompt and the longer answer: the padded length of its two rows)."""
    from sft_play.data import dropped_rows, skip_summary

    if stats.answers:
        head = (f"{name}: {stats.answers} answers ({stats.desirable} desirable, {stats.answers - stats.desirable} "
                f"undesirable), {stats.tokens_total} tokens")
        answer, example, cut = "answer tokens", "a row (prompt and answer)", ""
    else:
        head = f"{name}: {stats.pairs} preference pairs, {stats.tokens_total} tokens in their chosen and rejected rows"
        answer, example, cut = "the longer answer", "a pair (its prompt and longer answer, the padded length of its " \
            "two rows)", " pair(s)"
    lines = [
        head,
        f"  prompt tokens: p95 {stats.prompt_tokens_p95}, max {stats.prompt_tokens_max}; {answer}: p95 "
        f"{stats.answer_tokens_p95}, max {stats.answer_tokens_max}",
        f"  {example}: p50 {stats.tokens_p50}, p95 {stats.tokens_p95}, max {stats.tokens_max} "
        f"(data.max_seq_length {stats.max_seq_length})",
        f"  answers cut at data.max_seq_length: {stats.truncated}{cut}; dropped as too long: "
        f"{stats.dropped_overlong}{dropped_rows(stats)}; prompts cut to preference.max_prompt_length: "
        f"{stats.prompts_cut}",
        f"  tokens scored (the answers): {100 * stats.loss_token_share:.1f}%",
    ]
    if stats.skipped:
        lines.append(f"  {skip_summary(stats)}")
    return lines + [f"  {source}: {fmt}" for source, fmt in stats.formats.items()]


def describe(name: str, stats, policy: str = "keep") -> list[str]:
    from sft_play.data import dropped_rows
    from sft_play.data.stats import special_text_note

    if getattr(stats, "answers", 0) or stats.pairs:
        return _preference_lines(name, stats)
    lines = [
        f"{name}: {stats.examples} examples, {stats.tokens_total} tokens",
        f"  tokens per example: p50 {stats.tokens_p50}, p95 {stats.tokens_p95}, max {stats.tokens_max} "
        f"(data.max_seq_length {stats.max_seq_length})",
        f"  truncated: {stats.truncated} ({100 * stats.truncated_share:.1f}%), dropped as too long: {stats.dropped_overlong}"
        + dropped_rows(stats),
        f"  tokens that carry loss: {100 * stats.loss_token_share:.1f}%",
    ]
    if stats.example_tokens:  # what the planner times attention by (sft_play.planner.simulate.timing)
        lines.append(f"  a token's example is {stats.example_tokens:,.0f} tokens long on average over tokens: causal "
                     f"attention without a mask meets {stats.example_tokens / 2:,.0f} keys per token, with a mask "
                     "the whole row")
    if getattr(stats, "images", 0):
        lines.append(f"  images: {stats.images} ({stats.images / max(1, stats.examples):.2f} per example, at most "
                     f"{stats.images_max}), {stats.image_tokens:,} tokens ({stats.image_tokens / stats.images:,.0f} per "
                     f"image, {100 * stats.image_tokens / max(1, stats.tokens_total):.1f}% of all tokens; never cut: an "
                     "example whose cut would reach an image is left out)")
    if stats.packed_rows is not None:
        lines.append(f"  rows after packing: {stats.packed_rows} of {stats.max_seq_length} tokens "
                     f"({100 * stats.tokens_total / max(1, stats.packed_rows * stats.max_seq_length):.1f}% filled)")
    if stats.skipped:
        from sft_play.data import skip_summary

        lines.append(f"  {skip_summary(stats)}")
    note = special_text_note(stats, policy)
    if note:
        lines.append(f"  {note}")
    lines += [f"  {source}: {fmt}" for source, fmt in stats.formats.items()]
    return lines


def main() -> int:
    parser = cli.config_parser(cli.summary(__doc__))
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args()
    cli.setup_logging(quiet=args.json)

    with cli.importing():
        from sft_play import checks, data, model

    config, _ = config_module.as_built(config_module.load(args.config, args.overrides))
    checks.ensure_positions(config)
    tokenizer = model.load_tokenizer(config)
    bundle = data.build_for_run(config, tokenizer, model.load_processor(config, tokenizer))
    if args.json:
        print(json.dumps({"train": bundle.stats.to_dict(),
                          "validation": bundle.validation_stats.to_dict() if bundle.validation_stats else None},
                         indent=2))
        return 0
    lines = describe("train", bundle.stats, config.data.special_tokens_in_text)
    if bundle.validation_stats is not None:
        lines += describe("validation", bundle.validation_stats, config.data.special_tokens_in_text)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    cli.run(main)
