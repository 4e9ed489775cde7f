"""Readers survive any row: `leasework status`, the dashboard's pages and /metrics render rows
with the most extreme values the schema admits, inserted by the owner, without an error; the
forged rows of issue 18 (an infinite lease, a -infinity due time, a run due in year 33715) are
refused by the schema itself, so no reader ever meets them."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from leasework import status
from leasework.cli import main

from ..conftest import fast_config
from ..db.dashboard_helpers import request, running_dashboard

ESC = "\x1b]0;PWNED\x07\x1b[2J"
EXTREME_ROWS = [
    # running, lease at the last instant the schema admits, started at its first
    'INSERT INTO leasework.runs (kind, key, tenant, "group", exclusive, priority, status,'
    " lease_owner, lease_expires_at, lease_worker, started_at, queued_at, created_at,"
    " attempts, max_attempts, processed_units, total_units, cancel_requested_at, history)"
    " VALUES ('echo', 'k1', 'tenant-B', 'g', true, 2147483647, 'running', gen_random_uuid(),"
    " '2199-12-31 23:59:59+00', %(esc)s, '1970-01-01 00:00:00+00', '1970-01-01 00:00:00+00',"
    " '1970-01-01 00:00:00+00', 2147483647, 2147483647, 9223372036854775807, 1,"
    " '2199-12-31 23:59:59+00',"
    ' \'[{"attempt": 1, "started_at": "1970-01-01T00:00:00+00:00",'
    '   "ended_at": "2199-12-31T23:59:59+00:00", "outcome": "expired"}]\')',
    # queued, due at the far end; and due at the first instant
    "INSERT INTO leasework.runs (kind, priority, queued_at, error, payload)"
    " VALUES ('echo', -2147483648, '2199-12-31 23:59:59+00', %(error)s, %(payload)s)",
    "INSERT INTO leasework.runs (kind, queued_at, error, processed_units, total_units)"
    " VALUES (%(esc)s, '1970-01-01 00:00:00+00', %(esc)s, 9223372036854775807, 0)",
    # failed at both ends, with a control-character error and history garbage
    "INSERT INTO leasework.runs (kind, status, finished_at, started_at, error, attempts, history,"
    " result) VALUES ('echo', 'failed', '2199-12-31 23:59:59+00', '2199-12-31 23:59:59+00',"
    ' %(esc)s, 3, \'[{"attempt": "x", "outcome": 7, "started_at": "soon"}, 5, null]\','
    " '[1e308, -1e308, 12345678901234567890123456789]')",
    "INSERT INTO leasework.runs (kind, status, finished_at, error, history)"
    " VALUES ('echo', 'partial', '1970-01-01 00:00:00+00', %(esc)s, '{\"not\": \"a list\"}')",
    "INSERT INTO leasework.workers (id, host, pid, started_at, heartbeat_at, current_run)"
    " VALUES (%(esc)s, %(esc)s, 2147483647, '1970-01-01', 'infinity', 9223372036854775807)",
    "INSERT INTO leasework.workers (id, host, pid, started_at, heartbeat_at, stopped_at)"
    " VALUES ('w2', 'h', -1, '-infinity', '-infinity', 'infinity')",
]


@pytest.fixture
def extreme(conn: psycopg.Connection[Any]) -> None:
    params = {
        "esc": ESC + "\r\nforged line",
        "error": "x" * 1_000_000 + ESC,
        "payload": psycopg.types.json.Jsonb({"deep": [[[[[[[[[[ESC]]]]]]]]]], "n": 10**30}),
    }
    for statement in EXTREME_ROWS:
        conn.execute(statement, params)


def test_status_renders_extreme_rows(conn: Any, dsn: str, extreme: None, capsys: Any) -> None:
    snap = status.collect(conn)
    text = status.render(snap)
    assert "\x1b" not in text and "\x07" not in text
    assert main(["status", "--dsn", dsn]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\r" not in out
    assert "\\x1b]0;PWNED" in out  # shown, escaped
    assert main(["status", "--json", "--dsn", dsn]) == 0


def test_the_dashboard_renders_extreme_rows(conn: Any, dsn: str, extreme: None) -> None:
    ids = [r[0] for r in conn.execute("SELECT id FROM leasework.runs ORDER BY id").fetchall()]
    with running_dashboard(fast_config(dsn)) as d:
        for path in ["", "metrics", "healthz", *(f"runs/{i}" for i in ids)]:
            resp = request(f"{d.url}{path}")
            assert resp.status == 200, (path, resp.text[:300])
            if path == "metrics":  # label values are escaped by the exposition format
                assert all(
                    line.startswith(("#", "leasework_")) for line in resp.text.strip().split("\n")
                )
            else:
                assert "\x1b" not in resp.text


@pytest.mark.parametrize(
    "statement",
    [
        "INSERT INTO leasework.runs (kind, status, lease_owner, lease_expires_at)"
        " VALUES ('echo', 'running', gen_random_uuid(), 'infinity')",
        "INSERT INTO leasework.runs (kind, queued_at) VALUES ('echo', '-infinity')",
        "INSERT INTO leasework.runs (kind, queued_at)"
        " VALUES ('echo', now() + make_interval(secs => 1e12))",
    ],
)
def test_the_forged_rows_of_the_issue_cannot_be_stored(conn: Any, statement: str) -> None:
    with pytest.raises(psycopg.errors.CheckViolation):
        conn.execute(statement)
