"""The chaos tier's faults again, with every child and the supervisor reaching Postgres through a
PgBouncer in transaction mode (tests/pgbouncer.py) behind the fault proxy: no prepared statement,
no session state and no LISTEN may be relied on, a server session serves whichever client comes
next, and a terminated or crashed server session is the pooler's to replace. Every invariant of
the harness (and, for the blocking calls, the attempt oracle) must still hold. One CHAOS line per
test, marked `via=pgbouncer`."""

from __future__ import annotations

import functools
import signal
from collections.abc import Callable

import pytest

from tests.faults import scenarios as faults
from tests.faults.scenarios import Chaos

from . import test_noncooperative as noncoop
from .test_noncooperative import NonCoopRun, nc  # noqa: F401 - the fixture

FAULTS: dict[str, Callable[[Chaos], None]] = {
    "control": faults.fault_free_control_run_executes_each_run_exactly_once,
    "kill9_random": faults.kill_9_of_random_children_at_random_moments,
    "kill9_after_claim": lambda c: faults.kill_9_at_a_critical_point(c, "after_claim"),
    "kill9_before_checkpoint": lambda c: faults.kill_9_at_a_critical_point(c, "before_checkpoint"),
    "kill9_after_finish": faults.kill_9_right_after_the_finish_commits,
    "sigstop_past_lease": faults.sigstop_past_the_lease_then_sigcont,
    "blackhole": faults.blackholed_child_is_stopped_before_its_lease_expires,
    "partition_in_tx": faults.a_partition_inside_a_fenced_transaction_does_not_hold_the_run,
    "terminate_backend": faults.pg_terminate_backend_of_worker_sessions,
    "pg_crash_restart": faults.postgres_crash_and_restart_mid_run,
    "pg_paused": faults.postgres_paused_past_the_lease,
    "supervisor_signals": faults.supervisor_sigterm_and_kill_9_mid_job,
    "poison": faults.poison_job_ends_failed_while_others_flow,
    "cancels": faults.cancels_race_reclaims_and_retries,
}

BLOCKING: dict[str, Callable[[Callable[..., NonCoopRun]], None]] = {
    "kill9_blocked": noncoop.test_kill_9_of_a_child_blocked_in_each_call,
    "cancel_blocked": noncoop.test_cancel_of_each_blocking_call,
    "timeout_blocked": noncoop.test_timeout_of_each_blocking_call,
    "supervisor_kill9_blocked": lambda make: (
        noncoop.test_the_supervisor_signalled_mid_blocking_calls(make, signal.SIGKILL)
    ),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault_through_pgbouncer(chaos: Chaos, fault: str) -> None:
    FAULTS[fault](functools.partial(chaos, through_pooler=True))


@pytest.mark.parametrize("fault", list(BLOCKING))
def test_blocking_fault_through_pgbouncer(
    nc: Callable[..., NonCoopRun],  # noqa: F811 - the fixture
    fault: str,
) -> None:
    BLOCKING[fault](functools.partial(nc, through_pooler=True))
