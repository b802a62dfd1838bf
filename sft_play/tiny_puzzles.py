"""The embedded default's letter puzzles: reverse, upper-case or sort a short sequence of letters,
or name the letter that follows one. ``scripts/build_tiny_default.py`` draws the dataset from
these; ``bench/tiny_recipes.py`` draws fresh puzzles from them to score a recipe."""

from __future__ import annotations

import random
import string

LETTERS = string.ascii_lowercase

# The puzzles on a sequence of letters: the word that starts the question, and the answer
ANSWERS = {"Reverse": lambda seq: list(reversed(seq)), "Uppercase": lambda seq: [c.upper() for c in seq],
           "Sort": sorted}


def letters(rng: random.Random, low: int = 3, high: int = 6) -> list[str]:
    return [rng.choice(LETTERS) for _ in range(rng.randint(low, high))]


def repeating_letters(rng: random.Random) -> list[str]:
    """Letters as :func:`letters` draws them, drawn again until one repeats."""
    seq = letters(rng)
    while len(set(seq)) == len(seq):
        seq = letters(rng)
    return seq


def puzzle(kind: str, seq: list[str]) -> tuple[str, str]:
    """The (question, answer) of puzzle `kind` (one of :data:`ANSWERS`) on `seq`."""
    return f"{kind} the letters: {' '.join(seq)}", " ".join(ANSWERS[kind](seq))


def task(rng: random.Random) -> tuple[str, str]:
    """One (question, answer) pair from a randomly chosen puzzle."""
    kind = rng.choice([*ANSWERS, "Which"])
    if kind in ANSWERS:
        return puzzle(kind, letters(rng))
    letter = rng.choice(LETTERS[:-1])
    return f"Which letter comes after {letter}?", LETTERS[LETTERS.index(letter) + 1]
