"""Waiting for a run's end (`handle.wait`, `app.wait`, results.py): the result or the run's failure
raised, a timeout that leaves the run alone, clear refusals for a wait that could never end, the
NOTIFY sent only for runs someone waits for, and the wake-up by that NOTIFY rather than polling.
Through PgBouncer: tests/db/test_pooler.py."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from leasework import (
    App,
    Context,
    Enqueued,
    Fail,
    Partial,
    RunCancelled,
    RunFailed,
    RunPartial,
    WaitTimeout,
    WrongConnection,
    results,
)
from leasework.errors import ConfigError, NotFound
from leasework.testing import drain

from ..conftest import get_run

Conn = psycopg.Connection[Any]


def marked(conn: Conn, run_id: int) -> bool | None:
    row = conn.execute("SELECT notify_ended FROM leasework.runs WHERE id = %s", (run_id,)).fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


def make_app() -> App:
    app = App()

    @app.task("report")
    def report(ctx: Context, payload: dict[str, Any]) -> Any:
        if payload.get("fail"):
            raise Fail(payload["fail"])
        if payload.get("partial"):
            raise Partial({"pages": 2}, retryable=False)
        return {"rows": payload["n"] * 2}

    return app


@pytest.fixture
def app() -> App:
    return make_app()


@pytest.fixture
def no_recheck(monkeypatch: pytest.MonkeyPatch) -> None:
    """A wait on a direct connection then reads the run again only when NOTIFYed (or at its
    deadline): a wait that returns before its timeout was woken by the NOTIFY."""
    monkeypatch.setattr(results, "RECHECK", 3600.0)


@pytest.fixture
def drained(dsn: str, app: App) -> Iterator[threading.Event]:
    """Set the event, and the runs of `report` are drained on another thread (another
    connection), as a worker would."""
    go = threading.Event()
    done: list[Any] = []

    def run() -> None:
        if go.wait(60):
            done.append(drain(app, dsn, ["report"]))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    yield go
    go.set()
    t.join(60)


def later(go: threading.Event, conn: Conn, dsn: str) -> None:
    """Start the drain once this connection's wait has read the run (LISTENing since before
    that read), so that the seal comes after and only the NOTIFY can end the wait early."""

    def when_listening() -> None:
        with psycopg.connect(dsn, autocommit=True) as c:  # a fresh statistics snapshot each read
            for _ in range(6000):
                row = c.execute(
                    "SELECT count(*) FROM pg_stat_activity"
                    " WHERE pid = %s AND state = 'idle' AND query LIKE %s",
                    (conn.info.backend_pid, "%run_outcome%"),
                ).fetchone()
                if row and row[0]:
                    break
                threading.Event().wait(0.01)
        go.set()

    threading.Thread(target=when_listening, daemon=True).start()


def test_wait_returns_the_result_woken_by_the_notify(
    dsn: str, app: App, drained: threading.Event, no_recheck: None
) -> None:
    with psycopg.connect(dsn) as web:  # a web request's connection, not autocommit
        handle = app.enqueue_run(web, "report", {"n": 21})
        web.commit()
        later(drained, web, dsn)
        assert handle.wait(timeout=60) == {"rows": 42}
        assert web.autocommit is False, "the connection is given back as it was"
        # The LISTEN is gone: the connection hears nothing of later ends.
        row = web.execute("SELECT count(*) FROM pg_listening_channels()").fetchone()
        assert row == (0,)


def test_a_run_that_ended_already_is_read_at_once(dsn: str, app: App, conn: Conn) -> None:
    done = app.enqueue_run(conn, "report", {"n": 1})
    drain(app, dsn, ["report"])
    assert done.wait(conn, timeout=0) == {"rows": 2}
    assert app.wait(conn, done.run_id, timeout=0) == {"rows": 2}
    assert marked(conn, done.run_id) is None, "an ended run is not marked"


def test_failed_cancelled_and_partial_runs_raise(dsn: str, app: App, conn: Conn) -> None:
    failed = app.enqueue_run(conn, "report", {"fail": "the printer is on fire"})
    partial = app.enqueue_run(conn, "report", {"partial": True})
    cancelled = app.enqueue_run(conn, "report", {"n": 1}, delay=3600)
    app.cancel(conn, cancelled.run_id)
    drain(app, dsn, ["report"])
    with pytest.raises(RunFailed) as failure:
        failed.wait(conn, timeout=5)
    assert type(failure.value) is RunFailed
    assert failure.value.status == "failed"
    assert failure.value.error is not None and "the printer is on fire" in failure.value.error
    assert "the printer is on fire" in str(failure.value)
    with pytest.raises(RunPartial) as part:
        partial.wait(conn, timeout=5)
    assert part.value.status == "partial" and part.value.result == {"pages": 2}
    with pytest.raises(RunCancelled) as cancel:
        cancelled.wait(conn, timeout=5)
    assert cancel.value.status == "cancelled" and isinstance(cancel.value, RunFailed)


def test_a_timeout_raises_and_leaves_the_run_as_it_was(app: App, conn: Conn) -> None:
    handle = app.enqueue_run(conn, "report", {"n": 1})
    before = get_run(conn, handle.run_id)
    assert marked(conn, handle.run_id) is None
    with pytest.raises(WaitTimeout) as timeout:
        handle.wait(conn, timeout=0.05)
    assert isinstance(timeout.value, TimeoutError)
    assert timeout.value.status == "queued" and "still queued" in str(timeout.value)
    after = get_run(conn, handle.run_id)
    assert marked(conn, handle.run_id) is True, "the waiter asked for its end"
    assert after == before


def test_a_wait_inside_the_enqueues_transaction_is_refused_at_once(
    dsn: str, app: App, conn: Conn
) -> None:
    with psycopg.connect(dsn) as web:
        handle = app.enqueue_run(web, "report", {"n": 1})  # not committed
        with pytest.raises(WrongConnection, match="commit the enqueue first"):
            handle.wait(timeout=None)
        # Another connection cannot see it yet: no such run, not a wait for ever.
        with pytest.raises(NotFound, match="not committed yet"):
            handle.wait(conn, timeout=None)
        web.rollback()
    with pytest.raises(WrongConnection, match="closed or broken"):
        handle.wait(web)


def test_the_handle_compares_as_before_and_needs_a_connection_once_it_is_gone(
    dsn: str, app: App
) -> None:
    with psycopg.connect(dsn, autocommit=True) as c:
        handle = app.enqueue_run(c, "report", {"n": 1})
    assert handle == Enqueued(handle.run_id)
    assert handle == Enqueued(handle.run_id, existing=False, how=None)
    assert repr(handle) == f"Enqueued(run_id={handle.run_id}, existing=False, how=None)"
    import pickle

    assert pickle.loads(pickle.dumps(handle)) == handle
    del c
    import gc

    gc.collect()
    with pytest.raises(WrongConnection):
        handle.wait(timeout=0)


def test_bad_arguments_are_refused(app: App, conn: Conn) -> None:
    handle = app.enqueue_run(conn, "report", {"n": 1})
    for bad in (-1, float("nan"), "5", True):
        with pytest.raises(ConfigError, match="timeout must be a number of seconds"):
            handle.wait(conn, timeout=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="run id"):
        app.wait(conn, 0)
    with pytest.raises(NotFound):
        app.wait(conn, handle.run_id + 1000, timeout=1)


def test_only_a_run_someone_waits_for_notifies_its_end(dsn: str, app: App, conn: Conn) -> None:
    plain = app.enqueue_run(conn, "report", {"n": 1})
    waited = app.enqueue_run(conn, "report", {"n": 2})
    with pytest.raises(WaitTimeout):
        waited.wait(conn, timeout=0)  # marks it
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute(f"LISTEN {results.CHANNEL}")
        drain(app, dsn, ["report"])
        heard = [n.payload for n in listener.notifies(timeout=1.0)]
    assert heard == [str(waited.run_id)]
    assert marked(conn, plain.run_id) is None


def test_the_mark_gives_up_on_a_held_row_and_never_marks_an_ended_run(
    dsn: str, app: App, conn: Conn
) -> None:
    """leasework.run_outcome with watch: a seal under way holds the row; the mark gives up
    (lock_timeout) and says so (`watched` false: the waiter polls); once the seal committed,
    the run is read ended and left unmarked; a live run is marked and says so."""
    handle = app.enqueue_run(conn, "report", {"n": 3})
    live = app.enqueue_run(conn, "report", {"n": 4})
    outcome = "SELECT status, watched FROM leasework.run_outcome(%s, true)"
    with psycopg.connect(dsn) as sealer:
        sealer.execute(
            "UPDATE leasework.runs SET status = 'cancelled', finished_at = leasework.now()"
            " WHERE id = %s",
            (handle.run_id,),
        )
        assert conn.execute(outcome, (handle.run_id,)).fetchone() == ("queued", False)
        sealer.commit()
    assert conn.execute(outcome, (handle.run_id,)).fetchone() == ("cancelled", False)
    assert marked(conn, handle.run_id) is None
    assert conn.execute(outcome, (live.run_id,)).fetchone() == ("queued", True)
    assert marked(conn, live.run_id) is True


def test_await_handle_wait_on_an_async_connection(
    dsn: str, app: App, drained: threading.Event, no_recheck: None
) -> None:
    async def main() -> Any:
        async with await psycopg.AsyncConnection.connect(dsn) as web:
            handle = await app.enqueue_run_async(web, "report", {"n": 5})
            await web.commit()
            drained.set()
            result = await handle.wait(timeout=60)
            again = await app.wait_async(web, handle.run_id, timeout=0)
            return result, again, web.autocommit

    assert asyncio.run(main()) == ({"rows": 10}, {"rows": 10}, False)


def test_an_async_wait_times_out(app: App, dsn: str) -> None:
    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as web:
            handle = await app.enqueue_run_async(web, "report", {"n": 5})
            with pytest.raises(WaitTimeout):
                await handle.wait(timeout=0.05)

    asyncio.run(main())


def test_a_row_held_by_another_session_is_polled_not_waited_on(
    dsn: str, app: App, conn: Conn
) -> None:
    """A run's row locked by a long transaction (an enqueue merging a debounce into it holds it
    FOR UPDATE until its caller commits): the mark is not waited for, the wait's timeout holds,
    and once the row is free the mark is asked for again and the end is heard."""
    handle = app.enqueue_run(conn, "report", {"n": 4})
    released = threading.Event()
    done = threading.Event()
    with psycopg.connect(dsn) as holder:
        holder.execute("SELECT 1 FROM leasework.runs WHERE id = %s FOR UPDATE", (handle.run_id,))

        def release() -> None:
            done.wait(60)  # the wait below has returned (or a minute went by)
            released.set()
            holder.commit()

        t = threading.Thread(target=release)
        t.start()
        try:
            with pytest.raises(WaitTimeout):
                handle.wait(conn, timeout=0.5)
            assert not released.is_set(), "the wait blocked on the locked row"
        finally:
            done.set()
            t.join(60)
    assert marked(conn, handle.run_id) is None, "not marked while the row was held"
    drain(app, dsn, ["report"])
    assert handle.wait(conn, timeout=5) == {"rows": 8}
