"""No role forges a run: every forgery of issue 18, tried as the role deploy/roles.sql gives web
processes (leasework_enqueue) and as the workers' role, must fail; what each role is for
(enqueue and cancel; running jobs) must still work."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg import errors

from leasework import App, Config
from leasework.workers.worker import Worker

FORGE_RUNNING = (
    "INSERT INTO leasework.runs (kind, tenant, exclusive, status, lease_owner, lease_expires_at)"
    " VALUES ('echo', 'tenant-B', true, 'running', gen_random_uuid(), 'infinity')"
)
FORGE_QUEUED_AT = (
    "INSERT INTO leasework.runs (kind, tenant, status, queued_at)"
    " VALUES ('echo', 'tenant-B', 'queued', '-infinity')"
)


def _app() -> App:
    app = App()

    @app.task("echo")
    def echo(ctx: Any, payload: Any) -> Any:
        return payload

    return app


@pytest.fixture
def web(login: Any) -> Any:
    with psycopg.connect(login("leasework_enqueue"), autocommit=True) as c:
        yield c


@pytest.fixture
def worker_conn(login: Any) -> Any:
    with psycopg.connect(login("leasework_worker"), autocommit=True) as c:
        yield c


def _denied(conn: psycopg.Connection[Any], statement: str, params: Any = None) -> None:
    with pytest.raises(errors.InsufficientPrivilege):
        conn.execute(statement, params)


@pytest.mark.parametrize(
    "statement",
    [
        FORGE_RUNNING,
        FORGE_QUEUED_AT,
        "INSERT INTO leasework.runs (id, kind) OVERRIDING SYSTEM VALUE VALUES (1000000, 'echo')",
        "INSERT INTO leasework.runs (kind) VALUES ('echo')",
        "INSERT INTO leasework.tenants (name) VALUES ('tenant-B')",
        "SELECT payload FROM leasework.runs",
        "SELECT count(*) FROM leasework.tenants",
        "SELECT nextval(pg_get_serial_sequence('leasework.runs', 'id'))",
        "UPDATE leasework.runs SET status = 'succeeded', finished_at = now()",
        "UPDATE leasework.runs SET cancel_requested_at = now()",
        "DELETE FROM leasework.runs",
        "SELECT * FROM leasework.workers",
        "SELECT * FROM leasework.records",
        "UPDATE leasework.schema_version SET version = 1",
    ],
)
def test_the_enqueue_role_cannot_touch_a_table(conn: Any, web: Any, statement: str) -> None:
    victim = _app().enqueue(conn, "echo", {"secret": "tenant-A"}, tenant="tenant-A")
    _denied(web, statement)
    status = conn.execute("SELECT status FROM leasework.runs WHERE id = %s", (victim,)).fetchone()
    assert status == ("queued",)
    assert conn.execute("SELECT count(*) FROM leasework.runs").fetchone() == (1,)


def test_the_enqueue_role_cannot_uncancel_or_finish_anothers_run(conn: Any, web: Any) -> None:
    app = _app()
    cancelled = app.enqueue(conn, "echo", {}, tenant="tenant-A")
    assert app.cancel(conn, cancelled) == "cancelled"
    other = app.enqueue(conn, "echo", {}, tenant="tenant-A")
    _denied(
        web,
        "UPDATE leasework.runs SET status = 'queued', finished_at = NULL WHERE id = %s",
        (cancelled,),
    )
    _denied(
        web,
        "UPDATE leasework.runs SET status = 'succeeded', finished_at = now() WHERE id = %s",
        (other,),
    )
    # cancel through the function is final: a second cancel changes nothing
    assert web.execute("SELECT leasework.cancel(%s)", (cancelled,)).fetchone() == ("cancelled",)
    rows = conn.execute("SELECT id, status FROM leasework.runs ORDER BY id").fetchall()
    assert rows == [(cancelled, "cancelled"), (other, "queued")]


def test_the_enqueue_role_enqueues_and_cancels_through_the_functions(conn: Any, web: Any) -> None:
    app = _app()
    run_id = app.enqueue(web, "echo", {"x": 1}, key="k", tenant="t", group="g")
    assert app.enqueue(web, "echo", {"x": 2}, key="k", tenant="t") == run_id
    waiting = app.enqueue(web, "echo", {}, key="k", tenant="t", exclusive=True)
    assert waiting != run_id
    assert app.enqueue(web, "echo", {}, key="k", tenant="t", exclusive=True) == waiting
    doomed = app.enqueue(web, "echo", {}, delay=60)
    assert app.cancel(web, doomed) == "cancelled"
    from_sql = web.execute(
        "SELECT leasework.enqueue('echo', '{\"y\": 2}', tenant => 'tenant-B', priority => 5)"
    ).fetchone()[0]
    with pytest.raises(Exception, match="no run with id"):
        app.cancel(web, 10**12)
    rows = dict(conn.execute("SELECT id, status FROM leasework.runs").fetchall())
    assert rows == {run_id: "queued", waiting: "waiting", doomed: "cancelled", from_sql: "queued"}
    assert conn.execute(
        "SELECT tenant, priority, payload, status FROM leasework.runs WHERE id = %s", (from_sql,)
    ).fetchone() == ("tenant-B", 5, {"y": 2}, "queued")
    assert conn.execute("SELECT name FROM leasework.tenants ORDER BY name").fetchall() == [
        ("t",),
        ("tenant-B",),
    ]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        ("leasework.enqueue('echo', delay => 1e12)", "delay must be"),
        ("leasework.enqueue('echo', delay => 'NaN')", "delay must be"),
        ("leasework.enqueue('echo', delay => 'Infinity')", "delay must be"),
        ("leasework.enqueue('echo', delay => -1)", "delay must be"),
        ("leasework.enqueue('echo', delay => NULL)", "delay must be"),
        ("leasework.enqueue('echo', max_attempts => 0)", "max_attempts must be"),
        ("leasework.enqueue('echo', max_attempts => 1001)", "max_attempts must be"),
        ("leasework.enqueue('echo', lease_seconds => 1e308)", "lease_seconds must be"),
        ("leasework.enqueue('echo', lease_seconds => 'NaN')", "lease_seconds must be"),
        ("leasework.enqueue('echo', timeout_seconds => 'Infinity')", "timeout_seconds must be"),
        ("leasework.enqueue('bad kind')", "kind 'bad kind' is not valid"),
        ("leasework.enqueue(NULL)", "kind NULL is not valid"),
        ("leasework.enqueue('echo', key => '')", "key must be 1-200"),
        ("leasework.enqueue('echo', tenant => repeat('t', 201))", "tenant must be 1-200"),
        ("leasework.enqueue('echo', \"group\" => E'g\\x1b[2J')", "group contains control"),
        ("leasework.enqueue('echo', priority => NULL)", "priority and exclusive"),
    ],
)
def test_sql_enqueue_refuses_what_the_python_path_refuses(
    conn: Any, web: Any, call: str, message: str
) -> None:
    with pytest.raises(errors.InvalidParameterValue, match=message):
        web.execute(f"SELECT {call}")
    assert conn.execute("SELECT count(*) FROM leasework.runs").fetchone() == (0,)
    assert conn.execute("SELECT count(*) FROM leasework.tenants").fetchone() == (0,)


def test_a_role_without_grants_cannot_call_the_functions(conn: Any, login: Any) -> None:
    conn.execute("GRANT USAGE ON SCHEMA leasework TO PUBLIC")
    try:
        with psycopg.connect(login(None), autocommit=True) as nobody:
            _denied(nobody, "SELECT leasework.enqueue('echo')")
            _denied(nobody, "SELECT leasework.cancel(1)")
    finally:
        conn.execute("REVOKE USAGE ON SCHEMA leasework FROM PUBLIC")
    assert conn.execute("SELECT count(*) FROM leasework.runs").fetchone() == (0,)


@pytest.mark.parametrize(
    "statement",
    [
        "UPDATE leasework.schema_version SET version = 1",
        "DELETE FROM leasework.schema_version",
        "INSERT INTO leasework.schema_version (id, version) VALUES (true, 999) "
        "ON CONFLICT (id) DO UPDATE SET version = 999",
        "TRUNCATE leasework.runs",
        "DROP TABLE leasework.runs",
        "ALTER TABLE leasework.runs DROP CONSTRAINT runs_state_valid",
    ],
)
def test_the_worker_role_cannot_touch_the_schema(
    conn: Any, worker_conn: Any, statement: str
) -> None:
    before = conn.execute("SELECT version FROM leasework.schema_version").fetchone()
    _denied(worker_conn, statement)
    assert conn.execute("SELECT version FROM leasework.schema_version").fetchone() == before


def test_the_worker_role_runs_jobs(conn: Any, login: Any) -> None:
    app = _app()
    run_id = app.enqueue(conn, "echo", {"ok": True}, tenant="t")
    cfg = Config(dsn=login("leasework_worker"), poll_interval=0.05)
    worker = Worker(app.with_config(cfg), cfg)
    worker.open()
    worker.running = True
    try:
        worker.poll()
    finally:
        worker.close()
    assert conn.execute(
        "SELECT status, result FROM leasework.runs WHERE id = %s", (run_id,)
    ).fetchone() == ("succeeded", {"ok": True})


@pytest.mark.parametrize(
    "statement",
    [
        FORGE_RUNNING,
        FORGE_QUEUED_AT,
        "INSERT INTO leasework.runs (kind, queued_at) VALUES ('echo', now() + make_interval(secs => 1e12))",
        "INSERT INTO leasework.runs (kind, created_at) VALUES ('echo', 'infinity')",
        "INSERT INTO leasework.runs (kind, status, finished_at) VALUES ('echo', 'failed', '-infinity')",
        "INSERT INTO leasework.runs (kind, cancel_requested_at) VALUES ('echo', '9999-12-31')",
    ],
)
def test_no_role_stores_a_timestamp_out_of_range(
    conn: Any, worker_conn: Any, statement: str
) -> None:
    """The owner and the workers can write runs, but never a lease or due time that breaks a
    reader or blocks a tenant for ever."""
    for who in (conn, worker_conn):
        with pytest.raises(errors.CheckViolation, match="instant_in_range"):
            who.execute(statement)
    run_id = _app().enqueue(conn, "echo", {})
    with pytest.raises(errors.CheckViolation):
        conn.execute("UPDATE leasework.runs SET queued_at = 'infinity' WHERE id = %s", (run_id,))
    assert conn.execute("SELECT count(*) FROM leasework.runs").fetchone() == (1,)


def test_migration_0006_moves_rows_out_of_range_to_now(server_dsn: str) -> None:
    """A database that already holds the forged rows upgrades: their times become now() (an
    infinite lease expires at once), then the guard holds."""
    import os
    import secrets

    from psycopg import sql
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    from leasework import db

    name = f"leasework_sec_{os.getpid()}_{secrets.token_hex(3)}"
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        params = conninfo_to_dict(server_dsn)
        params["dbname"] = name
        with psycopg.connect(make_conninfo(**params), autocommit=True) as c:
            before = [m for m in db.migrations() if m.version < 6]
            with c.transaction():
                db.apply_migrations(c, before)
            c.execute(FORGE_RUNNING)
            c.execute(FORGE_QUEUED_AT)
            with c.transaction():
                db.apply_migrations(c, [m for m in db.migrations() if m.version >= 6])
            rows = c.execute(
                "SELECT status, lease_expires_at <= now() + interval '1 minute',"
                " queued_at > now() - interval '1 minute' FROM leasework.runs ORDER BY id"
            ).fetchall()
            assert rows == [("running", True, True), ("queued", None, True)]
    finally:
        with psycopg.connect(server_dsn, autocommit=True) as admin:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )
