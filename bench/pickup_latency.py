"""Pickup latency of an idle worker woken by NOTIFY: time from the enqueueing transaction to the
claim, in database time (started_at - created_at), for a raw LISTEN/NOTIFY loop, for
`leasework supervise` with its defaults (2 processes, 2 s poll, woken by the enqueue's NOTIFY:
what users deploy, the headline) and for a bare leasework worker (`Worker.run` in one process: a
breakdown row). Jobs arrive one at a time with a pause between, so each finds the workers idle.
Prints p50/p95, medians and ranges over the repeats; asserts nothing.

    .venv/bin/python bench/pickup_latency.py [--dsn DSN] [--samples 200] [--repeat 3] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import signal
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
from common import (
    DEFAULT_DSN,
    bench_database,
    drop_database,
    med,
    print_table,
    raw_drain,
    raw_table,
    record,
    results_arg,
    spread,
    supervised,
)

from leasework import App, Config, db
from leasework.workers.worker import Worker


def raw_listener(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("LISTEN bench_raw")
        while True:
            for _ in conn.notifies(timeout=2.0, stop_after=1):
                break
            raw_drain(conn)


bench_app = App()


@bench_app.task("noop")
def noop(ctx: Any, payload: Any) -> None:
    return None


def lw_listener(dsn: str) -> None:
    cfg = Config(dsn=dsn)  # the defaults: 2 s poll, NOTIFY wake-up
    Worker(bench_app.with_config(cfg), cfg, register=False).run()


SUPERVISED_APP = """
from leasework import App

app = App()


@app.task("noop")
def noop(ctx, payload):
    return None
"""


@contextlib.contextmanager
def listening(admin_dsn: str, dsn: str, system: str) -> Iterator[None]:
    """The listener of `system` running, idle, until the block ends."""
    if system == "supervise":
        with (
            tempfile.TemporaryDirectory() as tmp,
            psycopg.connect(admin_dsn, autocommit=True) as admin,
        ):
            (Path(tmp) / "pickup_app.py").write_text(SUPERVISED_APP)
            with supervised(admin, dsn, Path(tmp), "pickup_app:app", 2):
                time.sleep(1.0)  # booted; now idle
                yield
        return
    target = raw_listener if system == "raw" else lw_listener
    proc = mp.get_context("fork").Process(target=target, args=(dsn,), daemon=True)
    proc.start()
    try:
        time.sleep(1.0)  # the listener is up and idle
        yield
    finally:
        if proc.pid is not None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(5)


def percentiles(ms: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(ms, n=100, method="inclusive")
    return q[49], q[94]


def measure(admin_dsn: str, dsn: str, system: str, samples: int, gap: float) -> tuple[float, float]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        if system == "raw":
            raw_table(conn)
        else:
            db.migrate(conn)
            conn.execute("TRUNCATE leasework.runs, leasework.tenants, leasework.workers")
    with listening(admin_dsn, dsn, system), psycopg.connect(dsn, autocommit=True) as conn:
        for _ in range(samples):
            with conn.transaction():
                if system == "raw":
                    conn.execute("INSERT INTO bench_raw_jobs DEFAULT VALUES")
                    conn.execute("SELECT pg_notify('bench_raw', '')")
                else:
                    bench_app.enqueue(conn, "noop", {})
            time.sleep(gap)
        table = "bench_raw_jobs" if system == "raw" else "leasework.runs"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            row = conn.execute(f"SELECT count(*) FROM {table} WHERE started_at IS NULL").fetchone()
            if row is not None and row[0] == 0:
                break
            time.sleep(0.05)
        rows = conn.execute(
            f"SELECT extract(epoch FROM started_at - created_at) * 1000 FROM {table}"
        ).fetchall()
    return percentiles([float(r[0]) for r in rows])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dsn", default=DEFAULT_DSN, help="an admin DSN; a bench database is made")
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--gap", type=float, default=0.02, help="seconds between enqueues")
    ap.add_argument("--quick", action="store_true", help="60 samples, 2 repeats")
    results_arg(ap)
    args = ap.parse_args()
    if args.quick:
        args.samples, args.repeat = min(args.samples, 60), min(args.repeat, 2)
    name = "leasework_bench_pickup"
    dsn = bench_database(args.dsn, name)
    res: dict[str, list[tuple[float, float]]] = {"raw": [], "supervise": [], "leasework": []}
    try:
        for _ in range(args.repeat):
            for system in res:
                res[system].append(measure(args.dsn, dsn, system, args.samples, args.gap))
    finally:
        drop_database(args.dsn, name)
    base50 = med([p for p, _ in res["raw"]])
    base95 = med([p for _, p in res["raw"]])
    print(f"pickup latency: {args.samples} jobs one at a time, {args.repeat} runs each (ms)")
    rows = []
    for label, system, target in (
        ("raw LISTEN/NOTIFY loop", "raw", ""),
        ("leasework supervise (defaults)", "supervise", "≤ 1.2 / ≤ 2.0"),
        ("bare Worker.run, 1 process", "leasework", "breakdown"),
    ):
        p50 = [p for p, _ in res[system]]
        p95 = [p for _, p in res[system]]
        rows.append(
            [
                label,
                f"{med(p50):.2f}",
                spread(p50, ".2f"),
                f"{med(p95):.2f}",
                spread(p95, ".2f"),
                f"{med(p50) / base50:.2f} / {med(p95) / base95:.2f}",
                target,
            ]
        )
    print_table(["system", "p50", "range", "p95", "range", "x raw (p50/p95)", "target"], rows)
    scale = f"{args.samples} jobs, {args.repeat} runs"
    for system, what in (("supervise", "`leasework supervise`"), ("leasework", "breakdown: bare Worker.run")):
        for i, (q, base, limit) in enumerate([("p50", base50, 1.2), ("p95", base95, 2.0)]):
            lw = [p[i] for p in res[system]]
            headline = system == "supervise"
            record(
                args.results, 3, f"pickup latency {q}, {what} ({scale})", med(lw), "ms",
                baseline=base, baseline_label=f"raw LISTEN/NOTIFY {q}", ratio=med(lw) / base,
                target_text=f"≤ {limit:.1f} x raw" if headline else "breakdown (no target)",
                met=med(lw) / base <= limit if headline else None, short=args.quick,
                notes=f"{q} ranges: leasework {spread(lw, '.2f')},"
                f" raw {spread([p[i] for p in res['raw']], '.2f')} ms",
            )  # fmt: skip


if __name__ == "__main__":
    main()
