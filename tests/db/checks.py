"""Invariant checks shared by the lease tests and the mutation check: each raises AssertionError
when the rule is broken, so test_mutations can show the suite catches a deliberately broken query."""

from __future__ import annotations

from typing import Any

import psycopg

from leasework import App
from leasework.workers import lease

from ..conftest import expire_lease, get_run

Conn = psycopg.Connection[Any]
KINDS = ["job", "other"]
LEASE = 30.0


def make_app() -> App:
    app = App()
    for kind in KINDS:
        app.task(kind)(lambda ctx, payload: None)
    return app


def claim_one(conn: Conn, worker: str = "w1", kinds: list[str] | None = None) -> lease.Claim | None:
    claims = lease.claim_runs(conn, kinds or KINDS, worker=worker, lease=LEASE, limit=1)
    assert len(claims) <= 1
    return claims[0] if claims else None


def stale_owner_writes_nothing(conn: Conn) -> None:
    """An expired lease is reclaimed; the old owner's renew, control, checkpoint, finish, requeue,
    release and fence all match nothing and leave the row exactly as the new owner has it."""
    app = make_app()
    run_id = app.enqueue(conn, "job", {"n": 1})
    old = claim_one(conn, "old")
    assert old is not None and old.id == run_id and old.attempts == 1
    expire_lease(conn, run_id)
    new = claim_one(conn, "new")
    assert new is not None and new.id == run_id, "an expired lease must be reclaimable"
    assert new.owner != old.owner and new.attempts == 2
    before = get_run(conn, run_id)
    assert before["lease_owner"] == new.owner and before["lease_worker"] == "new"

    assert lease.renew(conn, old) is None
    assert lease.control(conn, old) == "lost"
    assert lease.checkpoint(conn, old, 5, 10) is False
    assert lease.finish(conn, old, "succeeded", result={"stale": True}) is False
    assert lease.finish_many(conn, [(old, {"stale": True})]) == set()
    assert lease.requeue(conn, old, delay=0, error="stale") is None
    assert lease.release(conn, old) is None
    with conn.transaction():
        assert lease.fence(conn, old) is False
    assert get_run(conn, run_id) == before, "a stale owner's write changed the row"

    # The new owner's writes land.
    assert lease.control(conn, new) == "ok"
    assert lease.renew(conn, new) is not None
    assert lease.checkpoint(conn, new, 1, 2) is True
    assert lease.finish(conn, new, "succeeded", result={"ok": 1}) is True
    done = get_run(conn, run_id)
    assert done["status"] == "succeeded" and done["result"] == {"ok": 1}
    assert [h["outcome"] for h in done["history"]] == ["expired", "succeeded"]


def cancel_beats_reclaim(conn: Conn) -> None:
    """A running run whose cancel was requested is never reclaimed once its lease expires; the
    poll's settle ends it `cancelled`."""
    app = make_app()
    run_id = app.enqueue(conn, "job")
    first = claim_one(conn, "w1")
    assert first is not None
    assert app.cancel(conn, run_id) == "running"
    assert lease.control(conn, first) == "cancelled"
    expire_lease(conn, run_id)
    assert claim_one(conn, "w2") is None, "a run with a cancel request was reclaimed"
    assert lease.settle_runs(conn, 100) == (1, 0)
    row = get_run(conn, run_id)
    assert row["status"] == "cancelled" and row["attempts"] == 1
    assert row["lease_owner"] is None and row["finished_at"] is not None
