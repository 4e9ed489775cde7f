"""deploy/roles.sql: a worker runs under the worker role; the enqueue role can enqueue and
cancel but cannot touch a lease column. The file runs as a schema owner that is no superuser
and has no CREATEROLE once the roles exist, and names what to ask a superuser for when not."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from leasework import App, Config, Enqueued, db
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


def test_the_enqueue_role_uses_unique_windows_and_debounce(conn, roles):
    """Through the functions deploy/roles.sql grants it: a unique window, a debounce, and a
    debounce_merge (leasework.debounce_pending reads and locks the key's pending debounced run).
    It reads no other payload that way: a run of the key that no debounce made, another kind's,
    and a family's key are not given to it."""
    app = _app()
    enqueue_dsn = roles("leasework_enqueue")

    def union(old, new):
        return {"items": sorted(set(old["items"]) | set(new["items"]))}

    with psycopg.connect(enqueue_dsn, autocommit=True) as web:
        first = app.enqueue(web, "work", {}, key="acct", tenant="t", unique_for=3600)
        assert app.enqueue_run(web, "work", {}, key="acct", tenant="t", unique_for=3600) == (
            Enqueued(first, True)
        )
        doc = app.enqueue(web, "work", {"items": [1]}, key="doc", debounce=60)
        merged = app.enqueue_run(
            web, "work", {"items": [2]}, key="doc", debounce=60, debounce_merge=union
        )
        assert merged.run_id == doc and merged.how == "debounced"
        plain = app.enqueue(web, "work", {"secret": 1}, key="plain")
        pending = "SELECT * FROM leasework.debounce_pending(%s, %s, %s)"
        assert web.execute(pending, ("work", "plain", None)).fetchall() == []
        assert web.execute(pending, ("other", "doc", None)).fetchall() == []
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="reserved"):
            web.execute(pending, ("sync", "leasework:connection:1", "ws"))
    assert get_run(conn, doc)["payload"] == {"items": [1, 2]}
    assert get_run(conn, plain)["payload"] == {"secret": 1}


def test_the_enqueue_role_enqueues_workflows_and_batches(conn, roles):
    """Through the functions deploy/roles.sql grants it (docs/workflows.md): a run after
    others, a workflow, a batch and a run joining it; the worker role's deps stage then decides
    the waiting runs."""
    app = _app()
    enqueue_dsn = roles("leasework_enqueue")
    with psycopg.connect(enqueue_dsn, autocommit=True) as web:
        first = app.enqueue(web, "work", {})
        second = app.enqueue(web, "work", {}, after=[first])
        wf = app.workflow()
        a = wf.add("work", {}, name="a")
        wf.add("work", {}, name="b", after=a)
        ids = wf.enqueue(web)
        batch = app.batch("work", {})
        batch.add(web, "work", {})
        callback = batch.close(web)
        app.batch_of(callback).add(web, "work", {})
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            web.execute("INSERT INTO leasework.run_deps (child, parent) VALUES (1, 2)")
    worker_dsn = roles("leasework_worker")
    cfg = Config(dsn=worker_dsn, poll_interval=0.05)
    worker = Worker(app.with_config(cfg), cfg)
    worker.open()
    worker.running = True
    try:
        for _ in range(20):
            worker.poll()
    finally:
        worker.close()
    done = [get_run(conn, i)["status"] for i in (first, second, ids["a"], ids["b"], callback)]
    assert done == ["succeeded"] * 5


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


# -- run by a schema owner that is no superuser (issue 34) ---------------------------------------


class Owners:
    """Login roles that are no superuser, each owning a database it migrated itself (as
    `leasework migrate` would), and role names of their own for roles.sql to make: all dropped
    after the test (roles are cluster-wide, and other suites share the server)."""

    def __init__(self, server_dsn: str) -> None:
        self.server_dsn = server_dsn
        self.made: list[tuple[str, str]] = []
        self.roles: list[str] = []

    def dsn(self, createrole: bool = False) -> str:
        name, db_name = f"lw_owner_{secrets.token_hex(4)}", f"lw_roles_{secrets.token_hex(4)}"
        with psycopg.connect(self.server_dsn, autocommit=True) as admin:
            admin.execute(
                sql.SQL("CREATE ROLE {} LOGIN NOSUPERUSER {}").format(
                    sql.Identifier(name), sql.SQL("CREATEROLE" if createrole else "NOCREATEROLE")
                )
            )
            self.made.append((name, db_name))
            admin.execute(
                sql.SQL("CREATE DATABASE {} OWNER {}").format(
                    sql.Identifier(db_name), sql.Identifier(name)
                )
            )
        params = conninfo_to_dict(self.server_dsn)
        params.update(user=name, dbname=db_name)
        owner_dsn = make_conninfo(**params)
        with psycopg.connect(owner_dsn, autocommit=True) as c:
            db.migrate(c)
        return owner_dsn

    def role_names(self) -> tuple[str, str]:
        """Names for the worker and enqueue roles that no other test uses."""
        worker, enqueue = f"lw_w_{secrets.token_hex(4)}", f"lw_e_{secrets.token_hex(4)}"
        self.roles += [worker, enqueue]
        return worker, enqueue

    def drop(self) -> None:
        with psycopg.connect(self.server_dsn, autocommit=True) as admin:
            for name, db_name in self.made:
                admin.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                        sql.Identifier(db_name)
                    )
                )
                admin.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))
            for name in self.roles:
                admin.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))


