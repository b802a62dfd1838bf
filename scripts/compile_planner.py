"""Compile the planner's allocator replay (sft_play.planner.simulate.compiled) and keep it on disk:
`make install` runs this after byte-compiling the Python, so that the first plan compiles nothing.
Without numba it does nothing (replays then run through the Python allocator).

Usage: python scripts/compile_planner.py
"""

from __future__ import annotations

from sft_play.planner.simulate.compiled import compile_ahead

if __name__ == "__main__":
    compile_ahead()
