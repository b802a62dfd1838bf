"""The resource-aware planner: before any weight loads, decide the micro-batch and accumulation
that reach the configured global batch as fast as possible without running out of memory on
any GPU, and say why. An index of the package:

  shapes.py     exact parameter counts and tensor sizes on the meta device
  trace.py      one decoder layer's allocations, traced on the meta device
  allocator.py  PyTorch's CUDA caching allocator, simulated
  step.py       training steps replayed through the allocator
  memory.py     the state a GPU holds whatever the batch, term by term
  predict.py    the peak of one GPU at a micro-batch (trace + replay + what lies outside)
  choose.py     budget, micro-batch, accumulation (arithmetic)
  search.py     which micro-batches fit the budget (monotone), and the peak reported
  plan.py       make_plan: the plan, its candidates, and the hardware it is for
  remedies.py   what to change when nothing fits, and the smallest hardware that would do
  calibrate.py  the same plan from measured peaks (GPU only)
  disk.py       checkpoint and model sizes on disk
  report.py     table, JSON, plot

``scripts/plan.py`` and the training entry call :func:`make_plan`.
"""

from sft_play.planner.plan import Plan, Target, make_plan, peak_at, resolve_for, target_for
from sft_play.planner.shapes import model_shape

__all__ = ["Plan", "Target", "make_plan", "model_shape", "peak_at", "resolve_for", "target_for"]
