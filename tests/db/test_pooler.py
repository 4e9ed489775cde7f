"""Through a real PgBouncer in transaction mode (tests/pgbouncer.py): leasework finds the pooler
by itself and then holds nothing across transactions (no prepared statement, no session setting,
no LISTEN), while a worker, enqueue, the keeper and the dashboard work as they do direct. Each
check that depends on it is shown to fail without it (the pooler not detected)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import errors

from leasework import App, Context, db
from leasework.config import Config
from leasework.dashboard.web import DashboardApp
from leasework.supervisor import wakeup
from leasework.workers.worker import Worker
from tests.pgbouncer import Bouncer, pgbouncer

from ..conftest import fast_config, get_run, wait_for

Conn = psycopg.Connection[Any]


@pytest.fixture(scope="module")
def bouncer(server_dsn: str) -> Iterator[Bouncer]:
    """One server session per database and user: every client shares it, so anything a client
    leaves on a session is met by the next one."""
    with pgbouncer(server_dsn, pool_size=1) as b:
        yield b


@pytest.fixture(scope="module")
def wide_bouncer(server_dsn: str) -> Iterator[Bouncer]:
    """Enough server sessions that a keeper's renewal never queues behind a handler's
    transaction (docs/operations.md, "Through a pooler")."""
    with pgbouncer(server_dsn, pool_size=10) as b:
        yield b


@pytest.fixture
def effects(conn: Conn) -> Conn:
    conn.execute("CREATE TABLE IF NOT EXISTS public.effects (run_id bigint, step int)")
    conn.execute("TRUNCATE public.effects")
    return conn


def test_the_pooler_is_detected_and_the_setting_forces_either_way(
    dsn: str, bouncer: Bouncer
) -> None:
    pooled = bouncer.dsn(dsn)
    with db.connect(dsn) as direct:
        assert not db.is_pooled(direct)
        assert direct.prepare_threshold is not None
    with db.connect(pooled) as through:
        assert db.is_pooled(through)
        assert through.prepare_threshold is None
    with db.connect(dsn, pooler="on") as forced:
        assert db.is_pooled(forced)
    with db.connect(pooled, pooler="off") as unforced:
        assert not db.is_pooled(unforced)


def test_prepared_statements_break_through_the_pooler_unless_turned_off(
    dsn: str, conn: Conn, bouncer: Bouncer
) -> None:
    """What detection prevents: two clients on one server session both prepare `_pg3_0`."""
    pooled = bouncer.dsn(dsn)
    conn.execute("SELECT 1")  # the database is emptied (and migrated)
    broken = (errors.DuplicatePreparedStatement, errors.InvalidSqlStatementName)
    with (
        db.connect(pooled, pooler="off") as a,
        db.connect(pooled, pooler="off") as b,
        pytest.raises(broken),
    ):
        for c in (a, b, a, b):
            c.execute("SELECT leasework.now()", prepare=True)
    with db.connect(pooled) as a, db.connect(pooled) as b:
        for _ in range(10):
            for c in (a, b):
                c.execute("SELECT leasework.now() + %s * interval '1 s'", (1,), prepare=True)


def test_a_worker_runs_every_job_through_the_pooler(
    dsn: str, effects: Conn, wide_bouncer: Bouncer
) -> None:
    """Claims, checkpoints, fenced transactions, renewals and outcomes, 40 runs through one
    worker (each statement runs far more often than psycopg's prepare threshold)."""
    app = App()

    @app.task("job")
    def job(ctx: Context, payload: Any) -> int:
        for step in range(ctx.processed, 3):
            with ctx.transaction() as tx:
                tx.execute("INSERT INTO public.effects VALUES (%s, %s)", (ctx.run_id, step))
                ctx.checkpoint(step + 1)
            ctx.check()
        return ctx.attempt

    pooled = wide_bouncer.dsn(dsn)
    with db.connect(pooled) as enq:
        ids = [app.enqueue(enq, "job", {"n": i}) for i in range(40)]
    cfg = fast_config(pooled)
    worker = Worker(app.with_config(cfg), cfg, keeper_thread=True)
    worker.open()
    worker.running = True
    try:
        assert worker.conns.behind_pooler
        wait_for(lambda: worker.poll() == 0 and _all_done(effects, ids), timeout=120)
    finally:
        worker.close()
    assert {get_run(effects, i)["status"] for i in ids} == {"succeeded"}
    counts = effects.execute(
        "SELECT count(*), count(DISTINCT (run_id, step)) FROM public.effects"
    ).fetchone()
    assert counts == (120, 120)


def _all_done(conn: Conn, ids: list[int]) -> bool:
    row = conn.execute(
        "SELECT count(*) FROM leasework.runs WHERE id = ANY(%s) AND status <> 'succeeded'", (ids,)
    ).fetchone()
    return row is not None and row[0] == 0


def test_enqueue_through_the_pooler_reads_its_key_back(dsn: str, conn: Conn, bouncer: Bouncer) -> None:
    app = App()
    app.task("job")(lambda ctx, payload: None)
    with db.connect(bouncer.dsn(dsn)) as c:
        first = app.enqueue(c, "job", {}, key="k1")
        for _ in range(8):
            assert app.enqueue(c, "job", {}, key="k1") == first
    assert get_run(conn, first)["status"] == "queued"
    with db.connect(bouncer.dsn(dsn)) as c, c.transaction():
        many = app.enqueue_many(c, "job", [{"i": i} for i in range(50)])  # COPY
        keyed = app.enqueue_many(c, "job", [{}, {}], keys=["k1", "k2"])  # k1 is busy
    assert len(many) == 50 and len(keyed) == 1
    assert get_run(conn, keyed[0])["key"] == "k2"


def test_no_listen_behind_the_pooler_but_over_listen_dsn(
    dsn: str, conn: Conn, wide_bouncer: Bouncer
) -> None:
    """Behind the pooler an idle worker polls (a LISTEN would be left on a server session no one
    reads); with listen_dsn it LISTENs there and a NOTIFY through the pooler wakes it."""
    app = App()
    app.task("job")(lambda ctx, payload: None)
    pooled = wide_bouncer.dsn(dsn)

    def worker(cfg: Config) -> Worker:
        w = Worker(app.with_config(cfg), cfg, keeper_thread=False)
        w.open()
        return w

    polling = worker(fast_config(pooled))
    try:
        assert polling.conns.wake.idle_wait(0.05) == set()
        assert _listeners(conn) == 0
    finally:
        polling.close()

    refused = worker(fast_config(pooled, listen_dsn=pooled))  # a pooled listen_dsn is refused
    try:
        assert refused.conns.wake.idle_wait(0.05) == set()
        assert _listeners(conn) == 0
    finally:
        refused.close()

    listening = worker(fast_config(pooled, listen_dsn=dsn))
    try:
        assert listening.conns.wake.idle_wait(0.05) == set()  # LISTEN is issued on its first wait
        assert _listeners(conn) == 1
        with db.connect(pooled) as c:
            app.enqueue(c, "job", {})
        assert wait_for(lambda: listening.conns.wake.idle_wait(0.5), timeout=10) == {"job"}
    finally:
        listening.close()


def _listeners(conn: Conn) -> int:
    """Sessions of workers that ran LISTEN (their last statement)."""
    row = conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND query ILIKE 'LISTEN %%'"
    ).fetchone()
    return int(row[0]) if row else 0


