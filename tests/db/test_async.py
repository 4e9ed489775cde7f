"""Async handlers on real Postgres: several runs at once per worker on one event loop, each under
its own lease. Concurrency caps (the worker's, a kind's), outcomes, cancel / timeout / lost lease
reaching a run that never awaits ctx.check() (its task is cancelled), a cancel landing during
leasework's own statement delivered after it, never inside (tests/mutants.py), the fenced
transaction and checkpoints on the async pool, a blocking call detected, a graceful and a fast
stop, and the registration checks."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import psycopg
import pytest
from psycopg import sql

from leasework import Aborted, App, Config, ConfigError, LeaseLost, Retry
from leasework.config import parse_pools
from leasework.leases import lease
from leasework.testing import run_task
from leasework.workers.acontext import AsyncContext
from leasework.workers.aexecutor import LAG_WARN, TICK
from leasework.workers.worker import Worker

from ..conftest import expire_lease, get_run, wait_for

Conn = psycopg.Connection[Any]
MakeWorker = Callable[..., Worker]
QUICK = {"lease": 3.0, "renew_interval": 0.5, "control_interval": 0.2, "keeper_thread": True}


@contextmanager
def serving(worker: Worker, *, graceful: bool = True) -> Iterator[threading.Thread]:
    """`worker.run()` on a thread of its own (its event loop there) until the block ends."""
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        worker.stop(graceful=graceful)
        thread.join(30)
        assert not thread.is_alive(), "the worker did not stop"


def statuses(conn: Conn) -> dict[str, int]:
    rows = conn.execute("SELECT status, count(*) FROM leasework.runs GROUP BY 1").fetchall()
    return {r[0]: r[1] for r in rows}


def all_succeeded(conn: Conn, n: int) -> Callable[[], bool]:
    return lambda: statuses(conn) == {"succeeded": n}


# -- running several at once -----------------------------------------------------------------


def test_runs_execute_concurrently_up_to_the_kinds_concurrency(
    conn: Conn, make_worker: MakeWorker
) -> None:
    app = App()
    live, peak = [0], [0]
    full = asyncio.Event()

    @app.task("io", concurrency=5)
    async def io(ctx: AsyncContext, payload: Any) -> int:
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        if live[0] == 5:
            full.set()
        # Every run waits until five are in flight at once (or a deadline): run one at a time,
        # this would take the deadline per run.
        await asyncio.wait_for(full.wait(), timeout=10)
        live[0] -= 1
        return int(payload) * 2

    ids = [app.enqueue(conn, "io", i) for i in range(20)]
    worker = make_worker(app, **QUICK)
    assert worker.asynchronous
    started = time.monotonic()
    with serving(worker):
        wait_for(all_succeeded(conn, 20), timeout=60)
    assert peak[0] == 5, f"at most the kind's concurrency at once, got {peak[0]}"
    assert time.monotonic() - started < 30  # never one deadline per run
    assert [get_run(conn, i)["result"] for i in ids] == [i * 2 for i in range(20)]
    rows = conn.execute(
        "SELECT count(*) FROM leasework.runs WHERE lease_owner IS NULL AND attempts = 1"
    ).fetchone()
    assert rows is not None and rows[0] == 20


def test_the_workers_concurrency_caps_every_async_kind_together(
    conn: Conn, make_worker: MakeWorker
) -> None:
    app = App()
    live, peak = [0], [0]

    async def body() -> None:
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        await asyncio.sleep(0.05)
        live[0] -= 1

    @app.task("a", concurrency=8)
    async def a(ctx: AsyncContext, payload: Any) -> None:
        await body()

    @app.task("b", concurrency=8)
    async def b(ctx: AsyncContext, payload: Any) -> None:
        await body()

    for i in range(15):
        app.enqueue(conn, "a", i)
        app.enqueue(conn, "b", i)
    worker = make_worker(app, concurrency=3, **QUICK)
    with serving(worker):
        wait_for(all_succeeded(conn, 30), timeout=60)
    assert peak[0] == 3


def test_a_poll_outside_the_loop_runs_its_claims_to_the_end(
    conn: Conn, make_worker: MakeWorker
) -> None:
    """`Worker.poll()` called directly (tests, benchmarks): the claimed runs end within it."""
    app = App()

    @app.task("io", concurrency=4)
    async def io(ctx: AsyncContext, payload: Any) -> str:
        await asyncio.sleep(0.01)
        return "done"

    for i in range(6):
        app.enqueue(conn, "io", i)
    worker = make_worker(app)
    worker.poll()
    assert statuses(conn) == {"succeeded": 4, "queued": 2}
    worker.poll()
    assert statuses(conn) == {"succeeded": 6}


def test_sync_and_async_kinds_in_one_worker(conn: Conn, make_worker: MakeWorker) -> None:
    app = App()

    @app.task("plain")
    def plain(ctx: Any, payload: Any) -> str:
        return "sync"

    @app.task("io")
    async def io(ctx: AsyncContext, payload: Any) -> str:
        await asyncio.sleep(0)
        return "async"

    p = app.enqueue(conn, "plain")
    a = app.enqueue(conn, "io")
    with serving(make_worker(app, **QUICK)):
        wait_for(all_succeeded(conn, 2), timeout=30)
    assert get_run(conn, p)["result"] == "sync"
    assert get_run(conn, a)["result"] == "async"


# -- outcomes -----------------------------------------------------------------------------------


def test_failures_retry_and_partial_results_as_for_sync_handlers(
    conn: Conn, make_worker: MakeWorker
) -> None:
    app = App()

    @app.task("flaky", max_attempts=2)
    async def flaky(ctx: AsyncContext, payload: Any) -> None:
        ctx.result = {"seen": ctx.attempt}
        raise ValueError("upstream said no")

    @app.task("later")
    async def later(ctx: AsyncContext, payload: Any) -> None:
        raise Retry(3600, "not yet")

    f = app.enqueue(conn, "flaky")
    r = app.enqueue(conn, "later")
    worker = make_worker(app)
    worker.poll()
    row = get_run(conn, f)
    assert row["status"] == "queued" and row["attempts"] == 1
    assert row["error"].startswith("ValueError: upstream said no")
    assert row["result"] == {"seen": 1}
    later_row = get_run(conn, r)
    assert later_row["status"] == "queued" and later_row["history"][-1]["outcome"] == "retry"


def test_keyword_only_async_handlers_get_the_payload_spread(
    conn: Conn, make_worker: MakeWorker
) -> None:
    app = App()

    @app.task("greet")
    async def greet(ctx: AsyncContext, *, name: str, times: int = 1) -> str:
        return " ".join([f"hi {name}"] * times)

    run_id = greet.enqueue(conn, name="ada", times=2)
    make_worker(app).poll()
    assert get_run(conn, run_id)["result"] == "hi ada hi ada"


def test_a_result_that_cannot_be_stored_fails_the_attempt(
    conn: Conn, make_worker: MakeWorker
) -> None:
    app = App()

    @app.task("odd")
    async def odd(ctx: AsyncContext, payload: Any) -> float:
        return float("nan")

    run_id = app.enqueue(conn, "odd")
    make_worker(app).poll()
    row = get_run(conn, run_id)
    assert row["status"] == "queued" and "nan" in row["error"].lower()


# -- stopping a run that never awaits ctx.check() ---------------------------------------------


def when_running(dsn: str, run_id: int, act: Callable[[Conn], Any]) -> threading.Thread:
    def go() -> None:
        with psycopg.connect(dsn, autocommit=True) as c:
            wait_for(lambda: get_run(c, run_id)["status"] == "running", timeout=30)
            act(c)

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread


def test_a_cancel_cancels_the_task_of_a_run_that_never_checks(
    conn: Conn, make_worker: MakeWorker, dsn: str
) -> None:
    app = App()
    told: list[str] = []
    others: list[int] = []

    @app.task("sleepy")
    async def sleepy(ctx: AsyncContext, payload: Any) -> None:
        if payload == "victim":
            try:
                await asyncio.sleep(120)
            except asyncio.CancelledError:
                told.append("cancelled")
                raise
        else:
            await asyncio.sleep(0.2)
            others.append(ctx.run_id)

    victim = app.enqueue(conn, "sleepy", "victim")
    rest = [app.enqueue(conn, "sleepy", i) for i in range(3)]
    canceller = when_running(dsn, victim, lambda c: App().cancel(c, victim))
    started = time.monotonic()
    with serving(make_worker(app, **QUICK)):
        wait_for(lambda: get_run(conn, victim)["status"] == "cancelled", timeout=60)
        wait_for(lambda: all(get_run(conn, i)["status"] == "succeeded" for i in rest), timeout=60)
    canceller.join(5)
    assert told == ["cancelled"]
    assert time.monotonic() - started < 60
    assert sorted(others) == sorted(rest), "the other runs of the worker went on"
    row = get_run(conn, victim)
    assert row["history"][-1]["outcome"] == "cancelled"


GATE = 734_215  # the advisory lock a gated session's UPDATE of leasework.runs waits on


@contextmanager
def gated_updates(conn: Conn, dsn: str, application_name: str) -> Iterator[Conn]:
    """Until the block ends or the gate is opened (`pg_advisory_unlock(GATE)` on the connection
    yielded), every UPDATE of leasework.runs sent by a session named `application_name` waits,
    before it touches a row, at a statement trigger: a statement of leasework's held in flight
    while every other session (the keeper, a cancel) goes on."""
    conn.execute(
        sql.SQL(
            """CREATE OR REPLACE FUNCTION public.gate() RETURNS trigger LANGUAGE plpgsql AS $$
               BEGIN
                   IF current_setting('application_name') = TG_ARGV[0] THEN
                       PERFORM pg_advisory_xact_lock_shared({});
                   END IF;
                   RETURN NULL;
               END $$"""
        ).format(sql.Literal(GATE))
    )
    conn.execute(
        sql.SQL(
            "CREATE TRIGGER gate BEFORE UPDATE ON leasework.runs"
            " FOR EACH STATEMENT EXECUTE FUNCTION public.gate({})"
        ).format(sql.Literal(application_name))
    )
    try:
        with psycopg.connect(dsn, autocommit=True) as holder:
            holder.execute("SELECT pg_advisory_lock(%s)", (GATE,))
            yield holder
    finally:
        conn.execute("DROP TRIGGER gate ON leasework.runs")


def test_a_cancel_that_arrives_during_leaseworks_statement_is_delivered_after_it(
    conn: Conn, make_worker: MakeWorker, dsn: str
) -> None:
    """The cancel lands while the handler's task waits inside leasework's own statement (a
    checkpoint, held at a gate in the database): it is not delivered there (the pool connection
    would be given back half-way), and it is delivered at the handler's first await after the
    statement has ended, not deferred for ever."""
    app = App()
    seen: list[str] = []

    @app.task("gated")
    async def gated(ctx: AsyncContext, payload: Any) -> None:
        try:
            await ctx.checkpoint(1)
        except asyncio.CancelledError:
            seen.append("cancelled inside the statement")
            raise
        seen.append("checkpoint written")
        try:
            for _ in range(1000):
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            seen.append("cancelled after the statement")
            raise
        seen.append("never cancelled")

    run_id = app.enqueue(conn, "gated")
    worker = make_worker(app, **QUICK)
    pool_name = f"leasework:{worker.id}"  # the async pool's sessions (workers/aexecutor.py)

    def at_the_gate() -> bool:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s"
            " AND wait_event_type = 'Lock' AND wait_event = 'advisory'",
            (pool_name,),
        ).fetchone()
        return row == (1,)

    with gated_updates(conn, dsn, pool_name) as gate, serving(worker):
        wait_for(at_the_gate, timeout=30)
        held = worker.keeper.get(run_id)  # kept: a cancel delivered at once ends the run
        assert held is not None
        assert App().cancel(conn, run_id) == "running"
        wait_for(lambda: held.interrupted, 30)
        worker.keeper.tend()  # under the keeper's lock: its interrupt has been sent
        loop = worker.aexecutor.loop
        assert loop is not None
        # The loop has run the interrupt's callback (queued before this one).
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(timeout=30)
        assert seen == [], "the cancel was delivered inside leasework's statement"
        assert at_the_gate()
        gate.execute("SELECT pg_advisory_unlock(%s)", (GATE,))
        wait_for(lambda: get_run(conn, run_id)["status"] not in ("queued", "running"), 30)
    assert seen == ["checkpoint written", "cancelled after the statement"], (
        f"the cancel was not delivered after the statement ended: {seen}"
    )
    row = get_run(conn, run_id)
    assert row["status"] == "cancelled" and row["processed_units"] == 1


def test_a_timeout_cancels_the_task_and_the_attempt_fails(
    conn: Conn, make_worker: MakeWorker
) -> None:
    app = App()

    @app.task("slow", timeout=0.5)
    async def slow(ctx: AsyncContext, payload: Any) -> None:
        await asyncio.sleep(120)

    run_id = app.enqueue(conn, "slow")
    with serving(make_worker(app, **QUICK)):
        wait_for(
            lambda: (
                get_run(conn, run_id)["status"] == "queued"
                and get_run(conn, run_id)["attempts"] == 1
            ),
            timeout=60,
        )
    row = get_run(conn, run_id)
    assert row["history"][-1]["outcome"] == "timeout"
    assert row["error"] == "timeout after 0.5 s"


def test_a_lost_lease_cancels_the_task_and_writes_nothing(
    conn: Conn, make_worker: MakeWorker, dsn: str
) -> None:
    app = App()
    told: list[str] = []

    @app.task("job")
    async def job(ctx: AsyncContext, payload: Any) -> str:
        try:
            await asyncio.sleep(120)
        except asyncio.CancelledError:
            told.append(ctx.signal.reason or "")
            raise
        return "never"

    run_id = app.enqueue(conn, "job")
    stolen: list[Any] = []

    def steal(c: Conn) -> None:
        # What a reclaim after the lease ran out does, in one statement: a new owner (with the
        # keeper's thread on, moving the lease first would race its renewal).
        row = c.execute(
            "UPDATE leasework.runs SET lease_owner = gen_random_uuid(), lease_worker = 'thief',"
            " attempts = attempts + 1, lease_expires_at = leasework.now() + interval '30 s'"
            " WHERE id = %s AND status = 'running' RETURNING lease_owner",
            (run_id,),
        ).fetchone()
        stolen.append(row[0] if row else None)

    thief = when_running(dsn, run_id, steal)
    with serving(make_worker(app, **QUICK)):
        thief.join(30)
        wait_for(lambda: told == ["lost"], timeout=60)
    [owner] = stolen
    row = get_run(conn, run_id)
    # The thief's lease stands: the first worker wrote nothing over it.
    assert row["status"] == "running" and row["lease_owner"] == owner is not None
    assert row["lease_worker"] == "thief"


def test_a_handler_that_swallows_the_cancel_still_ends_cancelled(
    conn: Conn, make_worker: MakeWorker, dsn: str
) -> None:
    app = App()

    @app.task("stubborn")
    async def stubborn(ctx: AsyncContext, payload: Any) -> str:
        # A handler that ignores the cancel: what it returns does not count.
        with suppress(asyncio.CancelledError):
            await asyncio.sleep(120)
        return "finished anyway"

    run_id = app.enqueue(conn, "stubborn")
    canceller = when_running(dsn, run_id, lambda c: App().cancel(c, run_id))
    with serving(make_worker(app, **QUICK)):
        wait_for(lambda: get_run(conn, run_id)["status"] == "cancelled", timeout=60)
    canceller.join(5)


def test_await_check_raises_aborted_once_the_signal_tripped(
    conn: Conn, make_worker: MakeWorker, dsn: str
) -> None:
    app = App()
    reasons: list[str] = []

    @app.task("polite")
    async def polite(ctx: AsyncContext, payload: Any) -> None:
        try:
            while True:
                await ctx.check()
                await asyncio.sleep(0.01)
        except Aborted as exc:
            reasons.append(exc.reason)
            raise

    run_id = app.enqueue(conn, "polite")
    canceller = when_running(dsn, run_id, lambda c: App().cancel(c, run_id))
    with serving(make_worker(app, **QUICK)):
        wait_for(lambda: get_run(conn, run_id)["status"] == "cancelled", timeout=60)
    canceller.join(5)
    assert reasons in (["cancelled"], [])  # told by check(), or by the task's cancel


# -- effects and progress -------------------------------------------------------------------------


@pytest.fixture
def effects(conn: Conn) -> Conn:
    conn.execute("CREATE TABLE IF NOT EXISTS public.effects (run_id bigint, step int)")
    conn.execute("TRUNCATE public.effects")
    return conn


def test_the_fenced_transaction_commits_effects_with_the_checkpoint(
    effects: Conn, make_worker: MakeWorker
) -> None:
    app = App()

    @app.task("steps")
    async def steps(ctx: AsyncContext, payload: Any) -> int:
        for step in range(ctx.processed, 3):
            async with ctx.transaction() as tx:
                await tx.execute("INSERT INTO public.effects VALUES (%s, %s)", (ctx.run_id, step))
                await ctx.checkpoint(step + 1, 3)
        return ctx.processed

    run_id = app.enqueue(effects, "steps")
    make_worker(app).poll()
    row = get_run(effects, run_id)
    assert row["status"] == "succeeded" and row["result"] == 3
    assert (row["processed_units"], row["total_units"]) == (3, 3)
    got = effects.execute("SELECT step FROM public.effects ORDER BY step").fetchall()
    assert [r[0] for r in got] == [0, 1, 2]


def test_a_run_resumes_from_its_checkpoint_on_the_next_attempt(
    effects: Conn, make_worker: MakeWorker
) -> None:
    app = App()
    starts: list[int] = []

    @app.task("resumable", max_attempts=2)
    async def resumable(ctx: AsyncContext, payload: Any) -> None:
        starts.append(ctx.processed)
        for step in range(ctx.processed, 4):
            if step == 2 and ctx.attempt == 1:
                raise RuntimeError("crash half-way")
            await ctx.checkpoint(step + 1)

    run_id = app.enqueue(effects, "resumable")
    worker = make_worker(app)
    worker.poll()
    effects.execute(
        "UPDATE leasework.runs SET queued_at = leasework.now() WHERE id = %s", (run_id,)
    )
    worker.poll()
    assert starts == [0, 2]
    assert get_run(effects, run_id)["status"] == "succeeded"


def test_a_fenced_transaction_of_a_run_no_longer_ours_writes_nothing(
    effects: Conn, make_worker: MakeWorker, dsn: str
) -> None:
    app = App()
    raised: list[str] = []

    @app.task("job")
    async def job(ctx: AsyncContext, payload: Any) -> None:
        with psycopg.connect(dsn, autocommit=True) as c:  # another worker took the run
            expire_lease(c, ctx.run_id)
            lease.claim_runs(c, ["job"], worker="thief", lease=30.0)
        try:
            async with ctx.transaction() as tx:
                await tx.execute("INSERT INTO public.effects VALUES (%s, 1)", (ctx.run_id,))
        except LeaseLost as exc:
            raised.append(str(exc))
            raise

    run_id = app.enqueue(effects, "job")
    make_worker(app).poll()
    assert raised and "no longer ours" in raised[0]
    assert effects.execute("SELECT count(*) FROM public.effects").fetchone() == (0,)
    assert get_run(effects, run_id)["lease_worker"] == "thief"


def test_a_cancel_during_the_handlers_own_query_leaves_the_pool_usable(
    effects: Conn, make_worker: MakeWorker, dsn: str
) -> None:
    """The handler is cancelled inside its own `pg_sleep` in a fenced transaction: the query is
    cancelled server-side, the transaction rolled back, and the next run's transaction works."""
    app = App()

    @app.task("db")
    async def dbwork(ctx: AsyncContext, payload: Any) -> None:
        async with ctx.transaction() as tx:
            await tx.execute("INSERT INTO public.effects VALUES (%s, %s)", (ctx.run_id, payload))
            if payload == 1:
                await tx.execute("SELECT pg_sleep(120)")

    first = app.enqueue(effects, "db", 1)
    canceller = when_running(dsn, first, lambda c: App().cancel(c, first))
    worker = make_worker(app, pool_size=2, **QUICK)
    with serving(worker):
        wait_for(lambda: get_run(effects, first)["status"] == "cancelled", timeout=60)
        second = app.enqueue(effects, "db", 2)
        wait_for(lambda: get_run(effects, second)["status"] == "succeeded", timeout=60)
    canceller.join(5)
    got = effects.execute("SELECT run_id, step FROM public.effects").fetchall()
    assert got == [(second, 2)], "the cancelled run's insert rolled back"


