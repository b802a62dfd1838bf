"""The data pipeline: read records in the formats people have (:mod:`sft_play.data.sources`,
:mod:`sft_play.data.formats`), turn them into tokens and labels (:mod:`sft_play.data.tokenize`),
mix, split and pack them, and cache the result (:mod:`sft_play.data.cache`).

``build(config.data, tokenizer, seed)`` is the one entry point the training path uses. With
``data.packing`` the examples are packed into rows of ``max_seq_length`` by best-fit decreasing
(TRL's ``pack_dataset``), each row recording where its examples start (``seq_lengths``) so that
the collator (:mod:`sft_play.data.collate`) keeps them from attending to each other.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from sft_play.config import DataConfig
from sft_play.data import cache, vision
from sft_play.data.formats import (SHOWN_BAD_ROWS, InvalidRow, InvalidRows, UnknownFormat, detect_format,
                                   detect_pair_format, mapped_but_absent, normalise, normalise_pair)
from sft_play.data.sources import HELD_OUT, iter_sources
from sft_play.data.tokenize import (IGNORE_INDEX, encode_chats_with_markers, encode_record, escape_markers,
                                    has_generation_markers, markers_in, prompt_turns_unlabelled, renders_tools,
                                    resolve_chat_template, text_markers, uses_tools)
from sft_play.data.stats import DataBundle, DataStats, NoUsableData, dropped_reason, dropped_rows, image_cut_reason
from sft_play.data.vision import CUT_IMAGE, image_settings
from sft_play.errors import UserError
from sft_play.hardware.machine import usable_cores

logger = logging.getLogger(__name__)

_DETECT_ROWS = 5


def _reason_key(error: InvalidRow) -> str:
    field_name = re.sub(r"\[\d+\]", "[]", error.field)
    reason = re.sub(r" \((allowed:|byte |invalid ).*\)$", "", error.reason)  # where exactly: in the row list
    return f"{field_name}: {reason}"


SKIPPED_ROWS_KEPT = 20  # row numbers kept per reason for the skip summary
ORIGIN = "_row"  # a record's file and row ("data/chat.jsonl:12"), for what tokenising leaves out
NO_ANSWER_LEFT = "no answer tokens left after truncation"
UNREADABLE = "unreadable"  # the status of a record whose image the processor could not decode
SPECIAL_TEXT = "special_text"  # refused (data.special_tokens_in_text: refuse) and skipped (data.on_invalid: skip)
SPECIAL_TEXT_REASON = "the tokenizer's special tokens written in the text (data.special_tokens_in_text: refuse)"
UNREADABLE_REASON = "images: an image the processor could not decode (a file cut short?)"
# Per-example columns of image data, counted into the statistics and then dropped
IMAGE_COUNTS = ("n_images", "n_image_tokens", "n_pixels", "encoder_inputs", "n_text_tokens")


def iter_records(paths: str | list[str], cfg: DataConfig, stats: DataStats, split: str | None = None,
                 streaming: bool = False, limit: int | None = None, pairs: bool = False) -> Iterator[dict[str, Any]]:
    """Canonical records from every source in `paths` (of `split` where a source holds splits:
    ``data.split`` unless said), one at a time (the first `limit`), each with its file and row under
    :data:`ORIGIN` (so that what tokenising leaves out is named). With ``data.on_invalid: error``
    every bad row is collected and one :class:`InvalidRows` names them all once the records are
    read; with ``skip`` they are counted by reason in `stats.skipped`, their numbers in
    `stats.skipped_rows`. Hub datasets are streamed with `streaming`. With `pairs`, the records are
    preference pairs (:func:`sft_play.data.formats.normalise_pair`)."""
    skipped: Counter[str] = Counter(stats.skipped)
    bad: list[InvalidRow] = []
    bad_count = 0

    def reject(error: InvalidRow) -> None:
        nonlocal bad_count
        bad_count += 1
        if len(bad) < SHOWN_BAD_ROWS:  # the rest counted: a million bad rows are no list to keep
            bad.append(error)
        reason = _reason_key(error)
        skipped[reason] += 1
        where = stats.skipped_rows.setdefault(reason, [])
        if len(where) < SKIPPED_ROWS_KEPT:
            where.append(f"{error.source}:{error.row}")
        stats.skipped = dict(skipped)

    given = 0
    told: set[str] = set()  # the sources of text records data.system_prompt changes nothing for
    for source, rows in iter_sources(paths, split or cfg.split, streaming):
        rows = iter(rows)
        head: list[tuple[int, dict[str, Any]]] = []  # the first readable rows: they tell the format
        unread: list[InvalidRow] = []  # lines among them that could not be read: said in row order below
        for number, row in rows:
            if isinstance(row, InvalidRow):
                unread.append(row)
                continue
            head.append((number, row))
            if len(head) == _DETECT_ROWS:
                break
        if not head:
            for error in unread:
                reject(error)
            stats.formats[source] = "empty"
            continue
        try:
            detect = detect_pair_format if pairs else detect_format
            fmt = cfg.format if cfg.format != "auto" else detect([r for _, r in head], cfg.columns)
        except UnknownFormat as exc:
            raise UnknownFormat(f"{source}: {exc}") from None
        if cfg.format == "auto":
            logger.info("data: %s looks like '%s' records", source, fmt)
        stats.formats[source] = fmt
        kept = 0
        for number, row in itertools.chain(head, rows):
            while unread and unread[0].row < number:
                reject(unread.pop(0))
            if isinstance(row, InvalidRow):
                reject(row)
                continue
            try:
                record = (normalise_pair if pairs else normalise)(row, fmt, cfg.columns, source, number)
            except InvalidRow as exc:
                reject(exc)
                continue
            record[ORIGIN] = f"{source}:{number}"
            if cfg.system_prompt:
                _with_system_prompt(record, cfg.system_prompt, pairs, source, told)
            kept += 1
            given += 1
            yield record
            if given == limit:
                break
        for error in unread:
            reject(error)
        if not kept and cfg.format != "auto" and not pairs:
            _refuse_forced_format(source, fmt, [r for _, r in head], cfg.columns)
        if given == limit:
            break
    stats.skipped = dict(skipped)
    if bad and cfg.on_invalid == "error":
        raise InvalidRows(bad, bad_count)


def _with_system_prompt(record: dict[str, Any], system: str, pairs: bool, source: str, told: set[str]) -> None:
    """``data.system_prompt`` put first in a chat record without a system message of its own; for
    a text record (a text pair, a prompt and completion), which has no chat to give it, said once
    a source."""
    turns = "prompt" if pairs and isinstance(record["prompt"], list) else "messages"
    if record.get(turns):
        if record[turns][0]["role"] != "system":
            record[turns] = [{"role": "system", "content": system}, *record[turns]]
    elif source not in told:
        told.add(source)
        logger.warning("data.system_prompt: %s holds text, not conversations: there is no chat to give a system "
                       "message, so the setting changes nothing for its %s", source, "pairs" if pairs else "records")


def load_records(paths: str | list[str], cfg: DataConfig, stats: DataStats, split: str | None = None) -> list[dict[str, Any]]:
    """:func:`iter_records` as a list: for a few records (checks, tests); a preparation writes them
    to an Arrow file instead (:func:`record_table`)."""
    return list(iter_records(paths, cfg, stats, split))


# Every canonical record's fields, one fixed schema for the table records are written to: sources of
# several formats leave the fields they lack None
RECORD_COLUMNS = ("messages", "tools", "images", "prompt_turns", "prompt", "completion", "text", ORIGIN)
_WRITE_BATCH = 1_000  # records held as Python objects at once on their way to the table


def _record_features():
    import datasets

    return datasets.Features({c: datasets.Value("int64" if c == "prompt_turns" else "string") for c in RECORD_COLUMNS})


def record_table(records: Iterable[dict[str, Any]], folder: Path | None = None) -> Any:
    """`records` as a ``datasets.Dataset`` of :data:`RECORD_COLUMNS`: written batch by batch to an
    Arrow file in `folder` and read back memory-mapped (never all of them Python objects at once),
    or held in memory without a folder (a few records)."""
    import datasets

    features = _record_features()
    if folder is None:
        rows = [_cells(r) for r in records]
        return datasets.Dataset.from_dict({c: [r[c] for r in rows] for c in RECORD_COLUMNS}, features=features)
    from datasets.arrow_writer import ArrowWriter

    path = str(Path(folder) / f"records-{next(_TABLES)}.arrow")
    with ArrowWriter(features=features, path=path, writer_batch_size=_WRITE_BATCH) as writer:
        records = iter(records)
        while batch := list(itertools.islice(records, _WRITE_BATCH)):
            rows = [_cells(r) for r in batch]
            writer.write_batch({c: [r[c] for r in rows] for c in RECORD_COLUMNS})
        writer.finalize()
    return datasets.Dataset.from_file(path)


_TABLES = itertools.count()


def _cells(record: dict[str, Any]) -> dict[str, Any]:
    """A canonical record as the table's row: every column of :data:`RECORD_COLUMNS`."""
    return {c: _to_cell(c, record.get(c)) for c in RECORD_COLUMNS}


