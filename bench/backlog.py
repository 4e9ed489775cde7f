"""Work a worker cannot take must not slow the work it can (issue 29): `leasework supervise` (its
defaults: 2 processes) drains runs of a no-op task with and without a backlog of 1,000,000 queued
runs it may not claim, in the same invocation, on a database of its own. Prints each case beside
the same drain with no backlog, the ratio and the target; asserts nothing.

Each case's backlog is loaded with one INSERT ... SELECT generate_series, then vacuumed and
analyzed; the measured drain is --runs runs of kind `noop` enqueued after it (for (c): spread
over 50 other tenants), timed from the first start to the last finish (started_at and
finished_at of leasework.runs). The same supervisor, with the same settings, drains the same runs
with no backlog before the backlog is loaded and (with --repeat 2 or more) after it is removed
again, so drift during the case favours neither. A drain still unfinished after --drain-timeout
seconds is stopped there: its rate is that of the runs it finished, marked `(partial)`.

- (a) paused: runs of kind `bulk`, paused with `leasework pause bulk`;
- (b) other pool: runs of kind `bulk`, which only another pool serves (this host runs
  `--pool web:2:noop`; the `bulk` pool's host is not running, so its runs stay queued);
- (c) blocked tenant: runs of tenant `big` in one group, held back by one exclusive run of `big`
  that holds a live lease (a row leased for an hour by a worker on another host);
- (d) delayed: runs of kind `noop` due in an hour;
- (e) unserved kind: runs of kind `orphan`, which no worker declares;
- (g) full group: runs of tenant `big` in one group, held back by one run of `big` in that group
  (not exclusive) that holds a live lease: (c) with the limiter's other hold (a group runs one
  at a time unless its kind sets group_limit); the measured runs spread over 50 other tenants;
- fairness: tenant `big` with --fair-backlog (100,000) queued runs being drained, then one run
  each for 50 small tenants: for each, the claims made between its enqueue and its start (its
  own included) and the seconds it waited;
- fairness without a tenant (`fairu`): the same with the backlog's runs enqueued without a tenant
  (they take turns as one more participant; a worker kept busy by them sees the small tenants'
  runs at its next probe, at most 250 ms late, so this case is read in seconds);
- (f) a held snapshot (--snapshot, or `--cases f`; `make bench-long`): on a private cluster
  (bench/cluster.py: autovacuum on, as on a default server; the development machine's shared
  server runs with it off), --offer runs/s (400) are offered to the supervisor; after a warm-up a
  REPEATABLE READ transaction in the same database holds its snapshot for --hold seconds (300),
  then commits. Beside it the same run with no transaction held. Prints the completion rate
  during the hold against the offered rate, the largest queue, and how long after the release
  the queue was back to its warm-up level.

    .venv/bin/python bench/backlog.py [--dsn DSN] [--backlog 1000000] [--runs 5000]
                                      [--repeat 2] [--drain-timeout 60] [--cases a,b,c,d,e,g,fair,fairu]
                                      [--fair-backlog 100000] [--snapshot] [--offer 400]
                                      [--hold 300] [--log-level LEVEL] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from cluster import private_server
from common import (
    DEFAULT_DSN,
    bench_database,
    drop_database,
    med,
    print_table,
    record,
    results_arg,
    spread,
    supervised,
)

from leasework import db

Conn = psycopg.Connection[Any]

APP = textwrap.dedent(
    """
    from leasework import App

    app = App()


    @app.task("noop")
    def noop(ctx, payload):
        return None


    @app.task("bulk")
    def bulk(ctx, payload):
        return None
    """
)
PROCESSES = 2  # supervise's default
SMALL_TENANTS = 50
FLAT_TARGET = 0.8  # (a)-(e), (g): x the drain with no backlog
FAIR_TARGET = 100  # claims
SNAPSHOT_TARGET = 0.9  # x the offered rate
DRAIN_TARGET = 30.0  # seconds after the release


@dataclass(frozen=True)
class Case:
    key: str
    label: str
    backlog: str  # one INSERT ... SELECT generate_series(1, %(n)s)
    pools: tuple[str, ...] = ()  # supervise --pool specs
    pause: tuple[str, ...] = ()  # kinds paused (leasework pause) before the drains
    tenants: bool = False  # the measured runs spread over 50 tenants
    extra: str = ""  # run after the backlog is loaded (the blocking run of (c))
    before: str = ""  # run before it (the tenant row of (c), as an enqueue makes it first)


INSERT = 'INSERT INTO leasework.runs (kind, tenant, "group", queued_at)'
CASES = [
    Case(
        "a", "(a) paused kind",
        f"{INSERT} SELECT 'bulk', NULL, NULL, now() FROM generate_series(1, %(n)s)",
        pause=("bulk",),
    ),
    Case(
        "b", "(b) another pool's kind",
        f"{INSERT} SELECT 'bulk', NULL, NULL, now() FROM generate_series(1, %(n)s)",
        pools=("web:2:noop",),
    ),
    Case(
        "c", "(c) tenant blocked by its exclusive run",
        f"{INSERT} SELECT 'noop', 'big', 'g', now() FROM generate_series(1, %(n)s)",
        tenants=True,
        before="INSERT INTO leasework.tenants (name) VALUES ('big') ON CONFLICT DO NOTHING",
        extra="""
        INSERT INTO leasework.runs (kind, tenant, "group", exclusive, status, attempts,
                                    started_at, lease_owner, lease_expires_at, lease_worker)
        VALUES ('noop', 'big', 'g', true, 'running', 1, now(), gen_random_uuid(),
                now() + interval '1 hour', 'bench-other-host')
        """,
    ),
    Case(
        "d", "(d) delayed by an hour",
        f"{INSERT} SELECT 'noop', NULL, NULL, now() + interval '1 hour'"
        " FROM generate_series(1, %(n)s)",
    ),
    Case(
        "e", "(e) kind no worker serves",
        f"{INSERT} SELECT 'orphan', NULL, NULL, now() FROM generate_series(1, %(n)s)",
    ),
    Case(
        "g", "(g) tenant held back by its full group",
        f"{INSERT} SELECT 'noop', 'big', 'g', now() FROM generate_series(1, %(n)s)",
        tenants=True,
        before="INSERT INTO leasework.tenants (name) VALUES ('big') ON CONFLICT DO NOTHING",
        extra="""
        INSERT INTO leasework.runs (kind, tenant, "group", status, attempts,
                                    started_at, lease_owner, lease_expires_at, lease_worker)
        VALUES ('noop', 'big', 'g', 'running', 1, now(), gen_random_uuid(),
                now() + interval '1 hour', 'bench-other-host')
        """,
    ),
]  # fmt: skip


# -- the supervisor under test ---------------------------------------------------------------


@contextlib.contextmanager
def supervisor(
    admin: Conn, dsn: str, tmp: Path, pools: tuple[str, ...], log_level: str | None
) -> Iterator[subprocess.Popen[bytes]]:
    """`leasework supervise --app backlog_app:app` with its defaults (and `pools`)."""
    with supervised(admin, dsn, tmp, "backlog_app:app", PROCESSES, pools, log_level) as sup:
        yield sup


def leasework_cli(dsn: str, tmp: Path, *args: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp), *sys.path])}
    env.pop("LEASEWORK_CONFIG", None)
    subprocess.run(
        [sys.executable, "-m", "leasework", *args, "--app", "backlog_app:app", "--dsn", dsn],
        cwd=tmp, env=env, check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip


# -- one measured drain ------------------------------------------------------------------------


@dataclass(frozen=True)
class Drain:
    rate: float  # runs/s, first start to last finish
    done: int
    runs: int
    seconds: float

    @property
    def partial(self) -> bool:
        return self.done < self.runs


def last_id(conn: Conn) -> int:
    row = conn.execute("SELECT coalesce(max(id), 0) FROM leasework.runs").fetchone()
    return int(row[0]) if row else 0


def drain(conn: Conn, runs: int, tenants: bool, timeout: float) -> Drain:
    """Enqueue `runs` no-op runs (over 50 tenants when `tenants`) and wait until they have all
    succeeded, or `timeout` seconds; the rate of those that did. The rest are deleted (a worker
    still holding one finds its lease lost, as it should)."""
    conn.execute("VACUUM leasework.runs")  # every drain starts from a vacuumed table
    marker = last_id(conn)
    if tenants:
        conn.execute(
            "INSERT INTO leasework.tenants (name) SELECT 's' || i FROM generate_series(1, %s) i"
            " ON CONFLICT DO NOTHING",
            (SMALL_TENANTS,),
        )
        conn.execute(
            "INSERT INTO leasework.runs (kind, tenant)"
            " SELECT 'noop', 's' || (i %% %s + 1) FROM generate_series(1, %s) i",
            (SMALL_TENANTS, runs),
        )
    else:
        conn.execute(
            "INSERT INTO leasework.runs (kind) SELECT 'noop' FROM generate_series(1, %s)", (runs,)
        )
    conn.execute(f"NOTIFY {db.NOTIFY_CHANNEL}, 'noop'")
    deadline = time.monotonic() + timeout
    while True:
        row = conn.execute(
            "SELECT count(*) FILTER (WHERE status = 'succeeded'),"
            "       count(*) FILTER (WHERE status NOT IN ('queued', 'running', 'succeeded'))"
            "  FROM leasework.runs WHERE id > %s",
            (marker,),
        ).fetchone()
        assert row is not None
        if row[1]:
            raise RuntimeError(f"{row[1]} measured runs ended other than succeeded")
        if row[0] >= runs or time.monotonic() > deadline:
            break
        time.sleep(0.25)  # polling the drain; the figure is read from the table
    row = conn.execute(
        "SELECT count(*), extract(epoch FROM max(finished_at) - min(started_at))"
        "  FROM leasework.runs WHERE id > %s AND status = 'succeeded'",
        (marker,),
    ).fetchone()
    assert row is not None
    done, seconds = int(row[0]), float(row[1] or 0.0)
    conn.execute("DELETE FROM leasework.runs WHERE id > %s", (marker,))
    return Drain(done / seconds if seconds > 0 else 0.0, done, runs, seconds)


def fmt_rate(ds: list[Drain]) -> str:
    rates = [d.rate for d in ds]
    text = f"{med(rates):,.0f}" + (f" ({spread(rates)})" if len(rates) > 1 else "")
    if any(d.partial for d in ds):
        done = "/".join(f"{d.done:,}" for d in ds)
        text += f" (partial: {done} of {ds[0].runs:,})"
    return text


@dataclass
class CaseResult:
    case: Case
    baseline: list[Drain]
    backlog: list[Drain]
    loaded: float  # seconds the backlog's INSERT took
    touched: int = 0  # backlog runs no longer queued after the drains (should be 0)

    @property
    def ratio(self) -> float:
        base = med([d.rate for d in self.baseline])
        return med([d.rate for d in self.backlog]) / base if base else 0.0


def reset(conn: Conn) -> None:
    conn.execute("TRUNCATE leasework.runs, leasework.tenants, leasework.paused_kinds")
    conn.execute("VACUUM ANALYZE leasework.runs")


def run_case(
    admin: Conn, conn: Conn, dsn: str, tmp: Path, case: Case, args: argparse.Namespace
) -> CaseResult:
    reset(conn)
    for kind in case.pause:
        leasework_cli(dsn, tmp, "pause", kind)
    res = CaseResult(case, [], [], 0.0)
    with supervisor(admin, dsn, tmp, case.pools, args.log_level):
        # With no backlog, then with it, then (--repeat 2+) with none again: drift during the
        # case favours neither.
        for _ in range((args.repeat + 1) // 2):
            res.baseline.append(drain(conn, args.runs, case.tenants, args.drain_timeout))
            print(f"  {case.label}, no backlog: {res.baseline[-1].rate:,.0f} runs/s", flush=True)
        if case.before:
            conn.execute(case.before)
        started = time.perf_counter()
        conn.execute(case.backlog, {"n": args.backlog})
        res.loaded = time.perf_counter() - started
        if case.extra:
            conn.execute(case.extra)
        conn.execute("VACUUM ANALYZE leasework.runs")
        conn.execute("CHECKPOINT")  # not in the middle of a drain
        for _ in range(args.repeat):
            res.backlog.append(drain(conn, args.runs, case.tenants, args.drain_timeout))
            d = res.backlog[-1]
            print(
                f"  {case.label}, {args.backlog:,} queued: {d.rate:,.0f} runs/s"
                + (f" (partial: {d.done:,} of {d.runs:,})" if d.partial else ""),
                flush=True,
            )
        # The harness's own check: the backlog was out of the workers' reach throughout.
        row = conn.execute(
            "SELECT count(*) FROM leasework.runs WHERE status <> 'queued'"
            " AND lease_worker IS DISTINCT FROM 'bench-other-host'"
        ).fetchone()
        res.touched = int(row[0]) if row else 0
        conn.execute("TRUNCATE leasework.runs")
        conn.execute("VACUUM ANALYZE leasework.runs")
        for _ in range(args.repeat // 2):
            res.baseline.append(drain(conn, args.runs, case.tenants, args.drain_timeout))
            print(f"  {case.label}, no backlog: {res.baseline[-1].rate:,.0f} runs/s", flush=True)
    return res


# -- fairness ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Small:
    tenant: str
    claims: int | None  # claims from its enqueue to its start, its own included; None: not started
    seconds: float | None
    claims_so_far: int  # when not started: the claims made since its enqueue


def fairness(
    admin: Conn, conn: Conn, dsn: str, tmp: Path, args: argparse.Namespace, big: str | None = "big"
) -> list[Small]:
    """Tenant `big`'s backlog (`big` None: runs without a tenant) being drained, then one run each
    for 50 small tenants: when does each start?"""
    reset(conn)
    if big is not None:
        conn.execute("INSERT INTO leasework.tenants (name) VALUES (%s)", (big,))
    conn.execute(
        "INSERT INTO leasework.runs (kind, tenant) SELECT 'noop', %s"
        " FROM generate_series(1, %s)",
        (big, args.fair_backlog),
    )
    conn.execute("VACUUM ANALYZE leasework.runs")
    conn.execute("CHECKPOINT")
    with supervisor(admin, dsn, tmp, (), args.log_level):
        conn.execute(f"NOTIFY {db.NOTIFY_CHANNEL}, 'noop'")
        # Big's drain under way (a few hundred of its runs claimed) before the small ones come.
        deadline = time.monotonic() + 60
        while started_runs(conn) < 300 and time.monotonic() < deadline:
            time.sleep(0.2)
        marker = last_id(conn)
        conn.execute(
            "INSERT INTO leasework.tenants (name) SELECT 's' || i FROM generate_series(1, %s) i",
            (SMALL_TENANTS,),
        )
        conn.execute(
            "INSERT INTO leasework.runs (kind, tenant)"
            " SELECT 'noop', 's' || i FROM generate_series(1, %s) i",
            (SMALL_TENANTS,),
        )
        conn.execute(f"NOTIFY {db.NOTIFY_CHANNEL}, 'noop'")
        deadline = time.monotonic() + args.drain_timeout
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT count(*) FROM leasework.runs WHERE id > %s AND started_at IS NULL",
                (marker,),
            ).fetchone()
            if row is not None and row[0] == 0:
                break
            time.sleep(0.25)  # polling the start of the small runs
        rows = conn.execute(
            """
            SELECT s.tenant,
                   CASE WHEN s.started_at IS NOT NULL THEN
                       (SELECT count(*) FROM leasework.runs o
                         WHERE o.started_at >= s.created_at AND o.started_at <= s.started_at)
                   END,
                   extract(epoch FROM s.started_at - s.created_at),
                   (SELECT count(*) FROM leasework.runs o WHERE o.started_at >= s.created_at)
              FROM leasework.runs s WHERE s.id > %s ORDER BY s.id
            """,
            (marker,),
        ).fetchall()
    return [
        Small(str(r[0]), None if r[1] is None else int(r[1]),
              None if r[2] is None else float(r[2]), int(r[3]))
        for r in rows
    ]  # fmt: skip


def started_runs(conn: Conn) -> int:
    row = conn.execute(
        "SELECT count(*) FROM leasework.runs WHERE status IN ('running', 'succeeded')"
    ).fetchone()
    return int(row[0]) if row else 0


# -- (f) a held snapshot -----------------------------------------------------------------------


@dataclass
class Offered:
    held: bool
    samples: list[tuple[float, int, int]]  # (t since start, enqueued, queued + running)
    warm: float
    hold: float
    after: float
    autovacuum: str = ""

    def at(self, t: float) -> tuple[float, int, int]:
        """The first sample at or after `t`."""
        return next((s for s in self.samples if s[0] >= t), self.samples[-1])

    def rate(self, t0: float, t1: float) -> tuple[float, float]:
        """Offered and completed runs/s between t0 and t1."""
        a, b = self.at(t0), self.at(t1)
        span = b[0] - a[0]
        return (b[1] - a[1]) / span, ((b[1] - b[2]) - (a[1] - a[2])) / span

    @property
    def steady(self) -> int:
        """The largest queue of the warm-up's second half (at least 40 runs: 0.1 s at 400/s)."""
        tail = [s[2] for s in self.samples if self.warm / 2 <= s[0] < self.warm]
        return max([40, *tail])

    def peak(self) -> int:
        return max(s[2] for s in self.samples if s[0] >= self.warm)

    def drained_after(self) -> float | None:
        """Seconds from the release until the queue was back to its warm-up level."""
        release = self.warm + self.hold
        for s in self.samples:
            if s[0] >= release and s[2] <= self.steady:
                return s[0] - release
        return None


