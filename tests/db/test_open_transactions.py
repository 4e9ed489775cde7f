"""No worker waits on a lock held by someone else's open transaction: a user's uncommitted
enqueue of a key whose waiting run is due for promotion, an operator's SELECT ... FOR UPDATE on a
queued run and on a running one. Runs of other keys and kinds still start within 2 s, and a
watcher that samples pg_blocking_pids() throughout finds no worker backend waiting on that
session (on the running run: not past lock_timeout, which the seal gives up after)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest

from leasework import App
from leasework.leases import lease
from leasework.supervisor.hostdb import HostDB
from leasework.workers.connections import Connections
from leasework.workers.worker import Worker

from ..conftest import fast_config, get_run, wait_for

Conn = psycopg.Connection[Any]
MakeWorker = Callable[..., Worker]

START_WITHIN = 2.0  # seconds from a run's queued_at to its started_at (database clock)
LOCK_TIMEOUT = 0.5  # the setting's default


class Watcher:
    """Samples, on its own connection, which leasework backends wait on `holder`'s locks."""

    def __init__(self, dsn: str, holder: int) -> None:
        self.holder = holder
        self.blocked: list[float] = []  # monotonic times of samples that found one waiting
        self._stop = threading.Event()
        self._conn = psycopg.connect(dsn, autocommit=True)
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            row = self._conn.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE application_name LIKE 'leasework:%%'"
                "   AND %s = ANY(pg_blocking_pids(pid))",
                (self.holder,),
            ).fetchone()
            if row and row[0]:
                self.blocked.append(time.monotonic())
            self._stop.wait(0.02)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._conn.close()

    def longest_wait(self) -> float:
        """The longest run of consecutive samples that found a worker waiting, in seconds."""
        longest, start, last = 0.0, None, None
        for t in self.blocked:
            if last is None or t - last > 0.2:
                start = t
            last = t
            assert start is not None
            longest = max(longest, t - start)
        return longest


@contextmanager
def holding(dsn: str, statement: str, params: tuple[Any, ...]) -> Iterator[tuple[Conn, Watcher]]:
    """Another session that runs `statement` in a transaction and leaves it open."""
    with psycopg.connect(dsn) as other:
        other.execute(statement, params)
        watcher = Watcher(dsn, other.info.backend_pid)
        try:
            yield other, watcher
        finally:
            watcher.close()
            other.rollback()


@pytest.fixture
def looping(make_worker: MakeWorker) -> Iterator[Callable[[App], Worker]]:
    """A worker's run() loop in a thread, stopped after the test."""
    started: list[tuple[Worker, threading.Thread]] = []

    def start(app: App) -> Worker:
        worker = make_worker(app)
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        started.append((worker, thread))
        return worker

    yield start
    for worker, thread in started:
        worker.stop(graceful=False)
        thread.join(20)
        assert not thread.is_alive(), "a worker never came back from a lock wait"


def _app(release: threading.Event | None = None) -> App:
    app = App()
    app.task("k")(lambda ctx, payload: None)
    app.task("other")(lambda ctx, payload: None)
    if release is not None:
        app.task("slow")(lambda ctx, payload: release.wait(30))
    return app


def _all_start_in_time(conn: Conn, ids: list[int]) -> None:
    runs = wait_for(
        lambda: all(get_run(conn, i)["status"] == "succeeded" for i in ids)
        and [get_run(conn, i) for i in ids],
        timeout=30,
    )
    for run in runs:
        late = (run["started_at"] - run["queued_at"]).total_seconds()
        assert late < START_WITHIN, f"run {run['id']} started {late:.2f} s after it was queued"


def _others(app: App, conn: Conn) -> list[int]:
    return [
        app.enqueue(conn, "other"),
        app.enqueue(conn, "k", key="another key"),
        app.enqueue(conn, "other", key="a third key"),
    ]


