"""The peers side by side: PGQueuer and Procrastinate in their best configurations found here,
the raw psycopg loops and leasework (one at a time and `batch=N`), no-op jobs, same server, same
invocation, repeats interleaved. Runs inside the bench-only virtualenv that `bench/peers.sh`
makes (the peers are never dependencies of leasework); prints medians, ranges and ratios.

    bench/peers.sh [--dsn DSN] [--jobs 20000] [--procs 2] [--repeat 3] [--batch 100] [--quick]

Each system gets the same number of worker processes; time runs from the first process start to
the last exit (imports are done before the fork, so only connecting and working count). Queues
are filled before the clock starts (PGQueuer's list enqueue, Procrastinate's batch defer).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Callable
from functools import partial

import asyncpg  # type: ignore[import-not-found]
import procrastinate  # type: ignore[import-not-found]
import psycopg
import uvloop  # type: ignore[import-not-found]
from common import DEFAULT_DSN, bench_database, drop_database, med, print_table, spread
from pgqueuer import AsyncpgDriver, Queries, QueueManager  # type: ignore[import-not-found]
from pgqueuer.models import Job  # type: ignore[import-not-found]
from pgqueuer.types import QueueExecutionMode  # type: ignore[import-not-found]
from throughput import (
    Setup,
    batch_app,
    lw_setup,
    lw_worker,
    raw_batch_worker,
    raw_setup,
    raw_worker,
    timed,
)


def asyncpg_connect(dsn: str) -> object:
    """asyncpg takes keyword arguments, not a libpq key=value string."""
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    kwargs = {k: params[k] for k in ("host", "port", "user", "password", "database") if k in params}
    if "dbname" in params:
        kwargs["database"] = params["dbname"]
    return asyncpg.connect(**kwargs)


# -- PGQueuer: asyncpg driver, uvloop, batch 100 (its own benchmark's fastest combination) -------


def pgq_setup(dsn: str, jobs: int, tenants: int) -> None:
    async def go() -> None:
        conn = await asyncpg_connect(dsn)
        try:
            queries = Queries(AsyncpgDriver(conn))
            if not await queries.schema_is_installed():
                await queries.install()
            await conn.execute("TRUNCATE pgqueuer, pgqueuer_log, pgqueuer_statistics")
            for start in range(0, jobs, 10_000):
                n = min(10_000, jobs - start)
                await queries.enqueue(["noop"] * n, [None] * n, [0] * n)
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


def procrastinate_app(dsn: str) -> procrastinate.App:
    logging.getLogger("procrastinate").setLevel(logging.ERROR)  # its top-level-app advice
    app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=dsn))

    @app.task(name="noop")
    async def noop() -> None:
        return None

    return app


def pro_setup(dsn: str, jobs: int, tenants: int) -> None:
    async def go() -> None:
        app = procrastinate_app(dsn)
        async with app.open_async():
            with psycopg.connect(dsn, autocommit=True) as conn:
                installed = conn.execute(
                    "SELECT to_regclass('procrastinate_jobs') IS NOT NULL"
                ).fetchone()
                if not (installed and installed[0]):
                    await app.schema_manager.apply_schema_async()
                conn.execute("TRUNCATE procrastinate_jobs CASCADE")
            task = app.tasks["noop"]
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


# -- the run -------------------------------------------------------------------------------------


def remaining(dsn: str) -> dict[str, int]:
    """Jobs left unfinished per system: every figure must be for a drained queue."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        counts = {
            "raw": "SELECT count(*) FROM bench_raw_jobs WHERE status <> 'done'",
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
    ap.add_argument("--quick", action="store_true", help="5,000 jobs, 2 repeats")
    args = ap.parse_args()
    if args.quick:
        args.jobs, args.repeat = min(args.jobs, 5000), min(args.repeat, 2)
    name = "leasework_bench_peers"
    dsn = bench_database(args.dsn, name)
    b = args.batch
    variants: list[tuple[str, Setup, Callable[[str], None]]] = [
        ("raw one-at-a-time", raw_setup, raw_worker),
        ("leasework one-at-a-time", lw_setup, lw_worker),
        ("Procrastinate, concurrency 10", pro_setup, partial(pro_worker, 10)),
        (f"raw batched ({b})", raw_setup, partial(raw_batch_worker, b)),
        (f"leasework batch={b}", lw_setup, partial(lw_worker, app=batch_app(b))),
        (f"PGQueuer asyncpg, batch {b}", pgq_setup, partial(pgq_worker, b)),
    ]
    results: dict[str, list[float]] = {v[0]: [] for v in variants}
    try:
        for _ in range(args.repeat):  # interleaved, so drift in machine load hits all alike
            for label, setup, work in variants:
                results[label].append(timed(setup, work, dsn, args.jobs, args.procs))
                left = remaining(dsn)
                if any(left.values()):
                    raise RuntimeError(f"{label}: jobs left unfinished: {left}")
    finally:
        drop_database(args.dsn, name)
    one, batched = med(results["raw one-at-a-time"]), med(results[f"raw batched ({b})"])
    pgq = med(results[f"PGQueuer asyncpg, batch {b}"])
    print(f"peers: {args.jobs:,} no-op jobs, {args.procs} processes each, {args.repeat} runs each")
    rows = []
    for label, values in results.items():
        m = med(values)
        target = ""
        if label == "leasework one-at-a-time":
            target = "≥ 0.80 x raw one-at-a-time"
        elif label == f"leasework batch={b}":
            target = f"≥ 0.40 x raw batched, ≥ 1.2 x PGQueuer ({m / pgq:.2f})"
        rows.append(
            [label, f"{m:,.0f}", spread(values), f"{m / one:.2f}", f"{m / batched:.2f}", target]
        )
    print_table(
        ["system", "jobs/s (median)", "range", "x raw 1-at-a-time", "x raw batched", "target"],
        rows,
    )


if __name__ == "__main__":
    main()
