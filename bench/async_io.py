"""Async handlers (issue 16) side by side: IO-bound runs (`await asyncio.sleep(0.05)`) through
leasework's async handlers, Procrastinate and PGQueuer, each with 2 processes and 10 runs in flight
per process, against the ideal (processes x concurrency / sleep: 400 runs/s); no-op async runs
against leasework's sync one-at-a-time with the same processes; and the RSS of a leasework child at
rest serving async kinds. Same server, same invocation, repeats interleaved; prints medians, ranges
and ratios and records them in the results channel. Runs inside bench/.venv-peers:

    bench/peers.sh async_io.py [--dsn DSN] [--jobs 4000] [--noop-jobs 10000] [--procs 2]
                               [--concurrency 10] [--sleep 0.05] [--repeat 3] [--quick]
                               [--sections io,noop,rest]

How each run is timed, the same for every system: its queue is filled and analyzed first (each
system's own bulk enqueue), the worker processes are forked (imports done before the fork, so
only connecting and working count), and the clock runs from the first fork until a watcher on
its own connection sees no job of the system left unfinished (one count every WATCH_EVERY s, in
one read-committed transaction rolled back at the end: no commit of its own, its backend left out
of the CPU figures). The peers then exit by themselves (their drain modes); leasework's workers,
`Worker.run()` as a supervised child runs it, get SIGTERM (the child's graceful stop). Every
queue is checked drained, every job succeeded.

The peers' settings, for this load (their documentation's advice):
- Procrastinate: `run_worker_async(concurrency=10)` per process, psycopg connector with a pool of
  `max_size = concurrency + 1` ("the shorter your jobs, the more your pool will need as many
  connections as your concurrency, plus one"), LISTEN/NOTIFY on, `wait=False` to drain;
- PGQueuer: asyncpg driver on one connection per process (its advice for a QueueManager),
  uvloop, `max_concurrent_tasks=10` (its per-process ceiling on running jobs; `concurrency_limit`
  on an entrypoint is fleet-wide, so 10 there would mean 10 in all) and `batch_size=5` (it requires
  `max_concurrent_tasks >= 2 x batch_size`), drain mode.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import procrastinate  # type: ignore[import-not-found]
import psycopg
import uvloop  # type: ignore[import-not-found]
from common import (
    COST_HEADERS,
    DEFAULT_DSN,
    Meter,
    Run,
    bench_database,
    cost_cells,
    drop_database,
    med,
    print_table,
    record,
    results_arg,
    spread,
)
from peers import asyncpg_connect, pgq_setup, pro_setup, procrastinate_app
from pgqueuer import AsyncpgDriver, Queries, QueueManager  # type: ignore[import-not-found]
from pgqueuer.models import Job  # type: ignore[import-not-found]
from pgqueuer.types import QueueExecutionMode  # type: ignore[import-not-found]
from throughput import lw_setup

from leasework import App, Config, db
from leasework.workers.worker import Worker

WATCH_EVERY = 0.02  # seconds between the watcher's counts (the clock's resolution)
SLEEP = 0.05  # the IO-bound handler's await, set from --sleep before any fork

# Jobs of each system not finished yet (the watcher's count), and not succeeded (the check after).
LEFT = {
    "leasework": "SELECT count(*) FROM leasework.runs WHERE status IN ('queued', 'running')",
    "procrastinate": "SELECT count(*) FROM procrastinate_jobs WHERE status IN ('todo', 'doing')",
    "pgqueuer": "SELECT count(*) FROM pgqueuer",
}
NOT_SUCCEEDED = {
    "leasework": "SELECT count(*) FROM leasework.runs WHERE status <> 'succeeded'",
    "procrastinate": "SELECT count(*) FROM procrastinate_jobs WHERE status <> 'succeeded'",
    "pgqueuer": "SELECT count(*) FROM pgqueuer",  # a finished job leaves the table for the log
}


class Skip(Exception):
    """This leasework cannot run the measurement (no async handlers): the reason, one line."""


# -- leasework -----------------------------------------------------------------------------------


async def lw_io(ctx: Any, payload: Any) -> None:
    await asyncio.sleep(SLEEP)


async def lw_noop_async(ctx: Any, payload: Any) -> None:
    return None


def lw_noop_sync(ctx: Any, payload: Any) -> None:
    return None


def async_app(kind: str, handler: Callable[..., Any], concurrency: int) -> App:
    """An app serving `kind` with an async handler, `concurrency` runs in flight per process;
    Skip when this leasework refuses `async def` handlers or the `concurrency=` keyword."""
    app = App()
    try:
        app.task(kind, concurrency=concurrency)(handler)
    except TypeError as exc:
        raise Skip(
            f"@app.task({kind!r}, concurrency={concurrency}) is not accepted by this leasework"
            f" ({exc}): async handlers have not landed"
        ) from exc
    except Exception as exc:
        raise Skip(f"this leasework refuses an async handler: {str(exc).splitlines()[0]}") from exc
    return app


def sync_app(kind: str) -> App:
    app = App()
    app.task(kind)(lw_noop_sync)
    return app


def lw_run(app: App, dsn: str) -> None:
    """`Worker.run()` as a supervised child runs it (default settings, poll 2 s as the other
    benches), stopped gracefully by SIGTERM as the supervisor stops a child."""
    cfg = Config(dsn=dsn, poll_interval=2.0)
    worker = Worker(app.with_config(cfg), cfg, register=False)
    signal.signal(signal.SIGTERM, lambda signum, frame: worker.stop(graceful=True))
    worker.run()


# -- Procrastinate: concurrency 10, pool max_size concurrency + 1 ---------------------------------


def pro_io_app(concurrency: int, dsn: str) -> procrastinate.App:
    app = procrastinate_app(dsn, max_size=concurrency + 1)

    @app.task(name="io")
    async def io() -> None:
        await asyncio.sleep(SLEEP)

    return app


def pro_io_worker(concurrency: int, dsn: str) -> None:
    async def go() -> None:
        app = pro_io_app(concurrency, dsn)
        async with app.open_async():
            await app.run_worker_async(
                concurrency=concurrency, wait=False, install_signal_handlers=False
            )

    asyncio.run(go())


# -- PGQueuer: asyncpg, uvloop, max_concurrent_tasks 10, batch 5 --------------------------------


def pgq_io_worker(concurrency: int, dsn: str) -> None:
    async def go() -> None:
        conn = await asyncpg_connect(dsn)
        qm = QueueManager(Queries(AsyncpgDriver(conn)))

        @qm.entrypoint("io")
        async def io(job: Job) -> None:
            await asyncio.sleep(SLEEP)

        await qm.run(
            batch_size=max(1, concurrency // 2),
            max_concurrent_tasks=concurrency,
            mode=QueueExecutionMode.drain,
        )
        await conn.close()

    uvloop.run(go())


# -- the timing ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class System:
    label: str
    family: str  # the key of LEFT / NOT_SUCCEEDED
    setup: Callable[[str, int], None]
    work: Callable[[str], None]
    exits: bool  # drains and exits by itself (the peers); else stopped by SIGTERM


@dataclass(frozen=True)
class Timeline:
    """Where a leasework run's time went, in database time, from its runs' started_at (the
    claim) and finished_at (the seal): the first claim after the fork, the last seal before the
    watcher saw the queue drained, each run's claim-to-seal time (the handler's await and the
    engine's own time around it), and how many runs were in flight on average between the first
    claim and the last seal (the ideal: processes x concurrency)."""

    first_claim_s: float
    after_last_seal_s: float
    claim_to_seal_p50_ms: float
    claim_to_seal_p95_ms: float
    in_flight: float


TIMELINE = """
SELECT extract(epoch FROM min(started_at) - %(t0)s),
       extract(epoch FROM %(t1)s - max(finished_at)),
       1000 * percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM finished_at - started_at)),
       1000 * percentile_cont(0.95) WITHIN GROUP (ORDER BY extract(epoch FROM finished_at - started_at)),
       sum(extract(epoch FROM finished_at - started_at))
         / nullif(extract(epoch FROM max(finished_at) - min(started_at)), 0)
  FROM leasework.runs
