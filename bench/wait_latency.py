"""Seal-to-return latency of `handle.wait()`: from the commit of a run's seal to the moment the
waiter has its result. The waiter enqueues a run, commits, and waits on its own connection (a
thread of this process); a second thread, playing the worker, claims the run beforehand and seals
it once the wait is in place (a pause of --gap after the wait started, so the seal always comes
after the wait's LISTEN and first read). Rows: a direct connection (woken by the run's NOTIFY: the
issue's target is 50 ms) and the pooler fallback (the same connection taken for a pooled one:
polling every 50 ms growing to 1 s). Prints p50/p95/max in ms; asserts nothing.

    .venv/bin/python bench/wait_latency.py [--dsn DSN] [--samples 200] [--gap 0.05] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any

import psycopg
from common import DEFAULT_DSN, bench_database, drop_database, print_table

from leasework import App, db
from leasework.leases import lease

bench_app = App()


@bench_app.task("report")
def report(ctx: Any, payload: Any) -> None:
    return None


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def one(dsn: str, waiter: psycopg.Connection[Any], sealer: psycopg.Connection[Any], gap: float) -> float:
    """One run: enqueued and claimed, waited for, sealed; seconds from seal commit to return."""
    handle = bench_app.enqueue_run(waiter, "report", {"n": 1})
    waiter.commit()
    [claim] = lease.claim_runs(sealer, ["report"], worker="bench", lease=60.0)
    sealed: list[float] = []

    def seal() -> None:
        time.sleep(gap)  # the wait is in place by then (a bench may pause; a test may not)
        assert lease.finish(sealer, claim, "succeeded", result={"rows": 42})
        sealed.append(time.perf_counter())

    t = threading.Thread(target=seal)
    t.start()
    result = handle.wait(timeout=30)
    returned = time.perf_counter()
    t.join()
    assert result == {"rows": 42}, result
    return returned - sealed[0]


def series(dsn: str, samples: int, gap: float, pooled: bool) -> list[float]:
    with (
        psycopg.connect(dsn) as waiter,
        psycopg.connect(dsn, autocommit=True) as sealer,
    ):
        if pooled:
            waiter.prepare_threshold = None  # what leasework does with a pooled connection
        for _ in range(5):  # warm-up
            one(dsn, waiter, sealer, gap)
        return [one(dsn, waiter, sealer, gap) for _ in range(samples)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dsn", default=DEFAULT_DSN, help="an admin DSN; a bench database is made")
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--gap", type=float, default=0.05, help="seconds from wait to seal")
    ap.add_argument("--quick", action="store_true", help="40 samples")
    args = ap.parse_args()
    samples = 40 if args.quick else args.samples
    name = "leasework_bench_wait"
    dsn = bench_database(args.dsn, name)
    try:
        with db.connect(dsn) as conn:
            db.migrate(conn)
        rows = []
        for label, pooled in (("direct (NOTIFY)", False), ("pooler fallback (polling)", True)):
            ms = [s * 1000 for s in series(dsn, samples, args.gap, pooled)]
            rows.append(
                [
                    label,
                    str(len(ms)),
                    f"{statistics.median(ms):.1f}",
                    f"{pct(ms, 0.95):.1f}",
                    f"{max(ms):.1f}",
                ]
            )
        print(f"handle.wait(): seal commit to return, ms ({samples} runs each, gap {args.gap} s)")
        print_table(["connection", "runs", "p50", "p95", "max"], rows)
    finally:
        drop_database(args.dsn, name)


if __name__ == "__main__":
    main()