def offered(admin: Conn, dsn: str, tmp: Path, args: argparse.Namespace, held: bool) -> Offered:
    """--offer runs/s enqueued for warm + hold + after seconds; with `held`, a REPEATABLE READ
    transaction holds its snapshot from the warm-up's end for --hold seconds."""
    res = Offered(held, [], args.warm, args.hold, args.after)
    with (
        psycopg.connect(dsn, autocommit=True) as conn,
        psycopg.connect(dsn, autocommit=True) as holder,
    ):
        reset(conn)
        res.autovacuum = str(conn.execute("SHOW autovacuum").fetchone()[0])  # type: ignore[index]
        with supervisor(admin, dsn, tmp, (), args.log_level):
            start = time.monotonic()
            enqueued, last_sample, holding, released = 0, -1.0, False, False
            end = args.warm + args.hold + args.after
            while (t := time.monotonic() - start) < end:
                if held and not holding and not released and t >= args.warm:
                    holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
                    holder.execute("SELECT count(*) FROM leasework.runs")  # takes the snapshot
                    holding = True
                if holding and t >= args.warm + args.hold:
                    holder.execute("COMMIT")
                    holding, released = False, True
                n = int(args.offer * t) - enqueued
                if n > 0:
                    conn.execute(
                        "INSERT INTO leasework.runs (kind) SELECT 'noop'"
                        " FROM generate_series(1, %s)",
                        (n,),
                    )
                    conn.execute(f"NOTIFY {db.NOTIFY_CHANNEL}, 'noop'")
                    enqueued += n
                if t - last_sample >= 1.0:
                    row = conn.execute(
                        "SELECT (SELECT count(*) FROM leasework.runs WHERE status = 'queued')"
                        "     + (SELECT count(*) FROM leasework.runs WHERE status = 'running')"
                    ).fetchone()
                    assert row is not None
                    res.samples.append((t, enqueued, int(row[0])))
                    last_sample = t
                time.sleep(0.02)  # the offer's pace: 8 runs a step at 400/s
            if holding:
                holder.execute("COMMIT")
    return res


