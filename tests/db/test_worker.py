"""One worker's poll on real Postgres: handler outcomes (success, failure retried in place,
Retry-After, Partial, exhaustion, cancel, lost lease, timeout, shutdown), the context's renewal,
control and fenced transaction, stage isolation, and the NOTIFY wake-up of an idle worker."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from leasework import Aborted, App, Context, LeaseLost, Partial, Retry
from leasework.leases import lease
from leasework.workers.stage import Site
from leasework.workers.worker import Worker

from ..conftest import expire_lease, get_run, make_due, wait_for

Conn = psycopg.Connection[Any]
MakeWorker = Callable[..., Worker]


@pytest.fixture
def effects(conn: Conn) -> Conn:
    """A user table for handler effects, in the test database's public schema."""
    conn.execute("CREATE TABLE IF NOT EXISTS public.effects (run_id bigint, step int)")
    conn.execute("TRUNCATE public.effects")
    return conn


def effect_steps(conn: Conn) -> list[int]:
    return [r[0] for r in conn.execute("SELECT step FROM public.effects ORDER BY step").fetchall()]


def secs(delta: timedelta) -> float:
    return delta.total_seconds()


def check_until_aborted(ctx: Context, timeout: float = 10.0) -> None:
    """A handler's loop: ctx.check() until the signal trips (raises Aborted), with a deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ctx.check()
        time.sleep(0.002)
    raise AssertionError("the abort signal never tripped")


def steal(dsn: str, run_id: int) -> lease.Claim:
    """Another worker reclaims the run, as if this one had been paused past its lease."""
    with psycopg.connect(dsn, autocommit=True) as c:
        expire_lease(c, run_id)
        claims = lease.claim_runs(c, ["job"], worker="thief", lease=30.0)
    assert [cl.id for cl in claims] == [run_id]
    return claims[0]


# -- outcomes --------------------------------------------------------------------------------


def test_success_stores_the_result_and_progress(conn: Conn, make_worker: MakeWorker) -> None:
    app = App()

    @app.task("job")
    def job(ctx: Context, payload: Any) -> dict[str, Any]:
        ctx.set_total(4)
        for i in range(ctx.processed, 4):
            ctx.check()
            ctx.checkpoint(i + 1)
        return {"sent": 4, "attempt": ctx.attempt}

    run_id = app.enqueue(conn, "job", {"week": 48})
    assert make_worker(app).poll() == 1
    row = get_run(conn, run_id)
    assert row["status"] == "succeeded" and row["result"] == {"sent": 4, "attempt": 1}
    assert (row["processed_units"], row["total_units"]) == (4, 4)
    assert row["lease_owner"] is None and row["finished_at"] is not None


def test_a_failure_is_retried_in_place_after_jittered_backoff(
    conn: Conn, make_worker: MakeWorker
) -> None:
    app = App()

    @app.task("job")
    def job(ctx: Context, payload: Any) -> None:
        raise ValueError("upstream said no")

    run_id = app.enqueue(conn, "job")
    worker = make_worker(app)
    before = lease.db_now(conn)
    worker.poll()
    after = lease.db_now(conn)
    row = get_run(conn, run_id)
    assert row["id"] == run_id and row["status"] == "queued" and row["attempts"] == 1
    # 5 s x uniform(0.8, 1.2), in database time.
    assert secs(row["queued_at"] - before) >= 4.0
    assert secs(row["queued_at"] - after) <= 6.0
    assert row["lease_owner"] is None and row["finished_at"] is None
    assert "ValueError: upstream said no" in row["error"]
    [entry] = row["history"]
    assert entry["outcome"] == "failed" and entry["attempt"] == 1
    assert "ValueError: upstream said no" in entry["error"] and "Traceback" in entry["error"]
    assert conn.execute("SELECT count(*) FROM leasework.runs").fetchone() == (1,)
    assert worker.poll() == 0, "not due before its backoff"


def test_backoff_is_jittered_across_runs(conn: Conn, make_worker: MakeWorker) -> None:
    app = App()

    @app.task("job")
    def job(ctx: Context, payload: Any) -> None:
        raise RuntimeError("flaky")

    ids = [app.enqueue(conn, "job") for _ in range(5)]
    make_worker(app).poll()
    # Five runs failing in the same poll come due at five different times.
    due = {get_run(conn, i)["queued_at"] for i in ids}
    assert len(due) == 5


def test_retry_after_wins_over_the_backoff(conn: Conn, make_worker: MakeWorker) -> None:
    app = App()

    @app.task("job")
    def job(ctx: Context, payload: Any) -> None:
        ctx.result = {"tables": ["a"]}
        raise Retry(after=90, message="429 Too Many Requests")

    run_id = app.enqueue(conn, "job")
    before = lease.db_now(conn)
    make_worker(app).poll()
    after = lease.db_now(conn)
    row = get_run(conn, run_id)
    assert row["status"] == "queued" and row["attempts"] == 1
    assert secs(row["queued_at"] - before) >= 90 and secs(row["queued_at"] - after) <= 90
    assert row["history"][0]["outcome"] == "retry"
    assert "429" in row["error"]


@pytest.mark.parametrize(
    "after", [float("inf"), float("-inf"), float("nan"), -1, 1e10, 30 * 24 * 3600 + 1, True, "30"]
)
def test_a_bad_retry_after_is_an_ordinary_failure(
    conn: Conn, make_worker: MakeWorker, after: Any
) -> None:
    # Once accepted, inf or True failed the requeue in SQL and left the run `running` until its
    # lease ran out, nan sealed it `failed`, 1e10 parked it for centuries. Refused where the Retry
    # is made, a bad `after` is a handler error: recorded, and retried after the backoff.
    app = App()

    @app.task("job")
    def job(ctx: Context, payload: Any) -> None:
        raise Retry(after=after, message="429 Too Many Requests")

    run_id = app.enqueue(conn, "job")
    before = lease.db_now(conn)
    make_worker(app).poll()
    done = lease.db_now(conn)
    row = get_run(conn, run_id)
    assert row["status"] == "queued" and row["attempts"] == 1, row["error"]
    assert row["lease_owner"] is None and row["finished_at"] is None
    first = row["error"].splitlines()[0]
    assert first == (
        f"ValueError: Retry(after={after!r}): after must be a number of seconds from 0 to "
        "2592000 (30 days), or None for the backoff"
    )
    [entry] = row["history"]
    assert entry["outcome"] == "failed" and entry["error"].startswith(first)
    # The backoff applies (5 s x uniform(0.8, 1.2)), not the rejected `after`.
    assert secs(row["queued_at"] - before) >= 4.0 and secs(row["queued_at"] - done) <= 6.0


def test_exhausted_attempts_end_failed(conn: Conn, make_worker: MakeWorker) -> None:
    app = App()
    seen: list[int] = []

    @app.task("job", max_attempts=2)
    def job(ctx: Context, payload: Any) -> None:
        seen.append(ctx.attempt)
        raise RuntimeError(f"attempt {ctx.attempt} failed")

    run_id = app.enqueue(conn, "job")
    worker = make_worker(app)
    worker.poll()
    assert get_run(conn, run_id)["status"] == "queued"
    make_due(conn, run_id)
    worker.poll()
    row = get_run(conn, run_id)
    assert seen == [1, 2]
    assert row["status"] == "failed" and row["attempts"] == 2 and row["finished_at"]
    assert "attempt 2 failed" in row["error"]
    assert [h["outcome"] for h in row["history"]] == ["failed", "failed"]
    make_due(conn, run_id)
    assert worker.poll() == 0


def test_a_retried_run_resumes_from_its_checkpoint(conn: Conn, make_worker: MakeWorker) -> None:
    app = App()
    starts: list[int] = []

    @app.task("job")
    def job(ctx: Context, payload: Any) -> dict[str, int]:
        starts.append(ctx.processed)
        ctx.set_total(6)
        for i in range(ctx.processed, 6):
            ctx.check()
            if ctx.attempt == 1 and i == 3:
                raise ConnectionError("dropped mid-run")
            ctx.checkpoint(i + 1)
        return {"done": 6}

    run_id = app.enqueue(conn, "job")
    worker = make_worker(app)
    worker.poll()
    assert get_run(conn, run_id)["processed_units"] == 3
    make_due(conn, run_id)
    worker.poll()
    assert starts == [0, 3]
    assert get_run(conn, run_id)["status"] == "succeeded"


def test_partial_retryable_requeues_keeping_the_result(conn: Conn, make_worker: MakeWorker) -> None:
    app = App()

    @app.task("job")
    def job(ctx: Context, payload: Any) -> None:
        raise Partial({"ok": ["projects"], "failed": ["rfis"]}, retryable=True)

    run_id = app.enqueue(conn, "job")
    make_worker(app).poll()
    row = get_run(conn, run_id)
    assert row["status"] == "queued" and row["attempts"] == 1
    assert row["result"] == {"ok": ["projects"], "failed": ["rfis"]}
    assert row["history"][0]["outcome"] == "partial"


def test_partial_not_retryable_is_sealed(conn: Conn, make_worker: MakeWorker) -> None:
    app = App()

    @app.task("job")
    def job(ctx: Context, payload: Any) -> None:
        raise Partial({"ok": ["projects"]}, retryable=False, message="endpoint gone")

    run_id = app.enqueue(conn, "job")
    make_worker(app).poll()
    row = get_run(conn, run_id)
    assert row["status"] == "partial" and row["result"] == {"ok": ["projects"]}
    assert row["error"] == "endpoint gone" and row["finished_at"] is not None
    assert row["attempts"] == 1


# -- cancel, lost lease, timeout, shutdown -------------------------------------------------------


def test_cancel_of_a_running_run_ends_cancelled_with_its_partial_result(
    conn: Conn, make_worker: MakeWorker
) -> None:
    app = App()
    aborted: list[str] = []

    @app.task("job")
    def job(ctx: Context, payload: Any) -> None:
        ctx.result = {"tables_done": 2}
        assert app.cancel(conn, ctx.run_id) == "running"  # the user clicks cancel
        try:
            check_until_aborted(ctx)
        except Aborted as exc:
            aborted.append(exc.reason)
            raise

    run_id = app.enqueue(conn, "job")
    make_worker(app, control_interval=0.01).poll()
    assert aborted == ["cancelled"]
    row = get_run(conn, run_id)
    assert row["status"] == "cancelled" and row["result"] == {"tables_done": 2}
    assert row["attempts"] == 1 and row["history"][-1]["outcome"] == "cancelled"


def test_lost_lease_is_seen_by_control_and_nothing_is_written(
    dsn: str, conn: Conn, make_worker: MakeWorker
) -> None:
    app = App()
    aborted: list[str] = []
    thief: list[lease.Claim] = []

    @app.task("job")
    def job(ctx: Context, payload: Any) -> dict[str, str]:
        thief.append(steal(dsn, ctx.run_id))
        try:
            check_until_aborted(ctx)
        except Aborted as exc:
            aborted.append(exc.reason)
            raise
        return {"written": "by a stale worker"}

    run_id = app.enqueue(conn, "job")
    make_worker(app, control_interval=0.01).poll()
    assert aborted == ["lost"]
    row = get_run(conn, run_id)
    assert row["status"] == "running" and row["lease_owner"] == thief[0].owner
    assert row["lease_worker"] == "thief" and row["result"] is None
    assert [h["outcome"] for h in row["history"]] == ["expired"]


def test_stale_worker_that_ignores_the_signal_still_writes_nothing(
    dsn: str, conn: Conn, make_worker: MakeWorker
) -> None:
    """A handler that never calls check() and just returns: finish is owner-scoped."""
    app = App()

    @app.task("job")
    def job(ctx: Context, payload: Any) -> dict[str, str]:
        steal(dsn, ctx.run_id)
        return {"written": "by a stale worker"}

    run_id = app.enqueue(conn, "job")
    make_worker(app).poll()
    row = get_run(conn, run_id)
    assert row["status"] == "running" and row["lease_worker"] == "thief"
    assert row["result"] is None


def test_fenced_write_of_a_stale_owner_raises_before_writing(
    dsn: str, effects: Conn, make_worker: MakeWorker
) -> None:
    conn = effects
    app = App()
    raised: list[str] = []

    @app.task("job")
    def job(ctx: Context, payload: Any) -> None:
        with ctx.transaction() as tx:
            tx.execute("INSERT INTO public.effects VALUES (%s, 1)", (ctx.run_id,))
            ctx.checkpoint(1, 2)
        steal(dsn, ctx.run_id)  # paused past the lease; someone else took the run
        try:
            with ctx.transaction() as tx:
                tx.execute("INSERT INTO public.effects VALUES (%s, 2)", (ctx.run_id,))
        except LeaseLost as exc:
            raised.append(str(exc))
            raise

    run_id = app.enqueue(conn, "job")
    make_worker(app).poll()
    assert raised and "no longer ours" in raised[0]
    assert effect_steps(conn) == [1]
    row = get_run(conn, run_id)
    assert row["status"] == "running" and row["lease_worker"] == "thief"
    assert row["processed_units"] == 1


def test_checkpoint_in_a_fenced_transaction_commits_and_rolls_back_with_the_effect(
    effects: Conn, make_worker: MakeWorker
) -> None:
    conn = effects
    app = App()
    observed: dict[str, Any] = {}

    class Boom(Exception):
        pass

    @app.task("job")
    def job(ctx: Context, payload: Any) -> dict[str, int]:
        ctx.set_total(3)
        with ctx.transaction() as tx:
            tx.execute("INSERT INTO public.effects VALUES (%s, 1)", (ctx.run_id,))
            ctx.checkpoint(1)
            # Not visible outside until the effect commits with it.
            observed["inside"] = get_run(conn, ctx.run_id)["processed_units"]
        observed["after_commit"] = (
            get_run(conn, ctx.run_id)["processed_units"],
            effect_steps(conn),
        )
        try:
            with ctx.transaction() as tx:
                tx.execute("INSERT INTO public.effects VALUES (%s, 2)", (ctx.run_id,))
                ctx.checkpoint(2)
                raise Boom
        except Boom:
            pass
        observed["after_rollback"] = (
            get_run(conn, ctx.run_id)["processed_units"],
            effect_steps(conn),
            ctx.processed,
        )
        for step in range(ctx.processed, 3):
            with ctx.transaction() as tx:
                tx.execute("INSERT INTO public.effects VALUES (%s, %s)", (ctx.run_id, step + 1))
                ctx.checkpoint(step + 1)
        return {"steps": 3}

    run_id = app.enqueue(conn, "job")
    make_worker(app).poll()
    assert observed["inside"] == 0
    assert observed["after_commit"] == (1, [1])
    assert observed["after_rollback"] == (1, [1], 1)
    assert effect_steps(conn) == [1, 2, 3]
    row = get_run(conn, run_id)
    assert row["status"] == "succeeded" and row["processed_units"] == 3


def test_run_timeout_trips_the_signal_and_retries(conn: Conn, make_worker: MakeWorker) -> None:
    app = App()
    aborted: list[str] = []

    @app.task("job", timeout=0.05, max_attempts=2)
    def job(ctx: Context, payload: Any) -> None:
        ctx.result = {"got": "some"}
        try:
            check_until_aborted(ctx)
        except Aborted as exc:
            aborted.append(exc.reason)
            raise

    run_id = app.enqueue(conn, "job")
    worker = make_worker(app)
    worker.poll()
    row = get_run(conn, run_id)
    assert aborted == ["timeout"]
    assert row["status"] == "queued" and row["attempts"] == 1
    assert row["history"][0]["outcome"] == "timeout" and "timeout after" in row["error"]
    assert row["result"] == {"got": "some"}
    make_due(conn, run_id)
    worker.poll()
    row = get_run(conn, run_id)
    assert aborted == ["timeout", "timeout"]
    assert row["status"] == "failed" and row["attempts"] == 2


def test_shutdown_releases_the_run_without_charging_the_attempt(
    conn: Conn, make_worker: MakeWorker
) -> None:
    app = App()
    worker_box: list[Worker] = []

    @app.task("job", max_attempts=1)
    def job(ctx: Context, payload: Any) -> None:
        worker_box[0].stop(graceful=False)
        check_until_aborted(ctx)

    run_id = app.enqueue(conn, "job")
    second = app.enqueue(conn, "job")
    worker = make_worker(app)
    worker_box.append(worker)
    worker.poll()
    row = get_run(conn, run_id)
    assert row["status"] == "queued" and row["attempts"] == 0 and row["lease_owner"] is None
    assert row["history"][0]["outcome"] == "released"
    assert get_run(conn, second)["status"] == "queued", "a stopping worker claims nothing more"
    # Another worker takes it at once, on its only attempt.
    ok = App()
    ok.task("job")(lambda ctx, payload: {"ok": True})
    make_worker(ok).poll()
    assert get_run(conn, run_id)["status"] == "succeeded"
    assert get_run(conn, run_id)["attempts"] == 1
    assert get_run(conn, second)["status"] == "succeeded"


def test_graceful_stop_lets_the_job_finish(conn: Conn, make_worker: MakeWorker) -> None:
    app = App()
    worker_box: list[Worker] = []

    @app.task("job")
    def job(ctx: Context, payload: Any) -> dict[str, bool]:
        worker_box[0].stop(graceful=True)
        ctx.check()  # inside graceful_timeout: carry on
        return {"finished": True}

    run_id = app.enqueue(conn, "job")
    worker = make_worker(app, graceful_timeout=30.0)
    worker_box.append(worker)
    worker.poll()
    assert get_run(conn, run_id)["status"] == "succeeded"


# -- renewal and control -------------------------------------------------------------------------


def test_check_renews_the_lease_on_the_reserved_connection(
    conn: Conn, make_worker: MakeWorker
) -> None:
    """ctx.check() renews once the renewal interval has passed, even while the handler holds
    every pooled connection."""
    app = App()
    seen: dict[str, Any] = {}

    @app.task("job")
    def job(ctx: Context, payload: Any) -> None:
        first = get_run(conn, ctx.run_id)["lease_expires_at"]
        with ctx.connection(), ctx.connection():  # the whole pool (pool_size 3 = 2 + control)

            def renewed() -> bool:
                ctx.check()
                return bool(get_run(conn, ctx.run_id)["lease_expires_at"] > first)

            wait_for(renewed, timeout=5)
        seen["renewed"] = True

    run_id = app.enqueue(conn, "job")
    make_worker(app, renew_interval=0.05, control_interval=0.01).poll()
    assert seen == {"renewed": True}
    assert get_run(conn, run_id)["status"] == "succeeded"


# -- the poll --------------------------------------------------------------------------------


class CountingStage:
    def __init__(self, name: str, fail: bool = False) -> None:
        self.name = name
        self.limit = 1
        self.fail = fail
        self.calls = 0
        self.wakes: frozenset[str] = frozenset()

    def step(self, site: Site) -> int:
        self.calls += 1
        if self.fail:
            raise RuntimeError(f"{self.name} broke")
        return 1


def test_one_failing_stage_never_skips_the_ones_after_it(dsn: str, conn: Conn) -> None:
    from ..conftest import fast_config

    stages = [CountingStage("a"), CountingStage("b", fail=True), CountingStage("c")]
    cfg = fast_config(dsn)
    worker = Worker(App(cfg), cfg, stages=stages, register=False)
    try:
        worker.open()
        worker.running = True
        assert worker.poll() == 2
        assert worker.poll() == 2
        assert [s.calls for s in stages] == [2, 2, 2]
    finally:
        worker.close()


# -- NOTIFY -----------------------------------------------------------------------------------


@pytest.fixture
def running_worker(make_worker: MakeWorker) -> Iterator[Callable[[App], Worker]]:
    """Starts Worker.run() in a thread with a 30 s poll interval (so only NOTIFY can explain a
    prompt pick-up); stops it after the test."""
    started: list[tuple[Worker, threading.Thread]] = []

    def start(app: App) -> Worker:
        worker = make_worker(app, poll_interval=30.0)
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        started.append((worker, thread))
        return worker

    yield start
    for worker, thread in started:
        worker.stop(graceful=False)
        with psycopg.connect(worker.config.dsn, autocommit=True) as c:
            c.execute("NOTIFY leasework")
        thread.join(10)
        assert not thread.is_alive()


def _listening_pid(worker: Worker) -> int | None:
    main = worker.conns._main
    if not worker.conns.wake._listening or main is None or main.closed:
        return None
    return main.info.backend_pid


def test_notify_wakes_an_idle_worker(conn: Conn, running_worker: Callable[[App], Worker]) -> None:
    app = App()
    app.task("job")(lambda ctx, payload: {"woke": True})
    worker = running_worker(app)
    wait_for(lambda: _listening_pid(worker))
    started = time.monotonic()
    with conn.transaction():
        run_id = app.enqueue(conn, "job")
    wait_for(lambda: get_run(conn, run_id)["status"] == "succeeded", timeout=10)
    assert time.monotonic() - started < 10  # far below the 30 s poll interval


def test_listen_is_re_established_after_a_reconnect(
    conn: Conn, running_worker: Callable[[App], Worker]
) -> None:
    app = App()
    app.task("job")(lambda ctx, payload: {"woke": True})
    worker = running_worker(app)
    old_pid = wait_for(lambda: _listening_pid(worker))
    conn.execute("SELECT pg_terminate_backend(%s)", (old_pid,))
    wait_for(lambda: (_listening_pid(worker) or old_pid) != old_pid)
    run_id = app.enqueue(conn, "job")
    wait_for(lambda: get_run(conn, run_id)["status"] == "succeeded", timeout=10)


def test_an_idle_worker_waits_out_a_database_it_cannot_reach(
    conn: Conn, dsn: str, make_worker: MakeWorker
) -> None:
    """Between polls a worker waits for a NOTIFY on its main connection. When that connection
    broke and the server cannot be reached (Postgres restarting), the wait must fail like a
    poll does (logged, then tried again), not crash the worker: a supervised child exited 1 on
    every Postgres restart that found it idle (tests/chaos/test_noncooperative.py)."""
    app = App()
    app.task("job")(lambda ctx, payload: None)
    worker = make_worker(app)
    assert worker.conns.wake.idle_wait(0.01) == set()  # listening
    reachable = worker.conns.config
    with socket.socket() as closed:  # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    worker.conns.config = reachable.replace(dsn=f"postgresql://postgres@127.0.0.1:{port}/postgres")
    worker.conns.drop_main()
    assert worker.conns.wake.idle_wait(0.01) == set()
    worker.conns.config = reachable
    assert worker.conns.wake.idle_wait(0.01) == set()
    assert _listening_pid(worker) is not None


def test_notifies_received_while_busy_wake_an_idle_worker_once(
    conn: Conn, dsn: str, make_worker: MakeWorker
) -> None:
    """psycopg keeps every NOTIFY its connection reads during other statements. A worker kept
    busy under a stream of enqueues must not pile them up and then wake once for each."""
    app = App()
    app.task("job")(lambda ctx, payload: None)
    worker = make_worker(app)
    assert worker.conns.wake.idle_wait(0.01) == set()  # listening now
    with psycopg.connect(dsn, autocommit=True) as other:
        for i in range(500):
            other.execute("SELECT pg_notify('leasework', 'job')")  # one transaction each
            other.execute("SELECT pg_notify('leasework', %s)", (f"no-such-kind-{i}",))
            if i % 50 == 0:
                worker.poll()  # busy: the main connection reads them between statements
    worker.poll()

    # psycopg's own queue (private, but it is where the memory would go) is emptied by each
    # poll, not left to grow while the worker stays busy.
    assert worker.conns._main is not None and not worker.conns._main._notifies_backlog
    # At once, all of them as one wake-up (and only kinds it serves: 500 distinct payloads from
    # anyone on the channel take no room).
    assert worker.conns.wake.idle_wait(5.0) == {"job"}
    assert (
        worker.conns.wake.idle_wait(0.2) == set()
    )  # and nothing left over: this one waited, then timed out


def test_notifies_received_during_a_long_job_are_drained_by_its_control_queries(
    conn: Conn, dsn: str, make_worker: MakeWorker
) -> None:
    app = App()
    holder: list[Worker] = []
    drained: list[bool] = []

    @app.task("long")
    def long(ctx: Context, payload: Any) -> None:
        main = holder[0].conns._main
        assert main is not None
        with psycopg.connect(dsn, autocommit=True) as other:
            for _ in range(200):
                other.execute("SELECT pg_notify('leasework', 'long')")

        # A checkpoint runs on the main connection and reads the NOTIFYs that came meanwhile;
        # the worker moves them out of psycopg's queue at once, into one wake-up entry.
        def moved() -> bool:
            ctx.checkpoint(1)
            return "long" in holder[0].conns.wake.woken and not main._notifies_backlog

        drained.append(wait_for(moved, timeout=5))

    run_id = app.enqueue(conn, "long")
    worker = make_worker(app, control_interval=0.05)
    holder.append(worker)
    assert worker.conns.wake.idle_wait(0.01) == set()  # listening
    worker.poll()
    assert drained == [True]
    assert get_run(conn, run_id)["status"] == "succeeded"


def test_drain_stops_claiming_after_the_job_in_hand(conn, make_worker):
    """Recycling a child: no deadline for the job in hand, and no further claim in this poll."""
    app = App()
    holder: dict[str, Any] = {}

    @app.task("drained")
    def drained(ctx, payload):
        holder["worker"].drain()
        ctx.check()  # draining is not a shutdown: the job is not aborted
        return {"done": True}

    ids = [app.enqueue(conn, "drained", {}) for _ in range(3)]
    worker = make_worker(app, runs_limit=10)
    holder["worker"] = worker
    worker.poll()
    statuses = [get_run(conn, i)["status"] for i in ids]
    assert statuses == ["succeeded", "queued", "queued"]
    assert worker.stopping and not worker.running


# -- regressions: a retryable Partial on the last attempt; what the log says ------------------


def test_a_retryable_partial_on_the_last_attempt_ends_partial(
    conn: Conn, make_worker: MakeWorker
) -> None:
    app = App()

    @app.task("half", max_attempts=1)
    def half(ctx: Context, payload: Any) -> None:
        raise Partial({"tables": 3}, retryable=True)

    run_id = app.enqueue(conn, "half")
    make_worker(app).poll()
    row = get_run(conn, run_id)
    assert row["status"] == "partial", "a partial result on the last attempt was thrown away"
    assert row["result"] == {"tables": 3}
    assert row["history"][-1]["outcome"] == "partial"


class Events(logging.Handler):
    """leasework's events as (name, level, fields), whatever the logging set-up."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, int, dict[str, Any]]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append((record.getMessage(), record.levelno, getattr(record, "fields", {})))

    def named(self, name: str) -> list[tuple[int, dict[str, Any]]]:
        return [(level, fields) for n, level, fields in self.seen if n == name]


