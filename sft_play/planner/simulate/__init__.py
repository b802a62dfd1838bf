"""Simulating a run's memory and time, with no GPU: every byte and second the planner predicts.

  shapes.py     exact parameter counts and tensor sizes on the meta device
  trace.py      one decoder layer's allocations, traced on the meta device
  cache.py      shapes and traces kept on disk, keyed by the code that made them
  memory.py     the state a GPU holds whatever the batch: every byte formula, term by term
  allocator.py  PyTorch's CUDA caching allocator, simulated
  step.py       training steps replayed through the allocator
  predict.py    the peak of one GPU at a micro-batch (trace + replay + what lies outside)
  timing.py     seconds per step and for the run
  disk.py       checkpoint and model sizes on disk
"""
