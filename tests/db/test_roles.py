"""deploy/roles.sql: a worker runs under the worker role; the enqueue role can enqueue and
cancel but cannot touch a lease column."""

from __future__ import annotations

import secrets
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from leasework import App, Config
from leasework.workers.worker import Worker

ROLES = Path(__file__).resolve().parents[2] / "deploy" / "roles.sql"


def _login(conn: psycopg.Connection, dsn: str, group: str) -> tuple[str, str]:
    name = f"lw_{group.removeprefix('leasework_')}_{secrets.token_hex(4)}"
    conn.execute(
        sql.SQL("CREATE ROLE {} LOGIN IN ROLE {}").format(
            sql.Identifier(name), sql.Identifier(group)
        )
    )
    params = conninfo_to_dict(dsn)
    params["user"] = name
    return name, make_conninfo(**params)


@pytest.fixture
def roles(conn, dsn):
    conn.execute(ROLES.read_text())
    made: list[str] = []

    def login(group: str) -> str:
        name, role_dsn = _login(conn, dsn, group)
        made.append(name)
        return role_dsn

    yield login
    for name in made:
        conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
        conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def _app() -> App:
    app = App()

    @app.task("work")
    def work(ctx, payload):
        with ctx.transaction():
            ctx.checkpoint(1, 1)
        return {"ok": True}

    return app


def test_worker_role_runs_jobs_and_enqueue_role_cannot_touch_leases(conn, roles):
    app = _app()
    enqueue_dsn = roles("leasework_enqueue")
    with psycopg.connect(enqueue_dsn, autocommit=True) as web:
        run_id = app.enqueue(web, "work", {"x": 1}, key="k", tenant="t")
        assert app.enqueue(web, "work", {"x": 1}, key="k", tenant="t") == run_id
        doomed = app.enqueue(web, "work", {}, delay=60)
        assert app.cancel(web, doomed) == "cancelled"
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            web.execute(
                "UPDATE leasework.runs SET lease_owner = gen_random_uuid() WHERE id = %s", (run_id,)
            )
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            web.execute("DELETE FROM leasework.runs")

    worker_dsn = roles("leasework_worker")
    cfg = Config(dsn=worker_dsn, poll_interval=0.05)
    worker = Worker(app.with_config(cfg), cfg)
    worker.open()
    worker.running = True
    try:
        worker.poll()
    finally:
        worker.close()
    status, result = conn.execute(
        "SELECT status, result FROM leasework.runs WHERE id = %s", (run_id,)
    ).fetchone()
    assert (status, result) == ("succeeded", {"ok": True})
    with (
        psycopg.connect(worker_dsn, autocommit=True) as w,
        pytest.raises(psycopg.errors.InsufficientPrivilege),
    ):
        w.execute("DROP TABLE leasework.runs")
