"""Bloat (issue 7, target 8): the size of `leasework.runs` and its indexes while and after
--jobs no-op runs (default 1,000,000) flow through two workers with maintenance on.

The parent keeps a backlog of about 20,000 queued runs topped up; two worker processes drain it
through every stage (the runs stage with a kind declared batch=100, so a million jobs take
minutes, not a quarter of an hour; each job still writes one row and two new versions of it,
claim and finish, as one at a time does); the maintenance stage prunes succeeded runs older than
--retention seconds. Sizes are sampled every second. `--storage default` first resets the
table's fillfactor and autovacuum settings to Postgres' defaults, to compare with schema.sql's.

    .venv/bin/python bench/bloat.py [--dsn DSN] [--jobs 1000000] [--retention 60]
                                    [--storage schema|default] [--quick]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from typing import Any

import psycopg
from common import DEFAULT_DSN, bench_database, drop_database, print_table

from leasework import App, Config, db
from leasework.workers.worker import Worker

BACKLOG = 20_000
SIZES = """
SELECT pg_relation_size('leasework.runs'), pg_indexes_size('leasework.runs'),
       pg_total_relation_size('leasework.runs'),
       (SELECT count(*) FROM leasework.runs),
       coalesce((SELECT n_dead_tup FROM pg_stat_user_tables WHERE relid = 'leasework.runs'::regclass), 0),
       coalesce((SELECT autovacuum_count FROM pg_stat_user_tables WHERE relid = 'leasework.runs'::regclass), 0)
"""
RESET = """
ALTER TABLE leasework.runs RESET (fillfactor, autovacuum_vacuum_scale_factor,
    autovacuum_vacuum_threshold, autovacuum_vacuum_insert_scale_factor,
    autovacuum_analyze_scale_factor, autovacuum_vacuum_cost_limit)
"""

app = App()


@app.task("noop", batch=100)
def noop(ctx: Any, payload: Any) -> None:
    return None


def work(dsn: str, retention: float, stop: Any) -> None:
    cfg = Config(
        dsn=dsn,
        poll_interval=0.5,
        retention_succeeded=retention,
        prune_interval=max(1.0, retention / 10),
        maintenance_limit=5000,
    )
    worker = Worker(app.with_config(cfg), cfg, register=False)
    worker.open()
    worker.running = True
    try:
        found = 0
        while not (stop.is_set() and found == 0):
            found = worker.poll(skip_idle=found > 0)
            if found == 0:
                time.sleep(0.05)
    finally:
        worker.close()


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dsn", default=DEFAULT_DSN, help="an admin DSN; a bench database is made")
    ap.add_argument("--jobs", type=int, default=1_000_000)
    ap.add_argument("--retention", type=float, default=60.0)
    ap.add_argument("--storage", choices=["schema", "default"], default="schema")
    ap.add_argument("--quick", action="store_true", help="200,000 jobs, retention 20 s")
    args = ap.parse_args()
    if args.quick:
        args.jobs, args.retention = min(args.jobs, 200_000), min(args.retention, 20.0)
    name = "leasework_bench_bloat"
    dsn = bench_database(args.dsn, name)
    samples: list[tuple[float, ...]] = []
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            db.migrate(conn)
            if args.storage == "default":
                conn.execute(RESET)
            stop = mp.get_context("fork").Event()
            ps = [
                mp.get_context("fork").Process(target=work, args=(dsn, args.retention, stop))
                for _ in range(2)
            ]
            for p in ps:
                p.start()
            start = time.monotonic()
            enqueued = 0
            last_sample = 0.0
            while True:
                queued = conn.execute(
                    "SELECT count(*) FROM leasework.runs WHERE status = 'queued'"
                ).fetchone()[0]  # type: ignore[index]
                if enqueued < args.jobs and queued < BACKLOG // 2:
                    n = min(BACKLOG - queued, args.jobs - enqueued)
                    conn.execute(
                        "INSERT INTO leasework.runs (kind) SELECT 'noop' FROM generate_series(1, %s)",
                        (n,),
                    )
                    conn.execute(f"NOTIFY {db.NOTIFY_CHANNEL}, 'noop'")
                    enqueued += n
                now = time.monotonic()
                if now - last_sample >= 1.0:
                    row = conn.execute(SIZES).fetchone()
                    assert row is not None
                    samples.append((now - start, *(float(v) for v in row)))
                    last_sample = now
                if enqueued >= args.jobs and queued == 0:
                    break
                time.sleep(0.05)
            drained = time.monotonic() - start
            # Maintenance keeps going past the retention, so the steady state is visible.
            settle_until = time.monotonic() + args.retention + 15
            while time.monotonic() < settle_until:
                row = conn.execute(SIZES).fetchone()
                assert row is not None
                samples.append((time.monotonic() - start, *(float(v) for v in row)))
                time.sleep(1.0)
            stop.set()
            for p in ps:
                p.join()
            final = conn.execute(SIZES).fetchone()
            assert final is not None
            autovacuum = conn.execute("SHOW autovacuum").fetchone()
            reloptions = conn.execute(
                "SELECT reloptions FROM pg_class WHERE oid = 'leasework.runs'::regclass"
            ).fetchone()
    finally:
        drop_database(args.dsn, name)
    peak = max(samples, key=lambda s: s[3])
    if autovacuum and autovacuum[0] != "on":
        print("WARNING: autovacuum is off on this server: the table's settings cannot act, and")
        print("nothing reclaims dead tuples; these figures are the unvacuumed growth.")
    print(
        f"bloat: {args.jobs:,} jobs in {drained:.0f} s ({args.jobs / drained:,.0f} jobs/s),"
        f" retention {args.retention:g} s, storage {args.storage}:"
        f" {reloptions[0] if reloptions else None}"
    )
    print_table(
        ["leasework.runs", "table MiB", "indexes MiB", "total MiB", "rows", "dead", "autovacuums"],
        [
            ["peak (total size)", mib(peak[1]), mib(peak[2]), mib(peak[3]), f"{peak[4]:,.0f}",
             f"{peak[5]:,.0f}", f"{peak[6]:.0f}"],
            ["at the end", mib(final[0]), mib(final[1]), mib(final[2]), f"{final[3]:,}",
             f"{final[4]:,}", f"{final[5]}"],
        ],
    )  # fmt: skip
    max_rows = max(s[4] for s in samples)
    print(
        f"most rows held at once: {max_rows:,.0f}; peak bytes per row held: "
        f"{peak[3] / max(max_rows, 1):,.0f}"
    )


if __name__ == "__main__":
    main()