def snapshot_case(args: argparse.Namespace, tmp: Path) -> list[Offered]:
    """The control run (nothing held) and the held snapshot, on a private cluster unless
    --snapshot-dsn names a server."""
    with contextlib.ExitStack() as stack:
        admin_dsn = args.snapshot_dsn or stack.enter_context(private_server())
        name = "leasework_bench_backlog_snapshot"
        dsn = bench_database(admin_dsn, name)
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                db.migrate(conn)
            out = []
            with psycopg.connect(admin_dsn, autocommit=True) as admin:
                for held in (False, True):
                    print(f"  (f) {'held snapshot' if held else 'control'}: "
                          f"{args.warm + args.hold + args.after:.0f} s", flush=True)  # fmt: skip
                    out.append(offered(admin, dsn, tmp, args, held))
        finally:
            drop_database(admin_dsn, name)
    return out


# -- output ------------------------------------------------------------------------------------


def report_cases(results: list[CaseResult], args: argparse.Namespace) -> None:
    tenants = f" (for (c) and (g) over {SMALL_TENANTS} tenants)"
    print(
        f"\nbacklog: {args.runs:,} no-op runs{tenants} drained by `leasework supervise`"
        f" ({PROCESSES} processes), beside {args.backlog:,} queued runs it may not claim and beside"
        f" none, {args.repeat} drain(s) each; drains stopped after {args.drain_timeout:g} s;"
        f" load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores"
    )
    rows = []
    for r in results:
        met = r.ratio >= FLAT_TARGET
        rows.append(
            [r.case.label, fmt_rate(r.backlog), fmt_rate(r.baseline), f"{r.ratio:.2f}",
             f"≥ {FLAT_TARGET:.1f}", "VOID" if r.touched else "met" if met else "NOT MET"]
        )  # fmt: skip
    print_table(
        ["case", "runs/s, backlog", "runs/s, no backlog", "ratio", "target", "verdict"], rows
    )
    for r in results:
        if r.touched:
            print(
                f"WARNING: {r.case.label}: {r.touched:,} backlog runs were claimed; the case is void"
            )
    short = args.quick or args.backlog < 1_000_000
    for r in results:
        backlog, base = med([d.rate for d in r.backlog]), med([d.rate for d in r.baseline])
        partial = [d for d in r.backlog if d.partial]
        notes = f"backlog loaded in {r.loaded:.1f} s; ranges {spread([d.rate for d in r.backlog])}"
        notes += f" / {spread([d.rate for d in r.baseline])}"
        if r.touched:
            notes += f"; VOID: {r.touched:,} backlog runs were claimed"
        if partial:
            notes += (
                f"; {len(partial)} backlog drain(s) stopped after {args.drain_timeout:g} s"
                f" ({', '.join(f'{d.done:,}' for d in partial)} of {args.runs:,} done)"
            )
        record(
            args.results, 1, f"{r.case.label}, {args.backlog:,} queued, {args.runs:,} runs",
            backlog, "runs/s", baseline=base, baseline_label="no backlog", ratio=r.ratio,
            target_text=f"≥ {FLAT_TARGET:.2f} x no backlog", met=r.ratio >= FLAT_TARGET and not r.touched,
            short=short, notes=notes, issue=29,
        )  # fmt: skip


