"""The peers side by side: PGQueuer and Procrastinate in their best configurations found here,
the raw psycopg loops (the fused one-at-a-time loop, one commit per job, is the limit; the
two-commit loop beside it) and leasework (one at a time and `batch=N`), no-op jobs, same server, same
invocation, repeats interleaved. Runs inside the bench-only virtualenv that `bench/peers.sh`
makes (the peers are never dependencies of leasework); prints medians, ranges and ratios.

    bench/peers.sh [--dsn DSN] [--jobs 20000] [--procs 2] [--repeat 3] [--batch 100]
                   [--bulk-jobs 100000] [--skip-throughput] [--quick]

Each system gets the same number of worker processes; time runs from the first process start to
the last exit (imports are done before the fork, so only connecting and working count). Queues
are filled before the clock starts (PGQueuer's list enqueue, Procrastinate's batch defer).

Then bulk enqueue side by side: the same number of no-op jobs (payload `{}`) enqueued by
leasework's `App.enqueue_many` (COPY, one transaction), PGQueuer's list enqueue and Procrastinate's
batch defer (both in chunks of BULK_CHUNK, their fastest found here), and a raw psycopg COPY into a
minimal table (the ceiling; bulk_enqueue.py's). Only the enqueue calls are timed, on a connection
(or an open app) made before the clock starts; every system's tables are emptied and a CHECKPOINT
taken before each run, and the rows are counted after it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import asyncpg  # type: ignore[import-not-found]
import bulk_enqueue
import procrastinate  # type: ignore[import-not-found]
import psycopg
import uvloop  # type: ignore[import-not-found]
from common import (
    COST_HEADERS,
    DEFAULT_DSN,
    RAW_LEFT,
    Run,
    bench_database,
    cost_cells,
    drop_database,
    med,
    paired,
    print_table,
    raw_batch_worker,
    raw_fused_worker,
    raw_setup,
    raw_table,
    raw_worker,
    record,
    results_arg,
    rounds,
    spread,
)
from pgqueuer import AsyncpgDriver, Queries, QueueManager  # type: ignore[import-not-found]
from pgqueuer.models import Job  # type: ignore[import-not-found]
from pgqueuer.types import QueueExecutionMode  # type: ignore[import-not-found]
from psycopg import sql
from throughput import (
    LW_ONE,
    LW_SUP,
    RAW_FUSED,
    RAW_TWO,
    Setup,
    batch_app,
    lw_setup,
    lw_supervised,
    lw_worker,
    rates,
    timed,
)

from leasework import db


def asyncpg_connect(dsn: str) -> object:
    """asyncpg takes keyword arguments, not a libpq key=value string."""
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    kwargs = {k: params[k] for k in ("host", "port", "user", "password", "database") if k in params}
    if "dbname" in params:
        kwargs["database"] = params["dbname"]
    return asyncpg.connect(**kwargs)


# -- PGQueuer: asyncpg driver, uvloop, batch 100 (its own benchmark's fastest combination) -------

PGQ_TABLES = "TRUNCATE pgqueuer, pgqueuer_log, pgqueuer_statistics"


async def pgq_install(queries: Queries) -> None:
    if not await queries.schema_is_installed():
        await queries.install()


def pgq_setup(dsn: str, jobs: int, tenants: int, entrypoint: str = "noop") -> None:
    async def go() -> None:
        conn = await asyncpg_connect(dsn)
        try:
            queries = Queries(AsyncpgDriver(conn))
            await pgq_install(queries)
            await conn.execute(PGQ_TABLES)
            for start in range(0, jobs, 10_000):
                n = min(10_000, jobs - start)
                await queries.enqueue([entrypoint] * n, [None] * n, [0] * n)
            await conn.execute("VACUUM ANALYZE pgqueuer")
        finally:
            await conn.close()

    asyncio.run(go())


def pgq_worker(batch: int, dsn: str) -> None:
    async def go() -> None:
        conn = await asyncpg_connect(dsn)
        qm = QueueManager(Queries(AsyncpgDriver(conn)))

        @qm.entrypoint("noop")
        async def noop(job: Job) -> None:
            return None

        await qm.run(batch_size=batch, mode=QueueExecutionMode.drain)
        await conn.close()

    uvloop.run(go())


# -- Procrastinate: psycopg connector, concurrency 10, LISTEN/NOTIFY -----------------------------


def procrastinate_app(dsn: str, **pool: int) -> procrastinate.App:
    """The app with its no-op task; `pool` goes to its psycopg pool (`max_size=`: Procrastinate
    advises concurrency + 1 for short jobs)."""
    logging.getLogger("procrastinate").setLevel(logging.ERROR)  # its top-level-app advice
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn, **pool))

    @app.task(name="noop")
    async def noop() -> None:
        return None

    return app


async def pro_install(app: procrastinate.App, conn: psycopg.Connection[Any]) -> None:
    installed = conn.execute("SELECT to_regclass('procrastinate_jobs') IS NOT NULL").fetchone()
    if not (installed and installed[0]):
        await app.schema_manager.apply_schema_async()


def pro_setup(
    dsn: str,
    jobs: int,
    tenants: int,
    make_app: Callable[[str], procrastinate.App] = procrastinate_app,
    task_name: str = "noop",
) -> None:
    async def go() -> None:
        app = make_app(dsn)
        async with app.open_async():
            with psycopg.connect(dsn, autocommit=True) as conn:
                await pro_install(app, conn)
                conn.execute("TRUNCATE procrastinate_jobs CASCADE")
            task = app.tasks[task_name]
            for start in range(0, jobs, 10_000):
                await task.batch_defer_async(*[{} for _ in range(min(10_000, jobs - start))])
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE procrastinate_jobs")

    asyncio.run(go())


def pro_worker(concurrency: int, dsn: str) -> None:
    async def go() -> None:
        app = procrastinate_app(dsn)
        async with app.open_async():
            await app.run_worker_async(
                concurrency=concurrency, wait=False, install_signal_handlers=False
            )

    asyncio.run(go())


# -- bulk enqueue: N no-op jobs, payload {}, only the enqueue timed --------------------------------

# PGQueuer's and Procrastinate's batch calls take lists of any length, but both were faster here
# in calls of 10,000 than in one call of 100,000 (PGQueuer 66-73k against 33-58k jobs/s, 25,000
# per call 44k; Procrastinate 21-22k against 17-20k), so they get that; 1,000 was no faster.
BULK_CHUNK = 10_000


def checked(dsn: str, table: str, jobs: int, elapsed: float, empty: str) -> float:
    """Jobs/s, once the rows are counted; then the tables are emptied again."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        count = sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(*table.split(".")))
        row = conn.execute(count).fetchone()
        conn.execute(empty)
    found = int(row[0]) if row else 0
    if found != jobs:
        raise RuntimeError(f"bulk enqueue into {table}: {found} rows, expected {jobs}")
    return jobs / elapsed


