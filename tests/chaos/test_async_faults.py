"""The fault tests of test_faults.py again, with async children (tests/chaos/chaosapp_async.py:
each child runs up to four runs at once on its event loop, and no handler ever awaits
ctx.check()). A kill -9 takes every run in flight on the child with it; a SIGSTOP freezes them
all; a cancel, a timeout or a shutdown reaches a run only by its task being cancelled. The same
invariants hold over the recorded history: no overlapping attempts, no stale effect, nothing
lost."""

from __future__ import annotations

import pytest

from .test_faults import (
    test_blackholed_child_is_stopped_before_its_lease_expires,
    test_cancels_race_reclaims_and_retries,
    test_fault_free_control_run_executes_each_run_exactly_once,
    test_kill_9_at_a_critical_point,
    test_kill_9_of_random_children_at_random_moments,
    test_kill_9_right_after_the_finish_commits,
    test_pg_terminate_backend_of_worker_sessions,
    test_poison_job_ends_failed_while_others_flow,
    test_postgres_crash_and_restart_mid_run,
    test_postgres_paused_past_the_lease,
    test_sigstop_past_the_lease_then_sigcont,
    test_supervisor_sigterm_and_kill_9_mid_job,
)

pytestmark = pytest.mark.chaos

# The chaos fixture (conftest.py) runs this module's supervisors with the async app.
CHAOS_APP = "tests.chaos.chaosapp_async:app"

__all__ = [
    "test_blackholed_child_is_stopped_before_its_lease_expires",
    "test_cancels_race_reclaims_and_retries",
    "test_fault_free_control_run_executes_each_run_exactly_once",
    "test_kill_9_at_a_critical_point",
    "test_kill_9_of_random_children_at_random_moments",
    "test_kill_9_right_after_the_finish_commits",
    "test_pg_terminate_backend_of_worker_sessions",
    "test_poison_job_ends_failed_while_others_flow",
    "test_postgres_crash_and_restart_mid_run",
    "test_postgres_paused_past_the_lease",
    "test_sigstop_past_the_lease_then_sigcont",
    "test_supervisor_sigterm_and_kill_9_mid_job",
]
