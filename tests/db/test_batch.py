"""Batches for short tasks (`@app.task(kind, batch=N)`): N runs claimed in one statement, each
executed one at a time under its own lease and fence, the successes finished in one owner-scoped
statement, failures through the normal per-run path, a lost lease in the batch writing nothing
for that run, and runs not started released when the worker stops."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from leasework import App, ConfigError, Context
from leasework.leases import lease
from leasework.workers.worker import Worker

from ..conftest import expire_lease, get_run

Conn = psycopg.Connection[Any]
MakeWorker = Callable[..., Worker]


@pytest.fixture
def effects(conn: Conn) -> Conn:
    conn.execute("CREATE TABLE IF NOT EXISTS public.batch_effects (run_id bigint, owner uuid)")
    conn.execute("TRUNCATE public.batch_effects")
    return conn


def effect_runs(conn: Conn) -> list[int]:
    rows = conn.execute("SELECT run_id FROM public.batch_effects ORDER BY run_id").fetchall()
    return [r[0] for r in rows]


def steal(dsn: str, run_id: int) -> lease.Claim:
    """Another worker takes the run over, as if this one had been paused past its lease."""
    with psycopg.connect(dsn, autocommit=True) as c:
        expire_lease(c, run_id)
        claims = lease.claim_runs(c, ["short"], worker="thief", lease=30.0)
    assert [cl.id for cl in claims] == [run_id]
    return claims[0]


def test_batch_must_be_a_sane_integer() -> None:
    app = App()
    for bad in (0, -1, 1001, 2.0, True, "5"):
        with pytest.raises(ConfigError, match="batch"):
            app.task("short", batch=bad)  # type: ignore[arg-type]


def test_one_claim_takes_the_batch_and_each_run_is_fenced(
    conn: Conn, dsn: str, effects: Conn, make_worker: MakeWorker
) -> None:
    app = App()
    seen: list[dict[str, Any]] = []

    @app.task("short", batch=5)
    def short(ctx: Context, payload: Any) -> dict[str, Any]:
        with psycopg.connect(dsn, autocommit=True) as c:
            rows = c.execute(
                "SELECT id, status, lease_owner, lease_worker FROM leasework.runs ORDER BY id"
            ).fetchall()
        seen.append({"run": ctx.run_id, "rows": rows})
        with ctx.transaction() as tx:
            tx.execute(
                "INSERT INTO public.batch_effects VALUES (%s, %s)", (ctx.run_id, ctx.claim.owner)
            )
        return {"n": payload["n"]}

    ids = [app.enqueue(conn, "short", {"n": i}) for i in range(5)]
    worker = make_worker(app, runs_limit=1)
    assert worker.poll() == 5
    # While the first run executed, all five were running under this worker, each with its own
    # owner token: one claim took the whole batch (runs_limit=1 allows one claim per poll).
    first = seen[0]["rows"]
    assert [r[1] for r in first] == ["running"] * 5
    assert len({r[2] for r in first}) == 5 and {r[3] for r in first} == {worker.id}
    assert [s["run"] for s in seen] == ids
    for i, run_id in enumerate(ids):
        row = get_run(conn, run_id)
        assert row["status"] == "succeeded" and row["result"] == {"n": i}
        assert row["lease_owner"] is None and row["finished_at"] is not None
        assert [h["outcome"] for h in row["history"]] == ["succeeded"]
    # Each effect was written in a transaction fenced by its own run's owner token.
    owners = dict(conn.execute("SELECT run_id, owner FROM public.batch_effects").fetchall())
    assert owners == {r[0]: r[2] for r in first}


def test_a_lost_lease_in_the_batch_writes_nothing_for_that_run(
    conn: Conn, dsn: str, effects: Conn, make_worker: MakeWorker
) -> None:
    """Run 2 is taken over after it succeeded but before the batch's finish; run 4 before it
    starts its fenced transaction. Neither gets anything from this worker; the rest succeed."""
    app = App()
    thieves: dict[int, lease.Claim] = {}
    ids: list[int] = []

    @app.task("short", batch=5)
    def short(ctx: Context, payload: Any) -> str:
        if ctx.run_id == ids[2]:
            thieves[ids[1]] = steal(dsn, ids[1])  # already done, its success not yet written
        if ctx.run_id == ids[3]:
            thieves[ids[3]] = steal(dsn, ids[3])  # itself, mid-run
        with ctx.transaction() as tx:
            tx.execute(
                "INSERT INTO public.batch_effects VALUES (%s, %s)", (ctx.run_id, ctx.claim.owner)
            )
        return "mine"

    ids.extend(app.enqueue(conn, "short", {"n": i}) for i in range(5))
    make_worker(app, runs_limit=1).poll()
    for i in (0, 2, 4):
        assert get_run(conn, ids[i])["status"] == "succeeded"
    for stolen in (ids[1], ids[3]):
        row = get_run(conn, stolen)
        assert row["status"] == "running" and row["lease_owner"] == thieves[stolen].owner
        assert row["lease_worker"] == "thief" and row["result"] is None
    assert effect_runs(conn) == [ids[0], ids[1], ids[2], ids[4]], "run 4's fence let it write"
    # The thief's own finish lands.
    assert lease.finish_many(conn, [(thieves[ids[1]], "thief's")]) == {ids[1]}
    assert get_run(conn, ids[1])["result"] == "thief's"


def test_mixed_success_and_failure(conn: Conn, make_worker: MakeWorker) -> None:
    app = App()

    @app.task("short", batch=4, max_attempts=3)
    def short(ctx: Context, payload: Any) -> int:
        if payload["fail"]:
            raise ValueError(f"boom {payload['n']}")
        return int(payload["n"])

    ids = [app.enqueue(conn, "short", {"n": i, "fail": i % 2 == 1}) for i in range(4)]
    assert make_worker(app, runs_limit=1).poll() == 4
    for i, run_id in enumerate(ids):
        row = get_run(conn, run_id)
        if i % 2:
            assert row["status"] == "queued" and row["attempts"] == 1
            assert row["error"].startswith(f"ValueError: boom {i}")
            assert [h["outcome"] for h in row["history"]] == ["failed"]
        else:
            assert row["status"] == "succeeded" and row["result"] == i
            assert row["error"] is None


def test_runs_not_started_are_released_when_the_worker_stops(
    conn: Conn, make_worker: MakeWorker
) -> None:
    app = App()
    started: list[int] = []
    worker: list[Worker] = []

    @app.task("short", batch=5)
    def short(ctx: Context, payload: Any) -> None:
        started.append(ctx.run_id)
        if len(started) == 2:
            worker[0].drain()  # recycling: stop after the run in hand

    ids = [app.enqueue(conn, "short") for _ in range(5)]
    worker.append(make_worker(app, runs_limit=1))
    worker[0].poll()
    assert started == ids[:2]
    assert [get_run(conn, i)["status"] for i in ids] == ["succeeded"] * 2 + ["queued"] * 3
    for run_id in ids[2:]:
        row = get_run(conn, run_id)
        assert row["attempts"] == 0 and row["lease_owner"] is None, "a release charged an attempt"


def test_runs_waiting_in_the_batch_are_renewed_and_a_lost_one_never_starts(
    conn: Conn, dsn: str, make_worker: MakeWorker
) -> None:
    """With a third of the lease gone by, the successes so far are written and the runs not yet
    started are renewed; one taken over meanwhile is skipped, its handler never called."""
    app = App()
    started: list[int] = []
    ids: list[int] = []
    thief: list[lease.Claim] = []

    @app.task("short", batch=4)
    def short(ctx: Context, payload: Any) -> None:
        started.append(ctx.run_id)
        if ctx.run_id == ids[0]:
            thief.append(steal(dsn, ids[2]))
        with psycopg.connect(dsn, autocommit=True) as c:  # the lease is a third gone by
            c.execute(
                "UPDATE leasework.runs SET lease_expires_at = lease_expires_at - interval '20 s'"
                " WHERE lease_worker <> 'thief'"
            )

    ids.extend(app.enqueue(conn, "short") for _ in range(4))
    make_worker(app, runs_limit=1, renew_interval=0.001).poll()
    assert started == [ids[0], ids[1], ids[3]]
    row = get_run(conn, ids[2])
    assert row["lease_owner"] == thief[0].owner and row["status"] == "running"
    assert [get_run(conn, i)["status"] for i in (ids[0], ids[1], ids[3])] == ["succeeded"] * 3


def test_the_renewal_keeps_a_waiting_run_from_reclaim(conn: Conn, make_worker: MakeWorker) -> None:
    """The waiting runs' leases move forward: after the renewal none is reclaimable."""
    app = App()
    expiries: list[list[Any]] = []

    @app.task("short", batch=3)
    def short(ctx: Context, payload: Any) -> None:
        with psycopg.connect(conn.info.dsn, autocommit=True) as c:
            expiries.append(
                [
                    r[0] > r[1]
                    for r in c.execute(
                        "SELECT lease_expires_at, leasework.now() + interval '25 s'"
                        " FROM leasework.runs WHERE status = 'running' ORDER BY id"
                    ).fetchall()
                ]
            )
            # Age every lease to 5 s left: without renewal the next run would start on one that
            # a rival could reclaim any moment.
            c.execute(
                "UPDATE leasework.runs SET lease_expires_at = leasework.now() + interval '5 s'"
                " WHERE status = 'running'"
            )

    for _ in range(3):
        app.enqueue(conn, "short")
    make_worker(app, runs_limit=1, renew_interval=0.001).poll()
    # From the second run on, every lease still held was renewed to the full 30 s.
    assert all(expiries[1]) and all(expiries[2])


