"""The runs stage through a worker's poll on real Postgres: a poll claims at most the stage's
limit and only the kinds the app serves, and the same poll settles expired runs (cancel beats
reclaim; expiry on the last attempt fails the run). The lease statements themselves are tested
in tests/db/lease/, one file per rule (the combined seal-and-claim in test_seal_and_claim.py);
batches in test_batch.py."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import psycopg

from leasework import App
from leasework.workers import lease
from leasework.workers.worker import Worker

from ..conftest import expire_lease, get_run

Conn = psycopg.Connection[Any]
MakeWorker = Callable[..., Worker]


def test_poll_claims_at_most_its_limit_and_only_its_kinds(
    conn: Conn, make_worker: MakeWorker
) -> None:
    app = App()
    app.task("job")(lambda ctx, payload: None)
    ids = [app.enqueue(conn, "job") for _ in range(5)]
    conn.execute(
        "INSERT INTO leasework.runs (kind) VALUES ('somebody_elses_kind')"
    )  # a kind this app does not serve
    worker = make_worker(app, runs_limit=2)
    # Another stage is always due, so the runs stage ends its step at its limit (with every other
    # stage resting it may go on: Site.yield_after_limit; whether they rest would otherwise
    # depend on how long the polls took against poll_interval).
    worker.site = dataclasses.replace(worker.site, others_due=lambda name: True)
    assert worker.poll() == 2
    assert [get_run(conn, i)["status"] for i in ids] == ["succeeded"] * 2 + ["queued"] * 3
    assert worker.poll() == 2 and worker.poll() == 1 and worker.poll() == 0
    other = conn.execute(
        "SELECT status FROM leasework.runs WHERE kind = 'somebody_elses_kind'"
    ).fetchone()
    assert other == ("queued",)


def test_poll_settles_expired_runs(conn: Conn, make_worker: MakeWorker) -> None:
    """Cancel beats reclaim and expiry on the last attempt both happen from the poll."""
    app = App()
    app.task("job")(lambda ctx, payload: None)
    cancelled = app.enqueue(conn, "job")
    last = app.enqueue(conn, "job", max_attempts=1)
    claims = lease.claim_runs(conn, ["job"], worker="dead", lease=30.0, limit=2)
    assert len(claims) == 2
    app.cancel(conn, cancelled)
    expire_lease(conn, cancelled)
    expire_lease(conn, last)
    make_worker(app).poll()
    assert get_run(conn, cancelled)["status"] == "cancelled"
    assert get_run(conn, last)["status"] == "failed"
    assert get_run(conn, last)["error"] == "lease expired"
