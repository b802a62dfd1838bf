"""What the tokenised data looks like (:class:`DataStats`: the planner reads its lengths, a resume
its counts), the datasets with it (:class:`DataBundle`), and how dropped rows are named."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from sft_play.errors import UserError


class NoUsableData(UserError, ValueError):
    """Data of which no example is left to train on (every row bad and skipped, or too long)."""


@dataclass
class DataStats:
    """What the tokenised data looks like; the planner reads the sequence lengths from here."""

    examples: int = 0
    formats: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)
    truncated: int = 0
    dropped_overlong: int = 0
    tokens_total: int = 0
    loss_tokens: int = 0
    tokens_p50: int = 0
    tokens_p95: int = 0
    tokens_max: int = 0
    tokens_squared: int = 0  # the sum of every example's length squared: what causal attention's FLOPs grow with
    packed_rows: int | None = None
    max_seq_length: int = 0
    uniform_rows: bool = False  # every row one example of one common length: no mask and no padding needed
    skipped_rows: dict[str, list[str]] = field(default_factory=dict)  # reason -> "file:row" (the first few)
    sampled: int = 0  # streamed data: these counts are of its first `sampled` records, not of the whole
    # vision-language data: the images the kept examples show, the tokens they cost, the most one example has
    images: int = 0
    image_tokens: int = 0
    images_max: int = 0
    pictured: int = 0  # the examples that show at least one image
    # what the processor gives the vision encoder for the example with the most pixels
    # (sft_play.data.vision.encoder_inputs): the planner traces the encoder on it
    encoder_inputs: dict[str, Any] = field(default_factory=dict)
    text_tokens_max: int = 0  # the most tokens one example holds besides its image tokens
    image_max_pixels: int = 0  # the pixel budget the images were prepared with (0: the processor's own)
    # the kept examples that write one of the tokenizer's special tokens in their text, and the first few
    special_text: int = 0
    special_text_rows: list[str] = field(default_factory=list)
    # preference pairs (finetune.objective: dpo): an example is a pair, its tokens the prompt and the
    # longer answer (the padded length of its two rows); loss tokens both answers'
    pairs: int = 0
    prompt_tokens_p95: int = 0
    prompt_tokens_max: int = 0
    answer_tokens_p95: int = 0
    answer_tokens_max: int = 0
    prompts_cut: int = 0  # prompts cut from the left to preference.max_prompt_length
    # KTO's labelled answers (finetune.objective: kto): an example is an answer
    answers: int = 0
    desirable: int = 0  # the answers labelled desirable (the rest undesirable)

    @property
    def truncated_share(self) -> float:
        return self.truncated / max(1, self.examples)

    @property
    def example_tokens(self) -> float | None:
        """The length of the example a token is in, on average over tokens (the sum of squares over
        the sum): the keys a token attends to, twice over, under a causal mask that keeps packed
        examples apart. None where the data was read before this was counted."""
        return self.tokens_squared / self.tokens_total if self.tokens_squared and self.tokens_total else None

    @property
    def loss_token_share(self) -> float:
        return self.loss_tokens / max(1, self.tokens_total)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["truncated_share"] = self.truncated_share
        data["loss_token_share"] = self.loss_token_share
        return data


@dataclass
class DataBundle:
    """Tokenised datasets (``input_ids``, ``labels``, and ``seq_lengths`` when packed) and their statistics."""

    train: Any
    validation: Any | None
    stats: DataStats
    validation_stats: DataStats | None = None


def image_cut_reason(limit: int) -> str:
    """The reason ``skipped_rows`` names the examples with images a cut at `limit` would reach under."""
    return f"an image's tokens reach past data.max_seq_length={limit} (image tokens are never cut)"


def dropped_reason(limit: int) -> str:
    """The reason ``skipped_rows`` names the examples ``data.overlong: drop`` left out under."""
    return f"longer than data.max_seq_length={limit} (data.overlong: drop)"


def special_text_note(stats: DataStats, policy: str) -> str | None:
    """What the data.special_tokens_in_text setting did to the examples that write a special token
    in their text, or None when none does."""
    if not stats.special_text:
        return None
    where = ", ".join(stats.special_text_rows[:3]) + (", ..." if stats.special_text > 3 else "")
    done = {"keep": "read as the tokens themselves (data.special_tokens_in_text: keep): a user's text can open a "
                    "turn; escape reads them as text, refuse refuses such rows",
            "escape": "read as text (data.special_tokens_in_text: escape)",
            "refuse": "refused (data.special_tokens_in_text: refuse): left out with data.on_invalid: skip, "
                      "else the preparation stops at the first"}[policy]
    return f"{stats.special_text} example(s) write the tokenizer's special tokens in their text ({where}): {done}"


def dropped_rows(stats: DataStats) -> str:
    """`` (file:row, file:row, ...)`` for the examples dropped as too long, or "" when none is named."""
    rows = stats.skipped_rows.get(dropped_reason(stats.max_seq_length), [])
    return f" ({', '.join(rows)}{', ...' if stats.dropped_overlong > len(rows) else ''})" if rows else ""
