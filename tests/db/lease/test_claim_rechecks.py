"""A batch claim re-checks each row that a claim committed after its snapshot took (Postgres'
EvalPlanQual, on the way to the row lock): what it re-checks must cost what a row costs. A call of
leasework.due_priority in the range's condition ran again per such row, each walking the kind's
index from its head: two workers draining a batch kind made one claim run for 60 s."""

from __future__ import annotations

import threading
from typing import Any

import psycopg

from leasework import db
from leasework.leases import lease

from ...conftest import wait_for

Conn = psycopg.Connection[Any]
GATE = 774_211  # the advisory lock that holds the claim after its snapshot
CALLS = "leasework_test_due_calls"


def _count_and_gate(conn: Conn) -> str:
    """Wrap leasework.due_priority (the original kept under another name): each call counted in a
    sequence, and each waits while the gate is held. Returns the original's definition."""
    original = conn.execute(
        "SELECT pg_get_functiondef('leasework.due_priority(text, text)'::regprocedure)"
    ).fetchone()
    assert original is not None
    conn.execute(f"CREATE SEQUENCE IF NOT EXISTS {CALLS}")
    # The copy's name, and the parameters it qualifies with its name, renamed together.
    conn.execute(str(original[0]).replace("due_priority", "due_priority_counted_original"))
    conn.execute(
        f"""CREATE OR REPLACE FUNCTION leasework.due_priority(kind text, tenant text)
        RETURNS integer LANGUAGE plpgsql STABLE AS $$
        BEGIN
            PERFORM nextval('{CALLS}');
            PERFORM pg_advisory_lock_shared({GATE});
            PERFORM pg_advisory_unlock_shared({GATE});
            RETURN leasework.due_priority_counted_original(kind, tenant);
        END $$"""
    )
    return str(original[0])


def test_rows_taken_under_a_batch_claim_do_not_ask_the_due_priority_again(dsn: str) -> None:
    runs = 40
    with (
        psycopg.connect(dsn, autocommit=True) as admin,
        psycopg.connect(dsn, autocommit=True) as claimer,
        psycopg.connect(dsn, autocommit=True) as rival,
    ):
        db.migrate(admin)
        admin.execute("TRUNCATE leasework.runs")
        admin.execute(
            "INSERT INTO leasework.runs (kind, payload)"
            " SELECT 'recheck', '{}' FROM generate_series(1, %s)",
            (runs,),
        )
        original = _count_and_gate(admin)
        try:
            admin.execute(f"SELECT setval('{CALLS}', 1, false)")
            admin.execute("SELECT pg_advisory_lock(%s)", (GATE,))
            claimed: list[lease.Claim] = []
            errors: list[BaseException] = []

            def claim() -> None:
                try:
                    claimed.extend(
                        lease.claim_runs(claimer, ["recheck"], worker="w", lease=60, limit=runs)
                    )
                except BaseException as exc:  # reported by the assertion below
                    errors.append(exc)

            thread = threading.Thread(target=claim)
            thread.start()
            pid = claimer.info.backend_pid

            def held_at_the_gate() -> bool:
                row = admin.execute(
                    "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
                ).fetchone()
                return row is not None and row[0] == "Lock"

            wait_for(held_at_the_gate, timeout=30)
            # Another worker takes every run and commits, after the claim's snapshot.
            taken = rival.execute(
                "UPDATE leasework.runs SET status = 'running', attempts = attempts + 1,"
                " lease_owner = gen_random_uuid(), lease_worker = 'rival',"
                " lease_expires_at = now() + interval '60 seconds', started_at = now()"
                " WHERE kind = 'recheck'"
            ).rowcount
            assert taken == runs
            admin.execute("SELECT pg_advisory_unlock(%s)", (GATE,))
            thread.join(60)
            assert not thread.is_alive() and not errors, errors
            assert claimed == []  # every row re-checked, and found taken
            calls = admin.execute(f"SELECT last_value FROM {CALLS}").fetchone()
            assert calls is not None
            # Asked once for the one kind (at most once more, before the gate), not once per row.
            assert int(calls[0]) <= 2, f"due_priority called {calls[0]} times for {runs} rows"
        finally:
            admin.execute("SELECT pg_advisory_unlock_all()")
            admin.execute(original)
            admin.execute(
                "DROP FUNCTION IF EXISTS leasework.due_priority_counted_original(text, text)"
            )
            admin.execute(f"DROP SEQUENCE IF EXISTS {CALLS}")
            admin.execute("TRUNCATE leasework.runs")