"""

TIMELINES: dict[str, list[Timeline]] = {}  # label -> one per leasework run


def timed(system: System, dsn: str, jobs: int, procs: int, limit: float) -> Run:
    """Jobs per second from the first fork until the watcher sees the queue drained, and what
    each job cost (common.Meter; the watcher's backend and transaction are left out); for
    leasework, its Timeline too (TIMELINES)."""
    system.setup(dsn, jobs)
    meter = Meter(dsn)
    ctx = mp.get_context("fork")
    ps = [ctx.Process(target=system.work, args=(dsn,)) for _ in range(procs)]
    watch = psycopg.connect(dsn)  # one transaction, read committed: each count sees the latest
    try:
        meter.ignore(watch.info.backend_pid)
        meter.start()
        t0 = db_clock(watch)
        start = time.perf_counter()
        for p in ps:
            p.start()
        while True:
            row = watch.execute(LEFT[system.family]).fetchone()  # type: ignore[arg-type]
            left = int(row[0]) if row else 0
            if left == 0:
                break
            elapsed = time.perf_counter() - start
            if not any(p.is_alive() for p in ps):
                raise RuntimeError(f"{system.label}: workers exited, {left} jobs unfinished")
            if elapsed > limit:
                raise RuntimeError(f"{system.label}: {left} jobs unfinished after {limit:.0f} s")
            time.sleep(WATCH_EVERY)
        elapsed = time.perf_counter() - start
        t1 = db_clock(watch)
        watch.rollback()
    finally:
        watch.close()
        stop(ps, system.exits)
    cost = meter.stop(jobs)
    if any(p.exitcode for p in ps):
        raise RuntimeError(f"{system.label}: a worker process failed: {[p.exitcode for p in ps]}")
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(NOT_SUCCEEDED[system.family]).fetchone()  # type: ignore[arg-type]
        if row and row[0]:
            raise RuntimeError(f"{system.label}: {row[0]} jobs did not succeed")
        if system.family == "leasework":
            t = conn.execute(TIMELINE, {"t0": t0, "t1": t1}).fetchone()
            assert t is not None
            TIMELINES.setdefault(system.label, []).append(Timeline(*(float(x) for x in t)))
    return Run(jobs / elapsed, cost)


def db_clock(conn: psycopg.Connection[Any]) -> Any:
    row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    return row[0]


def print_timelines(labels: list[str]) -> None:
    """Each leasework system's Timeline, medians over its runs."""
    rows = []
    for label in labels:
        ts = TIMELINES.get(label)
        if not ts:
            continue
        rows.append(
            [label, f"{med([t.first_claim_s for t in ts]):.3f}",
             f"{med([t.after_last_seal_s for t in ts]):.3f}",
             f"{med([t.claim_to_seal_p50_ms for t in ts]):.1f}",
             f"{med([t.claim_to_seal_p95_ms for t in ts]):.1f}",
             f"{med([t.in_flight for t in ts]):.1f}"]
        )  # fmt: skip
    if rows:
        print_table(
            ["leasework (database time, medians)", "fork -> 1st claim s", "last seal -> seen s",
             "claim->seal p50 ms", "p95 ms", "in flight (mean)"],
            rows,
        )  # fmt: skip


def stop(ps: list[Any], exits: bool) -> None:
    """The peers drain and exit; leasework's workers are stopped as a supervisor stops a child."""
    if exits:
        for p in ps:
            p.join(60)
    for p in ps:
        if p.is_alive():
            os.kill(p.pid, signal.SIGTERM)
    for p in ps:
        p.join(60)
        if p.is_alive():
            p.kill()
            p.join()


def interleaved(
    systems: list[System], dsn: str, jobs: int, procs: int, repeat: int, limit: float
) -> dict[str, list[Run]]:
    results: dict[str, list[Run]] = {s.label: [] for s in systems}
    for _ in range(repeat):  # interleaved, so drift in machine load hits all alike
        for s in systems:
            results[s.label].append(timed(s, dsn, jobs, procs, limit))
    return results


def rates(runs: list[Run]) -> list[float]:
    return [r.rate for r in runs]


# -- memory at rest ------------------------------------------------------------------------------

RSS_APP = textwrap.dedent(
    """
    import asyncio
    from leasework import App

    app = App()


    @app.task("io", concurrency={concurrency})
    async def io(ctx, payload):
        await asyncio.sleep({sleep})


    @app.task("io_db", concurrency={concurrency})
    async def io_db(ctx, payload):
        # A statement on the handlers' async pool (opened on first use), then the await.
        async with ctx.connection() as conn:
            await conn.execute("SELECT 1")
        await asyncio.sleep({sleep})


    sync_app = App()


    @sync_app.task("noop")
    def noop(ctx, payload):
        return None
    """
)


def vm_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


def children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except FileNotFoundError:
        return []
    return [int(p) for p in text.split()]


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


@dataclass(frozen=True)
class Rest:
    """VmRSS (KiB) of each child of `leasework supervise` at rest: after start-up, and again after
    serving a burst of runs (for the async kind, runs that use `ctx.connection()`: the handlers'
    async pool is then open, with its connections)."""

    fresh: list[int]
    after: list[int]
    sessions: tuple[int, int]  # the database's sessions then (the children's, the parent's)


def at_rest(dsn: str, app_ref: str, kind: str, procs: int, burst: int, rest: float) -> Rest:
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "abench_app.py").write_text(RSS_APP.format(concurrency=10, sleep=SLEEP))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([tmp, *sys.path])}
        env.pop("LEASEWORK_CONFIG", None)
        sup = subprocess.Popen(
            [sys.executable, "-m", "leasework", "supervise", "--app", app_ref,
             "--processes", str(procs), "--dsn", dsn],
            cwd=tmp, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        try:
            kids = wait_for(
                lambda: len(children(sup.pid)) == procs and children(sup.pid), 60, "children"
            )
            time.sleep(rest)  # past start-up and a first poll: at rest
            fresh = [vm_rss_kib(p) for p in kids]
            with psycopg.connect(dsn, autocommit=True) as conn:
                sessions_fresh = count_sessions(conn)
                conn.execute("TRUNCATE leasework.runs")
                conn.execute(
                    "SELECT leasework.enqueue(%s, '{}'::jsonb) FROM generate_series(1, %s)",
                    (kind, burst),
                )

                def done() -> bool:
                    row = conn.execute(
                        "SELECT count(*) FROM leasework.runs WHERE status = 'succeeded'"
                    ).fetchone()
                    return bool(row and row[0] == burst)

                wait_for(done, 120, f"{burst} runs of {kind}")
            time.sleep(rest)
            after = [vm_rss_kib(p) for p in kids if Path(f"/proc/{p}").exists()]
            with psycopg.connect(dsn, autocommit=True) as conn:
                sessions_after = count_sessions(conn)
        finally:
            sup.send_signal(signal.SIGTERM)
            try:
                _, err = sup.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                sup.kill()
                _, err = sup.communicate()
        if sup.returncode not in (0, -signal.SIGTERM):
            tail = err.decode(errors="replace").strip().splitlines()[-3:]
            raise RuntimeError(f"supervise exited {sup.returncode}: {' | '.join(tail)}")
        return Rest(fresh, after, (sessions_fresh, sessions_after))


def count_sessions(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND pid <> pg_backend_pid()"
    ).fetchone()
    return int(row[0]) if row else 0


# -- the run -------------------------------------------------------------------------------------


def main() -> None:
    global SLEEP
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dsn", default=DEFAULT_DSN, help="an admin DSN; a bench database is made")
    ap.add_argument("--jobs", type=int, default=4000, help="IO-bound jobs per run")
    ap.add_argument("--noop-jobs", type=int, default=10000, help="no-op jobs per run")
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=10, help="runs in flight per process")
    ap.add_argument("--sleep", type=float, default=0.05, help="the IO-bound handler's await (s)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--quick", action="store_true", help="2,000 IO jobs, 3,000 no-op jobs, 2 repeats"
    )
    ap.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"which to run, comma-separated (default: all of {','.join(SECTIONS)})",
    )
    results_arg(ap)
    args = ap.parse_args()
    sections = [x.strip() for x in args.sections.split(",") if x.strip()]
    unknown = [x for x in sections if x not in SECTIONS]
    if unknown or not sections:
        ap.error(f"--sections: {','.join(unknown) or 'none given'}: valid are {','.join(SECTIONS)}")
    for name in ("jobs", "noop_jobs", "procs", "concurrency", "repeat"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not 0 < args.sleep <= 10:
        ap.error(f"--sleep must be in (0, 10] seconds, got {args.sleep}")
    if args.quick:
        args.jobs, args.noop_jobs = min(args.jobs, 2000), min(args.noop_jobs, 3000)
        args.repeat = min(args.repeat, 2)
    SLEEP = args.sleep
    print(f"machine load (1, 5, 15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    name = "leasework_bench_async"
    dsn = bench_database(args.dsn, name)
    try:
        for i, section in enumerate(sections):
            if i:
                print()
            SECTIONS[section](dsn, args)
    finally:
        drop_database(args.dsn, name)
    print(f"machine load at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def skipped(
    args: argparse.Namespace, targets: list[tuple[int, str, float | None, str]], why: str
) -> None:
    """Leasework's figures could not be measured: each target recorded as skipped, with the
    peer's or the ideal's figure beside it when there is one."""
    print(f"leasework async: skipped: {why}")
    for target, label, base, base_label in targets:
        record(
            args.results, target, label, 0.0, "", baseline=base, baseline_label=base_label,
            issue=16, skipped=why, short=args.quick,
        )  # fmt: skip


def io_section(dsn: str, args: argparse.Namespace) -> None:
    c, procs = args.concurrency, args.procs
    ideal = procs * c / args.sleep
    lw_label = f"leasework async, concurrency {c}"
    pro_label = f"Procrastinate, concurrency {c}, pool {c + 1}"
    pgq_label = f"PGQueuer asyncpg, max_concurrent_tasks {c}, batch {max(1, c // 2)}"
    systems = [
        System(pro_label, "procrastinate",
               partial(pro_setup, tenants=0, make_app=partial(pro_io_app, c), task_name="io"),
               partial(pro_io_worker, c), True),
        System(pgq_label, "pgqueuer", partial(pgq_setup, tenants=0, entrypoint="io"),
               partial(pgq_io_worker, c), True),
    ]  # fmt: skip
    why = ""
    try:
        app = async_app("io", lw_io, c)
        systems.insert(
            0,
            System(lw_label, "leasework", partial(lw_setup, tenants=0, kind="io"),
                   partial(lw_run, app), False),
        )  # fmt: skip
    except Skip as exc:
        why = str(exc)
    limit = max(120.0, 20 * args.jobs / ideal)
    results = interleaved(systems, dsn, args.jobs, procs, args.repeat, limit)
    print(
        f"IO-bound runs (await asyncio.sleep({args.sleep:g})): {args.jobs:,} jobs, {procs}"
        f" processes x {c} in flight, {args.repeat} runs each, interleaved; ideal"
        f" {procs} x {c} / {args.sleep:g} s = {ideal:,.0f} jobs/s"
    )
    lw = med(rates(results[lw_label])) if lw_label in results else None
    rows = []
    for label, runs in results.items():
        m = med(rates(runs))
        target = ""
        if label == lw_label:
            target = "≥ 1.0 x each peer, ≥ 0.80 x ideal"
        rows.append(
            [label, f"{m:,.0f}", spread(rates(runs)), f"{m / ideal:.2f}",
             "" if lw is None else f"{lw / m:.2f}", target, *cost_cells(runs)]
        )  # fmt: skip
    print_table(
        ["system", "jobs/s (median)", "range", "x ideal", "leasework x it", "target",
         *COST_HEADERS],
        rows,
    )  # fmt: skip
    print_timelines([lw_label])
    scale = f"{args.jobs:,} jobs, {procs} x {c}, {args.repeat} runs"
    ideal_label = f"ideal {procs} x {c} / {args.sleep:g} s"
    # (target, label, baseline, its label, the baseline's range, target ratio, target's name)
    targets = [
        (1, f"IO-bound vs Procrastinate ({scale})", med(rates(results[pro_label])), pro_label,
         spread(rates(results[pro_label])), 1.0, "Procrastinate"),
        (2, f"IO-bound vs PGQueuer ({scale})", med(rates(results[pgq_label])), pgq_label,
         spread(rates(results[pgq_label])), 1.0, "PGQueuer"),
        (3, f"IO-bound vs the ideal ({scale})", ideal, ideal_label, "", 0.8, "ideal"),
    ]  # fmt: skip
    if lw is None:
        skipped(args, [(t, label, base, bl) for t, label, base, bl, *_ in targets], why)
        return
    lw_range = spread(rates(results[lw_label]))
    for target, label, base, base_label, base_range, limit, name in targets:
        record(
            args.results, target, label, lw, "jobs/s", baseline=base, baseline_label=base_label,
            ratio=lw / base, target_text=f"≥ {limit:.2f} x {name}", met=lw / base >= limit,
            short=args.quick, issue=16,
            notes=f"ranges: leasework {lw_range}" + (f", {name} {base_range}" if base_range else ""),
        )  # fmt: skip


def noop_section(dsn: str, args: argparse.Namespace) -> None:
    c, procs = args.concurrency, args.procs
    sync_label, async_label = "leasework sync, one at a time", f"leasework async, concurrency {c}"
    label = f"no-op async vs sync ({args.noop_jobs:,} jobs, {procs} procs, {args.repeat} runs)"
    try:
        app = async_app("noop_async", lw_noop_async, c)
    except Skip as exc:
        skipped(args, [(4, label, None, "")], str(exc))
        return
    systems = [
        System(sync_label, "leasework", partial(lw_setup, tenants=0, kind="noop"),
               partial(lw_run, sync_app("noop")), False),
        System(async_label, "leasework", partial(lw_setup, tenants=0, kind="noop_async"),
               partial(lw_run, app), False),
    ]  # fmt: skip
    results = interleaved(systems, dsn, args.noop_jobs, procs, args.repeat, 600.0)
    sync = med(rates(results[sync_label]))
    print(
        f"no-op runs: {args.noop_jobs:,} jobs, {procs} processes, {args.repeat} runs each,"
        " interleaved"
    )
    rows = []
    for lbl, runs in results.items():
        m = med(rates(runs))
        target = "≥ 0.80 x sync" if lbl == async_label else ""
        rows.append(
            [lbl, f"{m:,.0f}", spread(rates(runs)), f"{m / sync:.2f}", target, *cost_cells(runs)]
        )
    print_table(["leasework", "jobs/s (median)", "range", "x sync", "target", *COST_HEADERS], rows)
    print_timelines([sync_label, async_label])
    a = rates(results[async_label])
    ca, cs = cost_cells(results[async_label]), cost_cells(results[sync_label])
    record(
        args.results, 4, label, med(a), "jobs/s", baseline=sync, baseline_label=sync_label,
        ratio=med(a) / sync, target_text="≥ 0.80 x sync one at a time",
        met=med(a) / sync >= 0.8, short=args.quick, issue=16,
        notes=f"ranges: async {spread(a)}, sync {spread(rates(results[sync_label]))};"
        f" per job async {ca[0]} commits, {ca[2]} µs client, {ca[3]} µs backend;"
        f" sync {cs[0]} commits, {cs[2]} µs client, {cs[3]} µs backend",
    )  # fmt: skip


def rest_section(dsn: str, args: argparse.Namespace) -> None:
    procs, burst, rest = args.procs, 200, 3.0
    fresh_label = f"async child at rest after start-up (largest of {procs})"
    after_label = f"async child at rest, its pool open after {burst} runs (largest of {procs})"
    try:
        async_app("io", lw_io, args.concurrency)
    except Skip as exc:
        skipped(args, [(5, fresh_label, None, ""), (5, after_label, None, "")], str(exc))
        return
    with psycopg.connect(dsn, autocommit=True) as conn:
        db.migrate(conn)
    sync = at_rest(dsn, "abench_app:sync_app", "noop", procs, burst, rest)
    asy = at_rest(dsn, "abench_app:app", "io_db", procs, burst, rest)
    mib = 1024.0
    print(f"memory at rest: `leasework supervise --processes {procs}`, VmRSS of each child")
    print_table(
        ["children", "after start-up MiB", f"after {burst} runs MiB", "sessions", "target"],
        [
            ["sync kind (context)", " / ".join(f"{k / mib:.1f}" for k in sync.fresh),
             " / ".join(f"{k / mib:.1f}" for k in sync.after),
             f"{sync.sessions[0]} -> {sync.sessions[1]}", ""],
            [f"async kinds, concurrency {args.concurrency}, ctx.connection()",
             " / ".join(f"{k / mib:.1f}" for k in asy.fresh),
             " / ".join(f"{k / mib:.1f}" for k in asy.after),
             f"{asy.sessions[0]} -> {asy.sessions[1]}", "≤ 40 MiB"],
        ],
    )  # fmt: skip
    for label, values, base in [
        (fresh_label, asy.fresh, sync.fresh),
        (after_label, asy.after or [0], sync.after or [0]),
    ]:
        top, base_top = max(values) / mib, max(base) / mib
        record(
            args.results, 5, label, top, "MiB", baseline=base_top,
            baseline_label="sync child, same invocation", ratio=top / base_top if base_top else None,
            target_text="≤ 40 MiB", met=top <= 40.0, issue=16,
            notes="VmRSS MiB, async: " + ", ".join(f"{k / mib:.1f}" for k in values)
            + "; sync: " + ", ".join(f"{k / mib:.1f}" for k in base),
        )  # fmt: skip


SECTIONS: dict[str, Callable[[str, argparse.Namespace], None]] = {
    "io": io_section,
    "noop": noop_section,
    "rest": rest_section,
}

if __name__ == "__main__":
    main()
