"""Operators' searches over a million finished runs (docs/operations.md, "Search, tags and bulk actions"):
loads N finished runs with INSERT ... SELECT generate_series (10 kinds; 90% succeeded, 8% failed
with one of a few error texts, 2% cancelled; a payload with an account of 50,000; a fifth of the
runs tagged), ANALYZEs, then prints each search's plan (EXPLAIN ANALYZE, the statement
`leasework runs` sends: operations.list_runs, newest first, a page of 50) and its time, median
of --repeat: by tag, by payload (containment), by error text, and the same combined with a kind;
and the dashboard's capped count. Then the payload search again with an opt-in jsonb_path_ops
index, and the error search without the trigram index, to show what each index buys. Asserts
nothing.

    .venv/bin/python bench/search.py [--dsn DSN] [--runs 1000000] [--repeat 5] [--quick]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import psycopg
from common import DEFAULT_DSN, bench_database, drop_database, med, print_table, spread

from leasework import db, operations
from leasework.operations import Filters

LOAD = """
INSERT INTO leasework.runs (kind, status, payload, error, tags, attempts, max_attempts,
                            created_at, queued_at, started_at, finished_at)
SELECT 'kind-' || (g %% 10),
       CASE WHEN g %% 50 = 0 THEN 'cancelled' WHEN g %% 100 < 8 THEN 'failed'
            ELSE 'succeeded' END,
       jsonb_build_object('account', g %% 50000, 'region', (ARRAY['eu', 'us', 'ap'])[1 + g %% 3],
                          'document', 'doc-' || g),
       CASE WHEN g %% 50 = 0 THEN 'cancelled before it started'
            WHEN g %% 100 < 8 THEN
                (ARRAY['HTTP 429 Too Many Requests (retry after 30 s) for account ',
                       'ConnectionResetError: [Errno 104] Connection reset by peer, account ',
                       'KeyError: ''customer'' in payload of account ',
                       'psycopg.errors.UniqueViolation: duplicate key, account '])[1 + g %% 4]
                || (g %% 50000)
       END,
       CASE WHEN g %% 5 = 0 THEN ARRAY['batch-' || (g %% 1000), 'import'] END,
       1, 3,
       now() - make_interval(secs => (%(n)s - g) / 10.0),
       now() - make_interval(secs => (%(n)s - g) / 10.0),
       now() - make_interval(secs => (%(n)s - g) / 10.0),
       now() - make_interval(secs => (%(n)s - g) / 10.0 - 1)
  FROM generate_series(1, %(n)s) AS g
"""

SEARCHES: list[tuple[str, Filters]] = [
    ("tag, one batch (1,000 runs per million)", Filters(tags=["batch-5"])),
    ("tag, common (a fifth of the runs)", Filters(tags=["import"])),
    ("payload {account: 4242} (20 per million)", Filters(payload={"account": 4242})),
    ("payload {region: eu} (a third)", Filters(payload={"region": "eu"})),
    ("error 'too many requests' (2%)", Filters(error="too many requests")),
    ("error 'account 4242' (no run: trigrams say so)", Filters(error="account 4242")),
    ("error 'zz-not-there' (none)", Filters(error="zz-not-there")),
    ("kind + status failed + error '429'", Filters(kind="kind-3", statuses=["failed"], error="429")),
    ("kind + payload {account: 4242}", Filters(kind="kind-2", payload={"account": 4242})),
]


def timed(fn: Callable[[], Any], repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1000)
    return out


def plan(conn: psycopg.Connection[Any], f: Filters) -> list[str]:
    params = {**f.params(), "before": None, "limit": 51}
    rows = conn.execute(
        b"EXPLAIN (ANALYZE, BUFFERS, COSTS OFF, TIMING OFF) " + operations.Q["list_runs"], params
    ).fetchall()
    return [str(r[0]) for r in rows]


def measure(conn: psycopg.Connection[Any], repeat: int, label: str) -> list[list[str]]:
    rows = []
    for name, f in SEARCHES:
        times = timed(lambda f=f: operations.list_runs(conn, f, limit=50), repeat)  # type: ignore[misc]
        counted = timed(
            lambda f=f: operations.count_matching(conn, f, limit=100_000),  # type: ignore[misc]
            max(1, repeat // 2),
        )
        found = len(operations.list_runs(conn, f, limit=50).runs)
        shape = plan(conn, f)
        scan = next(
            (
                line.strip().removeprefix("->").strip().split(" (")[0]
                for line in shape
                if "Scan" in line
            ),
            "?",
        )
        print(f"\n-- {label}: {name} ({found} shown)")
        for line in shape:
            print("   " + line)
        rows.append(
            [name, scan[:48], f"{med(times):,.1f}", spread(times, ",.1f"), f"{med(counted):,.1f}"]
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dsn", default=DEFAULT_DSN, help="an admin DSN (a database is made)")
    ap.add_argument("--runs", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="100,000 runs, 3 repeats")
    args = ap.parse_args()
    if args.quick:
        args.runs, args.repeat = 100_000, 3
    name = "leasework_bench_search"
    dsn = bench_database(args.dsn, name)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            db.migrate(conn)
            trgm = conn.execute(
                "SELECT to_regclass('leasework.runs_error_trgm') IS NOT NULL"
            ).fetchone()
            print(f"pg_trgm index runs_error_trgm: {'yes' if trgm and trgm[0] else 'no'}")
            t = time.perf_counter()
            conn.execute(LOAD, {"n": args.runs})
            conn.execute("VACUUM ANALYZE leasework.runs")
            print(f"loaded {args.runs:,} finished runs in {time.perf_counter() - t:,.1f} s")
            sizes = conn.execute(
                "SELECT c.relname, pg_size_pretty(pg_relation_size(c.oid)) FROM pg_class c "
                "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'leasework' "
                "AND c.relname IN ('runs', 'runs_pkey', 'runs_tags', 'runs_error_trgm') "
                "ORDER BY 1"
            ).fetchall()
            print("sizes: " + ", ".join(f"{r[0]} {r[1]}" for r in sizes))
            headers = ["search (list_runs, page of 50)", "plan", "ms median", "range", "count ms"]
            shipped = measure(conn, args.repeat, "as shipped")
            conn.execute(
                "CREATE INDEX runs_payload_path ON leasework.runs USING gin (payload jsonb_path_ops)"
            )
            conn.execute("ANALYZE leasework.runs")
            size = conn.execute(
                "SELECT pg_size_pretty(pg_relation_size('leasework.runs_payload_path'))"
            ).fetchone()
            with_payload = measure(conn, args.repeat, "with a payload index")
            conn.execute("DROP INDEX leasework.runs_payload_path")
            conn.execute("DROP INDEX IF EXISTS leasework.runs_error_trgm")
            conn.execute("ANALYZE leasework.runs")
            without_trgm = measure(conn, args.repeat, "without the trigram index")
            print(f"\n{args.runs:,} finished runs; as shipped (runs_tags, runs_error_trgm):")
            print_table(headers, shipped)
            print(f"\nwith an opt-in payload index (jsonb_path_ops, {size[0] if size else '?'}):")
            print_table(headers, [r for r in with_payload if r[0].startswith(("payload", "kind + p"))])
            print("\nwithout the trigram index:")
            print_table(headers, [r for r in without_trgm if "error" in r[0]])
    finally:
        drop_database(args.dsn, name)


if __name__ == "__main__":
    main()