# -- the loop and its keeper ----------------------------------------------------------------------


def test_a_blocking_call_keeps_its_lease_and_is_logged_with_its_run(
    conn: Conn, make_worker: MakeWorker, dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A synchronous sleep inside an async handler blocks the loop: the keeper (its own thread)
    still renews the lease, and logs which run holds the loop."""
    app = App()
    expiries: set[Any] = set()

    def logged() -> bool:
        return any(r.getMessage() == "loop_blocked" for r in caplog.records)

    @app.task("blocker")
    async def blocker(ctx: AsyncContext, payload: Any) -> None:
        started = time.monotonic()
        with psycopg.connect(dsn, autocommit=True) as c:
            # Blocked until the keeper has logged the loop blocked (past 1.25 s) and the lease
            # was renewed twice, 20 s at most.
            while (len(expiries) < 3 or not logged()) and (time.monotonic() - started < 20):
                time.sleep(0.1)  # blocking, on purpose
                row = c.execute(
                    "SELECT lease_expires_at FROM leasework.runs WHERE id = %s", (ctx.run_id,)
                ).fetchone()
                expiries.add(row[0] if row else None)

    run_id = app.enqueue(conn, "blocker")
    caplog.set_level(logging.INFO, logger="leasework")
    with serving(make_worker(app, **QUICK)):
        wait_for(lambda: get_run(conn, run_id)["status"] == "succeeded", timeout=60)
    assert len(expiries) >= 3, "the lease was not renewed while the loop was blocked"
    blocked = [r for r in caplog.records if r.getMessage() == "loop_blocked"]
    assert blocked, "the blocked loop was not logged"
    assert blocked[0].fields["run_id"] == run_id  # type: ignore[attr-defined]


def test_a_sync_handler_of_a_mixed_worker_is_not_reported_as_blocking_the_loop(
    conn: Conn, make_worker: MakeWorker, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker serving a sync and an async kind runs the sync handler inline on the loop (README
    "Async handlers", Mixing): the keeper sees the loop stalled, but no async handler holds it,
    so there is no `loop_blocked` (whose hint blames a synchronous call in an async handler) and
    no warning at all."""
    app = App()
    looked = threading.Event()

    @app.task("fetch")
    async def fetch(ctx: AsyncContext, payload: Any) -> None:
        return None

    @app.task("report")
    def report(ctx: Any, payload: Any) -> None:
        # Held until the keeper has looked at the loop stalled past the threshold (20 s at most).
        assert looked.wait(20), "the keeper never looked at the stalled loop"

    worker = make_worker(app, **QUICK)
    ax = worker.aexecutor
    check = ax.check_lag

    def watched(now: float) -> None:  # the keeper's thread, after each of its ticks
        check(now)
        if ax.serving and worker.current is not None and now - ax._turned >= LAG_WARN + TICK:
            looked.set()

    ax.check_lag = watched  # type: ignore[method-assign]
    fetched = app.enqueue(conn, "fetch")
    reported = app.enqueue(conn, "report")
    caplog.set_level(logging.DEBUG, logger="leasework")
    with serving(worker):
        wait_for(
            lambda: {get_run(conn, r)["status"] for r in (fetched, reported)} == {"succeeded"},
            timeout=60,
        )
    assert looked.is_set()
    events = [r.getMessage() for r in caplog.records]
    assert "loop_blocked" not in events, "a sync handler was reported as an async one blocking"
    assert "loop_busy" in events, "the stall was not logged at all (DEBUG)"
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not {"loop_blocked", "loop_lagged"} & set(warned), warned


def test_a_graceful_stop_lets_runs_finish_and_claims_nothing_more(
    conn: Conn, make_worker: MakeWorker
) -> None:
    app = App()
    begun: list[int] = []
    release = threading.Event()

    @app.task("io", concurrency=3)
    async def io(ctx: AsyncContext, payload: Any) -> None:
        begun.append(ctx.run_id)
        while not release.is_set():  # held until the stop is asked
            await asyncio.sleep(0.01)

    for i in range(6):
        app.enqueue(conn, "io", i)
    worker = make_worker(app, graceful_timeout=60, **QUICK)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    wait_for(lambda: len(begun) == 3, timeout=30)
    worker.stop(graceful=True)
    release.set()
    thread.join(60)
    assert not thread.is_alive(), "the worker did not stop"
    assert statuses(conn) == {"succeeded": 3, "queued": 3}


def test_a_stop_past_the_graceful_deadline_releases_every_run(
    conn: Conn, make_worker: MakeWorker
) -> None:
    app = App()
    begun: list[int] = []

    @app.task("io", concurrency=4)
    async def io(ctx: AsyncContext, payload: Any) -> None:
        begun.append(ctx.run_id)
        await asyncio.sleep(120)

    for i in range(4):
        app.enqueue(conn, "io", i)
    worker = make_worker(app, graceful_timeout=0.5, **QUICK)
    with serving(worker):
        wait_for(lambda: len(begun) == 4, timeout=30)
    rows = conn.execute(
        "SELECT status, attempts, history -> -1 ->> 'outcome' FROM leasework.runs"
    ).fetchall()
    assert rows == [("queued", 0, "released")] * 4


def test_the_beat_names_the_run_whose_deadline_comes_first(
    conn: Conn, make_worker: MakeWorker
) -> None:
    app = App()
    begun: list[int] = []

    @app.task("io", concurrency=3)
    async def io(ctx: AsyncContext, payload: Any) -> None:
        begun.append(ctx.run_id)
        await asyncio.sleep(120)

    for i in range(3):
        app.enqueue(conn, "io", i)
    worker = make_worker(app, graceful_timeout=0.1, **QUICK)
    with serving(worker):
        wait_for(lambda: len(begun) == 3, timeout=30)
        with worker.keeper._lock:  # no renewal lands between the two readings
            held, count = worker.keeper.most_urgent()
            runs = worker.keeper.executing_runs()
        assert count == 3 and held is not None and held in runs
        assert held.renewed == min(h.renewed for h in runs)


# -- registration -------------------------------------------------------------------------------


def test_registration_checks() -> None:
    app = App()
    with pytest.raises(ConfigError, match="concurrency= is for async def handlers"):

        @app.task("plain", concurrency=3)
        def plain(ctx: Any, payload: Any) -> None: ...

    with pytest.raises(ConfigError, match="batch= is for plain functions"):

        @app.task("batched", batch=5)
        async def batched(ctx: Any, payload: Any) -> None: ...

    with pytest.raises(ConfigError, match="concurrency must be an integer from 1 to 1000"):

        @app.task("many", concurrency=0)
        async def many(ctx: Any, payload: Any) -> None: ...

    with pytest.raises(ConfigError, match="async generator"):

        @app.task("agen")
        async def agen(ctx: Any, payload: Any) -> Any:
            yield 1

    @app.task("fine", concurrency=7)
    async def fine(ctx: Any, payload: Any) -> None: ...

    assert app.tasks["fine"].concurrency == 7 and app.tasks["fine"].stage == "async"


def test_a_pool_sets_its_childrens_concurrency() -> None:
    [pool] = parse_pools("io:2x20:fetch,upload", "--pool")
    assert (pool.processes, pool.concurrency, pool.kinds) == (2, 20, ("fetch", "upload"))
    assert pool.spec() == "io:2x20:fetch,upload"
    [toml] = parse_pools([{"name": "io", "processes": 1, "kinds": "*", "concurrency": 5}], "file")
    assert toml.concurrency == 5
    with pytest.raises(ConfigError, match="concurrency must be an integer"):
        parse_pools("io:2x0:fetch", "--pool")
    cfg = Config.make(pools=parse_pools("io:1x4:io", "--pool"))
    assert cfg.pool("io").concurrency == 4


def test_run_task_runs_an_async_task(conn: Conn) -> None:
    app = App()

    @app.task("io")
    async def io(ctx: AsyncContext, payload: Any) -> dict[str, Any]:
        await asyncio.sleep(0)
        return {"got": payload}

    result = run_task(app, conn, "io", {"a": 1})
    assert result.status == "succeeded" and result.result == {"got": {"a": 1}}


def test_an_idle_async_stage_says_when_its_next_run_is_due(
    conn: Conn, make_worker: MakeWorker
) -> None:
    """So that an idle async worker sleeps until then (idle_poll_max at most), not polling."""
    app = App()

    @app.task("io")
    async def io(ctx: AsyncContext, payload: Any) -> None: ...

    worker = make_worker(app)
    [stage] = [s for s in worker.stages if s.name == "async"]
    worker.poll()
    assert stage.next_due(worker.site) is None  # type: ignore[attr-defined]
    app.enqueue(conn, "io", delay=600)
    worker.poll()
    due = stage.next_due(worker.site)  # type: ignore[attr-defined]
    assert due is not None and 590 < due <= 600


def test_the_async_handlers_example_runs(conn: Conn) -> None:
    """The example of "Async handlers" (docs/async.md), run as it stands there."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "async.md").read_text(encoding="utf-8")
    body = text[text.index("## Async handlers\n") :]
    [code] = re.findall(r"```python\n(# myproject/fetching\.py\n.*?)```", body, re.S)
    space: dict[str, Any] = {"__name__": "fetching"}
    exec(compile(code, "docs/async.md", "exec"), space)
    result = run_task(space["app"], conn, "fetch", {"url": "https://example.org", "pages": 3})
    assert result.status == "succeeded"
    assert result.result == {"url": "https://example.org", "pages": 3}


def cancel_reaches_a_run_that_never_checks(
    conn: Conn, make_worker: MakeWorker, dsn: str, within: float, sleep: float = 20
) -> None:
    """A running async run that only awaits a `sleep` s sleep is cancelled within `within` s."""
    app = App()

    @app.task("sleepy")
    async def sleepy(ctx: AsyncContext, payload: Any) -> None:
        await asyncio.sleep(sleep)

    run_id = app.enqueue(conn, "sleepy")
    canceller = when_running(dsn, run_id, lambda c: App().cancel(c, run_id))
    with serving(make_worker(app, **QUICK)):
        canceller.join(30)
        wait_for(lambda: get_run(conn, run_id)["status"] == "cancelled", timeout=within)


def test_the_cancel_check_catches_a_task_never_cancelled(
    monkeypatch: pytest.MonkeyPatch, conn: Conn, make_worker: MakeWorker, dsn: str
) -> None:
    """The mutation: the keeper's interrupt no longer cancels the run's task. The check that a
    cancel reaches a run that never awaits ctx.check() must fail. Mutated, nothing ends the run
    but its sleep (the graceful stop waits for it too): 4 s without the cancel (twenty control
    intervals; it lands in a fraction of a second), then a sleep that outlasts that window by
    4 s rather than 20."""
    cancel_reaches_a_run_that_never_checks(conn, make_worker, dsn, within=15)
    conn.execute("TRUNCATE leasework.runs CASCADE")
    monkeypatch.setattr(AsyncContext, "deliver", lambda self: None)
    with pytest.raises(AssertionError, match="condition not met"):
        cancel_reaches_a_run_that_never_checks(conn, make_worker, dsn, within=4, sleep=8)
