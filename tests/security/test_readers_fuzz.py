"""Every reader survives every value the worker role can write (issue 34, item 5). Hypothesis
writes random values, as leasework_worker, into the columns deploy/roles.sql lets that role
update (read from the catalog, so a new column or grant is fuzzed too): NaN and ±Infinity in
float columns, infinite and far timestamps, huge and negative numbers, jsonb of any shape, long
and odd text. Then it renders every reader: the CLI's status, runs, show, schedules, connections
list and tenants (text and --json), the dashboard's pages, each run's page and /metrics. Each
must answer (exit 0, HTTP 200) with valid output (JSON that parses, metrics that parse). A value
the schema refuses is simply not written: the readers must cope with what it admits, since older
rows exist whatever a new constraint would say."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from psycopg import sql

from leasework import cli
from leasework.dashboard import Dashboard

from ..conftest import fast_config, truncate_all
from ..db.dashboard_helpers import request, running_dashboard
from .conftest import ROLES

Conn = psycopg.Connection[Any]
WORKER = "leasework_worker"

# Derandomized in the suite like every property test (tests/conftest.py); `make fuzz` searches
# afresh (it found three bugs that way).
FUZZ = settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# A run of every status (one holding connection 1's key, so the connection shows its last run),
# and a row in every other table the readers show, written by the owner.
BASE_ROWS = """
INSERT INTO leasework.tenants (name) VALUES ('t1'), ('t2');
INSERT INTO leasework.kinds (kind) VALUES ('echo'), ('sync');
INSERT INTO leasework.runs (kind, key, tenant, "group", status, payload, error, attempts,
                            history, queued_at)
VALUES ('echo', 'k-queued', 't1', 'g', 'queued', '{"a": 1}', 'first attempt failed', 1,
        '[{"attempt": 1, "outcome": "failed", "error": "boom", "worker": "w1",
           "started_at": "2024-01-01T00:00:00+00:00", "ended_at": "2024-01-01T00:00:01+00:00"}]',
        now() - interval '5 minutes');
INSERT INTO leasework.runs (kind, key, exclusive, status) VALUES ('echo', 'k-queued', true, 'waiting');
INSERT INTO leasework.runs (kind, key, tenant, status, lease_owner, lease_expires_at,
                            lease_worker, started_at, attempts, processed_units, total_units,
                            lease_seconds, timeout_seconds)
VALUES ('sync', 'connection:1', 't2', 'running', gen_random_uuid(), now() + interval '1 hour',
        'w1', now() - interval '1 minute', 1, 3, 10, 30, 3600);
INSERT INTO leasework.runs (kind, key, status, started_at, finished_at, attempts, result)
VALUES ('sync', 'connection:2', 'succeeded', now() - interval '2 minutes', now(), 1,
        '{"tables": {"users": {"status": "ok", "upserted": 3, "tombstoned": 1},
                     "orders": {"status": "failed", "error": "HTTP 503"}}}');
INSERT INTO leasework.runs (kind, status, started_at, finished_at, attempts, max_attempts, error,
                            history)
VALUES ('echo', 'failed', now() - interval '1 minute', now(), 2, 2, 'boom',
        '[{"attempt": 1, "outcome": "expired", "error": "lease expired", "worker": "w2",
           "started_at": "2024-01-01T00:00:00+00:00", "ended_at": "2024-01-01T00:10:00+00:00"},
          {"attempt": 2, "outcome": "failed", "error": "boom", "worker": "w1",
           "started_at": "2024-01-01T00:11:00+00:00", "ended_at": "2024-01-01T00:11:01+00:00"}]');
INSERT INTO leasework.runs (kind, status, started_at, finished_at, attempts, error, result,
                            processed_units, total_units)
VALUES ('echo', 'partial', now() - interval '1 minute', now(), 1, 'half', '{"done": 5}', 5, 10);
INSERT INTO leasework.runs (kind, status, finished_at, error, cancel_requested_at)
VALUES ('echo', 'cancelled', now(), 'cancelled before it started', now());
INSERT INTO leasework.workers (id, host, pid, current_run, pool, pool_kinds)
VALUES ('w1', 'host-a', 101, 3, 'syncs', '{sync}'), ('w2', 'host-a', 102, NULL, 'rest', NULL);
INSERT INTO leasework.workers (id, host, pid, stopped_at) VALUES ('w3', 'host-b', 103, now());
INSERT INTO leasework.connections (workspace, provider, sync_interval_seconds, next_run_at)
VALUES ('ws', 'local', 60, now() + interval '1 minute'), ('ws', 'other', NULL, NULL);
INSERT INTO leasework.records (connection_id, table_name, external_id, data, deleted_at)
VALUES (1, 'users', 'u1', '{"name": "a"}', NULL), (1, 'users', 'u2', '{}', now());
INSERT INTO leasework.schedules (name, kind, every_seconds, cron, timezone, next_run_at,
                                 last_run_id)