def decoded(table: Any, limit: int | None = None) -> list[dict[str, Any]]:
    """The records of a :func:`record_table` as canonical records again (the first `limit`)."""
    rows = table.select(range(min(limit, len(table)))) if limit is not None else table
    return [{c: _from_cell(c, row[c]) for c in row if row[c] is not None} for row in rows]


def _refuse_forced_format(source: str, fmt: str, rows: list[dict[str, Any]], columns: dict[str, str]) -> None:
    """One clear error, instead of every row listed as bad, when a forced ``data.format`` fits
    none of a source's rows and its columns look like another format."""
    try:
        seen = detect_format(rows, columns)
    except UnknownFormat:
        absent = mapped_but_absent(rows, columns)
        if absent:
            raise UnknownFormat(f"{source}: data.format={fmt}, but none of its rows fits that format: {absent}") from None
        return
    if seen != fmt:
        found = sorted(set().union(*(r.keys() for r in rows)))
        raise UnknownFormat(
            f"{source}: data.format={fmt}, but none of its rows fits that format: its columns {found} look "
            f"like '{seen}' records. Set data.format=auto (or data.format={seen}), or map your columns to the "
            f"'{fmt}' fields with data.columns"
        )


def skip_summary(stats: DataStats) -> str | None:
    """The rows ``data.on_invalid: skip`` left out, by reason, with their numbers (None if none)."""
    if not stats.skipped:
        return None
    parts = []
    for reason, count in sorted(stats.skipped.items()):
        rows = stats.skipped_rows.get(reason, [])
        listed = ", ".join(rows) + (f", ... ({count - len(rows)} more)" if count > len(rows) else "")
        parts.append(f"{reason} x{count}" + (f" ({listed})" if rows else ""))
    skipped = sum(stats.skipped.values())
    # (of the whole data: a stream's examples are counted in its sample only)
    whole = skipped + stats.dropped_overlong + stats.examples
    share = f" of {whole}, {skipped / whole:.0%}" if stats.examples and not stats.sampled else ""
    return f"skipped {skipped} rows{share}: " + "; ".join(parts)


