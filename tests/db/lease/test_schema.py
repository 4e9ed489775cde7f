"""The schema itself refuses a row whose status and lease columns disagree (runs_state_valid, the
rule in leasework.run_state_valid), whatever the writing session's search_path."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from ..checks import (
    make_app,
)

Conn = psycopg.Connection[Any]

# Each write breaks one part of the rule, from a queued run.
BROKEN = [
    pytest.param("status = 'done'", id="unknown-status"),
    pytest.param("status = 'running'", id="running-without-lease"),
    pytest.param(
        "status = 'running', lease_owner = gen_random_uuid()", id="running-without-expiry"
    ),
    pytest.param(
        "lease_owner = gen_random_uuid(), lease_expires_at = now()", id="queued-with-lease"
    ),
    pytest.param("status = 'succeeded'", id="terminal-without-finished-at"),
    pytest.param("finished_at = now()", id="queued-with-finished-at"),
]


@pytest.mark.parametrize("assignment", BROKEN)
def test_status_invariants_are_enforced_by_the_schema(conn: Conn, assignment: str) -> None:
    run_id = make_app().enqueue(conn, "job")
    with pytest.raises(psycopg.errors.CheckViolation, match="runs_state_valid"):
        conn.execute(f"UPDATE leasework.runs SET {assignment} WHERE id = %s", (run_id,))


def test_the_rule_accepts_every_state_the_statements_write(conn: Conn) -> None:
    run_id = make_app().enqueue(conn, "job")
    conn.execute(
        "UPDATE leasework.runs SET status = 'running', lease_owner = gen_random_uuid(),"
        " lease_expires_at = now() WHERE id = %s",
        (run_id,),
    )
    for status in ("succeeded", "partial", "failed", "cancelled"):
        conn.execute(
            "UPDATE leasework.runs SET status = %s, lease_owner = NULL, lease_expires_at = NULL,"
            " finished_at = now() WHERE id = %s",
            (status, run_id),
        )
    for status in ("waiting", "queued"):
        conn.execute(
            "UPDATE leasework.runs SET status = %s, finished_at = NULL WHERE id = %s",
            (status, run_id),
        )


def test_an_operator_of_the_sessions_own_does_not_bend_the_rule(dsn: str, conn: Conn) -> None:
    # The rule is PL/pgSQL, whose operators are looked up by the search_path of the session that
    # first runs it: a session that puts its own `=` first must still meet the real one.
    run_id = make_app().enqueue(conn, "job")
    conn.execute("DROP SCHEMA IF EXISTS bend CASCADE")
    conn.execute("CREATE SCHEMA bend")
    try:
        conn.execute(
            "CREATE FUNCTION bend.always(text, text) RETURNS boolean"
            " LANGUAGE sql IMMUTABLE AS 'SELECT true'"
        )
        conn.execute(
            "CREATE OPERATOR bend.= (LEFTARG = text, RIGHTARG = text, FUNCTION = bend.always)"
        )
        with psycopg.connect(dsn, autocommit=True) as fresh:  # compiles the rule afresh
            fresh.execute("SET search_path = bend, pg_catalog, leasework")
            assert fresh.execute("SELECT 'a'::text = 'b'::text").fetchone() == (True,)
            with pytest.raises(psycopg.errors.CheckViolation, match="runs_state_valid"):
                fresh.execute("UPDATE leasework.runs SET status = 'done' WHERE id = %s", (run_id,))
    finally:
        conn.execute("DROP SCHEMA bend CASCADE")