VALUES ('every-minute', 'echo', 60, NULL, 'UTC', now() + interval '1 minute', 4),
       ('hourly', 'echo', NULL, '0 * * * *', 'Europe/Paris', now() - interval '2 hours', NULL);
INSERT INTO leasework.uploads (project, name, store_key, size, status, finished_at)
VALUES ('p', 'a.zip', 'k1', 10, 'done', now());
INSERT INTO leasework.files (project, name, store_key, size, sha256, status, chunks, upload_id,
                             member)
VALUES ('p', 'a.txt', 'k2', 5, 'ab', 'ready', 1, 1, 'a.txt');
INSERT INTO leasework.chunks (file_id, idx, project, page, text, embedding)
VALUES (1, 0, 'p', 1, 'hello', '{0.5, 0.25}');
INSERT INTO leasework.maintenance (handler, last_run_at, runs, last_result)
VALUES ('prune_runs', now(), 1, '{"deleted": 0}');
INSERT INTO leasework.paused_kinds (kind) VALUES ('echo');
INSERT INTO leasework.kind_limits (kind, declared, overrides)
VALUES ('echo', '{"max_running": 2, "group_limit": 3}', '{"rate": [5, 10], "rate_per": "tenant"}'),
       ('sync', '{"rate": [1, 3600], "rate_per": "group"}', '{}');
UPDATE leasework.rate_shards
   SET win = leasework.rate_recorded(NULL, CASE kind WHEN 'echo' THEN 10 ELSE 3600 END, now(), 1);
INSERT INTO leasework.tenant_rates (kind, tenant, rate_count, rate_seconds, win)
VALUES ('echo', 't1', 7, 60, leasework.rate_recorded(NULL, 60, now(), 7));
INSERT INTO leasework.group_rates (kind, tenant, "group", win)
VALUES ('sync', 't1', 'g', leasework.rate_recorded(NULL, 3600, now(), 1));
INSERT INTO leasework.counters (kind, name, label, value)
VALUES ('echo', 'finished', 'succeeded', 4), ('echo', 'duration', '0.05', 4),
       ('echo', 'duration_sum', '', 0.1), ('echo', 'lost', 'expired', 1),
       ('echo', 'reclaimed', '', 1);