def report_fairness(smalls: list[Small], args: argparse.Namespace, untenanted: bool = False) -> None:
    started = [s for s in smalls if s.claims is not None]
    late = [s for s in smalls if s.claims is None]
    whose = "runs without a tenant" if untenanted else "tenant big"
    print(
        f"\nfairness: {whose} with {args.fair_backlog:,} queued runs being drained, then one"
        f" run each for {SMALL_TENANTS} small tenants; when each small run started"
        f" (claims since its enqueue, its own included)"
    )
    rows: list[list[str]] = []
    if started:
        claims = sorted(s.claims for s in started if s.claims is not None)
        secs = sorted(s.seconds for s in started if s.seconds is not None)
        rows.append(
            [f"started ({len(started)} of {len(smalls)})", f"{claims[0]:,}",
             f"{med(claims):,.0f}", f"{claims[-1]:,}", f"{secs[0]:.2f}", f"{med(secs):.2f}",
             f"{secs[-1]:.2f}"]
        )  # fmt: skip
    if late:
        most = max(s.claims_so_far for s in late)
        rows.append(
            [f"not started within {args.drain_timeout:g} s ({len(late)})", f"> {most:,}", "", "",
             f"> {args.drain_timeout:g}", "", ""]
        )  # fmt: skip
    print_table(["small runs", "claims min", "median", "max", "seconds min", "median", "max"], rows)
    worst = max(
        [s.claims for s in started if s.claims is not None] + [s.claims_so_far + 1 for s in late]
    )
    met = not late and worst <= FAIR_TARGET
    secs = [s.seconds for s in started if s.seconds is not None]
    if untenanted:  # a breakdown row: the target is the tenants' case's
        print(f"last small run started after {worst:,}{'+' if late else ''} claims,"
              f" {max(secs) if secs else float('nan'):.2f} s")  # fmt: skip
        record(
            args.results, 3,
            f"fairness, {args.fair_backlog:,} runs without a tenant, then {SMALL_TENANTS} small"
            " tenants: seconds until the last small run started",
            max(secs) if secs and not late else float("nan"), "s", target_text="breakdown",
            met=None, short=args.quick or args.fair_backlog < 100_000, issue=29,
            notes=f"{len(started)} of {len(smalls)} started; the last after {worst:,} claims",
        )  # fmt: skip
        return
    print(f"last small run started after {worst:,}{'+' if late else ''} claims: target ≤"
          f" {FAIR_TARGET} claims {'met' if met else 'NOT MET'}")  # fmt: skip
    record(
        args.results, 3,
        f"fairness, {args.fair_backlog:,} of one tenant, then {SMALL_TENANTS} small tenants:"
        " claims until the last small run started", worst, "claims",
        target_text=f"each ≤ {FAIR_TARGET} claims after its enqueue", met=met,
        short=args.quick or args.fair_backlog < 100_000, issue=29,
        notes=(f"{len(started)} of {len(smalls)} started within {args.drain_timeout:g} s;"
               + (f" seconds {min(secs):.2f}-{max(secs):.2f} (median {med(secs):.2f})"
                  if secs else "")),
    )  # fmt: skip


