"""How long ``make plan`` takes to answer, this planner against an earlier one, in one run on one machine.

Each plan is ``scripts/plan.py`` in a fresh process, as ``make plan`` runs it: cold (an empty
planner cache: shapes, traces, compiled code and predictions all made) and then warm (the same
command again on that cache, as a user's next question is). The earlier planner is the same
repository at another commit (``--old``, default the last commit before the compiled replays),
checked out into a temporary folder and run with this machine's Python and packages; both plan
the same cases (tests/plan_snapshots.py: the five plans of issue 62, ``LONGEST=1`` for
Llama-3.1-8B LoRA on 1 x 80 and 8 x 80 GiB, ``sequence_parallel: auto`` at 1M tokens), and the
report says whether their answers are the same (the plans' JSON less the planning's own
seconds and replay counts; LONGEST's answers).

"planned" is the plan's own ``plan_seconds`` (from the config loaded to the plan made), "wall" the
process's, interpreter start to exit. The machine's other work is not controlled: the report
names the load average before and after.

Usage: python bench/planner_speed.py [--old COMMIT] [--only NAME ...] [--skip-old] [--out docs/reports/planner_speed.md]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO, REPORTS, versions  # bench/ is the script's folder

sys.path.insert(0, str(REPO))
from tests.plan_snapshots import CASES, Case  # noqa: E402

OLD = "c645d0c"  # the planner before the compiled replays and the kept predictions
UNSTABLE = ("plan_seconds", "plan_cpu_seconds", "replays")


def run_plan(root: Path, case: Case, cache: Path) -> dict:
    """One ``scripts/plan.py --json`` of `case` with the repository at `root`: wall seconds, the
    plan's own seconds, and its answer (less what measures the planning)."""
    env = {**os.environ, "SFT_PLAY_CACHE": str(cache), "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, str(root / "scripts" / "plan.py"), *case.make_args(), "--json"]
    started = time.perf_counter()
    result = subprocess.run(command, cwd=root, capture_output=True, text=True, env=env, timeout=3600)
    wall = time.perf_counter() - started
    if result.returncode not in (0, 3):  # 3: the plan does not fit
        return {"ok": False, "wall": wall, "error": (result.stderr.strip().splitlines() or ["?"])[-1][:200]}
    document = json.loads(result.stdout)
    planned = document.get("plan_seconds")
    answer = document if case.longest else {k: v for k, v in document.items() if k not in UNSTABLE}
    return {"ok": True, "wall": wall, "planned": planned, "answer": answer, "replays": document.get("replays")}


def checkout(commit: str, into: Path) -> Path:
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(into), commit], check=True,
                   capture_output=True, text=True)
    return into


def measure(root: Path, cases: list[Case], label: str) -> dict[str, dict]:
    results = {}
    for case in cases:
        with tempfile.TemporaryDirectory(prefix="planner-speed-") as cache:
            cold = run_plan(root, case, Path(cache))
            warm = run_plan(root, case, Path(cache))
        results[case.name] = {"cold": cold, "warm": warm}
        said = " ".join(f"{k} {v['wall']:.1f} s wall" + (f" ({v['planned']:.1f} s planned)" if v.get("planned") else "")
                        + ("" if v["ok"] else f" FAILED: {v['error']}") for k, v in results[case.name].items())
        print(f"{label:<4} {case.name:<28} {said}", flush=True)
    return results


def _seconds(result: dict | None, key: str) -> str:
    if result is None:
        return "not run"
    if not result["ok"]:
        return "failed"
    value = result.get(key)
    return f"{value:.1f}" if value is not None else "-"


def report(cases: list[Case], new: dict, old: dict | None, old_commit: str, load: tuple[str, str]) -> str:
    from sft_play import hardware

    facts = hardware.detect()
    generation = hardware.cpu_family_and_model()
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    lines = [
        "# How long the planner takes to answer",
        "",
        "Written by `python bench/planner_speed.py` (its docstring says how). Each figure is one fresh",
        "process of `scripts/plan.py --json` with the case's arguments (tests/plan_snapshots.py), cold on an",
        "empty planner cache, then warm on the same cache; seconds, \"planned\" the plan's own `plan_seconds`",
        "(LONGEST has none), \"wall\" the whole process with the interpreter's start and the imports.",
        "",
        f"- machine: {facts.cpu_model or 'unknown CPU'}{f' ({generation})' if generation else ''}, "
        f"{facts.cpu_usable_cores} usable cores, native bf16: {'yes' if facts.cpu_bf16 else 'no'}; no GPU (planning is CPU work)",
        f"- software: {versions()}",
        f"- this planner: commit {head} (and the working tree); the earlier one: commit {old_commit}",
        f"- load average (1 min) before: {load[0]}, after: {load[1]}",
        "",
        "| case | | cold wall | cold planned | warm wall | warm planned | same answer |",
        "|---|---|---|---|---|---|---|",
    ]
    for case in cases:
        for label, results in (("this", new), ("earlier", old)):
            if results is None:
                continue
            got = results.get(case.name)
            cold, warm = (got or {}).get("cold"), (got or {}).get("warm")
            same = ""
            if label == "earlier" and got and cold["ok"] and new[case.name]["cold"]["ok"]:
                same = "yes" if cold["answer"] == new[case.name]["cold"]["answer"] else "**no**"
            lines.append(f"| {case.name if label == 'this' else ''} | {label} | {_seconds(cold, 'wall')} | "
                         f"{_seconds(cold, 'planned')} | {_seconds(warm, 'wall')} | {_seconds(warm, 'planned')} | {same} |")
    left = [c.name for c in CASES if c not in cases]
    lines += ["", "Cold is an empty planner cache: the model's shape built on the meta device (with transformers'",
              "modeling code imported), its layers traced, every step replayed. numba's compiled replay is code, kept",
              "beside the source as Python's bytecode is, so it is compiled once per installed copy (about 5 s here),",
              "not per cold plan. The answers are compared as JSON documents, remedies and notes included: they",
              "differ wherever a commit after the earlier one changed what a plan says (each such commit names what",
              "changed, and tests/fixtures/plan_snapshots.json holds the answers as they are now)."]
    if left:
        lines += ["", f"Not timed in this run: {', '.join(left)}."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", default=OLD, help="the earlier planner's commit")
    parser.add_argument("--only", nargs="*", help="these cases only (tests/plan_snapshots.py names)")
    parser.add_argument("--skip-old", action="store_true", help="time this planner only")
    parser.add_argument("--out", type=Path, default=REPORTS / "planner_speed.md")
    args = parser.parse_args()
    default = ("llama8b-lora-1x80", "gemma9b-qlora-1x24", "mixtral-lora-8x80", "qwen14b-full-1x80",
               "llama70b-qlora-2x24", "llama8b-longest-1x80", "llama8b-longest-8x80", "llama8b-sp-auto-1m-8x80")
    cases = [c for c in CASES if c.name in (args.only or default)]
    if not cases:
        sys.exit(f"error: no case named {args.only}; tests/plan_snapshots.py lists them")
    before = f"{os.getloadavg()[0]:.2f}"
    new = measure(REPO, cases, "this")
    old = None
    if not args.skip_old:
        with tempfile.TemporaryDirectory(prefix="planner-old-") as folder:
            root = checkout(args.old, Path(folder) / "repo")
            try:
                old = measure(root, cases, "old")
            finally:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(root)], capture_output=True)
    args.out.write_text(report(cases, new, old, args.old, (before, f"{os.getloadavg()[0]:.2f}")))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