def test_finish_many_stores_each_result_as_the_handler_returned_it(conn: Conn) -> None:
    # The batch's arrays reach the server as text (wire.array_text): quotes, backslashes,
    # braces, commas, NULL-looking strings and no result at all must come through unchanged.
    app = App()
    app.task("k")(lambda ctx, p: None)
    results: list[Any] = [
        {"quote": 'say "hi"', "slash": "a\\b", "braces": "{1,2}", "null": "NULL"},
        None,
        ["x, y", "é", ""],
        'a "string" \\ alone',
        0,
    ]
    ids = [app.enqueue(conn, "k", {}) for _ in results]
    claims = lease.claim_runs(conn, ["k"], worker="w1", lease=30.0, limit=len(ids))
    by_id = {c.id: c for c in claims}

    sealed = lease.finish_many(conn, [(by_id[i], r) for i, r in zip(ids, results, strict=True)])

    assert sealed == set(ids)
    assert [get_run(conn, i)["result"] for i in ids] == results


def test_finish_many_pairs_each_id_with_its_own_owner_and_keeps_results_when_none_is_returned(
    conn: Conn,
) -> None:
    # Each run's owner is read at its own id's position: two runs of the batch with their
    # owners swapped are both someone else's and neither is written. A batch that returned no
    # result at all (sent as NULL, not an array) keeps what each run gathered so far.
    app = App()
    app.task("k")(lambda ctx, p: None)
    ids = [app.enqueue(conn, "k", {}) for _ in range(3)]
    claims = {c.id: c for c in lease.claim_runs(conn, ["k"], worker="w1", lease=30.0, limit=3)}
    conn.execute(
        "UPDATE leasework.runs SET result = '{\"gathered\": 1}' WHERE id = %s", (ids[2],)
    )
    a, b = claims[ids[0]], claims[ids[1]]
    swapped = [
        (dataclasses.replace(a, owner=b.owner), None),
        (dataclasses.replace(b, owner=a.owner), None),
    ]

    assert lease.finish_many(conn, swapped) == set()
    assert [get_run(conn, i)["status"] for i in ids[:2]] == ["running", "running"]

    assert lease.finish_many(conn, [(claims[i], None) for i in ids]) == set(ids)
    assert [get_run(conn, i)["result"] for i in ids] == [None, None, {"gathered": 1}]


