"""Versioned migrations: every migration from 0001 gives exactly the schema a fresh `schema.sql`
gives (catalog dumps compared), pending ones apply in order in one transaction under a lock, and
`migrate --check`, workers and the supervisor refuse a schema that is behind."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from leasework import db
from leasework.db import Migration
from leasework.errors import LeaseworkError, SchemaMissing

from .. import clock

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = db.migrations()

# What "the same schema" means: every table (with its storage parameters), column, constraint,
# index, function, trigger, view, domain and sequence in the `leasework` schema, by name and definition. Column order is left out: a
# migration can only append a column, while schema.sql may list it where it reads best.
CATALOG: dict[str, str] = {
    "tables": """
        SELECT c.relname, c.relkind::text, c.relpersistence::text, c.reloptions::text
          FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = 'leasework' AND c.relkind IN ('r', 'p', 'v', 'm', 'S')
         ORDER BY 1""",
    "columns": """
        SELECT c.relname, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
               pg_get_expr(d.adbin, d.adrelid), a.attidentity::text, a.attgenerated::text
          FROM pg_attribute a
          JOIN pg_class c ON c.oid = a.attrelid
          JOIN pg_namespace n ON n.oid = c.relnamespace
          LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
         WHERE n.nspname = 'leasework' AND c.relkind IN ('r', 'p') AND a.attnum > 0
           AND NOT a.attisdropped
         ORDER BY 1, 2""",
    "constraints": """
        SELECT c.relname, k.conname, pg_get_constraintdef(k.oid)
          FROM pg_constraint k
          JOIN pg_class c ON c.oid = k.conrelid
          JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = 'leasework'
         ORDER BY 1, 2""",
    "indexes": """
        SELECT tablename, indexname, indexdef FROM pg_indexes
         WHERE schemaname = 'leasework' ORDER BY 1, 2""",
    "functions": """
        SELECT p.proname, pg_get_function_identity_arguments(p.oid), pg_get_functiondef(p.oid)
          FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
         WHERE n.nspname = 'leasework' ORDER BY 1, 2""",
    "triggers": """
        SELECT c.relname, t.tgname, pg_get_triggerdef(t.oid)
          FROM pg_trigger t
          JOIN pg_class c ON c.oid = t.tgrelid
          JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = 'leasework' AND NOT t.tgisinternal
         ORDER BY 1, 2""",
    "domains": """
        SELECT t.typname, format_type(t.typbasetype, t.typtypmod), t.typnotnull, k.conname,
               pg_get_constraintdef(k.oid)
          FROM pg_type t
          JOIN pg_namespace n ON n.oid = t.typnamespace
          LEFT JOIN pg_constraint k ON k.contypid = t.oid
         WHERE n.nspname = 'leasework' AND t.typtype = 'd'
         ORDER BY 1, 4""",
    "views": """
        SELECT viewname, definition FROM pg_views WHERE schemaname = 'leasework' ORDER BY 1""",
}


def catalog(conn: psycopg.Connection[Any]) -> dict[str, list[tuple[Any, ...]]]:
    return {what: conn.execute(query).fetchall() for what, query in CATALOG.items()}


@pytest.fixture
def scratch(server_dsn: str) -> Iterator[Callable[[], str]]:
    """scratch() -> the DSN of a new empty database, dropped after the test."""
    made: list[str] = []

    def factory() -> str:
        name = f"leasework_mig_{os.getpid()}_{secrets.token_hex(3)}"
        with psycopg.connect(server_dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        made.append(name)
        params = conninfo_to_dict(server_dsn)
        params["dbname"] = name
        return make_conninfo(**params)

    yield factory
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        for name in made:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


@contextmanager
def extra_migrations(monkeypatch: pytest.MonkeyPatch, *extra: str) -> Iterator[int]:
    """Pretend this leasework ships more migrations than it does (the next versions)."""
    base = SHIPPED
    more = tuple(
        Migration(len(base) + i + 1, f"test_{i + 1}", text) for i, text in enumerate(extra)
    )
    monkeypatch.setattr(db, "migrations", lambda: base + more)
    monkeypatch.setattr(db, "SCHEMA_VERSION", len(base) + len(more))
    yield len(base) + len(more)


def test_every_migration_from_the_first_gives_the_fresh_schema(
    scratch: Callable[[], str],
) -> None:
    with psycopg.connect(scratch(), autocommit=True) as fresh:
        done = db.migrate(fresh)
        assert done.before is None and done.applied == ("schema.sql",)
        want = catalog(fresh)
        fresh_version = db.current_version(fresh)
    with psycopg.connect(scratch(), autocommit=True) as upgraded:
        with upgraded.transaction():
            db.apply_migrations(upgraded, list(db.migrations()))
        got = catalog(upgraded)
        assert db.current_version(upgraded) == fresh_version == db.SCHEMA_VERSION
    for what in CATALOG:
        missing = sorted(set(want[what]) - set(got[what]), key=repr)
        extra = sorted(set(got[what]) - set(want[what]), key=repr)
        assert not missing and not extra, (
            f"{what} differ between schema.sql and the migrations 0001..{db.SCHEMA_VERSION}.\n"
            f"  only in schema.sql: {missing}\n  only after the migrations: {extra}\n"
            "Changed schema.sql? Add leasework/migrations/NNNN_what.sql making the same change."
        )


def test_a_migrated_database_runs_on_the_servers_clock(scratch: Callable[[], str]) -> None:
    """Production's leasework.now() is now(), whatever leasework.now_offset says: only the test
    suite's own databases get the movable clock (tests/clock.py)."""
    for migrate in (db.migrate, lambda c: db.apply_migrations(c, list(db.migrations()))):
        with psycopg.connect(scratch()) as conn:
            migrate(conn)
            conn.execute("SELECT set_config('leasework.now_offset', '1 day', true)")
            row = conn.execute("SELECT leasework.now() = now(), leasework.now()").fetchone()
            assert row is not None and row[0], f"leasework.now() is {row}, not now()"
            clock.install(conn)
            moved = conn.execute("SELECT leasework.now() - now()").fetchone()
            assert moved is not None and moved[0] == timedelta(days=1)
            conn.rollback()