def bulk_raw(dsn: str, jobs: int) -> float:
    """The ceiling: bulk_enqueue.py's raw COPY into the raw queue's table, one transaction."""
    items: list[dict[str, Any]] = [{} for _ in range(jobs)]
    with psycopg.connect(dsn, autocommit=True) as conn:
        raw_table(conn)
        conn.execute("CHECKPOINT")
        start = time.perf_counter()
        bulk_enqueue.raw_copy(conn, items)
        elapsed = time.perf_counter() - start
    return checked(dsn, "bench_raw_jobs", jobs, elapsed, "DROP TABLE bench_raw_jobs")


LW_TABLES = "TRUNCATE leasework.runs, leasework.tenants, leasework.workers"


def bulk_leasework(dsn: str, jobs: int) -> float:
    """`App.enqueue_many` without keys (COPY), in one transaction (bulk_enqueue.py's call)."""
    items: list[dict[str, Any]] = [{} for _ in range(jobs)]
    with psycopg.connect(dsn, autocommit=True) as conn:
        db.migrate(conn)
        conn.execute(LW_TABLES)
        conn.execute("CHECKPOINT")
        start = time.perf_counter()
        bulk_enqueue.lw_copy(conn, items)
        elapsed = time.perf_counter() - start
    return checked(dsn, "leasework.runs", jobs, elapsed, LW_TABLES)


