"""deploy/roles.sql and issue 32's results: the enqueue role waits for a run's end
(leasework.run_outcome, SECURITY DEFINER) but still reads no table; the worker role stores and
reads durable steps (leasework.run_steps); a role without the grants can call neither."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from leasework import App, Config, Context
from leasework.workers.worker import Worker

from .test_roles import roles  # noqa: F401  (the fixture)


def _app() -> App:
    app = App()

    @app.task("work")
    def work(ctx: Context, payload: Any) -> Any:
        return {"fetched": ctx.step("fetch", lambda: payload["x"] * 2)}

    return app


def test_the_enqueue_role_waits_and_the_worker_role_stores_steps(conn: Any, roles: Any) -> None:  # noqa: F811
    app = _app()
    enqueue_dsn = roles("leasework_enqueue")
    worker_dsn = roles("leasework_worker")
    with psycopg.connect(enqueue_dsn) as web:
        handle = app.enqueue_run(web, "work", {"x": 21})
        web.commit()
        cfg = Config(dsn=worker_dsn, poll_interval=0.05)
        worker = Worker(app.with_config(cfg), cfg)
        worker.open()
        worker.running = True
        t = threading.Thread(target=worker.poll)
        try:
            t.start()
            assert handle.wait(timeout=60) == {"fetched": 42}
        finally:
            t.join(60)
            worker.close()
        web.autocommit = True
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            web.execute("SELECT * FROM leasework.run_steps")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            web.execute("SELECT result FROM leasework.runs")
    row = conn.execute("SELECT name, value FROM leasework.run_steps").fetchall()
    assert row == [("fetch", 42)]


def test_a_role_without_the_grant_cannot_read_outcomes(conn: Any, roles: Any) -> None:  # noqa: F811
    app = _app()
    run_id = app.enqueue(conn, "work", {"x": 1})
    other_dsn = roles("pg_monitor")
    name = conninfo_to_dict(other_dsn)["user"]
    conn.execute(sql.SQL("GRANT USAGE ON SCHEMA leasework TO {}").format(sql.Identifier(name)))
    with (
        psycopg.connect(other_dsn, autocommit=True) as other,
        pytest.raises(psycopg.errors.InsufficientPrivilege, match="function run_outcome"),
    ):
        other.execute("SELECT * FROM leasework.run_outcome(%s, true)", (run_id,))
