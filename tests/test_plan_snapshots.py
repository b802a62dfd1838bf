"""Plans of public configs say today what they said when their snapshot was taken
(tests/plan_snapshots.py): a change made for speed (the compiled replay, the predictions kept on
disk) changes no prediction. The suite plans the quicker cases; ``python tests/plan_snapshots.py``
plans every one (LONGEST and the remedy searches of large models among them), and
bench/planner_speed.py compares whole answers with an earlier commit's."""

from __future__ import annotations

import json

import pytest

from tests.plan_snapshots import CASES, SNAPSHOTS, canonical, snapshot

KEPT = json.loads(SNAPSHOTS.read_text())


@pytest.mark.parametrize("case", [c for c in CASES if c.quick], ids=lambda c: c.name)
def test_a_public_plan_is_what_its_snapshot_says(case):
    assert json.loads(canonical(snapshot(case))) == KEPT[case.name]


def test_every_case_has_a_snapshot():
    assert sorted(KEPT) == sorted(c.name for c in CASES)
