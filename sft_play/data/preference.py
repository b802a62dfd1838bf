"""Preference pairs (``finetune.objective: dpo``): read and checked like SFT records
(:func:`sft_play.data.pipeline.iter_records` with ``pairs``), tokenised exactly as TRL's
``DPOTrainer`` tokenises them, measured in pairs and cached.

The tokens are ours, not TRL's preparation: TRL's ``_prepare_dataset`` maps every row again on
each trainer it builds and keeps no statistics, and the planner needs the pairs' lengths before
a trainer exists. :func:`tokenize_pair` repeats TRL's ``tokenize_fn`` (trl/trainer/dpo_trainer.py,
1.16) with TRL's own helpers, so the ids are the same (tests/test_preference.py checks them
against TRL's preparation); the trainer then takes them as they are
(:class:`sft_play.training.preference` skips TRL's preparation).
"""

from __future__ import annotations

import json
import logging
import statistics
from pathlib import Path
from typing import Any

from sft_play.config import DataConfig, PreferenceConfig, RunConfig
from sft_play.data import cache
from sft_play.data.pipeline import ORIGIN, iter_records, mix, skip_summary
from sft_play.data.sources import HELD_OUT
from sft_play.data.stats import DataBundle, DataStats, NoUsableData, dropped_reason, dropped_rows
from sft_play.data.tokenize import resolve_chat_template
from sft_play.errors import UserError

logger = logging.getLogger(__name__)

PAIR_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")
SKIPPED_ROWS_KEPT = 20


def prompt_fills_reason(limit: int) -> str:
    """The reason ``skipped_rows`` names the pairs whose prompt alone reaches `limit` under."""
    return f"the prompt alone reaches data.max_seq_length={limit} (no answer token would be left)"


def tokenize_pair(pair: dict[str, Any], tokenizer: Any) -> dict[str, list[int]]:
    """`pair` (``prompt``/``chosen``/``rejected``, standard or conversational) as TRL's
    ``DPOTrainer`` tokenises it: a standard pair's answers end with the EOS token; a
    conversational prompt is rendered with the generation prompt, and each answer is what follows
    the tokens the prompt shares with prompt+answer (a template may render the prompt alone
    differently: TRL's ``common_prefix_length``)."""
    from trl.data_utils import _tokenize, common_prefix_length, is_conversational

    example = dict(pair)
    kwargs: dict[str, Any] = {"tools": example.get("tools")}
    if is_conversational(example):
        prompt_ids = _tokenize(tokenizer, example["prompt"], add_generation_prompt=True, **kwargs)["input_ids"]
        chosen = _tokenize(tokenizer, example["prompt"] + example["chosen"], **kwargs)["input_ids"]
        rejected = _tokenize(tokenizer, example["prompt"] + example["rejected"], **kwargs)["input_ids"]
    else:
        eos = tokenizer.eos_token
        for side in ("chosen", "rejected"):
            if not example[side].endswith(eos):
                example[side] = example[side] + eos
        prompt_ids = _tokenize(tokenizer, example["prompt"])["input_ids"]
        chosen = _tokenize(tokenizer, example["prompt"] + example["chosen"])["input_ids"]
        rejected = _tokenize(tokenizer, example["prompt"] + example["rejected"])["input_ids"]
    shared = min(common_prefix_length(prompt_ids, chosen), common_prefix_length(prompt_ids, rejected))
    return {"prompt_ids": prompt_ids[:shared], "chosen_ids": chosen[shared:], "rejected_ids": rejected[shared:]}


def _percentile(values: list[int], share: float) -> int:
    return sorted(values)[min(len(values) - 1, int(len(values) * share))] if values else 0


