"""The resource-aware planner: before any weight loads, decide the micro-batch and accumulation
that reach the configured global batch as fast as possible without running out of memory on
any GPU, and say why. In three steps, each a package:

  simulate/   what a run holds and takes, with no GPU: exact shapes, a traced layer, every byte
              formula (memory.py), the caching allocator replayed, seconds, disk
  choose/     what fits and the split to train at; remedies when nothing fits; calibration
  present/    the plan's notes in words; table, JSON, plot
  target.py   the hardware a plan is for (detected or described)
  plan.py     make_plan: simulate -> choose -> present

``scripts/plan.py`` and the training entry call :func:`make_plan`.
"""

from sft_play.planner.plan import QUICK, WITHOUT_REMEDIES, Plan, PlanOptions, make_plan, peak_at, resolve_for
from sft_play.planner.simulate.shapes import model_shape
from sft_play.planner.target import Target, target_for

__all__ = ["QUICK", "WITHOUT_REMEDIES", "Plan", "PlanOptions", "Target", "make_plan", "model_shape", "peak_at", "resolve_for",
           "target_for"]
