"""Reading records from local files (jsonl, json, csv, parquet, txt, arrow, the text ones also gzip,
bzip2, xz or zstd compressed; files, folders, globs, folders of splits, datasets' save_to_disk
folders) or the hub.

Local files are read row by row so that a bad row is reported with its file and row number;
hub datasets go through ``datasets.load_dataset``.
"""

from __future__ import annotations

import csv
import glob
import io
import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sft_play.data.formats import InvalidRow
from sft_play import hub
from sft_play.errors import UserError

logger = logging.getLogger(__name__)

EXTENSIONS = (".jsonl", ".json", ".csv", ".parquet", ".txt", ".arrow")
NAMED_ONLY = (".txt", ".arrow")  # read where a path or glob names them, not from a folder
# Whole-file compression of the text formats (``data.jsonl.gz``), read as a stream; Parquet and
# Arrow compress inside. zstd needs the zstandard package (datasets reads .zst with it too)
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
COMPRESSIBLE = (".jsonl", ".json", ".csv", ".txt")


def data_suffix(path: Path) -> str:
    """The format's suffix of a data file, under any compression's: ``.jsonl`` for ``a.jsonl.gz``."""
    return Path(path.stem).suffix if path.suffix in COMPRESSIONS else path.suffix


def _supported(path: Path) -> bool:
    kind = data_suffix(path)
    return kind in EXTENSIONS and (path.suffix not in COMPRESSIONS or kind in COMPRESSIBLE)


def _open(path: Path):
    """`path` opened for reading bytes, decompressed as its suffix says."""
    if path.suffix == ".gz":
        import gzip

        return gzip.open(path, "rb")
    if path.suffix == ".bz2":
        import bz2

        return bz2.open(path, "rb")
    if path.suffix == ".xz":
        import lzma

        return lzma.open(path, "rb")
    if path.suffix == ".zst":
        try:
            import zstandard
        except ImportError:
            raise UserError(f"'{path}' is compressed with zstd, which needs the zstandard package: pip install "
                            "zstandard (or decompress it: zstd -d)") from None
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")


def is_local(entry: str) -> bool:
    """Whether a data path names local files (else it is taken as a hub dataset name)."""
    return (
        os.path.exists(os.path.expanduser(entry))
        or entry.startswith((".", "/", "~"))
        or entry.endswith(EXTENSIONS)
        or entry.endswith(tuple(e + c for e in COMPRESSIBLE for c in COMPRESSIONS))
        or any(ch in entry for ch in "*?[")
    )


# Split names in file and folder names (as `datasets` reads a folder's splits), to the split they are
SPLIT_NAMES = {"train": "train", "training": "train", "test": "test", "testing": "test", "validation": "validation",
               "valid": "validation", "val": "validation", "dev": "validation", "eval": "validation"}
_SAID: set[tuple[Path, str]] = set()
HELD_OUT = "<held-out>"  # the split data.validation_path takes from a source of splits (held_out_split)
_HELD_OUT_NAMES = ("validation", "valid", "val", "dev", "eval", "test")


def held_out_split(names: Any) -> str | None:
    """The split validation data takes from a source whose splits are `names` (a folder's, a saved
    DatasetDict's, a hub dataset's): the first of validation, valid, val, dev, eval, test it has."""
    return next((name for name in _HELD_OUT_NAMES if name in names), None)


def split_of(file: Path, root: Path) -> str | None:
    """The split `file` (inside the folder `root`) belongs to by its folders' or its own name."""
    for part in [*file.relative_to(root).parent.parts, file.stem]:
        for word in re.split(r"[-_.\s]+", part.lower()):
            if word in SPLIT_NAMES:
                return SPLIT_NAMES[word]
    return None


def _held_out_or_train(names: list[str], source: str) -> str:
    """:func:`held_out_split` of a dataset named as validation data, else its train split (a
    dataset kept for validation alone may have only that), said: with data.path the same dataset,
    validation would score rows that train."""
    held_out = held_out_split(names)
    if held_out is None:
        logger.warning("data.validation_path: %s has no held-out split (its splits: %s): its train split is the "
                       "validation data", source, ", ".join(names))
    return held_out or "train"


def _select_split(files: list[Path], root: Path, split: str) -> list[Path]:
    """A folder's files of `split` where the folder holds splits by name (``train/``, ``test.jsonl``,
    ``validation-00000.parquet``): files named for no split go with train. A folder without
    held-out splits is read whole."""
    splits = {f: split_of(f, root) or "train" for f in files}
    present = set(splits.values())
    if present == {"train"}:
        return files
    wanted = held_out_split(present) if split == HELD_OUT else SPLIT_NAMES.get(split.lower(), split.lower())
    chosen = [f for f in files if splits[f] == wanted]
    if not chosen:
        raise FileNotFoundError(f"'{root}' holds the splits {', '.join(sorted(present))} (by its files' names), not "
                                f"'{split}': set data.split to one of them")
    left = [str(f) for f in files if splits[f] != wanted]
    if (root, wanted) in _SAID:  # each time the folder is listed (the cache's key, then the reading)
        return chosen
    _SAID.add((root, wanted))
    logger.info("data: %s: the %s split's files (%d); left out, as other splits: %s", root, wanted, len(chosen),
                ", ".join(left[:5]) + (f" and {len(left) - 5} more" if len(left) > 5 else ""))
    return chosen