def bulk_pgq(dsn: str, jobs: int) -> float:
    """`Queries.enqueue` with lists, BULK_CHUNK per call, each call its own statement and commit
    (as pgq_setup fills its queue; one transaction around the calls measured the same or a little
    slower, 66k against 68k jobs/s)."""

    async def go() -> float:
        conn = await asyncpg_connect(dsn)
        try:
            queries = Queries(AsyncpgDriver(conn))
            await pgq_install(queries)
            await conn.execute(PGQ_TABLES)
            await conn.execute("CHECKPOINT")
            entrypoints, payloads, priorities = ["noop"] * jobs, [b"{}"] * jobs, [0] * jobs
            start = time.perf_counter()
            for s in range(0, jobs, BULK_CHUNK):
                e = s + BULK_CHUNK
                await queries.enqueue(entrypoints[s:e], payloads[s:e], priorities[s:e])
            return time.perf_counter() - start
        finally:
            await conn.close()

    return checked(dsn, "pgqueuer", jobs, uvloop.run(go()), PGQ_TABLES)


def bulk_pro(dsn: str, jobs: int) -> float:
    """`Task.batch_defer_async`, BULK_CHUNK per call (as pro_setup fills its queue), on the
    app's connection pool, opened and used once before the clock starts."""

    async def go() -> float:
        app = procrastinate_app(dsn)
        async with app.open_async():
            with psycopg.connect(dsn, autocommit=True) as conn:
                await pro_install(app, conn)
                conn.execute("TRUNCATE procrastinate_jobs CASCADE")
                conn.execute("CHECKPOINT")
            await app.connector.execute_query_async("SELECT 1")
            task = app.tasks["noop"]
            kwargs: list[dict[str, Any]] = [{} for _ in range(jobs)]
            start = time.perf_counter()
            for s in range(0, jobs, BULK_CHUNK):
                await task.batch_defer_async(*kwargs[s : s + BULK_CHUNK])
            return time.perf_counter() - start

    elapsed = asyncio.run(go())
    return checked(dsn, "procrastinate_jobs", jobs, elapsed, "TRUNCATE procrastinate_jobs CASCADE")


BULK = {
    "raw COPY (ceiling)": bulk_raw,
    "leasework enqueue_many (COPY)": bulk_leasework,
    f"PGQueuer enqueue, lists of {BULK_CHUNK:,}": bulk_pgq,
    f"Procrastinate batch_defer, {BULK_CHUNK:,} per call": bulk_pro,
}


def bulk_section(
    dsn: str, jobs: int, repeat: int, results_file: str | None = None, short: bool = False
) -> None:
    results: dict[str, list[float]] = {label: [] for label in BULK}
    for _ in range(repeat):  # interleaved, as above
        for label, fn in BULK.items():
            results[label].append(fn(dsn, jobs))
    raw = med(results["raw COPY (ceiling)"])
    pgq = med(results[f"PGQueuer enqueue, lists of {BULK_CHUNK:,}"])
    print(f"bulk enqueue: {jobs:,} no-op jobs (payload {{}}), {repeat} runs each")
    rows = []
    for label, values in results.items():
        m = med(values)
        target = ""
        if label == "leasework enqueue_many (COPY)":
            target = f"≥ 1.0 x PGQueuer ({m / pgq:.2f})"
        rows.append(
            [label, f"{m:,.0f}", spread(values), f"{m / raw:.2f}", f"{m / pgq:.2f}", target]
        )
    print_table(["method", "jobs/s (median)", "range", "x raw COPY", "x PGQueuer", "target"], rows)
    pgq_label = f"PGQueuer enqueue, lists of {BULK_CHUNK:,}"
    lw = results["leasework enqueue_many (COPY)"]
    record(
        results_file, 5, f"enqueue_many (COPY), {jobs:,} jobs, {repeat} runs", med(lw), "jobs/s",
        baseline=pgq, baseline_label=pgq_label, ratio=med(lw) / pgq,
        target_text="≥ 1.0 x PGQueuer", met=med(lw) / pgq >= 1.0, short=short,
        notes=f"ranges: leasework {spread(lw)}, PGQueuer {spread(results[pgq_label])};"
        f" x raw COPY {med(lw) / raw:.2f}",
    )  # fmt: skip


