"""The longest rows a config trains on the given hardware, and with which settings
(``make plan LONGEST=1``).

The remedies that make long rows fit (:data:`.remedies.LEVERS`; on several GPUs,
ZeRO first) are added one at a time, cheapest first, each on top of the ones before. For each
set, the longest length of the ladder (:func:`ladder`, four lengths an octave, 1,024 to 16M
tokens) at which one row per GPU fits: found an octave at a time, then by bisection within the
octave, each length planned exactly as the run would plan it (the same replay, and the shorter
rows' envelope). Lengths past the model's trained positions are flagged, not refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sft_play.config import RunConfig
from sft_play.config.schema import consistency_problems
from sft_play.parallelism import Strategy
from sft_play.planner import progress
from sft_play.planner.choose import search
from sft_play.planner.choose.remedies import Remedy, command, long_row_levers, plan_command, with_overrides

SHORTEST, LONGEST = 1024, 16 << 20
# Plans a config on a target without remedies (make_plan, partially applied)
PlanFor = Callable[[RunConfig, Any], Any]


def ladder(shortest: int = SHORTEST, longest: int = LONGEST) -> list[int]:
    """Four lengths an octave: 1024, 1280, 1536, 1792, 2048, 2560 ...: the plans' own ladder
    (:func:`sft_play.planner.choose.search.ladder`), whose shorter lengths each plan covers, so
    that a length fits only where every shorter one does and the bisection is sound."""
    return search.ladder(longest, shortest)


def _with(config: RunConfig, overrides: tuple[str, ...], tokens: int, world: int) -> RunConfig:
    changed = with_overrides(config, overrides)
    changed.data.max_seq_length = tokens
    split = changed.distributed.sequence_parallel
    changed.train.global_batch_size = world // split if isinstance(split, int) else world  # one row per GPU, or per group
    changed.train.micro_batch_size = 1
    changed.train.gradient_accumulation_steps = 1
    return changed


def longest_rows(config: RunConfig, target: Any, plan_for: PlanFor, max_positions: int = 0,
                 config_path: str | None = None, user_overrides: tuple[str, ...] = (),
                 split: int = 1) -> list[dict[str, Any]]:
    """For the config as it is, then with each lever added to the ones before: the longest length
    of the ladder at which one row per GPU (split: per group of `split` GPUs) fits (0: not even the
    shortest), the next length (which does not fit), the peak at the longest, and the command that
    trains it."""
    lengths = ladder()
    answers, applied = [], ()
    for name, overrides in [("as configured", ()), *((r.name, r.overrides) for r in long_row_levers(config, target, split))]:
        applied = applied + overrides
        if consistency_problems(_with(config, applied, SHORTEST, target.world_size), target.world_size,
                                not target.on_cuda):
            applied = applied[:len(applied) - len(overrides)]
            continue
        plans: dict[int, Any] = {}

        def fits(index: int) -> bool:
            if index not in plans:
                with progress.doing(f"longest rows on {target.device_name}, {name}: {lengths[index]:,} tokens"):
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
            answer["command"] = command([levers], target, [*changes, *length_overrides(answer)], config_path,
                                        user_overrides)
        answers.append(answer)
    return answers


def length_overrides(answer: dict[str, Any]) -> list[str]:
    """The answer's length as a run sets it: past the model's trained positions, saying that is meant
    (a run refuses such rows otherwise)."""
    return [f"data.max_seq_length={answer['tokens']}",
            *(["data.beyond_model_positions=true"] if answer["beyond_positions"] else [])]


def describe(answers: list[dict[str, Any]], target: Any, max_positions: int = 0, config_path: str | None = None,
             user_overrides: tuple[str, ...] = (), hardware: str = "") -> list[str]:
    """The answers as the plan prints them, each that fits with the command that trains it and the
    ``make plan`` that plans it at that length (`hardware`: the variables that described the GPUs,
    as :func:`sft_play.planner.choose.remedies.plan_command` takes them)."""
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
        planned = plan_command([], target, [*answer["change"], *length_overrides(answer)], config_path, user_overrides,
                               hardware)
        lines += [f"      run:  {answer['command']}", f"      plan: {planned}"]
    return lines
