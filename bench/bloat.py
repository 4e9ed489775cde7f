"""Bloat (issue 7, target 8): the size of `leasework.runs` and its indexes while and after
--jobs no-op runs (default 1,000,000) flow through two workers with maintenance on.

The parent keeps a backlog of up to 20,000 queued runs topped up, offering at most --rate jobs
per second (default 4,000, below what two workers drain here, so that the runs held, about
rate x retention, are the same whatever the storage settings); two worker processes drain it
through every stage (the runs stage with a kind declared batch=100, so a million jobs take
minutes, not a quarter of an hour; each job still writes one row and two new versions of it,
claim and finish, as one at a time does); the maintenance stage prunes succeeded runs older than
--retention seconds (scaled down from the default 7 days so that pruning runs within the bench).
Sizes, dead tuples and autovacuum counts are sampled every second and printed over time.
--results FILE (default $LEASEWORK_BENCH_RESULTS) appends each storage's peak against the bound
documented in bench/README.md, computed from the run's own runs held, jobs/s and naptime.

By default the bench starts a private cluster (bench/cluster.py: initdb, a free port, a temp
directory, Postgres' defaults, so autovacuum is on) and runs twice in it: with schema.sql's
storage settings for the table, then with them reset to Postgres' defaults (`--storage`
chooses one). `--dsn` uses an existing server instead (it warns when autovacuum is off there).

    .venv/bin/python bench/bloat.py [--dsn DSN] [--jobs 1000000] [--retention 60] [--rate 4000]
                                    [--storage both|schema|default] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
from cluster import private_server
from common import bench_database, drop_database, print_table, record, results_arg

from leasework import App, Config, db
from leasework.workers.worker import Worker

BACKLOG = 20_000
STAT = "(SELECT {} FROM pg_stat_user_tables WHERE relid = 'leasework.runs'::regclass)"
SIZES = f"""
SELECT pg_relation_size('leasework.runs'), pg_indexes_size('leasework.runs'),
       pg_total_relation_size('leasework.runs'),
       (SELECT count(*) FROM leasework.runs),
       coalesce({STAT.format("n_dead_tup")}, 0),
       coalesce({STAT.format("autovacuum_count")}, 0),
       coalesce({STAT.format("n_tup_upd")}, 0),
       coalesce({STAT.format("n_tup_hot_upd")}, 0)