def _encode_batch(batch: dict[str, list], tokenizer: Any, template: str, train_on: str, limit: int,
                  overlong: str, tools_rendered: bool = True, processor: Any = None,
                  skip_unreadable: bool = False, special_text: str = "keep") -> dict[str, list]:
    """Tokens, labels and status (:func:`_limited`) of a batch of records (``datasets.map(batched=True)``: one Python call per
    thousand records rather than per record); the chat records of a template with generation
    markers go through the tokenizer together. With a vision-language model's `processor`, records
    with images go through it (:func:`sft_play.data.vision.encode`), and every row carries its
    images' references, token types and image counts; a record whose image the processor cannot
    decode (a file cut short that PIL's check let through) stops the preparation naming it, or with
    `skip_unreadable` (``data.on_invalid: skip``) is left out as :data:`UNREADABLE`. The special
    tokens a record writes in its text are counted (``n_markers``) and kept, escaped or refused as
    `special_text` (``data.special_tokens_in_text``) says."""
    columns = list(batch)
    records = [{c: _from_cell(c, batch[c][i]) for c in columns} for i in range(len(batch[columns[0]]) if columns else 0)]
    records, markers, refused = _special_text(records, tokenizer, special_text, skip_unreadable)
    _refuse_unrendered(records, tools_rendered, text_model=processor is None)
    if processor is not None:
        from sft_play.data import vision

        pictured = {i: record for i, record in enumerate(records) if record.get("images")}
        image_ids = vision.image_token_ids(processor)
        records = [r if i not in pictured else {} for i, r in enumerate(records)]  # (encoded below, with the processor)
    else:
        pictured = {}
    tokens: list[tuple[list[int], list[int]] | None] = [None] * len(records)
    if has_generation_markers(template):  # (a record with tools renders them: one by one below)
        chats = [i for i, record in enumerate(records) if record.get("messages") is not None and not record.get("tools")]
        if chats:
            try:
                for i, (ids, labels) in zip(chats, encode_chats_with_markers(
                        tokenizer, [records[i]["messages"] for i in chats], template, train_on)):
                    tokens[i] = ids, prompt_turns_unlabelled(records[i], labels, train_on)
            except Exception as exc:
                if not _template_refused(exc):
                    raise  # one by one below: the record the template refuses is named
    encoded = []
    for i, record in enumerate(records):
        record = pictured.get(i, record)
        if i in refused:
            encoded.append({"input_ids": [], "labels": [], "token_types": [], "status": SPECIAL_TEXT})
            continue
        try:
            if i in pictured:
                row = vision.limited(vision.encode(record, processor, template, train_on), limit, overlong)
            else:
                row = _limited(*(tokens[i] or encode_record(record, tokenizer, template, train_on)), limit, overlong)
        except Exception as exc:
            if i in pictured and not _template_refused(exc) and not isinstance(exc, UserError):
                reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
                if skip_unreadable:
                    encoded.append({"input_ids": [], "labels": [], "token_types": [], "status": UNREADABLE})
                    continue
                raise UserError(f"the processor could not read {record.get(ORIGIN) or 'a record'} with its images: "
                                f"{reason}") from None
            if not _template_refused(exc):
                raise
            raise UserError(f"the chat template cannot render {record.get(ORIGIN) or 'a record'}: {exc}. Choose a "
                            "template that takes these turns (data.chat_template: a name, e.g. chatml, or a .jinja "
                            "file), or change the data") from None
        if processor is not None and i not in pictured and image_ids and not image_ids.isdisjoint(row["input_ids"]):
            raise UserError(f"{record.get(ORIGIN) or 'a record'} has no image, and its text holds one of the model's "
                            "image tokens (as a placeholder written out): the model would look for an image that is "
                            "not there. Give the row its image (an images column), or take the token out of its text")
        encoded.append(row)
    records = [pictured.get(i, record) for i, record in enumerate(records)]
    return _columns(encoded, records, markers, vision_model=processor is not None)


def _refuse_unrendered(records: list[dict], tools_rendered: bool, text_model: bool) -> None:
    """One line for a batch's first record whose content would be dropped in silence: tool calls
    the chat template does not render, images shown to a text model."""
    if not tools_rendered:
        with_tools = next((r for r in records if uses_tools(r)), None)
        if with_tools is not None:
            raise UserError(f"{with_tools.get(ORIGIN) or 'a record'} calls tools, which the chat template does not "
                            "render (it would drop them in silence): set data.chat_template to one that does (a "
                            "model's own, e.g. qwen2_5, llama3_1, qwen3; or plain)")
    shown = next((r for r in records if r.get("images")), None) if text_model else None
    if shown is not None:
        raise UserError(f"{shown.get(ORIGIN) or 'a record'} shows images, and the model is a text model: train a "
                        "vision-language model (one whose config has a vision_config: Qwen2.5-VL, Gemma-3, "
                        "SmolVLM, LLaVA...), or leave the images out of the data")


def _columns(encoded: list[dict], records: list[dict], markers: list[int], vision_model: bool) -> dict[str, list]:
    """The encoded rows as the dataset's columns, with the counts the statistics read (counted here,
    so that they never read every row's tokens back into Python lists)."""
    out = {**{key: [row[key] for row in encoded] for key in ("input_ids", "labels", "status")},
           "origin": [record.get(ORIGIN) for record in records],
           "n_tokens": [len(row["input_ids"]) for row in encoded],
           "n_loss": [sum(1 for label in row["labels"] if label != IGNORE_INDEX) for row in encoded],
           "n_markers": markers}
    if vision_model:
        out["images"] = [_to_cell("images", record.get("images")) for record in records]
        out["token_types"] = [row.get("token_types") or [0] * len(row["input_ids"]) for row in encoded]
        out["n_images"] = [len(record.get("images") or ()) for record in records]
        out["n_image_tokens"] = [row.get("image_tokens", 0) for row in encoded]
        out["n_pixels"] = [row.get("pixels", 0) for row in encoded]
        out["encoder_inputs"] = [row.get("encoder_inputs", "") for row in encoded]
        out["n_text_tokens"] = [row.get("text_tokens", len(row["input_ids"])) for row in encoded]
    return out


