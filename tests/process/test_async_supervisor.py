"""Async children under a real supervisor: a child holding ten async runs at once is killed with
-9 or asked to stop (stopped: tests/chaos/test_async_watchdog.py), and every one of its runs is
released at once by its parent (a `crashed` entry, not a lease expiry), finished or released
within graceful_timeout, and done exactly once in the end.

Timings are short through the config file (lease 6 s); tests wait on conditions with deadlines."""

from __future__ import annotations

import os
import signal
import textwrap
from pathlib import Path
from typing import Any

import psycopg

from tests.conftest import wait_for

from .conftest import Supervised, holder_pid

Conn = psycopg.Connection[Any]

# `ahold` waits (awaiting, never ctx.check()) until the file release-ahold exists, then writes its
# effect through the fenced transaction. Up to ten at once per child.
APP = textwrap.dedent(
    """
    from __future__ import annotations

    import asyncio
    import os
    from pathlib import Path

    from leasework import App

    app = App()
    HERE = Path(__file__).parent


    @app.task("ahold", max_attempts=3, concurrency=10)
    async def ahold(ctx, payload):
        while not (HERE / "release-ahold").exists():
            await asyncio.sleep(0.02)
        async with ctx.transaction() as conn:
            await conn.execute(
                "INSERT INTO public.supervisor_test_effects (run_id, attempt, pid)"
                " VALUES (%s, %s, %s)",
                (ctx.run_id, ctx.attempt, os.getpid()),
            )
        return {"pid": os.getpid()}
    """
)
N = 10


def start(app_dir: Path, dsn: str, started: list[Supervised], **config: Any) -> Supervised:
    (app_dir / "lwasyncapp.py").write_text(APP)
    sup = Supervised(app_dir, dsn, config, app="lwasyncapp:app")
    started.append(sup)
    return sup


def enqueue_all(conn: Conn) -> list[int]:
    from leasework import App

    app = App()

    @app.task("ahold", max_attempts=3)
    async def ahold(ctx: Any, payload: Any) -> None: ...

    return [app.enqueue(conn, "ahold", {"i": i}) for i in range(N)]


def held_by(conn: Conn, ids: list[int], attempt: int) -> set[str] | None:
    """The workers holding every run of `ids` at `attempt`, once they all are."""
    rows = conn.execute(
        "SELECT lease_worker FROM leasework.runs"
        " WHERE id = ANY(%s) AND status = 'running' AND attempts = %s",
        (ids, attempt),
    ).fetchall()
    return {r[0] for r in rows} if len(rows) == len(ids) else None


def outcomes(conn: Conn, ids: list[int]) -> list[list[str]]:
    rows = conn.execute(
        "SELECT history FROM leasework.runs WHERE id = ANY(%s) ORDER BY id", (ids,)
    ).fetchall()
    return [[h["outcome"] for h in r[0]] for r in rows]


def finish_all(conn: Conn, app_dir: Path, ids: list[int]) -> None:
    (app_dir / "release-ahold").touch()
    wait_for(
        lambda: (
            conn.execute(
                "SELECT count(*) FROM leasework.runs WHERE id = ANY(%s) AND status = 'succeeded'",
                (ids,),
            ).fetchone()
            == (N,)
        ),
        timeout=60,
    )
    effects = conn.execute(
        "SELECT run_id, count(*) FROM public.supervisor_test_effects GROUP BY 1"
    ).fetchall()
    assert sorted(effects) == [(i, 1) for i in sorted(ids)], "each run's effect exactly once"


def test_kill_9_of_a_child_with_ten_runs_in_flight_releases_all_ten_at_once(
    app_dir: Path, dsn: str, pconn: Conn
) -> None:
    started: list[Supervised] = []
    try:
        sup = start(app_dir, dsn, started, processes=1)
        [child] = sup.wait_children(1)
        ids = enqueue_all(pconn)
        [worker] = wait_for(lambda: held_by(pconn, ids, 1), timeout=30)
        assert holder_pid(worker) == child
        os.kill(child, signal.SIGKILL)
        # Every run is given back by the parent (`crashed`), then taken by the new child: none
        # waited for its lease to expire (a reclaim after expiry records `expired`).
        wait_for(lambda: held_by(pconn, ids, 2), timeout=30)
        assert all(o[:1] == ["crashed"] for o in outcomes(pconn, ids)), outcomes(pconn, ids)
        finish_all(pconn, app_dir, ids)
    finally:
        for s in started:
            s.stop()


def test_term_releases_every_run_in_flight_within_the_graceful_timeout(
    app_dir: Path, dsn: str, pconn: Conn
) -> None:
    started: list[Supervised] = []
    try:
        sup = start(app_dir, dsn, started, processes=1, graceful_timeout=1.0)
        sup.wait_children(1)
        ids = enqueue_all(pconn)
        wait_for(lambda: held_by(pconn, ids, 1), timeout=30)
        sup.signal(signal.SIGTERM)
        assert sup.wait_exit(30) == 0
        rows = pconn.execute(
            "SELECT status, attempts, history -> -1 ->> 'outcome' FROM leasework.runs"
            " WHERE id = ANY(%s)",
            (ids,),
        ).fetchall()
        assert rows == [("queued", 0, "released")] * N, rows
        sup = start(app_dir, dsn, started, processes=1)
        finish_all(pconn, app_dir, ids)
    finally:
        for s in started:
            s.stop()
