"""Preference data (``finetune.objective``: dpo, kto, orpo, simpo): read and checked like SFT
records (:func:`sft_play.data.pipeline.iter_records` with ``pairs``), tokenised exactly as TRL's
``DPOTrainer`` tokenises pairs (and ``KTOTrainer`` labelled answers), measured and cached.

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
from typing import Any, Iterator

from sft_play.config import DataConfig, PreferenceConfig, RunConfig
from sft_play.data import cache
from sft_play.data.pipeline import ORIGIN, iter_records, mix, skip_summary
from sft_play.data.sources import HELD_OUT
from sft_play.data.stats import DataBundle, DataStats, NoUsableData, dropped_reason, dropped_rows
from sft_play.data.tokenize import resolve_chat_template
from sft_play.errors import UserError

logger = logging.getLogger(__name__)

PAIR_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")
ANSWER_COLUMNS = ("prompt_ids", "completion_ids", "label")  # KTO's: one answer, desirable or not
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


def tokenize_answer(record: dict[str, Any], tokenizer: Any) -> dict[str, list[int]]:
    """A labelled answer (``prompt``/``completion``) as TRL's ``KTOTrainer`` tokenises it
    (``tokenize_fn`` of trl/trainer/kto_trainer.py, 1.16): a standard completion ends with the EOS
    token; the completion is what follows the tokens the prompt shares with prompt+completion."""
    from trl.data_utils import _tokenize, common_prefix_length, is_conversational

    if is_conversational(record):
        kwargs: dict[str, Any] = {"tools": record.get("tools")}
        prompt_ids = _tokenize(tokenizer, record["prompt"], add_generation_prompt=True, **kwargs)["input_ids"]
        full = _tokenize(tokenizer, record["prompt"] + record["completion"], **kwargs)["input_ids"]
    else:
        completion = record["completion"]
        completion = completion if completion.endswith(tokenizer.eos_token) else completion + tokenizer.eos_token
        prompt_ids = _tokenize(tokenizer, record["prompt"])["input_ids"]
        full = _tokenize(tokenizer, record["prompt"] + completion)["input_ids"]
    shared = common_prefix_length(prompt_ids, full)
    return {"prompt_ids": prompt_ids[:shared], "completion_ids": full[shared:]}


def unpaired(records: list[dict[str, Any]], seed: int) -> list[dict[str, Any]]:
    """KTO's answers of `records`: a pair gives its chosen answer (desirable) and its rejected one
    (TRL's ``unpair_preference_dataset``); answers labelled already stay. Shuffled with `seed`:
    TRL's KTOTrainer reads them in order (each answer's KL estimate takes its micro-batch
    neighbour's answer), so an order that kept a pair's two answers, or a file's sides, together
    would bias both."""
    import random

    answers = []
    for record in records:
        if "label" in record:
            answers.append(record)
            continue
        extra = {key: value for key, value in record.items() if key not in ("chosen", "rejected")}
        answers += [{**extra, "completion": record["chosen"], "label": True},
                    {**extra, "completion": record["rejected"], "label": False}]
    random.Random(seed).shuffle(answers)
    return answers


def tokenize_answers(records: list[dict[str, Any]], tokenizer: Any, cfg: DataConfig, pref: PreferenceConfig,
                     stats: DataStats) -> dict[str, list]:
    """KTO's labelled answers of `records` as ``prompt_ids``/``completion_ids``/``label`` columns,
    measured into `stats` (an example is an answer), cut and dropped as :func:`tokenize_pairs`
    does pairs."""
    limit = cfg.max_seq_length
    columns: dict[str, list] = {name: [] for name in ANSWER_COLUMNS}
    columns[ORIGIN] = []
    lengths, prompts, answers = [], [], []
    for record in records:
        ids = tokenize_answer(record, tokenizer)
        prompt = ids["prompt_ids"]
        if pref.max_prompt_length and len(prompt) > pref.max_prompt_length:
            prompt = ids["prompt_ids"] = prompt[-pref.max_prompt_length:]
            stats.prompts_cut += 1
        length = len(prompt) + len(ids["completion_ids"])
        if not _kept(record, len(prompt), length, cfg, stats):
            continue
        columns["prompt_ids"].append(prompt)
        columns["completion_ids"].append(ids["completion_ids"])
        columns["label"].append(record["label"])
        columns[ORIGIN].append(record[ORIGIN])
        stats.desirable += record["label"]
        stats.tokens_total += length
        stats.loss_tokens += len(ids["completion_ids"])
        stats.tokens_squared += length * length
        lengths.append(length)
        prompts.append(len(prompt))
        answers.append(len(ids["completion_ids"]))
    stats.examples = stats.answers = len(lengths)
    _lengths(stats, limit, lengths, prompts, answers)
    return columns


def _kept(record: dict[str, Any], prompt: int, length: int, cfg: DataConfig, stats: DataStats) -> bool:
    """Whether an example of `prompt` tokens before its answer and `length` in all is kept: one
    whose prompt alone reaches ``data.max_seq_length`` is left out (TRL does too: no answer token
    would remain), one longer than it dropped under ``data.overlong: drop`` (else its answer's end
    is cut when batched: TRL's ``keep_start``), each counted and the left-out ones named."""
    limit = cfg.max_seq_length
    reason = (prompt_fills_reason(limit) if prompt >= limit
              else dropped_reason(limit) if length > limit and cfg.overlong == "drop" else None)
    if reason is None:
        stats.truncated += length > limit
        return True
    stats.skipped[reason] = stats.skipped.get(reason, 0) + 1
    named = stats.skipped_rows.setdefault(reason, [])
    if len(named) < SKIPPED_ROWS_KEPT:
        named.append(record[ORIGIN])
    if reason == dropped_reason(limit):
        stats.dropped_overlong += 1
    return False


def _lengths(stats: DataStats, limit: int, lengths: list[int], prompts: list[int], answers: list[int]) -> None:
    stats.max_seq_length = limit
    stats.tokens_p50 = int(statistics.median(lengths)) if lengths else 0
    stats.tokens_p95, stats.tokens_max = _percentile(lengths, 0.95), max(lengths, default=0)
    stats.prompt_tokens_p95, stats.prompt_tokens_max = _percentile(prompts, 0.95), max(prompts, default=0)
    stats.answer_tokens_p95, stats.answer_tokens_max = _percentile(answers, 0.95), max(answers, default=0)


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
        if not _kept(record, len(prompt), length, cfg, stats):
            continue
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
    _lengths(stats, limit, lengths, prompts, answers)
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


def _prepared(cfg: DataConfig, pref: PreferenceConfig, tokenizer: Any, seed: int, folder: Path,
              objective: str = "dpo") -> DataBundle:
    import datasets

    stats = DataStats()
    records, held, held_stats = _read(cfg, stats, seed)
    _refuse_labelled(stats, objective)
    if objective == "kto":
        train = tokenize_answers(unpaired(records, seed), tokenizer, cfg, pref, stats)
        validation = (tokenize_answers(unpaired(held, seed), tokenizer, cfg, pref, held_stats)
                      if held is not None else None)
    else:
        train = tokenize_pairs(records, tokenizer, cfg, pref, stats)
        validation = tokenize_pairs(held, tokenizer, cfg, pref, held_stats) if held is not None else None
    if not stats.examples:
        raise NoUsableData(f"no usable preference {'answer' if objective == 'kto' else 'pair'} in {cfg.path}"
                           + (f": {skip_summary(stats)}" if stats.skipped else ""))
    if objective == "kto":
        logger.info("data: %d answers tokenised, %d desirable (prompt p95 %d tokens, answer p95 %d, row p95 %d)",
                    stats.answers, stats.desirable, stats.prompt_tokens_p95, stats.answer_tokens_p95, stats.tokens_p95)
    else:
        logger.info("data: %d preference pairs tokenised (prompt p95 %d tokens, longer answer p95 %d, pair p95 %d)",
                    stats.pairs, stats.prompt_tokens_p95, stats.answer_tokens_p95, stats.tokens_p95)

    def table(columns: dict[str, list], name: str) -> Any:
        return datasets.Dataset.from_dict(columns).flatten_indices(cache_file_name=str(folder / f"{name}.arrow"))

    return DataBundle(train=table(train, "train"), stats=stats, validation_stats=held_stats,
                      validation=table(validation, "validation") if validation is not None else None)


def _refuse_labelled(stats: DataStats, objective: str) -> None:
    """KTO's labelled answers read for an objective that takes pairs: one line naming the source."""
    labelled = [source for source, fmt in stats.formats.items() if fmt == "unpaired"]
    if labelled and objective != "kto":
        raise UserError(f"{labelled[0]} holds answers labelled one by one (prompt/completion/label: KTO's unpaired "
                        f"data), which have no pairs for finetune.objective={objective}; set finetune.objective=kto")


def _streamed(cfg: DataConfig, pref: PreferenceConfig, tokenizer: Any, seed: int, objective: str) -> DataBundle:
    """``data.streaming`` for preference data: the training pairs (KTO: answers) as a
    ``datasets.IterableDataset`` read and tokenised as training consumes them (in the sources'
    order; mixed by ``data.weights`` at random in those shares), and the statistics of the first
    ``data.sample_rows`` records, prepared whole (bad rows among them as ``data.on_invalid`` says;
    later ones are skipped and counted, as a stream cannot stop a run half-way for them). KTO's
    answers are shuffled in a buffer of ``data.sample_rows`` (a stream cannot be shuffled whole;
    :func:`unpaired` says why they must be). The held-out data (``data.validation_path``) is
    prepared whole, uncached."""
    import datasets

    sample_cfg = cfg.model_copy(update={"streaming": False, "validation_fraction": 0.0})
    stats = DataStats()
    records = list(iter_records(cfg.path, sample_cfg, stats, streaming=True, limit=cfg.sample_rows, pairs=True))
    _refuse_labelled(stats, objective)
    if objective == "kto":
        tokenize_answers(unpaired(records, seed), tokenizer, sample_cfg, pref, stats)
    else:
        tokenize_pairs(records, tokenizer, sample_cfg, pref, stats)
    stats.sampled = len(records)
    logger.info("data: streamed; the planner reads the statistics of its first %d records (data.sample_rows)",
                stats.sampled)
    if not stats.examples:
        raise NoUsableData(f"no usable preference {'answer' if objective == 'kto' else 'pair'} in the first "
                           f"{stats.sampled} records of {cfg.path}" + (f": {skip_summary(stats)}" if stats.skipped else ""))
    skipping = cfg.model_copy(update={"on_invalid": "skip"})
    ids = datasets.Sequence(datasets.Value("int32"))
    features = datasets.Features({"prompt_ids": ids, "completion_ids": ids, "label": datasets.Value("bool")}
                                 if objective == "kto" else {name: ids for name in PAIR_COLUMNS})
    sources = [[entry] for entry in cfg.path] if cfg.weights else [[cfg.path] if isinstance(cfg.path, str) else cfg.path]
    streams = [datasets.IterableDataset.from_generator(_stream_rows, features=features, gen_kwargs={
        "paths": paths, "cfg": skipping, "pref": pref, "tokenizer": tokenizer, "objective": objective})
        for paths in sources]
    stream = streams[0] if len(streams) == 1 else datasets.interleave_datasets(
        streams, probabilities=[w / sum(cfg.weights) for w in cfg.weights], seed=seed,
        stopping_strategy="all_exhausted")
    if objective == "kto":
        stream = stream.shuffle(seed=seed, buffer_size=cfg.sample_rows)
    validation = validation_stats = None
    if cfg.validation_path:
        validation_stats = DataStats()
        held = list(iter_records(cfg.validation_path, sample_cfg, validation_stats, HELD_OUT, pairs=True))
        _refuse_labelled(validation_stats, objective)
        columns = (tokenize_answers(unpaired(held, seed), tokenizer, sample_cfg, pref, validation_stats)
                   if objective == "kto" else tokenize_pairs(held, tokenizer, sample_cfg, pref, validation_stats))
        validation = datasets.Dataset.from_dict({k: v for k, v in columns.items() if k != ORIGIN})
    return DataBundle(train=stream, validation=validation, stats=stats, validation_stats=validation_stats)


_SAID: set[str] = set()  # the streamed passes' skip summaries this process has said


def _stream_rows(paths: list[str], cfg: DataConfig, pref: PreferenceConfig, tokenizer: Any,
                 objective: str) -> Iterator[dict[str, Any]]:
    """The tokenised pairs (KTO: answers) of `paths`, for ``IterableDataset.from_generator``:
    each record read, checked, cut and dropped as a prepared one is; what was skipped said when a
    pass ends, once (every later pass skips the same rows)."""
    stats, said = DataStats(), DataStats()
    names = ANSWER_COLUMNS if objective == "kto" else PAIR_COLUMNS
    for record in iter_records(paths, cfg, stats, streaming=True, pairs=True):
        if objective == "kto":
            columns = tokenize_answers(unpaired([record], 0), tokenizer, cfg, pref, said)
        else:
            columns = tokenize_pairs([record], tokenizer, cfg, pref, said)
        for i in range(len(columns[ORIGIN])):
            yield {name: columns[name][i] for name in names}
    for name, count in said.skipped.items():
        stats.skipped[name] = stats.skipped.get(name, 0) + count
    summary = skip_summary(stats)
    if summary and summary not in _SAID:
        _SAID.add(summary)
        logger.warning("data (streamed): %s", summary)


def identity(pref: PreferenceConfig, objective: str = "dpo") -> str:
    """What of the preference settings decides the prepared data (for the cache's key): pairs for
    every objective but KTO, which takes labelled answers."""
    return json.dumps({"objective": "kto" if objective == "kto" else "dpo", "max_prompt_length": pref.max_prompt_length})


def build_pairs(cfg: DataConfig, pref: PreferenceConfig, tokenizer: Any, seed: int = 0,
                objective: str = "dpo") -> DataBundle:
    """Read, check, tokenise and measure the preference pairs of ``data.path`` (and the held-out
    ones; for KTO, `objective`, their labelled answers), or take them from the cache when these
    data, tokenizer and settings were prepared before. Bad rows are named by file and row, as for
    SFT data (``data.on_invalid``)."""
    if cfg.streaming:
        return _streamed(cfg, pref, tokenizer, seed, objective)
    key = cache.cache_key(cfg, tokenizer, resolve_chat_template(tokenizer, cfg.chat_template), seed,
                          preference=identity(pref, objective)) if cfg.cache else None
    if key is None:
        bundle = _prepared(cfg, pref, tokenizer, seed, cache.scratch(), objective)
    else:
        with cache.preparing(key):
            cached = cache.load(key)
            if cached is not None:
                logger.info("data: preprocessed preference pairs from the cache (%s)", key)
                bundle = _from_cache(cached)
            else:
                folder = cache.scratch()
                bundle = _prepared(cfg, pref, tokenizer, seed, folder, objective)
                if cache.save(key, bundle.train, bundle.validation, bundle.stats.to_dict(),
                              bundle.validation_stats.to_dict() if bundle.validation_stats else None):
                    bundle = _from_cache(cache.load(key, verify=False))
                    cache.discard(folder)
        cache.remember_stats(cache.stats_key(cfg, getattr(tokenizer, "name_or_path", None), seed,
                                             preference=identity(pref, objective)),
                             bundle.stats.to_dict(), bundle.validation_stats.to_dict() if bundle.validation_stats else None)
    for name, stats in (("train", bundle.stats), ("validation", bundle.validation_stats)):
        summary = skip_summary(stats) if stats is not None else None
        if summary:
            logger.warning("data (%s): %s", name, summary)
    stats = bundle.stats
    if stats.truncated or stats.dropped_overlong or stats.prompts_cut:
        logger.warning("data: at data.max_seq_length=%d, %d %s have their answers' ends cut, %d dropped%s; "
                       "%d prompt(s) cut to preference.max_prompt_length", stats.max_seq_length, stats.truncated,
                       "answer(s)" if objective == "kto" else "pair(s)", stats.dropped_overlong, dropped_rows(stats),
                       stats.prompts_cut)
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


def labelled(cfg: DataConfig, seed: int, path: str | None = None) -> bool:
    """Whether the held-out data of a run of `cfg` (or `path`'s) holds answers labelled one by one
    (KTO's unpaired format) rather than pairs."""
    if path is not None:
        first = next(iter_records(path, cfg, DataStats(), HELD_OUT, pairs=True, limit=1), None)
    else:
        first = next(iter(held_out_pairs(cfg, seed, 1)), None)
    return first is not None and "label" in first


def answers_of(path: str | None, config: RunConfig, tokenizer: Any) -> list[dict[str, Any]]:
    """KTO's held-out answers, tokenised as a run's are: `path`'s alone (the run's own training
    data neither read nor prepared), or the run's held-out ones."""
    cfg, pref = config.data, config.preference
    if path is None:
        bundle = build_pairs(cfg, pref, tokenizer, seed=config.train.seed, objective="kto")
        table = bundle.validation
        return [{name: table[i][name] for name in ANSWER_COLUMNS} for i in range(len(table))] if table else []
    stats = DataStats()
    columns = tokenize_answers(unpaired(list(iter_records(path, cfg, stats, HELD_OUT, pairs=True)), 0), tokenizer,
                               cfg, pref, stats)
    summary = skip_summary(stats)
    if summary:
        logger.warning("data (%s): %s", path, summary)
    return [{name: columns[name][i] for name in ANSWER_COLUMNS} for i in range(len(columns["label"]))]


def build_for_run(config: RunConfig, tokenizer: Any, processor: Any = None) -> DataBundle:
    """The run's data as its objective reads it: preference pairs (:func:`build_pairs`), or SFT
    examples (:func:`sft_play.data.pipeline.build`, with a vision-language model's `processor`)."""
    from sft_play.data.pipeline import build

    if config.finetune.objective != "sft":
        return build_pairs(config.data, config.preference, tokenizer, seed=config.train.seed,
                           objective=config.finetune.objective)
    return build(config.data, tokenizer, seed=config.train.seed, processor=processor)


def remembered_stats_for_run(config: RunConfig, tokenizer_source: str | None) -> DataStats | None:
    """The run's training data statistics as an earlier preparation of the same data, settings and
    local tokenizer measured them (read without loading the tokenizer); None when none did."""
    from sft_play.data.pipeline import _stat_fields

    cfg = config.data
    if config.finetune.objective == "sft":
        from sft_play.data.pipeline import remembered_stats

        return remembered_stats(cfg, tokenizer_source, config.train.seed)
    key = cache.stats_key(cfg, tokenizer_source, config.train.seed,
                          preference=identity(config.preference, config.finetune.objective))
    saved = cache.remembered_stats(key) if cfg.cache else None
    return DataStats(**_stat_fields(saved["stats"])) if saved else None
