"""Connections and the schema: opening connections and a worker's small pool, applying
`schema.sql`, checking that the schema is there. Holds no connection at import time."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from .errors import ConfigError, LeaseworkError, SchemaMissing
from .log import redact_dsn

SCHEMA_VERSION = 1
NOTIFY_CHANNEL = "leasework"


def schema_text() -> str:
    """The schema shipped in the wheel, or the repository's copy in a source checkout."""
    packaged = resources.files("leasework").joinpath("schema.sql")
    if packaged.is_file():
        return packaged.read_text(encoding="utf-8")
    return (Path(__file__).resolve().parent.parent / "schema.sql").read_text(encoding="utf-8")


def connect(
    dsn: str | None,
    *,
    autocommit: bool = True,
    application_name: str = "leasework",
    connect_timeout: int = 10,
) -> psycopg.Connection[Any]:
    """One connection; raises LeaseworkError with a one-line, password-free message on failure."""
    try:
        return psycopg.connect(
            dsn or "",
            autocommit=autocommit,
            application_name=application_name,
            connect_timeout=connect_timeout,
        )
    except psycopg.ProgrammingError as exc:  # a malformed DSN
        raise ConfigError(f"dsn is not a valid connection string: {redact_dsn(str(exc))}") from None
    except psycopg.OperationalError as exc:
        first = redact_dsn(str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc))
        if is_refusal(str(exc)):
            raise ConfigError(f"the database refused the connection: {first}") from None
        raise DatabaseUnavailable(f"cannot connect to the database: {first}") from exc


# Server answers that no retry can fix: wrong credentials, an unknown role or database, a
# pg_hba.conf that does not admit us. libpq reports them without an SQLSTATE, so by their text.
_REFUSALS = (
    "password authentication failed",
    "authentication failed for user",
    "no pg_hba.conf entry",
    "does not exist",
    "no password supplied",
)


def is_refusal(message: str) -> bool:
    """True when a connection failure is a configuration problem, not an outage."""
    text = message.lower()
    return any(r in text for r in _REFUSALS)


class DatabaseUnavailable(LeaseworkError):
    """The database could not be reached (a transient condition for the supervisor)."""


def make_pool(dsn: str | None, size: int, name: str) -> ConnectionPool[Any]:
    """A worker's pool for job work: `size` connections, autocommit, opened after fork."""
    pool: ConnectionPool[Any] = ConnectionPool(
        dsn or "",
        min_size=1,
        max_size=size,
        kwargs={"autocommit": True, "application_name": name, "connect_timeout": 10},
        open=False,
        name=name,
        timeout=30.0,
    )
    pool.open(wait=True, timeout=30.0)
    return pool


def migrate(conn: psycopg.Connection[Any]) -> int:
    """Apply schema.sql (idempotent) in one transaction, under an advisory lock so that two hosts
    migrating at once take turns. Returns the schema version now applied."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtext('leasework.migrate'))")
        conn.execute(schema_text())
    return SCHEMA_VERSION


def check_schema(conn: psycopg.Connection[Any]) -> None:
    """Raise SchemaMissing with one clear line unless the schema is present and current."""
    row = conn.execute(
        "SELECT to_regclass('leasework.schema_version') IS NOT NULL AS present"
    ).fetchone()
    if not row or not row[0]:
        raise SchemaMissing("the leasework schema is missing: run `leasework migrate` first")
    version = conn.execute("SELECT version FROM leasework.schema_version").fetchone()
    if not version or version[0] < SCHEMA_VERSION:
        have = version[0] if version else "none"
        raise SchemaMissing(
            f"the leasework schema is at version {have}, this leasework needs {SCHEMA_VERSION}: "
            "run `leasework migrate`"
        )
