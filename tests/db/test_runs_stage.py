"""The runs stage through a worker's poll on real Postgres: a poll claims at most the stage's
limit and only the kinds the app serves, and the same poll settles expired runs (cancel beats
reclaim; expiry on the last attempt fails the run). The lease statements themselves are tested
in tests/db/lease/, one file per rule (the combined seal-and-claim in test_seal_and_claim.py);
batches in test_batch.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg

from leasework import App
from leasework.leases import lease
from leasework.stages.runs import RunsStage
from leasework.workers.worker import Worker

from ..conftest import expire_lease, get_run

Conn = psycopg.Connection[Any]
MakeWorker = Callable[..., Worker]


class Tick:
    """A stage that finds `work` items every poll (1: it never rests; 0: it rests a
    poll_interval after each poll)."""

    name = "tick"
    wakes: frozenset[str] = frozenset()
    limit = 1

    def __init__(self, work: int) -> None:
        self.work = work

    def step(self, site: Any) -> int:
        return self.work


def statuses(conn: Conn, ids: list[int]) -> list[str]:
    return [get_run(conn, i)["status"] for i in ids]


def test_poll_claims_at_most_its_limit_while_another_stage_is_due_and_only_its_kinds(
    conn: Conn, make_worker: MakeWorker
) -> None:
    app = App()
    app.task("job")(lambda ctx, payload: None)
    ids = [app.enqueue(conn, "job") for _ in range(5)]
    conn.execute(
        "INSERT INTO leasework.runs (kind) VALUES ('somebody_elses_kind')"
    )  # a kind this app does not serve
    worker = make_worker(app, runs_limit=2)
    worker.stages = [RunsStage(app, limit=2), Tick(1)]  # another stage with work at every poll
    worker.poll()
    assert statuses(conn, ids) == ["succeeded"] * 2 + ["queued"] * 3
    worker.poll()
    assert statuses(conn, ids) == ["succeeded"] * 4 + ["queued"]
    worker.poll()
    assert statuses(conn, ids) == ["succeeded"] * 5
    other = conn.execute(
        "SELECT status FROM leasework.runs WHERE kind = 'somebody_elses_kind'"
    ).fetchone()
    assert other == ("queued",)


def test_past_its_limit_the_chain_goes_on_while_every_other_stage_rests(
    conn: Conn, make_worker: MakeWorker
) -> None:
    """Cutting a busy queue into polls would cost a seal and a claim of their own per cut; while
    no other stage is due, the runs stage goes on past its limit."""
    app = App()
    app.task("job")(lambda ctx, payload: None)
    ids = [app.enqueue(conn, "job") for _ in range(7)]
    worker = make_worker(app, runs_limit=2, poll_interval=3600)
    worker.stages = [RunsStage(app, limit=2), Tick(0)]
    worker.poll()  # a first poll: the other stage has never run, so it is due
    assert statuses(conn, ids) == ["succeeded"] * 2 + ["queued"] * 5
    worker.poll()  # it found nothing and rests for an hour: the chain takes the rest
    assert statuses(conn, ids) == ["succeeded"] * 7


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