def timeline(runs: list[Offered], rows: int = 16) -> None:
    """The queue and the completions over time, both runs side by side (every `step` s)."""
    end = min(r.samples[-1][0] for r in runs)
    step = max(1.0, round(end / rows))
    out = []
    t = 0.0
    while t + step <= end + 1e-9:
        cells = [f"{t:.0f}-{t + step:.0f}"]
        for r in runs:
            phase = "hold" if r.held and r.warm <= t < r.warm + r.hold else ""
            _, done = r.rate(t, t + step)
            cells += [f"{done:,.0f}", f"{r.at(t + step)[2]:,}", phase]
        out.append(cells)
        t += step
    print_table(
        ["t s", "nothing held: completed/s", "queue", "", "held: completed/s", "queue", ""], out
    )


def report_snapshot(runs: list[Offered], args: argparse.Namespace) -> None:
    control, held = runs
    print(
        f"\n(f) held snapshot: {args.offer:g} runs/s offered to `leasework supervise`"
        f" ({PROCESSES} processes), private cluster (autovacuum {held.autovacuum});"
        f" {args.warm:g} s warm-up, a REPEATABLE READ transaction held {args.hold:g} s, then"
        f" {args.after:g} s; beside the same run with nothing held"
    )
    rows = []
    for r in runs:
        t0, t1 = r.warm, r.warm + r.hold
        offer, done = r.rate(t0, t1)
        after = r.drained_after()
        rows.append(
            ["held snapshot" if r.held else "nothing held", f"{offer:,.0f}", f"{done:,.0f}",
             f"{done / offer:.2f}", f"{r.steady:,}", f"{r.peak():,}",
             "not drained" if after is None else f"{after:.0f}"]
        )  # fmt: skip
    print_table(
        ["run", "offered/s", "completed/s", "ratio", "warm-up queue", "largest queue",
         "s to drain after release"], rows,
    )  # fmt: skip
    load = os.getloadavg()
    print(
        f"load average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores"
    )
    timeline(runs)
    offer, done = held.rate(held.warm, held.warm + held.hold)
    ratio = done / offer
    after = held.drained_after()
    met = ratio >= SNAPSHOT_TARGET and after is not None and after <= DRAIN_TARGET
    c_offer, c_done = control.rate(control.warm, control.warm + control.hold)
    print(
        f"held snapshot: {ratio:.2f} x offered (target ≥ {SNAPSHOT_TARGET}), drained"
        f" {'never' if after is None else f'{after:.0f} s'} after the release (target ≤"
        f" {DRAIN_TARGET:g} s): {'met' if met else 'NOT MET'}"
    )
    record(
        args.results, 2,
        f"(f) completions through a {args.hold:g} s held snapshot, {args.offer:g} runs/s offered",
        done, "runs/s", baseline=offer, baseline_label="offered", ratio=ratio,
        target_text=f"≥ {SNAPSHOT_TARGET} x offered, drained ≤ {DRAIN_TARGET:g} s after",
        met=met, short=args.quick or args.hold < 300, issue=29,
        notes=(f"largest queue {held.peak():,} (warm-up {held.steady:,}); drained"
               f" {'never' if after is None else f'{after:.0f} s'} after the release; nothing held:"
               f" {c_done:,.0f} of {c_offer:,.0f}/s, largest queue {control.peak():,};"
               f" autovacuum {held.autovacuum}"),
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dsn", default=DEFAULT_DSN, help="an admin DSN; a bench database is made")
    ap.add_argument("--backlog", type=int, default=1_000_000, help="queued runs of each case")
    ap.add_argument(
        "--runs",
        type=int,
        default=5000,
        help="runs of each measured drain (5,000: a few seconds with no backlog)",
    )
    ap.add_argument("--repeat", type=int, default=2, help="drains with the backlog per case")
    ap.add_argument("--drain-timeout", type=float, default=60.0, help="seconds per drain at most")
    ap.add_argument("--cases", default="a,b,c,d,e,g,fair,fairu", help="of a,b,c,d,e,g,fair,fairu,f")
    ap.add_argument("--fair-backlog", type=int, default=100_000)
    ap.add_argument("--snapshot", action="store_true", help="also (f), the held snapshot")
    ap.add_argument("--snapshot-dsn", help="(f) on this admin DSN, not a private cluster")
    ap.add_argument("--offer", type=float, default=400.0, help="(f): runs/s offered")
    ap.add_argument("--warm", type=float, default=30.0, help="(f): seconds before the hold")
    ap.add_argument("--hold", type=float, default=300.0, help="(f): seconds the snapshot is held")
    ap.add_argument("--after", type=float, default=60.0, help="(f): seconds after the release")
    ap.add_argument("--log-level", help="LEASEWORK_LOG_LEVEL of the supervisor (default: its own)")
    ap.add_argument(
        "--quick", action="store_true",
        help="20,000-run backlogs, 1,000-run drains, 1 drain each, 30 s drains; (f): 30 s held",
    )  # fmt: skip
    results_arg(ap)
    args = ap.parse_args()
    cases = set(args.cases.split(","))
    if args.snapshot:
        cases.add("f")
    if unknown := cases - {"a", "b", "c", "d", "e", "g", "fair", "fairu", "f"}:
        ap.error(f"unknown case(s) {', '.join(sorted(unknown))}; valid: a,b,c,d,e,g,fair,fairu,f")
    if args.quick:
        args.backlog, args.runs = min(args.backlog, 20_000), min(args.runs, 1000)
        args.repeat, args.drain_timeout = 1, min(args.drain_timeout, 30.0)
        args.fair_backlog = min(args.fair_backlog, 20_000)
        args.warm, args.hold, args.after = 10.0, 30.0, 30.0

    name = "leasework_bench_backlog"
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        (tmp / "backlog_app.py").write_text(APP)
        results: list[CaseResult] = []
        smalls: list[Small] = []
        smalls_u: list[Small] = []
        if cases - {"f"}:
            dsn = bench_database(args.dsn, name)
            try:
                with (
                    psycopg.connect(args.dsn, autocommit=True) as admin,
                    psycopg.connect(dsn, autocommit=True) as conn,
                ):
                    db.migrate(conn)
                    for case in CASES:
                        if case.key in cases:
                            results.append(run_case(admin, conn, dsn, tmp, case, args))
                    if "fair" in cases:
                        smalls = fairness(admin, conn, dsn, tmp, args)
                    if "fairu" in cases:
                        smalls_u = fairness(admin, conn, dsn, tmp, args, big=None)
            finally:
                drop_database(args.dsn, name)
        snapshot = snapshot_case(args, tmp) if "f" in cases else []
    if results:
        report_cases(results, args)
    if smalls:
        report_fairness(smalls, args)
    if smalls_u:
        report_fairness(smalls_u, args, untenanted=True)
    if snapshot:
        report_snapshot(snapshot, args)


if __name__ == "__main__":
    main()
