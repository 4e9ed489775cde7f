"""The long fault scenarios (tests/faults/scenarios.py) on the sync chaos app: Postgres crashed
and restarted, Postgres paused past the lease, the supervisor signalled mid-job. The fast ones
are tests/process/test_faults.py's (`make test`)."""

from __future__ import annotations

from tests.faults import scenarios
from tests.faults.scenarios import Chaos


def test_postgres_crash_and_restart_mid_run(chaos: Chaos) -> None:
    scenarios.postgres_crash_and_restart_mid_run(chaos)


def test_postgres_paused_past_the_lease(chaos: Chaos) -> None:
    scenarios.postgres_paused_past_the_lease(chaos)


def test_supervisor_sigterm_and_kill_9_mid_job(chaos: Chaos) -> None:
    scenarios.supervisor_sigterm_and_kill_9_mid_job(chaos)