def expand(entry: str, split: str = "train") -> list[Path]:
    """The data files an entry names: a file, every supported file in a folder (those of `split`
    where the folder holds splits, :func:`_select_split`), or a glob's matches."""
    path = Path(os.path.expanduser(entry))
    if any(ch in entry for ch in "*?["):
        files = [Path(p) for p in sorted(glob.glob(os.path.expanduser(entry), recursive=True))]
    elif path.is_dir():  # .txt only where named: a folder's LICENSE.txt or notes.txt is no training data
        if saved_dataset(path):
            return [path]
        if (path / "dataset_info.json").is_file():
            raise UserError(f"'{entry}' holds a dataset_info.json but is no dataset saved by datasets' save_to_disk "
                             "(no state.json or dataset_dict.json): a LLaMA-Factory data folder registers its "
                             "datasets there; set data.path to the dataset's own file")
        files = sorted(p for p in path.rglob("*")
                       if _supported(p) and data_suffix(p) not in NAMED_ONLY and p.is_file())
        files = _select_split(files, path, split) if files else files
    else:
        files = [path]
    files = [f for f in files if f.is_file()]
    if not files:
        raise FileNotFoundError(f"no data files found at '{entry}' (looked for {', '.join(EXTENSIONS)}, or a dataset "
                                "saved by datasets' save_to_disk)")
    for f in files:
        if not _supported(f):
            raise UserError(f"'{f}' is not a supported data file; use one of {', '.join(EXTENSIONS)} (the text ones "
                            f"also compressed: {', '.join(COMPRESSIONS)}), or a folder written by datasets' save_to_disk")
    return files


