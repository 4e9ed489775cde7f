"""The claim of a pool's kinds against the claim of every kind, with 1,000,000 finished runs in the
table: EXPLAIN (ANALYZE, BUFFERS) of one claim (the plan the workers use: generic) and the
latency of real claims, for a mixed queue and for the worst cases of a pool, a backlog of the
other pool's runs queued ahead of its own. Same server, a database of its own, repeats
interleaved. Prints figures; asserts nothing.

    .venv/bin/python bench/pool_claim.py [--dsn DSN] [--history 1000000] [--queue 2000]
                                         [--backlog 10000] [--claims 400] [--repeat 3] [--quick]
                                         [--kind-index]

--kind-index adds the candidate index KIND_INDEX (kind first) to the bench database, to see
whether the planner takes it and what it does to each claim.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import psycopg
from common import DEFAULT_DSN, bench_database, drop_database, med, print_table, spread

from leasework import db
from leasework.leases import lease

HISTORY = """
INSERT INTO leasework.runs (kind, status, attempts, started_at, finished_at, history)
SELECT 'history', 'succeeded', 1, now() - interval '1 hour', now() - interval '59 minutes',
       jsonb_build_array(jsonb_build_object('attempt', 1, 'owner', gen_random_uuid(),
           'worker', 'bench', 'outcome', 'succeeded', 'error', null))
  FROM generate_series(1, %s)
"""
# Queued runs of `kind`, queued `age` seconds ago (older first in the claim's order), at a
# priority (lower first).
QUEUE = """
INSERT INTO leasework.runs (kind, queued_at, priority)
SELECT %s, now() - make_interval(secs => %s), %s FROM generate_series(1, %s)
"""
MIXED = """
INSERT INTO leasework.runs (kind, queued_at)
SELECT CASE WHEN i %% 2 = 0 THEN 'reports' ELSE 'short' END,
       now() - make_interval(secs => 60) + make_interval(secs => i * 0.001)
  FROM generate_series(1, %s) i
"""

# A candidate for a claim whose cost does not depend on other kinds' backlog (not in schema.sql:
# bench/README.md, "A pool's claim past other kinds' backlog").
KIND_INDEX = """
CREATE INDEX runs_queued_untenanted_by_kind ON leasework.runs (kind, priority, queued_at, id)
 WHERE status = 'queued' AND tenant IS NULL