def _special_text(records: list[dict], tokenizer: Any, policy: str, skip: bool) -> tuple[list[dict], list[int], set[int]]:
    """(the records, escaped where `policy` says so; how many special tokens each writes in its
    text; those refused and skipped). A refused record stops the preparation unless `skip`."""
    marks = text_markers(tokenizer)
    found = [markers_in(record, marks) if record else {} for record in records]
    refused = {i for i, counts in enumerate(found) if counts} if policy == "refuse" else set()
    if refused and not skip:
        first = min(refused)
        raise UserError(f"{records[first].get(ORIGIN) or 'a record'} writes the tokenizer's special token "
                         f"{next(iter(found[first]))!r} in its text, which data.special_tokens_in_text=refuse refuses "
                         "(escape reads it as text, keep as the token; data.on_invalid=skip leaves such rows out)")
    if policy == "escape":
        records = [escape_markers(record, marks) if counts else record for record, counts in zip(records, found)]
    return records, [sum(counts.values()) for counts in found], refused


# Columns of nested structures that go through the Arrow table as JSON text: Arrow would give every
# tool call's arguments the keys of all others (None where absent), and templates would render them
_JSON_COLUMNS = ("messages", "tools", "images")


def _to_cell(column: str, value: Any) -> Any:
    return json.dumps(value) if column in _JSON_COLUMNS and value is not None else value


def _from_cell(column: str, value: Any) -> Any:
    return json.loads(value) if column in _JSON_COLUMNS and value is not None else value


def _template_refused(exc: Exception) -> bool:
    """An error the chat template raised (its raise_exception, or a field it lacks), not ours."""
    return type(exc).__module__.split(".")[0] == "jinja2"


def _limited(ids: list[int], labels: list[int], limit: int, overlong: str) -> dict[str, Any]:
    """An example's tokens with ``data.overlong`` applied at `limit` tokens, and what happened."""
    status = "ok"
    if len(ids) > limit:
        if overlong == "drop":
            status = "dropped"
        else:
            ids, labels = ids[:limit], labels[:limit]
            status = "no_answer" if all(label == IGNORE_INDEX for label in labels) else "truncated"
    return {"input_ids": ids, "labels": labels, "status": status}


# Records from which ``data.num_proc: auto`` tokenises in a pool of processes: below, the pool's
# start costs about what it saves (20,000 chat rows of ~1,000 characters on 2 cores: 13.6 s in one
# process, 11.3 s in two; docs/reports/data_prep.md)
PARALLEL_FROM = 10_000


def tokenising_processes(setting: int | str | None, records: int) -> int | None:
    """The processes ``datasets.map`` tokenises `records` records in (None: this one) for
    ``data.num_proc``: a number as it is, ``auto`` the usable cores from :data:`PARALLEL_FROM`
    records on."""
    if setting == "auto":
        cores = usable_cores()
        return cores if cores > 1 and records >= PARALLEL_FROM else None
    return setting if setting and setting > 1 and records > 1 else None


def tokenize_records(records: Any, tokenizer: Any, cfg: DataConfig, stats: DataStats,
                     folder: Path | None = None, processor: Any = None) -> Any:
    """A ``datasets.Dataset`` of ``input_ids``/``labels`` (packed, with ``seq_lengths``, when
    ``data.packing``) from `records` (a :func:`record_table`, or a list of records), over-long
    examples truncated or dropped and counted in `stats`. Each step writes its Arrow file in
    `folder` (in memory without one: a few records). With a vision-language model's `processor`,
    rows also carry ``images`` (their references, as JSON) and ``token_types``.

    Tokenisation runs in :func:`tokenising_processes` processes.
    """
    import datasets
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    limit = cfg.max_seq_length
    stats.max_seq_length = limit
    table = records if isinstance(records, datasets.Dataset) else record_table(records)
    if not len(table):
        return datasets.Dataset.from_dict({"input_ids": [], "labels": []})
    files = _Files(folder)
    encoded = _encoded(table, tokenizer, cfg, processor, files)
    status_column = encoded.data.column("status")
    _count_left_out(encoded, status_column, stats, limit)
    dataset = encoded.filter(lambda status: [kind in ("ok", "truncated") for kind in status], input_columns=["status"],
                             batched=True, **files.kwargs("kept")).remove_columns(["status", "origin"])
    # the kept rows' counts, read from the tokenised columns as stored (through the filter's
    # indices, datasets would gather whole rows into memory: 0.7 KB a row)
    kept = pc.is_in(status_column, value_set=pa.array(["ok", "truncated"]))
    counted = ("n_tokens", "n_loss", "n_markers", *(IMAGE_COUNTS if processor is not None else ()))
    counts = {name: pc.filter(encoded.data.column(name), kept).to_numpy()
              for name in counted if name not in ("encoder_inputs", "n_text_tokens")}
    lengths = counts["n_tokens"].astype(np.int64) if len(dataset) else np.zeros(1, np.int64)
    stats.examples = len(dataset)
    stats.max_seq_length = limit
    stats.tokens_total = int(lengths.sum())
    stats.tokens_squared = int((lengths ** 2).sum())
    stats.loss_tokens = int(counts["n_loss"].astype(np.int64).sum()) if len(dataset) else 0
    stats.special_text = int((counts["n_markers"] > 0).sum()) if len(dataset) else 0
    if stats.special_text:  # which rows, as the skipped ones are named
        marked = pc.filter(encoded.data.column("origin"), pc.and_(kept, pc.greater(encoded.data.column("n_markers"), 0)))
        stats.special_text_rows = [o for o in marked.slice(0, SKIPPED_ROWS_KEPT).to_pylist() if o]
    dataset = dataset.remove_columns([name for name in counted])
    if processor is not None and len(dataset):
        dataset = _count_images(dataset, encoded, kept, counts, stats, cfg, processor)
    stats.tokens_p50 = int(np.percentile(lengths, 50))
    stats.tokens_p95 = int(np.percentile(lengths, 95))
    stats.tokens_max = int(lengths.max())
    stats.uniform_rows = bool(len(dataset)) and int(lengths.min()) == stats.tokens_max
    if cfg.packing and len(dataset):
        from trl.data_utils import pack_dataset

        # Best-fit decreasing into rows of max_seq_length, a thousand examples at a time (one
        # process: more would cut the batches elsewhere and pack other rows); `seq_lengths`
        # records the examples of a row
        dataset = pack_dataset(dataset, limit, "bfd", map_kwargs={"desc": "Packing", **files.kwargs("packed")})
        stats.packed_rows = len(dataset)
        stats.uniform_rows = stats.uniform_rows and stats.packed_rows == stats.examples
    return dataset


