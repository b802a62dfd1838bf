"""Data preparation beside TRL's own: the same chat file tokenised, labelled on the answers and
packed (best-fit decreasing) by ``sft_play.data.build`` and by ``SFTTrainer``'s preparation
(``assistant_only_loss``, ``packing_strategy="bfd"``), each in a fresh process without a cache:
wall time and the process's peak resident memory; writes docs/reports/data_prep.md.

Usage: python bench/data_prep.py [--data data/tiny/train.jsonl | --rows 20000 80000 ...] [--max-seq-length 256] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from _common import REPO, REPORTS, run_worker, versions  # bench/ is the script's folder
from tiny_default import hardware_line


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _anonymous_bytes() -> int:
    """The anonymous memory (not file pages) of this process and its children, each shared page
    counted once over them (proportional set sizes: forked workers share their parent's pages)."""
    import psutil

    total = 0
    for process in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            with open(f"/proc/{process.pid}/smaps_rollup") as f:
                total += sum(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss_Anon:"))
        except OSError:
            continue
    return total


class PeakAnonymous:
    """:func:`_anonymous_bytes` sampled every 200 ms while it runs: its peak (a preparation's
    memory holds for seconds at each step; listing the processes more often costs CPU the
    preparation would otherwise have)."""

    def __enter__(self):
        import threading

        self.peak, self._done = _anonymous_bytes(), threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._done.wait(0.2):
            self.peak = max(self.peak, _anonymous_bytes())

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()


def worker(spec: dict) -> dict:
    with PeakAnonymous() as anonymous:
        result = _prepare(spec)
    return {**result, "anonymous_peak_bytes": anonymous.peak}


def _prepare(spec: dict) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(REPO / "configs" / "tiny_model")
    before = _rss_bytes()
    started = time.perf_counter()
    if spec["side"] == "sft_play":
        from sft_play import config as config_module
        from sft_play.data import build

        cfg = config_module.load(None, [f"data.path={spec['data']}", "data.validation_path=null",
                                        f"data.max_seq_length={spec['max_seq_length']}",
                                        f"data.num_proc={spec.get('num_proc', 'auto')}"], check_paths=False).data
        rows = build(cfg, tokenizer, seed=0).train
    else:
        import datasets
        from trl import SFTConfig, SFTTrainer

        args = SFTConfig(output_dir=tempfile.mkdtemp(), max_length=spec["max_seq_length"], packing=True,
                         packing_strategy="bfd", assistant_only_loss=True, report_to="none", use_cpu=True)
        dataset = datasets.load_dataset("json", data_files=spec["data"], split="train")
        # The preparation SFTTrainer runs in its constructor, without a model or a trainer around it
        trainer_state = SimpleNamespace(_tokenizer=tokenizer, chat_template=None, completion_only_loss=None,
                                        padding_free=False)
        rows = SFTTrainer._prepare_dataset(trainer_state, dataset, tokenizer, args, True, None, "train")
    return {"ok": True, "seconds": time.perf_counter() - started, "rows": len(rows),
            "peak_bytes": _rss_bytes(), "before_bytes": before}


def generate_rows(path: Path, rows: int, seed: int = 0) -> Path:
    """`rows` chat records of about 1,000 characters each (a question and an answer of random
    words), the shape issue 47 measured: a file for the bench, kept out of the repository."""
    import random

    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo",
             "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango", "uniform"]
    rng = random.Random(seed)

    def text(characters: int) -> str:
        out: list[str] = []
        while sum(len(w) + 1 for w in out) < characters:
            out.append(rng.choice(words))
        return " ".join(out)

    with open(path, "w") as f:
        for _ in range(rows):
            f.write(json.dumps({"messages": [{"role": "user", "content": text(450)},
                                             {"role": "assistant", "content": text(500)}]}) + "\n")
    return path


def measure(data: str, max_seq_length: int, one_process: bool = False) -> dict[str, dict]:
    """Both sides on `data`, each in a fresh process: SFT-Play with an empty cache (first in one
    tokenising process with `one_process`: what every core buys), then again with the cache it
    wrote (a second run, or every other rank), then TRL with empty caches."""
    import os

    results = {}
    if one_process:
        with tempfile.TemporaryDirectory() as cache:
            os.environ["SFT_PLAY_CACHE"] = cache
            results["sft_play, data.num_proc=1"] = run_worker(Path(__file__), {
                "data": data, "max_seq_length": max_seq_length, "side": "sft_play", "num_proc": 1}, timeout=3600)
    with tempfile.TemporaryDirectory() as cache:
        os.environ["SFT_PLAY_CACHE"] = cache  # nothing prepared before: both sides do the whole work
        os.environ["HF_DATASETS_CACHE"] = str(Path(cache) / "hf")
        spec = {"data": data, "max_seq_length": max_seq_length}
        results["sft_play"] = run_worker(Path(__file__), {**spec, "side": "sft_play"}, timeout=3600)
        results["sft_play, cache written"] = run_worker(Path(__file__), {**spec, "side": "sft_play"}, timeout=3600)
        results["trl"] = run_worker(Path(__file__), {**spec, "side": "trl"}, timeout=3600)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=str(REPO / "data" / "tiny" / "train.jsonl"))
    parser.add_argument("--rows", type=int, nargs="*", help="instead of --data: generated chat files of these many "
                        "rows of about 1,000 characters (e.g. 20000 80000 320000 1000000), in a temporary folder")
    parser.add_argument("--max-seq-length", type=int, default=256)
    parser.add_argument("--one-process", action="store_true", help="also SFT-Play with data.num_proc=1 (what "
                        "tokenising on every core buys)")
    parser.add_argument("--out", default=str(REPORTS / "data_prep.md"))
    parser.add_argument("--worker")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    gib = 1 << 30
    with tempfile.TemporaryDirectory() as folder:
        if args.rows:
            sources = [(f"{n:,} generated rows", str(generate_rows(Path(folder) / f"rows-{n}.jsonl", n))) for n in args.rows]
            command = f"--rows {' '.join(map(str, args.rows))}" + (" --one-process" if args.one_process else "")
        else:
            shown = Path(args.data).relative_to(REPO) if Path(args.data).is_relative_to(REPO) else args.data
            sources, command = [(str(shown), args.data)], f"--data {shown}"
        measured = [(label, Path(path).stat().st_size, measure(path, args.max_seq_length, args.one_process))
                    for label, path in sources]
    lines = ["# Data preparation beside TRL's own", "",
             f"`python bench/data_prep.py {command} --max-seq-length {args.max_seq_length}`: the same chat file "
             "tokenised, labelled on the answers and packed (best-fit decreasing), each side in a fresh process: "
             "SFT-Play with an empty cache (`data.num_proc: auto`, a tokenising process per usable core"
             + ("; before it, with `data.num_proc=1`: what the other cores buy" if args.one_process else "") +
             "), SFT-Play again reading the cache the first wrote (what a second run and "
             "every other rank do), TRL's `SFTTrainer` preparation with empty caches. Peak memory is the process's "
             "peak resident set (it includes the libraries; 'before' is the peak once the tokenizer has loaded), "
             "which counts the pages of memory-mapped files the process has read: the kernel's page cache, dropped "
             "under memory pressure and shared by every process mapping the same file. Anonymous memory is what the "
             "process and its tokenising workers hold themselves (their proportional sets' anonymous pages, sampled "
             "every 200 ms): what cannot be given back.", "",
             f"Hardware: {hardware_line()}. {versions()}.", "",
             "| data | file (MB) | side | wall (s) | packed rows | peak resident (GiB) | peak resident before preparing (GiB) | "
             "peak anonymous, all processes (GiB) |",
             "|---|---|---|---|---|---|---|---|"]
    for label, size, results in measured:
        for side, result in results.items():
            if result.get("ok"):
                lines.append(f"| {label} | {size / 1e6:.0f} | {side} | {result['seconds']:.1f} | {result['rows']:,} | "
                             f"{result['peak_bytes'] / gib:.2f} | {result['before_bytes'] / gib:.2f} | "
                             f"{result['anonymous_peak_bytes'] / gib:.2f} |")
            else:
                lines.append(f"| {label} | {size / 1e6:.0f} | {side} | failed: {result.get('error')} | | | | |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r.get("ok") for _, _, results in measured for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
