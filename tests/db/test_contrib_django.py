"""leasework.contrib.django on real Django (psycopg 3 backend) and real Postgres: `migrate`
installs the leasework schema through the app's Django migration, the run commits and rolls back
with transaction.atomic(), the management command runs the CLI on Django's database, and
anything but a PostgreSQL connection on psycopg 3 is refused in one line."""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

django = pytest.importorskip("django")

from django.conf import settings  # noqa: E402

from leasework import App, db  # noqa: E402
from leasework.contrib import django as lw_django  # noqa: E402

Conn = psycopg.Connection[Any]
FRESH = "leasework_test_django_fresh"


def _db(dsn: str, name: str | None = None) -> dict[str, Any]:
    p = conninfo_to_dict(dsn)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": name or p.get("dbname"),
        "USER": p.get("user", "postgres"),
        "HOST": p.get("host", "127.0.0.1"),
        "PORT": p.get("port", "5432"),
    }


@pytest.fixture(scope="module")
def djangodb(dsn: str, server_dsn: str) -> Iterator[None]:
    """Django configured once (settings are per process) on the test database, plus a fresh
    database without the leasework schema for `migrate`."""
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(FRESH))
        )
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(FRESH)))
    if not settings.configured:
        settings.configure(
            DATABASES={"default": _db(dsn), "fresh": _db(dsn, FRESH)},
            INSTALLED_APPS=["leasework.contrib.django"],
            USE_TZ=True,
            LEASEWORK={"APP": "tests.db.test_contrib_django:app"},
        )
        django.setup()
    yield
    from django.db import connections

    connections.close_all()
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(FRESH))
        )


app = App()
app.task("ship")(lambda ctx, p: None)


def runs(conn: Conn) -> list[Any]:
    return [r[0] for r in conn.execute("SELECT payload FROM leasework.runs ORDER BY id")]


def test_migrate_installs_the_schema(djangodb: None, server_dsn: str) -> None:
    from django.core.management import call_command

    call_command("migrate", "leasework", database="fresh", verbosity=0)
    fresh = psycopg.conninfo.make_conninfo(server_dsn, dbname=FRESH)
    with psycopg.connect(fresh) as c:
        assert db.current_version(c) == db.SCHEMA_VERSION
        applied = c.execute("SELECT name FROM django_migrations WHERE app = 'leasework'").fetchall()
    assert applied == [("0001_leasework_schema",)]


def test_the_run_commits_and_rolls_back_with_atomic(djangodb: None, conn: Conn) -> None:
    from django.db import connection, transaction

    conn.execute("CREATE TABLE IF NOT EXISTS public.dj_orders (id int)")
    conn.execute("TRUNCATE public.dj_orders")
    with pytest.raises(RuntimeError, match="boom"), transaction.atomic():
        with connection.cursor() as cur:
            cur.execute("INSERT INTO public.dj_orders VALUES (1)")
        lw_django.enqueue(app, connection, "ship", {"order": 1})
        raise RuntimeError("boom")
    assert runs(conn) == [] and conn.execute(
        "SELECT count(*) FROM public.dj_orders"
    ).fetchone() == (0,)

    with transaction.atomic():
        lw_django.enqueue(app, connection, "ship", {"order": 2})  # the transaction's first query
        assert runs(conn) == []  # not visible before Django commits
        with connection.cursor() as cur:
            cur.execute("INSERT INTO public.dj_orders VALUES (2)")
        lw_django.enqueue_many(app, "default", "ship", [{"order": 3}])
    assert runs(conn) == [{"order": 2}, {"order": 3}]
    lw_django.enqueue(app, connection, "ship", {"order": 4})  # autocommit outside atomic, as Django
    assert runs(conn)[-1] == {"order": 4}


def test_debounce_in_a_django_transaction(djangodb: None, conn: Conn) -> None:
    """The enqueue options pass through: a debounced enqueue inside atomic() merges into the
    key's pending run, and rolls back with it."""
    from django.db import connection, transaction

    with transaction.atomic():
        first = lw_django.enqueue(app, connection, "ship", {"v": 1}, key="doc", debounce=60)
        assert lw_django.enqueue(app, connection, "ship", {"v": 2}, key="doc", debounce=60) == first
    with pytest.raises(RuntimeError, match="boom"), transaction.atomic():
        lw_django.enqueue(app, connection, "ship", {"v": 3}, key="doc", debounce=60)
        raise RuntimeError("boom")
    assert runs(conn) == [{"v": 2}]


def test_wrong_connections_are_refused_in_one_line(djangodb: None, dsn: str, conn: Conn) -> None:
    with psycopg.connect(dsn) as raw, pytest.raises(TypeError) as exc:
        lw_django.enqueue(app, raw, "ship", {})
    assert str(exc.value) == (
        "enqueue needs a Django database connection (django.db.connection, connections[alias]) "
        "or an alias, got psycopg.Connection"
    )
    with pytest.raises(TypeError, match="no Django database 'other'; DATABASES has default, fresh"):
        lw_django.enqueue(app, "other", "ship", {})
    assert runs(conn) == []


def test_the_management_command_runs_the_cli_on_djangos_database(
    djangodb: None, conn: Conn, capsys: pytest.CaptureFixture[str]
) -> None:
    from django.core.management import call_command

    call_command("leasework", "enqueue", "ship", "--payload", '{"order": 5}')
    assert runs(conn) == [{"order": 5}]
    assert capsys.readouterr().out.strip().isdigit()
    assert lw_django.app() is app
    out = io.StringIO()
    call_command("leasework", "status", "--json", stdout=out)