def _encoded(table: Any, tokenizer: Any, cfg: DataConfig, processor: Any, files: Any) -> Any:
    """Every record tokenised (:func:`_encode_batch`), with its status, origin and counts."""
    import datasets

    template = resolve_chat_template(tokenizer, cfg.chat_template)
    tokens = datasets.List(datasets.Value("int32"))
    features = {"input_ids": tokens, "labels": tokens, "status": datasets.Value("string"),
                "origin": datasets.Value("string"), "n_tokens": datasets.Value("int32"), "n_loss": datasets.Value("int32"),
                "n_markers": datasets.Value("int32")}
    if processor is not None:
        features |= {"images": datasets.Value("string"), "token_types": datasets.List(datasets.Value("int8")),
                     "n_images": datasets.Value("int32"), "n_image_tokens": datasets.Value("int32"),
                     "n_pixels": datasets.Value("int64"), "encoder_inputs": datasets.Value("string"),
                     "n_text_tokens": datasets.Value("int32")}
    return table.map(
        _encode_batch,
        batched=True,
        fn_kwargs={"tokenizer": tokenizer, "template": template, "train_on": cfg.train_on, "limit": cfg.max_seq_length,
                   "overlong": cfg.overlong, "tools_rendered": renders_tools(template), "processor": processor,
                   "skip_unreadable": cfg.on_invalid == "skip", "special_text": cfg.special_tokens_in_text},
        remove_columns=table.column_names,
        features=datasets.Features(features),
        num_proc=tokenising_processes(cfg.num_proc, len(table)),
        desc="Tokenising",
        **files.kwargs("tokenised"),
    )


def _count_left_out(encoded: Any, status_column: Any, stats: DataStats, limit: int) -> None:
    """What tokenising truncated or left out, counted in `stats` and the first few named by file
    and row, as the bad rows are."""
    import pyarrow.compute as pc

    status = Counter({entry["values"]: entry["counts"] for entry in pc.value_counts(status_column).to_pylist()})
    stats.truncated += status["truncated"]
    stats.dropped_overlong += status["dropped"]
    left_out = {"no_answer": NO_ANSWER_LEFT, "dropped": dropped_reason(limit), CUT_IMAGE: image_cut_reason(limit),
                UNREADABLE: UNREADABLE_REASON, SPECIAL_TEXT: SPECIAL_TEXT_REASON}
    for kind, reason in left_out.items():
        if status[kind]:
            where = stats.skipped_rows.setdefault(reason, [])
            origins = pc.filter(encoded.data.column("origin"), pc.equal(status_column, kind))
            for chunk in range(0, len(origins), _WRITE_BATCH):
                for origin in origins.slice(chunk, _WRITE_BATCH).to_pylist():
                    if origin and origin not in where and len(where) < SKIPPED_ROWS_KEPT:  # (a mix repeats records)
                        where.append(origin)
                if len(where) >= SKIPPED_ROWS_KEPT:
                    break
    for kind, reason in (("no_answer", NO_ANSWER_LEFT), (CUT_IMAGE, image_cut_reason(limit)),
                         (UNREADABLE, UNREADABLE_REASON), (SPECIAL_TEXT, SPECIAL_TEXT_REASON)):
        if status[kind]:
            stats.skipped = {**stats.skipped, reason: stats.skipped.get(reason, 0) + status[kind]}


def _count_images(dataset: Any, encoded: Any, kept: Any, counts: dict, stats: DataStats, cfg: DataConfig,
                  processor: Any) -> Any:
    """A vision-language model's data: its images counted in `stats` (and the encoder's inputs for
    the example with the most pixels, which the planner traces); `dataset` without the image
    columns where no example has one."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    stats.images = int(counts["n_images"].astype(np.int64).sum())
    stats.image_tokens = int(counts["n_image_tokens"].astype(np.int64).sum())
    stats.images_max = int(counts["n_images"].max())
    stats.pictured = int((counts["n_images"] > 0).sum())
    # the most text tokens an example holds before any cut, of those kept and of those left out for
    # an image a cut would reach: at a smaller pixel budget, the planner bounds their rows by it
    status_column = encoded.data.column("status")
    uncut = pc.is_in(status_column, value_set=pa.array(["ok", "truncated", CUT_IMAGE]))
    stats.text_tokens_max = int(pc.max(pc.filter(encoded.data.column("n_text_tokens"), uncut)).as_py() or 0)
    stats.image_max_pixels = vision.pixel_budget(processor)
    if stats.images:  # the vision encoder's inputs for the example with the most pixels (the planner's)
        heaviest = int(counts["n_pixels"].argmax())
        described = pc.filter(encoded.data.column("encoder_inputs"), kept)[heaviest].as_py()
        stats.encoder_inputs = json.loads(described) if described else {}
    if not stats.images:
        return dataset.remove_columns(["images", "token_types"])  # text only: trained as text
    if cfg.packing:
        raise UserError("data.packing joins examples into rows, which examples with images cannot share (their "
                        "image tokens and pixels go together, as TRL and Axolotl refuse too): set data.packing=false "
                        "for data with images")
    return dataset


def tokenize_file(paths: str | list[str], tokenizer: Any, cfg: DataConfig, stats: DataStats,
                  split: str = HELD_OUT, processor: Any = None) -> Any:
    """:func:`tokenize_records` of the records `paths` hold (their `split`: by default the held-out
    one), read and tokenised as a run's own data, uncached; its files live as long as this process."""
    folder = cache.scratch()
    return tokenize_records(record_table(iter_records(paths, cfg, stats, split), folder), tokenizer, cfg, stats, folder,
                            processor)


