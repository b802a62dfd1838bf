"""The tokens a run trained on, as its log lines and TensorBoard report them: every non-padding
token (TRL's own count reads one row's length per batch under our packed rows)."""

from __future__ import annotations

import ast
import re

import pytest

pytestmark = pytest.mark.slow


def logged(output: str) -> list[dict]:
    return [ast.literal_eval(m.group(0)) for m in re.finditer(r"\{'loss': [^}]*\}", output)]


def test_logs_count_every_trained_token_and_the_rate(tiny_lora_run):
    run_dir, result = tiny_lora_run  # 24 steps of 8 packed rows of 256 tokens, logged every 4
    lines = logged(result.stdout + result.stderr)
    assert [int(line["num_tokens"]) for line in lines] == [int(line["num_input_tokens_seen"]) for line in lines]
    first, last = lines[1], lines[-1]  # lines[0] is the first step (logging_first_step)
    per_step = (int(last["num_tokens"]) - int(first["num_tokens"])) / 20  # steps 4 to 24
    assert 0.8 * 8 * 256 < per_step <= 8 * 256, "real tokens per step: 8 rows, nearly full"
    assert all(float(line["tokens_per_second"]) > 0 for line in lines)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    assert {"train/num_tokens", "train/tokens_per_second"} <= set(events.Tags()["scalars"])
    assert events.Scalars("train/num_tokens")[-1].value == float(last["num_tokens"])