def test_migrations_are_numbered_without_gaps() -> None:
    numbers = [m.version for m in db.migrations()]
    assert numbers == list(range(1, len(numbers) + 1))
    assert numbers[-1] == db.SCHEMA_VERSION
    names = sorted(p.name for p in (ROOT / "leasework" / "migrations").glob("*.sql"))
    assert len(names) == len(numbers), "a migration file does not match NNNN_what.sql"


def test_migrate_twice_is_a_no_op(scratch: Callable[[], str]) -> None:
    with psycopg.connect(scratch(), autocommit=True) as conn:
        db.migrate(conn)
        again = db.migrate(conn)
        assert again.applied == () and again.after == db.SCHEMA_VERSION


def test_pending_migrations_apply_in_order_and_a_failure_rolls_back_all(
    scratch: Callable[[], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with psycopg.connect(scratch(), autocommit=True) as conn:
        db.migrate(conn)
        base = db.SCHEMA_VERSION
        with extra_migrations(
            monkeypatch,
            "ALTER TABLE leasework.runs ADD COLUMN note text",
            "ALTER TABLE leasework.runs ADD COLUMN no_such_type nosuchtype",
        ):
            with pytest.raises(LeaseworkError, match=f"migration {base + 2:04d}_test_2 failed"):
                db.migrate(conn)
            assert db.current_version(conn) == base
            cols = conn.execute(
                "SELECT count(*) FROM information_schema.columns"
                " WHERE table_schema = 'leasework' AND table_name = 'runs' AND column_name = 'note'"
            ).fetchone()
            assert cols == (0,), "the first migration must roll back with the second"
        with extra_migrations(
            monkeypatch,
            "ALTER TABLE leasework.runs ADD COLUMN note text",
            "UPDATE leasework.runs SET note = 'x'",  # needs the column: order matters
        ) as latest:
            done = db.migrate(conn)
            assert done.before == base and done.after == latest
            assert done.applied == (f"{base + 1:04d}_test_1", f"{base + 2:04d}_test_2")


def test_two_hosts_migrating_at_once_apply_each_migration_once(
    scratch: Callable[[], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    target = scratch()
    with psycopg.connect(target, autocommit=True) as conn:
        db.migrate(conn)
    # Not idempotent on purpose: applied twice it would fail.
    with extra_migrations(
        monkeypatch, "ALTER TABLE leasework.runs ADD COLUMN note text; SELECT pg_sleep(0.3)"
    ) as latest:
        results: list[Any] = []

        def run() -> None:
            try:
                with psycopg.connect(target, autocommit=True) as c:
                    results.append(db.migrate(c))
            except Exception as exc:
                results.append(exc)

        threads = [threading.Thread(target=run) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert all(isinstance(r, db.Migrated) for r in results), results
    assert sorted(len(r.applied) for r in results) == [0, 1]
    assert all(r.after == latest for r in results)


def test_check_schema_refuses_a_schema_that_is_behind(
    scratch: Callable[[], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with psycopg.connect(scratch(), autocommit=True) as conn:
        with pytest.raises(SchemaMissing, match="missing: run `leasework migrate`"):
            db.check_schema(conn)
        db.migrate(conn)
        db.check_schema(conn)
        with (
            extra_migrations(monkeypatch, "SELECT 1") as latest,
            pytest.raises(SchemaMissing, match=f"needs {latest}: run `leasework migrate`"),
        ):
            db.check_schema(conn)
        conn.execute("UPDATE leasework.schema_version SET version = version + 5")
        db.check_schema(conn)  # newer than this code: accepted (rolling upgrades)


def _cli(*args: str, dsn: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LEASEWORK_DSN": dsn, "LEASEWORK_LOG_FORMAT": "json"}
    env.pop("LEASEWORK_APP", None)
    return subprocess.run(
        [sys.executable, "-m", "leasework", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


def test_cli_migrate_check_and_workers_refuse_a_schema_behind(scratch: Callable[[], str]) -> None:
    target = scratch()
    check = _cli("migrate", "--check", dsn=target)
    assert check.returncode == 1 and "not installed" in check.stdout, check
    done = _cli("migrate", dsn=target)
    assert done.returncode == 0 and f"installed at version {db.SCHEMA_VERSION}" in done.stdout
    assert _cli("migrate", "--check", dsn=target).returncode == 0
    with psycopg.connect(target, autocommit=True) as conn:
        # A database one version behind (the last migration re-applies cleanly: idempotent).
        conn.execute("UPDATE leasework.schema_version SET version = version - 1")
    behind = _cli("migrate", "--check", dsn=target)
    assert behind.returncode == 1 and f"needs {db.SCHEMA_VERSION}" in behind.stdout, behind
    worker = _cli("worker", "--once", dsn=target)
    assert worker.returncode == 2
    assert worker.stderr.strip().splitlines() == [
        f"leasework: the leasework schema is at version {db.SCHEMA_VERSION - 1}, this leasework "
        f"needs {db.SCHEMA_VERSION}: run `leasework migrate`"
    ], worker.stderr
    supervisor = _cli("supervise", "--app", "leasework.demo:demo_app", dsn=target)
    assert supervisor.returncode == 2 and "run `leasework migrate`" in supervisor.stderr
    assert len(supervisor.stderr.strip().splitlines()) == 1, supervisor.stderr
    up = _cli("migrate", dsn=target)
    assert up.returncode == 0 and "migrated from version" in up.stdout, up
    assert _cli("migrate", "--check", dsn=target).returncode == 0


def test_migration_0011_keeps_the_grants_of_the_enqueue_it_replaces(
    scratch: Callable[[], str],
) -> None:
    """0011 drops leasework.enqueue to change two parameter types: whoever could call the old
    one (deploy/roles.sql's leasework_enqueue) must still call the new one, and PUBLIC not."""
    role = f"leasework_mig_role_{secrets.token_hex(3)}"
    with psycopg.connect(scratch(), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(role)))
        try:
            with conn.transaction():
                db.apply_migrations(conn, [m for m in SHIPPED if m.version <= 10])
            conn.execute(
                sql.SQL(
                    "GRANT EXECUTE ON FUNCTION leasework.enqueue(text, jsonb, text, text, text,"
                    " boolean, integer, double precision, integer, double precision,"
                    " double precision) TO {}"
                ).format(sql.Identifier(role))
            )
            with conn.transaction():
                db.apply_migrations(conn, [m for m in SHIPPED if m.version == 11])
            new = (
                "leasework.enqueue(text, jsonb, text, text, text, boolean, double precision,"
                " double precision, double precision, double precision, double precision)"
            )
            assert conn.execute(
                "SELECT has_function_privilege(%s, %s, 'EXECUTE'),"
                "       has_function_privilege('public', %s, 'EXECUTE'),"
                "       count(*) FROM pg_proc WHERE proname = 'enqueue'",
                (role, new, new),
            ).fetchone() == (True, False, 1)
            with conn.transaction():  # idempotent: applied again, nothing changes
                db.apply_migrations(conn, [m for m in SHIPPED if m.version == 11])
            assert conn.execute(
                "SELECT has_function_privilege(%s, %s, 'EXECUTE')", (role, new)
            ).fetchone() == (True,)
        finally:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_migration_0022_keeps_the_grants_of_the_enqueue_it_replaces(
    scratch: Callable[[], str],
) -> None:
    """0022 drops leasework.enqueue to add its window and debounce parameters: whoever could
    call the old one may call the new one and leasework.debounce_pending, PUBLIC neither; an
    older release's call (the first eleven arguments, by position) still works."""
    role = f"leasework_mig_role_{secrets.token_hex(3)}"
    old = (
        "leasework.enqueue(text, jsonb, text, text, text, boolean, double precision,"
        " double precision, double precision, double precision, double precision)"
    )
    new = (
        "leasework.enqueue(text, jsonb, text, text, text, boolean, double precision,"
        " double precision, double precision, double precision, double precision,"
        " double precision, double precision, double precision, bigint, integer)"
    )
    pending = "leasework.debounce_pending(text, text, text)"
    with psycopg.connect(scratch(), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(role)))
        try:
            with conn.transaction():
                db.apply_migrations(conn, [m for m in SHIPPED if m.version <= 21])
            conn.execute(
                sql.SQL(f"GRANT EXECUTE ON FUNCTION {old} TO {{}}").format(sql.Identifier(role))
            )
            with conn.transaction():
                db.apply_migrations(conn, [m for m in SHIPPED if m.version == 22])
            assert conn.execute(
                "SELECT has_function_privilege(%s, %s, 'EXECUTE'),"
                "       has_function_privilege(%s, %s, 'EXECUTE'),"
                "       has_function_privilege('public', %s, 'EXECUTE'),"
                "       has_function_privilege('public', %s, 'EXECUTE'),"
                "       count(*) FROM pg_proc WHERE proname = 'enqueue'",
                (role, new, role, pending, new, pending),
            ).fetchone() == (True, True, False, False, 1)
            conn.execute(sql.SQL("GRANT USAGE ON SCHEMA leasework TO {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(role)))
            row = conn.execute(
                "SELECT leasework.enqueue('report', '{}', 'k', NULL, NULL, false, 0, 0, 3, NULL,"
                " 3600)"
            ).fetchone()
            assert row is not None and row[0] is not None
        finally:
            conn.execute("RESET ROLE")
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_migration_0026_keeps_the_grants_of_the_enqueue_it_replaces(
    scratch: Callable[[], str],
) -> None:
    """0026 drops leasework.enqueue to add `after` and `on_parent_failure`: whoever could call
    the old one may call the new one and leasework.join_batch, PUBLIC neither; a call of the
    sixteen arguments before still works, and runs enqueued before keep working."""
    role = f"leasework_mig_role_{secrets.token_hex(3)}"
    old = (
        "leasework.enqueue(text, jsonb, text, text, text, boolean, double precision,"
        " double precision, double precision, double precision, double precision,"
        " double precision, double precision, double precision, bigint, integer)"
    )
    new = old.removesuffix(")") + ", bigint[], text)"
    join = "leasework.join_batch(bigint, bigint)"
    with psycopg.connect(scratch(), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(role)))
        try:
            with conn.transaction():
                db.apply_migrations(conn, [m for m in SHIPPED if m.version <= 25])
            before = conn.execute("SELECT leasework.enqueue('report')").fetchone()
            assert before is not None
            conn.execute(
                sql.SQL(f"GRANT EXECUTE ON FUNCTION {old} TO {{}}").format(sql.Identifier(role))
            )
            with conn.transaction():
                db.apply_migrations(conn, [m for m in SHIPPED if m.version == 26])
            assert conn.execute(
                "SELECT has_function_privilege(%s, %s, 'EXECUTE'),"
                "       has_function_privilege(%s, %s, 'EXECUTE'),"
                "       has_function_privilege('public', %s, 'EXECUTE'),"
                "       has_function_privilege('public', %s, 'EXECUTE'),"
                "       count(*) FROM pg_proc WHERE proname = 'enqueue'",
                (role, new, role, join, new, join),
            ).fetchone() == (True, True, False, False, 1)
            conn.execute(sql.SQL("GRANT USAGE ON SCHEMA leasework TO {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(role)))
            row = conn.execute(
                "SELECT leasework.enqueue('report', '{}', NULL, NULL, NULL, false, 0, 0, 3, NULL,"
                " 3600, NULL, NULL, NULL, NULL, NULL)"
            ).fetchone()
            assert row is not None and row[0] is not None
            after = conn.execute(
                "SELECT leasework.enqueue('report', after => ARRAY[%s]::bigint[])", (before[0],)
            ).fetchone()
            assert after is not None and after[0] is not None
            conn.execute("RESET ROLE")
            assert conn.execute(
                "SELECT status FROM leasework.runs WHERE id = %s", (after[0],)
            ).fetchone() == ("blocked",)
        finally:
            conn.execute("RESET ROLE")
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_migration_0030_keeps_the_grants_of_the_enqueue_it_replaces(
    scratch: Callable[[], str],
) -> None:
    """0030 drops leasework.enqueue to add `tags`: whoever could call the old one may call the
    new one, PUBLIC not; a call of the eighteen arguments before still works (no tags), a call
    with tags stores them, and a run enqueued before keeps working (no tags)."""
    role = f"leasework_mig_role_{secrets.token_hex(3)}"
    old = (
        "leasework.enqueue(text, jsonb, text, text, text, boolean, double precision,"
        " double precision, double precision, double precision, double precision,"
        " double precision, double precision, double precision, bigint, integer, bigint[], text)"
    )
    new = old.removesuffix(")") + ", text[])"
    with psycopg.connect(scratch(), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(role)))
        try:
            with conn.transaction():
                db.apply_migrations(conn, [m for m in SHIPPED if m.version <= 29])
            before = conn.execute("SELECT leasework.enqueue('report')").fetchone()
            assert before is not None
            conn.execute(
                sql.SQL(f"GRANT EXECUTE ON FUNCTION {old} TO {{}}").format(sql.Identifier(role))
            )
            with conn.transaction():
                db.apply_migrations(conn, [m for m in SHIPPED if m.version == 30])
            assert conn.execute(
                "SELECT has_function_privilege(%s, %s, 'EXECUTE'),"
                "       has_function_privilege('public', %s, 'EXECUTE'),"
                "       count(*) FROM pg_proc WHERE proname = 'enqueue'",
                (role, new, new),
            ).fetchone() == (True, False, 1)
            conn.execute(sql.SQL("GRANT USAGE ON SCHEMA leasework TO {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(role)))
            plain = conn.execute(
                "SELECT leasework.enqueue('report', '{}', NULL, NULL, NULL, false, 0, 0, 3, NULL,"
                " 3600, NULL, NULL, NULL, NULL, NULL, NULL, NULL)"
            ).fetchone()
            tagged = conn.execute(
                "SELECT leasework.enqueue('report', tags => array['b', 'a'])"
            ).fetchone()
            conn.execute("RESET ROLE")
            assert plain is not None and tagged is not None
            assert conn.execute(
                "SELECT id, tags FROM leasework.runs ORDER BY id"
            ).fetchall() == [(before[0], None), (plain[0], None), (tagged[0], ["a", "b"])]
            with conn.transaction():  # idempotent: applied again, nothing changes
                db.apply_migrations(conn, [m for m in SHIPPED if m.version == 30])
            assert conn.execute(
                "SELECT has_function_privilege(%s, %s, 'EXECUTE')", (role, new)
            ).fetchone() == (True,)
        finally:
            conn.execute("RESET ROLE")
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_migration_0018_keys_per_tenant_moves_the_families_keys(
    scratch: Callable[[], str],
) -> None:
    """0018 on a database with runs: the families' keys move under "leasework:" (a user's run keyed
    like one keeps its key), a waiting purge still waits for its sync, and a key another tenant
    holds no longer returns that tenant's run. Applied twice, nothing changes the second time."""
    with psycopg.connect(scratch(), autocommit=True) as conn:
        with conn.transaction():
            db.apply_migrations(conn, [m for m in SHIPPED if m.version <= 17])

        def enqueue(kind: str, payload: str, key: str, tenant: str | None = None, **o: Any) -> int:
            row = conn.execute(
                "SELECT leasework.enqueue(%s, %s::jsonb, %s, %s, exclusive => %s)",
                (kind, payload, key, tenant, o.get("exclusive", False)),
            ).fetchone()
            assert row is not None
            return int(row[0])

        done = enqueue("sync", '{"connection_id": 5}', "connection:5", "ws")
        conn.execute(
            "UPDATE leasework.runs SET status = 'succeeded', finished_at = now() WHERE id = %s",
            (done,),
        )
        sync = enqueue("sync", '{"connection_id": 6}', "connection:6", "ws")
        purge = enqueue("purge", '{"connection_id": 6}', "connection:6", "ws", exclusive=True)
        ingest = enqueue("ingest", '{"file_id": 3}', "file:3")
        users = [
            enqueue("report", "{}", "file:7"),
            enqueue("sync", '{"connection_id": 8}', "connection:9", "ws"),
        ]
        held = enqueue("report", "{}", "report:weekly", "a")
        assert enqueue("report", "{}", "report:weekly", "b") == held  # before: one key for all
        status = conn.execute("SELECT status FROM leasework.runs WHERE id = %s", (purge,))
        assert status.fetchone() == ("waiting",)

        for _ in range(2):
            with conn.transaction():
                db.apply_migrations(conn, [m for m in SHIPPED if m.version == 18])
            keys = dict(conn.execute("SELECT id, key FROM leasework.runs").fetchall())
            assert (keys[done], keys[sync], keys[purge], keys[ingest]) == (
                "leasework:connection:5",
                "leasework:connection:6",
                "leasework:connection:6",
                "leasework:file:3",
            )
            assert [keys[u] for u in users] == ["file:7", "connection:9"]
        # The purge still waits for its connection's sync, under the new key.
        key = "leasework:connection:6"
        assert enqueue("purge", '{"connection_id": 6}', key, "ws", exclusive=True) == purge
        assert enqueue("sync", '{"connection_id": 6}', key, "ws") == sync
        # Tenant b's key is its own now; tenant a's enqueue still gets a's run.
        mine = enqueue("report", "{}", "report:weekly", "b")
        assert mine != held and enqueue("report", "{}", "report:weekly", "a") == held


def test_migration_0018_gives_up_behind_a_long_transaction(scratch: Callable[[], str]) -> None:
    """On a live table 0018 waits for its lock on runs at most lock_timeout (5 s), then fails
    with one line, nothing applied, rather than hold every claim and enqueue up behind a long
    transaction meanwhile; once that transaction ends, it applies."""
    target = scratch()
    with psycopg.connect(target, autocommit=True) as conn:
        conn.execute("SET statement_timeout = '60s'")  # without its lock_timeout: fail, not hang
        with conn.transaction():
            db.apply_migrations(conn, [m for m in SHIPPED if m.version <= 17])
        with psycopg.connect(target) as long_running:
            long_running.execute("SELECT count(*) FROM leasework.runs")  # ACCESS SHARE, held
            gave_up = "0018_keys_per_tenant failed, nothing was applied: .*lock timeout"
            with pytest.raises(LeaseworkError, match=gave_up), conn.transaction():
                db.apply_migrations(conn, [m for m in SHIPPED if m.version == 18])
            long_running.rollback()
        assert db.current_version(conn) == 17
        with conn.transaction():
            db.apply_migrations(conn, [m for m in SHIPPED if m.version == 18])
        assert db.current_version(conn) == 18


def test_the_dependency_policies_migration_grants_whoever_may_join_a_batch(
    scratch: Callable[[], str],
) -> None:
    """The migration that adds leasework.set_dependency_policy grants it to the roles that may
    call leasework.join_batch (the enqueue role of deploy/roles.sql), not to PUBLIC."""
    role = f"leasework_mig_role_{secrets.token_hex(3)}"
    (policies,) = [m for m in SHIPPED if m.name.endswith("dependency_policies")]
    fn = "leasework.set_dependency_policy(bigint, bigint, text)"
    with psycopg.connect(scratch(), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(role)))
        try:
            with conn.transaction():
                db.apply_migrations(conn, [m for m in SHIPPED if m.version < policies.version])
            conn.execute(
                sql.SQL("GRANT EXECUTE ON FUNCTION leasework.join_batch(bigint, bigint) TO {}")
                .format(sql.Identifier(role))
            )
            with conn.transaction():
                db.apply_migrations(conn, [policies])
            assert conn.execute(
                "SELECT has_function_privilege(%s, %s, 'EXECUTE'),"
                "       has_function_privilege('public', %s, 'EXECUTE')",
                (role, fn, fn),
            ).fetchone() == (True, False)
        finally:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_the_rate_windows_migration_keeps_each_kinds_window(scratch: Callable[[], str]) -> None:
    """The migration that moves a kind's rate window into leasework.rate_windows copies the
    windows kept in leasework.kind_limits, so the claims they count still count; applied again,
    it keeps a window written since."""
    mine = next(m for m in SHIPPED if m.name == "rate_windows")
    with psycopg.connect(scratch(), autocommit=True) as conn:
        with conn.transaction():
            db.apply_migrations(conn, [m for m in SHIPPED if m.version < mine.version])
        conn.execute(
            "INSERT INTO leasework.kind_limits (kind, declared, win)"
            " VALUES ('metered', '{\"rate\": [2, 3600]}',"
            "         leasework.rate_recorded(NULL, 3600, now(), 2)),"
            "        ('capped', '{\"max_running\": 1}', NULL)"
        )

        def used() -> list[tuple[Any, ...]]:
            return conn.execute(
                "SELECT kind, leasework.rate_used(win, 3600, now()) FROM leasework.rate_windows"
            ).fetchall()

        with conn.transaction():
            db.apply_migrations(conn, [mine])
        assert used() == [("metered", 2)]
        conn.execute("INSERT INTO leasework.runs (kind) VALUES ('metered')")
        admitted = conn.execute(
            "SELECT leasework.admit(array_agg(id), array_agg(kind), ARRAY[NULL::text], 1, NULL,"
            " 'w') FROM leasework.runs"
        ).fetchone()
        assert admitted == ([],), "a claim went past the window the migration kept"
        conn.execute(
            "UPDATE leasework.rate_windows SET win = leasework.rate_recorded(NULL, 3600, now(), 1)"
        )
        with conn.transaction():
            db.apply_migrations(conn, [mine])
        assert used() == [("metered", 1)]


def test_the_rate_shards_migration_carries_each_kinds_window(scratch: Callable[[], str]) -> None:
    """The migration that splits a kind's rate window into shards carries the claims of
    leasework.rate_windows into them: in the first shard when they fit its share, else as
    `carried` in every shard; the claims they count still count, and applied again it changes
    nothing."""
    mine = next(m for m in SHIPPED if m.name == "rate_shards")
    with psycopg.connect(scratch(), autocommit=True) as conn:
        with conn.transaction():
            db.apply_migrations(conn, [m for m in SHIPPED if m.version < mine.version])
        conn.execute(
            "INSERT INTO leasework.kind_limits (kind, declared)"
            " VALUES ('metered', '{\"rate\": [2, 3600]}'), ('busy', '{\"rate\": [1000, 3600]}'),"
            "        ('capped', '{\"max_running\": 1}');"
            "INSERT INTO leasework.rate_windows (kind, win)"
            " VALUES ('metered', leasework.rate_recorded(NULL, 3600, now(), 2)),"
            "        ('busy', leasework.rate_recorded(NULL, 3600, now(), 3))"
        )

        def shards() -> list[tuple[Any, ...]]:
            return conn.execute(
                "SELECT kind, shard, share, leasework.rate_used(win, 3600, now()),"
                "       leasework.rate_used(carried, 3600, now())"
                "  FROM leasework.rate_shards ORDER BY kind, shard"
            ).fetchall()

        with conn.transaction():
            db.apply_migrations(conn, [mine])
        kept = shards()
        assert kept == [
            *[("busy", i, 125, 3 if i == 0 else 0, 0) for i in range(8)],
            ("metered", 0, 1, 0, 2),
            ("metered", 1, 1, 0, 2),
        ]
        conn.execute("INSERT INTO leasework.runs (kind) VALUES ('metered'), ('busy')")

        def admit(kind: str) -> Any:
            row = conn.execute(
                "SELECT leasework.admit(array_agg(id), array_agg(kind), ARRAY[NULL::text], 1,"
                " NULL, 'w') FROM leasework.runs WHERE kind = %s",
                (kind,),
            ).fetchone()
            assert row is not None
            return row[0]

        assert admit("metered") == [], "a claim went past the window the migration carried"
        assert len(admit("busy")) == 1
        with conn.transaction():
            db.apply_migrations(conn, [mine])
        assert shards() == [
            *[("busy", i, 125, 4 if i == 0 else 0, 0) for i in range(8)],
            *kept[8:],
        ]
