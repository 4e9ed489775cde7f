"""The fault scenarios that take seconds (tests/faults/scenarios.py), on the sync chaos app
(tests/faults/chaosapp.py): one fault at a time on a real supervisor with three children and a
private Postgres, every invariant checked over the recorded history. The long ones (Postgres
crashed or paused, the supervisor signalled) are tests/chaos/test_sync_faults.py's."""

from __future__ import annotations

import pytest

from tests.faults import scenarios
from tests.faults.scenarios import POINTS, Chaos


def test_fault_free_control_run_executes_each_run_exactly_once(chaos: Chaos) -> None:
    scenarios.fault_free_control_run_executes_each_run_exactly_once(chaos)


def test_kill_9_of_random_children_at_random_moments(chaos: Chaos) -> None:
    scenarios.kill_9_of_random_children_at_random_moments(chaos)


@pytest.mark.parametrize("point", POINTS)
def test_kill_9_at_a_critical_point(chaos: Chaos, point: str) -> None:
    scenarios.kill_9_at_a_critical_point(chaos, point)


def test_kill_9_right_after_the_finish_commits(chaos: Chaos) -> None:
    scenarios.kill_9_right_after_the_finish_commits(chaos)


def test_sigstop_past_the_lease_then_sigcont(chaos: Chaos) -> None:
    scenarios.sigstop_past_the_lease_then_sigcont(chaos)


def test_blackholed_child_is_stopped_before_its_lease_expires(chaos: Chaos) -> None:
    scenarios.blackholed_child_is_stopped_before_its_lease_expires(chaos)


def test_a_partition_inside_a_fenced_transaction_does_not_hold_the_run(chaos: Chaos) -> None:
    scenarios.a_partition_inside_a_fenced_transaction_does_not_hold_the_run(chaos)


def test_pg_terminate_backend_of_worker_sessions(chaos: Chaos) -> None:
    scenarios.pg_terminate_backend_of_worker_sessions(chaos)


def test_poison_job_ends_failed_while_others_flow(chaos: Chaos) -> None:
    scenarios.poison_job_ends_failed_while_others_flow(chaos)


def test_cancels_race_reclaims_and_retries(chaos: Chaos) -> None:
    scenarios.cancels_race_reclaims_and_retries(chaos)


def test_kill_9_during_a_workflow(chaos: Chaos) -> None:
    scenarios.kill_9_during_a_workflow(chaos, kills=2)
