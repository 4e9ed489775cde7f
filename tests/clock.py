"""The test suite's movable database clock. Production's `leasework.now()` is the server's now()
(migration 0014); a test database gets this definition instead, which adds the session setting
`leasework.now_offset` (an interval), so a test moves its connection's idea of database time
(`conftest.shift_clock`) rather than sleeping. Installed after every migration of the session's
database (conftest.dsn).

Also a pytest plugin, for `make compat`: loaded with `-p`, it installs the movable clock after
every `leasework.db.migrate`, so the previous release's tests, which move time this way, run
against this schema."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

MOVABLE_NOW = """
CREATE OR REPLACE FUNCTION leasework.now() RETURNS timestamptz
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT now() + coalesce(nullif(current_setting('leasework.now_offset', true), '')::interval,
                            interval '0');
$$
"""


def install(conn: psycopg.Connection[Any]) -> None:
    """Make `leasework.now()` of this database movable (autocommit or the caller's transaction)."""
    conn.execute(MOVABLE_NOW)


def pytest_configure(config: pytest.Config) -> None:
    from leasework import db

    migrate = db.migrate

    def migrate_then_install(conn: psycopg.Connection[Any], *args: Any, **kwargs: Any) -> Any:
        done = migrate(conn, *args, **kwargs)
        install(conn)
        return done

    db.migrate = migrate_then_install  # type: ignore[assignment]
