"""Durable steps under kill -9 (tests/faults/scenarios.py, chaosapp's `durable`): every step's value
stored once, by the attempt whose call returned it, never called again afterwards, and a step's
effect inside a fenced transaction committed once, with its record. The SIGSTOP past the lease is
tests/chaos/test_steps_chaos.py's (`make chaos`)."""

from __future__ import annotations

from tests.faults import scenarios
from tests.faults.scenarios import Chaos


def test_kill_9_during_durable_steps(chaos: Chaos) -> None:
    scenarios.kill_9_during_durable_steps(chaos)