def test_the_dashboard_leaves_no_setting_on_the_pooled_session(
    dsn: str, conn: Conn, bouncer: Bouncer
) -> None:
    """Every page through the pooler; afterwards the one server session is as it was (a session
    `SET default_transaction_read_only` would now refuse the next client's writes)."""
    pooled = bouncer.dsn(dsn)
    cfg = Config(dsn=pooled)
    app = App(cfg)
    app.task("job")(lambda ctx, payload: None)
    web = DashboardApp(cfg, app=app, actions=True)
    for _ in range(6):  # past psycopg's prepare threshold
        web.overview()
        web.runs({})
        web.metrics()
    # An action's session writes, in its own transaction, through the pooler too.
    assert "paused" in web.act_on_kind("pause", "job")
    assert "resumed" in web.act_on_kind("resume", "job")
    with db.connect(pooled) as c:
        assert c.execute("SHOW default_transaction_read_only").fetchone() == ("off",)
        assert c.execute("SHOW statement_timeout").fetchone() == ("0",)
        c.execute("CREATE TABLE IF NOT EXISTS public.after_dashboard (x int)")
        c.execute("DROP TABLE public.after_dashboard")


def test_the_worker_leaves_no_setting_on_the_pooled_session(
    dsn: str, conn: Conn, bouncer: Bouncer
) -> None:
    app = App()
    app.task("job")(lambda ctx, payload: None)
    pooled = bouncer.dsn(dsn)
    cfg = fast_config(pooled)
    with Worker(app.with_config(cfg), cfg, keeper_thread=False) as w:
        w.running = True
        w.poll()
        assert w.conns.behind_pooler
        with db.connect(pooled) as c:
            assert c.execute("SHOW plan_cache_mode").fetchone() == ("auto",)


