"""A handler's Snooze and Fail, statement by statement (snooze_run, fail_run): a snooze requeues
in place, due later in database time, without charging the attempt, at most max_snoozes times;
a fail ends the run `failed` whatever attempts are left; a cancel requested meanwhile wins over
both; a stale owner's writes nothing (checks.stale_owner_writes_nothing). And an attempt that
dies after a snooze (or a release) gave its attempt back is still recorded as lost."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import psycopg
import pytest

from leasework.leases import lease

from ...conftest import expire_lease, get_run, shift_clock
from ..checks import TENANTS, claim_one, make_app, snooze_charges_no_attempt

Conn = psycopg.Connection[Any]


def secs(delta: timedelta) -> float:
    return delta.total_seconds()


@pytest.mark.parametrize("tenant", TENANTS)
def test_a_snooze_charges_no_attempt(conn: Conn, tenant: str | None) -> None:
    snooze_charges_no_attempt(conn, tenant)


@pytest.mark.parametrize("tenant", TENANTS)
def test_a_snooze_requeues_in_place_due_later_keeping_the_error(
    conn: Conn, tenant: str | None
) -> None:
    app = make_app()
    run_id = app.enqueue(conn, "job", tenant=tenant)
    first = claim_one(conn)
    assert first is not None
    assert lease.requeue(conn, first, delay=0, error="ValueError: flaky") == "queued"
    claim = claim_one(conn)
    assert claim is not None and claim.attempts == 2
    before = lease.db_now(conn)
    done = lease.snooze(
        conn, claim, after=3600, max_snoozes=5, reason="window closed", result={"got": 1}
    )
    assert done is not None and done.status == "queued" and done.snoozes == 1
    row = get_run(conn, run_id)
    assert row["status"] == "queued" and row["attempts"] == 1 and row["lease_owner"] is None
    assert row["lease_worker"] is None and row["finished_at"] is None
    assert 3600 <= secs(row["queued_at"] - before) <= 3605 and row["queued_at"] == done.due_at
    # Not a failure: the error is the earlier failure's, untouched; the result is kept.
    assert row["error"] == "ValueError: flaky" and row["result"] == {"got": 1}
    entry = row["history"][-1]
    assert entry["outcome"] == "snoozed" and entry["attempt"] == 2
    assert entry["error"] == "window closed" and entry["worker"] == "w1"
    assert entry["owner"] == str(claim.owner)
    assert 3600 <= secs(done.due_at - before) <= 3605
    assert entry["due_at"][:19] == done.due_at.isoformat()[:19]
    try:
        shift_clock(conn, 3590)
        assert claim_one(conn) is None, "a snoozed run was claimed before it was due"
        shift_clock(conn, 3610)
        again = claim_one(conn)
        assert again is not None and again.id == run_id and again.attempts == 2
        assert again.result == {"got": 1}
    finally:
        shift_clock(conn, 0)


def test_the_snooze_past_max_snoozes_ends_the_run_failed(conn: Conn) -> None:
    app = make_app()
    run_id = app.enqueue(conn, "job", max_attempts=5)
    for n in (1, 2):
        claim = claim_one(conn)
        assert claim is not None
        done = lease.snooze(conn, claim, after=0, max_snoozes=2)
        assert done is not None and (done.status, done.snoozes) == ("queued", n)
    claim = claim_one(conn)
    assert claim is not None and claim.attempts == 1
    done = lease.snooze(conn, claim, after=0, max_snoozes=2, reason="once more")
    assert done is not None and (done.status, done.snoozes) == ("failed", 2)
    row = get_run(conn, run_id)
    assert row["status"] == "failed" and row["finished_at"] is not None
    assert row["attempts"] == 1, "the attempt that ended the run stays charged"
    assert row["error"] == "snoozed too often: more than max_snoozes = 2 snoozes"
    assert [h["outcome"] for h in row["history"]] == ["snoozed", "snoozed", "failed"]
    assert row["history"][-1]["error"] == row["error"]
    assert claim_one(conn) is None


def test_max_snoozes_zero_fails_the_first_snooze(conn: Conn) -> None:
    app = make_app()
    run_id = app.enqueue(conn, "job")
    claim = claim_one(conn)
    assert claim is not None
    done = lease.snooze(conn, claim, after=10, max_snoozes=0)
    assert done is not None and done.status == "failed"
    assert get_run(conn, run_id)["status"] == "failed"


def test_an_operators_retry_gives_a_fresh_snooze_budget(conn: Conn) -> None:
    app = make_app()
    run_id = app.enqueue(conn, "job")
    claim = claim_one(conn)
    assert claim is not None
    assert lease.snooze(conn, claim, after=0, max_snoozes=1) == (
        "queued",
        get_run(conn, run_id)["queued_at"],
        1,
    )
    claim = claim_one(conn)
    assert claim is not None
    done = lease.snooze(conn, claim, after=0, max_snoozes=1)
    assert done is not None and done.status == "failed"
    assert app.retry(conn, [run_id]).ids == [run_id]
    assert get_run(conn, run_id)["snoozes"] is None
    claim = claim_one(conn)
    assert claim is not None
    done = lease.snooze(conn, claim, after=0, max_snoozes=1)
    assert done is not None and (done.status, done.snoozes) == ("queued", 1)


@pytest.mark.parametrize("tenant", TENANTS)
def test_a_fail_ends_the_run_failed_whatever_attempts_are_left(
    conn: Conn, tenant: str | None
) -> None:
    app = make_app()
    run_id = app.enqueue(conn, "job", tenant=tenant, max_attempts=5)
    claim = claim_one(conn)
    assert claim is not None and not claim.last_attempt
    status = lease.fail(conn, claim, error="Fail: record 42 was deleted", result={"seen": 3})
    assert status == "failed"
    row = get_run(conn, run_id)
    assert row["status"] == "failed" and row["attempts"] == 1 and row["finished_at"]
    assert row["error"] == "Fail: record 42 was deleted" and row["result"] == {"seen": 3}
    assert row["lease_owner"] is None and row["lease_worker"] is None
    [entry] = row["history"]
    assert (entry["outcome"], entry["error"], entry["attempt"]) == (
        "failed",
        "Fail: record 42 was deleted",
        1,
    )
    expire_lease(conn, run_id)
    assert claim_one(conn) is None, "a failed run was claimed again"
    assert lease.expire_and_promote(conn, 100) == (0, 0)


@pytest.mark.parametrize("outcome", ["snooze", "fail"])
@pytest.mark.parametrize("tenant", TENANTS)
def test_a_cancel_requested_meanwhile_wins(conn: Conn, tenant: str | None, outcome: str) -> None:
    app = make_app()
    run_id = app.enqueue(conn, "job", tenant=tenant)
    claim = claim_one(conn)
    assert claim is not None
    assert app.cancel(conn, run_id) == "running"
    if outcome == "snooze":
        done = lease.snooze(conn, claim, after=60, max_snoozes=100)
        assert done is not None
        status = done.status
    else:
        status = lease.fail(conn, claim, error="Fail: gone")
    assert status == "cancelled"
    row = get_run(conn, run_id)
    assert row["status"] == "cancelled" and row["finished_at"] is not None
    assert row["lease_owner"] is None and row["snoozes"] is None
    assert row["attempts"] == 1
    assert claim_one(conn) is None


def test_a_snoozed_tenanted_run_takes_its_turn_again(conn: Conn) -> None:
    """Queued again, its tenant is back in the turns (tenant_queued_run), so the claim reads it."""
    app = make_app()
    run_id = app.enqueue(conn, "job", tenant="ws-1")
    claim = claim_one(conn)
    assert claim is not None
    assert conn.execute(
        "SELECT priority FROM leasework.tenants WHERE name = 'ws-1'"
    ).fetchone() == (None,)
    done = lease.snooze(conn, claim, after=0, max_snoozes=100)
    assert done is not None and done.status == "queued"
    again = claim_one(conn)
    assert again is not None and again.id == run_id


@pytest.mark.parametrize("gave_back", ["snooze", "release"])
@pytest.mark.parametrize("tenant", TENANTS)
def test_an_attempt_that_dies_after_one_was_given_back_is_recorded(
    conn: Conn, tenant: str | None, gave_back: str
) -> None:
    """A snooze (or a release) gives its attempt back, so the next attempt has the number of the
    entry before it; that attempt dying is still recorded (`expired`), when it is reclaimed and
    when the settle ends it, not taken for the entry already there (which only the owner says)."""
    app = make_app()
    run_id = app.enqueue(conn, "job", tenant=tenant, max_attempts=2)
    claim = claim_one(conn)
    assert claim is not None and claim.attempts == 1
    if gave_back == "snooze":
        assert lease.snooze(conn, claim, after=0, max_snoozes=100) is not None
    else:
        assert lease.release(conn, claim, "shutdown") == "queued"
    dying = claim_one(conn, "w-dying")
    assert dying is not None and dying.attempts == 1
    expire_lease(conn, run_id)
    reclaimed = claim_one(conn, "w2")
    assert reclaimed is not None and reclaimed.attempts == 2
    history = get_run(conn, run_id)["history"]
    assert [(h["attempt"], h["outcome"]) for h in history][-1] == (1, "expired"), history
    assert history[-1]["worker"] == "w-dying"
    expire_lease(conn, run_id)
    assert lease.expire_and_promote(conn, 100) == (1, 0)
    row = get_run(conn, run_id)
    assert row["status"] == "failed"
    assert [(h["attempt"], h["outcome"], h["worker"]) for h in row["history"][-2:]] == [
        (1, "expired", "w-dying"),
        (2, "expired", "w2"),
    ]


@pytest.mark.parametrize("gave_back", ["snooze", "release"])
def test_a_last_attempt_that_dies_after_one_was_given_back_is_recorded_by_the_settle(
    conn: Conn, gave_back: str
) -> None:
    app = make_app()
    run_id = app.enqueue(conn, "job", max_attempts=1)
    claim = claim_one(conn)
    assert claim is not None
    if gave_back == "snooze":
        assert lease.snooze(conn, claim, after=0, max_snoozes=100) is not None
    else:
        assert lease.release(conn, claim, "shutdown") == "queued"
    dying = claim_one(conn, "w-dying")
    assert dying is not None and dying.attempts == 1 and dying.last_attempt
    expire_lease(conn, run_id)
    assert claim_one(conn, "w2") is None
    assert lease.expire_and_promote(conn, 100) == (1, 0)
    row = get_run(conn, run_id)
    assert row["status"] == "failed" and row["error"] == "lease expired"
    assert [(h["attempt"], h["outcome"], h["worker"]) for h in row["history"]][-1] == (
        1,
        "expired",
        "w-dying",
    ), row["history"]


def test_an_attempt_the_supervisor_recorded_is_not_recorded_twice(conn: Conn) -> None:
    app = make_app()
    run_id = app.enqueue(conn, "job", max_attempts=3)
    claim = claim_one(conn)
    assert claim is not None
    assert lease.snooze(conn, claim, after=0, max_snoozes=100) is not None
    assert claim_one(conn, "w-dead") is not None
    assert lease.expire_worker_leases(conn, "w-dead", "killed") == [run_id]
    assert claim_one(conn, "w2") is not None
    outcomes = [h["outcome"] for h in get_run(conn, run_id)["history"]]
    assert outcomes == ["snoozed", "crashed"]
    expire_lease(conn, run_id)
    conn.execute("UPDATE leasework.runs SET max_attempts = attempts WHERE id = %s", (run_id,))
    conn.execute(
        "UPDATE leasework.runs SET history = history || jsonb_build_array("
        " leasework.history_entry(attempts, lease_owner, lease_worker, started_at,"
        " leasework.now(), 'crashed', 'killed')) WHERE id = %s",
        (run_id,),
    )
    assert lease.expire_and_promote(conn, 100) == (1, 0)
    outcomes = [h["outcome"] for h in get_run(conn, run_id)["history"]]
    assert outcomes == ["snoozed", "crashed", "crashed"]