def tokenize_pairs(records: list[dict[str, Any]], tokenizer: Any, cfg: DataConfig, pref: PreferenceConfig,
                   stats: DataStats) -> dict[str, list]:
    """The pairs of `records` as ``prompt_ids``/``chosen_ids``/``rejected_ids`` columns, measured
    into `stats`. A prompt longer than ``preference.max_prompt_length`` keeps its last tokens; a
    pair whose prompt alone reaches ``data.max_seq_length`` is left out (TRL leaves it out too:
    no answer token would remain), and one whose prompt and longer answer pass it is dropped
    (``data.overlong: drop``) or has its answers' ends cut when batched (``truncate``, TRL's
    ``keep_start``), each counted and the dropped ones named by file and row."""
    limit = cfg.max_seq_length
    columns: dict[str, list] = {name: [] for name in PAIR_COLUMNS}
    columns[ORIGIN] = []
    lengths, prompts, answers = [], [], []
    for record in records:
        ids = tokenize_pair(record, tokenizer)
        prompt = ids["prompt_ids"]
        if pref.max_prompt_length and len(prompt) > pref.max_prompt_length:
            prompt = ids["prompt_ids"] = prompt[-pref.max_prompt_length:]
            stats.prompts_cut += 1
        answer = max(len(ids["chosen_ids"]), len(ids["rejected_ids"]))
        length = len(prompt) + answer
        reason = (prompt_fills_reason(limit) if len(prompt) >= limit
                  else dropped_reason(limit) if length > limit and cfg.overlong == "drop" else None)
        if reason is not None:
            stats.skipped[reason] = stats.skipped.get(reason, 0) + 1
            named = stats.skipped_rows.setdefault(reason, [])
            if len(named) < SKIPPED_ROWS_KEPT:
                named.append(record[ORIGIN])
            if reason == dropped_reason(limit):
                stats.dropped_overlong += 1
            continue
        stats.truncated += length > limit
        for name in PAIR_COLUMNS:
            columns[name].append(ids[name])
        columns[ORIGIN].append(record[ORIGIN])
        rows = [len(prompt) + len(ids["chosen_ids"]), len(prompt) + len(ids["rejected_ids"])]
        stats.tokens_total += sum(rows)
        stats.loss_tokens += len(ids["chosen_ids"]) + len(ids["rejected_ids"])
        stats.tokens_squared += sum(n * n for n in rows)
        lengths.append(length)
        prompts.append(len(prompt))
        answers.append(answer)
    stats.examples = stats.pairs = len(lengths)
    stats.max_seq_length = limit
    stats.tokens_p50 = int(statistics.median(lengths)) if lengths else 0
    stats.tokens_p95, stats.tokens_max = _percentile(lengths, 0.95), max(lengths, default=0)
    stats.prompt_tokens_p95, stats.prompt_tokens_max = _percentile(prompts, 0.95), max(prompts, default=0)
    stats.answer_tokens_p95, stats.answer_tokens_max = _percentile(answers, 0.95), max(answers, default=0)
    return columns


def _read(cfg: DataConfig, stats: DataStats, seed: int) -> tuple[list[dict], list[dict] | None, DataStats | None]:
    """(training pairs, held-out pairs or None, their statistics): ``data.validation_path``'s, or
    ``data.validation_fraction`` of each source held out before the sources are mixed by
    ``data.weights`` (no copy of a held-out pair trains)."""
    from sft_play.data.pipeline import _split

    sources = cfg.path if cfg.weights else [cfg.path]
    parts = [list(iter_records(entry, cfg, stats, pairs=True)) for entry in sources]
    held: list[dict] | None = None
    if not cfg.validation_path and cfg.validation_fraction > 0:
        held = []
        for i, part in enumerate(parts):
            cut = min(max(1, round(len(part) * cfg.validation_fraction)), len(part) - 1)
            if cut > 0:
                kept, out = _split(len(part), cut, seed)
                held += [part[j] for j in out]
                parts[i] = [part[j] for j in kept]
        held = held or None
    records = mix(parts, cfg.weights, seed) if cfg.weights else parts[0]
    held_stats = DataStats(formats=dict(stats.formats)) if held is not None else None
    if cfg.validation_path:
        held_stats = DataStats()
        held = list(iter_records(cfg.validation_path, cfg, held_stats, HELD_OUT, pairs=True))
    return records, held, held_stats


def _prepared(cfg: DataConfig, pref: PreferenceConfig, tokenizer: Any, seed: int, folder: Path) -> DataBundle:
    import datasets

    stats = DataStats()
    records, held, held_stats = _read(cfg, stats, seed)
    train = tokenize_pairs(records, tokenizer, cfg, pref, stats)
    if not stats.pairs:
        raise NoUsableData(f"no usable preference pair in {cfg.path}"
                           + (f": {skip_summary(stats)}" if stats.skipped else ""))
    validation = tokenize_pairs(held, tokenizer, cfg, pref, held_stats) if held is not None else None
    logger.info("data: %d preference pairs tokenised (prompt p95 %d tokens, longer answer p95 %d, pair p95 %d)",
                stats.pairs, stats.prompt_tokens_p95, stats.answer_tokens_p95, stats.tokens_p95)

    def table(columns: dict[str, list], name: str) -> Any:
        return datasets.Dataset.from_dict(columns).flatten_indices(cache_file_name=str(folder / f"{name}.arrow"))

    return DataBundle(train=table(train, "train"), stats=stats, validation_stats=held_stats,
                      validation=table(validation, "validation") if validation is not None else None)


def identity(pref: PreferenceConfig) -> str:
    """What of the preference settings decides the prepared pairs (for the cache's key)."""
    return json.dumps({"objective": "dpo", "max_prompt_length": pref.max_prompt_length})


