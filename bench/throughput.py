"""Throughput of no-op jobs: the raw psycopg loops (the ceiling) against leasework's worker,
measured in the same invocation against the same server. Prints a table; asserts nothing.

    .venv/bin/python bench/throughput.py [--dsn DSN] [--jobs 20000] [--procs 2] [--repeat 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable
from typing import Any

import psycopg

from leasework import App, Config, db
from leasework.workers.worker import Worker

RAW_SCHEMA = """
DROP TABLE IF EXISTS bench_raw_jobs;
CREATE TABLE bench_raw_jobs (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    status text NOT NULL DEFAULT 'queued',
    payload jsonb NOT NULL DEFAULT '{}',
    lease_owner uuid,
    lease_expires_at timestamptz
);
CREATE INDEX ON bench_raw_jobs (id) WHERE status = 'queued';
"""

RAW_CLAIM = """
UPDATE bench_raw_jobs SET status = 'running', lease_owner = gen_random_uuid(),
       lease_expires_at = now() + interval '120 seconds'
 WHERE id = (SELECT id FROM bench_raw_jobs WHERE status = 'queued'
              ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED)
RETURNING id, lease_owner, payload
"""
RAW_DONE = "UPDATE bench_raw_jobs SET status = 'done' WHERE id = %s AND lease_owner = %s"


def raw_worker(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        while True:
            row = conn.execute(RAW_CLAIM, prepare=True).fetchone()
            if row is None:
                return
            conn.execute(RAW_DONE, (row[0], row[1]), prepare=True)


def raw_setup(dsn: str, jobs: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(RAW_SCHEMA)
        conn.execute("INSERT INTO bench_raw_jobs (payload) SELECT '{}' FROM generate_series(1, %s)", (jobs,))
        conn.execute("VACUUM ANALYZE bench_raw_jobs")


bench_app = App()


@bench_app.task("noop")
def noop(ctx: Any, payload: Any) -> None:
    return None


def lw_worker(dsn: str) -> None:
    cfg = Config(dsn=dsn, poll_interval=0.05)
    worker = Worker(bench_app.with_config(cfg), cfg, register=False)
    worker.open()
    worker.running = True
    try:
        while worker.poll() > 0:
            pass
    finally:
        worker.close()


def lw_setup(dsn: str, jobs: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        db.migrate(conn)
        conn.execute("TRUNCATE leasework.runs, leasework.tenants, leasework.workers")
        conn.execute(
            "INSERT INTO leasework.runs (kind, payload) SELECT 'noop', '{}' FROM generate_series(1, %s)",
            (jobs,),
        )
        conn.execute("VACUUM ANALYZE leasework.runs")


def timed(setup: Callable[[str, int], None], work: Callable[[str], None], dsn: str, jobs: int, procs: int) -> float:
    setup(dsn, jobs)
    ctx = mp.get_context("fork")
    ps = [ctx.Process(target=work, args=(dsn,)) for _ in range(procs)]
    start = time.perf_counter()
    for p in ps:
        p.start()
    for p in ps:
        p.join()
    return jobs / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dsn", default="postgresql://postgres@127.0.0.1/postgres")
    ap.add_argument("--jobs", type=int, default=20000)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    results: dict[str, list[float]] = {"raw one-at-a-time": [], "leasework one-at-a-time": []}
    for _ in range(args.repeat):
        results["raw one-at-a-time"].append(timed(raw_setup, raw_worker, args.dsn, args.jobs, args.procs))
        results["leasework one-at-a-time"].append(timed(lw_setup, lw_worker, args.dsn, args.jobs, args.procs))
    base = statistics.median(results["raw one-at-a-time"])
    print(f"{'system':<28} {'jobs/s (median)':>16} {'range':>20} {'ratio':>7}")
    for name, values in results.items():
        med = statistics.median(values)
        print(f"{name:<28} {med:>16,.0f} {min(values):>9,.0f}-{max(values):<9,.0f} {med / base:>7.2f}")


if __name__ == "__main__":
    main()
