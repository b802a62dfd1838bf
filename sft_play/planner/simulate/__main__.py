"""``python -m sft_play.planner.simulate``: compile the planner's allocator replay and keep it on
disk (:func:`sft_play.planner.simulate.compiled.compile_ahead`). ``make install`` runs it after
byte-compiling the Python, so that the first plan compiles nothing; without numba it does nothing."""

from sft_play.planner.simulate.compiled import compile_ahead

compile_ahead()