def test_an_open_enqueue_of_a_key_never_stalls_the_promotion(
    conn: Conn, dsn: str, looping: Callable[[App], Worker], caplog: pytest.LogCaptureFixture
) -> None:
    """The reproduction: key K has a waiting (exclusive) run, its active run has just ended, and
    another session enqueues K and leaves its transaction open. expire_and_promote skips K (it
    waited on the uncommitted run's index entry, with no timeout) and says who holds it."""
    caplog.set_level(logging.INFO, logger="leasework")
    app = _app()
    first = app.enqueue(conn, "k", key="K")
    (claim,) = lease.claim_runs(conn, ["k"], worker="elsewhere", lease=30.0)
    assert claim.id == first
    waiting = app.enqueue(conn, "k", key="K", exclusive=True)
    assert get_run(conn, waiting)["status"] == "waiting"
    assert lease.finish(conn, claim, "succeeded")
    with holding(dsn, "SELECT leasework.enqueue('k', key => 'K')", ()) as (other, watcher):
        looping(app)
        _all_start_in_time(conn, _others(app, conn))

        def skipped() -> bool:
            return any(
                r.getMessage() == "promotion_skipped"
                and watcher.holder in r.fields["blocking_pids"]  # type: ignore[attr-defined]
                for r in caplog.records
            )

        wait_for(skipped, timeout=20)
        assert get_run(conn, waiting)["status"] == "waiting"
        later = _others(app, conn)  # after a settle skipped K: the worker is not stuck in it
        _all_start_in_time(conn, later)
        assert not watcher.blocked, "a worker backend waited on the open enqueue"
        other.commit()
    # Committed: the enqueued run holds K, then the waiting run is promoted and runs.
    wait_for(lambda: get_run(conn, waiting)["status"] == "succeeded", timeout=30)
    warned = [r for r in caplog.records if r.getMessage() == "promotion_skipped"]
    assert len(warned) == 1, "the held key was logged more than once"
    assert warned[0].levelno == logging.WARNING


def test_an_operator_holding_a_queued_run_never_stalls_a_worker(
    conn: Conn, dsn: str, looping: Callable[[App], Worker]
) -> None:
    app = _app()
    held = app.enqueue(conn, "other")
    lock = "SELECT * FROM leasework.runs WHERE id = %s FOR UPDATE"
    with holding(dsn, lock, (held,)) as (other, watcher):
        looping(app)
        _all_start_in_time(conn, _others(app, conn))
        _all_start_in_time(conn, _others(app, conn))
        assert get_run(conn, held)["status"] == "queued"
        assert not watcher.blocked, "a worker backend waited on the operator's lock"
        other.commit()
        row = conn.execute("SELECT leasework.now()").fetchone()
        assert row is not None
        freed = row[0]
    run = wait_for(
        lambda: (r := get_run(conn, held))["status"] == "succeeded" and r, timeout=30
    )
    # The idle worker kept polling for it (next_due counts a due run it could not take), rather
    # than sleeping until a NOTIFY or idle_poll_max.
    late = (run["started_at"] - freed).total_seconds()
    assert late < 5 * START_WITHIN, f"started {late:.2f} s after the operator let it go"


def test_an_operator_holding_a_running_run_never_stalls_a_worker(
    conn: Conn, dsn: str, looping: Callable[[App], Worker], caplog: pytest.LogCaptureFixture
) -> None:
    """The run's seal meets the lock: it gives up after lock_timeout (the run is redone once its
    lease lapses and the row is free) and the worker goes on with other runs."""
    caplog.set_level(logging.INFO, logger="leasework")
    release = threading.Event()
    app = _app(release)
    held = app.enqueue(conn, "slow")
    looping(app)
    wait_for(lambda: get_run(conn, held)["status"] == "running", timeout=20)
    lock = "SELECT * FROM leasework.runs WHERE id = %s FOR UPDATE"
    with holding(dsn, lock, (held,)) as (other, watcher):
        release.set()
        _all_start_in_time(conn, _others(app, conn))
        _all_start_in_time(conn, _others(app, conn))
        wait_for(
            lambda: any(r.getMessage() == "finish_and_claim_failed" for r in caplog.records)
            or any(r.getMessage() == "outcome_not_recorded" for r in caplog.records),
            timeout=20,
        )
        assert watcher.longest_wait() < LOCK_TIMEOUT + 0.5, watcher.blocked
        assert get_run(conn, held)["status"] == "running"  # not sealed: redone after its lease
        other.commit()


def test_a_transaction_of_its_own_left_idle_past_a_lease_is_ended_by_the_server(dsn: str) -> None:
    """A worker cut off between two statements of one of its own transactions (a stage's, on
    its main connection) must not leave its server session holding that transaction's row locks
    until the server's TCP keepalive gives up: the session's idle_in_transaction_session_timeout
    is the lease, and the server ends it. The supervisor's connection is bounded the same way."""
    config = fast_config(dsn, lease=1.0, renew_interval=0.3)
    conns = Connections(config, "w-idle", lambda payload: False)
    hostdb = HostDB(config)
    try:
        main = conns.main()
        assert main.execute("SHOW idle_in_transaction_session_timeout").fetchone() == ("1s",)
        parent = hostdb._connection()
        assert parent.execute("SHOW idle_in_transaction_session_timeout").fetchone() == ("1s",)
        pid = main.info.backend_pid
        main.execute("BEGIN")
        main.execute("SELECT 1")  # ... and the next statement never comes
        with psycopg.connect(dsn, autocommit=True) as watch:
            wait_for(
                lambda: watch.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,)
                ).fetchone()
                == (0,),
                timeout=30,
            )
    finally:
        hostdb.close()
        conns.close()
