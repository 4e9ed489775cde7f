"""The pytest plugin (entry point `pytest11`, loaded once leasework is installed): fixtures that
give each test a clean leasework schema in the database you name, with `--leasework-dsn`, the
LEASEWORK_PYTEST_DSN environment variable or the `leasework_dsn` ini option (in that order). The
schema is migrated once per session and emptied before each test; your own tables are left
alone. A database whose name does not contain "test" is refused: the plugin empties it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from . import db, log
from .errors import LeaseworkError

ENV = "LEASEWORK_PYTEST_DSN"
Conn = psycopg.Connection[Any]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("leasework")
    group.addoption(
        "--leasework-dsn",
        dest="leasework_dsn",
        default=None,
        help=f"database for the leasework fixtures (its name must contain 'test'); else ${ENV}, "
        "else the leasework_dsn ini option",
    )
    parser.addini("leasework_dsn", "database for the leasework fixtures (see --leasework-dsn)")


def configured_dsn(config: pytest.Config) -> str:
    """The DSN the user named, checked; a UsageError (one line) when there is none or when its
    database name does not say it is a test database."""
    dsn = config.getoption("leasework_dsn") or os.environ.get(ENV) or config.getini("leasework_dsn")
    if not dsn:
        raise pytest.UsageError(
            f"the leasework fixtures need a test database: pass --leasework-dsn, set {ENV}, or "
            "set leasework_dsn in the pytest ini file"
        )
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        raise pytest.UsageError(str(db.malformed(exc))) from None
    name = params.get("dbname") or params.get("user") or os.environ.get("PGDATABASE") or ""
    if "test" not in str(name).lower():
        raise pytest.UsageError(
            f"--leasework-dsn names database {name!r}: the leasework fixtures empty its "
            "leasework schema before every test, so they use only a database whose name "
            "contains 'test'"
        )
    return str(dsn)


@pytest.fixture(scope="session")
def leasework_database(pytestconfig: pytest.Config) -> str:
    """The DSN of the named test database, its leasework schema migrated (once per session)."""
    # Any refusal ends the session with one line (exit 4, pytest's usage error), once, rather
    # than as an error with a traceback per test (which would also print the DSN, password and
    # all, among the fixture's arguments).
    try:
        dsn = configured_dsn(pytestconfig)
    except pytest.UsageError as exc:
        pytest.exit(f"leasework: {exc}", returncode=pytest.ExitCode.USAGE_ERROR)
    try:
        with db.connect(dsn) as conn:
            db.migrate(conn)
    except (LeaseworkError, psycopg.Error) as exc:
        pytest.exit(
            f"leasework: cannot prepare the test database {log.redact_dsn(dsn)}: "
            f"{log.redact_dsn(log.first_line(exc))}",
            returncode=pytest.ExitCode.USAGE_ERROR,
        )
    return dsn


# Each leasework table (the schema version excepted) with its identity's sequence, if any.
_TABLES = """
SELECT c.relname,
       (SELECT s.oid::regclass::text
          FROM pg_depend d
          JOIN pg_class s ON s.oid = d.objid AND s.relkind = 'S'
         WHERE d.classid = 'pg_class'::regclass AND d.refobjid = c.oid
           AND d.deptype IN ('a', 'i')
         LIMIT 1)
  FROM pg_class c
  JOIN pg_namespace n ON n.oid = c.relnamespace
 WHERE n.nspname = 'leasework' AND c.relkind IN ('r', 'p') AND c.relname <> 'schema_version'
"""


# Tables of one row that migrate makes and the engine keeps: set back, never emptied.
_ONE_ROW = frozenset({"untenanted_turn"})


def empty(conn: Conn) -> None:
    """Empty every leasework table (the schema version excepted) and restart its ids. Only the
    tables that need it are truncated: those holding a row, and those whose ids were drawn since
    they were last restarted (TRUNCATE gives each table it names new files whatever it holds, so
    truncating all thirteen cost every test about 26 ms, three times what the one or two a test
    used cost). `leasework.untenanted_turn`, the one row of the turn runs without a tenant share,
    is set back as migrate made it instead."""
    tables: dict[str, str | None] = dict(conn.execute(_TABLES).fetchall())
    if not tables:
        return
    checks = sql.SQL(" UNION ALL ").join(
        sql.SQL("SELECT {name} WHERE EXISTS (SELECT FROM {table}){drawn}").format(
            name=sql.Literal(name),
            table=sql.Identifier("leasework", name),
            drawn=sql.SQL("")
            if sequence is None
            else sql.SQL(" OR pg_sequence_last_value({seq}::regclass) IS NOT NULL").format(
                seq=sql.Literal(sequence)
            ),
        )
        for name, sequence in sorted(tables.items())
    )
    used = [r[0] for r in conn.execute(checks).fetchall() if r[0] not in _ONE_ROW]
    if used:
        conn.execute(
            sql.SQL("TRUNCATE {} RESTART IDENTITY CASCADE").format(
                sql.SQL(", ").join(sql.Identifier("leasework", t) for t in used)
            )
        )
    if "untenanted_turn" in tables:  # set back as migrate made it, not emptied
        conn.execute(
            "INSERT INTO leasework.untenanted_turn (turn, weight) VALUES (0, 1)"
            " ON CONFLICT (one) DO UPDATE SET turn = 0, weight = 1"
            " WHERE (leasework.untenanted_turn.turn, leasework.untenanted_turn.weight) <> (0, 1)"
        )


@pytest.fixture
def leasework_dsn(leasework_database: str) -> str:
    """The DSN of the test database, its leasework tables emptied for this test."""
    with db.connect(leasework_database) as conn:
        empty(conn)
    return leasework_database


@pytest.fixture
def leasework_conn(leasework_dsn: str) -> Iterator[Conn]:
    """An autocommit connection to the test database, its leasework tables empty."""
    with db.connect(leasework_dsn, application_name="leasework:pytest") as conn:
        yield conn
