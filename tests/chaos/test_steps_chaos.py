"""Durable steps (ctx.step) under faults, on the sync chaos app's `durable` kind: kill -9 of busy
children during steps, and a child paused past its lease in a step that wakes after its run was
taken and tries to store the step. Every step's stored value written once, by the attempt whose
call returned it; the cheaper kill -9 alone is tests/process/test_steps_kill.py's."""

from __future__ import annotations

from tests.faults import scenarios
from tests.faults.scenarios import Chaos


def test_kill_9_during_durable_steps(chaos: Chaos) -> None:
    scenarios.kill_9_during_durable_steps(chaos)


def test_sigstop_past_the_lease_during_durable_steps(chaos: Chaos) -> None:
    scenarios.sigstop_past_the_lease_during_durable_steps(chaos)