def build_pairs(cfg: DataConfig, pref: PreferenceConfig, tokenizer: Any, seed: int = 0) -> DataBundle:
    """Read, check, tokenise and measure the preference pairs of ``data.path`` (and the held-out
    ones), or take them from the cache when these pairs, tokenizer and settings were prepared
    before. Bad rows are named by file and row, as for SFT data (``data.on_invalid``)."""
    if cfg.streaming:
        raise UserError("data.streaming is not done for preference pairs yet: set data.streaming=false (the pairs "
                        "are prepared once and cached)")
    key = cache.cache_key(cfg, tokenizer, resolve_chat_template(tokenizer, cfg.chat_template), seed,
                          preference=identity(pref)) if cfg.cache else None
    if key is None:
        bundle = _prepared(cfg, pref, tokenizer, seed, cache.scratch())
    else:
        with cache.preparing(key):
            cached = cache.load(key)
            if cached is not None:
                logger.info("data: preprocessed preference pairs from the cache (%s)", key)
                bundle = _from_cache(cached)
            else:
                folder = cache.scratch()
                bundle = _prepared(cfg, pref, tokenizer, seed, folder)
                if cache.save(key, bundle.train, bundle.validation, bundle.stats.to_dict(),
                              bundle.validation_stats.to_dict() if bundle.validation_stats else None):
                    bundle = _from_cache(cache.load(key, verify=False))
                    cache.discard(folder)
        cache.remember_stats(cache.stats_key(cfg, getattr(tokenizer, "name_or_path", None), seed,
                                             preference=identity(pref)),
                             bundle.stats.to_dict(), bundle.validation_stats.to_dict() if bundle.validation_stats else None)
    for name, stats in (("train", bundle.stats), ("validation", bundle.validation_stats)):
        summary = skip_summary(stats) if stats is not None else None
        if summary:
            logger.warning("data (%s): %s", name, summary)
    stats = bundle.stats
    if stats.truncated or stats.dropped_overlong or stats.prompts_cut:
        logger.warning("data: at data.max_seq_length=%d, %d pair(s) have their answers' ends cut, %d dropped%s; "
                       "%d prompt(s) cut to preference.max_prompt_length", stats.max_seq_length, stats.truncated,
                       stats.dropped_overlong, dropped_rows(stats), stats.prompts_cut)
    return bundle


def _from_cache(cached: dict[str, Any]) -> DataBundle:
    from sft_play.data.pipeline import _bundle_from

    return _bundle_from(cached)


def held_out_pairs(cfg: DataConfig, seed: int, limit: int | None = None) -> list[dict[str, Any]]:
    """The first `limit` held-out pairs of a run of `cfg` (``data.validation_path``'s, or its
    seeded ``data.validation_fraction``), untokenised; empty without either."""
    if cfg.validation_path:  # (the training pairs unread)
        held = list(iter_records(cfg.validation_path, cfg, DataStats(), HELD_OUT, pairs=True))
    elif cfg.validation_fraction:
        held = _read(cfg, DataStats(), seed)[1] or []
    else:
        return []
    return held[:limit] if limit is not None else held


def pairs_of(path: str, cfg: DataConfig, pref: PreferenceConfig, tokenizer: Any) -> list[dict[str, list[int]]]:
    """The pairs of `path` alone, read and tokenised as a run's held-out pairs are, for an
    evaluation on other data: the run's own training pairs are neither read nor prepared."""
    stats = DataStats()
    columns = tokenize_pairs(list(iter_records(path, cfg, stats, HELD_OUT, pairs=True)), tokenizer, cfg, pref, stats)
    summary = skip_summary(stats)
    if summary:
        logger.warning("data (%s): %s", path, summary)
    return [{name: columns[name][i] for name in PAIR_COLUMNS} for i in range(len(columns[PAIR_COLUMNS[0]]))]


def build_for_run(config: RunConfig, tokenizer: Any, processor: Any = None) -> DataBundle:
    """The run's data as its objective reads it: preference pairs (:func:`build_pairs`), or SFT
    examples (:func:`sft_play.data.pipeline.build`, with a vision-language model's `processor`)."""
    from sft_play.data.pipeline import build

    if config.finetune.objective != "sft":
        return build_pairs(config.data, config.preference, tokenizer, seed=config.train.seed)
    return build(config.data, tokenizer, seed=config.train.seed, processor=processor)


def remembered_stats_for_run(config: RunConfig, tokenizer_source: str | None) -> DataStats | None:
    """The run's training data statistics as an earlier preparation of the same data, settings and
    local tokenizer measured them (read without loading the tokenizer); None when none did."""
    from sft_play.data.pipeline import _stat_fields

    cfg = config.data
    if config.finetune.objective == "sft":
        from sft_play.data.pipeline import remembered_stats

        return remembered_stats(cfg, tokenizer_source, config.train.seed)
    key = cache.stats_key(cfg, tokenizer_source, config.train.seed, preference=identity(config.preference))
    saved = cache.remembered_stats(key) if cfg.cache else None
    return DataStats(**_stat_fields(saved["stats"])) if saved else None
