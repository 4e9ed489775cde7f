"""claim_runs sent through a worker's Chain (libpq, its own prepared statement): what an idle
worker woken by a NOTIFY sends first. The same statement, so the same claims in the same order
as through psycopg's cursor (priorities, turns, a tenant's group held back, a paused kind passed
by, a delayed run left), a batch in claim order; the cursor again inside a transaction."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg

from leasework import App
from leasework.leases import lease
from leasework.workers.worker import Worker

from ...conftest import truncate_all

Conn = psycopg.Connection[Any]


def app_of(*kinds: str) -> App:
    app = App()
    for kind in kinds:
        app.task(kind)(lambda ctx, p: None)
    return app


def prepared_claims(conn: Conn) -> list[str]:
    rows = conn.execute(
        "SELECT name FROM pg_prepared_statements WHERE name LIKE 'leasework_claim_runs_%'"
    ).fetchall()
    return [r[0] for r in rows]


def queue(conn: Conn) -> None:
    """Runs the rules order, hold back and leave: a better priority, a tenant's group (its
    second run held back while the first runs), a paused kind, a delayed run."""
    app = app_of("k", "p")
    app.enqueue(conn, "k", {"n": "a"})
    app.enqueue(conn, "k", {"n": "b"}, priority=-1)
    app.enqueue(conn, "k", {"n": "c"}, tenant="t1", group="g")
    app.enqueue(conn, "k", {"n": "d"}, tenant="t1", group="g")  # held back while c runs
    app.enqueue(conn, "p", {"n": "e"})  # its kind paused
    app.enqueue(conn, "k", {"n": "f"}, delay=3600)  # not due
    conn.execute("INSERT INTO leasework.paused_kinds (kind) VALUES ('p')")


def drain(conn: Conn, chain: lease.Chain | None) -> list[lease.Claim]:
    taken = []
    while claims := lease.claim_runs(conn, ["k", "p"], worker="w1", lease=30.0, chain=chain):
        assert len(claims) == 1
        taken.append(claims[0])
    return taken


def test_claims_what_the_cursor_claims(conn: Conn) -> None:
    queue(conn)
    by_cursor = [cl.payload for cl in drain(conn, None)]
    assert prepared_claims(conn) == []
    truncate_all(conn)
    queue(conn)

    taken = drain(conn, lease.Chain())

    assert [cl.payload for cl in taken] == by_cursor
    assert sorted(p["n"] for p in by_cursor) == ["a", "b", "c"]
    assert all(cl.kind == "k" and cl.attempts == 1 and cl.lease_seconds == 30.0 for cl in taken)
    owners = conn.execute(
        "SELECT id, lease_owner, lease_worker FROM leasework.runs WHERE status = 'running'"
    ).fetchall()
    assert {(r[0], r[1], r[2]) for r in owners} == {(cl.id, cl.owner, "w1") for cl in taken}
    assert len(prepared_claims(conn)) == 1  # sent as the chain's own statement


def test_a_batch_in_claim_order(conn: Conn) -> None:
    app = app_of("k")
    ids = [app.enqueue(conn, "k", {"i": i}) for i in range(4)]
    claims = lease.claim_runs(conn, ["k"], worker="w1", lease=30.0, limit=3, chain=lease.Chain())
    assert [cl.id for cl in claims] == ids[:3]
    assert [cl.payload for cl in claims] == [{"i": 0}, {"i": 1}, {"i": 2}]


def test_in_a_transaction_the_cursor(conn: Conn) -> None:
    app = app_of("k")
    run = app.enqueue(conn, "k", {})
    with conn.transaction():
        claims = lease.claim_runs(conn, ["k"], worker="w1", lease=30.0, chain=lease.Chain())
    assert [cl.id for cl in claims] == [run]
    assert prepared_claims(conn) == []


def test_a_woken_worker_claims_through_its_chain(
    conn: Conn, make_worker: Callable[..., Worker]
) -> None:
    """The runs stage's own claim (an idle worker's first statement once a NOTIFY woke it)."""
    app = app_of("k")
    worker = make_worker(app)
    run = app.enqueue(conn, "k", {})
    assert worker.poll() >= 1
    assert conn.execute("SELECT status FROM leasework.runs WHERE id = %s", (run,)).fetchone() == (
        "succeeded",
    )
    assert len(prepared_claims(worker.conns.main())) == 1
