"""The pytest plugin's `empty()`, run before each test that uses its fixtures: every leasework
table (the schema version and the one-row untenanted_turn, set back, excepted) ends empty with
its ids restarted, and a table the test did
not touch is left as it is (TRUNCATE would give it new files for nothing)."""

from __future__ import annotations

from typing import Any

import psycopg

from leasework import App
from leasework.pytest_plugin import empty

Conn = psycopg.Connection[Any]


def _files(conn: Conn) -> dict[str, int]:
    rows = conn.execute(
        "SELECT c.relname, c.relfilenode FROM pg_class c"
        " JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = 'leasework' AND c.relkind = 'r'"
    ).fetchall()
    return {r[0]: int(r[1]) for r in rows}


def _counts(conn: Conn) -> dict[str, int]:
    out = {}
    for table in _files(conn):
        if table not in ("schema_version", "untenanted_turn"):  # the one-row ones
            row = conn.execute(f"SELECT count(*) FROM leasework.{table}").fetchone()
            out[table] = int(row[0]) if row else -1
    return out


def test_every_table_ends_empty_with_its_ids_restarted(conn: Conn) -> None:
    app = App()
    app.task("job")(lambda ctx, p: None)
    for i in range(3):
        app.enqueue(conn, "job", {"i": i}, tenant=f"t{i}")
    conn.execute("INSERT INTO leasework.paused_kinds (kind) VALUES ('job')")
    version = conn.execute("SELECT version FROM leasework.schema_version").fetchone()

    conn.execute("UPDATE leasework.untenanted_turn SET turn = 7, weight = 2")

    empty(conn)

    assert set(_counts(conn).values()) == {0}
    assert conn.execute("SELECT version FROM leasework.schema_version").fetchone() == version
    # The turn runs without a tenant share is set back as migrate made it, not emptied.
    assert conn.execute("SELECT turn, weight FROM leasework.untenanted_turn").fetchall() == [
        (0.0, 1.0)
    ]
    assert app.enqueue(conn, "job", {}) == 1


def test_a_table_whose_rows_were_deleted_still_has_its_ids_restarted(conn: Conn) -> None:
    app = App()
    app.task("job")(lambda ctx, p: None)
    app.enqueue(conn, "job", {})
    conn.execute("DELETE FROM leasework.runs")
    conn.execute("TRUNCATE leasework.counters")  # the delete's trigger counted the run there

    empty(conn)

    assert app.enqueue(conn, "job", {}) == 1


def test_a_table_the_test_did_not_touch_is_left_as_it_is(conn: Conn) -> None:
    empty(conn)
    before = _files(conn)
    app = App()
    app.task("job")(lambda ctx, p: None)
    app.enqueue(conn, "job", {})

    empty(conn)

    after = _files(conn)
    assert after["runs"] != before["runs"]  # truncated: it held a run
    untouched = {t for t in before if t not in ("runs", "kinds", "tenants", "schema_version")}
    assert {t: after[t] for t in untouched} == {t: before[t] for t in untouched}
