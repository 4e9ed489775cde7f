"""The demo's line for its cancelled run says what happened, with numbers that agree: the steps
its partial result says were done, and its last checkpoint, told apart (before, "cancelled at
30/200, partial result kept: {"done":34}" read like a bug)."""

from __future__ import annotations

from leasework.demo import slow_outcome


def test_the_cancelled_runs_line_tells_steps_done_from_its_checkpoint() -> None:
    row = {"status": "cancelled", "processed_units": 30, "total_units": 200, "result": {"done": 34}}
    line = slow_outcome(row)
    assert line.startswith("cancelled after 34 of 200 steps")
    assert "last checkpoint: step 30" in line
    assert 'partial result kept: {"done":34}' in line
    assert "30/200" not in line


def test_a_run_cancelled_before_its_first_step_or_checkpoint() -> None:
    line = slow_outcome({"status": "cancelled", "processed_units": None, "total_units": None,
                         "result": None})
    assert line == "cancelled after ? of ? steps; partial result kept: null"