# -- the run -------------------------------------------------------------------------------------


def remaining(dsn: str) -> dict[str, int]:
    """Jobs left unfinished per system: every figure must be for a drained queue."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        counts = {
            "raw": RAW_LEFT,
            "leasework": "SELECT count(*) FROM leasework.runs WHERE status <> 'succeeded'",
            "pgqueuer": "SELECT count(*) FROM pgqueuer",
            "procrastinate": "SELECT count(*) FROM procrastinate_jobs WHERE status <> 'succeeded'",
        }
        out = {}
        for name, query in counts.items():
            try:
                row = conn.execute(query).fetchone()  # type: ignore[arg-type]
            except psycopg.errors.UndefinedTable:
                continue
            out[name] = int(row[0]) if row else 0
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dsn", default=DEFAULT_DSN, help="an admin DSN; a bench database is made")
    ap.add_argument("--jobs", type=int, default=20000)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument(
        "--bulk-jobs", type=int, default=100_000, help="jobs per bulk enqueue (0 to skip it)"
    )
    ap.add_argument("--skip-throughput", action="store_true", help="only the bulk enqueue section")
    ap.add_argument(
        "--quick", action="store_true", help="5,000 jobs, 20,000 for bulk enqueue, 2 repeats"
    )
    results_arg(ap)
    args = ap.parse_args()
    if args.quick:
        args.jobs, args.repeat = min(args.jobs, 5000), min(args.repeat, 2)
        args.bulk_jobs = min(args.bulk_jobs, 20_000)
    name = "leasework_bench_peers"
    dsn = bench_database(args.dsn, name)
    try:
        if not args.skip_throughput:
            throughput_section(dsn, args)
        if args.bulk_jobs:
            if not args.skip_throughput:
                print()
            bulk_section(dsn, args.bulk_jobs, args.repeat, args.results, args.quick)
    finally:
        drop_database(args.dsn, name)


def throughput_section(dsn: str, args: argparse.Namespace) -> None:
    b = args.batch
    raw_b, pgq_label = f"raw batched ({b})", f"PGQueuer asyncpg, batch {b}"
    sup_b, lw_b = f"leasework supervise batch={b}", f"bare loop batch={b}"
    # Each comparison's systems next to each other: they run back to back in every round.
    # `leasework supervise` (its defaults, as deployed) is the headline; the bare loops are
    # breakdown rows. A None set-up: lw_supervised does its own.
    variants: list[tuple[str, Setup | None, Callable[..., Any]]] = [
        (RAW_TWO, raw_setup, raw_worker),
        (RAW_FUSED, raw_setup, raw_fused_worker),
        (LW_SUP, None, partial(lw_supervised, args.dsn)),
        (LW_ONE, lw_setup, lw_worker),
        ("Procrastinate, concurrency 10", pro_setup, partial(pro_worker, 10)),
        (raw_b, raw_setup, partial(raw_batch_worker, b)),
        (sup_b, None, partial(lw_supervised, args.dsn, batch=b)),
        (lw_b, lw_setup, partial(lw_worker, app=batch_app(b))),
        (pgq_label, pgq_setup, partial(pgq_worker, b)),
    ]
    by_label = {label: (setup, work) for label, setup, work in variants}

    def run_one(label: str) -> Run:
        setup, work = by_label[label]
        if setup is None:
            run: Run = work(dsn, args.jobs, args.procs)
        else:
            run = timed(setup, work, dsn, args.jobs, args.procs)
        left = remaining(dsn)
        if any(left.values()):
            raise RuntimeError(f"{label}: jobs left unfinished: {left}")
        return run

    results = rounds(list(by_label), args.repeat, run_one)
    fused_runs, batched_runs = results[RAW_FUSED], results[raw_b]
    one, batched = med(rates(fused_runs)), med(rates(batched_runs))
    pgq = med(rates(results[pgq_label]))
    print(
        f"peers: {args.jobs:,} no-op jobs, {args.procs} processes each, {args.repeat} runs each,"
        " interleaved, the order reversed every other round; `leasework supervise` with its"
        " defaults timed from the first run's start to the last's finish, the rest from the"
        " first process start to the last exit; ratios: the median of each round's; per job:"
        " medians (WAL is the whole server's)"
    )
    rows = []
    for label, runs in results.items():
        m = med(rates(runs))
        target = ""
        if label == LW_SUP:
            target = "≥ 0.80 x raw fused"
        elif label == sup_b:
            target = (
                f"≥ 0.60 x raw batched, ≥ 1.5 x PGQueuer ({paired(runs, results[pgq_label]):.2f})"
            )
        elif label in (LW_ONE, lw_b):
            target = f"breakdown ({paired(runs, results[pgq_label]):.2f} x PGQueuer)"
        rows.append(
            [label, f"{m:,.0f}", spread(rates(runs)), f"{paired(runs, fused_runs):.2f}",
             f"{paired(runs, batched_runs):.2f}", target, *cost_cells(runs)]
        )  # fmt: skip
    print_table(
        ["system", "jobs/s (median)", "range", "x raw fused", "x raw batched", "target",
         *COST_HEADERS],
        rows,
    )  # fmt: skip
    scale = f"{args.jobs:,} jobs, {args.procs} procs, {args.repeat} runs"
    lw1, lwb = rates(results[LW_SUP]), rates(results[sup_b])
    c1, cf = cost_cells(results[LW_SUP]), cost_cells(results[RAW_FUSED])
    ratio1 = paired(results[LW_SUP], fused_runs)
    record(
        args.results, 1, f"one-at-a-time, `leasework supervise` ({scale})", med(lw1), "jobs/s",
        baseline=one, baseline_label="raw fused loop (1 commit per job)", ratio=ratio1,
        target_text="≥ 0.80 x raw fused", met=ratio1 >= 0.8, short=args.quick,
        notes=f"ratio: median of the rounds' (ratio of the medians {med(lw1) / one:.2f});"
        f" ranges: leasework {spread(lw1)}, raw fused {spread(rates(fused_runs))};"
        f" x two-commit raw {paired(results[LW_SUP], results[RAW_TWO]):.2f};"
        f" x bare loop {paired(results[LW_SUP], results[LW_ONE]):.2f};"
        f" per job leasework {c1[0]} commits, {c1[1]} B WAL; raw fused {cf[0]}, {cf[1]} B",
    )  # fmt: skip
    for key, base, limit, short_name in [
        (raw_b, batched, 0.6, "raw batched"),
        (pgq_label, pgq, 1.5, "PGQueuer"),
    ]:
        ratio = paired(results[sup_b], results[key])
        record(
            args.results, 2, f"batch={b}, `leasework supervise` ({scale})", med(lwb), "jobs/s",
            baseline=base, baseline_label=key, ratio=ratio,
            target_text=f"≥ {limit:.2f} x {short_name}", met=ratio >= limit,
            short=args.quick,
            notes=f"ratio: median of the rounds' (ratio of the medians {med(lwb) / base:.2f});"
            f" ranges: leasework {spread(lwb)}, {key} {spread(rates(results[key]))};"
            f" bare loop batch={b}: {paired(results[lw_b], results[key]):.2f} x {short_name}",
        )  # fmt: skip


if __name__ == "__main__":
    main()
