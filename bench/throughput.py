"""Throughput of no-op jobs one at a time: the raw psycopg loops (the fused one, which finishes a
job and claims the next in one statement, one commit per job: the limit; and the two-commit one,
claim then finish) against leasework's worker, in the same invocation, against the same server, in
a database of its own; with --batch N (default 100, 0 for none) also the raw loop claiming and
completing N at a time against a kind declared `batch=N`; and the fused loop and leasework with
one process each (--single-jobs, 0 for none). Beside every throughput, what a job
cost: commits, WAL bytes, client and backend CPU (common.Meter). Rounds are interleaved, the
order reversed every other round (common.rounds). Prints medians and ranges, and each ratio as
the median of the rounds' (common.paired), beside its target; asserts nothing.

    .venv/bin/python bench/throughput.py [--dsn DSN] [--jobs 20000] [--procs 2] [--repeat 5]
                                         [--single-jobs 10000] [--tenants 0] [--batch 100]
                                         [--batch-jobs 100000] [--quick]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import tempfile
import textwrap
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
from common import (
    COST_HEADERS,
    DEFAULT_DSN,
    Meter,
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
    raw_worker,
    record,
    results_arg,
    rounds,
    spread,
    supervised,
)

from leasework import App, Config, db
from leasework.workers.worker import Worker

bench_app = App()


@bench_app.task("noop")
def noop(ctx: Any, payload: Any) -> None:
    return None


def batch_app(batch: int) -> App:
    """The same no-op kind declared `batch=N`."""
    app = App()
    app.task("noop", batch=batch)(noop)
    return app


def lw_worker(dsn: str, app: App = bench_app) -> None:
    """The worker's own loop (`Worker.run` without the idle sleep): poll until a poll finds
    nothing, skipping idle stages between back-to-back polls as `run()` does."""
    cfg = Config(dsn=dsn, poll_interval=2.0)
    worker = Worker(app.with_config(cfg), cfg, register=False)
    worker.open()
    worker.running = True
    try:
        found = 0
        while True:
            found = worker.poll(skip_idle=found > 0)
            if found == 0:
                break
    finally:
        worker.close()


def lw_setup(dsn: str, jobs: int, tenants: int, kind: str = "noop") -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        db.migrate(conn)
        conn.execute("TRUNCATE leasework.runs, leasework.tenants, leasework.workers")
        if tenants:
            conn.execute(
                "INSERT INTO leasework.tenants (name) SELECT 't' || i FROM generate_series(1, %s) i",
                (tenants,),
            )
            conn.execute(
                'INSERT INTO leasework.runs (kind, payload, tenant, "group")'
                " SELECT %s, '{}', 't' || (i %% %s + 1), 'g' FROM generate_series(1, %s) i",
                (kind, tenants, jobs),
            )
        else:
            conn.execute(
                "INSERT INTO leasework.runs (kind, payload)"
                " SELECT %s, '{}' FROM generate_series(1, %s)",
                (kind, jobs),
            )
        conn.execute("VACUUM ANALYZE leasework.runs")


Setup = Callable[[str, int, int], None]

# The app `leasework supervise` runs: the same no-op kind, declared `batch=N` when the
# environment says so, `concurrency=N` async when it says that.
SUPERVISED_APP = textwrap.dedent(
    """
    import os

    from leasework import App

    app = App()
    batch = int(os.environ.get("THROUGHPUT_BATCH") or 0)
    concurrency = int(os.environ.get("THROUGHPUT_CONCURRENCY") or 0)


    def noop(ctx, payload):
        return None


    async def anoop(ctx, payload):
        return None


    if batch:
        app.task("noop", batch=batch)(noop)
    elif concurrency:
        app.task("noop", concurrency=concurrency)(anoop)
    else:
        app.task("noop")(noop)
    """
)


def lw_supervised(
    admin_dsn: str, dsn: str, jobs: int, procs: int, *, batch: int = 0, concurrency: int = 0,
    log_level: str | None = None,
) -> Run:  # fmt: skip
    """`leasework supervise --processes` default (2) with its default settings, as README deploys
    it: booted first, then `jobs` runs enqueued in one INSERT (and a NOTIFY, as enqueue sends);
    jobs per second from the first run's start to the last run's finish (started_at and
    finished_at: database time), and what each job cost, the supervisor's boot included."""
    assert procs == 2, "supervise's default is 2 processes"
    lw_setup(dsn, 0, 0)
    env = {"THROUGHPUT_BATCH": str(batch), "THROUGHPUT_CONCURRENCY": str(concurrency)}
    meter = Meter(dsn)
    with (
        tempfile.TemporaryDirectory() as tmp_dir,
        psycopg.connect(admin_dsn, autocommit=True) as admin,
        psycopg.connect(dsn, autocommit=True) as conn,
    ):
        meter.ignore(conn.info.backend_pid)
        meter.ignore(admin.info.backend_pid)
        tmp = Path(tmp_dir)
        (tmp / "throughput_app.py").write_text(SUPERVISED_APP)
        meter.start()
        with supervised(admin, dsn, tmp, "throughput_app:app", procs, (), log_level, env):
            conn.execute(
                "INSERT INTO leasework.runs (kind, payload)"
                " SELECT 'noop', '{}' FROM generate_series(1, %s)",
                (jobs,),
            )
            conn.execute(f"NOTIFY {db.NOTIFY_CHANNEL}, 'noop'")
            deadline = time.monotonic() + 600
            while True:
                time.sleep(0.25)  # polling the drain; the figure is read from the table
                row = conn.execute(
                    "SELECT count(*) FROM leasework.runs WHERE status <> 'succeeded'"
                ).fetchone()
                if row is not None and row[0] == 0:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{row and row[0]} runs not done after 600 s")
            row = conn.execute(
                "SELECT count(*), extract(epoch FROM max(finished_at) - min(started_at))"
                "  FROM leasework.runs"
            ).fetchone()
        cost = meter.stop(jobs)
    assert row is not None and row[0] == jobs
    return Run(jobs / float(row[1]), cost)