def test_wake_ups_relayed_by_the_parent_end_an_idle_wait(dsn: str, wide_bouncer: Bouncer) -> None:
    """Under the supervisor with listen_dsn, a child behind the pooler waits on the pipe its
    parent relays NOTIFYs through (supervisor/wakeup.py), not on a connection of its own."""
    app = App()
    app.task("job")(lambda ctx, payload: None)
    cfg = fast_config(wide_bouncer.dsn(dsn), listen_dsn=dsn)
    r, w = os.pipe()
    os.set_blocking(r, False)
    with Worker(app.with_config(cfg), cfg, keeper_thread=False) as worker:
        worker.conns.wake.relay_fd = r
        wakeup.send(w, b"job\nupload\n")
        assert worker.conns.wake.idle_wait(30) == {"job"}  # a payload no stage serves is dropped
        wakeup.send(w, wakeup.WAKE_ALL)  # a fast release, the relay reconnected: no kind
        assert worker.conns.wake.idle_wait(30) == set()
        assert worker.conns.wake.stray  # so the worker asks every stage
        assert worker.conns.wake._listener is None  # no connection of its own for LISTEN
        os.close(w)
        assert worker.conns.wake.idle_wait(0.01) == set()
        assert worker.conns.wake.relay_fd is None  # the parent is gone: it polls


def test_behind_the_pooler_without_listen_an_idle_worker_still_polls_every_poll_interval(
    dsn: str, conn: Conn, wide_bouncer: Bouncer
) -> None:
    """Nothing could end a long idle sleep there (no LISTEN): every stage rests poll_interval at
    most, whatever idle_poll_max, and a run whose NOTIFY nobody hears is found by polling. With
    a direct listen_dsn the same worker may sleep until something is due."""
    app = App()
    app.task("job")(lambda ctx, payload: None)
    pooled = wide_bouncer.dsn(dsn)
    cfg = fast_config(pooled, poll_interval=0.2, idle_poll_max=60.0)
    polling = Worker(app.with_config(cfg), cfg, keeper_thread=False)
    polling.open()
    thread = threading.Thread(target=polling.run, daemon=True)
    try:
        assert polling.poll() == 0
        assert not polling.conns.wake.can_wake
        assert polling.idle_timeout(time.monotonic()) <= 0.2
        thread.start()
        with db.connect(pooled) as c:
            run_id = app.enqueue(c, "job", {})
        wait_for(lambda: get_run(conn, run_id)["status"] == "succeeded", timeout=10)
    finally:
        polling.stop(graceful=False)
        if thread.is_alive():
            thread.join(10)
        polling.close()

    cfg = fast_config(pooled, poll_interval=0.2, idle_poll_max=60.0, listen_dsn=dsn)
    listening = Worker(app.with_config(cfg), cfg, keeper_thread=False)
    listening.open()
    try:
        assert listening.poll() == 0
        assert listening.conns.wake.can_wake
        assert listening.idle_timeout(time.monotonic()) > 30
    finally:
        listening.close()