class _Files:
    """The ``datasets.map``/``filter`` arguments that write a step's Arrow file in a folder (named,
    so that no fingerprint of the tokenizer is hashed) or, without one, keep it in memory."""

    def __init__(self, folder: Path | None):
        self.folder = folder
        self.number = next(_TABLES)

    def kwargs(self, step: str) -> dict[str, Any]:
        if self.folder is None:
            return {"keep_in_memory": True, "new_fingerprint": f"{step}-{self.number}"}
        return {"cache_file_name": str(Path(self.folder) / f"{step}-{self.number}.arrow"),
                "load_from_cache_file": False, "new_fingerprint": f"{step}-{self.number}"}


def mix(parts: list[list[dict[str, Any]]], weights: list[float], seed: int) -> list[dict[str, Any]]:
    """Records mixed by weight (:func:`mix_order`)."""
    flat = [record for part in parts for record in part]
    return [flat[i] for i in mix_order([len(p) for p in parts], weights, seed)]


def mix_order(sizes: list[int], weights: list[float], seed: int) -> list[int]:
    """Sources of `sizes` records mixed by weight, as positions in their concatenation: the mixture
    keeps the total number of records, and source i contributes ``total x w_i / sum(w)`` of them,
    drawn without replacement while it has enough and repeated (whole passes, then a random
    remainder) when its share is larger than it is.

    Kept rather than ``datasets.interleave_datasets(probabilities=...)``: that draws each example's
    source at random, so the shares are right only on average and the length depends on the
    stopping strategy; here each share is an exact count and the total is the sources' total."""
    import random

    rng = random.Random(seed)
    total = sum(sizes)
    mixed: list[int] = []
    offset = 0
    for size, weight in zip(sizes, weights):
        want = round(total * weight / sum(weights))
        if size:
            passes, remainder = divmod(want, size)
            positions = range(offset, offset + size)
            mixed += list(positions) * passes + rng.sample(positions, remainder)
        offset += size
    rng.shuffle(mixed)
    return mixed


def build(cfg: DataConfig, tokenizer: Any, seed: int = 0, processor: Any = None) -> DataBundle:
    """Read, validate, tokenise and measure the training and validation data, or take all of it
    from the cache when this data, tokenizer and settings were prepared before
    (:mod:`sft_play.data.cache`; ``data.cache: false`` turns it off).

    Args:
        cfg: the ``data`` section of the run config.
        tokenizer: a transformers tokenizer (its chat template is used unless the config overrides it).
        seed: seed for carving a validation split by fraction and for mixing by weight.
        processor: a vision-language model's processor (:func:`sft_play.model.load_processor`):
            records with images are read, and their images counted as the tokens they cost.

    Returns:
        A :class:`DataBundle`.

    Raises:
        InvalidRow: a bad row, with ``data.on_invalid: error``.
        ValueError: no usable example, or a format that cannot be detected.
    """
    if cfg.streaming and processor is not None:
        raise UserError("data.streaming is not done for vision-language models yet (whether a stream shows images, "
                        "and what they cost, is known only as it is read): set data.streaming=false; the data is then "
                        "prepared once and cached")
    if cfg.streaming:
        return _streamed(cfg, tokenizer, seed, processor)
    if not cfg.cache:
        return _prepared(cfg, tokenizer, seed, processor=processor)  # its files live as long as this process
    key = cache.cache_key(cfg, tokenizer, resolve_chat_template(tokenizer, cfg.chat_template), seed,
                          image_settings(processor) if processor is not None else None)
    with cache.preparing(key):  # processes started together with this data prepare it once
        cached = cache.load(key)
        stale = vision.changed_images(cached["train"], cached["validation"]) if cached and processor else []
        if stale:  # (the key sees the data files, not the image files they name)
            logger.warning("data: %d image(s) changed since the data was prepared (%s%s): preparing it again",
                           len(stale), stale[0], ", ..." if len(stale) > 1 else "")
            cached = None
            cache.forget(key)
        if cached is not None:
            logger.info("data: preprocessed data from the cache (%s)", key)
            bundle = _bundle_from(cached)
            _log_skips(bundle)
        else:
            folder = cache.scratch()
            bundle = _prepared(cfg, tokenizer, seed, folder, processor)
            if cache.save(key, bundle.train, bundle.validation, bundle.stats.to_dict(),
                          bundle.validation_stats.to_dict() if bundle.validation_stats else None):
                bundle = _bundle_from(cache.load(key, verify=False))  # the cache's copy: the steps' files can go
                cache.discard(folder)
    # what planning reads without loading the tokenizer (transformers keeps the source it loaded from)
    cache.remember_stats(cache.stats_key(cfg, getattr(tokenizer, "name_or_path", None), seed),
                         bundle.stats.to_dict(), bundle.validation_stats.to_dict() if bundle.validation_stats else None)
    return bundle