"""

# Values that broke a reader once, or could: per column type, the edges of the type.
TIMESTAMPS = [
    "infinity",
    "-infinity",
    "1970-01-01 00:00:00+00",
    "2199-12-31 23:59:59+00",
    "9999-12-31 23:59:59+00",
    "10000-01-01 00:00:00+00",
    "294276-12-31 23:59:59+00",
    "4713-01-01 00:00:00+00 BC",
    "0001-01-01 00:00:00+00",
]
FLOATS = ["NaN", "Infinity", "-Infinity", "1.7976931348623157e308", "-1e308", "5e-324", "-0",
          "-1", "0", "0.001", "1e15"]  # fmt: skip
INTS = [-(2**31), 2**31 - 1, -1, 0, 1, 2]
BIGINTS = [-(2**63), 2**63 - 1, -1, 0, 2**53 + 1]
ODD_TEXT = [
    "",
    "x" * 5000,
    "infinity",
    "NaN",
    "running",
    "failed",
    "connection:1",
    "\x1b[2J\x07\r\n\x9b\u202e\u2028",
    "<script>alert(1)</script>",
    "* * * * *",
    "61 25 * * *",
    "Mars/Olympus_Mons",
    "../../etc/passwd",
    "\U0001f600" * 40,
    "a\\b%s{}",
]
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | st.sampled_from(["infinity", "-infinity", "2024-01-01", "9999-12-31T23:59:59+00:00"])
)
json_keys = st.text(max_size=8) | st.sampled_from(
    ["attempt", "outcome", "started_at", "ended_at", "error", "worker", "owner", "tables",
     "status", "upserted", "tombstoned"]
)  # fmt: skip
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(json_keys, inner, max_size=5),
    max_leaves=12,
)
# Shapes the readers look into: a history entry, per-table results.
ODD_JSON = [
    '"a plain string"',
    "7",
    "null",
    "{}",
    '{"not": "a list"}',
    '["x", 1, null, [], {}]',
    '[{"attempt": "x", "outcome": 7, "started_at": "soon", "ended_at": {"a": 1}, "error": 5}]',
    '[{"attempt": 1e30, "outcome": "expired", "started_at": "infinity", "ended_at": "-infinity"}]',
    '[{"attempt": 1.5, "outcome": "crashed", "started_at": "99999-01-01", "worker": 3}]',
    # a snooze's entry (its due_at read by show and the run page), and an owner of any type (the
    # run page finds the attempt in progress by it)
    '[{"outcome": "snoozed", "due_at": {"a": 1}, "error": 5, "owner": 7}]',
    '[{"outcome": "snoozed", "due_at": "\\u001b[2J99999-01-01", "error": "\\u001b]8;;x"}]',
    '[{"outcome": "snoozed", "due_at": 1e400, "owner": null}, {"owner": ["x"]}]',
    '{"tables": "x"}',
    '{"tables": [1, 2]}',
    '{"tables": {"a": 5, "b": {"status": "failed", "error": 7}, "c": {"upserted": "many"}}}',
    "[1e400, -1e400, 1e-400, 123456789012345678901234567890]",
    # deeper than Python's JSON decoder goes, and deep enough that printing it would recurse out
    "[" * 3000 + "]" * 3000,
    '{"tables": ' * 500 + "{}" + "}" * 500,
]


def values_for(pg_type: str) -> st.SearchStrategy[str | None]:
    """Text literals of `pg_type` (format_type's name; a domain's base type decides)."""
    base = pg_type.removeprefix("leasework.")
    if base in ("timestamp with time zone", "instant"):
        return st.none() | st.sampled_from(TIMESTAMPS)
    if base in ("double precision", "seconds", "real"):
        floats = st.floats(
            allow_nan=False, allow_infinity=False, width=32 if base == "real" else 64
        )
        return st.none() | st.sampled_from(FLOATS) | floats.map(repr)
    if base in ("integer", "attempt_count", "max_attempts"):
        return st.none() | st.sampled_from(INTS).map(str)
    if base == "smallint":  # a rate shard's number
        return st.none() | st.sampled_from(["0", "7", "-1", "32767"])
    if base in ("bigint", "units"):
        return st.none() | st.sampled_from(BIGINTS).map(str)
    if base == "boolean":
        return st.none() | st.sampled_from(["true", "false"])
    if base == "uuid":
        return st.none() | st.just("00000000-0000-0000-0000-000000000000")
    if base == "jsonb":
        return st.sampled_from(ODD_JSON) | json_values.map(json.dumps)
    if base == "bigint[]":  # a rate's window (its CHECK refuses what is not one)
        window = "{500000,3534451200," + ",".join(["0"] * 41) + ",9}"
        edges = "{30240000000,152519," + ",".join(["4611686018427387903"] * 42) + "}"
        return st.none() | st.sampled_from(["{}", "{1,2}", window, edges])
    if base == "real[]":
        return st.none() | st.sampled_from(["{}", "{NaN,Infinity,-Infinity}", "{NULL}"])
    if base == "text[]":
        texts = st.lists(st.text(max_size=10) | st.sampled_from(ODD_TEXT), max_size=3)
        return st.none() | st.sampled_from(["{}", "{NULL}"]) | texts.map(_text_array)
    if base == "text":
        return st.none() | st.sampled_from(ODD_TEXT) | st.text(max_size=40)
    raise AssertionError(f"no values for column type {pg_type!r}: add them to values_for")


def _text_array(items: list[str]) -> str:
    quoted = ('"' + i.replace("\\", "\\\\").replace('"', '\\"') + '"' for i in items)
    return "{" + ",".join(quoted) + "}"


WRITABLE = """
SELECT c.relname::text AS table_name, a.attname::text AS column_name,
       format_type(a.atttypid, a.atttypmod) AS type
  FROM pg_class c
  JOIN pg_namespace n ON n.oid = c.relnamespace AND n.nspname = 'leasework'
  JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
 WHERE c.relkind IN ('r', 'p')
   AND has_column_privilege(%(role)s, c.oid, a.attnum, 'UPDATE')
   AND a.attidentity = '' AND a.attgenerated = ''
 ORDER BY 1, 2
