"""Enqueue from SQL: leasework.enqueue called from psql (a subprocess) and from a user table's
trigger gives what app.enqueue gives (same row, same key rule, same NOTIFY at commit), refuses
what the Python path refuses, and a rolled-back insert enqueues nothing."""

from __future__ import annotations

import math
import re
import subprocess
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg import errors as pgerrors

from leasework import Client, ConfigError, Context
from leasework.testing import drain

Conn = psycopg.Connection[Any]
COLUMNS = (
    'kind, key, tenant, "group", exclusive, priority, status, payload, max_attempts, '
    "lease_seconds, timeout_seconds, attempts"
)


def psql(dsn: str, command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["psql", dsn, "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-v", "VERBOSITY=terse", "-c", command],
        capture_output=True,
        text=True,
        timeout=120,
    )


def row(conn: Conn, run_id: int) -> tuple[Any, ...]:
    found = conn.execute(
        f"SELECT {COLUMNS} FROM leasework.runs WHERE id = %s", (run_id,)
    ).fetchone()
    assert found is not None
    return found


def test_psql_enqueue_matches_the_python_path(dsn: str, conn: Conn) -> None:
    conn.execute("LISTEN leasework")
    done = psql(
        dsn,
        "SELECT leasework.enqueue('report', '{\"week\": 48}', key => 'w48', tenant => 't1', "
        "\"group\" => 'g', priority => 2, max_attempts => 5)",
    )
    assert done.returncode == 0, done.stderr
    sql_id = int(done.stdout.strip())
    assert [n.payload for n in conn.notifies(timeout=5, stop_after=1)] == ["report"]
    # the key rule: a second enqueue for the busy key in its tenant returns the active run; the
    # same key without a tenant is another namespace
    again = psql(
        dsn, "SELECT leasework.enqueue('report', '{\"week\": 49}', key => 'w48', tenant => 't1')"
    )
    assert int(again.stdout.strip()) == sql_id
    untenanted = psql(dsn, "SELECT leasework.enqueue('report', '{\"week\": 49}', key => 'w48')")
    assert int(untenanted.stdout.strip()) not in (sql_id, 0)
    py_id = Client().enqueue(
        conn,
        "report",
        {"week": 48},
        key="w48b",
        tenant="t1",
        group="g",
        priority=2,
        max_attempts=5,
    )
    sql_row, py_row = row(conn, sql_id), row(conn, py_id)
    assert sql_row[0] == py_row[0] and sql_row[2:] == py_row[2:]
    # JSON null and no payload are stored as {} by both paths
    null_id = int(psql(dsn, "SELECT leasework.enqueue('report', 'null')").stdout.strip())
    none_id = Client().enqueue(conn, "report", None)
    assert row(conn, null_id)[7] == row(conn, none_id)[7] == {}


