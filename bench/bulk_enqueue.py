"""Bulk enqueue: `app.enqueue_many` (COPY without keys, INSERT ... unnest with keys) against a raw
COPY of the same payloads into a minimal jobs table. One transaction per batch, same server, a
database of its own, repeats interleaved. Prints medians and ranges; asserts nothing.

    .venv/bin/python bench/bulk_enqueue.py [--dsn DSN] [--jobs 100000] [--repeat 3] [--quick]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import orjson
import psycopg
from common import (
    DEFAULT_DSN,
    bench_database,
    drop_database,
    med,
    print_table,
    raw_table,
    record,
    results_arg,
    spread,
)

from leasework import App, db

bench_app = App()


@bench_app.task("noop")
def noop(ctx: Any, payload: Any) -> None:
    return None


def payloads(n: int) -> list[dict[str, Any]]:
    return [{"i": i, "doc": f"document-{i}"} for i in range(n)]


def raw_copy(conn: psycopg.Connection[Any], items: list[dict[str, Any]]) -> None:
    with (
        conn.transaction(),
        conn.cursor() as cur,
        cur.copy("COPY bench_raw_jobs (payload) FROM STDIN") as copy,
    ):
        for p in items:
            copy.write_row((orjson.dumps(p).decode(),))


def lw_copy(conn: psycopg.Connection[Any], items: list[dict[str, Any]]) -> None:
    with conn.transaction():
        bench_app.enqueue_many(conn, "noop", items)


def lw_keys(conn: psycopg.Connection[Any], items: list[dict[str, Any]]) -> None:
    with conn.transaction():
        bench_app.enqueue_many(conn, "noop", items, keys=[f"k{p['i']}" for p in items])


def timed(
    dsn: str, fn: Callable[[psycopg.Connection[Any], list[dict[str, Any]]], None], n: int
) -> float:
    items = payloads(n)
    with psycopg.connect(dsn, autocommit=True) as conn:
        raw_table(conn)
        conn.execute("TRUNCATE leasework.runs, leasework.tenants")
        conn.execute("CHECKPOINT")
        start = time.perf_counter()
        fn(conn, items)
        return n / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dsn", default=DEFAULT_DSN, help="an admin DSN; a bench database is made")
    ap.add_argument("--jobs", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="20,000 jobs, 2 runs")
    results_arg(ap)
    args = ap.parse_args()
    if args.quick:
        args.jobs, args.repeat = min(args.jobs, 20_000), min(args.repeat, 2)
    name = "leasework_bench_enqueue"
    dsn = bench_database(args.dsn, name)
    variants = {
        "raw COPY": raw_copy,
        "enqueue_many (COPY)": lw_copy,
        "enqueue_many with keys (unnest)": lw_keys,
    }
    res: dict[str, list[float]] = {label: [] for label in variants}
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            db.migrate(conn)
        for _ in range(args.repeat):
            for label, fn in variants.items():
                res[label].append(timed(dsn, fn, args.jobs))
    finally:
        drop_database(args.dsn, name)
    base = med(res["raw COPY"])
    print(f"bulk enqueue: {args.jobs:,} jobs in one transaction, {args.repeat} runs each")
    rows = [
        [label, f"{med(v):,.0f}", spread(v), f"{med(v) / base:.2f}"] for label, v in res.items()
    ]
    print_table(["method", "jobs/s (median)", "range", "x raw COPY"], rows)
    for label in ("enqueue_many (COPY)", "enqueue_many with keys (unnest)"):
        v = med(res[label])
        record(
            args.results, 5, f"{label}, {args.jobs:,} jobs, {args.repeat} runs", v, "jobs/s",
            baseline=base, baseline_label="raw COPY (ceiling)", ratio=v / base,
            target_text="context (vs PGQueuer: peers.py)", short=args.quick,
            notes=f"{label}: ranges {spread(res[label])}, raw COPY {spread(res['raw COPY'])}",
        )  # fmt: skip


if __name__ == "__main__":
    main()
