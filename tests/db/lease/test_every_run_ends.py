"""Every run ends: attempts are charged by claims and requeues, never by a release; a run that
expires or is requeued on its last attempt ends `failed`, never reclaimed past max_attempts; a
requeue is in place and delayed in database time."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import psycopg
import pytest

from leasework.leases import lease

from ...conftest import expire_lease, get_run, shift_clock
from ..checks import (
    TENANTS,
    claim_one,
    last_attempt_is_never_reclaimed,
    make_app,
)

Conn = psycopg.Connection[Any]


def secs(delta: timedelta) -> float:
    return delta.total_seconds()


@pytest.mark.parametrize("tenant", TENANTS)
def test_expired_on_last_attempt_is_never_reclaimed_and_ends_failed(
    conn: Conn, tenant: str | None
) -> None:
    last_attempt_is_never_reclaimed(conn, tenant)


def test_expired_on_its_only_attempt_ends_failed(conn: Conn) -> None:
    app = make_app()
    run_id = app.enqueue(conn, "job", max_attempts=1)
    claim = claim_one(conn)
    assert claim is not None and claim.last_attempt
    assert lease.expire_and_promote(conn, 100) == (0, 0)  # live lease: nothing to settle
    expire_lease(conn, run_id)
    assert claim_one(conn, "w2") is None, "no attempts left: never reclaimed"
    assert lease.expire_and_promote(conn, 100) == (1, 0)
    row = get_run(conn, run_id)
    assert row["status"] == "failed" and row["error"] == "lease expired"
    assert row["attempts"] == 1 and row["lease_owner"] is None
    assert [h["outcome"] for h in row["history"]] == ["expired"]
    assert lease.finish(conn, claim, "succeeded") is False


def test_requeue_is_in_place_and_delayed_in_database_time(conn: Conn) -> None:
    app = make_app()
    run_id = app.enqueue(conn, "job")
    claim = claim_one(conn)
    assert claim is not None
    before = lease.db_now(conn)
    assert lease.requeue(conn, claim, delay=30, error="boom", result={"got": 1}) == "queued"
    row = get_run(conn, run_id)
    assert row["status"] == "queued" and row["attempts"] == 1 and row["lease_owner"] is None
    assert row["result"] == {"got": 1} and row["error"] == "boom"
    assert 29 <= secs(row["queued_at"] - before) <= 35
    assert claim_one(conn) is None
    shift_clock(conn, 31)
    again = claim_one(conn)
    assert again is not None and again.id == run_id and again.attempts == 2
    assert again.result == {"got": 1}


def test_requeue_on_the_last_attempt_ends_failed(conn: Conn) -> None:
    app = make_app()
    run_id = app.enqueue(conn, "job", max_attempts=1)
    claim = claim_one(conn)
    assert claim is not None
    assert lease.requeue(conn, claim, delay=5, error="boom") == "failed"
    row = get_run(conn, run_id)
    assert row["status"] == "failed" and row["error"] == "boom" and row["finished_at"]


def test_release_does_not_charge_the_attempt(conn: Conn) -> None:
    app = make_app()
    run_id = app.enqueue(conn, "job", max_attempts=1)
    claim = claim_one(conn)
    assert claim is not None and claim.attempts == 1
    assert lease.release(conn, claim, "shutdown") == "queued"
    row = get_run(conn, run_id)
    assert row["status"] == "queued" and row["attempts"] == 0 and row["lease_owner"] is None
    again = claim_one(conn, "w2")  # claimable at once, and still on its only attempt
    assert again is not None and again.attempts == 1
    assert lease.finish(conn, again, "succeeded")
    outcomes = [h["outcome"] for h in get_run(conn, run_id)["history"]]
    assert outcomes == ["released", "succeeded"]


# A run's history is jsonb the worker role can write anything into: the claim's reclaim and the
# settle read its last entry's attempt number, which must be a number to count.
ODD_HISTORIES = [
    '[{"attempt": "x"}]',
    '[{"attempt": 1.5}]',
    '[{"attempt": 1e30}]',
    '[{"attempt": true}]',
    '[{"attempt": [1]}]',
    '["a plain string"]',
    '"a plain string"',
    '{"attempt": "x"}',
    "7",
]


@pytest.mark.parametrize("history", ODD_HISTORIES)
@pytest.mark.parametrize("tenant", TENANTS)
def test_a_history_of_any_shape_is_reclaimed_and_its_run_ends(
    conn: Conn, tenant: str | None, history: str
) -> None:
    app = make_app()
    run_id = app.enqueue(conn, "job", max_attempts=2, tenant=tenant)
    assert claim_one(conn) is not None
    conn.execute(
        "UPDATE leasework.runs SET history = %s::jsonb WHERE id = %s", (history, run_id)
    )
    expire_lease(conn, run_id)
    again = claim_one(conn, "w2")  # raised (22P02, 22003) while the cast was unguarded
    assert again is not None and again.id == run_id and again.attempts == 2
    expire_lease(conn, run_id)
    assert lease.expire_and_promote(conn, 100) == (1, 0)
    row = get_run(conn, run_id)
    assert row["status"] == "failed" and row["error"] == "lease expired"
    # Nothing the history held is lost; an attempt that is no number counts as none recorded.
    written = conn.execute("SELECT %s::jsonb", (history,)).fetchone()[0]  # as jsonb keeps it
    if isinstance(written, list):
        assert row["history"][: len(written)] == written
    if "x" in history or "true" in history:
        assert [h.get("attempt") for h in row["history"][-2:]] == [1, 2]