def timed(
    setup: Setup, work: Callable[[str], None], dsn: str, jobs: int, procs: int, tenants: int = 0
) -> Run:
    """Jobs per second from the first process start to the last process exit, and what each job
    cost (common.Meter)."""
    setup(dsn, jobs, tenants)
    meter = Meter(dsn)
    meter.start()
    ctx = mp.get_context("fork")
    ps = [ctx.Process(target=work, args=(dsn,)) for _ in range(procs)]
    start = time.perf_counter()
    for p in ps:
        p.start()
    for p in ps:
        p.join()
    elapsed = time.perf_counter() - start
    if any(p.exitcode for p in ps):
        raise RuntimeError(f"a worker process failed: {[p.exitcode for p in ps]}")
    return Run(jobs / elapsed, meter.stop(jobs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dsn", default=DEFAULT_DSN, help="an admin DSN; a bench database is made")
    ap.add_argument("--jobs", type=int, default=20000)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument(
        "--tenants", type=int, default=0, help="also run with runs spread over N tenants"
    )
    ap.add_argument(
        "--batch", type=int, default=100, help="also raw and leasework batched by N (0: not)"
    )
    ap.add_argument(
        "--batch-jobs",
        type=int,
        default=100000,
        help="jobs of the batched runs: 20,000 take well under a second batched, of which a"
        " worker's start (connections, the first poll) would be a tenth",
    )
    ap.add_argument("--quick", action="store_true", help="5,000 jobs, 3 repeats")
    ap.add_argument(
        "--log-level", help="`leasework supervise`'s log_level (default: its default setting)"
    )
    ap.add_argument(
        "--concurrency",
        type=int,
        default=10,
        help="also `leasework supervise` with an async no-op handler, concurrency=N (0: not)",
    )
    ap.add_argument(
        "--private",
        action="store_true",
        help="on a private cluster (bench/cluster.py; fsync off): exact WAL and commits per job",
    )
    ap.add_argument(
        "--single-jobs",
        type=int,
        default=10000,
        help="jobs of the one-process pair (the fused loop and leasework one at a time, one"
        " process each), printed beside the 2-process figures (0: not run)",
    )
    results_arg(ap)
    args = ap.parse_args()
    if args.quick:
        args.jobs, args.repeat = min(args.jobs, 5000), min(args.repeat, 3)
        args.batch_jobs = min(args.batch_jobs, 25000)
        args.single_jobs = min(args.single_jobs, 3000)
    if args.private:
        # Exact WAL and commit figures: nothing else writes to this server. Its fsync is off
        # (bench/cluster.py), so a commit costs less than on a real server: read its costs per
        # job, not its throughput.
        from cluster import private_server

        with private_server() as admin:
            args.dsn, args.results = admin, None  # not make bench's figures
            run(args)
    else:
        run(args)


def run(args: argparse.Namespace) -> None:
    name = "leasework_bench_throughput"
    dsn = bench_database(args.dsn, name)
    # Each comparison's two systems next to each other: they run back to back in every round.
    # Each: its label, set-up, worker, tenants, jobs and processes.
    jobs, procs = args.jobs, args.procs
    # A supervised variant's "set-up" is None: lw_supervised does all of it.
    variants: list[tuple[str, Setup | None, Callable[[str], Any], int, int, int]] = [
        (RAW_TWO, raw_setup, raw_worker, 0, jobs, procs),
        (RAW_FUSED, raw_setup, raw_fused_worker, 0, jobs, procs),
        (LW_SUP, None, partial(lw_supervised, args.dsn, log_level=args.log_level), 0, jobs, procs),
        (LW_ONE, lw_setup, lw_worker, 0, jobs, procs),
    ]
    if args.concurrency:
        sup_async = partial(
            lw_supervised, args.dsn, concurrency=args.concurrency, log_level=args.log_level
        )
        variants.append((LW_SUP_ASYNC, None, sup_async, 0, jobs, procs))
    if args.single_jobs:
        variants.append((RAW_FUSED_1, raw_setup, raw_fused_worker, 0, args.single_jobs, 1))
        variants.append((LW_ONE_1, lw_setup, lw_worker, 0, args.single_jobs, 1))
    if args.tenants:
        lw_tenants = f"leasework, {args.tenants:,} tenants"
        variants.append((lw_tenants, lw_setup, lw_worker, args.tenants, jobs, procs))
    raw_batched, lw_batched = f"raw batched ({args.batch})", f"bare loop batch={args.batch}"
    sup_batched = f"leasework supervise batch={args.batch}"
    if args.batch:
        raw_b, lw_b = partial(raw_batch_worker, args.batch), partial(lw_worker, app=batch_app(args.batch))
        sup_b = partial(lw_supervised, args.dsn, batch=args.batch, log_level=args.log_level)
        variants.append((raw_batched, raw_setup, raw_b, 0, args.batch_jobs, procs))
        variants.append((sup_batched, None, sup_b, 0, args.batch_jobs, procs))
        variants.append((lw_batched, lw_setup, lw_b, 0, args.batch_jobs, procs))
    by_label = {v[0]: v[1:] for v in variants}

    def one(label: str) -> Run:
        setup, work, tenants, n, processes = by_label[label]
        if setup is None:
            run: Run = work(dsn, n, processes)
            return run
        return timed(setup, work, dsn, n, processes, tenants)

    try:
        results = rounds(list(by_label), args.repeat, one)
    finally:
        drop_database(args.dsn, name)
    report(results, args, raw_batched if args.batch else None, lw_batched)


# The one-at-a-time limit (one statement and one commit per job), the older two-commit loop, and
# leasework one at a time: the labels the table, the results and peers.py share. The headline is
# `leasework supervise` as deployed; the bare Worker loop is a breakdown row (what the supervisor
# costs: its difference).
RAW_FUSED = "raw fused (finish + claim, 1 commit)"
RAW_TWO = "raw claim, then finish (2 commits)"
LW_SUP = "leasework supervise (defaults)"
LW_SUP_ASYNC = "leasework supervise, async handler"
LW_ONE = "bare Worker loop (no supervisor)"
# The same two with one process each (--single-jobs): no second worker to take turns with.
RAW_FUSED_1 = "raw fused, 1 process"
LW_ONE_1 = "bare Worker loop, 1 process"


def rates(runs: list[Run]) -> list[float]:
    return [r.rate for r in runs]


def report(
    results: dict[str, list[Run]],
    args: argparse.Namespace,
    raw_batched: str | None,
    lw_batched: str,
) -> None:
    """The table (throughput and each job's cost) and the results channel's records. Ratios are
    paired (common.paired): the median of each round's ratio, the runs of a round back to back."""
    fused_runs = results[RAW_FUSED]
    fused = med(rates(fused_runs))
    single = f", {args.single_jobs:,} with 1 process" if args.single_jobs else ""
    sup_batched = f"leasework supervise batch={args.batch}"
    level = f"log_level {args.log_level}" if args.log_level else "its default settings"
    print(
        f"throughput: {args.jobs:,} no-op jobs ({args.batch_jobs:,} batched{single}), {args.procs}"
        f" processes, {args.repeat} runs each, interleaved, the order reversed every other round;"
        f" `leasework supervise` with {level} (async: concurrency={args.concurrency}), timed"
        " from the first run's start to the last's finish; the rest from the first process"
        " start to the last exit; ratios: the median of each round's; per job: medians (commits"
        " and WAL include autovacuum's; WAL is the whole server's; supervise's include its boot)"
    )
    rows = []
    for label, runs in results.items():
        values = rates(runs)
        target = {LW_SUP: "≥ 0.80", LW_ONE: "breakdown"}.get(label, "")
        ratio = f"{paired(runs, fused_runs):.2f}"
        if label in (RAW_FUSED_1, LW_ONE_1):  # against the fused loop with one process too
            ratio = f"{paired(runs, results[RAW_FUSED_1]):.2f}"
        if raw_batched and label in (lw_batched, sup_batched):
            target = f"≥ 0.60 x {raw_batched}" if label == sup_batched else "breakdown"
            ratio += f" ({paired(runs, results[raw_batched]):.2f} x batched)"
        rows.append(
            [label, f"{med(values):,.0f}", spread(values), ratio, target, *cost_cells(runs)]
        )
    print_table(["system", "jobs/s (median)", "range", "x fused", "target", *COST_HEADERS], rows)
    scale = f"{args.jobs:,} jobs, {args.procs} procs, {args.repeat} runs"
    batch_scale = f"{args.batch_jobs:,} jobs, {args.procs} procs, {args.repeat} runs"
    fused_cost = cost_cells(fused_runs)
    for label, target, kind in [
        (LW_SUP, 1, "one-at-a-time, `leasework supervise` (defaults)"),
        (LW_ONE, None, "breakdown: one-at-a-time, bare Worker loop"),
    ]:
        lw = rates(results[label])
        one = paired(results[label], fused_runs)
        cost = cost_cells(results[label])
        record(
            args.results, target or 1, f"{kind} ({scale})", med(lw), "jobs/s",
            baseline=fused, baseline_label="raw fused loop (1 commit per job)", ratio=one,
            target_text="≥ 0.80 x raw fused" if target else "breakdown (no target)",
            met=one >= 0.8 if target else None, short=args.quick,
            notes=f"ratio: median of the rounds' (ratio of the medians {med(lw) / fused:.2f});"
            f" ranges: leasework {spread(lw)}, raw fused {spread(rates(fused_runs))};"
            f" x two-commit raw {paired(results[label], results[RAW_TWO]):.2f};"
            f" per job leasework {cost[0]} commits, {cost[1]} B WAL, {cost[2]} µs client CPU;"
            f" raw fused {fused_cost[0]} commits, {fused_cost[1]} B WAL",
        )  # fmt: skip
    if args.concurrency:
        lwa = rates(results[LW_SUP_ASYNC])
        record(
            args.results, 1, f"async handler, concurrency={args.concurrency}, `leasework"
            f" supervise` ({scale})", med(lwa), "jobs/s", baseline=fused,
            baseline_label="raw fused loop (1 commit per job)",
            ratio=paired(results[LW_SUP_ASYNC], fused_runs),
            target_text="context (beside the sync figure)", met=None, short=args.quick,
            notes=f"ranges: leasework {spread(lwa)}",
        )  # fmt: skip
    if args.single_jobs:
        lw1, fused1 = rates(results[LW_ONE_1]), rates(results[RAW_FUSED_1])
        single_ratio = paired(results[LW_ONE_1], results[RAW_FUSED_1])
        c1, f1 = cost_cells(results[LW_ONE_1]), cost_cells(results[RAW_FUSED_1])
        record(
            args.results, 1,
            f"breakdown: bare Worker loop, 1 process ({args.single_jobs:,} jobs, {args.repeat} runs)",
            med(lw1), "jobs/s", baseline=med(fused1),
            baseline_label="raw fused loop, 1 process", ratio=single_ratio,
            target_text="breakdown (no target)", met=None, short=args.quick,
            notes=f"ratio: median of the rounds' (ratio of the medians {med(lw1) / med(fused1):.2f});"
            f" ranges: leasework {spread(lw1)}, raw fused {spread(fused1)};"
            f" per job leasework {c1[0]} commits, {c1[1]} B WAL; raw fused {f1[0]} commits,"
            f" {f1[1]} B WAL",
        )  # fmt: skip
    if raw_batched:
        rawb = rates(results[raw_batched])
        rb = cost_cells(results[raw_batched])
        for label, target in [(sup_batched, True), (lw_batched, False)]:
            lwb = rates(results[label])
            batched = paired(results[label], results[raw_batched])
            cb = cost_cells(results[label])
            record(
                args.results, 2,
                f"{'' if target else 'breakdown: bare loop '}batch={args.batch} ({batch_scale})",
                med(lwb), "jobs/s", baseline=med(rawb), baseline_label=raw_batched,
                ratio=batched,
                target_text="≥ 0.60 x raw batched" if target else "breakdown (no target)",
                met=batched >= 0.6 if target else None, short=args.quick,
                notes=f"ratio: median of the rounds' (ratio of the medians"
                f" {med(lwb) / med(rawb):.2f}); ranges: leasework {spread(lwb)}, raw"
                f" {spread(rawb)}; per job leasework {cb[0]} commits, {cb[1]} B WAL; raw {rb[0]}"
                f" commits, {rb[1]} B WAL",
            )  # fmt: skip


if __name__ == "__main__":
    main()