"""


@pytest.fixture(scope="module")
def writable(dsn: str) -> list[tuple[str, str, str]]:
    """(table, column, type) of every column the worker role may update."""
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(ROLES.read_text())
        rows = c.execute(WRITABLE, {"role": WORKER}).fetchall()
    assert ("connections", "sync_interval_seconds", "double precision") in rows
    assert ("runs", "history", "jsonb") in rows
    assert not any(table == "schema_version" for table, _, _ in rows)
    return [(str(t), str(col), str(ty)) for t, col, ty in rows]


@pytest.fixture(scope="module")
def dashboard(dsn: str) -> Iterator[Dashboard]:
    with running_dashboard(fast_config(dsn)) as d:
        yield d


def reset(conn: Conn) -> None:
    truncate_all(conn)
    conn.execute(BASE_ROWS)


def write_as_worker(conn: Conn, writes: list[tuple[str, str, str, str | None, int | None]]) -> int:
    """Apply each (table, column, type, value, row) as leasework_worker, row None: every row.
    A write the schema refuses (a CHECK, a domain, NOT NULL) is skipped. Returns how many took."""
    took = 0
    with conn.transaction():
        conn.execute(sql.SQL("SET LOCAL ROLE {}").format(sql.Identifier(WORKER)))
        for table, column, pg_type, value, row in writes:
            target = sql.Identifier("leasework", table)
            where = (
                sql.SQL("")
                if row is None
                else sql.SQL(
                    " WHERE ctid = (SELECT ctid FROM {} ORDER BY ctid OFFSET {} LIMIT 1)"
                ).format(target, sql.Literal(row))
            )
            statement = sql.SQL("UPDATE {} SET {} = CAST({} AS {}){}").format(
                target, sql.Identifier(column), sql.Literal(value), sql.SQL(pg_type), where
            )
            try:
                with conn.transaction():
                    conn.execute(statement)
                took += 1
            except (psycopg.errors.IntegrityError, psycopg.errors.DataError):
                pass
    return took


# Built once: building the parser is most of an in-process call's time, and `main` only wraps
# _main(parser, argv) in its handling of a closed pipe.
PARSER = cli.build_parser()


def run_cli(dsn: str, *args: str) -> str:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = cli._main(PARSER, [*args, "--dsn", dsn])
    assert code == 0, (args, code, err.getvalue()[-500:])
    if "--json" in args:
        json.loads(out.getvalue())
    return out.getvalue()


def render_every_reader(conn: Conn, dsn: str, dashboard: Dashboard) -> None:
    ids = [r[0] for r in conn.execute("SELECT id FROM leasework.runs ORDER BY id").fetchall()]
    for json_flag in ([], ["--json"]):
        run_cli(dsn, "status", *json_flag)
        run_cli(dsn, "runs", *json_flag)
        run_cli(dsn, "schedules", *json_flag)
        run_cli(dsn, "connections", "list", *json_flag)
        run_cli(dsn, "tenants", *json_flag)
        run_cli(dsn, "limits", *json_flag)
    for run_id in ids:
        run_cli(dsn, "show", str(run_id))
        run_cli(dsn, "show", str(run_id), "--json")
    pages = ["", "runs", "runs?status=failed", "kinds", "schedules", "connections", "healthz"]
    for path in [*pages, *(f"runs/{i}" for i in ids)]:
        resp = request(f"{dashboard.url}{path}")
        assert resp.status == 200, (path, resp.text[-500:])
    resp = request(f"{dashboard.url}metrics")
    assert resp.status == 200, ("metrics", resp.text[-500:])
    for family in text_string_to_metric_families(resp.text):
        for sample in family.samples:
            assert isinstance(sample.value, float)


def test_the_base_rows_render_and_every_column_type_has_values(
    conn: Conn, dsn: str, dashboard: Dashboard, writable: list[tuple[str, str, str]]
) -> None:
    reset(conn)
    for _, _, pg_type in writable:
        values_for(pg_type)  # raises for a type the fuzz below would not know how to write
    render_every_reader(conn, dsn, dashboard)


@FUZZ
@given(data=st.data())
def test_every_reader_survives_what_the_worker_role_can_write(
    conn: Conn, dsn: str, dashboard: Dashboard, writable: list[tuple[str, str, str]], data: Any
) -> None:
    reset(conn)
    columns = st.sampled_from(writable)
    writes = []
    for _ in range(data.draw(st.integers(min_value=1, max_value=12), label="writes")):
        table, column, pg_type = data.draw(columns, label="column")
        value = data.draw(values_for(pg_type), label=f"{table}.{column}")
        row = data.draw(st.none() | st.integers(min_value=0, max_value=6), label="row")
        writes.append((table, column, pg_type, value, row))
    write_as_worker(conn, writes)
    render_every_reader(conn, dsn, dashboard)


# The reproductions of issue 34 and their kin, each a write the worker role can make, in groups
# whose writes do not overwrite each other; every reader renders each group.
REPRODUCTIONS = {
    "nan": [
        "UPDATE leasework.connections SET sync_interval_seconds = 'NaN', next_run_at = 'infinity'"
        " WHERE id = 1",
        "UPDATE leasework.connections SET sync_interval_seconds = 'Infinity',"
        " next_run_at = '-infinity', created_at = 'infinity' WHERE id = 2",
        "UPDATE leasework.runs SET lease_seconds = 'NaN', timeout_seconds = 'Infinity'",
        "UPDATE leasework.tenants SET turn = 'NaN'",
        "UPDATE leasework.counters SET value = 'NaN'",
        "UPDATE leasework.runs SET payload = '" + "[" * 3000 + "]" * 3000 + "' WHERE id = 1",
        "UPDATE leasework.connections SET config = '" + '{"a": ' * 600 + "1" + "}" * 600 + "'",
    ],
    "infinity": [
        "UPDATE leasework.schedules SET next_run_at = 'infinity', last_enqueued_at = '-infinity',"
        " created_at = 'infinity', updated_at = '294276-12-31' WHERE cron IS NOT NULL",
        "UPDATE leasework.schedules SET next_run_at = '-infinity', every_seconds = 'NaN'"
        " WHERE every_seconds IS NOT NULL",
        "UPDATE leasework.tenants SET turn = '-Infinity'",
        "UPDATE leasework.counters SET value = 'Infinity'",
        "UPDATE leasework.workers SET heartbeat_at = 'infinity', started_at = '-infinity'",
        "UPDATE leasework.paused_kinds SET paused_at = 'infinity'",
    ],
    "history": [
        """UPDATE leasework.runs SET history = '"a plain string"' WHERE status = 'failed'""",
        """UPDATE leasework.runs SET history = '["x", 5, null, {"error": 7, "attempt": [1]}]'"""
        " WHERE status = 'running'",
        """UPDATE leasework.runs SET history = '{"attempt": 1}' WHERE status = 'queued'""",
        """UPDATE leasework.runs SET history = '7' WHERE status = 'cancelled'""",
        """UPDATE leasework.runs SET history = '[{"outcome": "expired", "started_at": "soon"}]',"""
        " attempts = 2 WHERE status = 'partial'",
        """UPDATE leasework.runs SET result = '{"tables": {"a": 5, "b": [1]}}'"""
        " WHERE key = 'connection:1'",
        """UPDATE leasework.runs SET result = '{"tables": ["x"]}' WHERE key = 'connection:2'""",
        "UPDATE leasework.runs SET history = '" + "[" * 600 + "]" * 600 + "' WHERE id = 2",
    ],
    # Found by the fuzz test: a NULL among a worker's pool kinds (`status` joined None).
    "pool": ["UPDATE leasework.workers SET pool = 'p', pool_kinds = '{NULL}'"],
    # Found by the fuzz test: a kind's overrides not a JSON object (`status` looked a name up in
    # the number 7); a string would have been searched for the name as a substring.
    "overrides": [
        "UPDATE leasework.kind_limits SET overrides = '7'",
        "UPDATE leasework.kind_limits SET overrides = '\"max_running rate\"'"
        " WHERE kind = (SELECT min(kind) FROM leasework.kind_limits)",
    ],
    # Found by the fuzz test: an owner on a run without a lease (`show` subtracted from None).
    "owner": [
        "UPDATE leasework.runs SET lease_owner = '00000000-0000-0000-0000-000000000000'"
        " WHERE status = 'queued'",
    ],
    # Found by the fuzz test: a NULL among a run's tags (`runs` joined them: a TypeError).
    "tags": ["UPDATE leasework.runs SET tags = '{NULL, a}'"],
}


@pytest.mark.parametrize("group", sorted(REPRODUCTIONS))
def test_each_reproduction_renders(conn: Conn, dsn: str, dashboard: Dashboard, group: str) -> None:
    reset(conn)
    conn.execute(ROLES.read_text())
    with conn.transaction():
        conn.execute(sql.SQL("SET LOCAL ROLE {}").format(sql.Identifier(WORKER)))
        for statement in REPRODUCTIONS[group]:
            assert conn.execute(statement).rowcount >= 1, statement
    render_every_reader(conn, dsn, dashboard)
