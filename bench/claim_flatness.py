"""The claim stays flat: leasework's one-at-a-time throughput with an empty table against 1,000,000
finished runs in it, and with runs spread over 1,000 tenants (through the rate limiter) against
runs without tenants. Same server, same invocation, a database of its own, repeats interleaved.
Prints medians, ranges and ratios; asserts nothing.

    .venv/bin/python bench/claim_flatness.py [--dsn DSN] [--jobs 10000] [--history 1000000]
                                             [--tenants 1000] [--repeat 3] [--quick]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import psycopg
from common import (
    DEFAULT_DSN,
    bench_database,
    drop_database,
    med,
    print_table,
    record,
    results_arg,
    spread,
)
from throughput import timed as timed_run

from leasework import db

HISTORY = """
INSERT INTO leasework.runs (kind, status, attempts, started_at, finished_at, history)
SELECT 'history', 'succeeded', 1, now() - interval '1 hour', now() - interval '59 minutes',
       jsonb_build_array(jsonb_build_object('attempt', 1, 'owner', gen_random_uuid(),
           'worker', 'bench', 'outcome', 'succeeded', 'error', null))
  FROM generate_series(1, %s)
"""


BACKEND: dict[str, list[float]] = {}  # label -> the backends' CPU per job (µs) of each run


def timed(label: str, *args: Any) -> float:
    """Jobs per second of one timed run; its backends' CPU per job kept in BACKEND[label] (two
    workers sharing tenants once cost most in the server: bench/README.md, issue 29)."""
    run = timed_run(*args)
    if run.cost.backend_us is not None:
        BACKEND.setdefault(label, []).append(run.cost.backend_us)
    return run.rate


def queue(dsn: str, jobs: int, tenants: int) -> None:
    """Replace the queue (finished history runs stay) with `jobs` runs, over `tenants` tenants."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM leasework.runs WHERE kind <> 'history'")
        conn.execute("TRUNCATE leasework.tenants")
        if tenants:
            conn.execute(
                "INSERT INTO leasework.tenants (name) SELECT 't' || i FROM generate_series(1, %s) i",
                (tenants,),
            )
            conn.execute(
                'INSERT INTO leasework.runs (kind, tenant, "group")'
                " SELECT 'noop', 't' || (i %% %s + 1), 'g' FROM generate_series(1, %s) i",
                (tenants, jobs),
            )
        else:
            conn.execute(
                "INSERT INTO leasework.runs (kind) SELECT 'noop' FROM generate_series(1, %s)",
                (jobs,),
            )
        conn.execute("VACUUM ANALYZE leasework.runs")
        # Start every variant from the same place: no checkpoint or autovacuum of the bulk
        # history insert landing in the middle of a measurement.
        conn.execute("CHECKPOINT")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dsn", default=DEFAULT_DSN, help="an admin DSN; a bench database is made")
    ap.add_argument("--jobs", type=int, default=10000)
    ap.add_argument("--history", type=int, default=1_000_000)
    ap.add_argument("--tenants", type=int, default=1000)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--quick", action="store_true", help="4,000 jobs, 200,000 finished runs, 2 runs"
    )
    results_arg(ap)
    args = ap.parse_args()
    if args.quick:
        args.jobs, args.history = min(args.jobs, 4000), min(args.history, 200_000)
        args.repeat = min(args.repeat, 2)
    from throughput import lw_worker

    name = "leasework_bench_flatness"
    dsn = bench_database(args.dsn, name)
    labels = ["empty table", f"{args.history:,} finished runs", f"{args.tenants:,} tenants"]
    res: dict[str, list[float]] = {label: [] for label in labels}
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            db.migrate(conn)
        for _ in range(args.repeat):
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("TRUNCATE leasework.runs")
            res[labels[0]].append(
                timed(
                    labels[0], lambda d, j, t: queue(d, j, 0), lw_worker, dsn, args.jobs, args.procs
                )
            )
            res[labels[2]].append(
                timed(
                    labels[2],
                    lambda d, j, t: queue(d, j, args.tenants),
                    lw_worker,
                    dsn,
                    args.jobs,
                    args.procs,
                )
            )
            with psycopg.connect(dsn, autocommit=True) as conn:
                started = time.perf_counter()
                conn.execute(HISTORY, (args.history,))
                filled = time.perf_counter() - started
            res[labels[1]].append(
                timed(
                    labels[1], lambda d, j, t: queue(d, j, 0), lw_worker, dsn, args.jobs, args.procs
                )
            )
    finally:
        drop_database(args.dsn, name)
    base = med(res[labels[0]])
    print(
        f"claim flatness: {args.jobs:,} no-op jobs, {args.procs} processes, {args.repeat} runs each"
        f" (history insert took {filled:.0f} s)"
    )
    targets = {labels[0]: "", labels[1]: "≥ 0.80", labels[2]: "≥ 0.50"}
    rows = [
        [
            label,
            f"{med(v):,.0f}",
            spread(v),
            f"{med(BACKEND[label]):,.0f}" if BACKEND.get(label) else "-",
            f"{med(v) / base:.2f}",
            targets[label],
        ]
        for label, v in res.items()
    ]
    print_table(
        ["leasework, queue of", "jobs/s (median)", "range", "backend µs/job", "x empty", "target"],
        rows,
    )
    scale = f"{args.jobs:,} jobs, {args.procs} procs, {args.repeat} runs"
    for label, limit, short in [
        (labels[1], 0.8, args.quick or args.history < 1_000_000),
        (labels[2], 0.5, args.quick or args.tenants < 1000),
    ]:
        v = med(res[label])
        record(
            args.results, 4, f"claim with {label} ({scale})", v, "jobs/s",
            baseline=base, baseline_label="empty table, no tenants", ratio=v / base,
            target_text=f"≥ {limit:.2f} x empty", met=v / base >= limit, short=short,
            notes=f"{label}: ranges {spread(res[label])}, empty {spread(res[labels[0]])}",
        )  # fmt: skip


if __name__ == "__main__":
    main()