"""

# The claims a host with pools `reports` (kinds ["reports"]) and `rest` (every other kind) makes,
# against the claim of a host without pools (the app's kinds: both).
VARIANTS = {
    "no pool (both kinds)": ["reports", "short"],
    "pool reports": ["reports"],
    "pool rest (short)": ["short"],
}


Part = tuple[str, float, int, int] | None


def scenarios(queue: int, backlog: int) -> dict[str, list[Part]]:
    """Queue states: (kind, queued this many seconds ago, priority, how many); None: the mixed
    queue. The last: the reports backlog at priority 1, behind every short run."""
    return {
        f"{queue:,} due, mixed": [None],
        f"{backlog:,} reports ahead of {queue:,} short": [
            ("reports", 120.0, 0, backlog),
            ("short", 60.0, 0, queue),
        ],
        f"{backlog:,} short ahead of {queue:,} reports": [
            ("short", 120.0, 0, backlog),
            ("reports", 60.0, 0, queue),
        ],
        f"{backlog:,} reports at priority 1, {queue:,} short": [
            ("reports", 120.0, 1, backlog),
            ("short", 60.0, 0, queue),
        ],
    }


def fill(dsn: str, parts: list[Part], queue: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM leasework.runs WHERE kind <> 'history'")
        for part in parts:
            if part is None:
                conn.execute(MIXED, (queue,))
            else:
                conn.execute(QUEUE, part)
        conn.execute("VACUUM ANALYZE leasework.runs")


def main_conn(dsn: str) -> psycopg.Connection[Any]:
    conn = psycopg.connect(dsn, autocommit=True)
    conn.execute("SET plan_cache_mode = force_generic_plan")  # as the workers' main connection
    return conn


def explain(dsn: str, kinds: list[str]) -> dict[str, Any]:
    """One claim under EXPLAIN ANALYZE, rolled back: the indexes it walked, the rows it read and
    threw away for their kind, buffers and time."""
    params = {"kinds": kinds, "worker": "bench", "lease": 120.0, "limit": 1, "finishing": None}
    with main_conn(dsn) as conn, conn.transaction(force_rollback=True):
        sql = b"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + lease.Q["claim_runs"]
        row = conn.execute(sql, params).fetchone()
    assert row is not None
    plan = row[0][0]
    scans: list[str] = []
    removed = 0
    seq = False

    def walk(node: dict[str, Any]) -> None:
        nonlocal removed, seq
        if node.get("Relation Name") == "runs":
            if "Index Name" in node:
                scans.append(node["Index Name"])
            elif node["Node Type"] == "Seq Scan":
                seq = True
            removed += int(node.get("Rows Removed by Filter", 0)) * int(node.get("Actual Loops", 1))
        for child in node.get("Plans", []):
            walk(child)

    walk(plan["Plan"])
    return {
        "indexes": sorted(set(scans)),
        "seq_scan": seq,
        "removed": removed,
        "buffers": int(plan["Plan"].get("Shared Hit Blocks", 0))
        + int(plan["Plan"].get("Shared Read Blocks", 0)),
        "ms": float(plan["Execution Time"]),
    }


def claim_latency(dsn: str, kinds: list[str], claims: int) -> list[float]:
    """`claims` real claims, one at a time, through lease.claim_runs: microseconds each."""
    out = []
    with main_conn(dsn) as conn:
        for _ in range(claims):
            started = time.perf_counter()
            got = lease.claim_runs(conn, kinds, worker="bench", lease=120.0)
            out.append((time.perf_counter() - started) * 1e6)
            if not got:
                raise RuntimeError(f"the queue ran out of {kinds}: lower --claims")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dsn", default=DEFAULT_DSN, help="an admin DSN; a bench database is made")
    ap.add_argument("--history", type=int, default=1_000_000)
    ap.add_argument("--queue", type=int, default=2000)
    ap.add_argument("--backlog", type=int, default=10_000)
    ap.add_argument("--claims", type=int, default=400)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="200,000 finished runs, 1 run, 200 claims")
    ap.add_argument("--kind-index", action="store_true", help="add the candidate KIND_INDEX")
    args = ap.parse_args()
    if args.quick:
        args.history, args.repeat, args.claims = min(args.history, 200_000), 1, 200
    name = "leasework_bench_pool_claim"
    dsn = bench_database(args.dsn, name)
    states = scenarios(args.queue, args.backlog)
    latency: dict[tuple[str, str], list[float]] = {}
    plans: dict[tuple[str, str], dict[str, Any]] = {}
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            db.migrate(conn)
            if args.kind_index:
                conn.execute(KIND_INDEX)
            started = time.perf_counter()
            conn.execute(HISTORY, (args.history,))
            filled = time.perf_counter() - started
        for r in range(args.repeat):
            for state, parts in states.items():
                for label, kinds in VARIANTS.items():
                    fill(dsn, parts, args.queue)
                    if r == 0:
                        plans[state, label] = explain(dsn, kinds)
                    times = claim_latency(dsn, kinds, args.claims)
                    latency.setdefault((state, label), []).append(statistics.median(times))
                    latency.setdefault((state, label, "p95"), []).append(  # type: ignore[arg-type]
                        statistics.quantiles(times, n=20)[-1]
                    )
    finally:
        drop_database(args.dsn, name)
    print(
        f"pool claims: {args.history:,} finished runs (inserted in {filled:.0f} s), "
        f"{args.claims} claims per run, {args.repeat} run(s), generic plan, one at a time"
        + (", with the candidate index by kind" if args.kind_index else "")
    )
    rows = []
    for state in states:
        for label in VARIANTS:
            p = plans[state, label]
            med_us = latency[state, label]
            p95 = latency[(state, label, "p95")]  # type: ignore[index]
            rows.append(
                [
                    f"{state} / {label}",
                    ", ".join(p["indexes"]) + (" + SEQ SCAN" if p["seq_scan"] else ""),
                    f"{p['removed']:,}",
                    f"{p['buffers']:,}",
                    f"{p['ms']:.2f}",
                    f"{med(med_us):,.0f} ({spread(med_us)})",
                    f"{med(p95):,.0f}",
                ]
            )
    print_table(
        [
            "queue / claim",
            "indexes walked (EXPLAIN)",
            "rows filtered",
            "buffers",
            "ms",
            "us/claim median (range)",
            "p95 us",
        ],
        rows,
    )


if __name__ == "__main__":
    main()
