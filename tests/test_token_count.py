"""The tokens a run trained on, as its log lines and TensorBoard report them: every non-padding
token (TRL's own count reads one row's length per batch under our packed rows)."""

from __future__ import annotations

import re

import pytest

from tests.conftest import ROW_TOKENS

pytestmark = pytest.mark.slow

LINE = re.compile(r"^step (\d+)/\d+  loss \S+  .*  tokens ([\d,]+)  ([\d,]+) tok/s  epoch \S+$", re.M)


def logged(output: str) -> list[tuple[int, int, int]]:
    """(step, tokens so far, tokens per second) of each printed training log line."""
    return [(int(m.group(1)), int(m.group(2).replace(",", "")), int(m.group(3).replace(",", "")))
            for m in LINE.finditer(output.replace("\r", "\n"))]


def test_logs_count_every_trained_token_and_the_rate(tiny_lora_run):
    run_dir, result = tiny_lora_run  # 24 steps of 8 packed rows of ROW_TOKENS, logged every 4
    output = result.stdout + result.stderr
    lines = logged(output)
    assert [step for step, _, _ in lines] == [1, 4, 8, 12, 16, 20, 24], output[-3000:]
    assert "{'loss'" not in output and "num_input_tokens_seen" not in output  # one readable line, no duplicates
    first, last = lines[1], lines[-1]  # lines[0] is the first step (logging_first_step)
    per_step = (last[1] - first[1]) / 20  # steps 4 to 24
    assert 0.8 * 8 * ROW_TOKENS < per_step <= 8 * ROW_TOKENS, "real tokens per step: 8 rows, nearly full"
    assert all(rate > 0 for _, _, rate in lines)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    assert {"train/num_tokens", "train/tokens_per_second"} <= set(events.Tags()["scalars"])
    ours, trainers = events.Scalars("train/num_tokens"), events.Scalars("train/num_input_tokens_seen")
    trainers_at = {e.step: e.value for e in trainers}  # (it also logs one with the end-of-training summary)
    assert all(e.value == trainers_at[e.step] for e in ours)  # TRL's own count overwritten by the true one
    assert [(e.step, e.value) for e in ours] == [(step, float(tokens)) for step, tokens, _ in lines]