BAD = [
    # (what Python is given, what SQL is given, the words both refusals share)
    ({"kind": "bad kind"}, "'bad kind'", "is not valid"),
    ({"kind": "report\n"}, "E'report\\n'", "is not valid"),
    ({"key": ""}, "'report', key => ''", "key"),
    ({"key": "k" * 201}, f"'report', key => '{'k' * 201}'", "key"),
    ({"tenant": "a\x07b"}, "'report', tenant => E'a\\x07b'", "control characters"),
    ({"delay": -1}, "'report', delay => -1", "delay must be a number of seconds from 0"),
    ({"delay": math.nan}, "'report', delay => 'NaN'", "delay must be a number of seconds from 0"),
    ({"delay": 366 * 86400}, "'report', delay => 31622400", "delay must be a number of seconds"),
    (
        {"max_attempts": 0},
        "'report', max_attempts => 0",
        "max_attempts must be an integer from 1 to 1000",
    ),
    (
        {"max_attempts": 1001},
        "'report', max_attempts => 1001",
        "max_attempts must be an integer from 1 to 1000",
    ),
    # Numbers out of a 32-bit integer's range, of every SQL number type: each gets the range, not
    # "function leasework.enqueue(...) does not exist" (integer parameters matched no call).
    ({"priority": 2**40}, "'report', priority => 2^40", "priority must be"),
    ({"priority": 2**40}, "'report', priority => 1099511627776", "priority must be"),
    ({"priority": -(2**31) - 1}, "'report', priority => -2147483649", "priority must be"),
    ({"priority": 1.5}, "'report', priority => 1.5", "priority must be"),
    ({"priority": math.inf}, "'report', priority => 'Infinity'", "priority must be"),
    (
        {"max_attempts": 2**40},
        "'report', max_attempts => 1099511627776",
        "max_attempts must be an integer from 1 to 1000",
    ),
    (
        {"max_attempts": 2.5},
        "'report', max_attempts => 2.5",
        "max_attempts must be an integer from 1 to 1000",
    ),
    # Unique windows and debounce (leasework.window_problem, tasks.check_windows): each range,
    # then what may not go together, in the same order and words.
    *(
        (
            {"key": "k", name: value},
            f"'report', key => 'k', {name} => {sql_value}",
            f"{name} must be a number of seconds above 0 to 31536000",
        )
        for name in ("unique_for", "debounce")
        for value, sql_value in [
            (0, "0"),
            (-5, "-5"),
            (math.inf, "'Infinity'"),
            (math.nan, "'NaN'"),
        ]
    ),
    (
        {"key": "k", "debounce": 10, "debounce_max": 366 * 86400},
        "'report', key => 'k', debounce => 10, debounce_max => 31622400",
        "debounce_max must be a number of seconds above 0 to 31536000",
    ),
    (
        {"key": "k", "debounce_max": 60},
        "'report', key => 'k', debounce_max => 60",
        "debounce_max needs debounce",
    ),
    (
        {"key": "k", "debounce": 60, "debounce_max": 30},
        "'report', key => 'k', debounce => 60, debounce_max => 30",
        "debounce_max must be at least debounce (60), got 30",
    ),
    (
        {"key": "k", "unique_for": 60, "debounce": 30},
        "'report', key => 'k', unique_for => 60, debounce => 30",
        "unique_for and debounce cannot be combined",
    ),
    ({"unique_for": 60}, "'report', unique_for => 60", "unique_for needs a key"),
    ({"debounce": 60}, "'report', debounce => 60", "debounce needs a key"),
    (
        {"key": "k", "unique_for": 60, "exclusive": True},
        "'report', key => 'k', unique_for => 60, exclusive => true",
        "exclusive cannot be combined with unique_for",
    ),
    (
        {"key": "k", "debounce": 60, "delay": 5},
        "'report', key => 'k', debounce => 60, delay => 5",
        "delay cannot be combined with debounce",
    ),
]


@pytest.mark.parametrize(("python", "sql", "words"), BAD)
def test_sql_and_python_refuse_the_same_input_and_write_nothing(
    dsn: str, conn: Conn, python: dict[str, Any], sql: str, words: str
) -> None:
    args = {"kind": "report", **python}
    kind = args.pop("kind")
    with pytest.raises(ConfigError) as py_error:
        Client().enqueue(conn, kind, {}, **args)
    assert words in str(py_error.value)
    call = sql
    with pytest.raises(pgerrors.InvalidParameterValue) as sql_error:
        conn.execute(f"SELECT leasework.enqueue({call})")
    assert words in str(sql_error.value)
    done = psql(dsn, f"SELECT leasework.enqueue({call})")
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("ERROR:") and words in lines[0], done.stderr
    assert conn.execute("SELECT count(*) FROM leasework.runs").fetchone() == (0,)


# What only SQL can pass (Python refuses these before anything is sent): NULL or NaN for an
# argument of an enqueue without a label or a window. leasework.enqueue first asks whether every
# check passes in one expression (migration 0034); a NULL or a NaN there must send the enqueue
# the long way, check by check, and never past the checks.
SQL_ONLY_BAD = [
    ("NULL::text", "kind NULL is not valid"),
    ("'report', priority => NULL", "priority and exclusive must not be NULL"),
    ("'report', exclusive => NULL", "priority and exclusive must not be NULL"),
    ("'report', delay => NULL", "delay must be a number of seconds"),
    ("'report', delay => 'NaN'", "delay must be a number of seconds"),
    ("'report', max_attempts => NULL", "max_attempts must be an integer from 1 to 1000"),
    ("'report', max_attempts => 'NaN'", "max_attempts must be an integer from 1 to 1000"),
    ("'report', priority => 'NaN'", "priority must be an integer"),
    ("'report', lease_seconds => 0.5", "lease_seconds must be from 1 to 86400"),
    ("'report', lease_seconds => 'NaN'", "lease_seconds must be from 1 to 86400"),
    ("'report', timeout_seconds => 0", "timeout_seconds must be > 0"),
    ("'report', timeout_seconds => 'NaN'", "timeout_seconds must be > 0"),
    ("'report', merge_seen => 1, merge_into => 0", "merge_into needs debounce"),
]


