"""Who a claim takes, and in what order: one statement, a fresh owner token each time, priority
then queue time then id, only its kinds, up to its limit, a delayed run only once it is due in
database time. Every claim rule is stated twice in the claim (tenanted runs and runs without a
tenant), so its test runs once per branch (checks.TENANTS)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import psycopg
import pytest

from leasework.leases import lease

from ...conftest import get_run
from ..checks import (
    LEASE,
    TENANTS,
    claim_one,
    claim_order_is_priority_then_queued_at,
    claim_takes_only_its_kinds,
    delayed_run_is_claimed_only_when_due,
    make_app,
)

Conn = psycopg.Connection[Any]


def secs(delta: timedelta) -> float:
    return delta.total_seconds()


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
def test_claim_order_holds_across_kinds_expired_leases_and_tenants(
    conn: Conn, tenant: str | None
) -> None:
    claim_order_is_priority_then_queued_at(conn, tenant)


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