def _streamed(cfg: DataConfig, tokenizer: Any, seed: int, processor: Any = None) -> DataBundle:
    """``data.streaming``: the training data as a ``datasets.IterableDataset`` read, tokenised and
    packed a thousand records at a time as training consumes it (in the sources' order; mixed by
    ``data.weights`` at random in those shares), and the statistics of its first
    ``data.sample_rows`` records, prepared whole (bad rows among them as ``data.on_invalid`` says;
    later ones are skipped and counted, as a stream cannot stop a run half-way for them). The
    validation data (``data.validation_path``) is prepared whole, uncached."""
    import datasets

    sample_cfg = cfg.model_copy(update={"streaming": False, "validation_fraction": 0.0})
    folder = cache.scratch()
    stats = DataStats()
    # one stream per weighted source; without weights one of every source in order
    sources = [[entry] for entry in cfg.path] if cfg.weights else [[cfg.path] if isinstance(cfg.path, str) else cfg.path]
    records = record_table(iter_records(cfg.path, sample_cfg, stats, streaming=True, limit=cfg.sample_rows), folder)
    tokenize_records(records, tokenizer, sample_cfg, stats, folder, processor)
    stats.sampled = len(records)
    del records
    cache.discard(folder)  # (only the statistics are kept)
    logger.info("data: streamed; the planner reads the statistics of its first %d records (data.sample_rows)",
                stats.sampled)
    if not stats.examples:
        raise NoUsableData(f"no usable training example in the first {stats.sampled} records of {cfg.path}"
                           + (f": {skip_summary(stats)}" if stats.skipped else ""))
    skipping = cfg.model_copy(update={"on_invalid": "skip"})
    streams = [datasets.IterableDataset.from_generator(_stream_cells, features=_record_features(), gen_kwargs={
        "paths": paths, "cfg": skipping}) for paths in sources]
    stream = streams[0] if len(streams) == 1 else datasets.interleave_datasets(
        streams, probabilities=[w / sum(cfg.weights) for w in cfg.weights], seed=seed,
        stopping_strategy="all_exhausted")
    template = resolve_chat_template(tokenizer, cfg.chat_template)
    train = stream.map(_encode_batch, batched=True, remove_columns=list(RECORD_COLUMNS), fn_kwargs={
        "tokenizer": tokenizer, "template": template, "train_on": cfg.train_on, "limit": cfg.max_seq_length,
        "overlong": cfg.overlong, "tools_rendered": renders_tools(template), "processor": processor,
        "special_text": cfg.special_tokens_in_text, "skip_unreadable": cfg.on_invalid == "skip"})
    counted = ["n_tokens", "n_loss", "n_markers"] + (list(IMAGE_COUNTS) if processor is not None else [])
    train = train.filter(lambda status: [kind in ("ok", "truncated") for kind in status], input_columns=["status"],
                         batched=True).remove_columns(["status", "origin", *counted])
    if cfg.packing:
        from trl.data_utils import pack_dataset

        train = pack_dataset(train, cfg.max_seq_length, "bfd")  # a thousand examples at a time, as prepared
    validation = validation_stats = None
    if cfg.validation_path:
        validation_stats = DataStats()
        validation = tokenize_file(cfg.validation_path, tokenizer, sample_cfg, validation_stats, processor=processor)
    bundle = DataBundle(train=train, validation=validation, stats=stats, validation_stats=validation_stats)
    _log_skips(bundle)
    return bundle


_SAID: set[str] = set()  # the streamed passes' skip summaries this process has said


def _stream_cells(paths: list[str], cfg: DataConfig) -> Iterator[dict[str, Any]]:
    """The records of `paths` as :data:`RECORD_COLUMNS` cells, for ``IterableDataset.from_generator``;
    the rows skipped as bad said when a pass ends, once: every later pass skips the same rows."""
    stats = DataStats()
    for record in iter_records(paths, cfg, stats, streaming=True):
        yield _cells(record)
    summary = skip_summary(stats)
    if summary and summary not in _SAID:
        _SAID.add(summary)
        logger.warning("data (streamed): %s", summary)


def _prepared(cfg: DataConfig, tokenizer: Any, seed: int, folder: Path | None = None, processor: Any = None) -> DataBundle:
    """:func:`_build` in `folder` (a new :func:`cache.scratch` folder unless given), a full disk said
    as what it is."""
    folder = folder or cache.scratch()
    try:
        return _build(cfg, tokenizer, seed, folder, processor)
    except OSError as exc:
        if not cache.out_of_space(exc):
            raise
        raise UserError(f"no space left on the disk of {folder.parent} to prepare the data (about 3x the tokenised "
                        "data's size is written there): free some, or set SFT_PLAY_CACHE to a folder on a larger "
                        "disk") from None


def remembered_stats(cfg: DataConfig, tokenizer_source: str | None, seed: int = 0) -> DataStats | None:
    """The training data's statistics as a :func:`build` of the same data, settings and local
    tokenizer folder measured them, read without loading the tokenizer; None when none did (or
    the tokenizer is on the hub, or ``data.cache`` is off)."""
    saved = cache.remembered_stats(cache.stats_key(cfg, tokenizer_source, seed)) if cfg.cache else None
    return DataStats(**_stat_fields(saved["stats"])) if saved else None


def _bundle_from(cached: dict[str, Any]) -> DataBundle:
    """The bundle :func:`cache.load` read back."""
    validation_stats = cached["validation_stats"]
    return DataBundle(train=cached["train"], validation=cached["validation"],
                      stats=DataStats(**_stat_fields(cached["stats"])),
                      validation_stats=DataStats(**_stat_fields(validation_stats)) if validation_stats else None)


def _stat_fields(saved: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in saved.items() if k in DataStats.__dataclass_fields__}


