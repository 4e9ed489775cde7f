"""An async child holding ten runs is stopped (SIGSTOP) under a real supervisor: the watchdog
kills it before the first of its leases expires, its parent releases every run at once (a
`crashed` entry, not a lease expiry), and each is done exactly once in the end. The test app,
its fixtures and helpers are tests/process/test_async_supervisor.py's.

Timings are short through the config file (lease 6 s); tests wait on conditions with deadlines."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from tests.conftest import wait_for
from tests.process.conftest import Supervised, app_dir, pconn  # noqa: F401 - the fixtures
from tests.process.test_async_supervisor import (
    Conn,
    enqueue_all,
    finish_all,
    held_by,
    outcomes,
    start,
)


# In the chaos tier (`make chaos`), not `make test`: the watchdog stopping an async child with
# several runs in flight that no longer renews, before its lease expires, and those runs then done
# exactly once, is what tests/chaos/test_async_faults.py's
# test_blackholed_child_is_stopped_before_its_lease_expires checks (there its renewals hang; here
# the child is frozen); tests/process/test_supervisor.py's watchdog test stops a sync child so in
# `make test`.
def test_sigstop_of_a_child_with_ten_runs_is_caught_by_the_watchdog(
    app_dir: Path,  # noqa: F811 - the fixture
    dsn: str,
    pconn: Conn,  # noqa: F811 - the fixture
) -> None:
    started: list[Supervised] = []
    try:
        sup = start(app_dir, dsn, started, processes=1)
        [child] = sup.wait_children(1)
        ids = enqueue_all(pconn)
        wait_for(lambda: held_by(pconn, ids, 1), timeout=30)
        os.kill(child, signal.SIGSTOP)
        # Frozen, the child renews nothing more: its leases end where they stand now.
        row = pconn.execute(
            "SELECT extract(epoch FROM min(lease_expires_at)) FROM leasework.runs"
            " WHERE id = ANY(%s)",
            (ids,),
        ).fetchone()
        assert row is not None
        killed = sup.wait_event("child_killed_by_watchdog", lambda e: e["pid"] == child, 30)
        assert killed["reason"] == "lease", killed
        assert killed["ts"] < float(row[0]), "killed after the first of its leases expired"
        wait_for(lambda: held_by(pconn, ids, 2), timeout=30)
        assert all(o[:1] == ["crashed"] for o in outcomes(pconn, ids)), outcomes(pconn, ids)
        finish_all(pconn, app_dir, ids)
    finally:
        for s in started:
            s.stop()
