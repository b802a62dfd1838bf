"""Reading records from local files (jsonl, json, csv, parquet, txt; files, folders, globs) or the hub.

Local files are read row by row so that a bad row is reported with its file and row number;
hub datasets go through ``datasets.load_dataset``.
"""

from __future__ import annotations

import csv
import glob
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sft_play.data.formats import InvalidRow

EXTENSIONS = (".jsonl", ".json", ".csv", ".parquet", ".txt")


def is_local(entry: str) -> bool:
    """Whether a data path names local files (else it is taken as a hub dataset name)."""
    return (
        os.path.exists(os.path.expanduser(entry))
        or entry.startswith((".", "/", "~"))
        or entry.endswith(EXTENSIONS)
        or any(ch in entry for ch in "*?[")
    )


def expand(entry: str) -> list[Path]:
    """The data files an entry names: a file, every supported file in a folder, or a glob's matches."""
    path = Path(os.path.expanduser(entry))
    if any(ch in entry for ch in "*?["):
        files = [Path(p) for p in sorted(glob.glob(os.path.expanduser(entry), recursive=True))]
    elif path.is_dir():  # .txt only where named: a folder's LICENSE.txt or notes.txt is no training data
        files = sorted(p for p in path.rglob("*") if p.suffix in EXTENSIONS and p.suffix != ".txt" and p.is_file())
    else:
        files = [path]
    files = [f for f in files if f.is_file()]
    if not files:
        raise FileNotFoundError(f"no data files found at '{entry}' (looked for {', '.join(EXTENSIONS)})")
    for f in files:
        if f.suffix not in EXTENSIONS:
            raise ValueError(f"'{f}' is not a supported data file; use one of {', '.join(EXTENSIONS)}")
    return files


def _jsonl_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield number, InvalidRow(str(path), number, "<line>", f"not valid UTF-8 ({exc.reason} at byte {exc.start})")
                continue
            if not line.strip():
                continue
            try:
                row = json.loads(line.rstrip("\r\n"))  # a column on this line, not 1 on the next
            except json.JSONDecodeError as exc:
                yield number, InvalidRow(str(path), number, "<line>", f"not valid JSON: {exc.msg} at column {exc.colno}")
                continue
            if not isinstance(row, dict):
                yield number, InvalidRow(str(path), number, "<line>", f"expected a JSON object, got {type(row).__name__}")
                continue
            yield number, row


def _json_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    raw = path.read_bytes()
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise InvalidRow(str(path), 0, "<file>", f"not valid UTF-8 ({exc.reason} at byte {exc.start}, on line {line})")
    except json.JSONDecodeError as exc:
        # Many ".json" files are really JSON lines
        if exc.msg == "Extra data":
            yield from _jsonl_rows(path)
            return
        raise InvalidRow(str(path), exc.lineno, "<file>", f"not valid JSON: {exc.msg} at column {exc.colno}")
    if isinstance(data, dict):
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise InvalidRow(str(path), 0, "<file>", "expected a list of records (or an object holding one list)")
        data = lists[0]
    if not isinstance(data, list):
        raise InvalidRow(str(path), 0, "<file>", f"expected a list of records, got {type(data).__name__}")
    for number, row in enumerate(data, start=1):
        if not isinstance(row, dict):
            yield number, InvalidRow(str(path), number, "<record>", f"expected an object, got {type(row).__name__}")
            continue
        yield number, row


def _csv_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Rows of a CSV file, numbered from 1 after the header. A byte that is not UTF-8 makes its
    row bad (named by row, column and line), not the whole file: the file is decoded with
    ``surrogateescape``, which keeps such bytes as lone surrogates, found per field."""
    with open(path, encoding="utf-8", errors="surrogateescape", newline="") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        for name in header:
            if _undecodable(name):
                raise InvalidRow(str(path), 0, "<header>", f"not valid UTF-8 ({_undecodable(name)} on line 1)")
        for number, row in enumerate(reader, start=1):
            bad = next(((k, _undecodable(v)) for k, v in row.items() if k is not None and _undecodable(v)), None)
            if bad:
                yield number, InvalidRow(str(path), number, bad[0], f"not valid UTF-8 ({bad[1]} on line {reader.line_num})")
                continue
            yield number, {k: v for k, v in row.items() if k is not None}


def _undecodable(value: Any) -> str | None:
    """The first byte of `value` that was not UTF-8 (decoded with ``surrogateescape``), described."""
    if not isinstance(value, str):
        return None
    for char in value:
        if "\udc80" <= char <= "\udcff":
            return f"byte 0x{ord(char) - 0xDC00:02x}"
    return None


def _parquet_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    import pyarrow.parquet as pq

    for number, row in enumerate(pq.read_table(path).to_pylist(), start=1):
        yield number, row


def _text_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """A plain-text file: each non-empty line one ``text`` record, numbered by its line (as
    ``datasets``' text loader reads it); documents that span lines belong in JSONL records."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as exc:
                yield number, InvalidRow(str(path), number, "<line>", f"not valid UTF-8 ({exc.reason} at byte {exc.start})")
                continue
            if line.strip():
                yield number, {"text": line}


_READERS = {".jsonl": _jsonl_rows, ".json": _json_rows, ".csv": _csv_rows, ".parquet": _parquet_rows,
            ".txt": _text_rows}


def read_file(path: Path) -> Iterator[tuple[int, dict[str, Any] | InvalidRow]]:
    """(row number, record) pairs of one local file; row numbers count from 1 (jsonl: line numbers).

    A line that cannot be read comes as an :class:`InvalidRow` in place of its record, so that
    the caller can skip it and go on; a file that cannot be read at all raises it.
    """
    yielded = False
    for item in _READERS[path.suffix](path):
        yielded = True
        yield item
    if not yielded:
        raise InvalidRow(str(path), 0, "<file>", "no records (the file is empty)")


def read_hub(name: str, split: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(row number, record) pairs of a hub dataset split (downloads through ``datasets``)."""
    import datasets

    dataset = datasets.load_dataset(name, split=split)
    for number, row in enumerate(dataset, start=1):
        yield number, row


def iter_sources(paths: str | list[str], split: str) -> Iterator[tuple[str, Iterator[tuple[int, dict[str, Any]]]]]:
    """(source name, rows) for every file or hub dataset that `paths` names, in order."""
    for entry in [paths] if isinstance(paths, str) else paths:
        if is_local(entry):
            for file in expand(entry):
                yield str(file), read_file(file)
        else:
            yield f"{entry}[{split}]", read_hub(entry, split)