def _records(cfg: DataConfig, stats: DataStats, seed: int, folder: Path | None = None) -> tuple[Any, Any | None]:
    """(training records, validation records or None) as read, each a :func:`record_table` (its
    Arrow file in `folder`): mixed by ``data.weights``, and with ``data.validation_fraction`` that
    share of each source held out *before* mixing, so that no copy of a held-out record (mixing
    repeats the sources it weights up) trains."""
    if not cfg.weights:
        return _held_out(record_table(iter_records(cfg.path, cfg, stats), folder), cfg, seed)
    import datasets

    parts = [record_table(iter_records(entry, cfg, stats), folder) for entry in cfg.path]
    sizes = [len(p) for p in parts]
    kept = [list(range(size)) for size in sizes]
    held = None
    if not cfg.validation_path and cfg.validation_fraction > 0:
        # each source's share, but never its last record (a small source would leave the mix);
        # at least one record in all, from the largest source
        cuts = [min(size - 1, round(size * cfg.validation_fraction)) if size else 0 for size in sizes]
        if not sum(cuts) and max(sizes) > 1:
            cuts[max(range(len(sizes)), key=lambda i: sizes[i])] = 1
        splits = [_split(size, cut, seed) for size, cut in zip(sizes, cuts)]
        kept = [train for train, _ in splits]
        held = [offset + i for offset, (_, out) in zip(itertools.accumulate([0, *sizes]), splits) for i in out] or None
        import random

        if held:
            random.Random(seed).shuffle(held)  # the held-out prompts make generate shows come from every source
    whole = datasets.concatenate_datasets(parts)
    offsets = list(itertools.accumulate([0, *sizes]))
    order = mix_order([len(k) for k in kept], cfg.weights, seed)
    positions = [offset + i for offset, part in zip(offsets, kept) for i in part]  # the kept records, in sources' order
    records = whole.select([positions[i] for i in order])
    total = sum(len(k) for k in kept)
    shares = []
    for entry, part, weight in zip(cfg.path, kept, cfg.weights):
        drawn = round(total * weight / sum(cfg.weights)) if part else 0
        shares.append(f"{entry}: {drawn} of its {len(part)} ({drawn / len(part):.2f} passes)" if part
                      else f"{entry}: none (no usable record)")
    logger.info("data: mixed by weights %s into %d records: %s", cfg.weights, len(records), "; ".join(shares))
    return records, whole.select(held) if held else None


def _held_out(records: Any, cfg: DataConfig, seed: int) -> tuple[Any, Any | None]:
    """(training records, validation records or None) for ``data.validation_fraction``: a seeded
    split of the records before tokenising, as Dataset.train_test_split would do (of chat and
    prompt/completion records mixed)."""
    if cfg.validation_path or cfg.validation_fraction <= 0:
        return records, None
    # at least one record held out, and one left to train on (one record: none held out, no validation)
    cut = min(max(1, round(len(records) * cfg.validation_fraction)), len(records) - 1)
    if cut <= 0:
        return records, None
    kept, held = _split(len(records), cut, seed)
    return records.select(kept), records.select(held)


def _split(size: int, cut: int, seed: int) -> tuple[list[int], list[int]]:
    """(the positions of `size` records left, `cut` of them held out at random with `seed`), each in order."""
    import random

    order = list(range(size))
    random.Random(seed).shuffle(order)
    held = set(order[:max(0, cut)])
    return [i for i in range(size) if i not in held], [i for i in range(size) if i in held]


def validation_records(cfg: DataConfig, seed: int, limit: int | None = None) -> list[dict[str, Any]]:
    """The first `limit` validation records a run of `cfg` held out (``data.validation_path``'s, or
    its seeded ``data.validation_fraction`` of the training records), untokenised; empty without either."""
    if cfg.validation_path:
        return list(itertools.islice(iter_records(cfg.validation_path, cfg, DataStats(), HELD_OUT), limit))
    if cfg.validation_fraction > 0:
        folder = cache.scratch()
        try:
            held = _records(cfg, DataStats(), seed, folder)[1]
            return decoded(held, limit) if held is not None else []
        finally:
            cache.discard(folder)
    return []


def _build(cfg: DataConfig, tokenizer: Any, seed: int, folder: Path, processor: Any = None) -> DataBundle:
    stats = DataStats()
    records, validation_records = _records(cfg, stats, seed, folder)
    validation_stats = None
    if cfg.validation_path:
        validation_stats = DataStats()
        validation_records = record_table(iter_records(cfg.validation_path, cfg, validation_stats, HELD_OUT), folder)
    elif validation_records is not None:
        validation_stats = DataStats(formats=dict(stats.formats))
    started = time.perf_counter()
    train = tokenize_records(records, tokenizer, cfg, stats, folder, processor)
    logger.info("data: %d examples tokenised%s in %.1f s", stats.examples,
                f" and packed into {stats.packed_rows} rows" if stats.packed_rows is not None else "",
                time.perf_counter() - started)
    if len(train) == 0:
        raise NoUsableData(
            f"no usable training example in {cfg.path}"
            + (f": {skip_summary(stats)}" if stats.skipped else "")
            + (f" ({stats.dropped_overlong} longer than data.max_seq_length={cfg.max_seq_length})" if stats.dropped_overlong else "")
        )
    validation = None
    if validation_records is not None and validation_stats is not None:
        validation = tokenize_records(validation_records, tokenizer, cfg, validation_stats, folder, processor)
    bundle = DataBundle(train=train, validation=validation, stats=stats, validation_stats=validation_stats)
    _log_skips(bundle)
    if stats.truncated or stats.dropped_overlong:
        logger.warning(
            "data: %d examples truncated and %d dropped%s at data.max_seq_length=%d",
            stats.truncated, stats.dropped_overlong, dropped_rows(stats), cfg.max_seq_length,
        )
    return bundle


def _log_skips(bundle: DataBundle) -> None:
    """The skip summary, on every run (also when the data comes from the cache)."""
    for name, stats in (("train", bundle.stats), ("validation", bundle.validation_stats)):
        summary = skip_summary(stats) if stats is not None else None
        if summary:
            logger.warning("data (%s): %s", name, summary)
