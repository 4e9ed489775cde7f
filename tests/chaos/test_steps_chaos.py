"""Durable steps (ctx.step) under faults, on the sync chaos app's `durable` kind: kill -9 of busy
children during steps, and a child paused past its lease in a step that wakes after its run was
taken and tries to store the step. Every step's stored value written once, by the attempt whose
call returned it; the cheaper kill -9 alone is tests/process/test_steps_kill.py's. Both again with
async handlers (`await ctx.step`, four runs at once per child)."""

from __future__ import annotations

import functools

from tests.faults import scenarios
from tests.faults.scenarios import Chaos

ASYNC_APP = "tests.faults.chaosapp_async:app"


def test_kill_9_during_durable_steps(chaos: Chaos) -> None:
    scenarios.kill_9_during_durable_steps(chaos)


def test_sigstop_past_the_lease_during_durable_steps(chaos: Chaos) -> None:
    scenarios.sigstop_past_the_lease_during_durable_steps(chaos)


def _async(chaos: Chaos) -> Chaos:
    """The async app, its pool wide enough for four runs at once each holding a fenced
    transaction's connection while its step's call logs on another (the default 3 would leave
    them all waiting for a connection)."""
    return functools.partial(chaos, app=ASYNC_APP, pool_size=8)


def test_kill_9_during_async_durable_steps(chaos: Chaos) -> None:
    scenarios.kill_9_during_durable_steps(_async(chaos))


def test_sigstop_past_the_lease_during_async_durable_steps(chaos: Chaos) -> None:
    scenarios.sigstop_past_the_lease_during_durable_steps(_async(chaos))
