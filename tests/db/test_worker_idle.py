"""An idle worker sleeps long (until a NOTIFY, or until what it serves is next due, at most
idle_poll_max) and still keeps every promise polling kept: a NOTIFY wakes it at once, a delayed
or retried run starts within a second of its due time, a dead worker's run is reclaimed once its
lease runs out, a schedule fires on time, and a stop ends the sleep. Each worker here polls every
0.05 s when it cannot tell (poll_interval) and may sleep 60 s (idle_poll_max): a worker that
polled would fail the count of polls, one that slept the cap would fail the timings, which are
read from the database's clock (started_at against queued_at), never slept for."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import psycopg
import pytest

from leasework import App, Context
from leasework.leases import lease
from leasework.workers.worker import Worker

from ..conftest import get_run, wait_for

Conn = psycopg.Connection[Any]
MakeWorker = Callable[..., Worker]

CAP = 60.0  # idle_poll_max: nothing in these tests may wait for it
ON_TIME = 1.0  # a due run starts within this many seconds of its due time (database clock)


class Sleeper:
    """Worker.run() in a thread, counting its polls."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.polls = 0
        poll = worker.poll

        def counted(*, skip_idle: bool = False) -> int:
            self.polls += 1
            return poll(skip_idle=skip_idle)

        worker.poll = counted  # type: ignore[method-assign]
        self.thread = threading.Thread(target=worker.run, daemon=True)
        self.thread.start()

    def asleep(self) -> None:
        """Wait until it is in an idle wait that will last (its polls stop coming)."""

        def settled() -> bool:
            before = self.polls
            time.sleep(0.3)  # a look at the count, not a wait for a lease
            return self.polls == before and self.worker.idle_timeout(time.monotonic()) > 1.0

        wait_for(settled, timeout=20)

    def polls_during(self, seconds: float) -> int:
        before = self.polls
        time.sleep(seconds)  # a window in which to count polls
        return self.polls - before


@pytest.fixture
def sleeper(make_worker: MakeWorker) -> Iterator[Callable[..., Sleeper]]:
    started: list[Sleeper] = []

    def start(app: App, **overrides: Any) -> Sleeper:
        options: dict[str, Any] = {"poll_interval": 0.05, "idle_poll_max": CAP, **overrides}
        s = Sleeper(make_worker(app, **options))
        started.append(s)
        return s

    yield start
    for s in started:
        s.asleep()
        s.worker.stop(graceful=False)  # no NOTIFY: the stop alone must end a 60 s sleep
        s.thread.join(10)
        assert not s.thread.is_alive(), "a stopped worker stayed in its idle sleep"


def _late(run: dict[str, Any], due: datetime) -> float:
    return (run["started_at"] - due).total_seconds()


def test_an_idle_worker_sleeps_and_a_notify_wakes_it_at_once(
    conn: Conn, sleeper: Callable[..., Sleeper]
) -> None:
    app = App()
    app.task("job")(lambda ctx, payload: None)
    s = sleeper(app)
    s.asleep()
    assert s.polls_during(1.0) <= 1  # polling every poll_interval would be about 20
    run_id = app.enqueue(conn, "job")
    run = wait_for(lambda: (r := get_run(conn, run_id))["status"] == "succeeded" and r, timeout=10)
    assert _late(run, run["queued_at"]) < ON_TIME


def test_a_delayed_run_enqueued_during_the_sleep_starts_on_time(
    conn: Conn, sleeper: Callable[..., Sleeper]
) -> None:
    """Its enqueue NOTIFYs at once: the worker wakes, finds nothing due, and sleeps until it is."""
    app = App()
    app.task("later")(lambda ctx, payload: None)
    s = sleeper(app)
    s.asleep()
    run_id = app.enqueue(conn, "later", delay=2.0)
    run = wait_for(lambda: (r := get_run(conn, run_id))["status"] == "succeeded" and r, timeout=20)
    assert 0 <= _late(run, run["queued_at"]) < ON_TIME


def test_a_retry_requeued_by_another_worker_starts_on_its_backoff(
    conn: Conn, dsn: str, sleeper: Callable[..., Sleeper]
) -> None:
    """The sleeper knows the run only as running elsewhere (a lease 30 s away); the other worker
    requeues it with a 2 s backoff, which NOTIFYs, and the sleeper starts it on time."""
    app = App()
    app.task("flaky")(lambda ctx, payload: None)
    run_id = app.enqueue(conn, "flaky")
    with psycopg.connect(dsn, autocommit=True) as other:
        (claim,) = lease.claim_runs(other, ["flaky"], worker="elsewhere", lease=30.0)
        s = sleeper(app)
        s.asleep()
        assert lease.requeue(other, claim, delay=2.0, error="boom") == "queued"
    queued = get_run(conn, run_id)["queued_at"]
    run = wait_for(lambda: (r := get_run(conn, run_id))["status"] == "succeeded" and r, timeout=20)
    assert run["attempts"] == 2
    assert 0 <= _late(run, queued) < ON_TIME