def saved_dataset(path: Path) -> bool:
    """Whether `path` is a folder ``datasets``' ``save_to_disk`` wrote (a Dataset or a DatasetDict)."""
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def _saved_rows(path: Path, split: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """The rows of a ``save_to_disk`` folder; of a DatasetDict, its `split`'s."""
    import datasets

    dataset = datasets.load_from_disk(str(path))
    if isinstance(dataset, datasets.DatasetDict):
        names = list(dataset)
        wanted = _held_out_or_train(names, str(path)) if split == HELD_OUT else split
        if wanted not in names:
            raise InvalidRow(str(path), 0, "<split>", f"no split '{split}' in this dataset (its splits: "
                                                      f"{', '.join(names)}); set data.split to one of them")
        dataset = dataset[wanted]
    for number, row in enumerate(dataset, start=1):
        yield number, row


# A record is one example: a conversation of a million tokens is about 4 MiB of text. Larger
# lines, or objects nested deeper than any chat format, are refused as bad rows (tokenising a
# record takes a few hundred times its size in memory; Python's JSON reader recurses per level)
MAX_RECORD_BYTES = 16 << 20
MAX_NESTING = 32


def _bounded(path: Path, number: int, raw: bytes | str) -> InvalidRow | None:
    if len(raw) > MAX_RECORD_BYTES:
        return InvalidRow(str(path), number, "<line>", f"over {MAX_RECORD_BYTES >> 20} MiB in one record, more than a "
                          "record may hold (a million-token conversation is ~4 MiB)")
    return None


def _lines(f) -> Iterator[bytes]:
    """The lines of binary file `f`, none held beyond :data:`MAX_RECORD_BYTES` + 1 bytes: the rest
    of a longer line is read past in pieces, so a multi-GB line costs no more memory than a record."""
    while raw := f.readline(MAX_RECORD_BYTES + 1):
        if len(raw) > MAX_RECORD_BYTES and not raw.endswith(b"\n"):
            while (rest := f.readline(1 << 20)) and not rest.endswith(b"\n"):
                pass
        yield raw


def _record_problem(record: Any, text: str | None = None) -> str | None:
    """What makes a parsed record unusable, found in one walk without recursion: nesting beyond
    :data:`MAX_NESTING`, or a string holding half of a UTF-16 pair (JSON's ``"\\ud83d"`` alone),
    which no tokenizer can encode (`text`, the record's JSON, tells cheaply whether one can be there)."""
    strings = text is None or "\\ud" in text or "\\uD" in text
    stack = [(record, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth > MAX_NESTING:
                return f"nested deeper than {MAX_NESTING} levels"
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
        elif strings and isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:
                return "a \\uD800-\\uDFFF escape without its pair: not text a tokenizer can encode"
    return None


def _loads(text: str) -> Any:
    """``json.loads``, with a record no tokenizer could take (:func:`_record_problem`) a ValueError
    (not a RecursionError, or a TypeError deep in the tokenizer)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(f"nested deeper than {MAX_NESTING} levels") from None
    problem = _record_problem(value, text)
    if problem:
        raise ValueError(problem)
    return value


def _jsonl_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with _open(path) as f:
        for number, raw in enumerate(_lines(f), start=1):
            too_large = _bounded(path, number, raw)
            if too_large is not None:
                yield number, too_large
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield number, InvalidRow(str(path), number, "<line>", f"not valid UTF-8 ({exc.reason} at byte {exc.start})")
                continue
            if not line.strip():
                continue
            try:
                row = _loads(line.rstrip("\r\n"))  # a column on this line, not 1 on the next
            except json.JSONDecodeError as exc:
                yield number, InvalidRow(str(path), number, "<line>", f"not valid JSON: {exc.msg} at column {exc.colno}")
                continue
            except ValueError as exc:
                yield number, InvalidRow(str(path), number, "<line>", str(exc))
                continue
            if not isinstance(row, dict):
                yield number, InvalidRow(str(path), number, "<line>", f"expected a JSON object, got {type(row).__name__}")
                continue
            yield number, row


def _json_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with _open(path) as f:
        raw = f.read()
    try:
        data = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise InvalidRow(str(path), 0, "<file>", "nested deeper than Python's JSON reader follows") from None
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
        problem = _record_problem(row)
        if problem:
            yield number, InvalidRow(str(path), number, "<record>", problem)
            continue
        yield number, row


def _csv_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Rows of a CSV file, numbered from 1 after the header. A byte that is not UTF-8 makes its
    row bad (named by row, column and line), not the whole file: the file is decoded with
    ``surrogateescape``, which keeps such bytes as lone surrogates, found per field."""
    with io.TextIOWrapper(_open(path), encoding="utf-8", errors="surrogateescape", newline="") as f:
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

    number = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=1_000):  # (a whole file as Python objects: GBs)
        for row in batch.to_pylist():
            number += 1
            yield number, row


def _text_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """A plain-text file: each non-empty line one ``text`` record, numbered by its line (as
    ``datasets``' text loader reads it); documents that span lines belong in JSONL records."""
    with _open(path) as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as exc:
                yield number, InvalidRow(str(path), number, "<line>", f"not valid UTF-8 ({exc.reason} at byte {exc.start})")
                continue
            if line.strip():
                yield number, {"text": line}


def _arrow_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """An Arrow file as ``datasets`` writes one (a shard of a save_to_disk folder, or its cache)."""
    import datasets

    for number, row in enumerate(datasets.Dataset.from_file(str(path)), start=1):
        yield number, row


_READERS = {".jsonl": _jsonl_rows, ".json": _json_rows, ".csv": _csv_rows, ".parquet": _parquet_rows,
            ".txt": _text_rows, ".arrow": _arrow_rows}


def read_file(path: Path, split: str = "train") -> Iterator[tuple[int, dict[str, Any] | InvalidRow]]:
    """(row number, record) pairs of one local file; row numbers count from 1 (jsonl: line numbers).

    A line that cannot be read comes as an :class:`InvalidRow` in place of its record, so that
    the caller can skip it and go on; a file that cannot be read at all raises it.
    """
    yielded = False
    for item in (_saved_rows(path, split) if saved_dataset(path) else _READERS[data_suffix(path)](path)):
        yielded = True
        yield item
    if not yielded:
        raise InvalidRow(str(path), 0, "<file>", "no records (the file is empty)")


def read_hub(name: str, split: str, streaming: bool = False) -> Iterator[tuple[int, dict[str, Any]]]:
    """(row number, record) pairs of a hub dataset split (downloads through ``datasets``; with
    `streaming`, read as they download, nothing kept on disk); for validation data
    (:data:`HELD_OUT`) its validation split, else its test split, else its train split.

    Raises:
        UserError: the dataset cannot be had (offline and not cached, not on the hub, gated), or
            has no such split."""
    hub.prepare(name)  # an unreachable hub: the local cache, at once, not half a minute of retries
    import datasets

    try:
        if split == HELD_OUT:
            split = _held_out_or_train(datasets.get_dataset_split_names(name), name)
        dataset = datasets.load_dataset(name, split=split, streaming=streaming)
    except (ConnectionError, OSError) as exc:  # offline, not found, gated: datasets' errors derive from these
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        offline = os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1"
        cause = ("the hub cannot be reached (HF_HUB_OFFLINE=1) and it is not in the local cache" if offline
                 else reason)
        raise UserError(f"cannot load the dataset '{name}': {cause}. To use a local copy: hf download {name} "
                        "--repo-type dataset --local-dir DIR, then set data.path=DIR (its files are read as they are)"
                        ) from None
    except ValueError as exc:  # an unknown split
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"cannot load the dataset '{name}' split '{split}': {reason} (data.split)") from None
    for number, row in enumerate(dataset, start=1):
        yield number, row


def iter_sources(paths: str | list[str], split: str,
                 streaming: bool = False) -> Iterator[tuple[str, Iterator[tuple[int, dict[str, Any]]]]]:
    """(source name, rows) for every file or hub dataset that `paths` names, in order (hub datasets
    streamed with `streaming`; local files are read row by row either way)."""
    for entry in [paths] if isinstance(paths, str) else paths:
        if is_local(entry):
            for file in expand(entry, split):
                yield str(file), read_file(file, split)
        else:
            yield f"{entry}[{split}]", read_hub(entry, split, streaming)
