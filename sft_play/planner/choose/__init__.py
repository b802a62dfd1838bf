"""Choosing from the simulation: what fits, the batch split, and what to change when nothing does.

  split.py      the budget, the micro-batch and accumulation (arithmetic)
  search.py     which micro-batches fit the budget (monotone), and the peak reported
  remedies.py   what to change when nothing fits, and the smallest hardware that would do
  calibrate.py  the same choice from measured peaks (GPU only)
"""
