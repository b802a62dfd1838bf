"""The longest rows a config trains on the given hardware, and with which settings
(``make plan LONGEST=1``).

The levers that make long rows fit are added one at a time, cheapest first, each on top of the
ones before (:data:`LEVERS`; on several GPUs, sharding the parameters first): for each set, the
longest row of the length ladder (:func:`ladder`, four lengths an octave, 1,024 to 16M tokens)
at which one row per GPU fits, found an octave at a time then by bisection on the ladder, and
planned exactly as the run would plan it (the same replay, and the shorter rows' envelope). Where the levers stop helping,
the answer says so; lengths past the model's trained positions are flagged, not refused.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from sft_play.config import RunConfig, parse_override
from sft_play.config.schema import consistency_problems
from sft_play.parallelism import Strategy
from sft_play.planner.choose.remedies import Remedy, command

SHORTEST, LONGEST = 1024, 16 << 20
# Plans a config on a target without remedies (make_plan, partially applied)
PlanFor = Callable[[RunConfig, Any], Any]


def ladder(shortest: int = SHORTEST, longest: int = LONGEST) -> list[int]:
    """Four lengths an octave: 1024, 1280, 1536, 1792, 2048, 2560 ... (multiples of 256 throughout)."""
    lengths, octave = [], shortest
    while octave <= longest:
        lengths += [octave * quarters // 4 for quarters in (4, 5, 6, 7) if octave * quarters // 4 <= longest]
        octave *= 2
    return lengths


def _levers(config: RunConfig, target: Any) -> list[tuple[str, tuple[str, ...]]]:
    """(name, overrides) of each lever that applies, cheapest first."""
    levers: list[tuple[str, tuple[str, ...]]] = []
    if target.world_size > 1 and config.distributed.strategy in ("ddp", "deepspeed_zero2"):
        stage = "deepspeed_zero2" if config.finetune.method == "qlora" else "deepspeed_zero3"
        if stage != config.distributed.strategy:
            levers.append(("ZeRO sharding", (f"distributed.strategy={stage}",)))
    if not config.train.gradient_checkpointing:
        levers.append(("gradient checkpointing", ("train.gradient_checkpointing=true",)))
    if target.on_cuda and config.model.attn_implementation in ("auto", "sdpa"):
        levers.append(("FlashAttention-2", ("model.attn_implementation=flash_attention_2",)))
    zero = Strategy(config.distributed.strategy).deepspeed or any(name == "ZeRO sharding" for name, _ in levers)
    if not config.train.tiled_mlp and (target.world_size == 1 or zero):  # one process, or ZeRO (sft_play.long_rows)
        levers.append(("tiled MLP", ("train.tiled_mlp=true", "lora.dropout=0")))
    if not config.train.offload_activations:
        levers.append(("activation offload", ("train.gradient_checkpointing=true", "train.offload_activations=true")))
    return levers


def _with(config: RunConfig, overrides: tuple[str, ...], tokens: int, world: int) -> RunConfig:
    changed = copy.deepcopy(config)
    for text in overrides:
        key, value = parse_override(text)
        section, attribute = key.split(".")
        setattr(getattr(changed, section), attribute, value)
    changed.data.max_seq_length = tokens
    changed.train.global_batch_size = world  # one row per GPU
    changed.train.micro_batch_size = 1
    changed.train.gradient_accumulation_steps = 1
    return changed


def longest_rows(config: RunConfig, target: Any, plan_for: PlanFor, max_positions: int = 0,
                 config_path: str | None = None, user_overrides: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """For the config as it is, then with each lever added to the ones before: the longest length
    of the ladder at which one row per GPU fits (0: not even the shortest), the next length (which
    does not fit), the peak at the longest, and the command that trains it."""
    lengths = ladder()
    answers, applied = [], ()
    for name, overrides in [("as configured", ()), *_levers(config, target)]:
        applied = applied + overrides
        if consistency_problems(_with(config, applied, SHORTEST, target.world_size)):
            applied = applied[:len(applied) - len(overrides)]
            continue
        plans: dict[int, Any] = {}

        def fits(index: int) -> bool:
            if index not in plans:
                plans[index] = plan_for(_with(config, applied, lengths[index], target.world_size), target)
            return bool(plans[index].fits)

        # an octave at a time from the shortest (a plan at a length far beyond the answer is the
        # slowest to make), then bisection within the octave that stopped fitting
        low, high = -1, len(lengths)  # the longest fitting index is in [low, high)
        probe = 0
        while probe < len(lengths) and fits(probe):
            low, probe = probe, probe + 4
        high = min(probe, len(lengths))
        while high - low > 1:
            middle = (low + high) // 2
            if fits(middle):
                low = middle
            else:
                high = middle
        tokens = lengths[low] if low >= 0 else 0
        changes = sorted(dict((o.split("=", 1)[0], o) for o in applied).values())
        answer = {
            "settings": name if not answers else f"+ {name}",
            "change": changes,
            "tokens": tokens,
            "next_tokens": lengths[high] if high < len(lengths) else None,
            "peak_bytes": plans[low].peak_bytes_per_gpu if low >= 0 else None,
            "host_bytes_per_node": plans[low].host_bytes_per_node if low >= 0 else 0,
            "beyond_positions": bool(max_positions and tokens > max_positions),
            "command": None,
        }
        if tokens:
            strategy = next((o.split("=", 1)[1] for o in reversed(applied) if o.startswith("distributed.strategy=")),
                            config.distributed.strategy)
            make_target = Strategy(strategy).make_target if Strategy(strategy).shards_states else "train"
            levers = Remedy(name, "", applied, make_target, lambda c, t: True)
            answer["command"] = command([levers], target, [*changes, f"data.max_seq_length={tokens}"], config_path,
                                        user_overrides)
        answers.append(answer)
    return answers


def describe(answers: list[dict[str, Any]], target: Any, max_positions: int = 0) -> list[str]:
    """The answers as the plan prints them."""
    gib = 1 << 30
    lines = [f"Longest rows on {target.device_name}, one row per GPU (each set adds its lever to those above):"]
    for answer in answers:
        if not answer["tokens"]:
            lines.append(f"  {answer['settings']:<28} not even {SHORTEST:,} tokens fit")
            continue
        beyond = f" (past the model's {max_positions:,} positions)" if answer["beyond_positions"] else ""
        host = (f"; {answer['host_bytes_per_node'] / gib:.1f} GiB of host memory per node"
                if answer["host_bytes_per_node"] else "")
        nxt = f", {answer['next_tokens']:,} does not" if answer["next_tokens"] else ""
        lines.append(f"  {answer['settings']:<28} {answer['tokens']:>11,} tokens{beyond} at "
                     f"{answer['peak_bytes'] / gib:.1f} GiB{nxt}{host}")
    best = max(answers, key=lambda a: a["tokens"])
    if best["tokens"]:
        lines.append(f"  run: {best['command']}")
    return lines
