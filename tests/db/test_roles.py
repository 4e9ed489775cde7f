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
from leasework.errors import ConfigError
from leasework.workers.worker import Worker

from ..conftest import get_run
from .syncing import sync_app, syncs

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


def test_the_enqueue_role_cannot_take_a_familys_key(conn, roles, tmp_path):
    """Keys under "leasework:" are the families' (a connection's syncs and purge, a file's
    ingest): the enqueue role's leasework.enqueue refuses one with one line naming the prefix
    (42501), as the Python enqueue does before sending anything; so does a session that SET ROLE
    to it. The worker role's family API keys its runs there."""
    app = sync_app()
    enqueue_dsn = roles("leasework_enqueue")
    with psycopg.connect(enqueue_dsn, autocommit=True) as web:
        for key in ("leasework:connection:1", "leasework:file:1", "leasework:"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege) as refused:
                web.execute("SELECT leasework.enqueue('sync', key => %s, tenant => 'ws')", (key,))
            line = refused.value.diag.message_primary or ""
            assert "\n" not in line and f"key '{key}' is refused" in line
            assert "starting with 'leasework:' are reserved" in line
            with pytest.raises(ConfigError, match="starting with 'leasework:' are reserved"):
                app.enqueue(web, "sync", {"connection_id": 1}, key=key, tenant="ws")
        # Any other key is the caller's, in its tenant.
        assert web.execute("SELECT leasework.enqueue('sync', key => 'connection:1')").fetchone()
    with conn.transaction():
        conn.execute("SET LOCAL ROLE leasework_enqueue")
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="reserved"):
            conn.execute("SELECT leasework.enqueue('sync', key => 'leasework:connection:2')")
    assert conn.execute(
        "SELECT count(*) FROM leasework.runs WHERE key LIKE 'leasework:%'"
    ).fetchone() == (0,)

    worker_dsn = roles("leasework_worker")
    with psycopg.connect(worker_dsn, autocommit=True) as host:
        cid = syncs(app).connect(
            host, workspace="ws", provider="files", config={"path": str(tmp_path)}
        )
        purge = syncs(app).delete_connection(host, cid)
    keys = conn.execute(
        "SELECT kind, key FROM leasework.runs WHERE key LIKE 'leasework:%' ORDER BY id"
    ).fetchall()
    assert keys == [
        ("sync", f"leasework:connection:{cid}"),
        ("purge", f"leasework:connection:{cid}"),
    ]
    assert get_run(conn, purge)["status"] in ("waiting", "queued")