def test_a_dead_workers_run_is_reclaimed_when_its_lease_runs_out(
    conn: Conn, dsn: str, sleeper: Callable[..., Sleeper]
) -> None:
    """Nothing NOTIFYs a lease running out: the sleeper read when it would, and woke for it."""
    app = App()
    app.task("orphan")(lambda ctx, payload: None)
    run_id = app.enqueue(conn, "orphan")
    with psycopg.connect(dsn, autocommit=True) as other:
        lease.claim_runs(other, ["orphan"], worker="dead", lease=30.0)
    # The dead worker's lease, moved to run out 2 s from now (not waited out from 30 s).
    row = conn.execute(
        "UPDATE leasework.runs SET lease_expires_at = leasework.now() + interval '2 seconds'"
        " WHERE id = %s RETURNING lease_expires_at",
        (run_id,),
    ).fetchone()
    assert row is not None
    expires: datetime = row[0]
    sleeper(app)
    run = wait_for(lambda: (r := get_run(conn, run_id))["status"] == "succeeded" and r, timeout=20)
    assert run["attempts"] == 2
    assert 0 <= _late(run, expires) < ON_TIME


def test_a_schedule_fires_on_time_while_the_worker_sleeps(
    conn: Conn, sleeper: Callable[..., Sleeper]
) -> None:
    app = App()
    app.task("tick", every=2.0)(lambda ctx, payload: None)
    s = sleeper(app)
    runs = wait_for(
        lambda: (
            rows := conn.execute(
                "SELECT created_at, payload FROM leasework.runs WHERE kind = 'tick' ORDER BY id"
            ).fetchall()
        )
        and len(rows) >= 3
        and rows,
        timeout=30,
    )
    for created_at, payload in runs[1:]:  # the first fires at start; the others on their time
        due = datetime.fromisoformat(payload["scheduled_at"])
        assert 0 <= (created_at - due).total_seconds() < ON_TIME
    assert s.worker.idle_timeout(time.monotonic()) <= 2.0 + ON_TIME  # it sleeps up to the next


def test_a_stage_that_cannot_tell_is_asked_every_poll_interval(
    conn: Conn, make_worker: MakeWorker
) -> None:
    """A stage without next_due keeps today's rhythm, and so does the whole worker."""
    app = App()
    asked: list[float] = []

    class Plain:
        name = "plain"
        limit = 1
        wakes: frozenset[str] = frozenset()

        def step(self, site: Any) -> int:
            asked.append(time.monotonic())
            return 0

    worker = make_worker(app, poll_interval=0.05, idle_poll_max=CAP)
    worker.stages.append(Plain())
    worker.poll()
    assert len(asked) == 1
    assert worker.idle_timeout(time.monotonic()) <= 0.05


def test_stages_tell_when_they_are_next_due(conn: Conn, make_worker: MakeWorker) -> None:
    """After an idle poll: the runs stage reads the first delayed run; maintenance its periods."""
    app = App()

    @app.task("later")
    def later(ctx: Context, payload: Any) -> None:
        return None

    app.enqueue(conn, "later", delay=40.0)
    worker = make_worker(app, poll_interval=0.05, idle_poll_max=CAP)
    assert worker.poll() == 0
    dues = {s.name: worker.poller.next_due(s) for s in worker.stages}
    assert dues["schedule"] is None  # no periodic task: nothing, ever
    assert dues["runs"] is not None and 38 < dues["runs"] <= 40
    assert dues["maintenance"] is not None and dues["maintenance"] > CAP
    assert 38 < worker.idle_timeout(time.monotonic()) <= 40.01
    worker.config = worker.config.replace(idle_poll_max=10.0)
    worker.poll()
    assert 9 < worker.idle_timeout(time.monotonic()) <= 10.0


def _runs_a_silent_run_after_losing_its_connection(conn: Conn, s: Sleeper) -> None:
    """Asleep, the worker loses its main connection while a run arrives without a NOTIFY
    (as one sent while nobody listened): the poll after its new LISTEN must run it."""
    s.asleep()
    row = conn.execute("INSERT INTO leasework.runs (kind) VALUES ('job') RETURNING id").fetchone()
    assert row is not None
    conn.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
        " WHERE datname = current_database() AND application_name LIKE 'leasework:%:control'"
    )
    run = wait_for(lambda: (r := get_run(conn, row[0]))["status"] == "succeeded" and r, timeout=10)
    assert run["attempts"] == 1


def test_a_worker_whose_connection_was_lost_asks_every_stage_once_it_listens_again(
    conn: Conn, sleeper: Callable[..., Sleeper]
) -> None:
    """While its connection is down, NOTIFYs reach nobody (a server restart, a terminated
    session): a run enqueued then is found by the poll that follows the new LISTEN, not after
    idle_poll_max."""
    app = App()
    app.task("job")(lambda ctx, payload: None)
    _runs_a_silent_run_after_losing_its_connection(conn, sleeper(app))


def test_an_async_worker_whose_connection_was_lost_asks_every_stage_once_it_listens_again(
    conn: Conn, sleeper: Callable[..., Sleeper]
) -> None:
    """The same on the event loop of a worker running async handlers."""
    app = App()

    @app.task("job")
    async def job(ctx: Any, payload: Any) -> None:
        return None

    _runs_a_silent_run_after_losing_its_connection(conn, sleeper(app))
