"""Faults during a workflow (tests/faults/scenarios.py, docs/workflows.md): kill -9 of busy
children (at random moments, and right after a parent's seal) and a SIGSTOP past the lease
while a graph and a batch run. The quick variant is tests/process/test_faults.py's."""

from __future__ import annotations

from tests.faults import scenarios
from tests.faults.scenarios import Chaos


def test_kill_9_during_a_workflow(chaos: Chaos) -> None:
    scenarios.kill_9_during_a_workflow(chaos, kills=6)


def test_sigstop_during_a_batch_join(chaos: Chaos) -> None:
    scenarios.sigstop_during_a_batch_join(chaos)


def test_kill_9_right_after_a_parents_seal(chaos: Chaos) -> None:
    scenarios.kill_9_right_after_a_parents_seal(chaos, kills=4)