def test_a_batch_logs_its_slow_successes_and_lost_leases_not_its_quick_ones(
    conn: Conn, dsn: str, make_worker: MakeWorker
) -> None:
    """At info (the default), a batch's quick successes write no line; a success that took
    log_runs_slower_than or longer does, and a success whose lease was lost before the batch's
    finish always does (lease_lost)."""
    app = App()
    ids: list[int] = []

    @app.task("short", batch=3)
    def short(ctx: Context, payload: Any) -> None:
        if ctx.run_id == ids[2]:
            steal(dsn, ids[0])  # done, its success not yet written

    seen: list[tuple[str, int, dict[str, Any]]] = []

    class Events(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append((record.getMessage(), record.levelno, getattr(record, "fields", {})))

    logger = logging.getLogger("leasework")
    handler, level = Events(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        ids.extend(app.enqueue(conn, "short") for _ in range(3))
        make_worker(app, runs_limit=1).poll()  # the default threshold: 1 s, far above a no-op
        assert [e[0] for e in seen if e[0] == "run_succeeded"] == []
        assert [(e[1], e[2]["run_id"]) for e in seen if e[0] == "lease_lost"] == [
            (logging.INFO, ids[0])
        ]
        seen.clear()
        ids[:] = [app.enqueue(conn, "short") for _ in range(3)]
        make_worker(app, runs_limit=1, log_runs_slower_than=0).poll()  # every success is slow
        succeeded = [(e[1], e[2]["run_id"]) for e in seen if e[0] == "run_succeeded"]
        assert succeeded == [(logging.INFO, ids[1]), (logging.INFO, ids[2])]
    finally:
        logger.setLevel(level)
        logger.removeHandler(handler)
