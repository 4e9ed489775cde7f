"""What one enqueue costs on the pickup-latency path (issue 30): `app.enqueue` of one run, each
in its own transaction (autocommit: a web request's enqueue and commit), N per round, rounds
interleaved between a run without tags, and with two tags when this leasework takes them. Run it
from two checkouts (PYTHONPATH) to compare releases: it uses only the public API, and migrates a
database of its own with the schema of the leasework it imports. Prints medians; asserts nothing.

    PYTHONPATH=. .venv/bin/python bench/enqueue_cost.py [--dsn DSN] [--n 2000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import psycopg
from common import DEFAULT_DSN, bench_database, drop_database, med, print_table, spread

from leasework import App, db
from leasework.tasks import EnqueueOptions

app = App()
app.task("noop")(lambda ctx, payload: None)


def round_of(conn: psycopg.Connection[Any], n: int, options: EnqueueOptions) -> float:
    """Microseconds per enqueue, over n enqueues."""
    t = time.perf_counter()
    for i in range(n):
        app.enqueue(conn, "noop", {"i": i}, **options)
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dsn", default=DEFAULT_DSN, help="an admin DSN (a database is made)")
    ap.add_argument("--n", type=int, default=2000, help="enqueues per round")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    variants: dict[str, EnqueueOptions] = {"no tags": {}}
    if "tags" in EnqueueOptions.__optional_keys__:
        variants["two tags"] = {"tags": ["import", "batch-7"]}  # type: ignore[typeddict-item]
    name = "leasework_bench_enqueue_cost"
    dsn = bench_database(args.dsn, name)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            db.migrate(conn)
            for options in variants.values():  # warm up: plans, caches
                round_of(conn, 200, options)
            times: dict[str, list[float]] = {v: [] for v in variants}
            for _ in range(args.rounds):
                for label, options in variants.items():
                    times[label].append(round_of(conn, args.n, options))
                conn.execute("TRUNCATE leasework.runs")
            version = db.SCHEMA_VERSION
    finally:
        drop_database(args.dsn, name)
    print(f"schema version {version}: {args.rounds} rounds of {args.n:,} enqueues, autocommit")
    print_table(
        ["enqueue", "us per enqueue (median)", "range"],
        [[k, f"{med(v):,.1f}", spread(v, ",.1f")] for k, v in times.items()],
    )


if __name__ == "__main__":
    main()