@pytest.fixture
def owners(server_dsn: str) -> Iterator[Owners]:
    made = Owners(server_dsn)
    yield made
    made.drop()


def _renamed(worker: str, enqueue: str) -> str:
    """roles.sql for roles of other names: the cluster's own leasework roles stay untouched."""
    return (
        ROLES.read_text().replace("leasework_worker", worker).replace("leasework_enqueue", enqueue)
    )


def test_an_owner_without_createrole_runs_roles_sql_once_the_roles_exist(conn, owners):
    conn.execute(ROLES.read_text())  # as a superuser: the roles exist
    with psycopg.connect(owners.dsn(), autocommit=True) as c:
        assert c.execute(
            "SELECT rolsuper, rolcreaterole FROM pg_roles WHERE rolname = current_user"
        ).fetchone() == (False, False)
        c.execute(ROLES.read_text())
        c.execute(ROLES.read_text())  # and again, as after an upgrade
        granted = c.execute(
            "SELECT has_table_privilege('leasework_worker', 'leasework.runs', 'UPDATE'),"
            " has_function_privilege('leasework_enqueue', 'leasework.cancel(bigint)', 'EXECUTE'),"
            " has_table_privilege('leasework_enqueue', 'leasework.runs', 'SELECT')"
        ).fetchone()
    assert granted == (True, True, False)


def test_missing_roles_that_the_owner_cannot_create_are_named_in_one_line(owners, server_dsn):
    worker, enqueue = owners.role_names()
    with psycopg.connect(owners.dsn(), autocommit=True) as c:
        with pytest.raises(psycopg.errors.InsufficientPrivilege) as err:
            c.execute(_renamed(worker, enqueue))
        message = err.value.diag.message_primary or ""
        assert "\n" not in message
        assert "ask a superuser to run" in message and "CREATEROLE" in message, message
        assert f"CREATE ROLE {worker} NOLOGIN; CREATE ROLE {enqueue} NOLOGIN;" in message
        with psycopg.connect(server_dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("CREATE ROLE {} NOLOGIN").format(sql.Identifier(worker)))
        with pytest.raises(psycopg.errors.InsufficientPrivilege) as err:
            c.execute(_renamed(worker, enqueue))
        message = err.value.diag.message_primary or ""
        assert f"{enqueue} is missing" in message and f"CREATE ROLE {worker}" not in message
        # Nothing of the file was applied: it stopped at the roles.
        assert c.execute(
            "SELECT has_table_privilege(%s, 'leasework.runs', 'UPDATE')", (worker,)
        ).fetchone() == (False,)


def test_an_owner_with_createrole_makes_the_missing_roles(owners):
    worker, enqueue = owners.role_names()
    with psycopg.connect(owners.dsn(createrole=True), autocommit=True) as c:
        c.execute(_renamed(worker, enqueue))
        assert c.execute(
            "SELECT has_table_privilege(%s, 'leasework.runs', 'UPDATE'),"
            " has_table_privilege(%s, 'leasework.runs', 'SELECT')",
            (worker, enqueue),
        ).fetchone() == (True, False)


# -- Tracing (docs/operations.md, "Tracing"): the enqueue role writes its span's traceparent into its run --------


def test_the_enqueue_role_keeps_its_trace_in_its_run(conn, roles):
    """Through leasework.trace_run, which deploy/roles.sql grants it: the Python enqueue inside a
    span writes its traceparent; the function sets it once, on a queued run, and nothing else."""
    trace = pytest.importorskip("opentelemetry.trace")
    app = _app()
    span = trace.NonRecordingSpan(
        trace.SpanContext(0xAB, 0xCD, is_remote=False, trace_flags=trace.TraceFlags(1))
    )
    with psycopg.connect(roles("leasework_enqueue"), autocommit=True) as web:
        with trace.use_span(span):
            traced = app.enqueue(web, "work", {})
        plain = app.enqueue(web, "work", {})
        other = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"
        # not a second time, and not on a run that is no longer queued
        assert web.execute("SELECT leasework.trace_run(%s, %s)", (traced, other)).fetchone() == (
            False,
        )
        conn.execute("UPDATE leasework.runs SET status = 'cancelled', finished_at = now()"
                     " WHERE id = %s", (plain,))  # fmt: skip
        assert web.execute("SELECT leasework.trace_run(%s, %s)", (plain, other)).fetchone() == (
            False,
        )
    stored = conn.execute(
        "SELECT id, traceparent FROM leasework.runs WHERE id = ANY(%s)", ([traced, plain],)
    ).fetchall()
    assert dict(stored) == {traced: f"00-{0xAB:032x}-{0xCD:016x}-01", plain: None}
