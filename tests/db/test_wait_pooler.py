"""`handle.wait()` through a real PgBouncer in transaction mode (tests/pgbouncer.py): the pooler is
found on the caller's own connection (a plain psycopg one, or leasework's), nothing is LISTENed
there (a LISTEN would stay on whichever server session ran it), and the wait polls until the run
ends, sync and awaited."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from leasework import App, Context, RunFailed, WaitTimeout, db, results
from leasework.testing import drain
from tests.pgbouncer import Bouncer, pgbouncer

Conn = psycopg.Connection[Any]


@pytest.fixture(scope="module")
def bouncer(server_dsn: str) -> Iterator[Bouncer]:
    with pgbouncer(server_dsn, pool_size=2) as b:
        yield b


@pytest.fixture
def app() -> App:
    app = App()

    @app.task("report", max_attempts=1)
    def report(ctx: Context, payload: dict[str, Any]) -> Any:
        if payload.get("fail"):
            raise RuntimeError("no data for that week")
        return {"rows": payload["n"]}

    return app


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each wait found a pooler (the `pooled` its core was started with)."""
    found: list[bool] = []
    real = results._waiting

    def spy(run_id: int, timeout: float | None, pooled: bool, clock: Any) -> Any:
        found.append(pooled)
        return real(run_id, timeout, pooled, clock)

    monkeypatch.setattr(results, "_waiting", spy)
    return found


def drain_soon(app: App, dsn: str) -> threading.Thread:
    t = threading.Thread(target=lambda: drain(app, dsn, ["report"]), daemon=True)
    t.start()
    return t


def test_a_wait_through_the_pooler_polls_until_the_run_ends(
    dsn: str, conn: Conn, app: App, bouncer: Bouncer, seen: list[bool]
) -> None:
    pooled = bouncer.dsn(dsn)
    with psycopg.connect(pooled) as web:  # the web app's own connection, not leasework's
        handle = app.enqueue_run(web, "report", {"n": 7})
        failing = app.enqueue_run(web, "report", {"fail": True})
        web.commit()
        with pytest.raises(WaitTimeout):
            handle.wait(timeout=0.2)  # polled a few times, nothing ran
        t = drain_soon(app, dsn)
        assert handle.wait(timeout=60) == {"rows": 7}
        with pytest.raises(RunFailed, match="no data for that week"):
            failing.wait(timeout=60)
        t.join(60)
    with db.connect(pooled) as through:  # leasework's: known pooled without asking
        assert app.wait(through, handle.run_id, timeout=1) == {"rows": 7}
    assert seen == [True, True, True, True]
    # Nothing was marked to notify: a pooled wait never LISTENs, so it never asks for a NOTIFY.
    row = conn.execute("SELECT count(*) FROM leasework.runs WHERE notify_ended").fetchone()
    assert row == (0,)


def test_an_awaited_wait_through_the_pooler(
    dsn: str, app: App, bouncer: Bouncer, seen: list[bool]
) -> None:
    async def main() -> Any:
        async with await psycopg.AsyncConnection.connect(bouncer.dsn(dsn)) as web:
            handle = await app.enqueue_run_async(web, "report", {"n": 3})
            await web.commit()
            t = drain_soon(app, dsn)
            result = await handle.wait(timeout=60)
            t.join(60)
            return result

    assert asyncio.run(main()) == {"rows": 3}
    assert seen == [True]


def test_a_direct_wait_is_not_taken_for_a_pooled_one(
    dsn: str, app: App, seen: list[bool]
) -> None:
    """The check can fail: the same wait on a direct connection LISTENs."""
    with psycopg.connect(dsn, autocommit=True) as web:
        handle = app.enqueue_run(web, "report", {"n": 1})
        t = drain_soon(app, dsn)
        assert handle.wait(timeout=60) == {"rows": 1}
        t.join(60)
    assert seen == [False]
