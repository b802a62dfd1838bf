"""Data: read records in the formats people have, turn them into tokens and labels, and measure them.

  sources.py   files, folders and hub datasets, the held-out split
  formats.py   messages, ShareGPT, Alpaca, prompt/completion, text: detection and bad rows
  tokenize.py  chat templates, labels on the answers, truncation
  pipeline.py  build(): read, mix, split, tokenise, pack (in Arrow files, on every core), cache
  cache.py     the preprocessed data, keyed by what made it
  preference.py  preference pairs: read, tokenised as TRL's DPOTrainer does, measured, cached
  stats.py     DataStats (what the planner reads), DataBundle
  collate.py   batches: padded, packed rows, padding-free
"""

from sft_play.data.pipeline import (build, iter_records, load_records, mix, remembered_stats, skip_summary,
                                    tokenize_file, tokenize_records, validation_records)
from sft_play.data.preference import build_for_run, build_pairs, remembered_stats_for_run
from sft_play.data.sources import HELD_OUT
from sft_play.data.stats import DataBundle, DataStats, NoUsableData, dropped_reason, dropped_rows

__all__ = ["HELD_OUT", "DataBundle", "DataStats", "NoUsableData", "build", "build_for_run", "build_pairs", "remembered_stats_for_run", "dropped_reason", "dropped_rows",
           "iter_records", "load_records", "mix", "remembered_stats", "skip_summary", "tokenize_file", "tokenize_records",
           "validation_records"]
