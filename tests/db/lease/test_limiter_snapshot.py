"""The claim's limiter re-check reads a fresh snapshot: leasework.limiter_conflict sees a rival
claim that committed while the calling statement was already running, which that statement's own
snapshot cannot. This is what lets claim_runs stay one autocommit statement without the narrow
race between its snapshot and its tenant lock."""

from __future__ import annotations

import threading
from typing import Any

import psycopg

from ...conftest import wait_for
from ..checks import make_app

Conn = psycopg.Connection[Any]

GATE = 74207  # an advisory lock key the statement under test waits on, mid-statement

# The statement's snapshot is taken before the gate; both checks run after it.
CHECK = """
WITH gate AS MATERIALIZED (SELECT pg_advisory_xact_lock_shared(%(gate)s) AS g)
SELECT leasework.limiter_conflict(%(run)s) AS fresh,
       EXISTS (SELECT 1 FROM leasework.runs o
                WHERE o.id = %(rival)s AND o.status = 'running') AS stale
  FROM gate
"""


def test_limiter_conflict_sees_a_claim_committed_mid_statement(conn: Conn, dsn: str) -> None:
    app = make_app()
    ours = app.enqueue(conn, "job", tenant="ws-1", group="g")
    rival = app.enqueue(conn, "job", tenant="ws-1", group="g")
    with (
        psycopg.connect(dsn, autocommit=True) as holder,
        psycopg.connect(dsn, autocommit=True) as checker,
    ):
        holder.execute("SELECT pg_advisory_lock(%s)", (GATE,))
        result: list[Any] = []
        t = threading.Thread(
            target=lambda: result.append(
                checker.execute(CHECK, {"gate": GATE, "run": ours, "rival": rival}).fetchone()
            ),
            daemon=True,
        )
        t.start()
        pid = checker.info.backend_pid
        wait_for(
            lambda: (
                conn.execute(
                    "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s", (pid,)
                ).fetchone()
                == (True,)
            )
        )
        # A rival worker's claim of the same tenant's run commits while the check waits.
        conn.execute(
            "UPDATE leasework.runs SET status = 'running', attempts = 1,"
            " lease_owner = gen_random_uuid(), lease_worker = 'rival',"
            " lease_expires_at = leasework.now() + interval '30 seconds',"
            " started_at = leasework.now() WHERE id = %s",
            (rival,),
        )
        holder.execute("SELECT pg_advisory_unlock(%s)", (GATE,))
        t.join(10)
        assert not t.is_alive()
    assert result == [(True, False)], "the re-check must see the rival the snapshot cannot"


def test_limiter_conflict_ignores_other_groups_and_dead_leases(conn: Conn) -> None:
    app = make_app()
    ours = app.enqueue(conn, "job", tenant="ws-1", group="g1")
    other = app.enqueue(conn, "job", tenant="ws-1", group="g2")
    conn.execute(
        "UPDATE leasework.runs SET status = 'running', attempts = 1,"
        " lease_owner = gen_random_uuid(), started_at = leasework.now(),"
        " lease_expires_at = leasework.now() + interval '30 seconds' WHERE id = %s",
        (other,),
    )

    def conflict() -> bool:
        row = conn.execute("SELECT leasework.limiter_conflict(%s)", (ours,)).fetchone()
        assert row is not None
        return bool(row[0])

    assert not conflict()  # different group, neither exclusive
    conn.execute("UPDATE leasework.runs SET exclusive = true WHERE id = %s", (other,))
    assert conflict()
    conn.execute(
        "UPDATE leasework.runs SET lease_expires_at = leasework.now() - interval '1 second'"
        " WHERE id = %s",
        (other,),
    )
    assert not conflict()  # an expired lease limits nobody
