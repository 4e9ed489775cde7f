"""The fault scenarios (tests/faults/scenarios.py) again, with async children
(tests/faults/chaosapp_async.py: each child runs up to four runs at once on its event loop, and
no handler ever awaits ctx.check()). A kill -9 takes every run in flight on the child with it; a
SIGSTOP freezes them all; a cancel, a timeout or a shutdown reaches a run only by its task being
cancelled. The same invariants hold over the recorded history: no overlapping attempts, no stale
effect, nothing lost."""

from __future__ import annotations

import functools

import pytest

from tests.faults import scenarios
from tests.faults.scenarios import POINTS, Chaos

ASYNC_APP = "tests.faults.chaosapp_async:app"


@pytest.fixture
def achaos(chaos: Chaos) -> Chaos:
    """The chaos fixture with the async app for its supervisors."""
    return functools.partial(chaos, app=ASYNC_APP)


def test_fault_free_control_run_executes_each_run_exactly_once(achaos: Chaos) -> None:
    scenarios.fault_free_control_run_executes_each_run_exactly_once(achaos)


def test_kill_9_of_random_children_at_random_moments(achaos: Chaos) -> None:
    scenarios.kill_9_of_random_children_at_random_moments(achaos)


@pytest.mark.parametrize("point", POINTS)
def test_kill_9_at_a_critical_point(achaos: Chaos, point: str) -> None:
    scenarios.kill_9_at_a_critical_point(achaos, point)


def test_kill_9_right_after_the_finish_commits(achaos: Chaos) -> None:
    scenarios.kill_9_right_after_the_finish_commits(achaos)


def test_sigstop_past_the_lease_then_sigcont(achaos: Chaos) -> None:
    scenarios.sigstop_past_the_lease_then_sigcont(achaos)


def test_blackholed_child_is_stopped_before_its_lease_expires(achaos: Chaos) -> None:
    scenarios.blackholed_child_is_stopped_before_its_lease_expires(achaos)


def test_pg_terminate_backend_of_worker_sessions(achaos: Chaos) -> None:
    scenarios.pg_terminate_backend_of_worker_sessions(achaos)


def test_postgres_crash_and_restart_mid_run(achaos: Chaos) -> None:
    scenarios.postgres_crash_and_restart_mid_run(achaos)


def test_postgres_paused_past_the_lease(achaos: Chaos) -> None:
    scenarios.postgres_paused_past_the_lease(achaos)


def test_supervisor_sigterm_and_kill_9_mid_job(achaos: Chaos) -> None:
    scenarios.supervisor_sigterm_and_kill_9_mid_job(achaos)


def test_poison_job_ends_failed_while_others_flow(achaos: Chaos) -> None:
    scenarios.poison_job_ends_failed_while_others_flow(achaos)


def test_cancels_race_reclaims_and_retries(achaos: Chaos) -> None:
    scenarios.cancels_race_reclaims_and_retries(achaos)
