"""The rate limiter: one run at a time per tenant and group, an exclusive run alone in its tenant,
other tenants and groups never blocked, a crashed run not blocking its tenant once its lease
has expired, and one claim statement taking one run per tenant."""

from __future__ import annotations

from typing import Any

import psycopg

from leasework.leases import lease

from ...conftest import expire_lease
from ..checks import (
    KINDS,
    LEASE,
    claim_one,
    make_app,
)

Conn = psycopg.Connection[Any]


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
