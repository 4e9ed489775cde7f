"""A lease is owned: it runs out in database time, is renewed from database now, is reclaimed once
expired, and every write of its old owner afterwards (renew, checkpoint, seal, the fenced
transaction) changes nothing. The fence holds a reclaim off while its transaction is open, and
the server ends a fenced transaction left idle."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import psycopg
import pytest

from leasework.leases import lease

from ...conftest import expire_lease, get_run, shift_clock
from ..checks import (
    LEASE,
    TENANTS,
    claim_one,
    expire_worker_leases_expires_only_the_dead_workers_leases,
    idle_fenced_transaction_is_ended,
    make_app,
    stale_owner_writes_nothing,
)

Conn = psycopg.Connection[Any]


def secs(delta: timedelta) -> float:
    return delta.total_seconds()


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
    # Lost once it ran out, before anyone reclaims it: never renewed back to life.
    assert lease.control(conn, old) == "lost"
    assert lease.renew(conn, old) is None and lease.checkpoint(conn, old, 1) is False
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
    shift_clock(conn, LEASE / 2)
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


@pytest.mark.parametrize("tenant", TENANTS)
def test_expire_worker_leases_makes_runs_claimable_now(conn: Conn, tenant: str | None) -> None:
    expire_worker_leases_expires_only_the_dead_workers_leases(conn, tenant)


def test_checkpoint_records_progress_and_renews(conn: Conn) -> None:
    app = make_app()
    run_id = app.enqueue(conn, "job")
    claim = claim_one(conn)
    assert claim is not None
    claimed_until = get_run(conn, run_id)["lease_expires_at"]
    shift_clock(conn, 20)
    assert lease.checkpoint(conn, claim, 40, 200)
    row = get_run(conn, run_id)
    assert (row["processed_units"], row["total_units"]) == (40, 200)
    assert secs(row["lease_expires_at"] - claimed_until) >= 19
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
        # Another connection (the keeper's) can still renew while the fence is held.
        assert lease.renew(conn, claim) is not None
        expire_lease(conn, run_id)
        assert claim_one(conn, "w2") is None, "a fenced run was reclaimed"
    thief = claim_one(conn, "w2")
    assert thief is not None and thief.id == run_id
    with other.transaction():
        assert lease.fence(other, claim) is False


def test_an_expired_lease_is_lost_even_if_unclaimed(conn: Conn) -> None:
    """Neither the fence nor a renewal nor a checkpoint accepts a lease that ran out, though no
    one reclaimed the run yet; the run is reclaimed next, its attempt charged."""
    app = make_app()
    run_id = app.enqueue(conn, "job")
    claim = claim_one(conn)
    assert claim is not None
    expire_lease(conn, run_id)
    with conn.transaction():
        assert lease.fence(conn, claim) is False
    assert lease.renew(conn, claim) is None
    assert lease.checkpoint(conn, claim, 1) is False
    assert lease.control(conn, claim) == "lost"
    again = claim_one(conn, "w2")
    assert again is not None and again.id == run_id and again.attempts == 2


def test_idle_fenced_transaction_is_ended_by_the_server(conn: Conn, dsn: str) -> None:
    idle_fenced_transaction_is_ended(conn, dsn)


def test_a_lapsed_exclusive_run_is_not_revived_beside_its_tenants_next_run(conn: Conn) -> None:
    """The limiter counts live leases only: once an exclusive run's lease ran out, its tenant's
    next run may be claimed before anyone reclaims the first. Its old owner's renewal or
    checkpoint must then fail, or two runs of one exclusive tenant would hold live leases."""
    app = make_app()
    first = app.enqueue(conn, "job", tenant="t", exclusive=True)
    second = app.enqueue(conn, "job", tenant="t", delay=0)
    old = claim_one(conn, "w1")
    assert old is not None and old.id == first
    shift_clock(conn, LEASE + 12)
    taken = lease.claim_runs(conn, ["job"], worker="w2", lease=LEASE, limit=3)
    assert taken, "the tenant's work stopped behind a lapsed lease"
    assert lease.checkpoint(conn, old, 1) is False
    assert lease.renew(conn, old) is None
    live = conn.execute(
        "SELECT count(*) FROM leasework.runs WHERE tenant = 't' AND status = 'running'"
        " AND lease_expires_at > leasework.now()"
    ).fetchone()
    assert live is not None and live[0] <= 1, "two runs of an exclusive tenant hold live leases"
    assert {c.id for c in taken} <= {first, second}
