"""The lease rules, statement by statement, on real Postgres: claim, limiter, settle (cancel beats
reclaim, expired on the last attempt, promotion), renew, control, finish, requeue, release,
checkpoint and the fence. Time moves by shifting the database clock or the lease columns.
Every claim rule is stated twice in the claim, for tenanted runs and for runs without a tenant,
so its test runs once per branch (checks.TENANTS)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from leasework import ConfigError
from leasework.workers import lease

from ..conftest import expire_lease, get_run, shift_clock
from .checks import (
    KINDS,
    LEASE,
    TENANTS,
    cancel_beats_reclaim,
    claim_one,
    claim_takes_only_its_kinds,
    delayed_run_is_claimed_only_when_due,
    expire_worker_leases_expires_only_the_dead_workers_leases,
    idle_fenced_transaction_is_ended,
    last_attempt_is_never_reclaimed,
    make_app,
    stale_owner_writes_nothing,
    waiting_run_waits_for_its_key,
)

Conn = psycopg.Connection[Any]


@pytest.fixture
def other(dsn: str) -> Iterator[Conn]:
    with psycopg.connect(dsn, autocommit=True) as c:
        yield c


def secs(delta: timedelta) -> float:
    return delta.total_seconds()


# -- claim ------------------------------------------------------------------------------------


def test_claim_takes_a_queued_run_in_one_statement(conn: Conn) -> None:
    app = make_app()
    run_id = app.enqueue(conn, "job", {"x": 1}, key="k")
    before = lease.db_now(conn)
    claim = claim_one(conn)
    assert claim is not None and claim.id == run_id
    assert claim.payload == {"x": 1} and claim.attempts == 1 and claim.max_attempts == 3
    row = get_run(conn, run_id)
    assert row["status"] == "running" and row["lease_owner"] == claim.owner
    assert row["lease_worker"] == "w1"
    assert LEASE - 1 <= secs(row["lease_expires_at"] - before) <= LEASE + 5
    assert claim_one(conn) is None, "a live lease is not claimable"


def test_owner_tokens_are_unique_per_claim(conn: Conn) -> None:
    app = make_app()
    run_id = app.enqueue(conn, "job")
    owners = set()
    for _ in range(3):
        claim = claim_one(conn)
        assert claim is not None and claim.id == run_id
        owners.add(claim.owner)
        assert lease.release(conn, claim) == "queued"
    assert len(owners) == 3


def test_claim_order_is_priority_then_queued_at_then_id(conn: Conn) -> None:
    app = make_app()
    late = app.enqueue(conn, "job", priority=0)
    urgent = app.enqueue(conn, "job", priority=-5)
    also_late = app.enqueue(conn, "job", priority=0)
    background = app.enqueue(conn, "job", priority=10)
    order = []
    while (claim := claim_one(conn)) is not None:
        order.append(claim.id)
    assert order == [urgent, late, also_late, background]


@pytest.mark.parametrize("tenant", TENANTS)
def test_claim_takes_only_its_kinds(conn: Conn, tenant: str | None) -> None:
    claim_takes_only_its_kinds(conn, tenant)


def test_claim_respects_limit_and_kinds(conn: Conn) -> None:
    app = make_app()
    ids = [app.enqueue(conn, "job") for _ in range(5)]
    other_kind = app.enqueue(conn, "other")
    claims = lease.claim_runs(conn, ["job"], worker="w", lease=LEASE, limit=3)
    assert [c.id for c in claims] == ids[:3]
    assert lease.claim_runs(conn, [], worker="w", lease=LEASE, limit=3) == []
    rest = lease.claim_runs(conn, ["job"], worker="w", lease=LEASE, limit=10)
    assert [c.id for c in rest] == ids[3:]
    assert get_run(conn, other_kind)["status"] == "queued"


@pytest.mark.parametrize("tenant", TENANTS)
def test_delayed_run_is_claimable_only_when_due_in_database_time(
    conn: Conn, tenant: str | None
) -> None:
    delayed_run_is_claimed_only_when_due(conn, tenant)


@pytest.mark.parametrize("tenant", TENANTS)
def test_expired_lease_is_reclaimed_and_stale_owner_writes_nothing(
    conn: Conn, tenant: str | None
) -> None:
    stale_owner_writes_nothing(conn, tenant)


def test_lease_expiry_by_database_clock(conn: Conn) -> None:
    """The same as expire_lease, but by moving database time past the lease."""
    app = make_app()
    run_id = app.enqueue(conn, "job")
    old = claim_one(conn)
    assert old is not None
    shift_clock(conn, LEASE - 1)
    assert claim_one(conn) is None
    shift_clock(conn, LEASE + 1)
    assert lease.control(conn, old) == "expired"  # still ours until someone reclaims it
    new = claim_one(conn, "w2")
    assert new is not None and new.id == run_id and new.attempts == 2
    assert lease.control(conn, old) == "lost"
    history = get_run(conn, run_id)["history"]
    assert history[0]["outcome"] == "expired" and history[0]["worker"] == "w1"
    assert history[0]["owner"] == str(old.owner)


def test_renew_extends_from_database_now(conn: Conn) -> None:
    app = make_app()
    app.enqueue(conn, "job")
    claim = claim_one(conn)
    assert claim is not None
    shift_clock(conn, 1000)
    expires = lease.renew(conn, claim)
    assert expires is not None
    assert abs(secs(expires - lease.db_now(conn)) - LEASE) < 5


def test_finished_run_cannot_be_renewed_or_written(conn: Conn) -> None:
    app = make_app()
    run_id = app.enqueue(conn, "job")
    claim = claim_one(conn)
    assert claim is not None
    assert lease.finish(conn, claim, "succeeded", result={"a": 1})
    row = get_run(conn, run_id)
    assert lease.renew(conn, claim) is None
    assert lease.checkpoint(conn, claim, 3) is False
    assert lease.finish(conn, claim, "failed", error="again") is False
    assert lease.requeue(conn, claim, delay=0, error="again") is None
    assert lease.release(conn, claim) is None
    assert lease.control(conn, claim) == "lost"
    assert get_run(conn, run_id) == row


# -- cancel --------------------------------------------------------------------------------------


def test_cancel_of_a_queued_run_is_immediate(conn: Conn) -> None:
    app = make_app()
    run_id = app.enqueue(conn, "job")
    assert app.cancel(conn, run_id) == "cancelled"
    row = get_run(conn, run_id)
    assert row["status"] == "cancelled" and row["finished_at"] is not None
    assert claim_one(conn) is None
    assert app.cancel(conn, run_id) == "cancelled"  # idempotent, unchanged
    with pytest.raises(ConfigError, match="no run"):
        app.cancel(conn, 999_999)


def test_cancel_of_a_running_run_is_seen_by_control(conn: Conn) -> None:
    app = make_app()
    run_id = app.enqueue(conn, "job")
    claim = claim_one(conn)
    assert claim is not None
    assert lease.control(conn, claim) == "ok"
    assert app.cancel(conn, run_id) == "running"
    row = get_run(conn, run_id)
    assert row["status"] == "running" and row["cancel_requested_at"] is not None
    assert lease.control(conn, claim) == "cancelled"
    assert lease.finish(conn, claim, "cancelled", result={"partial": 1}, error="cancelled")
    row = get_run(conn, run_id)
    assert row["status"] == "cancelled" and row["result"] == {"partial": 1}
    assert app.cancel(conn, run_id) == "cancelled"


@pytest.mark.parametrize("tenant", TENANTS)
def test_cancel_beats_reclaim(conn: Conn, tenant: str | None) -> None:
    cancel_beats_reclaim(conn, tenant)


def test_requeue_after_cancel_request_ends_cancelled(conn: Conn) -> None:
    app = make_app()
    run_id = app.enqueue(conn, "job")
    claim = claim_one(conn)
    assert claim is not None
    app.cancel(conn, run_id)
    assert lease.requeue(conn, claim, delay=5, error="boom") == "cancelled"
    row = get_run(conn, run_id)
    assert row["status"] == "cancelled" and row["finished_at"] is not None


# -- settle: expired on the last attempt, promotion ----------------------------------------------


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


def test_waiting_exclusive_run_is_promoted_only_when_its_key_is_idle(conn: Conn) -> None:
    waiting_run_waits_for_its_key(conn)


def test_exclusive_run_on_an_idle_key_is_queued_at_once(conn: Conn) -> None:
    app = make_app()
    run_id = app.enqueue(conn, "other", key="k", exclusive=True)
    assert get_run(conn, run_id)["status"] == "queued"


def test_cancel_of_a_waiting_run_is_immediate(conn: Conn) -> None:
    app = make_app()
    app.enqueue(conn, "job", key="k")
    waiting = app.enqueue(conn, "other", key="k", exclusive=True)
    assert app.cancel(conn, waiting) == "cancelled"
    assert get_run(conn, waiting)["status"] == "cancelled"


def test_key_is_free_again_after_the_run_ends(conn: Conn) -> None:
    app = make_app()
    first = app.enqueue(conn, "job", key="k")
    claim = claim_one(conn)
    assert claim is not None
    assert lease.finish(conn, claim, "failed", error="x")
    second = app.enqueue(conn, "job", key="k")
    assert second != first


# -- the rate limiter ----------------------------------------------------------------------------


def test_limiter_same_tenant_and_group_run_one_at_a_time(conn: Conn) -> None:
    app = make_app()
    a = app.enqueue(conn, "job", tenant="ws-1", group="procore")
    b = app.enqueue(conn, "job", tenant="ws-1", group="procore")
    first = claim_one(conn)
    assert first is not None and first.id == a
    assert claim_one(conn, "w2") is None
    assert lease.claim_runs(conn, KINDS, worker="w3", lease=LEASE, limit=5) == []
    assert lease.finish(conn, first, "succeeded")
    second = claim_one(conn, "w2")
    assert second is not None and second.id == b


def test_limiter_one_claim_statement_takes_one_run_per_tenant(conn: Conn) -> None:
    app = make_app()
    a = app.enqueue(conn, "job", tenant="ws-1", group="g")
    app.enqueue(conn, "job", tenant="ws-1", group="g")
    c = app.enqueue(conn, "job", tenant="ws-2", group="g")
    d = app.enqueue(conn, "job")
    claims = lease.claim_runs(conn, KINDS, worker="w", lease=LEASE, limit=10)
    assert sorted(cl.id for cl in claims) == [a, c, d]


def test_limiter_different_groups_run_in_parallel(conn: Conn) -> None:
    app = make_app()
    a = app.enqueue(conn, "job", tenant="ws-1", group="procore")
    b = app.enqueue(conn, "job", tenant="ws-1", group="autodesk")
    c = app.enqueue(conn, "job", tenant="ws-1")  # no group: conflicts with nobody non-exclusive
    claimed = {cl.id for cl in (claim_one(conn, f"w{i}") for i in range(3)) if cl is not None}
    assert claimed == {a, b, c}


def test_limiter_other_tenants_are_not_blocked(conn: Conn) -> None:
    app = make_app()
    app.enqueue(conn, "job", tenant="ws-1", group="g", exclusive=True)
    b = app.enqueue(conn, "job", tenant="ws-2", group="g")
    assert claim_one(conn) is not None
    second = claim_one(conn, "w2")
    assert second is not None and second.id == b


def test_limiter_exclusive_run_runs_alone_in_its_tenant(conn: Conn) -> None:
    app = make_app()
    sync = app.enqueue(conn, "job", tenant="ws-1", group="procore")
    purge = app.enqueue(conn, "other", tenant="ws-1", group="autodesk", exclusive=True)
    later = app.enqueue(conn, "job", tenant="ws-1", group="sage")
    first = claim_one(conn)
    assert first is not None and first.id == sync
    # The exclusive run may not start while anything of its tenant runs...
    nxt = claim_one(conn, "w2")
    assert nxt is not None and nxt.id == later  # (a different group may)
    assert claim_one(conn, "w3") is None
    assert lease.finish(conn, first, "succeeded")
    assert claim_one(conn, "w3") is None
    assert lease.finish(conn, nxt, "succeeded")
    excl = claim_one(conn, "w3")
    assert excl is not None and excl.id == purge
    # ...and nothing else of its tenant starts while it runs.
    app.enqueue(conn, "job", tenant="ws-1", group="other-group")
    assert claim_one(conn, "w4") is None
    assert lease.finish(conn, excl, "succeeded")
    assert claim_one(conn, "w4") is not None


def test_limiter_a_crashed_run_does_not_block_its_tenant(conn: Conn) -> None:
    app = make_app()
    crashed = app.enqueue(conn, "job", tenant="ws-1", group="g")
    waiting_for_it = app.enqueue(conn, "other", tenant="ws-1", group="g")
    assert claim_one(conn, "dead", kinds=["job"]) is not None
    assert claim_one(conn, "w2", kinds=["other"]) is None
    expire_lease(conn, crashed)  # its worker died: only unexpired leases count
    claim = claim_one(conn, "w2", kinds=["other"])
    assert claim is not None and claim.id == waiting_for_it
    # Now the crashed run waits for the live one.
    assert claim_one(conn, "w3", kinds=["job"]) is None


def test_limiter_does_not_count_a_run_against_itself_on_reclaim(conn: Conn) -> None:
    app = make_app()
    run_id = app.enqueue(conn, "job", tenant="ws-1", group="g", exclusive=True)
    assert claim_one(conn) is not None
    expire_lease(conn, run_id)
    again = claim_one(conn, "w2")
    assert again is not None and again.id == run_id


# -- requeue and release -------------------------------------------------------------------------


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


def test_release_after_cancel_request_ends_cancelled(conn: Conn) -> None:
    app = make_app()
    run_id = app.enqueue(conn, "job")
    claim = claim_one(conn)
    assert claim is not None
    app.cancel(conn, run_id)
    assert lease.release(conn, claim) == "cancelled"
    assert get_run(conn, run_id)["status"] == "cancelled"


@pytest.mark.parametrize("tenant", TENANTS)
def test_expire_worker_leases_makes_runs_claimable_now(conn: Conn, tenant: str | None) -> None:
    expire_worker_leases_expires_only_the_dead_workers_leases(conn, tenant)


# -- checkpoint and the fence --------------------------------------------------------------------


def test_checkpoint_records_progress_and_renews(conn: Conn) -> None:
    app = make_app()
    run_id = app.enqueue(conn, "job")
    claim = claim_one(conn)
    assert claim is not None
    shift_clock(conn, 20)
    assert lease.checkpoint(conn, claim, 40, 200)
    row = get_run(conn, run_id)
    assert (row["processed_units"], row["total_units"]) == (40, 200)
    assert secs(row["lease_expires_at"] - claim.lease_expires_at) >= 19
    assert lease.checkpoint(conn, claim, 80)
    row = get_run(conn, run_id)
    assert (row["processed_units"], row["total_units"]) == (80, 200)
    # A reclaimed run keeps its processed_units.
    shift_clock(conn, 0)
    expire_lease(conn, run_id)
    again = claim_one(conn, "w2")
    assert again is not None and again.processed_units == 80 and again.total_units == 200


def test_fence_blocks_reclaim_until_the_fenced_transaction_ends(conn: Conn, other: Conn) -> None:
    """A paused worker inside its fenced transaction: even once its lease has lapsed nobody can
    take the run until that transaction ends, and after that its fence matches nothing."""
    app = make_app()
    run_id = app.enqueue(conn, "job")
    claim = claim_one(conn)
    assert claim is not None
    with other.transaction():
        assert lease.fence(other, claim)
        # The reserved control connection can still renew while the fence is held.
        assert lease.renew(conn, claim) is not None
        expire_lease(conn, run_id)
        assert claim_one(conn, "w2") is None, "a fenced run was reclaimed"
    thief = claim_one(conn, "w2")
    assert thief is not None and thief.id == run_id
    with other.transaction():
        assert lease.fence(other, claim) is False


def test_fence_refuses_an_expired_lease_even_if_unclaimed(conn: Conn) -> None:
    app = make_app()
    run_id = app.enqueue(conn, "job")
    claim = claim_one(conn)
    assert claim is not None
    expire_lease(conn, run_id)
    with conn.transaction():
        assert lease.fence(conn, claim) is False
    assert lease.renew(conn, claim) is not None  # not yet taken: renewal rescues it
    with conn.transaction():
        assert lease.fence(conn, claim) is True


def test_idle_fenced_transaction_is_ended_by_the_server(conn: Conn, dsn: str) -> None:
    idle_fenced_transaction_is_ended(conn, dsn)


def test_status_invariants_are_enforced_by_the_schema(conn: Conn) -> None:
    app = make_app()
    run_id = app.enqueue(conn, "job")
    with pytest.raises(psycopg.errors.CheckViolation):
        conn.execute("UPDATE leasework.runs SET status = 'running' WHERE id = %s", (run_id,))
    with pytest.raises(psycopg.errors.CheckViolation):
        conn.execute("UPDATE leasework.runs SET status = 'succeeded' WHERE id = %s", (run_id,))
    with pytest.raises(psycopg.errors.CheckViolation):
        conn.execute("UPDATE leasework.runs SET status = 'done' WHERE id = %s", (run_id,))