@pytest.fixture
def events() -> Iterator[Events]:
    handler = Events()
    logger = logging.getLogger("leasework")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.setLevel(level)
    logger.removeHandler(handler)


def test_quick_successes_and_claims_log_at_debug_slow_successes_at_info(
    conn: Conn, make_worker: MakeWorker, events: Events
) -> None:
    """The default log level writes no line per quick run (two per job at thousands of jobs a
    second): run_claimed is at debug, and run_succeeded at info only for a run that took
    log_runs_slower_than or longer."""
    app = App()

    @app.task("fine")
    def fine(ctx: Context, payload: Any) -> None:
        return None

    quick = app.enqueue(conn, "fine")
    make_worker(app).poll()  # the default: 1 s; a no-op takes far less
    assert [level for level, _ in events.named("run_claimed")] == [logging.DEBUG]
    [(level, done)] = events.named("run_succeeded")
    assert (level, done["run_id"]) == (logging.DEBUG, quick)
    slow = app.enqueue(conn, "fine")
    make_worker(app, log_runs_slower_than=0).poll()  # every success counts as slow
    [_, (level, done)] = events.named("run_succeeded")
    assert (level, done["run_id"]) == (logging.INFO, slow)


def test_the_log_says_what_the_database_returned(
    conn: Conn, make_worker: MakeWorker, events: Events
) -> None:
    app = App()

    @app.task("flaky", max_attempts=2)
    def flaky(ctx: Context, payload: Any) -> None:
        raise ValueError("upstream said no\nsecond line")

    @app.task("fine")
    def fine(ctx: Context, payload: Any) -> dict[str, int]:
        return {"ok": 1}

    run_id = app.enqueue(conn, "flaky")
    worker = make_worker(app)
    worker.poll()
    [(level, retry)] = events.named("run_retry")
    assert level == logging.WARNING and retry["run_id"] == run_id and retry["attempt"] == 1
    assert retry["error"] == "ValueError: upstream said no"
    assert retry["due_at"] == get_run(conn, run_id)["queued_at"].isoformat()
    make_due(conn, run_id)
    worker.poll()
    [(level, failed)] = events.named("run_failed")
    assert level == logging.ERROR and failed["attempts"] == 2
    assert failed["error"] == "ValueError: upstream said no"
    assert get_run(conn, run_id)["status"] == "failed"
    assert not events.named("run_requeued")
    done = app.enqueue(conn, "fine")
    worker.poll()
    [(_, ok)] = events.named("run_succeeded")
    assert ok["run_id"] == done and isinstance(ok["duration"], float) and ok["duration"] >= 0
