"""Postgres crashes (immediate shutdown, WAL replay on restart) under worker processes that are
busy claiming and finishing short runs: nothing is lost and no effect is committed twice.

Every claim, effect, checkpoint and finish commits synchronously, so whatever a worker was told
has committed survives the crash. Runs on a private cluster of its own."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from leasework import App, Config, db
from leasework.workers.worker import Worker

from ..conftest import wait_for
from ..pgcluster import Cluster, private_cluster

RUNS = 1500
CRASHES = 3

app = App()


@app.task("effect")
def effect(ctx: Any, payload: Any) -> None:
    # The effect and its checkpoint commit together (fenced), so a retry skips a done step.
    if ctx.processed == 0:
        with ctx.transaction() as conn:
            conn.execute("INSERT INTO public.crash_effects (run_id) VALUES (%s)", (ctx.run_id,))
            ctx.checkpoint(1)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    with private_cluster("leasework-pgcrash-") as c:
        yield c


def _work(dsn: str) -> None:
    """A worker, started again when it dies of the dead server (the supervisor's job)."""
    cfg = Config(dsn=dsn, poll_interval=0.1, lease=3.0, renew_interval=1.0, control_interval=0.5)
    while True:
        try:
            Worker(app.with_config(cfg), cfg, register=False).run()
        except Exception:
            time.sleep(0.2)


def test_postgres_crash_loses_nothing_and_commits_no_effect_twice(cluster: Cluster) -> None:
    with psycopg.connect(cluster.dsn, autocommit=True) as conn:
        db.migrate(conn)
        conn.execute("CREATE TABLE public.crash_effects (run_id bigint NOT NULL)")
        conn.execute(
            "INSERT INTO leasework.runs (kind, payload, max_attempts)"
            " SELECT 'effect', '{}', 100 FROM generate_series(1, %s)",
            (RUNS,),
        )
    ctx = mp.get_context("fork")
    workers = [ctx.Process(target=_work, args=(cluster.dsn,), daemon=True) for _ in range(2)]
    for w in workers:
        w.start()

    def settled() -> int:
        with psycopg.connect(cluster.dsn, autocommit=True, connect_timeout=3) as c:
            row = c.execute(
                "SELECT count(*) FROM leasework.runs WHERE status = 'succeeded'"
            ).fetchone()
        assert row is not None
        return int(row[0])

    try:
        for i in range(CRASHES):
            floor = (i + 1) * RUNS // (CRASHES + 2)
            wait_for(lambda floor=floor: settled() >= floor, timeout=60)
            cluster.crash()
            time.sleep(0.2)  # the workers meet a dead server for a moment
            cluster.start()
        wait_for(lambda: settled() == RUNS, timeout=90, interval=0.2)
    finally:
        for w in workers:
            if w.pid is not None and w.is_alive():
                os.kill(w.pid, signal.SIGKILL)
            w.join(5)
    with psycopg.connect(cluster.dsn, autocommit=True) as conn:
        statuses = dict(
            conn.execute("SELECT status, count(*) FROM leasework.runs GROUP BY 1").fetchall()
        )
        assert statuses == {"succeeded": RUNS}, statuses
        twice = conn.execute(
            "SELECT count(*) FROM (SELECT run_id FROM public.crash_effects"
            " GROUP BY run_id HAVING count(*) > 1) d"
        ).fetchone()
        assert twice == (0,), "an effect was committed twice"
        once = conn.execute("SELECT count(DISTINCT run_id) FROM public.crash_effects").fetchone()
        assert once == (RUNS,), "a run succeeded without its effect"