"""
# Column positions in a sample: the elapsed time, then SIZES' columns.
T, TABLE, INDEXES, TOTAL, ROWS, DEAD, AUTOVAC, UPD, HOT = range(9)
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


@dataclass
class Result:
    storage: str
    jobs: int
    rate: float
    drained: float = 0.0
    samples: list[tuple[float, ...]] = field(default_factory=list)
    done: list[int] = field(default_factory=list)  # jobs enqueued minus queued, per sample
    autovacuum: str = ""
    reloptions: str = ""
    version: str = ""
    naptime: float = 60.0


def sample(conn: psycopg.Connection[Any], start: float) -> tuple[float, ...]:
    row = conn.execute(SIZES).fetchone()
    assert row is not None
    return (time.monotonic() - start, *(float(v) for v in row))


@contextlib.contextmanager
def workers(dsn: str, retention: float) -> Iterator[Any]:
    ctx = mp.get_context("fork")
    stop = ctx.Event()
    ps = [ctx.Process(target=work, args=(dsn, retention, stop)) for _ in range(2)]
    for p in ps:
        p.start()
    try:
        yield stop
    finally:
        stop.set()
        for p in ps:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
                p.join()


def run(admin_dsn: str, storage: str, jobs: int, retention: float, rate: float) -> Result:
    name = f"leasework_bench_bloat_{storage}"
    dsn = bench_database(admin_dsn, name)
    res = Result(storage, jobs, rate)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            db.migrate(conn)
            if storage == "default":
                conn.execute(RESET)
            start = time.monotonic()
            with workers(dsn, retention):
                enqueued = 0
                last_sample = 0.0
                while True:
                    queued = conn.execute(
                        "SELECT count(*) FROM leasework.runs WHERE status = 'queued'"
                    ).fetchone()[0]  # type: ignore[index]
                    # At most --rate jobs/s offered (after the first backlog): the rows held
                    # are about rate x retention, so storage settings compare at equal load.
                    allowed = BACKLOG + rate * (time.monotonic() - start) if rate else jobs
                    n = min(BACKLOG - queued, jobs - enqueued, int(allowed) - enqueued)
                    if enqueued < jobs and queued < BACKLOG // 2 and n >= min(100, jobs - enqueued):
                        conn.execute(
                            "INSERT INTO leasework.runs (kind)"
                            " SELECT 'noop' FROM generate_series(1, %s)",
                            (n,),
                        )
                        conn.execute(f"NOTIFY {db.NOTIFY_CHANNEL}, 'noop'")
                        enqueued += n
                    if time.monotonic() - last_sample >= 1.0:
                        res.samples.append(sample(conn, start))
                        res.done.append(enqueued - queued)
                        last_sample = time.monotonic()
                    if enqueued >= jobs and queued == 0:
                        break
                    time.sleep(0.05)
                res.drained = time.monotonic() - start
                # Maintenance keeps going past the retention, so the steady state is visible.
                settle_until = time.monotonic() + retention + 15
                while time.monotonic() < settle_until:
                    res.samples.append(sample(conn, start))
                    res.done.append(jobs)
                    time.sleep(1.0)
            res.samples.append(sample(conn, start))
            res.done.append(jobs)
            res.autovacuum = str(conn.execute("SHOW autovacuum").fetchone()[0])  # type: ignore[index]
            res.version = str(conn.execute("SHOW server_version").fetchone()[0])  # type: ignore[index]
            res.naptime = float(
                conn.execute(
                    "SELECT setting FROM pg_settings WHERE name = 'autovacuum_naptime'"
                ).fetchone()[0]  # type: ignore[index]
            )
            res.reloptions = str(
                conn.execute(
                    "SELECT reloptions FROM pg_class WHERE oid = 'leasework.runs'::regclass"
                ).fetchone()[0]  # type: ignore[index]
            )
    finally:
        drop_database(admin_dsn, name)
    return res


def report(res: Result, rows: int) -> None:
    if res.autovacuum != "on":
        print("WARNING: autovacuum is off on this server: the table's settings cannot act, and")
        print("nothing reclaims dead tuples; these figures are the unvacuumed growth.")
    print(
        f"\nbloat, storage {res.storage} ({res.reloptions}): {res.jobs:,} jobs in"
        f" {res.drained:.0f} s ({res.jobs / res.drained:,.0f} jobs/s, offered"
        f" {f'{res.rate:,.0f}/s' if res.rate else 'as fast as they go'}); PostgreSQL {res.version},"
        f" autovacuum {res.autovacuum}"
    )
    step = max(1, len(res.samples) // rows)
    picks = sorted({*range(0, len(res.samples), step), len(res.samples) - 1})
    print_table(
        ["t s", "jobs done", "rows", "dead", "table MiB", "indexes MiB", "total MiB", "autovacuums"],
        [
            [f"{s[T]:.0f}", f"{res.done[i]:,}", f"{s[ROWS]:,.0f}", f"{s[DEAD]:,.0f}",
             mib(s[TABLE]), mib(s[INDEXES]), mib(s[TOTAL]), f"{s[AUTOVAC]:.0f}"]
            for i in picks
            for s in [res.samples[i]]
        ],
    )  # fmt: skip


def summary(results: list[Result]) -> None:
    print("\nbloat summary (peak = the largest table + indexes seen)")
    out = []
    for r in results:
        peak = max(r.samples, key=lambda s: s[TOTAL])
        end = r.samples[-1]
        held = max(s[ROWS] for s in r.samples)
        hot = end[HOT] / end[UPD] if end[UPD] else 0.0
        out.append(
            [r.storage, f"{r.jobs / r.drained:,.0f}", mib(peak[TABLE]), mib(peak[INDEXES]),
             mib(peak[TOTAL]), mib(end[TOTAL]), f"{held:,.0f}",
             f"{peak[TOTAL] / max(held, 1):,.0f}", f"{max(s[DEAD] for s in r.samples):,.0f}",
             f"{end[AUTOVAC]:.0f}", f"{hot:.0%}"]
        )  # fmt: skip
    print_table(
        ["storage", "jobs/s", "peak table MiB", "peak idx MiB", "peak total MiB", "end MiB",
         "most rows", "peak B/row", "most dead", "autovacuums", "HOT upd"],
        out,
    )  # fmt: skip


# bench/README.md's bound: ~290 bytes per tuple version, live or dead (table and indexes), for the
# runs held plus two dead versions per job over a naptime and a vacuum (~40 s).
BYTES_PER_VERSION, VACUUM_S = 290, 40


def record_bound(results_file: str | None, r: Result, short: bool) -> None:
    peak = max(s[TOTAL] for s in r.samples)
    held = max(s[ROWS] for s in r.samples)
    rate = r.jobs / r.drained
    bound = BYTES_PER_VERSION * (held + 2 * rate * (r.naptime + VACUUM_S))
    vacuumed = [s for s in r.samples if s[AUTOVAC] >= 1]
    if vacuumed:
        first = vacuumed[0]
        plateau = (
            f"first autovacuum by {first[T]:.0f} s at {mib(first[TOTAL])} MiB, end"
            f" {mib(r.samples[-1][TOTAL])} MiB, {r.samples[-1][AUTOVAC]:.0f} autovacuums"
        )
    else:
        plateau = "no autovacuum ran: the plateau was not reached, the bound not tested"
    record(
        results_file, 8,
        f"runs + indexes, peak, {r.jobs:,} jobs, storage {r.storage}", peak / 2**20, "MiB",
        baseline=bound / 2**20, baseline_label="documented bound", ratio=peak / bound,
        target_text="≤ the documented bound", met=peak <= bound if vacuumed else None,
        short=short,
        notes=f"bound {BYTES_PER_VERSION} B x ({held:,.0f} runs held + 2 x {rate:,.0f} jobs/s"
        f" x ({r.naptime:g} s naptime + {VACUUM_S} s)); {plateau}",
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--dsn", default=None, help="an admin DSN (a bench database is made); default: private"
    )
    ap.add_argument("--private", action="store_true", help="a private cluster (the default)")
    ap.add_argument("--jobs", type=int, default=1_000_000)
    ap.add_argument("--retention", type=float, default=60.0)
    ap.add_argument(
        "--rate", type=float, default=4000.0, help="jobs/s offered at most (0: no limit)"
    )
    ap.add_argument("--storage", choices=["both", "schema", "default"], default="both")
    ap.add_argument("--rows", type=int, default=15, help="rows of each size-over-time table")
    ap.add_argument("--quick", action="store_true", help="200,000 jobs, retention 20 s")
    results_arg(ap)
    args = ap.parse_args()
    if args.quick:
        args.jobs, args.retention = min(args.jobs, 200_000), min(args.retention, 20.0)
    storages = ["schema", "default"] if args.storage == "both" else [args.storage]
    with contextlib.ExitStack() as stack:
        admin = args.dsn
        if admin is None or args.private:
            admin = stack.enter_context(private_server())
        results = []
        for s in storages:
            results.append(run(admin, s, args.jobs, args.retention, args.rate))
            report(results[-1], args.rows)
    summary(results)
    for r in results:
        record_bound(args.results, r, args.jobs < 1_000_000)


if __name__ == "__main__":
    main()