@pytest.mark.parametrize(("call", "words"), SQL_ONLY_BAD)
def test_sql_refuses_null_and_nan_arguments_and_writes_nothing(
    conn: Conn, call: str, words: str
) -> None:
    with pytest.raises(pgerrors.InvalidParameterValue) as refused:
        conn.execute(f"SELECT leasework.enqueue({call})")
    assert words in str(refused.value)
    assert conn.execute("SELECT count(*) FROM leasework.runs").fetchone() == (0,)


TRIGGER = """
CREATE TABLE sql_users (id bigint PRIMARY KEY, email text NOT NULL);
CREATE FUNCTION sql_users_welcome() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM leasework.enqueue('email.welcome', jsonb_build_object('user', NEW.id),
                              key => 'welcome:' || NEW.id);
    RETURN NEW;
END $$;
CREATE TRIGGER sql_users_welcome AFTER INSERT ON sql_users
    FOR EACH ROW EXECUTE FUNCTION sql_users_welcome();
"""


def test_a_trigger_enqueues_with_its_row_and_a_rollback_enqueues_nothing(
    dsn: str, conn: Conn
) -> None:
    conn.execute("DROP TABLE IF EXISTS sql_users CASCADE")
    conn.execute("DROP FUNCTION IF EXISTS sql_users_welcome")
    conn.execute(TRIGGER)
    with pytest.raises(RuntimeError), conn.transaction():
        conn.execute("INSERT INTO sql_users VALUES (1, 'a@example.com')")
        assert conn.execute("SELECT count(*) FROM leasework.runs").fetchone() == (1,)
        raise RuntimeError("roll back")
    assert conn.execute("SELECT count(*) FROM leasework.runs").fetchone() == (0,)
    # committed from psql: the run commits with the row and wakes listeners at commit
    conn.execute("LISTEN leasework")
    done = psql(dsn, "INSERT INTO sql_users VALUES (2, 'b@example.com'), (3, 'c@example.com')")
    assert done.returncode == 0, done.stderr
    assert [n.payload for n in conn.notifies(timeout=5, stop_after=1)] == ["email.welcome"]
    # a failing statement rolls its runs back too
    bad = psql(dsn, "INSERT INTO sql_users VALUES (4, 'd@example.com'), (2, 'dup@example.com')")
    assert bad.returncode != 0 and "duplicate key" in bad.stderr
    runs = conn.execute("SELECT key, payload FROM leasework.runs ORDER BY id").fetchall()
    assert runs == [("welcome:2", {"user": 2}), ("welcome:3", {"user": 3})]

    # and a worker with the handler runs them
    from leasework import App

    app = App()

    @app.task("email.welcome")
    def welcome(ctx: Context, payload: dict[str, int]) -> int:
        return payload["user"]

    assert [r.result for r in drain(app, conn)] == [2, 3]


KIND_RULE = re.compile(r"[A-Za-z0-9_.:/@+-]{1,200}")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    kind=st.one_of(
        st.text(alphabet="Az09_.:/@+- %é\u00a0\n\x7f'\"\\", max_size=12),
        st.sampled_from(["", "a" * 200, "a" * 201, "é" * 3, "k" * 199 + "é", "ok.kind/v2@x+y-z:1"]),
    )
)
def test_sql_enqueue_takes_a_kind_exactly_when_the_kind_rule_does(conn: Conn, kind: str) -> None:
    # The function checks the kind without a regular expression (migration 0015): it must take
    # exactly the kinds ^[A-Za-z0-9_.:/@+-]{1,200}$ matches, and refuse the rest in one line.
    with conn.transaction(force_rollback=True):
        try:
            conn.execute("SELECT leasework.enqueue(%s)", (kind,))
        except pgerrors.InvalidParameterValue as exc:
            taken, message = False, exc.diag.message_primary or ""
        else:
            taken, message = True, ""
    assert taken == bool(KIND_RULE.fullmatch(kind)), (kind, message)
    if not taken:
        assert "is not valid" in message and "\n" not in message
